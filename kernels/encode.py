"""The message of a token in the quantized formats (`layouts.formats`): FP8 blockwise with an
fp32 scale per 128 elements (exact, or rounded up to a power of two), or NVFP4 with an e4m3 scale
per 16 under the rank's global scale (read on the device), written into the local send buffer
that `ep_dispatch` (`kernels.dispatch`) streams from. The NVFP4 encoder exists twice, like
`quantize_nvfp4`: software e2m1 for sm_90a, the hardware conversion for sm_100a.

A token is quantized by ENCODE_THREADS threads (`encode_fp8_token`, `encode_nvfp4_token`), in
one of two places, both on the layer's SM budget:
- `ep_encode`, a kernel of its own before the dispatch: `ctas` CTAs (at most the budget's SMs),
  each of GROUPS groups, group g of CTA c taking tokens c * GROUPS + g, + ctas * GROUPS, ...;
- the dispatch kernel itself (its phase 1b), each channel its own tokens with every warp of its
  CTA, right after it has sent its counts: for a few tokens a channel (a decode step's), where a
  second launch would cost more than the quantization. FP8 there spreads the tokens' vectors over
  all of the CTA's threads (`encode_fp8_rows`), so two tokens take its twelve warps at once.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64

from kernels.bulk_copy import bulk_prefetch_l2
from kernels.copy import row_predicate, row_tiled_copy
from kernels.fp8 import FP8_BLOCK, scale_fp8_block
from kernels.memory import gmem_ptr, load_f32, store_f32, store_u8
from kernels.nvfp4 import (SCALE_TABLE_BYTES, fill_scale_table, quantize_nvfp4_pairs,
                           scale_table_layout)
from layouts.abi import ARCHES, GridRule, KernelSpec, Param
from layouts.config import FP8_SCALES

WARP = 32
FORMATS = ("fp8", "nvfp4")
E2M1_ARCHES = {"software": ("sm_90a",), "hardware": ("sm_100a",)}
BF16_PER_VECTOR = 8  # bf16 elements in one 128-bit access
NVFP4_BLOCK = 16  # elements per e4m3 scale
ENCODE_THREADS = 128  # threads that quantize one token together
# Tokens an `ep_encode` CTA encodes at once, a group of ENCODE_THREADS threads each: a budget of
# SMs runs one CTA each, so a CTA needs several tokens in flight to keep its SM's loads going.
GROUPS = 4
# A thread's loads of a token in flight before it quantizes the first: FP8 tiles of 8 elements a
# thread (8: a whole token up to H = 8192), NVFP4 16-element blocks (4: up to H = 8192). One
# load, quantize and store after another would wait for memory once per tile, seven times a
# token at H = 7168.
FP8_AHEAD = 8
NVFP4_AHEAD = 4


@cute.jit
def encode_fp8_token(tidx, src_addr, dst_addr, scales_addr, hidden, pow2: cutlass.Constexpr,
                     bf16_copy: cute.TiledCopy, fp8_copy: cute.TiledCopy):
    """Thread `tidx` of ENCODE_THREADS: the token at `src_addr` (bf16) to e4m3 codes at
    `dst_addr` and fp32 scales at `scales_addr`. Rows of 8 elements, one per thread; a
    128-element block is 16 consecutive lanes. The math of `kernels.fp8.scale_fp8_block`."""
    rows = hidden // BF16_PER_VECTOR
    layout = cute.make_layout((rows, BF16_PER_VECTOR), stride=(BF16_PER_VECTOR, 1))
    tiler = (ENCODE_THREADS, BF16_PER_VECTOR)
    g_x = cute.zipped_divide(cute.make_tensor(gmem_ptr(BFloat16, src_addr, 16), layout), tiler)
    g_q = cute.zipped_divide(cute.make_tensor(gmem_ptr(Float8E4M3FN, dst_addr, 8), layout),
                             tiler)
    g_c = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
    scales = cute.make_tensor(gmem_ptr(Float32, scales_addr, 16),
                              cute.make_layout(hidden // FP8_BLOCK))
    thr_in = bf16_copy.get_slice(tidx)
    thr_out = fp8_copy.get_slice(tidx)
    lane = tidx % WARP
    vectors_per_block = FP8_BLOCK // BF16_PER_VECTOR
    tiles = cute.ceil_div(rows, ENCODE_THREADS)
    # FP8_AHEAD tiles' loads in flight, then each tile quantized and stored.
    regs = [cute.make_fragment_like(thr_in.partition_S(g_x[((None, None), 0)]))
            for _ in range(FP8_AHEAD)]
    for first in cutlass.range(0, tiles, FP8_AHEAD):
        for a in cutlass.range_constexpr(FP8_AHEAD):
            tile = first + a
            regs[a].fill(0.0)
            if tile < tiles:
                cute.copy(bf16_copy, thr_in.partition_S(g_x[((None, None), tile)]), regs[a],
                          pred=row_predicate(thr_in.partition_S(g_c[((None, None), tile)]),
                                             rows))
        for a in cutlass.range_constexpr(FP8_AHEAD):
            tile = first + a
            if tile < tiles:
                t_q = thr_out.partition_D(g_q[((None, None), tile)])
                vals = cute.make_fragment_like(regs[a], Float32)
                vals.store(regs[a].load().to(Float32))
                scale = scale_fp8_block(vals, BF16_PER_VECTOR, vectors_per_block, pow2)
                q = cute.make_fragment_like(t_q)
                q.store(vals.load().to(Float8E4M3FN))
                cute.copy(fp8_copy, q, t_q,
                          pred=row_predicate(thr_in.partition_S(g_c[((None, None), tile)]),
                                             rows))
                vec = tile * ENCODE_THREADS + tidx
                if lane % vectors_per_block == 0 and vec < rows:
                    scales[vec // vectors_per_block] = scale


@cute.jit
def encode_fp8_rows(tidx, threads: cutlass.Constexpr, src_addr, dst_addr, msg_bytes,
                    scales_offset, hidden, rows, pow2: cutlass.Constexpr):
    """Thread `tidx` of `threads` (whole warps): `rows` consecutive bf16 tokens at `src_addr`
    (rows of `hidden`, a multiple of 128) to their messages, `msg_bytes` apart from `dst_addr`
    (e4m3 codes, then fp32 scales at `scales_offset`). The rows' 8-element vectors are spread
    over every thread at once (vector v = tile * threads + tidx of the rows taken as one; 16
    consecutive lanes share a 128-element block), each thread's FP8_AHEAD loads in flight before
    it quantizes the first: a few tokens take all of the CTA's warps, where a token each for
    ENCODE_THREADS threads left some idle and gave the rest a whole token's tiles in turn. The
    math of `kernels.fp8.scale_fp8_block`."""
    per_row = hidden // BF16_PER_VECTOR
    total = rows * per_row
    lane = tidx % WARP
    vectors_per_block = FP8_BLOCK // BF16_PER_VECTOR
    regs = [cute.make_rmem_tensor(cute.make_layout(BF16_PER_VECTOR), BFloat16)
            for _ in range(FP8_AHEAD)]
    for first in cutlass.range(0, total, threads * FP8_AHEAD):
        for a in cutlass.range_constexpr(FP8_AHEAD):
            v = first + a * threads + tidx
            regs[a].fill(0.0)
            if v < total:
                cute.autovec_copy(cute.make_tensor(
                    gmem_ptr(BFloat16, src_addr + Int64(v) * (BF16_PER_VECTOR * 2), 16),
                    cute.make_layout(BF16_PER_VECTOR)), regs[a])
        for a in cutlass.range_constexpr(FP8_AHEAD):
            # Uniform over the warp (its block shuffles need every lane); the lanes past the
            # rows quantize zeros and store nothing.
            if first + a * threads + tidx - lane < total:
                v = first + a * threads + tidx
                vals = cute.make_rmem_tensor(cute.make_layout(BF16_PER_VECTOR), Float32)
                vals.store(regs[a].load().to(Float32))
                scale = scale_fp8_block(vals, BF16_PER_VECTOR, vectors_per_block, pow2)
                q = cute.make_rmem_tensor(cute.make_layout(BF16_PER_VECTOR), Float8E4M3FN)
                q.store(vals.load().to(Float8E4M3FN))
                if v < total:
                    row = v // per_row
                    vec = v - row * per_row
                    msg = dst_addr + Int64(row) * Int64(msg_bytes)
                    cute.autovec_copy(q, cute.make_tensor(
                        gmem_ptr(Float8E4M3FN, msg + Int64(vec) * BF16_PER_VECTOR, 8),
                        cute.make_layout(BF16_PER_VECTOR)))
                    if lane % vectors_per_block == 0:
                        store_f32(msg + Int64(scales_offset) + Int64(vec // vectors_per_block) * 4,
                                  scale)


@cute.jit
def encode_nvfp4_token(tidx, src_addr, codes_addr, scales_addr, hidden, gs,
                       e2m1: cutlass.Constexpr, table: cute.Tensor,
                       ahead: cutlass.Constexpr = NVFP4_AHEAD):
    """Thread `tidx` of ENCODE_THREADS: the token at `src_addr` (bf16) to e2m1 codes at
    `codes_addr` (8 bytes a 16-element block) and e4m3 scale bytes at `scales_addr`: the block
    quantizer `quantize_nvfp4` uses (`quantize_nvfp4_pairs`), under the global scale `gs`. A
    thread loads `ahead` of its blocks (every ENCODE_THREADS-th) before quantizing the first."""
    blocks = hidden // NVFP4_BLOCK
    pairs = [cute.make_rmem_tensor(cute.make_layout(NVFP4_BLOCK // 2), Int32)
             for _ in range(ahead)]
    codes = cute.make_rmem_tensor(cute.make_layout(2), Int32)
    for first in cutlass.range(tidx, blocks, ENCODE_THREADS * ahead):
        for a in cutlass.range_constexpr(ahead):
            kb = first + a * ENCODE_THREADS
            if kb < blocks:
                cute.autovec_copy(cute.make_tensor(
                    gmem_ptr(Int32, src_addr + Int64(kb) * NVFP4_BLOCK * 2, 16),
                    cute.make_layout(NVFP4_BLOCK // 2)), pairs[a])
        for a in cutlass.range_constexpr(ahead):
            kb = first + a * ENCODE_THREADS
            if kb < blocks:
                byte = quantize_nvfp4_pairs(pairs[a], codes, gs, e2m1, table)
                cute.autovec_copy(codes, cute.make_tensor(
                    gmem_ptr(Int32, codes_addr + Int64(kb) * 8, 8), cute.make_layout(2)))
                store_u8(scales_addr + Int64(kb), byte)


class EpEncode:
    def __init__(self, fmt: str, e2m1: str | None = None, scales: str | None = None):
        """`e2m1` ("software" for sm_90a, "hardware" for sm_100a) is for NVFP4 only; `scales`
        (FP8_SCALES, default "exact") for FP8 only."""
        if fmt not in FORMATS:
            raise ValueError(f"ep_encode formats: {FORMATS}, not {fmt!r}")
        if (fmt == "nvfp4") != (e2m1 is not None) or (e2m1 and e2m1 not in E2M1_ARCHES):
            raise ValueError(f"ep_encode: nvfp4 needs e2m1 software|hardware, other formats "
                             f"none; got {fmt}, {e2m1}")
        if scales is not None and fmt != "fp8":
            raise ValueError(f"ep_encode: scales are for fp8, got {fmt}, {scales}")
        if fmt == "fp8" and (scales or "exact") not in FP8_SCALES:
            raise ValueError(f"ep_encode fp8 scales: {FP8_SCALES}, not {scales!r}")
        self.fmt = fmt
        self.e2m1 = e2m1
        self.scales = (scales or "exact") if fmt == "fp8" else None
        self.threads = ENCODE_THREADS
        self.arches = E2M1_ARCHES[e2m1] if e2m1 else ARCHES

    def spec(self) -> KernelSpec:
        config = {"format": self.fmt, "threads": self.threads, "groups": GROUPS}
        if self.e2m1:
            config["e2m1"] = self.e2m1
        if self.scales:
            config["scales"] = self.scales
        return KernelSpec(
            family="ep_encode",
            config=config,
            params=(
                Param("send_buf", "ptr", "uint8", align=16, writes=True,
                      min_elements=("num_tokens", 16)),
                Param("x", "ptr", "bfloat16", align=16, min_elements=("num_tokens", 8)),
                Param("global_scale", "ptr", "float32", align=4),
                Param("num_tokens", "i32"),
                Param("ctas", "i32"),
                Param("hidden", "i32"),
                Param("msg_bytes", "i32"),
                Param("scales_offset", "i32"),
            ),
            block=(self.threads * GROUPS, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes={},
        )

    @property
    def smem_bytes(self) -> int:
        return SCALE_TABLE_BYTES + 16 if self.fmt == "nvfp4" else 0

    @cute.jit
    def __call__(self, send_buf: cute.Pointer, x: cute.Pointer, global_scale: cute.Pointer,
                 num_tokens: Int32, ctas: Int32, hidden: Int32, msg_bytes: Int32,
                 scales_offset: Int32, stream):
        self.kernel(send_buf, x, global_scale, num_tokens, ctas, hidden, msg_bytes,
                    scales_offset, row_tiled_copy(self.threads, BFloat16, BF16_PER_VECTOR),
                    row_tiled_copy(self.threads, Float8E4M3FN, BF16_PER_VECTOR)).launch(
            grid=(ctas, 1, 1), block=(self.threads * GROUPS, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.jit
    def _prefetch_next(self, x: cute.Pointer, t, num_tokens, ctas, hidden, tidx):
        """The group's next token into L2 while it quantizes token t (thread 0 asks)."""
        if tidx == 0 and t + ctas * GROUPS < num_tokens:
            prefetch_rows(x, t + ctas * GROUPS, hidden)

    @cute.kernel
    def kernel(self, send_buf: cute.Pointer, x: cute.Pointer, global_scale: cute.Pointer,
               num_tokens: Int32, ctas: Int32, hidden: Int32, msg_bytes: Int32,
               scales_offset: Int32, bf16_copy: cute.TiledCopy, fp8_copy: cute.TiledCopy):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        group = tid // self.threads
        tidx = tid - group * self.threads  # the thread within its group
        if cutlass.const_expr(self.fmt == "fp8"):
            for t in cutlass.range(cta * GROUPS + group, num_tokens, ctas * GROUPS):
                self._prefetch_next(x, t, num_tokens, ctas, hidden, tidx)
                msg = send_buf.toint() + Int64(t) * Int64(msg_bytes)
                row = x.toint() + Int64(t) * Int64(hidden) * 2
                encode_fp8_token(tidx, row, msg, msg + Int64(scales_offset), hidden,
                                 self.scales == "pow2", bf16_copy, fp8_copy)
        else:
            smem = cutlass.memory.SmemAllocator()
            table = smem.allocate_tensor(Float32, scale_table_layout(), byte_alignment=16)
            fill_scale_table(table, tid, self.threads * GROUPS)
            cute.arch.sync_threads()
            gs = load_f32(global_scale.toint())
            for t in cutlass.range(cta * GROUPS + group, num_tokens, ctas * GROUPS):
                self._prefetch_next(x, t, num_tokens, ctas, hidden, tidx)
                msg = send_buf.toint() + Int64(t) * Int64(msg_bytes)
                row = x.toint() + Int64(t) * Int64(hidden) * 2
                encode_nvfp4_token(tidx, row, msg, msg + Int64(scales_offset), hidden, gs,
                                   self.e2m1, table)


@cute.jit
def prefetch_rows(x: cute.Pointer, t, hidden):
    """Ask L2 for bf16 token row t of `x` (rows of `hidden`, a multiple of 8), not waiting."""
    bulk_prefetch_l2(x.toint() + Int64(t) * Int64(hidden) * 2, hidden * 2)


def encode_kernels() -> list:
    return [*(EpEncode("fp8", scales=s) for s in FP8_SCALES), EpEncode("nvfp4", "software"),
            EpEncode("nvfp4", "hardware")]
