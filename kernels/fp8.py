"""FP8 blockwise quantization in registers, shared by dispatch's encode and `fused_silu_fp8`.

Per 128-element block: `s = max(amax, 1e-4) / 448`, `q = clamp(x / s, +-448)` (a true fp32
division), then e4m3. The max and the clamp propagate NaN: a NaN anywhere in a block makes its
scale and every code NaN, as the reference's torch max / clamp do (a plain fmax would drop it).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4


@cute.jit
def scale_fp8_block(vals: cute.Tensor, n: cutlass.Constexpr, lanes: cutlass.Constexpr) -> Float32:
    """`vals`: this thread's `n` fp32 values of a block shared by `lanes` consecutive lanes (a
    power of two). Divides them in place by the block's scale and clamps them to +-448; returns
    the scale."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, cute.arch.fmax(vals[i], -vals[i], nan=True), nan=True)
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=lanes >> (i + 1)),
                              nan=True)
    scale = cute.arch.fmax(amax, Float32(FP8_MIN_AMAX), nan=True) / Float32(FP8_MAX)
    for i in cutlass.range_constexpr(n):
        vals[i] = cute.arch.fmin(cute.arch.fmax(vals[i] / scale, Float32(-FP8_MAX), nan=True),
                                 Float32(FP8_MAX), nan=True)
    return scale
