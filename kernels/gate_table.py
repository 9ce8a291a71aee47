"""The SwiGLU gate as a shared-memory table with one entry per bf16 gate value.

The gate part of the activation, `s(g) = g / (1 + exp(-g))` (silu) or
`s(g) = g' * (1 / (1 + exp(-(a * g'))))` with `g' = min(g, L)` (swiglu_oai), depends on `g`
alone, and `g` is a bf16 value. A CTA fills a table with `s` of every bf16 magnitude in
`[2^-25, 2^7)` of either sign, computed by the very expressions the formula path runs (`expf`,
correctly rounded divisions), so a looked-up value is the computed one bit for bit; each element
then costs a clamp, an address, one shared-memory load and one fma instead of an `expf` and a
correctly rounded division (about twenty issue slots).

An entry is a pair `(M, T)` and `s = fma(g, M, T)`, which covers the gates outside the range
too. `|g|` is clamped to `[LOW, HIGH]`: `LOW` is the largest bf16 below 2^-25, `HIGH` is 2^7,
and the entry at each bound stands for every gate clamped onto it:

- in range: `(0, s(g))`; `g * 0 + s(g)` is `s(g)` (in-range gates are finite and a zero `s` has
  g's sign);
- silu, `|g| <= LOW` (zeros, subnormals; NaN, which the clamp maps here): `(0.5, -0)`. `exp(-g)`
  is within 2^-23 of 1 there, so `1 + exp(-g)` rounds to 2 and `s = RN(g / 2) = RN(g * 0.5)`;
  a NaN gate stays NaN;
- silu, `g >= 2^7`: `(1, -0)`, `exp(-g)` underflows and `s = g / 1`; `g <= -2^7`: `(0, -0)`,
  `exp(-g)` is infinite and `s = g / inf = -0` (NaN for `-inf`, as `-inf * 0`);
- swiglu_oai: both bounds, and any in-range entry whose value is a zero (the fma would give it
  the sign of `g * 0`), hold `(NaN, 0)`: `s` comes out NaN and the caller computes those elements
  by the formula (its limit and alpha are runtime values, so no class holds for every input).

`tests/gpu/test_gate_table.py` checks every one of the 65536 bf16 gates against the formula.
Layout: entry `2 j + sign` for `j = bits(|g|) >> 16 - (LOW_T16)`, 8 bytes each, 16-byte aligned.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.nvfp4 import bits_f32

LOW_T16 = 0x32FF  # bf16 bits of LOW = the largest bf16 below 2^-25
HIGH_T16 = 0x4300  # bf16 bits of HIGH = 2^7
PER_SIGN = HIGH_T16 - LOW_T16 + 1
ENTRIES = 2 * PER_SIGN
TABLE_BYTES = ENTRIES * 8
FALLBACK_M = float("nan")
# The lookup clamps |g| * 2^-7 to [LOW * 2^-7, 1] (a saturating multiply, exact on bf16 values
# in range, then one max): LOW_T16 in those units.
SCALE_T16 = 7 << 7  # 2^-7 takes 7 off the bf16 exponent field
LOW_SCALED_T16 = LOW_T16 - SCALE_T16
assert HIGH_T16 - SCALE_T16 == 0x3F80  # HIGH * 2^-7 == 1.0, the saturation bound

# `$1` the gate g, `$2` the table's shared address minus LOW_SCALED_T16 * 16: `$0` =
# fma(g, M, T). `mul.sat` maps a NaN to +0, which the max takes to the LOW entry, as before.
LOOKUP_PTX = (
    "{ .reg .f32 a, m, t; .reg .b32 b, s, o; "
    f"abs.f32 a, $1; mul.rn.sat.f32 a, a, 0f3C000000; max.f32 a, a, 0f{LOW_SCALED_T16:04X}0000; "
    "mov.b32 b, a; mov.b32 s, $1; shr.u32 o, b, 12; shr.u32 s, s, 28; and.b32 s, s, 8; "
    "or.b32 o, o, s; add.u32 o, o, $2; ld.shared.v2.f32 {m, t}, [o]; "
    "fma.rn.f32 $0, $1, m, t; }")


@dsl_user_op
def lookup_gate(g: Float32, base: Int32, *, loc=None, ip=None) -> Float32:
    """`s(g)` from the table: `base` is `table_base(...)`."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(g).ir_value(loc=loc, ip=ip), Int32(base).ir_value(loc=loc, ip=ip)],
        LOOKUP_PTX, "=f,f,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def table_base(table: cute.Tensor, *, loc=None, ip=None) -> Int32:
    """The lookup's base operand for a shared-memory table tensor."""
    addr = llvm.ptrtoint(T.i32(), table.iterator.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return Int32(addr) - Int32(LOW_SCALED_T16 * 16)


@cute.jit
def silu_gate(g: Float32) -> Float32:
    """silu's gate part, the formula: `g / (1 + exp(-g))`."""
    return g / (Float32(1.0) + cute.math.exp(-g))


@cute.jit
def oai_gate(g: Float32, limit: Float32, alpha: Float32) -> Float32:
    """swiglu_oai's gate part, the formula: `g' * (1 / (1 + exp(-(alpha * g'))))`,
    `g' = min(g, limit)` (a NaN gate stays NaN)."""
    gi = g
    if gi > limit:
        gi = limit
    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-(alpha * gi)))
    return gi * sig


@cute.jit
def fill_gate_table(table: cute.Tensor, activation: cutlass.Constexpr, limit: Float32,
                    alpha: Float32, tidx, threads: cutlass.Constexpr):
    """The whole CTA fills `table` (Float32, 2 * ENTRIES, shared memory); ends with a
    barrier."""
    for e in cutlass.range(tidx, ENTRIES, threads):
        j = e >> 1
        g = bits_f32(((j + LOW_T16) << 16) | ((e & 1) << 31))
        m = Float32(0.0)
        t = Float32(0.0)
        if cutlass.const_expr(activation == "silu"):
            t = silu_gate(g)
            if j == 0:
                m = Float32(0.5)
                t = Float32(-0.0)
            elif j == PER_SIGN - 1:
                m = Float32(1.0)
                if e & 1:
                    m = Float32(0.0)
                t = Float32(-0.0)
        else:
            t = oai_gate(g, limit, alpha)
            if j == 0 or j == PER_SIGN - 1 or t == Float32(0.0):
                m = Float32(FALLBACK_M)
                t = Float32(0.0)
        table[2 * e] = m
        table[2 * e + 1] = t
    cute.arch.sync_threads()
