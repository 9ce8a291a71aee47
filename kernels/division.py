"""Correctly rounded fp32 division by a divisor a whole quantization block shares.

`a / b` (`div.rn.f32`) is, on sm_90a, a reciprocal estimate, five fmas and a range check that
branches to a slow path, about ten issue slots per element: most of a quantizer's work. Every
element of a block divides by the block's scale, so the block computes one correctly rounded
reciprocal `r = RN(1 / b)` (a true division) and each element three operations:

    q0 = RN(a * r)           within 1.5 ulp of a / b (not always within one)
    rho = RN(a - b * q0)     one fma
    q1 = RN(q0 + rho * r)    one fma

`divide_once` returns q1. It is RN(a / b) for every fp32 `a` when `b` has at most four significant
bits (every e4m3 value, the NVFP4 scales), as long as no step leaves the normal range: each step
scales exactly by powers of two, so the 2^23 significands of `a` against the 8 of `b` are every
case, and `tests/test_division.py` runs them all through an exact model of these operations.

`divide_twice` corrects once more. After one correction the quotient is within one ulp of a / b
for any `b` (the first correction leaves an error of a few 2^-24 ulp before its own rounding), and
Markstein's theorem (a quotient within one ulp, corrected with r = RN(1/b), no overflow or
underflow) makes the second one RN(a / b): used where `b` is any fp32 (FP8's scale).

`divide_split` needs no correction: with the reciprocal split in two, `r_hi = RN(1/b)` and
`r_lo = RN((1 - b * r_hi) * r_hi)` (both once per block), one product and one fma,

    q = RN(a * r_hi + RN(a * r_lo))

are RN(a / b) for every fp32 `a` and every `b` = K 2^d with K odd and at most 15 (the e4m3
values). The sum before its rounding is within 2^-46 of a / b, relatively, while a / b lies
further than that from every midpoint between fp32 neighbours: a / b = A 2^s / K with A < 2^24,
so its distance to a midpoint (an odd multiple of 2^(e-25) in its binade [2^e, 2^(e+1)), where
s >= e - 23) is a multiple of 2^(e-25) / K, and it is not zero, since a / b has at most 24
significant bits or infinitely many, never the midpoint's 25. One operation fewer per element
than `divide_once`; `tests/test_division.py` checks it the same way.

The corrections add +0 to -0, so the sign of a zero quotient is lost: callers take the sign from
`a` (RN(a / b) has a's sign for b > 0). Callers send blocks whose operands could overflow a step
to `/` instead (a per-block test, see each caller).
"""

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Dividends up to this magnitude keep every step finite: NVFP4's e4m3 scales are >= 2^-9
# (r <= 2^9), and FP8's dividends are at most its block's amax, about 448 times its scale.
FAST_LIMIT = 2.0 ** 100


def _asm(result_type, args, text, constraints, loc, ip):
    return llvm.inline_asm(result_type, [a.ir_value(loc=loc, ip=ip) for a in args], text,
                           constraints, has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


# `$1` the dividend a, `$2` the divisor b, `$3` r = RN(1/b), `$0` the quotient.
DIVIDE_ONCE_PTX = ("{ .reg .f32 q, rho, nb; neg.f32 nb, $2; mul.rn.f32 q, $1, $3; "
                   "fma.rn.f32 rho, nb, q, $1; fma.rn.f32 $0, rho, $3, q; }")
DIVIDE_TWICE_PTX = ("{ .reg .f32 q, rho, nb; neg.f32 nb, $2; mul.rn.f32 q, $1, $3; "
                    "fma.rn.f32 rho, nb, q, $1; fma.rn.f32 q, rho, $3, q; "
                    "fma.rn.f32 rho, nb, q, $1; fma.rn.f32 $0, rho, $3, q; }")
# `$1` the dividend a, `$2` r_hi, `$3` r_lo (`split_reciprocal`), `$0` the quotient.
DIVIDE_SPLIT_PTX = "{ .reg .f32 lo; mul.rn.f32 lo, $1, $3; fma.rn.f32 $0, $1, $2, lo; }"
# `$1` the divisor b, `$2` r_hi = RN(1/b), `$0` r_lo.
RECIPROCAL_LOW_PTX = ("{ .reg .f32 e, nb; neg.f32 nb, $1; fma.rn.f32 e, nb, $2, 0f3F800000; "
                      "mul.rn.f32 $0, e, $2; }")
# `$1` the magnitude, `$2` the sign source: one bit select.
WITH_SIGN_OF_PTX = ("{ .reg .b32 m, s; mov.b32 m, $1; mov.b32 s, $2; "
                    "lop3.b32 m, m, s, 0x7FFFFFFF, 0xE4; mov.b32 $0, m; }")


@dsl_user_op
def divide_once(a: Float32, b: Float32, r: Float32, *, loc=None, ip=None) -> Float32:
    """RN(a / b) up to the sign of a zero, for `b` with <= 4 significant bits and r = RN(1/b)."""
    return Float32(_asm(T.f32(), [Float32(a), Float32(b), Float32(r)], DIVIDE_ONCE_PTX,
                        "=f,f,f,f", loc, ip))


@dsl_user_op
def divide_twice(a: Float32, b: Float32, r: Float32, *, loc=None, ip=None) -> Float32:
    """RN(a / b) up to the sign of a zero, for any `b` and r = RN(1/b)."""
    return Float32(_asm(T.f32(), [Float32(a), Float32(b), Float32(r)], DIVIDE_TWICE_PTX,
                        "=f,f,f,f", loc, ip))


@dsl_user_op
def divide_split(a: Float32, r_hi: Float32, r_lo: Float32, *, loc=None, ip=None) -> Float32:
    """RN(a / b) up to the sign of a zero, for `b` an e4m3 value and (r_hi, r_lo) its
    `split_reciprocal`."""
    return Float32(_asm(T.f32(), [Float32(a), Float32(r_hi), Float32(r_lo)], DIVIDE_SPLIT_PTX,
                        "=f,f,f,f", loc, ip))


@dsl_user_op
def reciprocal_low(b: Float32, r_hi: Float32, *, loc=None, ip=None) -> Float32:
    """r_lo of `split_reciprocal`: RN((1 - b * r_hi) * r_hi), the residual by one fma."""
    return Float32(_asm(T.f32(), [Float32(b), Float32(r_hi)], RECIPROCAL_LOW_PTX, "=f,f,f",
                        loc, ip))


def split_reciprocal(b: Float32):
    """(r_hi, r_lo) of `divide_split`: r_hi = RN(1 / b) (a true division), r_lo its residual."""
    r_hi = Float32(1.0) / b
    return r_hi, reciprocal_low(b, r_hi)


@dsl_user_op
def with_sign_of(magnitude: Float32, sign: Float32, *, loc=None, ip=None) -> Float32:
    """`magnitude` with the sign bit of `sign` (both fp32)."""
    return Float32(_asm(T.f32(), [Float32(magnitude), Float32(sign)], WITH_SIGN_OF_PTX,
                        "=f,f,f", loc, ip))
