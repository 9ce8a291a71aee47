"""The SwiGLU gate as a shared-memory table with one entry per bf16 gate value.

The gate part of the activation, `s(g) = g / (1 + exp(-g))` (silu) or
`s(g) = g' * (1 / (1 + exp(-(a * g'))))` with `g' = min(g, L)` (swiglu_oai), depends on `g`
alone, and `g` is a bf16 value. A table holds `s` of every bf16 magnitude in
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

A second form of the same table, for the kernels that check each element anyway (FP8 and the
fp32 output), holds one value per entry (layout below): `s(g)` in range, NaN at both bounds
(the caller computes those elements by the formula), and a lookup is a 4-byte load with no fma
(`lookup_value`), half the shared-memory bytes of a pair.

A third form holds the value form again, split by sign (the positive gates' values in order of
magnitude, then the negative ones'), for lookups on bf16 pairs: two packed clamps
(`max.xorsign.abs`, `min.xorsign.abs` on bf16x2) bring both gates of a pair into range with their
signs kept, and each half's 16 bits times 4 is its entry's byte offset once the negative half lies
SPLIT_SIGN_BYTES (2^17) past the positive one in shared memory, a shift and a mask a gate
(`gate_pair_key`, `lookup_split`). SwiGLU-OAI's FP4 stream uses it; its gates outside the table
come out NaN there too, and the vector takes the formula.

The tables are built once per device and activation (limit, alpha) by the `gate_table` kernel
into global memory, the pairs, the values, then the split values (`cute_ep.silu` keeps them),
and a table kernel
copies its form into shared memory with one bulk copy at its start (`init_gate_load`,
`start_gate_load`): 64 or 32 KB from L2 in place of 8196 `expf`s and divisions per CTA, about
1.5 us of a whole SM's issue slots.

`tests/gpu/test_gate_table.py` checks every one of the 65536 bf16 gates against the formula.
Layout: entry `2 j + sign` for `j = bits(|g|) >> 16 - (LOW_T16)`, 8 bytes each (pairs) or 4
(values), 16-byte aligned; the split values: `sign * SPLIT_PER_SIGN + j`, 4 bytes each.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.bulk_copy import bulk_load
from kernels.nvfp4 import bits_f32
from layouts.abi import GridRule, KernelSpec, Param

FAMILY = "gate_table"

LOW_T16 = 0x32FF  # bf16 bits of LOW = the largest bf16 below 2^-25
HIGH_T16 = 0x4300  # bf16 bits of HIGH = 2^7
PER_SIGN = HIGH_T16 - LOW_T16 + 1
ENTRIES = 2 * PER_SIGN
TABLE_BYTES = ENTRIES * 8
VALUE_TABLE_BYTES = ENTRIES * 4
# A third form, the values split by sign for lookups on bf16 pairs (`gate_pair_key`): each
# sign's PER_SIGN values in order of magnitude, padded to whole 16-byte pieces, the positive
# gates' then the negative ones'. In shared memory the two halves lie SPLIT_SIGN_BYTES apart,
# where a gate's sign bit lands in its entry's byte offset (`lookup_split`).
SPLIT_PER_SIGN = (PER_SIGN + 3) // 4 * 4
SPLIT_HALF_BYTES = SPLIT_PER_SIGN * 4
SPLIT_SIGN_BYTES = 1 << 17
TABLE_FLOATS = 3 * ENTRIES + 2 * SPLIT_PER_SIGN  # the gate_table kernel's output: the pairs,
SPLIT_OFFSET_BYTES = 3 * ENTRIES * 4  # the values, then the split values
FALLBACK = float("nan")  # an entry's value (or M) that leaves its gates to the formula
# The lookup clamps |g| * 2^-7 to [LOW * 2^-7, 1] (a saturating multiply, exact on bf16 values
# in range, then one max): LOW_T16 in those units.
SCALE_T16 = 7 << 7  # 2^-7 takes 7 off the bf16 exponent field
LOW_SCALED_T16 = LOW_T16 - SCALE_T16
assert HIGH_T16 - SCALE_T16 == 0x3F80  # HIGH * 2^-7 == 1.0, the saturation bound


def _lookup_ptx(entry_bytes: int) -> str:
    """PTX of a lookup in a table of `entry_bytes` entries (8: pairs, `$0` = fma(g, M, T); 4:
    values, `$0` = the value): `$1` the gate g, `$2` the table's shared address minus
    LOW_SCALED_T16 * 2 * entry_bytes. bits(clamped |g|) >> 16 is j + LOW_SCALED_T16, shifted to
    2 j entries' bytes; g's sign bit becomes one entry's bytes. `mul.sat` maps a NaN to +0,
    which the max takes to the LOW entry."""
    log = entry_bytes.bit_length() - 1
    pairs = entry_bytes == 8
    load = ("ld.shared.v2.f32 {m, t}, [o]; fma.rn.f32 $0, $1, m, t; " if pairs
            else "ld.shared.f32 $0, [o]; ")
    return (f"{{ .reg .f32 {'a, m, t' if pairs else 'a'}; .reg .b32 b, s, o; "
            f"abs.f32 a, $1; mul.rn.sat.f32 a, a, 0f3C000000; "
            f"max.f32 a, a, 0f{LOW_SCALED_T16:04X}0000; mov.b32 b, a; mov.b32 s, $1; "
            f"shr.u32 o, b, {15 - log}; shr.u32 s, s, {31 - log}; and.b32 s, s, {entry_bytes}; "
            f"or.b32 o, o, s; add.u32 o, o, $2; {load}}}")


LOOKUP_PTX = _lookup_ptx(8)
VALUE_LOOKUP_PTX = _lookup_ptx(4)

# Both bf16 halves of `$1` with their magnitudes clamped to [LOW, HIGH] and their signs kept:
# max.xorsign.abs gives the larger magnitude with the xor of the signs (LOW's and HIGH's are
# clear); a NaN half becomes LOW (max returns the other operand), the LOW entry's gates.
PAIR_KEY_PTX = (f"{{ .reg .b32 lo, hi, c; mov.b32 lo, 0x{LOW_T16:04X}{LOW_T16:04X}; "
                f"mov.b32 hi, 0x{HIGH_T16:04X}{HIGH_T16:04X}; "
                f"max.xorsign.abs.bf16x2 c, $1, lo; min.xorsign.abs.bf16x2 $0, c, hi; }}")
# A key half's 16 bits times 4 (the sign bit lands on SPLIT_SIGN_BYTES), plus `$2`.
SPLIT_LOW_PTX = ("{ .reg .b32 o; shl.b32 o, $1, 2; and.b32 o, o, 0x3FFFC; add.u32 o, o, $2; "
                 "ld.shared.f32 $0, [o]; }")
SPLIT_HIGH_PTX = ("{ .reg .b32 o; shr.u32 o, $1, 14; and.b32 o, o, 0x3FFFC; add.u32 o, o, $2; "
                  "ld.shared.f32 $0, [o]; }")
assert 4 * 0x8000 == SPLIT_SIGN_BYTES


@dsl_user_op
def gate_pair_key(pair: Int32, *, loc=None, ip=None) -> Int32:
    """The split table's key of the two bf16 gates in `pair` (`lookup_split`): each half's
    magnitude clamped to [LOW, HIGH], its sign kept, in two packed bf16 operations."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(pair).ir_value(loc=loc, ip=ip)], PAIR_KEY_PTX,
                                 "=r,r", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def lookup_split(key: Int32, base: Int32, high: bool, *, loc=None, ip=None) -> Float32:
    """`s(g)` of the low (or `high`) gate of a `gate_pair_key` key from the split value table
    (NaN: the formula's): `base` is `split_base(...)`. The entry's byte offset is the key
    half's 16 bits times 4, its sign bit becoming SPLIT_SIGN_BYTES: a shift and a mask."""
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(key).ir_value(loc=loc, ip=ip), Int32(base).ir_value(loc=loc, ip=ip)],
        SPLIT_HIGH_PTX if high else SPLIT_LOW_PTX, "=f,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def low_halves(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """The low bf16 of `a` and the low bf16 of `b` as one pair (a byte permute): the two gates
    of interleaved (gate, up) pairs."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip),
                                           Int32(b).ir_value(loc=loc, ip=ip)],
                                 "prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def split_base(positive: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """`lookup_split`'s base operand: the shared address of the positive gates' half (the
    negative half SPLIT_SIGN_BYTES past it) minus LOW's key bytes."""
    addr = llvm.ptrtoint(T.i32(), positive.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return Int32(addr) - Int32(LOW_T16 * 4)


def _lookup(ptx: str, g: Float32, base: Int32, loc, ip) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(g).ir_value(loc=loc, ip=ip), Int32(base).ir_value(loc=loc, ip=ip)],
        ptx, "=f,f,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def lookup_gate(g: Float32, base: Int32, *, loc=None, ip=None) -> Float32:
    """`s(g)` from the pair table: `base` is `table_base(...)`."""
    return _lookup(LOOKUP_PTX, g, base, loc, ip)


