"""`quantize_nvfp4`: bf16 rows grouped in segments -> NVFP4 codes and e4m3 block scales.

Rows `[row_offsets[g], row_offsets[g + 1])` form segment g (an expert) with global scale
`global_scales[g]`; only `row_offsets` on the device says how many rows there are. A thread owns
one 16-element block: `sf = e4m3_rne_satfinite(gs * amax / 6)`, `q = e2m1(x * gs / f32(sf))`
(true fp32 divisions), codes 0 where sf is not positive (a zero block; a NaN block keeps its NaN
scale 0x7F), element 2i in the low nibble.

Scales are linear `[rows, K / 16]`, or in the 128x4 layout (`layouts.scales`) where each segment
starts on a fresh 128-row block: the grid walks *scale rows*, so the padding rows of every
segment's last block (and padding scale columns) are written as zeros by the same pass.

The e2m1 encoder is software on sm_90a (threshold comparisons, round to nearest even,
saturating) and the hardware `cvt.rn.satfinite.e2m1x2.f32` on sm_100a; two configurations.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

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
def e2m1_software(v: Float32) -> Int32:
    """e2m1 code of `v`: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, saturating
    at 6; the sign bit is the input's. The midpoints that round up to an even code use `>=`."""
    a = cute.arch.fmax(v, -v)
    code = Int32(0)
    if a > 0.25:
        code = code + 1
    if a >= 0.75:
        code = code + 1
    if a > 1.25:
        code = code + 1
    if a >= 1.75:
        code = code + 1
    if a > 2.5:
        code = code + 1
    if a >= 3.5:
        code = code + 1
    if a > 5.0:
        code = code + 1
    sign = Int32(0)
    if f32_bits(v) < 0 and a >= 0.0:  # the sign bit, -0 included; NaN (never here) gets none
        sign = Int32(8)
    return code + sign


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


@cute.jit
def e2m1_words(vals: cute.Tensor, gs: Float32, sf: Float32, usable, words: cute.Tensor,
               e2m1: cutlass.Constexpr):
    """words[w] = the 8 e2m1 codes of `(vals[8w + i] * gs) / sf` (true fp32 division), element
    2i in the low nibble of byte i; all zero unless `usable`. `e2m1`: "software" | "hardware"."""
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = Int32(0)
    if usable:
        for w in cutlass.range_constexpr(cute.size(words)):
            word = Int32(0)
            for p in cutlass.range_constexpr(4):
                even = (vals[8 * w + 2 * p] * gs) / sf
                odd = (vals[8 * w + 2 * p + 1] * gs) / sf
                pair = Int32(0)
                if cutlass.const_expr(e2m1 == "hardware"):
                    pair = cvt_e2m1x2(even, odd)
                else:
                    pair = e2m1_software(even) + (e2m1_software(odd) << 4)
                word = word | (pair << (8 * p))
            words[w] = word


@cute.jit
def quantize_nvfp4_block(src_addr, codes_addr, gs: Float32, e2m1: cutlass.Constexpr):
    """The 16 bf16 values at `src_addr` (16-byte aligned): write their 8 code bytes to
    `codes_addr` (8-byte aligned) and return their e4m3 scale byte. `sf = e4m3(gs * amax / 6)`,
    `q = e2m1((x * gs) / sf)`, true fp32 divisions, codes 0 where sf is not positive."""
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
    e2m1_words(vals, gs, sf, sf > 0.0, words, e2m1)
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
                    at = (Int64(unit // ATOM_ROWS) * Int64(rk) * 512 + Int64(kb // 4) * 512
                          + Int64(unit % 32) * 16 + Int64((unit // 32) % 4) * 4 + Int64(kb % 4))
                cute.make_tensor(_ptr(Uint8, scales.toint() + at, 1), cute.make_layout(1))[0] = \
                    Uint8(byte)

    @cute.jit
    def _quantize_block(self, x: cute.Pointer, codes: cute.Pointer, row, kb, hidden, gs):
        """Quantize block kb of `row`; write its 8 code bytes, return its e4m3 scale byte."""
        return quantize_nvfp4_block(
            x.toint() + (Int64(row) * Int64(hidden) + Int64(kb) * BLOCK) * 2,
            codes.toint() + Int64(row) * Int64(hidden // 2) + Int64(kb) * 8, gs, self.e2m1)
