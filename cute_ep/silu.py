"""The fused SwiGLU kernels on torch tensors: `silu(gate) * up` of expert activations, quantized.

Every function takes `x: bf16 [M, 2I]` (`[gate | up]`, or interleaved `gate_i, up_i` with
`interleaved=True`) and `row_offsets: int32 [S + 1]` on the device (dispatch output's segment
boundaries; None: one segment of all M rows). Only rows below `row_offsets[S]` are read and
written, so M may be a capacity and nothing waits for the host; output rows past the valid ones
are left as allocated (uninitialised). See `kernels/silu.py` for the exact fp32 arithmetic and
`cute_ep.reference.silu` for its plain-torch definition.
"""

from __future__ import annotations

import torch

from cute_ep.quant import (E2M1_OF_ARCH, check_scale_rows, check_work_items, fp4_scale_bytes,
                           fp4_scale_rows, per_segment_scales, segment_offsets, sm_count)
from cute_ep.runtime.launch import check_tensor, device_arch, runtime

__all__ = ["fused_silu", "fused_silu_fp8", "fused_silu_nvfp4", "fused_silu_mxfp4"]

_VECTOR = {"bf16": 8, "fp8": 128, "nvfp4": 16, "mxfp4": 32, "fp32": 8}
_FAMILY = {"bf16": "fused_silu", "fp8": "fused_silu_fp8", "nvfp4": "fused_silu_nvfp4",
           "mxfp4": "fused_silu_mxfp4", "fp32": "fused_silu_fp32"}
_GRID_PER_SM = 8
_TABLE_THREADS = 1024  # the gate-table kernels' CTA size, one CTA per SM
# Kernel layouts (`_layout`) as config fields of the quantized outputs. "table" is the pair
# table for FP4 and the value table for FP8 and fp32; "pairs" (fp32 only, for the tests) the
# pair table.
_LAYOUTS = {"thread": {"rows_per_warp": False, "table": False},
            "warp": {"rows_per_warp": True, "table": False},
            "table": {"rows_per_warp": True, "table": True},
            "pairs": {"rows_per_warp": True, "table": True}}


def fused_silu(x: torch.Tensor, row_offsets: torch.Tensor | None = None, *,
               interleaved: bool = False) -> torch.Tensor:
    """bf16 [M, I]."""
    if torch.compiler.is_compiling():
        return torch.ops.cute_ep.fused_silu(x, row_offsets, bool(interleaved))
    row_offsets, _ = _prepare("bf16", x, row_offsets)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.bfloat16, device=x.device)
    _launch("bf16", x, row_offsets, interleaved, out.view(torch.uint8))
    return out


def fused_silu_fp8(x: torch.Tensor, row_offsets: torch.Tensor | None = None, *,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, I], fp32 scales transposed [I / 128, M]): per 128 elements
    `s = max(amax, 1e-4) / 448`, `q = e4m3(clamp(z / s, +-448))`. I must be a multiple of 128."""
    if torch.compiler.is_compiling():
        return torch.ops.cute_ep.fused_silu_fp8(x, row_offsets, bool(interleaved))
    row_offsets, _ = _prepare("fp8", x, row_offsets)
    m, i = x.shape[0], x.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(i // 128, m, dtype=torch.float32, device=x.device)
    _launch("fp8", x, row_offsets, interleaved, out.view(torch.uint8), scales.view(torch.uint8),
            scale_stride=m)
    return out, scales


def fused_silu_nvfp4(x: torch.Tensor, input_scales: torch.Tensor | float,
                     row_offsets: torch.Tensor | None = None, *, interleaved: bool = False,
                     scale_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [M, I / 2], e4m3 scales uint8 in the 128x4 layout of `layouts.scales`).

    input_scales: fp32 [S] (or one number), segment g's global scale `gs`:
    `sf = e4m3(gs * amax / 6)`, `q = e2m1(z * gs / sf)` per 16 elements. Each segment's scales
    start on a fresh 128-row block; the buffer holds `scale_rows` rows (default M + 128 S; fewer
    are checked against row_offsets, which makes the host wait for the device) and the padding
    of every used block is zero.
    """
    if torch.compiler.is_compiling():
        return torch.ops.cute_ep.fused_silu_nvfp4(
            x, per_segment_scales(input_scales, row_offsets, x.device), row_offsets,
            bool(interleaved), scale_rows)
    row_offsets, segments = _prepare("nvfp4", x, row_offsets)
    input_scales = per_segment_scales(input_scales, row_offsets, x.device)
    check_tensor(input_scales, name="input_scales", dtype="float32", align=4,
                 device_index=x.device.index)
    if input_scales.numel() != segments:
        raise ValueError(f"input_scales has {input_scales.numel()} entries for {segments} "
                         f"segments")
    return _fp4("nvfp4", x, row_offsets, interleaved, scale_rows, input_scales=input_scales)