@dsl_user_op
def lookup_value(g: Float32, base: Int32, *, loc=None, ip=None) -> Float32:
    """`s(g)` from the value table (NaN: the formula's): `base` is `table_base(..., True)`."""
    return _lookup(VALUE_LOOKUP_PTX, g, base, loc, ip)


@dsl_user_op
def table_base(table: cute.Tensor, values: bool = False, *, loc=None, ip=None) -> Int32:
    """The lookup's base operand for a shared-memory table tensor (`values`: the value
    table's, for `lookup_value`)."""
    addr = llvm.ptrtoint(T.i32(), table.iterator.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return Int32(addr) - Int32(LOW_SCALED_T16 * (8 if values else 16))


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
def activation_constants(activation: cutlass.Constexpr, activation_params: cute.Pointer):
    """(limit, alpha): swiglu_oai's, read from the 2 floats at `activation_params`; zeros for
    silu (nothing read)."""
    limit = Float32(0.0)
    alpha = Float32(0.0)
    if cutlass.const_expr(activation == "swiglu_oai"):
        act = cute.make_tensor(activation_params, cute.make_layout(2))
        limit = act[0]
        alpha = act[1]
    return limit, alpha


@cute.jit
def entry_gate(e):
    """(j, the gate) of entry e of either table: magnitude step j, sign e mod 2."""
    j = e >> 1
    return j, bits_f32(((j + LOW_T16) << 16) | ((e & 1) << 31))


@cute.jit
def gate_entry(e, activation: cutlass.Constexpr, limit: Float32, alpha: Float32):
    """(M, T) of table entry e."""
    j, g = entry_gate(e)
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
            m = Float32(FALLBACK)
            t = Float32(0.0)
    return m, t


@cute.jit
def gate_value(e, activation: cutlass.Constexpr, limit: Float32, alpha: Float32) -> Float32:
    """Value-table entry e: the formula's s(g) of its gate, NaN at either bound."""
    j, g = entry_gate(e)
    value = Float32(0.0)
    if cutlass.const_expr(activation == "silu"):
        value = silu_gate(g)
    else:
        value = oai_gate(g, limit, alpha)
    if j == 0 or j == PER_SIGN - 1:
        value = Float32(FALLBACK)
    return value


@cute.jit
def init_gate_load(bar: cute.Pointer, leader):
    """`leader` initialises the one-arrival mbarrier `bar` on which `start_gate_load` completes
    and fences it for the async proxy. Other threads may wait on `bar` once a CTA barrier has
    followed this."""
    if leader:
        cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()


@cute.jit
def start_gate_load(table: cute.Tensor, src: cute.Pointer, bar: cute.Pointer, leader,
                    values: cutlass.Constexpr = False):
    """`leader` (the thread that initialised `bar`, or any once a barrier has followed that)
    bulk-copies the global table at `src` (the `gate_table` kernel's output: its pairs, or with
    `values` its value table) into `table` (shared memory, `TABLE_BYTES` or
    `VALUE_TABLE_BYTES`), its completion on `bar` (phase 0)."""
    if leader:
        if cutlass.const_expr(values):
            cute.arch.mbarrier_arrive_and_expect_tx(bar, VALUE_TABLE_BYTES)
            bulk_load(table.iterator, src.toint() + TABLE_BYTES, VALUE_TABLE_BYTES, bar)
        else:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, TABLE_BYTES)
            bulk_load(table.iterator, src.toint(), TABLE_BYTES, bar)


