"""FP8 blockwise quantization in registers, shared by dispatch's encode and `fused_silu_fp8`.

Per 128-element block: `s = max(amax, 1e-4) / 448`, `q = clamp(x / s, +-448)` (a correctly
rounded fp32 division), then e4m3. The max and the clamp propagate NaN: a NaN anywhere in a block
makes its scale and every code NaN, as the reference's torch max / clamp do (a plain fmax would
drop it).

The division is `kernels.division.divide_twice` with one reciprocal per block (the quotient bit for
bit, its sign from x) while amax <= FAST_LIMIT; a block with a larger, infinite or NaN amax
divides with `/`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from kernels.division import FAST_LIMIT, divide_twice, with_sign_of

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
    if amax <= Float32(FAST_LIMIT):
        r = Float32(1.0) / scale
        for i in cutlass.range_constexpr(n):
            vals[i] = with_sign_of(divide_twice(vals[i], scale, r), vals[i])
    else:
        for i in cutlass.range_constexpr(n):
            vals[i] = vals[i] / scale
    for i in cutlass.range_constexpr(n):
        vals[i] = cute.arch.fmin(cute.arch.fmax(vals[i], Float32(-FP8_MAX), nan=True),
                                 Float32(FP8_MAX), nan=True)
    return scale
