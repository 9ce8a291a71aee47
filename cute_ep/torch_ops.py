"""cute-ep's calls as `torch.library` custom operators (namespace `cute_ep`), so they work inside
`torch.compile(fullgraph=True)` and CUDA graphs.

Each operator runs the same code as the eager function (`cute_ep.silu`, `cute_ep.quant`,
`cute_ep.ep.Buffer`) and has a fake (meta) implementation that gives the output shapes and
dtypes from the input shapes alone, so tracing never touches the device or the host's copy of
the data. Dispatch and combine name their Buffer by `Buffer.op_id`; they act on the Buffer's
peer-visible memory, so they are registered as side-effecting (never dropped or reordered by
the compiler). The dependency runs one way: `cute_ep.ep` imports this module and registers
each Buffer in `register_buffer`'s table, where the operators find it by id; nothing here
imports `cute_ep.ep`.

The public functions (`cute_ep.fused_silu`, ..., `cute_ep.dispatch`, `cute_ep.combine`) call
these operators; `torch.ops.cute_ep.<name>` is the raw form.
"""

from __future__ import annotations

import weakref

import torch
from torch.fx.node import has_side_effect
from torch.library import custom_op

from cute_ep.quant import fp4_scale_bytes, fp4_scale_rows, segment_count

_VECTOR = {"nvfp4": 16, "mxfp4": 32}
_BUFFERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next_id = [0]


def register_buffer(buf) -> int:
    """A process-unique id for `buf`, the handle the dispatch / combine operators take."""
    _next_id[0] += 1
    _BUFFERS[_next_id[0]] = buf
    return _next_id[0]


def _buffer(op_id: int):
    buf = _BUFFERS.get(op_id)
    if buf is None:
        raise ValueError(f"no live cute_ep Buffer has op_id {op_id}")
    return buf


