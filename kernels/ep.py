"""Intranode dispatch and combine over NVLink: the six kernels of one expert-parallel layer.

Dispatch (`dispatch_async` = plan, encode, send; `dispatch_wait` = receive):
- `ep_plan`: one CTA per key. A destination-rank key gives each token routed to that rank the
  next slot there; an expert key numbers the tokens routed to that expert (its *position*). The
  CTA's warps ballot over consecutive runs of tokens and a scan of the run counts orders them,
  so both follow source-token order and the receiver's row order is deterministic. The counts
  of each key go to `send_counts`.
- `ep_encode`: one CTA per token writes its message once (`layouts.formats`): the payload (bf16
  copied, FP8 blockwise quantized with fp32 scales per 128, or NVFP4 with e4m3 scales per 16
  under the rank's global scale, read on the device), then the metadata (source token, K expert
  ids, K weights, K positions). The NVFP4 encoder exists twice, like `quantize_nvfp4`: software
  e2m1 for sm_90a, the hardware conversion for sm_100a.
- `ep_send`: CTA (destination d, chunk of tokens) copies each message routed to d, once per
  destination rank, into slot [me][slot] of d's receive buffer over NVLink with 128-bit tiled
  copies. The chunk that finishes last for d writes this rank's counts into d's `recv_counts`
  and raises d's arrival flag [me] to the round's epoch (system-scope fence, release store).
- `ep_recv`: every CTA waits (bounded) for every source's flag, turns the received counts into
  segment offsets (each segment padded to the format's row alignment), and CTA (s, c) expands
  source s's messages c, c + C, ... into expert rows: row = base[segment][s] + position. It
  records, per (source, message, k), the row and weight the combine needs. NVFP4 scales go to
  the 128x4 layout (`layouts.scales`), each segment on a fresh 128-row block; all CTAs share the
  zeroing of the padding rows of every segment's last block.

Combine (`combine_async` = send; `combine_wait` = receive):
- `ep_combine_send`: CTA (home rank s, chunk) sums, in fp32, the weighted rows of each token
  over the k slots that live on this rank, and writes the bf16 partial sum into slot
  [token, first local k] of s's combine buffer (unreduced mode: every row to its own slot), then
  signals like `ep_send`.
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

from kernels.copy import copy_rows, row_predicate, row_tiled_copy, vector_tiled_copy
from kernels.fp8 import FP8_BLOCK, scale_fp8_block
from kernels.nvfp4 import quantize_nvfp4_block
from kernels.scan import warp_exclusive_scan
from layouts import VECTOR_BYTES
from layouts.abi import ARCHES, GridRule, KernelSpec, Param
from layouts.buffers import ERROR_ID_RANGE, ERROR_ID_TWICE, FP8_ROW_ALIGN
from layouts.scales import ATOM_BYTES, ATOM_ROWS

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


def _ptr(dtype, addr, align):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def _scale_word_offset(srow, group, rk):
    """Byte offset, in the 128x4 scale layout (`layouts.scales`), of scale row `srow`'s columns
    4 group .. 4 group + 3: (r//128)*RK*512 + (kb//4)*512 + (r%32)*16 + ((r//32)%4)*4 + kb%4."""
    return ((Int64(srow // ATOM_ROWS) * Int64(rk) + Int64(group)) * ATOM_BYTES
            + Int64(srow % 32) * 16 + Int64((srow // 32) % 4) * 4)


@cute.jit
def _clamp(i, n):
    """min(i, n - 1) for n >= 1: an index that is always safe to load."""
    j = i
    if i > n - 1:
        j = n - 1
    return j


@cute.jit
def _load_i32(addr):
    return cute.make_tensor(_ptr(Int32, addr, 4), cute.make_layout(1))[0]


@cute.jit
def _load_f32(addr):
    return cute.make_tensor(_ptr(Float32, addr, 4), cute.make_layout(1))[0]


@cute.jit
def _store_i32(addr, value):
    cute.make_tensor(_ptr(Int32, addr, 4), cute.make_layout(1))[0] = Int32(value)


@cute.jit
def _store_f32(addr, value):
    cute.make_tensor(_ptr(Float32, addr, 4), cute.make_layout(1))[0] = Float32(value)


@cute.jit
def _copy_bytes(tiled_copy: cute.TiledCopy, tidx, src_addr, dst_addr, num_vectors, rows_per_tile):
    """Copy `num_vectors` 16-byte rows from `src_addr` to `dst_addr`, the whole CTA."""
    layout = cute.make_layout((num_vectors, VECTOR_BYTES), stride=(VECTOR_BYTES, 1))
    tiler = (rows_per_tile, VECTOR_BYTES)
    g_src = cute.zipped_divide(cute.make_tensor(_ptr(cutlass.Uint8, src_addr, 16), layout), tiler)
    g_dst = cute.zipped_divide(cute.make_tensor(_ptr(cutlass.Uint8, dst_addr, 16), layout), tiler)
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
    done_dest = _ptr(Int32, done.toint() + Int64(dest) * 4, 4)
    old = cute.arch.atomic_add(done_dest, Int32(1), sem="acq_rel", scope="gpu")
    if old == num_chunks - 1:
        cute.arch.store(done_dest, Int32(0))
        for e in cutlass.range(entries):
            _store_i32(counts_dst_addr + Int64(e) * 4, _load_i32(counts_src_addr + Int64(e) * 4))
        cute.arch.fence_acq_rel_sys()
        epoch = cute.arch.load(rounds, Int64, sem="relaxed", scope="gpu") + 1
        cute.arch.store(_ptr(Int64, flag_addr, FLAG_BYTES), epoch, sem="release", scope="sys")
        done_all = _ptr(Int32, done.toint() + Int64(ranks) * 4, 4)
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
        flag = _ptr(Int64, flags.toint() + Int64(tidx) * FLAG_BYTES, FLAG_BYTES)
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
                    _store_i32(error.toint() + 4, phase)
        s_arrived[tidx] = ok


class EpPlan:
    """CTA per key (a destination rank, then an expert). Warp w owns the w-th run of
    consecutive tokens (a lane per token, so the id loads coalesce): it counts its matches with
    ballots, a scan of the warp counts gives each run its first slot / position, and a second
    pass over the run writes them, in token order."""

    def __init__(self, threads: int = 512):
        self.threads = threads
        self.warps = threads // WARP

    @property
    def smem_bytes(self) -> int:
        return (self.warps + 4) * 4 + 16

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_plan",
            config={"threads": self.threads},
            params=(
                Param("topk_ids", "ptr", "int32", align=4, min_elements=("num_tokens", 1)),
                Param("dest_slot", "ptr", "int32", align=4, writes=True,
                      min_elements=("max_tokens", 1)),
                Param("positions", "ptr", "int32", align=4, writes=True,
                      min_elements=("max_tokens", 1)),
                Param("send_counts", "ptr", "int32", align=4, writes=True,
                      min_elements=("ranks", 2)),
                Param("error", "ptr", "int32", align=4, writes=True),
                Param("num_tokens", "i32"),
                Param("max_tokens", "i32"),
                Param("topk", "i32"),
                Param("local_experts", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("shared", "i32"),
                Param("skip_a2a", "i32"),
                Param("shared_begin", "i32"),
                Param("shared_end", "i32"),
                Param("num_keys", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("num_keys", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes=dict(LIMITS),
        )

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, dest_slot: cute.Pointer, positions: cute.Pointer,
                 send_counts: cute.Pointer, error: cute.Pointer, num_tokens: Int32,
                 max_tokens: Int32, topk: Int32, local_experts: Int32, ranks: Int32,
                 my_rank: Int32, shared: Int32, skip_a2a: Int32, shared_begin: Int32,
                 shared_end: Int32, num_keys: Int32, stream):
        self.kernel(topk_ids, dest_slot, positions, send_counts, error, num_tokens, max_tokens,
                    topk, local_experts, ranks, my_rank, shared, skip_a2a, shared_begin,
                    shared_end, num_keys).launch(
            grid=(num_keys, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, dest_slot: cute.Pointer, positions: cute.Pointer,
               send_counts: cute.Pointer, error: cute.Pointer, num_tokens: Int32,
               max_tokens: Int32, topk: Int32, local_experts: Int32, ranks: Int32,
               my_rank: Int32, shared: Int32, skip_a2a: Int32, shared_begin: Int32,
               shared_end: Int32, num_keys: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        key, _, _ = cute.arch.block_idx()
        experts = local_experts * ranks
        entries = 1 + local_experts + shared
        smem = cutlass.memory.SmemAllocator()
        s_run = smem.allocate_tensor(Int32, cute.make_layout(self.warps + 4), byte_alignment=16)
        slots = cute.make_tensor(dest_slot, cute.make_layout(ranks * max_tokens))
        pos = cute.make_tensor(positions, cute.make_layout(max_tokens * topk))
        counts = cute.make_tensor(send_counts, cute.make_layout(ranks * entries))

        # This warp's run of tokens [begin, end): consecutive lanes read consecutive tokens.
        warp = tidx // WARP
        lane = tidx % WARP
        below = cute.arch.lanemask_lt()
        per = (num_tokens + self.warps * WARP - 1) // (self.warps * WARP) * WARP
        begin = warp * per
        end = begin + per
        if end > num_tokens:
            end = num_tokens

        # A rank key d matches token t if one of t's experts lives on d (or t is a shared-expert
        # token of this rank); an expert key g matches at the k with ids[t, k] == g.
        is_rank = key < ranks
        d = key
        g = key - ranks
        if key >= ranks:
            d = g // local_experts
        lo = d * local_experts
        hi = lo + local_experts
        active = Int32(1)
        if skip_a2a != 0 and d != my_rank:
            active = Int32(0)  # allreduce mode: nothing leaves this rank
        found = Int32(0)
        for base in cutlass.range(begin, end, WARP):
            t = base + lane
            k = Int32(-1)
            if t < end:
                k, flag = self._match(topk_ids, t, topk, is_rank, lo, hi, g, experts, d,
                                      my_rank, shared, shared_begin, shared_end)
                # Rank key 0 checks every expert id (once per token, even when inactive);
                # an expert key, that no token lists it twice.
                if key == 0 and flag != 0:
                    cute.arch.atomic_or(_ptr(Int32, error.toint() + 8, 4), Int32(ERROR_ID_RANGE),
                                        sem="relaxed", scope="gpu")
                if key >= ranks and flag > 1:
                    cute.arch.atomic_or(_ptr(Int32, error.toint() + 8, 4), Int32(ERROR_ID_TWICE),
                                        sem="relaxed", scope="gpu")
            found = found + Int32(cute.arch.popc(cute.arch.vote_ballot_sync(
                (Int32(k >= 0) & active) != 0)))
        if lane == 0:
            s_run[warp] = found
        cute.arch.sync_threads()
        if warp == 0:
            warp_exclusive_scan(s_run, s_run, self.warps, lane)
        cute.arch.sync_threads()
        carry = s_run[warp]
        for base in cutlass.range(begin, end, WARP):
            t = base + lane
            k = Int32(-1)
            flag = Int32(0)
            if t < end and active != 0:
                k, flag = self._match(topk_ids, t, topk, is_rank, lo, hi, g, experts, d,
                                      my_rank, shared, shared_begin, shared_end)
            ballot = cute.arch.vote_ballot_sync(k >= 0)
            at = carry + Int32(cute.arch.popc(ballot & below))
            if t < end:
                if is_rank:
                    slot = Int32(-1)
                    if k >= 0:
                        slot = at
                    slots[d * max_tokens + t] = slot
                elif k >= 0:
                    pos[t * topk + k] = at
                    if flag > 1:
                        # The same expert listed again at a later k: no position there, so the
                        # receiver drops that (token, k) instead of reading a stale position.
                        ids = cute.make_tensor(topk_ids, cute.make_layout((t + 1) * topk))
                        for k2 in cutlass.range(k + 1, topk):
                            if ids[t * topk + k2] == g:
                                pos[t * topk + k2] = Int32(-1)
            carry = carry + Int32(cute.arch.popc(ballot))
        if tidx == 0:
            total = s_run[self.warps]
            if is_rank:
                counts[d * entries] = total
                if shared != 0:
                    n_shared = Int32(0)
                    if d == my_rank:
                        n_shared = shared_end - shared_begin
                    counts[d * entries + 1] = n_shared
            else:
                counts[d * entries + 1 + shared + g - lo] = total

    @cute.jit
    def _match(self, topk_ids: cute.Pointer, t, topk, is_rank, lo, hi, g, experts, d, my_rank,
               shared, shared_begin, shared_end):
        """(match, flag). Rank key: match 0 if token t goes to rank d, else -1; flag 1 if one of
        its ids is outside [0, experts). Expert key: match = the first k with ids[t, k] == g, or
        -1; flag = how many k list g."""
        result = Int32(-1)
        flag = Int32(0)
        if is_rank:
            m, bad = self._rank_match(topk_ids, t, topk, lo, hi, experts)
            if d == my_rank and shared != 0 and t >= shared_begin and t < shared_end:
                m = Int32(1)
            result = m - 1
            flag = bad
        else:
            result, flag = self._expert_slot(topk_ids, t, topk, g)
        return result, flag

    @cute.jit
    def _rank_match(self, topk_ids: cute.Pointer, t, topk, lo, hi, experts):
        """(1 if an expert of token t is in [lo, hi) else 0, 1 if an id is outside [0, experts)).
        The ids are loaded PLAN_IDS at a time, unconditionally (indices clamped), so those loads
        are in flight together."""
        ids = cute.make_tensor(topk_ids, cute.make_layout((t + 1) * topk))
        m = Int32(0)
        bad = Int32(0)
        for k0 in cutlass.range(0, topk, PLAN_IDS):
            for i in cutlass.range_constexpr(PLAN_IDS):
                k = k0 + i
                e = ids[t * topk + _clamp(k, topk)]
                live = Int32(k < topk)
                m = m | (Int32(e >= lo) & Int32(e < hi) & live)
                bad = bad | ((Int32(e < 0) | Int32(e >= experts)) & live)
        return m, bad

    @cute.jit
    def _expert_slot(self, topk_ids: cute.Pointer, t, topk, g):
        """(the first k with ids[t, k] == g or -1, how many k list g); loads as in
        `_rank_match`."""
        ids = cute.make_tensor(topk_ids, cute.make_layout((t + 1) * topk))
        f = Int32(-1)
        hits = Int32(0)
        for k0 in cutlass.range(0, topk, PLAN_IDS):
            for i in cutlass.range_constexpr(PLAN_IDS):
                k = k0 + i
                e = ids[t * topk + _clamp(k, topk)]
                hit = Int32(e == g) & Int32(k < topk)
                f = f + (hit & Int32(f < 0)) * (k - f)
                hits = hits + hit
        return f, hits


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
                Param("topk_ids", "ptr", "int32", align=4, min_elements=("num_tokens", 1)),
                Param("topk_weights", "ptr", "float32", align=4),
                Param("positions", "ptr", "int32", align=4, min_elements=("num_tokens", 1)),
                Param("global_scale", "ptr", "float32", align=4),
                Param("num_tokens", "i32"),
                Param("hidden", "i32"),
                Param("topk", "i32"),
                Param("msg_bytes", "i32"),
                Param("scales_offset", "i32"),
                Param("meta_offset", "i32"),
                Param("has_weights", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("num_tokens", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            sizes=dict(LIMITS),
        )

    @cute.jit
    def __call__(self, send_buf: cute.Pointer, x: cute.Pointer, topk_ids: cute.Pointer,
                 topk_weights: cute.Pointer, positions: cute.Pointer,
                 global_scale: cute.Pointer, num_tokens: Int32, hidden: Int32, topk: Int32,
                 msg_bytes: Int32, scales_offset: Int32, meta_offset: Int32,
                 has_weights: Int32, stream):
        self.kernel(send_buf, x, topk_ids, topk_weights, positions, global_scale, num_tokens,
                    hidden, topk, msg_bytes, scales_offset, meta_offset, has_weights,
                    vector_tiled_copy(self.threads),
                    row_tiled_copy(self.threads, BFloat16, BF16_PER_VECTOR),
                    row_tiled_copy(self.threads, Float8E4M3FN, BF16_PER_VECTOR)).launch(
            grid=(num_tokens, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, send_buf: cute.Pointer, x: cute.Pointer, topk_ids: cute.Pointer,
               topk_weights: cute.Pointer, positions: cute.Pointer, global_scale: cute.Pointer,
               num_tokens: Int32, hidden: Int32, topk: Int32, msg_bytes: Int32,
               scales_offset: Int32, meta_offset: Int32, has_weights: Int32,
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
            gs = _load_f32(global_scale.toint())
            for kb in cutlass.range(tidx, hidden // NVFP4_BLOCK, self.threads):
                self._quantize_nvfp4_block(row, msg, msg + Int64(scales_offset), kb, gs)

        meta = msg + Int64(meta_offset)
        if tidx == 0:
            _store_i32(meta, t)
        if tidx < topk:
            k_at = Int64(t) * Int64(topk) + Int64(tidx)
            _store_i32(meta + 4 + Int64(tidx) * 4, _load_i32(topk_ids.toint() + k_at * 4))
            w = Float32(0.0)
            if has_weights != 0:
                w = _load_f32(topk_weights.toint() + k_at * 4)
            _store_f32(meta + 4 + Int64(topk + tidx) * 4, w)
            _store_i32(meta + 4 + Int64(2 * topk + tidx) * 4,
                       _load_i32(positions.toint() + k_at * 4))

    @cute.jit
    def _quantize_nvfp4_block(self, src_addr, codes_addr, scales_addr, kb, gs):
        """Block kb (16 elements) of the token at `src_addr`: its 8 code bytes to `codes_addr`,
        its e4m3 scale byte to `scales_addr`: the block quantizer `quantize_nvfp4` uses."""
        byte = quantize_nvfp4_block(src_addr + Int64(kb) * NVFP4_BLOCK * 2,
                                    codes_addr + Int64(kb) * 8, gs, self.e2m1)
        cute.make_tensor(_ptr(cutlass.Uint8, scales_addr + Int64(kb), 1),
                         cute.make_layout(1))[0] = cutlass.Uint8(byte)

    @cute.jit
    def _quantize_fp8(self, tidx, src_addr, dst_addr, scales_addr, hidden,
                      bf16_copy: cute.TiledCopy, fp8_copy: cute.TiledCopy):
        """Rows of 8 elements, one per thread; a 128-element block is 16 consecutive lanes.
        The math of `kernels.fp8.scale_fp8_block`."""
        rows = hidden // BF16_PER_VECTOR
        layout = cute.make_layout((rows, BF16_PER_VECTOR), stride=(BF16_PER_VECTOR, 1))
        tiler = (self.threads, BF16_PER_VECTOR)
        g_x = cute.zipped_divide(cute.make_tensor(_ptr(BFloat16, src_addr, 16), layout), tiler)
        g_q = cute.zipped_divide(cute.make_tensor(_ptr(Float8E4M3FN, dst_addr, 8), layout), tiler)
        g_c = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        scales = cute.make_tensor(_ptr(Float32, scales_addr, 16),
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


class EpSend:
    def __init__(self, threads: int = 256, tokens_per_cta: int = 8):
        self.threads = threads
        self.tokens_per_cta = tokens_per_cta
        self.rows_per_tile = threads * 4

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_send",
            config={"threads": self.threads, "tokens_per_cta": self.tokens_per_cta},
            params=(
                Param("peer_bases", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("send_buf", "ptr", "uint8", align=16),
                Param("dest_slot", "ptr", "int32", align=4),
                Param("send_counts", "ptr", "int32", align=4, min_elements=("ranks", 2)),
                Param("done", "ptr", "int32", align=4, writes=True, min_elements=("ranks", 1)),
                Param("rounds", "ptr", "int64", align=8, writes=True),
                Param("num_tokens", "i32"),
                Param("max_tokens", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("msg_vectors", "i32"),
                Param("entries", "i32"),
                Param("recv_offset", "i64"),
                Param("counts_offset", "i64"),
                Param("flags_offset", "i64"),
                Param("num_chunks", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("ranks", 1)), GridRule(ceil_div=("num_chunks", 1)),
                  GridRule(constant=1)),
            sizes=dict(LIMITS, tokens_per_cta=self.tokens_per_cta),
        )

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, send_buf: cute.Pointer, dest_slot: cute.Pointer,
                 send_counts: cute.Pointer, done: cute.Pointer, rounds: cute.Pointer,
                 num_tokens: Int32, max_tokens: Int32, ranks: Int32, my_rank: Int32,
                 msg_vectors: Int32, entries: Int32, recv_offset: Int64, counts_offset: Int64,
                 flags_offset: Int64, num_chunks: Int32, stream):
        self.kernel(peer_bases, send_buf, dest_slot, send_counts, done, rounds, num_tokens,
                    max_tokens, ranks, my_rank, msg_vectors, entries, recv_offset, counts_offset,
                    flags_offset, num_chunks, vector_tiled_copy(self.threads)).launch(
            grid=(ranks, num_chunks, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, peer_bases: cute.Pointer, send_buf: cute.Pointer, dest_slot: cute.Pointer,
               send_counts: cute.Pointer, done: cute.Pointer, rounds: cute.Pointer,
               num_tokens: Int32, max_tokens: Int32, ranks: Int32, my_rank: Int32,
               msg_vectors: Int32, entries: Int32, recv_offset: Int64, counts_offset: Int64,
               flags_offset: Int64, num_chunks: Int32, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        dest, chunk, _ = cute.arch.block_idx()
        peer = cute.make_tensor(peer_bases, cute.make_layout(ranks))[dest]
        slots = cute.make_tensor(dest_slot, cute.make_layout(ranks * max_tokens))
        msg_bytes = Int64(msg_vectors) * VECTOR_BYTES
        for t in cutlass.range(chunk, num_tokens, num_chunks):  # token-strided over the CTAs
            slot = slots[dest * max_tokens + t]
            if slot >= 0:
                dst = (peer + recv_offset
                       + (Int64(my_rank) * Int64(max_tokens) + Int64(slot)) * msg_bytes)
                _copy_bytes(tiled_copy, tidx, send_buf.toint() + Int64(t) * msg_bytes, dst,
                            msg_vectors, self.rows_per_tile)
        cute.arch.sync_threads()
        if tidx == 0:
            _finish_destination(
                done, rounds, dest, ranks, num_chunks,
                peer + flags_offset + Int64(my_rank) * FLAG_BYTES,
                send_counts.toint() + Int64(dest) * Int64(entries) * 4,
                peer + counts_offset + Int64(my_rank) * Int64(entries) * 4, entries)


class EpRecv:
    def __init__(self, fmt: str, threads: int = 256):
        if fmt not in FORMATS:
            raise ValueError(f"ep_recv formats: {FORMATS}, not {fmt!r}")
        self.fmt = fmt
        self.threads = threads
        self.rows_per_tile = threads * 2
        self.row_align = FP8_ROW_ALIGN if fmt == "fp8" else 1
        # Payload rows move in 16-byte vectors, NVFP4 rows (H / 2 bytes) in 8-byte ones.
        self.vector_bytes = NVFP4_ROW_VECTOR if fmt == "nvfp4" else VECTOR_BYTES

    @property
    def smem_bytes(self) -> int:
        words = (2 * MAX_RANKS * MAX_ENTRIES + 3 * (MAX_ENTRIES + 4) + MAX_RANKS
                 + 2 * (MAX_TOPK + 4))
        return words * 4 + 10 * 16  # allocator alignment padding

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_recv",
            config={"format": self.fmt, "threads": self.threads},
            params=(
                Param("recv_buf", "ptr", "uint8", align=16),
                Param("recv_counts", "ptr", "int32", align=4, min_elements=("ranks", 2)),
                Param("flags", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("rounds", "ptr", "int64", align=8),
                Param("error", "ptr", "int32", align=4, writes=True),
                Param("tokens", "ptr", "uint8", align=16, writes=True),
                Param("scales", "ptr", "uint8" if self.fmt == "nvfp4" else "float32", align=4,
                      writes=True),
                Param("scales_offsets", "ptr", "int32", align=4, writes=True),
                Param("row_offsets", "ptr", "int32", align=4, writes=True),
                Param("expert_ids", "ptr", "int32", align=4, writes=True),
                Param("seg_counts", "ptr", "int32", align=4, writes=True),
                Param("src_info", "ptr", "int32", align=4, writes=True),
                Param("comb_rows", "ptr", "int32", align=4, writes=True),
                Param("comb_weights", "ptr", "float32", align=4, writes=True),
                Param("comb_tokens", "ptr", "int32", align=4, writes=True),
                Param("comb_counts", "ptr", "int32", align=4, writes=True,
                      min_elements=("ranks", 1)),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("max_tokens", "i32"),
                Param("topk", "i32"),
                Param("local_experts", "i32"),
                Param("shared", "i32"),
                Param("shared_begin", "i32"),
                Param("shared_end", "i32"),
                Param("msg_bytes", "i32"),
                Param("payload_vectors", "i32"),
                Param("scales_offset", "i32"),
                Param("meta_offset", "i32"),
                Param("row_capacity", "i32"),
                Param("timeout_ns", "i64"),
                Param("ctas_per_source", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("ranks", 1)), GridRule(ceil_div=("ctas_per_source", 1)),
                  GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes=dict(LIMITS, row_align=self.row_align, vector_bytes=self.vector_bytes),
        )

    @cute.jit
    def __call__(self, recv_buf: cute.Pointer, recv_counts: cute.Pointer, flags: cute.Pointer,
                 rounds: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
                 scales: cute.Pointer, scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
                 expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
                 comb_rows: cute.Pointer,
                 comb_weights: cute.Pointer, comb_tokens: cute.Pointer, comb_counts: cute.Pointer,
                 ranks: Int32, my_rank: Int32, max_tokens: Int32, topk: Int32,
                 local_experts: Int32, shared: Int32, shared_begin: Int32, shared_end: Int32,
                 msg_bytes: Int32, payload_vectors: Int32, scales_offset: Int32,
                 meta_offset: Int32, row_capacity: Int32, timeout_ns: Int64,
                 ctas_per_source: Int32, stream):
        self.kernel(recv_buf, recv_counts, flags, rounds, error, tokens, scales, scales_offsets,
                    row_offsets, expert_ids, seg_counts, src_info, comb_rows, comb_weights,
                    comb_tokens, comb_counts, ranks, my_rank, max_tokens, topk, local_experts,
                    shared, shared_begin, shared_end, msg_bytes, payload_vectors, scales_offset,
                    meta_offset, row_capacity, timeout_ns, ctas_per_source,
                    row_tiled_copy(self.threads, cutlass.Uint8, self.vector_bytes)).launch(
            grid=(ranks, ctas_per_source, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, recv_buf: cute.Pointer, recv_counts: cute.Pointer, flags: cute.Pointer,
               rounds: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
               scales: cute.Pointer, scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
               expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
               comb_rows: cute.Pointer,
               comb_weights: cute.Pointer, comb_tokens: cute.Pointer, comb_counts: cute.Pointer,
               ranks: Int32, my_rank: Int32, max_tokens: Int32, topk: Int32,
               local_experts: Int32, shared: Int32, shared_begin: Int32, shared_end: Int32,
               msg_bytes: Int32, payload_vectors: Int32, scales_offset: Int32,
               meta_offset: Int32, row_capacity: Int32, timeout_ns: Int64,
               ctas_per_source: Int32, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        source, cta, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        segments = local_experts + shared
        entries = 1 + segments
        payload_bytes = Int64(payload_vectors) * self.vector_bytes
        blocks = payload_vectors * self.vector_bytes // FP8_BLOCK  # fp8: one byte per element
        # nvfp4: H / 16 e4m3 scales per row (two codes a byte), in RK groups of 4 columns.
        scale_cols = payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK
        rk = (scale_cols + 3) // 4

        smem = cutlass.memory.SmemAllocator()
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(MAX_RANKS * MAX_ENTRIES), byte_alignment=16)
        s_base = smem.allocate_tensor(Int32, cute.make_layout(MAX_RANKS * MAX_ENTRIES), byte_alignment=16)
        s_tot = smem.allocate_tensor(Int32, cute.make_layout(MAX_ENTRIES + 4), byte_alignment=16)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(MAX_ENTRIES + 4), byte_alignment=16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(MAX_ENTRIES + 4), byte_alignment=16)
        s_arrived = smem.allocate_tensor(Int32, cute.make_layout(MAX_RANKS), byte_alignment=16)
        s_rows = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)
        s_srow = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOPK + 4), byte_alignment=16)

        # 1. Wait for every source, bounded.
        _wait_for_sources(tidx, ranks, flags, rounds, error, timeout_ns, Int32(PHASE_DISPATCH),
                          s_arrived)
        cute.arch.sync_threads()

        # 2. Counts of the sources that arrived (the others count as nothing), clamped to what
        # the buffers can hold so that no row can land outside them.
        counts = cute.make_tensor(recv_counts, cute.make_layout(ranks * entries))
        for i in cutlass.range(tidx, ranks * entries, self.threads):
            value = Int32(0)
            if s_arrived[i // entries] != 0:
                value = counts[i]
            if value < 0 or value > max_tokens:
                value = Int32(0)
                _store_i32(error.toint() + 12, Int32(1))
            s_cnt[i] = value
        cute.arch.sync_threads()

        # 3. Rows of each segment, padded to the format's alignment; 4. their offsets (nvfp4:
        # also the first 128-row scale block of each segment, every segment on fresh blocks).
        for g in cutlass.range(tidx, segments, self.threads):
            total = Int32(0)
            for s in cutlass.range(ranks):
                total = total + s_cnt[s * entries + 1 + g]
            s_tot[g] = (total + self.row_align - 1) // self.row_align * self.row_align
            if cutlass.const_expr(self.fmt == "nvfp4"):
                s_first[g] = (total + ATOM_ROWS - 1) // ATOM_ROWS
        cute.arch.sync_threads()
        if warp == 0:
            warp_exclusive_scan(s_tot, s_off, segments, lane)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                warp_exclusive_scan(s_first, s_first, segments, lane)
        cute.arch.sync_threads()
        # 5. First row of each (segment, source).
        for g in cutlass.range(tidx, segments, self.threads):
            run = s_off[g]
            for s in cutlass.range(ranks):
                s_base[g * ranks + s] = run
                run = run + s_cnt[s * entries + 1 + g]
            s_tot[g] = run - s_off[g]  # now the unpadded row count
        cute.arch.sync_threads()

        # 6. One CTA writes the segment metadata; every CTA clears a share of the padding.
        if source == 0 and cta == 0:
            offsets = cute.make_tensor(row_offsets, cute.make_layout(segments + 1))
            for g in cutlass.range(tidx, segments + 1, self.threads):
                offsets[g] = s_off[g]
            for g in cutlass.range(tidx, segments, self.threads):
                cute.make_tensor(expert_ids, cute.make_layout(segments))[g] = g - shared
                cute.make_tensor(seg_counts, cute.make_layout(segments))[g] = s_tot[g]
            for s in cutlass.range(tidx, ranks, self.threads):
                cute.make_tensor(comb_counts, cute.make_layout(ranks))[s] = s_cnt[s * entries]
            if cutlass.const_expr(self.fmt == "nvfp4"):
                for g in cutlass.range(tidx, segments, self.threads):
                    cute.make_tensor(scales_offsets, cute.make_layout(segments))[g] = \
                        s_first[g] - s_off[g] // ATOM_ROWS
        if cutlass.const_expr(self.row_align > 1):
            self._zero_row_padding(tidx, source * ctas_per_source + cta, ranks * ctas_per_source,
                                   tokens, scales, src_info, s_off, s_tot, segments,
                                   payload_bytes, blocks, row_capacity)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            self._zero_scale_padding(tidx, source * ctas_per_source + cta,
                                     ranks * ctas_per_source, scales, s_tot, s_first, segments,
                                     rk)

        # 7. Expand this source's messages into expert rows.
        vec = self.vector_bytes
        layout = cute.make_layout((payload_vectors, vec), stride=(vec, 1))
        tiler = (self.rows_per_tile, vec)
        g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = tiled_copy.get_slice(tidx)
        n = s_cnt[source * entries]
        for j in cutlass.range(cta, n, ctas_per_source):
            msg = recv_buf.toint() + (Int64(source) * Int64(max_tokens) + Int64(j)) * Int64(msg_bytes)
            meta = msg + Int64(meta_offset)
            at = Int64(source) * Int64(max_tokens) + Int64(j)
            if tidx < topk:
                e = _load_i32(meta + 4 + Int64(tidx) * 4) - my_rank * local_experts
                p = _load_i32(meta + 4 + Int64(2 * topk + tidx) * 4)
                row = Int32(-1)
                if e >= 0 and e < local_experts:
                    g = e + shared
                    if p >= 0 and p < s_cnt[source * entries + 1 + g]:
                        row = s_base[g * ranks + source] + p
                        if cutlass.const_expr(self.fmt == "nvfp4"):
                            s_srow[tidx] = row - s_off[g] + s_first[g] * ATOM_ROWS
                    else:
                        _store_i32(error.toint() + 12, Int32(1))
                s_rows[tidx] = row
                _store_i32(comb_rows.toint() + (at * Int64(topk) + Int64(tidx)) * 4, row)
                _store_f32(comb_weights.toint() + (at * Int64(topk) + Int64(tidx)) * 4,
                           _load_f32(meta + 4 + Int64(topk + tidx) * 4))
            if tidx == topk:
                tok = _load_i32(meta)
                _store_i32(comb_tokens.toint() + at * 4, tok)
                row = Int32(-1)
                if shared != 0 and source == my_rank and tok >= shared_begin and tok < shared_end:
                    row = s_base[source] + tok - shared_begin
                if cutlass.const_expr(self.fmt == "nvfp4"):
                    s_srow[topk] = row  # segment 0 starts at row 0 and scale block 0
                s_rows[topk] = row
                s_rows[topk + 1] = tok
            cute.arch.sync_threads()
            tok = s_rows[topk + 1]
            if tidx <= topk:
                row = s_rows[tidx]
                if row >= 0:
                    slot = Int32(-1)
                    if tidx < topk:
                        slot = tidx
                    _store_i32(src_info.toint() + Int64(row) * 8, tok)
                    _store_i32(src_info.toint() + Int64(row) * 8 + 4, slot)
            g_src = cute.zipped_divide(
                cute.make_tensor(_ptr(cutlass.Uint8, msg, vec), layout), tiler)
            for tile in cutlass.range(cute.ceil_div(payload_vectors, self.rows_per_tile)):
                t_src = thr.partition_S(g_src[((None, None), tile)])
                pred = row_predicate(thr.partition_S(g_crd[((None, None), tile)]),
                                     payload_vectors)
                regs = cute.make_fragment_like(t_src)
                cute.copy(tiled_copy, t_src, regs, pred=pred)
                for k in cutlass.range(topk + 1):
                    row = s_rows[k]
                    if row >= 0:
                        g_dst = cute.zipped_divide(cute.make_tensor(
                            _ptr(cutlass.Uint8, tokens.toint() + Int64(row) * payload_bytes, vec),
                            layout), tiler)
                        cute.copy(tiled_copy, regs, thr.partition_D(g_dst[((None, None), tile)]),
                                  pred=row_predicate(thr.partition_S(g_crd[((None, None), tile)]),
                                                     payload_vectors))
            if cutlass.const_expr(self.fmt == "fp8"):
                for i in cutlass.range(tidx, (topk + 1) * blocks, self.threads):
                    k = i // blocks
                    b = i - k * blocks
                    row = s_rows[k]
                    if row >= 0:
                        _store_f32(scales.toint() + (Int64(b) * Int64(row_capacity) + Int64(row)) * 4,
                                   _load_f32(msg + Int64(scales_offset) + Int64(b) * 4))
            if cutlass.const_expr(self.fmt == "nvfp4"):
                # A 32-bit word per (row, group of 4 scale columns); columns past H / 16 zero.
                for i in cutlass.range(tidx, (topk + 1) * rk, self.threads):
                    k = i // rk
                    c = i - k * rk
                    row = s_rows[k]
                    if row >= 0:
                        word = _load_i32(msg + Int64(scales_offset) + Int64(c) * 4)
                        valid = scale_cols - c * 4
                        if valid < 4:
                            word = word & ((Int32(1) << (valid * 8)) - 1)
                        _store_i32(scales.toint() + _scale_word_offset(s_srow[k], c, rk), word)
            cute.arch.sync_threads()

    @cute.jit
    def _zero_row_padding(self, tidx, cta_rank, num_ctas, tokens: cute.Pointer,
                          scales: cute.Pointer, src_info: cute.Pointer, s_off: cute.Tensor,
                          s_tot: cute.Tensor, segments, payload_bytes, blocks, row_capacity):
        """FP8: zero the alignment rows after each segment's rows (payload words, their scales,
        src_info -1), the grid's threads striding over them (rows below the count are written
        by the expansion, so the two never meet)."""
        first = cta_rank * self.threads + tidx
        stride = num_ctas * self.threads
        words = Int32(payload_bytes // 4)
        for g in cutlass.range(segments):
            pad_begin = s_off[g] + s_tot[g]
            pad_rows = s_off[g + 1] - pad_begin
            for i in cutlass.range(first, pad_rows * words, stride):
                _store_i32(tokens.toint() + Int64(pad_begin) * payload_bytes + Int64(i) * 4,
                           Int32(0))
            for i in cutlass.range(first, pad_rows * blocks, stride):
                r = pad_begin + i // blocks
                _store_f32(scales.toint()
                           + (Int64(i % blocks) * Int64(row_capacity) + Int64(r)) * 4,
                           Float32(0.0))
            for i in cutlass.range(first, pad_rows * 2, stride):
                _store_i32(src_info.toint() + Int64(pad_begin) * 8 + Int64(i) * 4, Int32(-1))

    @cute.jit
    def _zero_scale_padding(self, tidx, cta_rank, num_ctas, scales: cute.Pointer,
                            s_tot: cute.Tensor, s_first: cute.Tensor, segments, rk):
        """Zero the scale words of the rows past each segment's count in its last 128-row block,
        the grid's threads striding over the block's words in address order (coalesced). The
        rows below the count are written by the expansion, so the two never meet."""
        first = cta_rank * self.threads + tidx
        stride = num_ctas * self.threads
        for g in cutlass.range(segments):
            used = s_tot[g] - (s_first[g + 1] - s_first[g] - 1) * ATOM_ROWS  # rows in last block
            if s_tot[g] > 0 and used < ATOM_ROWS:
                base = scales.toint() + Int64(s_first[g + 1] - 1) * Int64(rk) * ATOM_BYTES
                for i in cutlass.range(first, rk * (ATOM_BYTES // 4), stride):
                    w = i % (ATOM_BYTES // 4)
                    if w // 4 + 32 * (w % 4) >= used:  # word w of an atom holds row w/4 + 32 (w%4)
                        _store_i32(base + Int64(i) * 4, Int32(0))


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
                s_rows[tidx] = _load_i32(comb_rows.toint() + (at * Int64(topk) + Int64(tidx)) * 4)
                s_w[tidx] = _load_f32(comb_weights.toint()
                                      + (at * Int64(topk) + Int64(tidx)) * 4)
            if tidx == 0:
                s_rows[MAX_TOPK] = _load_i32(comb_tokens.toint() + at * 4)
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
        g_dst = cute.zipped_divide(cute.make_tensor(_ptr(BFloat16, dst_addr, 16), layout), tiler)
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
                        _ptr(BFloat16, y.toint() + Int64(row) * Int64(hidden) * 2, 16), layout),
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
                e = _load_i32(ids_at + Int64(tidx) * 4)
                filled = Int32(0)
                if e >= 0 and e < experts:
                    d = e // local_experts
                    filled = Int32(1)
                    if skip_a2a != 0 and d != my_rank:
                        filled = Int32(0)
                    if weighted != 0:
                        for k2 in cutlass.range(tidx):
                            e2 = _load_i32(ids_at + Int64(k2) * 4)
                            if e2 >= 0 and e2 < experts and e2 // local_experts == d:
                                filled = Int32(0)
                s_filled[tidx] = filled
            cute.arch.sync_threads()
            slots = combine_buf.toint() + Int64(t) * Int64(topk) * row_bytes
            has_shared = shared != 0 and t >= shared_begin and t < shared_end
            for tile in cutlass.range(cute.ceil_div(rows, self.threads)):
                if weighted != 0:
                    g_out = cute.zipped_divide(cute.make_tensor(
                        _ptr(BFloat16, out.toint() + Int64(t) * row_bytes, 16), layout),
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
                        g_out = cute.zipped_divide(cute.make_tensor(_ptr(
                            BFloat16, out.toint() + (Int64(t) * Int64(topk) + Int64(k))
                            * row_bytes, 16), layout), tiler)
                        t_out = thr.partition_D(g_out[((None, None), tile)])
                        regs = cute.make_fragment_like(t_out)
                        regs.fill(0.0)
                        if s_filled[k] != 0:
                            g_in = cute.zipped_divide(cute.make_tensor(_ptr(
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
        g_in = cute.zipped_divide(cute.make_tensor(_ptr(BFloat16, row_addr, 16), layout), tiler)
        t_in = thr.partition_S(g_in[((None, None), tile)])
        regs = cute.make_fragment_like(t_in)
        regs.fill(0.0)
        cute.copy(bf16_copy, t_in, regs, pred=pred)
        acc.store(acc.load() + regs.load().to(Float32))


def ep_kernels() -> list:
    return [EpPlan(), EpEncode("bf16"), EpEncode("fp8"), EpEncode("nvfp4", "software"),
            EpEncode("nvfp4", "hardware"), EpSend(), *(EpRecv(f) for f in FORMATS),
            EpCombineSend(), EpCombineRecv()]
