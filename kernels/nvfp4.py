"""`quantize_nvfp4`: bf16 rows grouped in segments -> NVFP4 codes and e4m3 block scales.

Rows `[row_offsets[g], row_offsets[g + 1])` form segment g (an expert) with global scale
`global_scales[g]`; only `row_offsets` on the device says how many rows there are. A thread owns
one 16-element block: `sf = e4m3_rne_satfinite(gs * amax / 6)`, `q = e2m1(x * gs / f32(sf))`
(correctly rounded fp32 operations), codes 0 where sf is not positive (a zero block; a NaN block
keeps its NaN scale 0x7F), element 2i in the low nibble.

Scales are linear `[rows, K / 16]`, or in the 128x4 layout (`layouts.scales`) where each segment
starts on a fresh 128-row block: the grid walks *scale rows*, so the padding rows of every
segment's last block (and padding scale columns) are written as zeros by the same pass.

The e2m1 encoder is software on sm_90a (`e2m1_word`: three fmas into the integer-spaced
fp32 range and a min) and the hardware `cvt.rn.satfinite.e2m1x2.f32` on sm_100a; two
configurations. Each block divides by its scale with one reciprocal and fmas
(`kernels.division.divide_once`), the quotient bit for bit the correctly rounded one.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.division import FAST_LIMIT, divide_once, with_sign_of
from kernels.memory import scale_offset
from kernels.scan import WARP, warp_exclusive_scan
from layouts.abi import GridRule, KernelSpec, Param

BLOCK = 16
ATOM_ROWS = 128
MAX_SEGMENTS = 272


def _ptr(dtype, addr, align):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def _asm(result_type, args, text, constraints, loc, ip):
    """One side-effect-free PTX snippet: `$0` the result, `$1...` the numeric args."""
    return llvm.inline_asm(result_type, [a.ir_value(loc=loc, ip=ip) for a in args], text,
                           constraints, has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cvt_e4m3_byte(value: Float32, *, loc=None, ip=None) -> Int32:
    """e4m3 (round to nearest even, saturating to 448; NaN stays NaN) of `value`, in the low
    byte."""
    return Int32(_asm(T.i32(), [Float32(0.0), Float32(value)],
                      "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; cvt.u32.u16 $0, t; }",
                      "=r,f,f", loc, ip))


@dsl_user_op
def e4m3_byte_to_f32(byte: Int32, *, loc=None, ip=None) -> Float32:
    """The exact fp32 value of the e4m3 code in the low byte of `byte`."""
    return Float32(_asm(T.f32(), [Int32(byte)],
                        "{ .reg .b16 lo, a, b; .reg .b32 pair; cvt.u16.u32 lo, $1; "
                        "cvt.rn.f16x2.e4m3x2 pair, lo; mov.b32 {a, b}, pair; cvt.f32.f16 $0, a; }",
                        "=f,r", loc, ip))


@dsl_user_op
def cvt_e2m1x2(even: Float32, odd: Float32, *, loc=None, ip=None) -> Int32:
    """Hardware e2m1 pair (sm_100a): `even` in the low nibble, `odd` in the high one."""
    return Int32(_asm(T.i32(), [Float32(odd), Float32(even)],
                      "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $1, $2; cvt.u32.u8 $0, t; }",
                      "=r,f,f", loc, ip))


@dsl_user_op
def f32_bits(value: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of an fp32 value as an int32."""
    return Int32(_asm(T.i32(), [Float32(value)], "mov.b32 $0, $1;", "=r,f", loc, ip))