def fused_silu_mxfp4(x: torch.Tensor, row_offsets: torch.Tensor | None = None, *,
                     interleaved: bool = False, swiglu_limit: float | None = None,
                     swiglu_alpha: float = 1.702,
                     scale_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [M, I / 2], e8m0 scales uint8 in the 128x4 layout).

    Scale per 32 elements: the smallest power of two >= amax / 6 (round-up), so no element
    saturates because of its scale. swiglu_limit: None for `silu(g) * u`; a positive number L for
    the clamped SwiGLU-OAI `(clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g')`, `g' = min(g, L)`.
    """
    if torch.compiler.is_compiling():
        return torch.ops.cute_ep.fused_silu_mxfp4(
            x, row_offsets, bool(interleaved),
            None if swiglu_limit is None else float(swiglu_limit), float(swiglu_alpha),
            scale_rows)
    row_offsets, _ = _prepare("mxfp4", x, row_offsets)
    oai = None
    if swiglu_limit is not None:
        if not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {swiglu_limit}")
        oai = (float(swiglu_limit), float(swiglu_alpha))
    return _fp4("mxfp4", x, row_offsets, interleaved, scale_rows, swiglu_oai=oai)


def _fp4(out_format, x, row_offsets, interleaved, scale_rows, **extra):
    m, i = x.shape[0], x.shape[1] // 2
    rows = fp4_scale_rows(m, row_offsets.numel() - 1, scale_rows)
    if rows < 1:
        raise ValueError(f"scale_rows must be positive, got {scale_rows}")
    check_scale_rows(scale_rows, m, row_offsets)
    codes = torch.empty(m, i // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(fp4_scale_bytes(rows, i, _VECTOR[out_format]), dtype=torch.uint8,
                         device=x.device)
    _launch(out_format, x, row_offsets, interleaved, codes, scales, work_rows=rows, **extra)
    return codes, scales


def _prepare(out_format, x, row_offsets) -> tuple[torch.Tensor, int]:
    """Check `x` for this output and `row_offsets` (None: one segment of all rows), once per
    call; returns (row_offsets on the device, number of segments)."""
    check_tensor(x, name="x", dtype="bfloat16", align=16)
    vector = _VECTOR[out_format]
    if x.dim() != 2 or x.shape[1] % (2 * vector):
        raise ValueError(f"x must be bf16 [M, 2I] with I a multiple of {vector} for "
                         f"{_FAMILY[out_format]}, got {tuple(x.shape)}")
    check_work_items(x.shape[0], x.shape[1] // (2 * vector), _FAMILY[out_format])
    return segment_offsets(row_offsets, x.shape[0], x.device)


def _layout(rows: int, sms: int) -> str:
    """The quantized kernels' layout for `rows` (scale rows for FP4): "table" once every warp of
    a CTA-per-SM grid has a row (a gate table per CTA, copied in once, in place of an `expf` and a
    division per element; FP4 with a warp per scale row, a lane or a lane pair per block), else
    "thread" (a thread per block, the activation by the formula): a warp walking a whole row
    leaves the GPU idle on small inputs (measured at base clocks, H200, I = 7168: 256 rows
    53 us a warp per row, 14 us a thread per block). "warp" (a warp per row without the table)
    stays in the library for tests."""
    return "table" if rows >= sms * _TABLE_THREADS // 32 else "thread"


_PLACEHOLDERS: dict = {}
# (device index, swiglu_oai's (limit, alpha) or None for silu) -> (activation_params,
# gate_table): built once and kept; past _MAX_GATES distinct ones, each call builds its own.
_GATES: dict = {}
_MAX_GATES = 64
_BUILD_STREAMS: dict = {}
_COUNTERS: dict = {}
_MAX_COUNTERS = 64


def _pool_counters(device: torch.device, ints: int) -> torch.Tensor:
    """The FP4 stream kernels' pool counters (`ints` int32, the kernel's
    `sizes["counter_ints"]`; `FusedSilu._fp4_stream`): zero between launches (each launch's
    last CTA sets them back), one set per stream, since launches that share a set must not
    overlap. Under CUDA graph capture a fresh set, zeroed inside the graph, so a replay never
    shares one with another stream's launches; past _MAX_COUNTERS streams, a fresh set per
    call."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(ints, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    got = _COUNTERS.get(key)
    if got is None:
        got = torch.zeros(ints, dtype=torch.int32, device=device)
        if len(_COUNTERS) < _MAX_COUNTERS:
            _COUNTERS[key] = got
    return got


