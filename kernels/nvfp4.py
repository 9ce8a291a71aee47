"""`quantize_nvfp4`: bf16 rows grouped in segments -> NVFP4 codes and e4m3 block scales.

Rows `[row_offsets[g], row_offsets[g + 1])` form segment g (an expert) with global scale
`global_scales[g]`; only `row_offsets` on the device says how many rows there are. Per
16-element block: `sf = e4m3_rne_satfinite(gs * amax / 6)`, `q = e2m1(x * gs / f32(sf))`
(correctly rounded fp32 operations), codes 0 where sf is not positive (a zero block; a NaN block
keeps its NaN scale 0x7F), element 2i in the low nibble.

The kernel streams the rows through shared memory, a ring of stages per warp that its lanes
fill with `cp.async` (`QuantizeNvfp4`); a lane quantizes a block from registers
(`quantize_nvfp4_pairs`, which the dispatch encoder `kernels.encode` and the quad kernel
`kernels.quantize_quads` share). Scales are linear `[rows, K / 16]`, or in the 128x4 layout
(`layouts.scales`) where each segment starts on a fresh 128-row block, its padding rows (and
padding scale columns) written as zeros by a pass of their own; for 128x4 scales of an input
larger than L2 the library runs `kernels.quantize_quads` instead, which takes the rows four at
a time so that the scales go out in whole 16-byte pieces.

The e2m1 encoder is software on sm_90a (`e2m1_pairs_word`: three fmas into the integer-spaced
fp32 range and two mins, signs from the bf16 bits) and the hardware
`cvt.rn.satfinite.e2m1x2.f32` on sm_100a; two configurations. Each block divides by its scale
with a reciprocal split in two and a product and an fma per element
(`kernels.division.divide_split`), the quotient bit for bit the correctly rounded one.
"""

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.bulk_copy import cp_async_16
from kernels.division import (FAST_LIMIT, divide_split, reciprocal_low,
                              split_reciprocal, with_sign_of)
from kernels.memory import scale_offset, store_i32, store_u8
from kernels.scan import WARP, warp_exclusive_scan
from layouts.abi import GridRule, KernelSpec, Param
from layouts.scales import ATOM_BYTES

BLOCK = 16
BLOCK_BYTES = 2 * BLOCK  # bf16
CHUNK_BYTES = WARP * BLOCK_BYTES  # a warp's chunk: a block per lane
ATOM_ROWS = 128
MAX_SEGMENTS = 272
E4M3_CODES = 128  # the non-negative e4m3 codes: the scale table's entries
# The scale table (`fill_scale_table`): per code (r_hi, r_lo, sf, 0), 16 bytes.
SCALE_TABLE_BYTES = 4 * 4 * E4M3_CODES


def scale_table_layout():
    """Layout of the scale table: field f of code c at 4 c + f (Float32)."""
    return cute.make_layout((4, E4M3_CODES), stride=(1, 4))


def _fp32(value: float) -> float:
    """`value` rounded to the nearest fp32."""
    return struct.unpack("f", struct.pack("f", value))[0]


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


# The 64-bit rotation of rotate_left64, one word per snippet: `$1` lo, `$2` hi, `$3` bits in
# [0, 64); after swapping the words for 32 bits or more, a funnel shift by the rest (0 included).
ROTATE_PTX = ("{{ .reg .pred p; .reg .b32 a, b, c; setp.ge.u32 p, $3, 32; selp.b32 a, $2, $1, p; "
              "selp.b32 b, $1, $2, p; and.b32 c, $3, 31; shf.l.wrap.b32 $0, {}, c; }}")


@dsl_user_op
def rotate_left64(lo: Int32, hi: Int32, bits: Int32, *, loc=None, ip=None):
    """(lo, hi) of the 64-bit value `hi:lo` rotated left by `bits` (in [0, 64))."""
    args = [Int32(lo), Int32(hi), Int32(bits)]
    return (Int32(_asm(T.i32(), args, ROTATE_PTX.format("b, a"), "=r,r,r,r", loc, ip)),
            Int32(_asm(T.i32(), args, ROTATE_PTX.format("a, b"), "=r,r,r,r", loc, ip)))


