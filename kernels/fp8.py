"""FP8 blockwise quantization in registers, shared by dispatch's encode and `fused_silu_fp8`.

Per 128-element block: `s = max(amax, 1e-4) / 448`, `q = clamp(x / s, +-448)` (a correctly
rounded fp32 division), then e4m3. The max and the clamp propagate NaN: a NaN anywhere in a block
makes its scale and every code NaN, as the reference's torch max / clamp do (a plain fmax would
drop it).

The division is `kernels.division.divide_twice` with one reciprocal per block (the quotient bit for
bit, its sign from x) while amax <= FAST_LIMIT; a block with a larger, infinite or NaN amax
divides with `/`.

With `pow2` the scale is rounded up to a power of two, `s = 2^ceil(log2(max(amax, 1e-4) *
RN(1/448)))` (DeepEP's `round_scale`; its exponent byte is the UE8M0 scale), and `q = x * (1/s)`,
exact.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.division import FAST_LIMIT, _asm, divide_twice, with_sign_of

FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
# `$1` a positive fp32, `$0` the least power of two >= it (an infinity stays one): its exponent
# field, one more when any mantissa bit is set.
POW2_CEIL_PTX = ("{ .reg .b32 b, e, m; .reg .pred p; mov.b32 b, $1; and.b32 e, b, 0x7F800000; "
                 "and.b32 m, b, 0x007FFFFF; setp.ne.u32 p, m, 0; @p add.u32 e, e, 0x00800000; "
                 "mov.b32 $0, e; }")


@dsl_user_op
def pow2_ceil(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^ceil(log2(x)) for a positive normal or infinite fp32 `x`."""
    return Float32(_asm(T.f32(), [Float32(x)], POW2_CEIL_PTX, "=f,f", loc, ip))


@cute.jit
def scale_fp8_block(vals: cute.Tensor, n: cutlass.Constexpr, lanes: cutlass.Constexpr,
                    pow2: cutlass.Constexpr = False) -> Float32:
    """`vals`: this thread's `n` fp32 values of a block shared by `lanes` consecutive lanes (a
    power of two). Divides them in place by the block's scale (`pow2`: rounded up to a power of
    two); returns the scale. The caller converts them to e4m3 with saturation (`F2FP.SATFINITE`,
    what `.to(Float8E4M3FN)` compiles to): a quotient past +-448 (a rounding of amax / 448, or
    an infinite amax) becomes +-448 there and a NaN stays NaN, as the reference's clamp to +-448
    gives, so no clamp of its own (two min/max a value)."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, cute.arch.fmax(vals[i], -vals[i], nan=True), nan=True)
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=lanes >> (i + 1)),
                              nan=True)
    if cutlass.const_expr(pow2):
        scale = cute.arch.fmax(amax, Float32(FP8_MIN_AMAX), nan=True) * Float32(1.0 / FP8_MAX)
        if scale == scale:  # a NaN block keeps its NaN scale (and codes)
            scale = pow2_ceil(scale)
        r = Float32(1.0) / scale  # exact: a power of two
        for i in cutlass.range_constexpr(n):
            vals[i] = vals[i] * r
    else:
        scale = cute.arch.fmax(amax, Float32(FP8_MIN_AMAX), nan=True) / Float32(FP8_MAX)
        if amax <= Float32(FAST_LIMIT):
            r = Float32(1.0) / scale
            for i in cutlass.range_constexpr(n):
                vals[i] = with_sign_of(divide_twice(vals[i], scale, r), vals[i])
        else:
            for i in cutlass.range_constexpr(n):
                vals[i] = vals[i] / scale
    return scale
