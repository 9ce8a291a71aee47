"""Training through dispatch and combine: both as autograd functions over a `Buffer`.

    rows, out = cute_ep.autograd.dispatch(buf, x, topk_ids, topk_weights)
    y = experts(rows, out.row_offsets)           # any differentiable torch code, bf16 [rows, H]
    z = cute_ep.autograd.combine(buf, y, out)    # bf16 [T, H]
    z.sum().backward()                           # fills x.grad and topk_weights.grad

`rows` is bf16 `[row_capacity, H]` in the dispatch's row order (for an FP8 Buffer: the rows the
expert GEMM sees, codes times their block scales). Every rank runs the same layer, so every
rank's backward issues the same collectives in the same order.

The backward passes are the transport run the other way:

- combine: the gradient of expert row (t, k) is `w[t, k] * grad_z[t]` (the shared expert's
  row: `grad_z[t]`), which is a BF16 dispatch of `grad_z` with the same routing (the same
  messages in the same order, so each of its rows is matched to the forward row of the same
  (source, message, k)), scaled by the row's weight. The weights' gradient
  `grad_w[t, k] = <grad_z[t], y[row of (t, k)]>` needs the expert rows at home: an unreduced
  combine of `y` brings each (t, k)'s row back, and the dot runs in fp32.
- dispatch: a row is a copy of its token, so `grad_x[t]` is the sum of the gradients of t's
  rows: the combine of the row gradients with every weight 1 (bf16 partial sums per rank,
  added in fp32 at home and rounded once, as a forward combine). FP8 rows pass the gradient
  straight through the quantization (d rows / d x taken as 1).

The backward dispatch needs a BF16 Buffer: `buf` itself when it is one, else `backward=`, a
Buffer of the same config in format "bf16" (same group, same SM budget). NVFP4 layers and
layers without `topk_weights` (no reduced combine to differentiate) are refused.
"""

from __future__ import annotations

import dataclasses

import torch

from cute_ep.ep import Buffer, DispatchHandle, DispatchOutput

@dataclasses.dataclass
class _Layer:
    """What the backward passes need from a forward dispatch."""

    buf: Buffer
    backward: Buffer
    out: DispatchOutput
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int
    skip_a2a: bool
    num_input_tokens: int | None


def _backward_buffer(buf: Buffer, backward: Buffer | None) -> Buffer:
    if buf.cfg.format == "nvfp4":
        raise NotImplementedError("autograd through an nvfp4 dispatch is not supported (its rows "
                                  "are e2m1 codes): train with a bf16 or fp8 Buffer")
    if backward is None:
        if buf.cfg.format != "bf16":
            raise ValueError(f"a {buf.cfg.format} Buffer's backward needs a bf16 dispatch: pass "
                             f"backward=Buffer(dataclasses.replace(cfg, format='bf16'), ...)")
        return buf
    want = dataclasses.replace(buf.cfg, format="bf16")
    if backward.cfg != want:
        raise ValueError(f"backward Buffer must have config {want}, got {backward.cfg}")
    if backward.sms != buf.sms or backward.rank != buf.rank:
        raise ValueError(f"backward Buffer must match the forward one's rank and SM budget "
                         f"(rank {buf.rank}, sms={buf.sms}); got rank {backward.rank}, "
                         f"sms={backward.sms}")
    return backward


def _rows_of(out: DispatchOutput, fmt: str) -> torch.Tensor:
    """The dispatch's rows as bf16 values: the tokens, or FP8 codes times their block scales."""
    if fmt == "bf16":
        return out.tokens
    codes = out.tokens.float()
    scales = out.scales.t().repeat_interleave(128, dim=1)  # [row_capacity, H]
    return (codes * scales).to(torch.bfloat16)


def _handle_with(handle: DispatchHandle, **fields) -> DispatchHandle:
    """A copy of `handle` with some fields replaced (the rest still read from its memory)."""
    copy = DispatchHandle.__new__(DispatchHandle)
    copy.__dict__.update(handle.__dict__)
    copy.__dict__.update(fields)
    return copy