def _fp4_silu_outputs(x, row_offsets, scale_rows, vector):
    """Fake (codes, scales) of an FP4 fused SwiGLU of x [M, 2I]."""
    m, i = x.shape[0], x.shape[1] // 2
    rows = fp4_scale_rows(m, segment_count(row_offsets), scale_rows)
    return (x.new_empty(m, i // 2, dtype=torch.uint8),
            x.new_empty(fp4_scale_bytes(rows, i, vector), dtype=torch.uint8))


# Fused SwiGLU and quantization ----------------------------------------------------------------


@custom_op("cute_ep::fused_silu", mutates_args=())
def fused_silu(x: torch.Tensor, row_offsets: torch.Tensor | None,
               interleaved: bool) -> torch.Tensor:
    from cute_ep import silu

    return silu.fused_silu(x, row_offsets, interleaved=interleaved)


@fused_silu.register_fake
def _(x, row_offsets, interleaved):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@custom_op("cute_ep::fused_silu_fp8", mutates_args=())
def fused_silu_fp8(x: torch.Tensor, row_offsets: torch.Tensor | None,
                   interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from cute_ep import silu

    return silu.fused_silu_fp8(x, row_offsets, interleaved=interleaved)


@fused_silu_fp8.register_fake
def _(x, row_offsets, interleaved):
    m, i = x.shape[0], x.shape[1] // 2
    return (x.new_empty(m, i, dtype=torch.float8_e4m3fn),
            x.new_empty(i // 128, m, dtype=torch.float32))


@custom_op("cute_ep::fused_silu_nvfp4", mutates_args=())
def fused_silu_nvfp4(x: torch.Tensor, input_scales: torch.Tensor,
                     row_offsets: torch.Tensor | None, interleaved: bool,
                     scale_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from cute_ep import silu

    return silu.fused_silu_nvfp4(x, input_scales, row_offsets, interleaved=interleaved,
                                 scale_rows=scale_rows)


@fused_silu_nvfp4.register_fake
def _(x, input_scales, row_offsets, interleaved, scale_rows):
    return _fp4_silu_outputs(x, row_offsets, scale_rows, _VECTOR["nvfp4"])


@custom_op("cute_ep::fused_silu_mxfp4", mutates_args=())
def fused_silu_mxfp4(x: torch.Tensor, row_offsets: torch.Tensor | None, interleaved: bool,
                     swiglu_limit: float | None, swiglu_alpha: float,
                     scale_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from cute_ep import silu

    return silu.fused_silu_mxfp4(x, row_offsets, interleaved=interleaved,
                                 swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                                 scale_rows=scale_rows)


@fused_silu_mxfp4.register_fake
def _(x, row_offsets, interleaved, swiglu_limit, swiglu_alpha, scale_rows):
    return _fp4_silu_outputs(x, row_offsets, scale_rows, _VECTOR["mxfp4"])


@custom_op("cute_ep::quantize_nvfp4", mutates_args=())
def quantize_nvfp4(x: torch.Tensor, global_scales: torch.Tensor,
                   row_offsets: torch.Tensor | None, scales: str,
                   scale_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from cute_ep import quant

    return quant.quantize_nvfp4(x, global_scales, row_offsets, scales=scales,
                                scale_rows=scale_rows)


@quantize_nvfp4.register_fake
def _(x, global_scales, row_offsets, scales, scale_rows):
    m, k = x.shape
    if scales == "linear":
        sf = x.new_empty(m, k // 16, dtype=torch.uint8)
    else:
        rows = fp4_scale_rows(m, segment_count(row_offsets), scale_rows)
        sf = x.new_empty(fp4_scale_bytes(rows, k, _VECTOR["nvfp4"]), dtype=torch.uint8)
    return x.new_empty(m, k // 2, dtype=torch.uint8), sf


# Dispatch and combine -------------------------------------------------------------------------

DISPATCH_FIELDS = ("tokens", "scales", "row_offsets", "expert_ids", "src_info", "counts",
                    "scales_offsets", "rows", "weights", "source_tokens", "messages", "channels")


@custom_op("cute_ep::dispatch", mutates_args=())
def dispatch(op_id: int, x: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor | None, skip_a2a: bool, num_input_tokens: int | None,
             global_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """`Buffer.dispatch` of Buffer `op_id`: the DispatchOutput's tensors and its handle's, in
    `DISPATCH_FIELDS` order (an absent `scales` / `scales_offsets` is an empty tensor)."""
    out = _buffer(op_id).dispatch_for_operator(x, topk_ids, topk_weights, skip_a2a,
                                               num_input_tokens, global_scale)
    empty = x.new_empty(0, dtype=torch.int32)
    h = out.handle
    return [out.tokens, out.scales if out.scales is not None else empty.float(),
            out.row_offsets, out.expert_ids, out.src_info, out.counts,
            out.scales_offsets if out.scales_offsets is not None else empty,
            h.rows, h.weights, h.tokens, h.messages, h.channels]


@dispatch.register_fake
def _(op_id, x, topk_ids, topk_weights, skip_a2a, num_input_tokens, global_scale):
    return [x.new_empty(shape, dtype=dtype) for shape, dtype in _buffer(op_id).output_shapes()]


@custom_op("cute_ep::combine", mutates_args=())
def combine(op_id: int, y: torch.Tensor, topk_ids: torch.Tensor, rows: torch.Tensor,
            weights: torch.Tensor, channels: torch.Tensor, weighted: bool, skip_a2a: bool,
            active: int) -> torch.Tensor:
    """`Buffer.combine` of Buffer `op_id` for the dispatch whose handle tensors are given
    (`active`: the channels that dispatch used)."""
    buf = _buffer(op_id)
    return buf.combine(y, buf.handle_of(topk_ids, rows, weights, channels, weighted, skip_a2a,
                                        active))


@combine.register_fake
def _(op_id, y, topk_ids, rows, weights, channels, weighted, skip_a2a, active):
    t, k = topk_ids.shape
    shape = (t, y.shape[1]) if weighted else (t, k, y.shape[1])
    return y.new_empty(shape, dtype=torch.bfloat16)


for _op in (torch.ops.cute_ep.dispatch.default, torch.ops.cute_ep.combine.default):
    has_side_effect(_op)