@dsl_user_op
def f32_bits(value: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of an fp32 value as an int32."""
    return Int32(_asm(T.i32(), [Float32(value)], "mov.b32 $0, $1;", "=r,f", loc, ip))


@dsl_user_op
def bits_f32(value: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of 32 bits."""
    return Float32(_asm(T.f32(), [Int32(value)], "mov.b32 $0, $1;", "=f,r", loc, ip))


@cute.jit
def read_segment_inputs(row_offsets: cute.Pointer, scales, num_segments, tidx):
    """A stream kernel's small reads, all in one round trip before its bulk loads (queued behind
    them they would wait for megabytes): (`row_offsets[tidx]` for tidx <= S, else 0, which
    `load_segment_blocks(..., offset=)` stores; `scales[tidx]` for tidx < S, else 0, or 1 where
    `scales` is None; the row count `row_offsets[S]`). The CTA has more than MAX_SEGMENTS
    threads."""
    offsets = cute.make_tensor(row_offsets, cute.make_layout(num_segments + 1))
    offset = Int32(0)
    if tidx <= num_segments:
        offset = offsets[tidx]
    scale = Float32(1.0)
    if cutlass.const_expr(scales is not None):
        scale = Float32(0.0)
        if tidx < num_segments:
            scale = cute.make_tensor(scales, cute.make_layout(num_segments))[tidx]
    return offset, scale, offsets[num_segments]


@cute.jit
def warp_run(me, warps, count):
    """(first, number) of warp `me`'s equal share of `count` consecutive items among `warps`
    (shares differ by at most one, the longer ones spread evenly over `me`: a CTA's consecutive
    warps, and so an SM's, get within one item of their share of the work).

    The first item is floor(me * count / warps), computed as me * q + floor(me * r / warps)
    with (q, r) = divmod(count, warps): unsigned 32-bit divisions only ((me + 1) * r <= warps^2,
    so fewer than 65536 warps; a grid is a few CTAs an SM at most). It lies on the path from
    the row count to a stream's first loads, where a 64-bit quotient and signed corrections
    cost instructions that every warp of the SM issues before its first load."""
    c = Uint32(count)
    w = Uint32(warps)
    m = Uint32(me)
    q = c // w
    r = c - q * w
    mr = m * r // w
    return Int32(m * q + mr), Int32(q + (m + Uint32(1)) * r // w - mr)


@cute.jit
def load_segment_blocks(row_offsets: cute.Pointer, num_segments, s_off: cute.Tensor,
                        s_first: cute.Tensor, tidx, threads: cutlass.Constexpr,
                        offset=None):
    """The whole CTA: `s_off[g] = row_offsets[g]` for g <= S, and `s_first[g]` = the first
    128-row scale block of segment g (each segment starts a fresh block), `s_first[S]` the
    blocks in all. Shared-memory tensors; ends with a barrier. `offset`: this thread's
    `read_segment_inputs`' offset, already read (the CTA then has more than MAX_SEGMENTS
    threads)."""
    if cutlass.const_expr(offset is None):
        offsets = cute.make_tensor(row_offsets, cute.make_layout(num_segments + 1))
        for g in cutlass.range(tidx, num_segments + 1, threads):
            s_off[g] = offsets[g]
    else:
        if tidx <= num_segments:
            s_off[tidx] = offset
    cute.arch.sync_threads()
    for g in cutlass.range(tidx, num_segments, threads):
        s_first[g] = (s_off[g + 1] - s_off[g] + ATOM_ROWS - 1) // ATOM_ROWS
    cute.arch.sync_threads()
    if tidx < WARP:
        warp_exclusive_scan(s_first, s_first, num_segments, tidx % WARP)
    cute.arch.sync_threads()


def _e2m1_code_lines(saturate: bool) -> list[str]:
    """PTX lines giving `k<i>` the e2m1 code of |`$<i+1>`| in its low byte, i < 8 (f32
    registers a, c, d and b32 k declared by the caller): |x| rounded to nearest at each of
    e2m1's steps (0.5, 1, 2) by adding it, scaled by the step's inverse, to 1.5 * 2^23 plus
    the offset that maps that step's values onto their codes (0, 2, 4), so a code lands in the
    low mantissa bits; the least of the three is the code.
    Without `saturate` the value must be below 7."""
    lines = []
    for i in range(8):
        cap = f"min.f32 d{i}, d{i}, 0f4B400007; " if saturate else ""
        lines.append(
            f"abs.f32 a{i}, ${i + 1}; fma.rn.f32 c{i}, a{i}, 0f40000000, 0f4B400000; "
            f"add.rn.f32 d{i}, a{i}, 0f4B400002; min.f32 c{i}, c{i}, d{i}; "
            f"fma.rn.f32 d{i}, a{i}, 0f3F000000, 0f4B400004; {cap}"
            f"min.f32 c{i}, c{i}, d{i}; mov.b32 k{i}, c{i};")
    return lines


def _e2m1_word_ptx(saturate: bool) -> str:
    """PTX of e2m1_word: `$1..$8` the values, `$9..$16` their sign sources, `$0` the word.
    Without `saturate` the values must be below 7 in magnitude."""
    lines = ["{ .reg .f32 a<8>, c<8>, d<8>; .reg .b32 k<8>, t<4>, ev, od, sv, so;"]
    lines += _e2m1_code_lines(saturate)
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


E2M1_WORD_PTX = _e2m1_word_ptx(saturate=True)
E2M1_WORD_BELOW_7_PTX = _e2m1_word_ptx(saturate=False)


@dsl_user_op
def e2m1_word(values: list, signs: list, saturate: bool = True, *, loc=None, ip=None) -> Int32:
    """The 8 e2m1 codes of `values` (fp32, none NaN), element i in nibble i, each with the sign
    bit of `signs[i]`: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, saturating
    at 6.

    For a = |v|, over [0, 2], [2, 4] and [4, 6] the code is 2a, a + 2 and a/2 + 4 rounded to an
    integer with ties to even (the midpoints 0.25, 0.75, ..., 5 land on half-integers and go to
    the even code, as e2m1 requires), so it is round(min(2a, a + 2, a/2 + 4, 7)); rounding is
    monotone, so that is the min of the four rounded. Each is one fma into [2^23, 2^24), where
    fp32 values are the integers E2M1_ROUND + code: byte 0 of the bits is the code.
    `tests/test_division.py` checks every fp32 magnitude against the threshold rule.
    `saturate=False` (one min less per element): every |value| is below 7, where the code
    never exceeds 7 unclamped."""
    args = [Float32(v) for v in values] + [Float32(v) for v in signs]
    return Int32(_asm(T.i32(), args, E2M1_WORD_PTX if saturate else E2M1_WORD_BELOW_7_PTX,
                      "=r," + ",".join(["f"] * 16), loc, ip))


@cute.jit
def e2m1_words(vals: cute.Tensor, gs: Float32, sf: Float32, amax: Float32, usable,
               words: cute.Tensor, e2m1: cutlass.Constexpr, divide: cutlass.Constexpr = True,
               r: Float32 = Float32(0.0), given_r: cutlass.Constexpr = False,
               r_lo: Float32 = Float32(0.0), bounded=None):
    """words[w] = the 8 e2m1 codes of `(vals[8w + i] * gs) / sf` (correctly rounded fp32
    multiply and divide), element 2i in the low nibble of byte i; all zero unless `usable`
    (then gs > 0 and sf > 0). `amax`: the largest |vals|. `divide=False` (MXFP4, whose scale is a
    power of two folded into gs): `vals * gs` alone. `e2m1`: "software" | "hardware".
    `given_r`: `(r, r_lo)` is sf's `split_reciprocal` already (else it is computed here).
    `bounded` (`divide=False`, a runtime flag, software encoder): every product is below 7 in
    magnitude, so the codes need no saturation (SwiGLU-OAI's MXFP4 with a finite amax); None:
    always saturate.

    The division is `kernels.division.divide_split` with one split reciprocal per block (sf is
    an e4m3 value) unless `gs * amax` exceeds FAST_LIMIT (or is not a number), where `/` runs
    instead."""
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = Int32(0)
    if usable:
        if cutlass.const_expr(not divide):
            _encode_bounded(vals, gs, sf, Float32(0.0), words, e2m1, "none", bounded)
        elif gs * amax <= Float32(FAST_LIMIT):
            if cutlass.const_expr(not given_r):
                r, r_lo = split_reciprocal(sf)
            _encode_words(vals, gs, r_lo, r, words, e2m1, "reciprocal")
        else:
            _encode_words(vals, gs, sf, Float32(0.0), words, e2m1, "true")


@cute.jit
def _encode_bounded(vals: cute.Tensor, gs: Float32, sf: Float32, r: Float32,
                    words: cute.Tensor, e2m1: cutlass.Constexpr, division: cutlass.Constexpr,
                    bounded):
    """`_encode_words`, unsaturated where the runtime flag `bounded` says every quotient is
    below 7 (software encoder; `bounded` None: always saturated)."""
    if cutlass.const_expr(bounded is None or e2m1 != "software"):
        _encode_words(vals, gs, sf, r, words, e2m1, division)
    else:
        unsaturated_if(bounded, lambda saturate: _encode_words(vals, gs, sf, r, words, e2m1,
                                                                division, saturate))


@cute.jit
def unsaturated_if(bounded, encode: cutlass.Constexpr):
    """`encode(saturate)`, an encoder traced twice: unsaturated where the runtime flag `bounded`
    says every value is below 7, saturating otherwise."""
    if bounded:
        encode(False)
    else:
        encode(True)


@cute.jit
def _encode_words(vals: cute.Tensor, gs: Float32, sf: Float32, r: Float32, words: cute.Tensor,
                  e2m1: cutlass.Constexpr, division: cutlass.Constexpr,
                  saturate: cutlass.Constexpr = True):
    """The codes of e2m1_words; `division`: "none" (y = v * gs), "reciprocal" (`divide_split`
    with `(r, sf)` = sf's split reciprocal (r_hi, r_lo), the sign from v * gs) or "true" (`/` by
    sf; any y, a NaN encoded as +0). `saturate=False`: every |y| is below 7 (software
    encoder)."""
    for w in cutlass.range_constexpr(cute.size(words)):
        ys = []
        signs = []
        for i in cutlass.range_constexpr(8):
            v = vals[8 * w + i]
            y = v * gs
            sign = y
            if cutlass.const_expr(division == "reciprocal"):
                y = divide_split(y, r, sf)  # its magnitude; the sign is v * gs's
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
            words[w] = e2m1_word(ys, signs, saturate)




def _bf16x2_amax_ptx() -> str:
    """PTX of bf16x2_amax: `$1..$8` eight bf16 pairs, `$0` the largest magnitude as fp32."""
    lines = ["{ .reg .b32 m<4>, n<2>, top, bottom; .reg .f32 a, b;"]
    # max.xorsign.abs: the larger magnitude of each half (its sign the xor of the two, which the
    # next step's abs discards); .NaN: a NaN anywhere stays NaN to the end.
    for i in range(4):
        lines.append(f"max.NaN.xorsign.abs.bf16x2 m{i}, ${2 * i + 1}, ${2 * i + 2};")
    lines.append("max.NaN.xorsign.abs.bf16x2 n0, m0, m1; max.NaN.xorsign.abs.bf16x2 n1, m2, m3;")
    lines.append("max.NaN.xorsign.abs.bf16x2 m0, n0, n1;")
    lines.append("and.b32 top, m0, 0xFFFF0000; shl.b32 bottom, m0, 16; mov.b32 a, top; "
                 "mov.b32 b, bottom; abs.f32 a, a; abs.f32 b, b; max.NaN.f32 $0, a, b; }")
    return " ".join(lines)


BF16X2_AMAX_PTX = _bf16x2_amax_ptx()
LOW_BF16_PTX = "{ .reg .b32 t; shl.b32 t, $1, 16; mov.b32 $0, t; }"
HIGH_BF16_PTX = "{ .reg .b32 t; and.b32 t, $1, 0xFFFF0000; mov.b32 $0, t; }"


@dsl_user_op
def bf16x2_amax(pairs: list, *, loc=None, ip=None) -> Float32:
    """The largest |value| of the 16 bf16 values in 8 words (pairs), as fp32; NaN if any is."""
    return Float32(_asm(T.f32(), [Int32(p) for p in pairs], BF16X2_AMAX_PTX,
                        "=f," + ",".join(["r"] * 8), loc, ip))


@dsl_user_op
def low_bf16(pair: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of the bf16 in the low half of `pair`."""
    return Float32(_asm(T.f32(), [Int32(pair)], LOW_BF16_PTX, "=f,r", loc, ip))


@dsl_user_op
def high_bf16(pair: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of the bf16 in the high half of `pair`."""
    return Float32(_asm(T.f32(), [Int32(pair)], HIGH_BF16_PTX, "=f,r", loc, ip))


def _e2m1_pairs_word_ptx(saturate: bool) -> str:
    """PTX of e2m1_pairs_word: `$1..$8` the values, `$9..$12` the bf16 pairs whose signs they
    take (element 2k the low half of pair k, 2k + 1 the high half), `$0` the word. Without
    `saturate` the values must be below 7 in magnitude (no code above 7 can arise)."""
    lines = ["{ .reg .f32 a<8>, c<8>, d<8>; .reg .b32 k<8>, p<4>, t<2>, u<2>, w, se, so;"]
    lines += _e2m1_code_lines(saturate)
    # Byte 0 of each k is its code and bits 3..7 are zero, so k_even + (k_odd << 4) has the
    # pair's byte in byte 0 (the bits above only carry upwards); then the four bytes gathered.
    for j in range(4):
        lines.append(f"shl.b32 p{j}, k{2 * j + 1}, 4; add.u32 p{j}, p{j}, k{2 * j};")
    lines.append("prmt.b32 t0, p0, p1, 0x0040; prmt.b32 t1, p2, p3, 0x4000; "
                 "prmt.b32 w, t0, t1, 0x7610;")
    # The sign bytes (byte 1: element 2k, byte 3: element 2k + 1) of the four pairs, then each
    # element's sign spread over a byte (selectors with bit 3 set) and masked to its nibble's
    # bit 3.
    lines.append("prmt.b32 u0, $9, $10, 0x7531; prmt.b32 u1, $11, $12, 0x7531; "
                 "prmt.b32 se, u0, u1, 0xECA8; prmt.b32 so, u0, u1, 0xFDB9; "
                 "lop3.b32 w, w, se, 0x08080808, 0xF8; lop3.b32 $0, w, so, 0x80808080, 0xF8; }")
    return " ".join(lines)


E2M1_PAIRS_WORD_PTX = _e2m1_pairs_word_ptx(saturate=True)
E2M1_PAIRS_WORD_BELOW_7_PTX = _e2m1_pairs_word_ptx(saturate=False)


@dsl_user_op
def e2m1_pairs_word(values: list, pairs: list, saturate: bool = True, *, loc=None,
                    ip=None) -> Int32:
    """`e2m1_word` of 8 values whose signs are those of 8 bf16 values in 4 words (element 2k
    the low half of `pairs[k]`): the sign bits are gathered from the bf16 pairs with byte
    permutes instead of from each fp32 value. `saturate=False` (one min less per element):
    every |value| is below 7, where the code never exceeds 7 unclamped (round(|v| / 2 + 4)
    < 7.5)."""
    args = [Float32(v) for v in values] + [Int32(p) for p in pairs]
    return Int32(_asm(T.i32(), args,
                      E2M1_PAIRS_WORD_PTX if saturate else E2M1_PAIRS_WORD_BELOW_7_PTX,
                      "=r," + ",".join(["f"] * 8 + ["r"] * 4), loc, ip))


# RN(1/6) in fp32 and the low half of its split reciprocal, RN((1 - 6 * SIXTH) * SIXTH): 6 is
# 3 * 2, an e4m3 value, so divide_split(m, SIXTH, SIXTH_LO) is RN(m / 6).
SIXTH = _fp32(1.0 / 6.0)
SIXTH_LO = _fp32((1.0 - 6.0 * SIXTH) * SIXTH)  # both products exact in fp64
# A block whose s = gs * amax / 6 lies in [2^-6, 464) gets an e4m3 scale within 2^-4 of s
# (normal, unsaturated), so every quotient |x * gs / sf| <= 6 / (1 - 2^-4) (plus ulps) < 7.
BOUNDED_LOW = 2.0 ** -6
BOUNDED_HIGH = 464.0


@cute.jit
def nvfp4_scale_byte(gs: Float32, amax: Float32):
    """`(e4m3(gs * amax / 6) byte, fast, bounded)`: the quotient s correctly rounded, by one
    product and an fma (`divide_split`; 6 is an e4m3 value) where
    `0 < gs * amax <= FAST_LIMIT` (`fast`), else by `/` (zero, negative, huge, infinite or
    NaN); `bounded`: s in [BOUNDED_LOW, BOUNDED_HIGH), every quotient by the scale below 7."""
    m = gs * amax
    fast = (m > Float32(0.0)) & (m <= Float32(FAST_LIMIT))
    q = Float32(0.0)
    if fast:
        q = divide_split(m, Float32(SIXTH), Float32(SIXTH_LO))
    else:
        q = m / Float32(6.0)
    bounded = (q >= Float32(BOUNDED_LOW)) & (q < Float32(BOUNDED_HIGH))
    return cvt_e4m3_byte(q), fast, bounded


@cute.jit
def fill_scale_table(table: cute.Tensor, tidx, threads: cutlass.Constexpr):
    """`table[:, c]` = (r_hi, r_lo, sf, 0): the e4m3 value sf of code c and its
    `split_reciprocal`, for the 128 non-negative codes (shared memory, `scale_table_layout`;
    the caller synchronises before reading)."""
    for c in cutlass.range(tidx, E4M3_CODES, threads):
        sf = e4m3_byte_to_f32(c)
        r_hi = Float32(1.0) / sf
        table[0, c] = r_hi
        table[1, c] = reciprocal_low(sf, r_hi)
        table[2, c] = sf
        table[3, c] = Float32(0.0)


@cute.jit
def quantize_nvfp4_pairs(pairs: cute.Tensor, codes: cute.Tensor, gs: Float32,
                         e2m1: cutlass.Constexpr, table: cute.Tensor):
    """One 16-element block held as 8 bf16 pairs (register words, element 2k the low half of
    pair k): its 8 code bytes into the 2 register words `codes`, its e4m3 scale byte returned.
    `sf = e4m3(gs * amax / 6)`, `q = e2m1((x * gs) / sf)`, correctly rounded fp32 operations,
    codes 0 where sf is not positive. `table`: `fill_scale_table`'s.

    The block's amax is taken on the bf16 pairs (max of magnitudes is exact in bf16); a block
    with `0 < gs * amax <= FAST_LIMIT` divides by a split reciprocal and takes the codes' signs
    from the bf16 sign bits (v * gs has v's sign for 0 < gs < inf, underflow included), and
    one whose scale is normal and unsaturated skips the saturation of the codes."""
    words = [pairs[k] for k in range(BLOCK // 2)]
    amax = bf16x2_amax(words)
    byte, fast, bounded = nvfp4_scale_byte(gs, amax)
    codes[0] = Int32(0)
    codes[1] = Int32(0)
    # Codes 1..126: a positive finite scale (0 is zero, 0x7F NaN, 0x80 and up negative).
    if (byte > 0) & (byte < 0x7F):
        r = table[0, byte]
        r_lo = table[1, byte]
        vals = cute.make_rmem_tensor(cute.make_layout(BLOCK), Float32)
        for k in cutlass.range_constexpr(BLOCK // 2):
            vals[2 * k] = low_bf16(words[k])
            vals[2 * k + 1] = high_bf16(words[k])
        if cutlass.const_expr(e2m1 == "software"):
            if fast:
                unsaturated_if(bounded, lambda saturate: _divide_encode(vals, words, gs, r, r_lo,
                                                                         codes, saturate))
            else:
                _encode_words(vals, gs, table[2, byte], Float32(0.0), codes, e2m1, "true")
        else:
            e2m1_words(vals, gs, table[2, byte], amax, True, codes, e2m1, r=r, given_r=True,
                       r_lo=r_lo)
    return byte


@cute.jit
def _divide_encode(vals: cute.Tensor, words: list, gs: Float32, r: Float32, r_lo: Float32,
                   codes: cute.Tensor, saturate: cutlass.Constexpr):
    """codes[w] = the e2m1 codes of `divide_split(vals * gs, r, r_lo)` (sf's split
    reciprocal), signs from the bf16 pairs."""
    for w in cutlass.range_constexpr(2):
        ys = [divide_split(vals[8 * w + i] * gs, r, r_lo) for i in range(8)]
        codes[w] = e2m1_pairs_word(ys, words[4 * w:4 * w + 4], saturate)


SEARCH_STEPS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # covers MAX_SEGMENTS


@cute.jit
def segment_of(s_start: cute.Tensor, num_segments, position) -> Int32:
    """The last segment g < num_segments with `s_start[g] <= position` (starts non-decreasing;
    an empty segment shares its start with the next one), by binary search."""
    seg = Int32(0)
    for step in cutlass.range_constexpr(len(SEARCH_STEPS)):
        probe = seg + SEARCH_STEPS[step]
        if probe < num_segments:
            if s_start[probe] <= position:
                seg = probe
    return seg


@cute.jit
def next_row_segment(s_off: cute.Tensor, s_first: cute.Tensor, s_gs: cute.Tensor, seg, row):
    """A stream's move to `row` (at or past segment `seg`'s first row; `load_segment_blocks`'
    tables and each segment's global scale `s_gs`): (its segment, that segment's global scale,
    its scale row in the 128x4 layout)."""
    while row >= s_off[seg + 1]:
        seg += 1
    return seg, s_gs[seg], s_first[seg] * ATOM_ROWS + row - s_off[seg]


@cute.jit
def zero_scale_padding(scales: cute.Pointer, s_off: cute.Tensor, s_first: cute.Tensor,
                       num_segments, blocks, me, warps, lane):
    """Zero the 128x4 scale bytes no block writes, `blocks` scales a row: whole rows past each
    segment's rows up to its 128-row block, and the columns past `blocks` of the others. Warp
    `me` of `warps` takes every `warps`-th scale row (`s_off`, `s_first`: `load_segment_blocks`'s
    tables)."""
    scale_cols = (blocks + 3) // 4 * 4
    for srow in cutlass.range(me, s_first[num_segments] * ATOM_ROWS, warps):
        seg = segment_of(s_first, num_segments, srow // ATOM_ROWS)
        local = srow - s_first[seg] * ATOM_ROWS
        begin = blocks
        if local >= s_off[seg + 1] - s_off[seg]:
            begin = 0
        for kb in cutlass.range(begin + lane, scale_cols, WARP):
            store_u8(scales.toint() + scale_offset(srow, kb, scale_cols // 4), Int32(0))


@cute.jit
def zero_padding_atoms(scales: cute.Pointer, s_off: cute.Tensor, s_first: cute.Tensor,
                       num_segments, blocks, me, warps, lane):
    """`zero_scale_padding` for the padding rows only (the kernel writes every scale column of
    its rows, or `blocks` is a multiple of 4): segment g's padding rows are the rows past its
    n = count % 128 in its last, partial 128-row block, and a warp zeroes one 512-byte atom of
    that block (4 scale columns) at a time, warp `me` of `warps` taking every `warps`-th of the
    S x rk atoms (`s_off`, `s_first`: `load_segment_blocks`'s tables). Lane s takes 16-byte slot
    s of the atom, rows s, s + 32, s + 64 and s + 96 (4 bytes each): the rows from the first at
    or past n on are padding, the slot's last bytes, zeroed as one 16-byte piece, or 12, 8 or 4
    bytes in aligned 4- and 8-byte pieces. A row at a time (4 bytes in each of the atoms of a
    row, a store into 32 lines), padding was the bulk of the kernel's time where segments end
    inside a block (`perf/results/quant-2026-11-26-H200-padding.json`)."""
    rk = (blocks + 3) // 4
    zeros = cute.make_rmem_tensor(cute.make_layout(4), Int32)
    pair = cute.make_rmem_tensor(cute.make_layout(2), Int32)
    for w in cutlass.range_constexpr(4):
        zeros[w] = Int32(0)
    for w in cutlass.range_constexpr(2):
        pair[w] = Int32(0)
    atoms = num_segments * rk
    if s_first[num_segments] * ATOM_ROWS == s_off[num_segments] - s_off[0]:
        atoms = 0  # no segment ends inside a block
    for item in cutlass.range(me, atoms, warps):
        seg = item // rk
        atom = item - seg * rk
        count = s_off[seg + 1] - s_off[seg]
        tail = count % ATOM_ROWS
        if (count > 0) & (tail > 0):
            block = s_first[seg] + count // ATOM_ROWS
            slot = (scales.toint() + (Int64(block) * Int64(rk) + Int64(atom)) * ATOM_BYTES
                    + Int64(lane * 16))
            rows = cutlass.min((tail - lane + WARP - 1) // WARP, 4)  # the slot's rows below n
            if rows == 0:
                cute.autovec_copy(zeros, cute.make_tensor(_ptr(Int32, slot, 16),
                                                          cute.make_layout(4)))
            if rows == 1:
                store_i32(slot + 4, Int32(0))
            if (rows == 1) | (rows == 2):
                cute.autovec_copy(pair, cute.make_tensor(_ptr(Int32, slot + 8, 8),
                                                         cute.make_layout(2)))
            if rows == 3:
                store_i32(slot + 12, Int32(0))


@cute.jit
def zero_padding(scales: cute.Pointer, s_off: cute.Tensor, s_first: cute.Tensor, num_segments,
                 blocks, me, warps, lane, columns_written: cutlass.Constexpr = False):
    """The 128x4 scale bytes no block writes, zeroed: by `zero_padding_atoms` where `blocks` is a
    multiple of 4 or the kernel writes its rows' padding columns itself (`columns_written`: whole
    4-column words), else by `zero_scale_padding` (every scale row, for the padding columns)."""
    if cutlass.const_expr(columns_written):
        zero_padding_atoms(scales, s_off, s_first, num_segments, blocks, me, warps, lane)
    else:
        if blocks % 4 == 0:
            zero_padding_atoms(scales, s_off, s_first, num_segments, blocks, me, warps, lane)
        else:
            zero_scale_padding(scales, s_off, s_first, num_segments, blocks, me, warps, lane)


class QuantizeLaunch:
    """What every quantize_nvfp4 kernel shares: its configuration (`order`: "rows" or "quads",
    the order of the rows' stream), the launch ABI the runtime checks and the launch: a
    persistent grid of `grid_ctas` CTAs of `warps` warps, each warp a ring of `stages` stages of
    `32 * steps` blocks in shared memory, and the segment and scale tables."""

    order = "rows"

    def __init__(self, scales: str, e2m1: str, warps: int = 16, stages: int = 2, steps: int = 2):
        if scales not in ("linear", "128x4") or e2m1 not in ("software", "hardware"):
            raise ValueError(f"scales linear|128x4, e2m1 software|hardware; got {scales}, {e2m1}")
        self.scales = scales
        self.e2m1 = e2m1
        self.warps = warps
        self.stages = stages
        self.steps = steps
        self.chunk = WARP * steps  # blocks
        self.threads = WARP * warps
        if self.threads < MAX_SEGMENTS:  # a thread per row offset (`read_segment_inputs`)
            raise ValueError(f"quantize_nvfp4 needs at least {MAX_SEGMENTS} threads")
        self.arches = ("sm_100a",) if e2m1 == "hardware" else ("sm_90a",)

    @property
    def smem_bytes(self) -> int:
        ring = self.warps * self.stages * self.chunk * BLOCK_BYTES
        tables = 3 * (MAX_SEGMENTS + 4) * 4 + SCALE_TABLE_BYTES
        return ring + tables + 256

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="quantize_nvfp4",
            config={"scales": self.scales, "e2m1": self.e2m1, "warps": self.warps,
                    "stages": self.stages, "steps": self.steps, "order": self.order},
            params=(
                Param("x", "ptr", "bfloat16", align=16),
                Param("row_offsets", "ptr", "int32", align=4,
                      min_elements=("num_segments", 1)),
                Param("global_scales", "ptr", "float32", align=4,
                      min_elements=("num_segments", 1)),
                Param("codes", "ptr", "uint8", align=8, writes=True),
                Param("scales", "ptr", "uint8", align=4, writes=True),
                Param("num_segments", "i32"),
                Param("rows", "i32"),
                Param("hidden", "i32"),
                Param("grid_ctas", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("grid_ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes={"block": BLOCK, "max_segments": MAX_SEGMENTS - 1, "warps": self.warps},
        )

    def _start(self, row_offsets, global_scales, num_segments, rows, tidx):
        """The kernel's shared memory (the warps' rings, `ring[:, b, stage, warp]` the 8 bf16
        pairs of block b of a chunk; the scale table; the segments' offsets, first scale blocks
        and global scales) and its small reads, issued first (queued behind the chunk loads they
        would wait for them): this thread's row offset, capped at `rows` (offsets past the input
        are taken as its end), and global scale, and the row count."""
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Int32, cute.make_layout((BLOCK // 2, self.chunk, self.stages,
                                                             self.warps)), byte_alignment=128)
        table = smem.allocate_tensor(Float32, scale_table_layout(), byte_alignment=16)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4),
                                       byte_alignment=16)
        s_gs = smem.allocate_tensor(Float32, cute.make_layout(MAX_SEGMENTS + 4),
                                    byte_alignment=16)
        offset, gs_mine, valid_rows = read_segment_inputs(row_offsets, global_scales,
                                                          num_segments, tidx)
        return (ring, table, s_off, s_first, s_gs, cutlass.min(offset, rows), gs_mine,
                valid_rows)

    @cute.jit
    def _tables(self, table: cute.Tensor, s_off: cute.Tensor, s_first: cute.Tensor,
                s_gs: cute.Tensor, row_offsets: cute.Pointer, num_segments, offset, gs_mine,
                valid_rows, rows, tidx):
        """The whole CTA fills the scale table and the segments' tables from `_start`'s reads
        (ends with a barrier); returns the rows to quantize, the row count capped at `rows`."""
        fill_scale_table(table, tidx, self.threads)
        if tidx < num_segments:
            s_gs[tidx] = gs_mine
        load_segment_blocks(row_offsets, num_segments, s_off, s_first, tidx, self.threads,
                            offset)
        return cutlass.min(valid_rows, rows)

    @cute.jit
    def __call__(self, x: cute.Pointer, row_offsets: cute.Pointer, global_scales: cute.Pointer,
                 codes: cute.Pointer, scales: cute.Pointer, num_segments: Int32, rows: Int32,
                 hidden: Int32, grid_ctas: Int32, stream):
        self.kernel(x, row_offsets, global_scales, codes, scales, num_segments, rows, hidden,
                    grid_ctas).launch(grid=(grid_ctas, 1, 1), block=(self.threads, 1, 1),
                                      smem=self.smem_bytes, stream=stream)


class QuantizeNvfp4(QuantizeLaunch):
    """The rows are one stream of blocks (block b: row b // (K / 16), column b % (K / 16), at
    byte 32 b of the input and 8 b of the codes), cut into chunks of `32 * steps` consecutive
    blocks, and each warp takes an equal run of consecutive chunks (`warp_run`); lane l
    quantizes blocks l, l + 32, ... of each chunk, its row, segment, global scale and scale
    address carried from its block before. The chunks come in through a ring of `stages`
    shared-memory stages per warp, each lane copying `2 * steps` 16-byte pieces of every chunk
    (`cp.async`, one group per chunk, `stages - 1` chunks ahead of the one computed): every
    piece load is one coalesced 512-byte warp access, and no lane issues a copy for the warp.

    The first chunks are requested before the row count is known (the round trip for
    `row_offsets` would otherwise come before any load), for the split of all `rows` rows of
    the input; when the offsets end below `rows` (a capacity) those loads are drained and the
    valid rows split again. The 128x4 layout's padding (the rows past each segment's last row
    up to its 128-row block, and scale columns past K / 16) is written as zeros by a pass of
    its own once the warp's blocks are done (`zero_padding`)."""

    @cute.kernel
    def kernel(self, x: cute.Pointer, row_offsets: cute.Pointer, global_scales: cute.Pointer,
               codes: cute.Pointer, scales: cute.Pointer, num_segments: Int32, rows: Int32,
               hidden: Int32, grid_ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        stages = self.stages
        ring, table, s_off, s_first, s_gs, offset, gs_mine, valid_rows = self._start(
            row_offsets, global_scales, num_segments, rows, tidx)
        blocks = hidden // BLOCK
        me = bidx * self.warps + warp
        warps = grid_ctas * self.warps
        # This warp's run if every row is valid, its first chunks requested at once.
        begin, n = warp_run(me, warps, (rows * blocks + self.chunk - 1) // self.chunk)
        src = self._first_loads(ring, warp, lane, x.toint(), begin, n, rows * blocks)
        total_rows = self._tables(table, s_off, s_first, s_gs, row_offsets, num_segments,
                                  offset, gs_mine, valid_rows, rows, tidx)
        total = total_rows * blocks
        if total_rows < rows:  # a capacity: drain the first loads, split the valid rows
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()
            begin, n = warp_run(me, warps, (total + self.chunk - 1) // self.chunk)
            src = self._first_loads(ring, warp, lane, x.toint(), begin, n, total)

        # This lane's first block, its row and column, and where its codes and scale byte go.
        block = begin * self.chunk + lane
        row = block // blocks
        col = block - row * blocks
        codes_at = codes.toint() + Int64(block) * 8
        rk = (blocks + 3) // 4
        seg = Int32(0)
        gs = Float32(0.0)
        scales_at = Int64(0)
        if row < total_rows:
            seg = segment_of(s_off, num_segments, row)
            seg, gs, scales_at = self._row_start(s_off, s_first, s_gs, seg, row, col, blocks,
                                                 rk, scales.toint())
        load = begin + stages - 1  # the next chunk to load (this lane's first piece at src)
        full = total // self.chunk  # chunks wholly inside the stream
        for i in cutlass.range(n):
            cute.arch.sync_warp()  # every lane has read the stage loaded next
            if i + stages - 1 < n:
                self._load(ring, (i + stages - 1) % stages, warp, lane, src, load, full, total)
            cute.arch.cp_async_commit_group()
            load += 1
            src = src + self.chunk * BLOCK_BYTES
            cute.arch.cp_async_wait_group(stages - 1)  # this lane's pieces of chunk i are in
            cute.arch.sync_warp()  # and every other lane's
            for t in cutlass.range_constexpr(self.steps):
                if row < total_rows:
                    pairs = cute.make_rmem_tensor(cute.make_layout(BLOCK // 2), Int32)
                    cute.autovec_copy(ring[None, lane + t * WARP, i % stages, warp], pairs)
                    words = cute.make_rmem_tensor(cute.make_layout(2), Int32)
                    byte = quantize_nvfp4_pairs(pairs, words, gs, self.e2m1, table)
                    cute.autovec_copy(words, cute.make_tensor(_ptr(Int32, codes_at, 8),
                                                              cute.make_layout(2)))
                    store_u8(scales_at, byte)
                codes_at = codes_at + WARP * 8
                col = col + WARP
                if col < blocks:
                    if cutlass.const_expr(self.scales == "128x4"):
                        scales_at = scales_at + scale_offset(0, WARP, 0)
                    else:
                        scales_at = scales_at + WARP
                else:
                    while col >= blocks:
                        col = col - blocks
                        row = row + 1
                    if row < total_rows:
                        seg, gs, scales_at = self._row_start(s_off, s_first, s_gs, seg, row,
                                                             col, blocks, rk, scales.toint())

        # The padding last, after this warp's blocks.
        if cutlass.const_expr(self.scales == "128x4"):
            zero_padding(scales, s_off, s_first, num_segments, blocks, me, warps, lane)

    @cute.jit
    def _row_start(self, s_off: cute.Tensor, s_first: cute.Tensor, s_gs: cute.Tensor, seg, row,
                   col, blocks, rk, scales_base):
        """(segment, global scale, scale byte address) of column `col` of `row` (at or past
        segment `seg`'s first row)."""
        seg, gs, unit = next_row_segment(s_off, s_first, s_gs, seg, row)
        at = scales_base + Int64(row) * Int64(blocks) + Int64(col)
        if cutlass.const_expr(self.scales == "128x4"):
            at = scales_base + scale_offset(unit, col, rk)
        return seg, gs, at

    @cute.jit
    def _first_loads(self, ring: cute.Tensor, warp, lane, x_base, begin, n, total):
        """The `stages - 1` chunks from `begin` of a run of `n`, one group each (empty past the
        run), `total` blocks in the stream; returns this lane's first piece address of the
        chunk after them."""
        src = x_base + Int64(begin) * (self.chunk * BLOCK_BYTES) + Int64(lane * 16)
        full = total // self.chunk
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < n:
                self._load(ring, s, warp, lane, src, begin + s, full, total)
            cute.arch.cp_async_commit_group()
            src = src + self.chunk * BLOCK_BYTES
        return src

    @cute.jit
    def _load(self, ring: cute.Tensor, s, warp, lane, src, chunk, full, total):
        """This lane's pieces of chunk `chunk` into stage s: bytes 16 lane + 512 j of it from
        global address `src` on, at the same offsets in the stage; in the stream's last chunk
        (from `full` on) only pieces of its `total` blocks."""
        stage = ring[None, None, s, warp].iterator
        if chunk < full:
            for j in cutlass.range_constexpr(2 * self.steps):
                cp_async_16(stage + (lane * 4 + j * (CHUNK_BYTES // 8)),
                            src + j * (CHUNK_BYTES // 2))
        else:
            for j in cutlass.range_constexpr(2 * self.steps):
                if Int64(chunk) * self.chunk + (lane + j * WARP) // 2 < Int64(total):
                    cp_async_16(stage + (lane * 4 + j * (CHUNK_BYTES // 8)),
                                src + j * (CHUNK_BYTES // 2))