@dsl_user_op
def bits_f32(value: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of 32 bits."""
    return Float32(_asm(T.f32(), [Int32(value)], "mov.b32 $0, $1;", "=f,r", loc, ip))


@cute.jit
def load_segment_blocks(row_offsets: cute.Pointer, num_segments, s_off: cute.Tensor,
                        s_first: cute.Tensor, tidx, threads: cutlass.Constexpr):
    """The whole CTA: `s_off[g] = row_offsets[g]` for g <= S, and `s_first[g]` = the first
    128-row scale block of segment g (each segment starts a fresh block), `s_first[S]` the
    blocks in all. Shared-memory tensors; ends with a barrier."""
    offsets = cute.make_tensor(row_offsets, cute.make_layout(num_segments + 1))
    for g in cutlass.range(tidx, num_segments + 1, threads):
        s_off[g] = offsets[g]
    cute.arch.sync_threads()
    for g in cutlass.range(tidx, num_segments, threads):
        s_first[g] = (s_off[g + 1] - s_off[g] + ATOM_ROWS - 1) // ATOM_ROWS
    cute.arch.sync_threads()
    if tidx < WARP:
        warp_exclusive_scan(s_first, s_first, num_segments, tidx % WARP)
    cute.arch.sync_threads()


def _e2m1_word_ptx() -> str:
    """PTX of e2m1_word: `$1..$8` the values, `$9..$16` their sign sources, `$0` the word."""
    lines = ["{ .reg .f32 a<8>, c<8>, d<8>; .reg .b32 k<8>, t<4>, ev, od, sv, so;"]
    for i in range(8):
        lines.append(
            f"abs.f32 a{i}, ${i + 1}; fma.rn.f32 c{i}, a{i}, 0f40000000, 0f4B400000; "
            f"add.rn.f32 d{i}, a{i}, 0f4B400002; min.f32 c{i}, c{i}, d{i}; "
            f"fma.rn.f32 d{i}, a{i}, 0f3F000000, 0f4B400004; min.f32 d{i}, d{i}, 0f4B400007; "
            f"min.f32 c{i}, c{i}, d{i}; mov.b32 k{i}, c{i};")
    # Byte 0 of each k is its code: gather the even elements' codes into the four bytes of
    # `ev`, the odd ones' into `od`; the same selectors with bit 3 set copy each value's sign
    # bit (the top bit of its byte 3) across a byte, masked to bit 3 of the nibble.
    for word, first, sign_word in (("ev", 0, "sv"), ("od", 1, "so")):
        e = [first + 2 * j for j in range(4)]
        lines.append(f"prmt.b32 t0, k{e[0]}, k{e[1]}, 0x0040; prmt.b32 t1, k{e[2]}, k{e[3]}, "
                     f"0x4000; prmt.b32 {word}, t0, t1, 0x7610;")
        lines.append(f"prmt.b32 t2, ${e[0] + 9}, ${e[1] + 9}, 0x00FB; prmt.b32 t3, ${e[2] + 9}, "
                     f"${e[3] + 9}, 0xFB00; prmt.b32 {sign_word}, t2, t3, 0x7610;")
        lines.append(f"lop3.b32 {word}, {word}, {sign_word}, 0x08080808, 0xF8;")
    lines.append("shl.b32 od, od, 4; or.b32 $0, ev, od; }")
    return " ".join(lines)


E2M1_WORD_PTX = _e2m1_word_ptx()


@dsl_user_op
def e2m1_word(values: list, signs: list, *, loc=None, ip=None) -> Int32:
    """The 8 e2m1 codes of `values` (fp32, none NaN), element i in nibble i, each with the sign
    bit of `signs[i]`: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, saturating
    at 6.

    For a = |v|, over [0, 2], [2, 4] and [4, 6] the code is 2a, a + 2 and a/2 + 4 rounded to an
    integer with ties to even (the midpoints 0.25, 0.75, ..., 5 land on half-integers and go to
    the even code, as e2m1 requires), so it is round(min(2a, a + 2, a/2 + 4, 7)); rounding is
    monotone, so that is the min of the four rounded. Each is one fma into [2^23, 2^24), where
    fp32 values are the integers E2M1_ROUND + code: byte 0 of the bits is the code.
    `tests/test_division.py` checks every fp32 magnitude against the threshold rule."""
    args = [Float32(v) for v in values] + [Float32(v) for v in signs]
    return Int32(_asm(T.i32(), args, E2M1_WORD_PTX, "=r," + ",".join(["f"] * 16), loc, ip))


@cute.jit
def e2m1_words(vals: cute.Tensor, gs: Float32, sf: Float32, amax: Float32, usable,
               words: cute.Tensor, e2m1: cutlass.Constexpr, divide: cutlass.Constexpr = True,
               r: Float32 = Float32(0.0), given_r: cutlass.Constexpr = False):
    """words[w] = the 8 e2m1 codes of `(vals[8w + i] * gs) / sf` (correctly rounded fp32
    multiply and divide), element 2i in the low nibble of byte i; all zero unless `usable`
    (then gs > 0 and sf > 0). `amax`: the largest |vals|. `divide=False` (MXFP4, whose scale is a
    power of two folded into gs): `vals * gs` alone. `e2m1`: "software" | "hardware".
    `given_r`: `r` is RN(1 / sf) already (else it is computed here).

    The division is `kernels.division.divide_once` with one reciprocal per block (sf is an e4m3
    value) unless `gs * amax` exceeds FAST_LIMIT (or is not a number), where `/` runs instead."""
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = Int32(0)
    if usable:
        if cutlass.const_expr(not divide):
            _encode_words(vals, gs, sf, Float32(0.0), words, e2m1, "none")
        elif gs * amax <= Float32(FAST_LIMIT):
            if cutlass.const_expr(not given_r):
                r = Float32(1.0) / sf
            _encode_words(vals, gs, sf, r, words, e2m1, "reciprocal")
        else:
            _encode_words(vals, gs, sf, Float32(0.0), words, e2m1, "true")


@cute.jit
def _encode_words(vals: cute.Tensor, gs: Float32, sf: Float32, r: Float32, words: cute.Tensor,
                  e2m1: cutlass.Constexpr, division: cutlass.Constexpr):
    """The codes of e2m1_words; `division`: "none" (y = v * gs), "reciprocal" (divide_once by
    sf with r = RN(1/sf), the sign from v * gs) or "true" (`/`; any y, a NaN encoded as +0)."""
    for w in cutlass.range_constexpr(cute.size(words)):
        ys = []
        signs = []
        for i in cutlass.range_constexpr(8):
            v = vals[8 * w + i]
            y = v * gs
            sign = y
            if cutlass.const_expr(division == "reciprocal"):
                y = divide_once(y, sf, r)  # its magnitude; the sign is v * gs's
                if cutlass.const_expr(e2m1 == "hardware"):
                    y = with_sign_of(y, v)
            elif cutlass.const_expr(division == "true"):
                y = y / sf
                if cutlass.const_expr(e2m1 == "software"):
                    if y != y:  # NaN (0 * inf): code 0, no sign
                        y = Float32(0.0)
                    sign = y
            ys.append(y)
            signs.append(sign)
        if cutlass.const_expr(e2m1 == "hardware"):
            word = Int32(0)
            for p in cutlass.range_constexpr(4):
                word = word | (cvt_e2m1x2(ys[2 * p], ys[2 * p + 1]) << (8 * p))
            words[w] = word
        else:
            words[w] = e2m1_word(ys, signs)


@cute.jit
def quantize_nvfp4_block(src_addr, codes_addr, gs: Float32, e2m1: cutlass.Constexpr):
    """The 16 bf16 values at `src_addr` (16-byte aligned): write their 8 code bytes to
    `codes_addr` (8-byte aligned) and return their e4m3 scale byte. `sf = e4m3(gs * amax / 6)`,
    `q = e2m1((x * gs) / sf)`, correctly rounded fp32 operations, codes 0 where sf is not
    positive."""
    src = cute.make_tensor(_ptr(BFloat16, src_addr, 16), cute.make_layout(BLOCK))
    regs = cute.make_rmem_tensor(cute.make_layout(BLOCK), BFloat16)
    cute.autovec_copy(src, regs)
    vals = cute.make_rmem_tensor(cute.make_layout(BLOCK), Float32)
    vals.store(regs.load().to(Float32))
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(BLOCK):
        amax = cute.arch.fmax(amax, cute.arch.fmax(vals[i], -vals[i], nan=True), nan=True)
    byte = cvt_e4m3_byte((gs * amax) / Float32(6.0))
    sf = e4m3_byte_to_f32(byte)
    words = cute.make_rmem_tensor(cute.make_layout(2), Int32)
    e2m1_words(vals, gs, sf, amax, sf > 0.0, words, e2m1)
    cute.autovec_copy(words, cute.make_tensor(_ptr(Int32, codes_addr, 8), cute.make_layout(2)))
    return byte


class QuantizeNvfp4:
    def __init__(self, scales: str, e2m1: str, threads: int = 128):
        if scales not in ("linear", "128x4") or e2m1 not in ("software", "hardware"):
            raise ValueError(f"scales linear|128x4, e2m1 software|hardware; got {scales}, {e2m1}")
        self.scales = scales
        self.e2m1 = e2m1
        self.threads = threads
        self.arches = ("sm_100a",) if e2m1 == "hardware" else ("sm_90a",)

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="quantize_nvfp4",
            config={"scales": self.scales, "e2m1": self.e2m1, "threads": self.threads},
            params=(
                Param("x", "ptr", "bfloat16", align=16),
                Param("row_offsets", "ptr", "int32", align=4,
                      min_elements=("num_segments", 1)),
                Param("global_scales", "ptr", "float32", align=4,
                      min_elements=("num_segments", 1)),
                Param("codes", "ptr", "uint8", align=8, writes=True),
                Param("scales", "ptr", "uint8", align=4, writes=True),
                Param("num_segments", "i32"),
                Param("hidden", "i32"),
                Param("grid_ctas", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("grid_ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=2 * (MAX_SEGMENTS + 4) * 4 + 64,
            sizes={"block": BLOCK, "max_segments": MAX_SEGMENTS - 1},
        )

    @cute.jit
    def __call__(self, x: cute.Pointer, row_offsets: cute.Pointer, global_scales: cute.Pointer,
                 codes: cute.Pointer, scales: cute.Pointer, num_segments: Int32, hidden: Int32,
                 grid_ctas: Int32, stream):
        self.kernel(x, row_offsets, global_scales, codes, scales, num_segments, hidden,
                    grid_ctas).launch(grid=(grid_ctas, 1, 1), block=(self.threads, 1, 1),
                                      smem=2 * (MAX_SEGMENTS + 4) * 4 + 64, stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, row_offsets: cute.Pointer, global_scales: cute.Pointer,
               codes: cute.Pointer, scales: cute.Pointer, num_segments: Int32, hidden: Int32,
               grid_ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        s_off = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4),
                                       byte_alignment=16)
        load_segment_blocks(row_offsets, num_segments, s_off, s_first, tidx, self.threads)

        blocks = hidden // BLOCK
        scale_cols = blocks
        units = s_off[num_segments]
        if cutlass.const_expr(self.scales == "128x4"):
            scale_cols = (blocks + 3) // 4 * 4
            units = s_first[num_segments] * ATOM_ROWS
        rk = scale_cols // 4
        for unit in cutlass.range(bidx, units, grid_ctas):
            # The row this unit (a scale row) stands for, or -1 for block padding.
            row = unit
            seg = Int32(0)
            for g in cutlass.range(num_segments):
                start = s_off[g]
                if cutlass.const_expr(self.scales == "128x4"):
                    start = s_first[g] * ATOM_ROWS
                if start <= unit:
                    seg = g
            if cutlass.const_expr(self.scales == "128x4"):
                local = unit - s_first[seg] * ATOM_ROWS
                row = Int32(-1)
                if local < s_off[seg + 1] - s_off[seg]:
                    row = s_off[seg] + local
            gs = cute.make_tensor(global_scales, cute.make_layout(num_segments))[seg]
            for kb in cutlass.range(tidx, scale_cols, self.threads):
                byte = Int32(0)
                if row >= 0 and kb < blocks:
                    byte = self._quantize_block(x, codes, row, kb, hidden, gs)
                at = Int64(unit) * Int64(scale_cols) + Int64(kb)
                if cutlass.const_expr(self.scales == "128x4"):
                    at = scale_offset(unit, kb, rk)
                cute.make_tensor(_ptr(Uint8, scales.toint() + at, 1), cute.make_layout(1))[0] = \
                    Uint8(byte)

    @cute.jit
    def _quantize_block(self, x: cute.Pointer, codes: cute.Pointer, row, kb, hidden, gs):
        """Quantize block kb of `row`; write its 8 code bytes, return its e4m3 scale byte."""
        return quantize_nvfp4_block(
            x.toint() + (Int64(row) * Int64(hidden) + Int64(kb) * BLOCK) * 2,
            codes.toint() + Int64(row) * Int64(hidden // 2) + Int64(kb) * 8, gs, self.e2m1)
