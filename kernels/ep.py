"""The encoder of the quantized dispatch formats, and combine over NVLink.

- `ep_encode`: one CTA per token writes its message once (`layouts.formats`) into the local
  send buffer that `ep_dispatch` (`kernels.dispatch`) streams from: the payload (FP8 blockwise
  quantized with fp32 scales per 128, or NVFP4 with e4m3 scales per 16 under the rank's global
  scale, read on the device), then the metadata. The NVFP4 encoder exists twice, like
  `quantize_nvfp4`: software e2m1 for sm_90a, the hardware conversion for sm_100a.

Combine (`combine_async` = send; `combine_wait` = receive):
- `ep_combine_send`: CTA (home rank s, chunk) sums, in fp32, the weighted rows of each token
  over the k slots that live on this rank, and writes the bf16 partial sum into slot
  [token, first local k] of s's combine buffer (unreduced mode: every row to its own slot), then
  signals: the last CTA for s raises s's arrival flag to the round's epoch.
- `ep_combine_recv`: waits for every rank, then sums each token's filled slots (the first k of
  every destination rank) in fp32, adds the shared expert's row unweighted, writes bf16.

Signals are epochs: the device-side round counter of (phase, buffer group) is read by the
sender, the flag raised to counter + 1, and the counter advanced by the last CTA of the send;
the receiver waits for flag >= counter. Nothing on the host takes part, so a CUDA graph replays
the whole layer. A wait gives up after `timeout_ns` of `%globaltimer`, records the missing rank
and phase in `error`, treats that rank as having sent nothing, and returns.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64

from kernels.copy import (copy_rows, row_predicate, row_tiled_copy,
                          vector_tiled_copy)
from kernels.fp8 import FP8_BLOCK, scale_fp8_block
from kernels.memory import gmem_ptr, load_f32, load_i32, store_i32
from kernels.nvfp4 import quantize_nvfp4_block
from layouts import VECTOR_BYTES
from layouts.abi import ARCHES, GridRule, KernelSpec, Param

WARP = 32
MAX_RANKS = 8
MAX_TOPK = 16
MAX_ENTRIES = 272  # 1 + segments: up to 256 local experts, a shared expert, and slack
FLAG_BYTES = 8
BF16_PER_VECTOR = 8  # bf16 elements in one 128-bit access
NVFP4_BLOCK = 16  # elements per e4m3 scale
NVFP4_ROW_VECTOR = 8  # an NVFP4 row (H / 2 bytes) is a multiple of 8 bytes, not always of 16

# The error record's words are layouts.buffers.ERROR_FIELDS: missing rank + 1, phase, bad expert
# id bits (ERROR_ID_RANGE, ERROR_ID_TWICE), inconsistent counts received.
PHASE_DISPATCH = 1
PHASE_COMBINE = 2
FORMATS = ("bf16", "fp8", "nvfp4")
E2M1_ARCHES = {"software": ("sm_90a",), "hardware": ("sm_100a",)}

PLAN_IDS = 4  # expert ids ep_plan loads together
COMBINE_ROWS = 4  # expert output rows ep_combine_send loads together
COMBINE_VECTORS = 4  # 16-byte vectors of a row per thread in ep_combine_send

LIMITS = {"max_ranks": MAX_RANKS, "max_topk": MAX_TOPK, "max_segments": MAX_ENTRIES - 1}


@cute.jit
def _clamp(i, n):
    """min(i, n - 1) for n >= 1: an index that is always safe to load."""
    j = i
    if i > n - 1:
        j = n - 1
    return j


@cute.jit
def _copy_bytes(tiled_copy: cute.TiledCopy, tidx, src_addr, dst_addr, num_vectors, rows_per_tile):
    """Copy `num_vectors` 16-byte rows from `src_addr` to `dst_addr`, the whole CTA."""
    layout = cute.make_layout((num_vectors, VECTOR_BYTES), stride=(VECTOR_BYTES, 1))
    tiler = (rows_per_tile, VECTOR_BYTES)
    g_src = cute.zipped_divide(cute.make_tensor(gmem_ptr(cutlass.Uint8, src_addr, 16), layout), tiler)
    g_dst = cute.zipped_divide(cute.make_tensor(gmem_ptr(cutlass.Uint8, dst_addr, 16), layout), tiler)
    g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
    for tile in cutlass.range(cute.ceil_div(num_vectors, rows_per_tile)):
        copy_rows(tiled_copy, tidx, g_src[((None, None), tile)], g_dst[((None, None), tile)],
                  g_crd[((None, None), tile)], num_vectors)


@cute.jit
def _finish_destination(done: cute.Pointer, rounds: cute.Pointer, dest, ranks, num_chunks,
                        flag_addr, counts_src_addr, counts_dst_addr, entries):
    """Called by one thread of each CTA after its copies to `dest`: the last CTA for `dest`
    sends the counts (if any), raises the flag, and the last destination advances the round."""
    cute.arch.fence_acq_rel_sys()
    done_dest = gmem_ptr(Int32, done.toint() + Int64(dest) * 4, 4)
    old = cute.arch.atomic_add(done_dest, Int32(1), sem="acq_rel", scope="gpu")
    if old == num_chunks - 1:
        cute.arch.store(done_dest, Int32(0))
        for e in cutlass.range(entries):
            store_i32(counts_dst_addr + Int64(e) * 4, load_i32(counts_src_addr + Int64(e) * 4))
        cute.arch.fence_acq_rel_sys()
        epoch = cute.arch.load(rounds, Int64, sem="relaxed", scope="gpu") + 1
        cute.arch.store(gmem_ptr(Int64, flag_addr, FLAG_BYTES), epoch, sem="release", scope="sys")
        done_all = gmem_ptr(Int32, done.toint() + Int64(ranks) * 4, 4)
        old_all = cute.arch.atomic_add(done_all, Int32(1), sem="acq_rel", scope="gpu")
        if old_all == ranks - 1:
            cute.arch.store(done_all, Int32(0))
            cute.arch.store(rounds, epoch)


@cute.jit
def _wait_for_sources(tidx, ranks, flags: cute.Pointer, rounds: cute.Pointer,
                      error: cute.Pointer, timeout_ns, phase, s_arrived: cute.Tensor):
    """Threads [0, ranks) wait for their source's flag to reach this round's epoch; the result
    (1 arrived, 0 gave up) lands in `s_arrived`. Call before a CTA barrier."""
    if tidx < ranks:
        epoch = cute.arch.load(rounds, Int64, sem="relaxed", scope="gpu")
        flag = gmem_ptr(Int64, flags.toint() + Int64(tidx) * FLAG_BYTES, FLAG_BYTES)
        start = cute.arch.globaltimer()
        arrived = cute.arch.load(flag, Int64, sem="acquire", scope="sys") >= epoch
        waited = Int64(0)
        other_failed = Int32(0)
        while not arrived and waited < timeout_ns and other_failed == 0:
            arrived = cute.arch.load(flag, Int64, sem="acquire", scope="sys") >= epoch
            waited = cute.arch.globaltimer() - start
            if cute.arch.load(error, Int32, sem="relaxed", scope="gpu") != 0:
                other_failed = Int32(1)
        ok = Int32(0)
        if arrived:
            ok = Int32(1)
        else:
            if other_failed == 0:
                old = cute.arch.atomic_cas(error, cmp=Int32(0), val=Int32(tidx + 1),
                                           sem="relaxed", scope="gpu")
                if old == 0:
                    store_i32(error.toint() + 4, phase)
        s_arrived[tidx] = ok


class EpEncode:
    def __init__(self, fmt: str, e2m1: str | None = None, threads: int = 128):
        """`e2m1` ("software" for sm_90a, "hardware" for sm_100a) is for NVFP4 only."""
        if fmt not in FORMATS:
            raise ValueError(f"ep_encode formats: {FORMATS}, not {fmt!r}")
        if (fmt == "nvfp4") != (e2m1 is not None) or (e2m1 and e2m1 not in E2M1_ARCHES):
            raise ValueError(f"ep_encode: nvfp4 needs e2m1 software|hardware, other formats "
                             f"none; got {fmt}, {e2m1}")
        self.fmt = fmt
        self.e2m1 = e2m1
        self.threads = threads
        self.vectors_per_thread = 4
        self.arches = E2M1_ARCHES[e2m1] if e2m1 else ARCHES

    def spec(self) -> KernelSpec:
        config = {"format": self.fmt, "threads": self.threads}
        if self.e2m1:
            config["e2m1"] = self.e2m1
        return KernelSpec(
            family="ep_encode",
            config=config,
            params=(
                Param("send_buf", "ptr", "uint8", align=16, writes=True,
                      min_elements=("num_tokens", 16)),
                Param("x", "ptr", "bfloat16", align=16, min_elements=("num_tokens", 8)),
                Param("global_scale", "ptr", "float32", align=4),
                Param("num_tokens", "i32"),
                Param("hidden", "i32"),
                Param("msg_bytes", "i32"),
                Param("scales_offset", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("num_tokens", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            sizes=dict(LIMITS),
        )

    @cute.jit
    def __call__(self, send_buf: cute.Pointer, x: cute.Pointer, global_scale: cute.Pointer,
                 num_tokens: Int32, hidden: Int32, msg_bytes: Int32, scales_offset: Int32,
                 stream):
        self.kernel(send_buf, x, global_scale, num_tokens, hidden, msg_bytes, scales_offset,
                    vector_tiled_copy(self.threads),
                    row_tiled_copy(self.threads, BFloat16, BF16_PER_VECTOR),
                    row_tiled_copy(self.threads, Float8E4M3FN, BF16_PER_VECTOR)).launch(
            grid=(num_tokens, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, send_buf: cute.Pointer, x: cute.Pointer, global_scale: cute.Pointer,
               num_tokens: Int32, hidden: Int32, msg_bytes: Int32, scales_offset: Int32,
               bytes_copy: cute.TiledCopy, bf16_copy: cute.TiledCopy, fp8_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        msg = send_buf.toint() + Int64(t) * Int64(msg_bytes)
        row = x.toint() + Int64(t) * Int64(hidden) * 2

        if cutlass.const_expr(self.fmt == "bf16"):
            _copy_bytes(bytes_copy, tidx, row, msg, hidden * 2 // VECTOR_BYTES,
                        self.threads * self.vectors_per_thread)
        elif cutlass.const_expr(self.fmt == "fp8"):
            self._quantize_fp8(tidx, row, msg, msg + Int64(scales_offset), hidden, bf16_copy,
                               fp8_copy)
        else:
            gs = load_f32(global_scale.toint())
            for kb in cutlass.range(tidx, hidden // NVFP4_BLOCK, self.threads):
                self._quantize_nvfp4_block(row, msg, msg + Int64(scales_offset), kb, gs)

    @cute.jit
    def _quantize_nvfp4_block(self, src_addr, codes_addr, scales_addr, kb, gs):
        """Block kb (16 elements) of the token at `src_addr`: its 8 code bytes to `codes_addr`,
        its e4m3 scale byte to `scales_addr`: the block quantizer `quantize_nvfp4` uses."""
        byte = quantize_nvfp4_block(src_addr + Int64(kb) * NVFP4_BLOCK * 2,
                                    codes_addr + Int64(kb) * 8, gs, self.e2m1)
        cute.make_tensor(gmem_ptr(cutlass.Uint8, scales_addr + Int64(kb), 1),
                         cute.make_layout(1))[0] = cutlass.Uint8(byte)

    @cute.jit
    def _quantize_fp8(self, tidx, src_addr, dst_addr, scales_addr, hidden,
                      bf16_copy: cute.TiledCopy, fp8_copy: cute.TiledCopy):
        """Rows of 8 elements, one per thread; a 128-element block is 16 consecutive lanes.
        The math of `kernels.fp8.scale_fp8_block`."""
        rows = hidden // BF16_PER_VECTOR
        layout = cute.make_layout((rows, BF16_PER_VECTOR), stride=(BF16_PER_VECTOR, 1))
        tiler = (self.threads, BF16_PER_VECTOR)
        g_x = cute.zipped_divide(cute.make_tensor(gmem_ptr(BFloat16, src_addr, 16), layout), tiler)
        g_q = cute.zipped_divide(cute.make_tensor(gmem_ptr(Float8E4M3FN, dst_addr, 8), layout), tiler)
        g_c = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        scales = cute.make_tensor(gmem_ptr(Float32, scales_addr, 16),
                                  cute.make_layout(hidden // FP8_BLOCK))
        thr_in = bf16_copy.get_slice(tidx)
        thr_out = fp8_copy.get_slice(tidx)
        lane = tidx % WARP
        vectors_per_block = FP8_BLOCK // BF16_PER_VECTOR
        for tile in cutlass.range(cute.ceil_div(rows, self.threads)):
            t_x = thr_in.partition_S(g_x[((None, None), tile)])
            t_q = thr_out.partition_D(g_q[((None, None), tile)])
            pred = row_predicate(thr_in.partition_S(g_c[((None, None), tile)]), rows)
            regs = cute.make_fragment_like(t_x)
            regs.fill(0.0)
            cute.copy(bf16_copy, t_x, regs, pred=pred)
            vals = cute.make_fragment_like(regs, Float32)
            vals.store(regs.load().to(Float32))
            scale = scale_fp8_block(vals, BF16_PER_VECTOR, vectors_per_block)
            q = cute.make_fragment_like(t_q)
            q.store(vals.load().to(Float8E4M3FN))
            cute.copy(fp8_copy, q, t_q, pred=pred)
            vec = tile * self.threads + tidx
            if lane % vectors_per_block == 0 and vec < rows:
                scales[vec // vectors_per_block] = scale


class EpCombineSend:
    def __init__(self, threads: int = 256):
        self.threads = threads
        self.rows_per_tile = threads * 4

    @property
    def smem_bytes(self) -> int:
        return (4 * MAX_TOPK + 12) * 4 + 96

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_combine_send",
            config={"threads": self.threads},
            params=(
                Param("peer_bases", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("y", "ptr", "bfloat16", align=16),
                Param("comb_rows", "ptr", "int32", align=4),
                Param("comb_weights", "ptr", "float32", align=4),
                Param("comb_tokens", "ptr", "int32", align=4),
                Param("comb_counts", "ptr", "int32", align=4, min_elements=("ranks", 1)),
                Param("done", "ptr", "int32", align=4, writes=True, min_elements=("ranks", 1)),
                Param("rounds", "ptr", "int64", align=8, writes=True),
                Param("max_tokens", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("topk", "i32"),
                Param("hidden", "i32"),
                Param("weighted", "i32"),
                Param("combine_offset", "i64"),
                Param("flags_offset", "i64"),
                Param("ctas_per_rank", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("ranks", 1)), GridRule(ceil_div=("ctas_per_rank", 1)),
                  GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes=dict(LIMITS),
        )

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, y: cute.Pointer, comb_rows: cute.Pointer,
                 comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                 comb_counts: cute.Pointer, done: cute.Pointer, rounds: cute.Pointer,
                 max_tokens: Int32, ranks: Int32, my_rank: Int32, topk: Int32, hidden: Int32,
                 weighted: Int32, combine_offset: Int64, flags_offset: Int64,
                 ctas_per_rank: Int32, stream):
        self.kernel(peer_bases, y, comb_rows, comb_weights, comb_tokens, comb_counts, done,
                    rounds, max_tokens, ranks, my_rank, topk, hidden, weighted, combine_offset,
                    flags_offset, ctas_per_rank, vector_tiled_copy(self.threads),
                    row_tiled_copy(self.threads, BFloat16, BF16_PER_VECTOR)).launch(
            grid=(ranks, ctas_per_rank, 1), block=(self.threads, 1, 1),
            smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, peer_bases: cute.Pointer, y: cute.Pointer, comb_rows: cute.Pointer,
               comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
               comb_counts: cute.Pointer, done: cute.Pointer, rounds: cute.Pointer,
               max_tokens: Int32, ranks: Int32, my_rank: Int32, topk: Int32, hidden: Int32,
               weighted: Int32, combine_offset: Int64, flags_offset: Int64,
               ctas_per_rank: Int32, bytes_copy: cute.TiledCopy, bf16_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        home, cta, _ = cute.arch.block_idx()
        peer = cute.make_tensor(peer_bases, cute.make_layout(ranks))[home]
        smem = cutlass.memory.SmemAllocator()
        s_rows = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)
        s_w = smem.allocate_tensor(Float32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)
        # The rows of this token that live here, compacted, and their weights.
        s_here = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)
        s_hw = smem.allocate_tensor(Float32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)
        row_bytes = Int64(hidden) * 2
        n = cute.make_tensor(comb_counts, cute.make_layout(ranks))[home]
        for j in cutlass.range(cta, n, ctas_per_rank):
            at = Int64(home) * Int64(max_tokens) + Int64(j)
            if tidx < topk:
                s_rows[tidx] = load_i32(comb_rows.toint() + (at * Int64(topk) + Int64(tidx)) * 4)
                s_w[tidx] = load_f32(comb_weights.toint()
                                      + (at * Int64(topk) + Int64(tidx)) * 4)
            if tidx == 0:
                s_rows[MAX_TOPK] = load_i32(comb_tokens.toint() + at * 4)
            cute.arch.sync_threads()
            if tidx == 0:
                n_here = Int32(0)
                first_k = Int32(-1)
                for k in cutlass.range(topk):
                    if s_rows[k] >= 0:
                        s_here[n_here] = s_rows[k]
                        s_hw[n_here] = s_w[k]
                        n_here = n_here + 1
                        if first_k < 0:
                            first_k = k
                s_here[MAX_TOPK] = n_here
                s_here[MAX_TOPK + 1] = first_k
            cute.arch.sync_threads()
            tok = s_rows[MAX_TOPK]
            slot_base = peer + combine_offset + Int64(tok) * Int64(topk) * row_bytes
            if weighted != 0:
                first = s_here[MAX_TOPK + 1]
                if first >= 0:
                    self._weighted_sum(tidx, y, s_here, s_hw, s_here[MAX_TOPK], hidden,
                                       slot_base + Int64(first) * row_bytes, bf16_copy)
            else:
                for k in cutlass.range(topk):
                    row = s_rows[k]
                    if row >= 0:
                        _copy_bytes(bytes_copy, tidx, y.toint() + Int64(row) * row_bytes,
                                    slot_base + Int64(k) * row_bytes,
                                    hidden * 2 // VECTOR_BYTES, self.rows_per_tile)
            cute.arch.sync_threads()
        cute.arch.sync_threads()
        if tidx == 0:
            _finish_destination(done, rounds, home, ranks, ctas_per_rank,
                                peer + flags_offset + Int64(my_rank) * FLAG_BYTES,
                                Int64(0), Int64(0), Int32(0))

    @cute.jit
    def _weighted_sum(self, tidx, y: cute.Pointer, s_rows: cute.Tensor, s_w: cute.Tensor, n,
                      hidden, dst_addr, bf16_copy: cute.TiledCopy):
        """dst = bf16(sum_i w[i] * y[rows[i]]) over the n >= 1 rows here (compacted), in fp32.
        A thread holds COMBINE_VECTORS vectors of a row (one tile covers H <= 8192), and the
        loads of COMBINE_ROWS rows are issued before any is summed, so they overlap."""
        rows = hidden // BF16_PER_VECTOR
        layout = cute.make_layout((rows, BF16_PER_VECTOR), stride=(BF16_PER_VECTOR, 1))
        tiler = (self.threads * COMBINE_VECTORS, BF16_PER_VECTOR)
        g_c = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        g_dst = cute.zipped_divide(cute.make_tensor(gmem_ptr(BFloat16, dst_addr, 16), layout), tiler)
        thr = bf16_copy.get_slice(tidx)
        for tile in cutlass.range(cute.ceil_div(rows, self.threads * COMBINE_VECTORS)):
            pred = row_predicate(thr.partition_S(g_c[((None, None), tile)]), rows)
            t_dst = thr.partition_D(g_dst[((None, None), tile)])
            acc = cute.make_fragment_like(t_dst, Float32)
            acc.fill(0.0)
            for i0 in cutlass.range(0, n, COMBINE_ROWS):
                frags = []
                for j in cutlass.range_constexpr(COMBINE_ROWS):
                    row = s_rows[_clamp(i0 + j, n)]  # past n: a row already summed, not used
                    g_y = cute.zipped_divide(cute.make_tensor(
                        gmem_ptr(BFloat16, y.toint() + Int64(row) * Int64(hidden) * 2, 16), layout),
                        tiler)
                    regs = cute.make_fragment_like(thr.partition_S(g_y[((None, None), tile)]))
                    cute.copy(bf16_copy, thr.partition_S(g_y[((None, None), tile)]), regs,
                              pred=pred)
                    frags.append(regs)
                for j in cutlass.range_constexpr(COMBINE_ROWS):
                    if i0 + j < n:
                        acc.store(acc.load() + frags[j].load().to(Float32) * s_w[i0 + j])
            out = cute.make_fragment_like(t_dst)
            out.store(acc.load().to(BFloat16))
            cute.copy(bf16_copy, out, t_dst, pred=pred)


class EpCombineRecv:
    def __init__(self, threads: int = 256, tokens_per_cta: int = 4):
        self.threads = threads
        self.tokens_per_cta = tokens_per_cta
        self.rows_per_tile = threads * 4

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_combine_recv",
            config={"threads": self.threads, "tokens_per_cta": self.tokens_per_cta},
            params=(
                Param("combine_buf", "ptr", "bfloat16", align=16),
                Param("flags", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("rounds", "ptr", "int64", align=8),
                Param("error", "ptr", "int32", align=4, writes=True),
                Param("out", "ptr", "bfloat16", align=16, writes=True),
                Param("y", "ptr", "bfloat16", align=16),
                Param("topk_ids", "ptr", "int32", align=4, min_elements=("num_tokens", 1)),
                Param("num_tokens", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("topk", "i32"),
                Param("hidden", "i32"),
                Param("local_experts", "i32"),
                Param("weighted", "i32"),
                Param("skip_a2a", "i32"),
                Param("shared", "i32"),
                Param("shared_begin", "i32"),
                Param("shared_end", "i32"),
                Param("timeout_ns", "i64"),
                Param("num_chunks", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("num_chunks", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            smem_bytes=(MAX_TOPK + MAX_RANKS + 8) * 4 + 64,
            sizes=dict(LIMITS, tokens_per_cta=self.tokens_per_cta),
        )

    @cute.jit
    def __call__(self, combine_buf: cute.Pointer, flags: cute.Pointer, rounds: cute.Pointer,
                 error: cute.Pointer, out: cute.Pointer, y: cute.Pointer,
                 topk_ids: cute.Pointer, num_tokens: Int32, ranks: Int32, my_rank: Int32,
                 topk: Int32, hidden: Int32, local_experts: Int32, weighted: Int32,
                 skip_a2a: Int32, shared: Int32, shared_begin: Int32, shared_end: Int32,
                 timeout_ns: Int64, num_chunks: Int32, stream):
        self.kernel(combine_buf, flags, rounds, error, out, y, topk_ids, num_tokens, ranks,
                    my_rank, topk, hidden, local_experts, weighted, skip_a2a, shared,
                    shared_begin, shared_end, timeout_ns, num_chunks,
                    row_tiled_copy(self.threads, BFloat16, BF16_PER_VECTOR)).launch(
            grid=(num_chunks, 1, 1), block=(self.threads, 1, 1),
            smem=(MAX_TOPK + MAX_RANKS + 8) * 4 + 64, stream=stream)

    @cute.kernel
    def kernel(self, combine_buf: cute.Pointer, flags: cute.Pointer, rounds: cute.Pointer,
               error: cute.Pointer, out: cute.Pointer, y: cute.Pointer,
               topk_ids: cute.Pointer, num_tokens: Int32, ranks: Int32, my_rank: Int32,
               topk: Int32, hidden: Int32, local_experts: Int32, weighted: Int32,
               skip_a2a: Int32, shared: Int32, shared_begin: Int32, shared_end: Int32,
               timeout_ns: Int64, num_chunks: Int32, bf16_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        s_filled = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)
        s_arrived = smem.allocate_tensor(Int32, cute.make_layout(MAX_RANKS), byte_alignment=16)
        _wait_for_sources(tidx, ranks, flags, rounds, error, timeout_ns, Int32(PHASE_COMBINE),
                          s_arrived)
        cute.arch.sync_threads()

        experts = local_experts * ranks
        rows = hidden // BF16_PER_VECTOR
        layout = cute.make_layout((rows, BF16_PER_VECTOR), stride=(BF16_PER_VECTOR, 1))
        tiler = (self.threads, BF16_PER_VECTOR)
        g_c = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = bf16_copy.get_slice(tidx)
        row_bytes = Int64(hidden) * 2
        for t in cutlass.range(chunk, num_tokens, num_chunks):  # token-strided over the CTAs
            # Which k slots were written this round: one per destination rank (the first k
            # routed there) when reduced, every slot otherwise; only our own with skip_a2a.
            if tidx < topk:
                ids_at = topk_ids.toint() + Int64(t) * Int64(topk) * 4
                e = load_i32(ids_at + Int64(tidx) * 4)
                filled = Int32(0)
                if e >= 0 and e < experts:
                    d = e // local_experts
                    filled = Int32(1)
                    if skip_a2a != 0 and d != my_rank:
                        filled = Int32(0)
                    if weighted != 0:
                        for k2 in cutlass.range(tidx):
                            e2 = load_i32(ids_at + Int64(k2) * 4)
                            if e2 >= 0 and e2 < experts and e2 // local_experts == d:
                                filled = Int32(0)
                s_filled[tidx] = filled
            cute.arch.sync_threads()
            slots = combine_buf.toint() + Int64(t) * Int64(topk) * row_bytes
            has_shared = shared != 0 and t >= shared_begin and t < shared_end
            for tile in cutlass.range(cute.ceil_div(rows, self.threads)):
                if weighted != 0:
                    g_out = cute.zipped_divide(cute.make_tensor(
                        gmem_ptr(BFloat16, out.toint() + Int64(t) * row_bytes, 16), layout),
                        tiler)
                    t_out = thr.partition_D(g_out[((None, None), tile)])
                    acc = cute.make_fragment_like(t_out, Float32)
                    acc.fill(0.0)
                    for k in cutlass.range(topk):
                        if s_filled[k] != 0:
                            self._accumulate(thr, bf16_copy, acc, slots + Int64(k) * row_bytes,
                                             layout, tiler, tile, g_c, rows)
                    if has_shared:
                        self._accumulate(thr, bf16_copy, acc,
                                         y.toint() + Int64(t - shared_begin) * row_bytes,
                                         layout, tiler, tile, g_c, rows)
                    res = cute.make_fragment_like(t_out)
                    res.store(acc.load().to(BFloat16))
                    cute.copy(bf16_copy, res, t_out, pred=row_predicate(
                        thr.partition_S(g_c[((None, None), tile)]), rows))
                else:
                    for k in cutlass.range(topk):
                        g_out = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                            BFloat16, out.toint() + (Int64(t) * Int64(topk) + Int64(k))
                            * row_bytes, 16), layout), tiler)
                        t_out = thr.partition_D(g_out[((None, None), tile)])
                        regs = cute.make_fragment_like(t_out)
                        regs.fill(0.0)
                        if s_filled[k] != 0:
                            g_in = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                                BFloat16, slots + Int64(k) * row_bytes, 16), layout), tiler)
                            cute.copy(bf16_copy, thr.partition_S(g_in[((None, None), tile)]),
                                      regs, pred=row_predicate(
                                          thr.partition_S(g_c[((None, None), tile)]), rows))
                        cute.copy(bf16_copy, regs, t_out, pred=row_predicate(
                            thr.partition_S(g_c[((None, None), tile)]), rows))
            cute.arch.sync_threads()

    @cute.jit
    def _accumulate(self, thr, bf16_copy: cute.TiledCopy, acc: cute.Tensor, row_addr, layout,
                    tiler, tile, g_c, rows):
        pred = row_predicate(thr.partition_S(g_c[((None, None), tile)]), rows)
        g_in = cute.zipped_divide(cute.make_tensor(gmem_ptr(BFloat16, row_addr, 16), layout), tiler)
        t_in = thr.partition_S(g_in[((None, None), tile)])
        regs = cute.make_fragment_like(t_in)
        regs.fill(0.0)
        cute.copy(bf16_copy, t_in, regs, pred=pred)
        acc.store(acc.load() + regs.load().to(Float32))


def ep_kernels() -> list:
    """The encoder of the quantized formats and the combine kernels (dispatch itself is
    `kernels.dispatch`)."""
    return [EpEncode("fp8"), EpEncode("nvfp4", "software"), EpEncode("nvfp4", "hardware"),
            EpCombineSend(), EpCombineRecv()]