def _matched_rows(fwd: DispatchOutput, bwd: DispatchOutput):
    """(forward row, backward row, weight) of every routed (source, message, k): both
    dispatches received the same messages in the same order (same ids, same channels)."""
    f, b = fwd.handle, bwd.handle
    messages = f.messages.long()
    m = torch.arange(f.rows.shape[1], device=messages.device)
    live = (m[None, :] < messages[:, None])[:, :, None] & (f.rows >= 0)
    return f.rows[live].long(), b.rows[live].long(), f.weights[live]


def _shared_rows(out: DispatchOutput) -> torch.Tensor:
    """Rows of the fused shared expert's segment (segment 0, in token order)."""
    count = int(out.counts[0])
    return torch.arange(count, device=out.counts.device) + out.row_offsets[0].long()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, layer: _Layer):
        ctx.layer = layer
        return _rows_of(layer.out, layer.buf.cfg.format)

    @staticmethod
    def backward(ctx, grad_rows):
        layer = ctx.layer
        h = layer.out.handle
        ones = _handle_with(h, weights=torch.ones_like(h.weights))
        grad_x = layer.buf.combine(grad_rows.to(torch.bfloat16).contiguous(), ones)
        return grad_x, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_weights, layer: _Layer):
        ctx.layer = layer
        ctx.save_for_backward(y)
        return layer.buf.combine(y.contiguous(), layer.out.handle)

    @staticmethod
    def backward(ctx, grad_z):
        layer = ctx.layer
        (y,) = ctx.saved_tensors
        cfg = layer.buf.cfg
        grad_z = grad_z.to(torch.bfloat16).contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            back = layer.backward.dispatch(grad_z, layer.topk_ids, layer.topk_weights,
                                           skip_a2a=layer.skip_a2a,
                                           num_input_tokens=layer.num_input_tokens)
            rows_f, rows_b, w = _matched_rows(layer.out, back)
            acc = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
            acc[rows_f] = back.tokens[rows_b].float() * w[:, None]
            if cfg.fused_shared_expert:  # its rows are unweighted copies of grad_z
                acc[_shared_rows(layer.out)] = back.tokens[_shared_rows(back)].float()
            grad_y = acc.to(y.dtype)
        if ctx.needs_input_grad[1]:
            h = layer.out.handle
            unreduced = _handle_with(h, routing=dataclasses.replace(h.routing, weighted=False))
            slots = layer.buf.combine(y.detach().contiguous(), unreduced)  # [T, K, H]
            grad_w = (slots.float() * grad_z.float()[:, None, :]).sum(-1)
            grad_w = grad_w.to(layer.topk_weights.dtype)
        return grad_y, grad_w, None


def dispatch(buf: Buffer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             *, skip_a2a: bool = False, num_input_tokens: int | None = None,
             backward: Buffer | None = None) -> tuple[torch.Tensor, DispatchOutput]:
    """`buf.dispatch` with gradients: (bf16 rows [row_capacity, H], differentiable in `x`, and
    the DispatchOutput to pass to `combine`). `backward`: the bf16 Buffer of an fp8 layer."""
    if topk_weights is None:
        raise ValueError("autograd dispatch needs topk_weights (the combine it pairs with is "
                         "the weighted one)")
    back = _backward_buffer(buf, backward)
    out = buf.dispatch(x.detach(), topk_ids, topk_weights.detach(), skip_a2a=skip_a2a,
                       num_input_tokens=num_input_tokens)
    layer = _Layer(buf, back, out, out.handle.routing.topk_ids, topk_weights.detach(),
                   x.shape[0], skip_a2a, num_input_tokens)
    out.__dict__["_autograd"] = (layer, topk_weights)
    return _Dispatch.apply(x, topk_weights, layer), out


def combine(buf: Buffer, y: torch.Tensor, out: DispatchOutput) -> torch.Tensor:
    """`buf.combine` with gradients in `y` and in the `topk_weights` given to the autograd
    `dispatch` that made `out`: bf16 [T, H]."""
    state = out.__dict__.get("_autograd")
    if state is None:
        raise ValueError("combine with gradients needs the output of cute_ep.autograd.dispatch")
    layer, topk_weights = state
    if layer.buf is not buf:
        raise ValueError("combine must run on the Buffer that dispatched `out`")
    if y.dtype != torch.bfloat16:
        raise TypeError(f"expert outputs must be bf16, got {y.dtype}")
    return _Combine.apply(y, topk_weights, layer)