def _placeholder(device: torch.device) -> torch.Tensor:
    """A tensor for the pointer parameters a kernel configuration never reads."""
    got = _PLACEHOLDERS.get(device.index)
    if got is None:
        got = torch.empty(4, dtype=torch.float32, device=device)
        if not torch.cuda.is_current_stream_capturing():  # kept only outside a graph's pool
            _PLACEHOLDERS[device.index] = got
    return got


def _gate_inputs(device: torch.device, swiglu_oai) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation_params, gate_table) of the activation: fp32 (limit, alpha) (the placeholder
    for silu) and the gate tables of `kernels.gate_table` (96 KB, built by the `gate_table`
    kernel). The first call of a device and activation builds them on a stream of their own and
    waits for that one small kernel, so every stream may read them from then on; under CUDA
    graph capture a miss builds them on the capturing stream instead, part of the graph."""
    key = (device.index, swiglu_oai)
    got = _GATES.get(key)
    if got is not None:
        return got
    if torch.cuda.is_current_stream_capturing() or len(_GATES) >= _MAX_GATES:
        return _build_gate(device, swiglu_oai)
    stream = _BUILD_STREAMS.get(device.index)
    if stream is None:
        stream = _BUILD_STREAMS[device.index] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        got = _build_gate(device, swiglu_oai)
    stream.synchronize()
    _GATES[key] = got
    return got


def _build_gate(device, swiglu_oai) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = runtime().select("gate_table", device,
                              activation="silu" if swiglu_oai is None else "swiglu_oai")
    params = _placeholder(device)
    if swiglu_oai is not None:
        # Filled on the device (no host-to-device copy, so the build can be graph-captured).
        params = torch.full((2,), swiglu_oai[0], dtype=torch.float32, device=device)
        params[1:].fill_(swiglu_oai[1])
    table = torch.empty(kernel.spec.sizes["floats"], dtype=torch.float32, device=device)
    kernel.launch(params, table)
    return params, table


def _launch(out_format, x, row_offsets, interleaved, out, scales=None, *, input_scales=None,
            swiglu_oai=None, scale_stride=0, work_rows=None):
    """Launch on arguments `_prepare` checked and the caller allocated; `swiglu_oai`: the
    clamped activation's (limit, alpha), None for silu."""
    device = x.device
    m, i = x.shape[0], x.shape[1] // 2
    segments = row_offsets.numel() - 1
    fields = {"interleaved": bool(interleaved),
              "activation": "silu" if swiglu_oai is None else "swiglu_oai"}
    sms = sm_count(device)
    layout = "thread"
    if out_format != "bf16":
        layout = _layout(work_rows or m, sms)
        fields["table"] = _LAYOUTS[layout]["table"]
        if fields["table"] and out_format in ("fp8", "fp32"):
            fields["values"] = layout != "pairs"
    if out_format in ("nvfp4", "mxfp4"):
        fields["e2m1"] = E2M1_OF_ARCH[device_arch(device)]
        fields["rows_per_warp"] = _LAYOUTS[layout]["rows_per_warp"]
    kernel = runtime().select(_FAMILY[out_format], device, **fields)
    if segments > kernel.spec.sizes["max_segments"]:
        raise ValueError(f"at most {kernel.spec.sizes['max_segments']} segments, got {segments}")
    placeholder = _placeholder(device)
    params, table = placeholder, placeholder
    if swiglu_oai is not None or _LAYOUTS[layout]["table"]:
        params, table = _gate_inputs(device, swiglu_oai)
    items = -(-((work_rows or m) * i) // kernel.spec.sizes["vector"])
    per_sm = 1 if _LAYOUTS[layout]["table"] else _GRID_PER_SM
    grid = max(1, min(-(-items // kernel.spec.block[0]), per_sm * sms))
    counters = placeholder.view(torch.int32)
    if out_format in ("nvfp4", "mxfp4") and _LAYOUTS[layout]["table"]:
        counters = _pool_counters(device, kernel.spec.sizes["counter_ints"])
    kernel.launch(x, row_offsets, placeholder if input_scales is None else input_scales,
                  params, table, out,
                  placeholder.view(torch.uint8) if scales is None else scales, counters,
                  segments, i, scale_stride, grid)