@cute.jit
def start_split_gate_load(positive: cute.Pointer, negative: cute.Pointer, src: cute.Pointer,
                          bar: cute.Pointer, leader):
    """`start_gate_load` of the split value table: its two halves into `positive` and
    `negative` (shared memory, SPLIT_SIGN_BYTES apart), both on `bar`."""
    if leader:
        cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * SPLIT_HALF_BYTES)
        bulk_load(positive, src.toint() + SPLIT_OFFSET_BYTES, SPLIT_HALF_BYTES, bar)
        bulk_load(negative, src.toint() + SPLIT_OFFSET_BYTES + SPLIT_HALF_BYTES,
                  SPLIT_HALF_BYTES, bar)


class GateTable:
    """`gate_table`: the tables of one activation into global memory (`activation_params`: the
    swiglu_oai (limit, alpha), unread for silu; `table`: `sizes["floats"]` fp32, the pairs then
    the values), a thread per entry."""

    def __init__(self, activation: str, threads: int = 256):
        if activation not in ("silu", "swiglu_oai"):
            raise ValueError(f"activation silu|swiglu_oai, got {activation!r}")
        self.activation = activation
        self.threads = threads

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY, config={"activation": self.activation, "threads": self.threads},
            params=(Param("activation_params", "ptr", "float32", align=4),
                    Param("table", "ptr", "float32", align=16, writes=True)),
            block=(self.threads, 1, 1),
            grid=(GridRule(constant=-(-ENTRIES // self.threads)), GridRule(constant=1),
                  GridRule(constant=1)),
            sizes={"floats": TABLE_FLOATS})

    @cute.jit
    def __call__(self, activation_params: cute.Pointer, table: cute.Pointer, stream):
        self.kernel(activation_params, table).launch(
            grid=(-(-ENTRIES // self.threads), 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, activation_params: cute.Pointer, table: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        limit, alpha = activation_constants(self.activation, activation_params)
        e = bidx * self.threads + tidx
        if e < ENTRIES:
            m, t = gate_entry(e, self.activation, limit, alpha)
            out = cute.make_tensor(table, cute.make_layout(TABLE_FLOATS))
            out[2 * e] = m
            out[2 * e + 1] = t
            value = gate_value(e, self.activation, limit, alpha)
            out[2 * ENTRIES + e] = value
            out[3 * ENTRIES + (e & 1) * SPLIT_PER_SIGN + (e >> 1)] = value
        elif e < ENTRIES + 2 * (SPLIT_PER_SIGN - PER_SIGN):  # the split halves' padding
            pad = e - ENTRIES
            out = cute.make_tensor(table, cute.make_layout(TABLE_FLOATS))
            out[3 * ENTRIES + (pad & 1) * SPLIT_PER_SIGN + PER_SIGN + (pad >> 1)] = Float32(
                FALLBACK)
