"""The fused SwiGLU kernels in plain torch: the definitions the kernels are tested against.

Written from SPEC section 5, independently of the kernels. Input `[M, 2I]` bf16, gate and up as
halves or interleaved (`layouts.swiglu`); rows grouped in segments by `row_offsets` (a list), of
which only rows below `row_offsets[-1]` exist. The activation is in fp32, operation by operation
in this order (divisions are tensor divisions, correctly rounded on every device):

- silu: `z = (g / (1 + exp(-g))) * u`;
- swiglu_oai (limit L, alpha a): `g' = min(g, L)`, `u' = clamp(u, -L, L)`,
  `z = (u' + 1) * (g' * (1 / (1 + exp(-(a * g')))))`.

`exp` is torch's: on CUDA the CUDA math library's `expf`, the routine the kernels call, so the
GPU tests compare bit for bit; on the CPU it may differ from it in the last bit.
Outputs: bf16 `z`; FP8 blockwise (`cute_ep.reference.quantize_fp8_blockwise`, scales transposed);
NVFP4 with one global scale per segment and MXFP4 (`cute_ep.reference.fp4`), scales in the 128x4
layout with every segment on a fresh 128-row block.
"""

from __future__ import annotations

import torch

from cute_ep.reference import fp4
from cute_ep.reference.ep import quantize_fp8_blockwise
from layouts.swiglu import swiglu_views


def gate_up(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (gate, up) [M, I] of a `[M, 2I]` input, through `layouts.swiglu`'s views."""
    m, width = x.shape
    if width % 2:
        raise ValueError(f"the input must be [M, 2I], got {tuple(x.shape)}")
    gate, up = swiglu_views(m, width // 2, interleaved)
    flat = x.float().reshape(-1)
    return (flat.as_strided((m, width // 2), gate.layout.stride, gate.offset),
            flat.as_strided((m, width // 2), up.layout.stride, up.offset))


def silu_mul(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    g, u = gate_up(x, interleaved)
    one = torch.ones_like(g)
    return (g / (one + torch.exp(-g))) * u


def swiglu_oai(x: torch.Tensor, interleaved: bool = False, limit: float = 7.0,
               alpha: float = 1.702) -> torch.Tensor:
    g, u = gate_up(x, interleaved)
    lim = torch.full_like(g, limit)
    g = torch.where(g > lim, lim, g)
    u = torch.where(u > lim, lim, torch.where(u < -lim, -lim, u))
    one = torch.ones_like(g)
    sig = one / (one + torch.exp(-(torch.full_like(g, alpha) * g)))
    return (u + one) * (g * sig)


def activation(x: torch.Tensor, offsets: list[int], interleaved: bool,
               swiglu_limit: float | None, swiglu_alpha: float) -> torch.Tensor:
    """fp32 `z` of the valid rows."""
    rows = x[:offsets[-1]]
    if swiglu_limit is None:
        return silu_mul(rows, interleaved)
    return swiglu_oai(rows, interleaved, swiglu_limit, swiglu_alpha)


def fused_silu(x, offsets, interleaved=False) -> torch.Tensor:
    """bf16 [rows, I]."""
    return activation(x, offsets, interleaved, None, 0.0).to(torch.bfloat16)


def fused_silu_fp8(x, offsets, interleaved=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [rows, I], fp32 scales [I / 128, rows])."""
    q, scales = quantize_fp8_blockwise(activation(x, offsets, interleaved, None, 0.0))
    return q, scales.t()


def fused_silu_nvfp4(x, offsets, input_scales, scale_rows, interleaved=False):
    """(codes [rows, I / 2], 128x4 e4m3 scales for `scale_rows` rows); segment g quantized with
    global scale `input_scales[g]`."""
    z = activation(x, offsets, interleaved, None, 0.0)
    return fp4.quantize_nvfp4_segments(z, offsets, input_scales, scale_rows)


def fused_silu_mxfp4(x, offsets, scale_rows, interleaved=False, swiglu_limit=None,
                     swiglu_alpha=1.702):
    """(codes [rows, I / 2], 128x4 e8m0 scales for `scale_rows` rows)."""
    z = activation(x, offsets, interleaved, swiglu_limit, swiglu_alpha)
    return fp4.quantize_mxfp4_segments(z, offsets, scale_rows)
