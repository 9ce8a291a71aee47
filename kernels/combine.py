"""`ep_combine`: one persistent launch per combine, a CTA per channel (transport v2).

Combine retraces dispatch's streams backwards through `layouts.channels`' combine rings: the
messages rank d received from source s on channel c go back, in the same order, on the stream
(c, d -> s). Both ends know every stream's length from the dispatch (the expert side from its
handle, the home side from its own topk_ids), so no counts travel. Each CTA has SEND_WARPS
sender warps, RECV_WARPS receiver warps and a publisher warp:

- Senders (the expert side): the warps of home rank s take s's messages of this channel a chunk
  at a time. A weighted combine sends one bf16 row per message, the fp32 sum of w_k * y[row_k]
  over the message's rows here (zeros for a message that only brought the shared expert's
  token); an unreduced one sends each of the message's rows, in k order. Rows are stored
  straight into the home rank's ring slots over NVLink once the home rank has returned credit.
  On two ranks (PUBLISH_MAX_RANKS) the warps of a home do not wait for each other: each records
  its progress after a chunk, and a publisher warp (`_publish`) advances the stream's tail at the
  home rank to the chunk all of them have written, with the system-scope fence that the senders
  then never wait for. On more, a home's warps meet after each chunk (a named barrier) and
  their first warp fences and advances the tail.
- Receivers (the home side): a chunk of this channel's tokens at a time (unreduced or
  weighted at home, as many tokens as bring at most half a ring from every rank), routed by
  warp 0 while the warps sum the chunk before (two chunks' routes in shared memory), each token
  by the warp that claims it next (a shared counter: warp 0 joins once it has routed): a
  weighted combine adds, in fp32, the row of every rank the token went to and the shared
  expert's row (this rank's `y`, unweighted); an unreduced one copies each k's row (zeros where
  none), and one weighted at home (`AT_HOME`: the weights are the home side's, given to
  combine, not dispatch's) sums, in fp32 and k order, home_weights[t, k] times each k's row.
  Credit returns to every rank after the chunk.

Both sums run through one routine (`EpCombine._row_sum`): a warp streams the listed rows a step
at a time through its own shared-memory stages by cp.async, several steps in flight, and adds
them in fp32 with little more than a conversion and a multiply-add per value (counters, not
divisions or layout arithmetic, index the steps: the per-value work is what bounds a combine on
a small SM budget). The rows that go or come home as they are (unreduced, weighted at home)
stream through the same stages (`EpCombine._copy_rows`), several steps a warp in flight where a
load and then its store of each step kept one: with the chunks above, a decode step's combine
weighted at home took 50 us instead of 105 and unreduced 55 instead of 203 on 2 emulated ranks
(emulated-2026-11-29-H200-decode-combines.json in perf/results).

Waits are bounded by `timeout_ns` like dispatch's (the missing rank and phase are recorded). It
runs on the `active` channels its dispatch used; launched with spare CTAs, as a prefill-sized
combine is, it places them one per TPC like the dispatch (`kernels/placement.py`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from kernels.copy import row_tiled_copy
from kernels.dispatch.common import MAX_CHUNK, MAX_RANKS, MAX_TOPK, WARP, _wait_at_least
from kernels.memory import gmem_ptr, load_f32, load_i32, nanosleep, trace_word
from kernels.placement import placed_channel
from kernels.nvfp4 import high_bf16, low_bf16
from kernels.routing import channel_tokens, load_id, route_ids, valid_expert
from layouts.abi import GridRule, KernelSpec, Param
from layouts.buffers import AT_EXPERTS, AT_HOME, UNREDUCED  # the `weighted` argument
from layouts.channels import (COMBINE, COMBINE_TRACE_FIELDS, COMBINE_VECTORS, HEADS, TAILS,
                              channel_messages_layout, counters_layout, ring_layout, trace_layout)

SEND_WARPS = 8
RECV_WARPS = 4
PUBLISH_WARPS = 1  # the warp that publishes the expert side's streams (`_publish`)
PUBLISH_POLL_NS = 200  # its sleep between polls of the sender warps' progress
# The most ranks whose streams the publisher warp publishes. Past them, each home's sender warps
# meet after every chunk and their first warp fences and publishes, so each home's fences run in
# its own warp: with one warp publishing four homes the combine was slower (4 x H100: 531 us
# lockstep without the publisher, 569-576 with it; 2 x H100: 386 without, 360 with).
PUBLISH_MAX_RANKS = 2
ROW_VECTOR = 8  # bf16 elements per 16-byte access
PAIRS = ROW_VECTOR // 2  # 32-bit words of bf16 pairs in one
STAGES = 8  # row steps (4 vectors a lane) a warp's sum has in flight (cp.async to shared), plus one
PHASE_COMBINE = 2  # the error record's phase (1-based, layouts.buffers.PHASES order)
# s_flag's word of the receivers' next token of a chunk (after alive and the per-rank counts).
CLAIM_AT = 4 * MAX_RANKS + 4
# s_flag's words of the two routed chunks' token counts (`_route_chunk`), one a buffer.
LENGTH_AT = CLAIM_AT + 1
LIMITS = {"max_ranks": MAX_RANKS, "max_topk": MAX_TOPK, "max_chunk": MAX_CHUNK}


@cute.jit
def _handle_word(i, words, topk, sub, per_home, first, s, max_tokens):
    """Element index, in the dispatch handle's [R, max_tokens, K] rows and weights, of word i of
    a sender warp's chunk: its q-th message (message first + sub + q * per_home of home s),
    slot k, for i = q * topk + k. Indices past `words` read a word in bounds, never used."""
    i = cutlass.max(cutlass.min(i, words - 1), 0)
    q = i // topk
    j = cutlass.min(first + sub + q * per_home, max_tokens - 1)
    return (Int64(s) * Int64(max_tokens) + Int64(j)) * Int64(topk) + Int64(i - q * topk)


@cute.jit
def _home_tail(peers: cute.Tensor, s, counters_offset, counters, channel, my_rank):
    """The address, in home rank s's counters, of the tail of this rank's combine stream on
    `channel` (what the expert side publishes)."""
    return peers[s] + counters_offset + Int64(counters((channel, my_rank, TAILS, COMBINE))) * 8


@cute.jit
def _trace_set(trace: cute.Pointer, channel, field: cutlass.Constexpr, value):
    cute.arch.store(trace_word(trace, channel, COMBINE_TRACE_FIELDS, field), Int64(value))


@cute.jit
def _trace_max(trace: cute.Pointer, channel, field: cutlass.Constexpr, value):
    cute.arch.atomic_max(trace_word(trace, channel, COMBINE_TRACE_FIELDS, field), Int64(value))


class EpCombine:
    def __init__(self, vectors: int = 4):
        self.threads = WARP * (SEND_WARPS + RECV_WARPS + PUBLISH_WARPS)
        # 16-byte vectors per lane in one step of a row (a warp's step: WARP * vectors of the
        # row's vectors); a warp's sum has self.stages - 1 steps of rows in flight.
        self.vectors = vectors
        # Steps in a warp's shared-memory ring (a power of two): as many as the shared memory
        # holds, STAGES at 4 vectors. At H 7168 and 24 SMs on 2 x H200, 7 vectors through 4
        # stages took the combine from 346.0-346.4 to 328.2-328.8 us lockstep
        # (ab-2026-11-27-2xH200-combine-vectors.json): the loop's overhead per value is what
        # bounds it.
        self.stages = STAGES if vectors <= 4 else 4

    @property
    def smem_bytes(self) -> int:
        words = (SEND_WARPS * 2 * MAX_CHUNK * MAX_TOPK  # rows, weights of a sender's chunk
                 + 3 * MAX_CHUNK * MAX_RANKS  # receivers: first item per (token, rank), counts x 2
                 + 2 * MAX_CHUNK + 4 * MAX_RANKS + 8
                 + 2 * MAX_CHUNK * MAX_TOPK  # receivers: two chunks' ids
                 + 2 * RECV_WARPS * (MAX_TOPK + 1)  # receivers: a token's row addresses
                 + RECV_WARPS * MAX_TOPK  # receivers: a token's home weights
                 + SEND_WARPS)  # senders: done
        return (4 * words + 8 * 2 * MAX_RANKS + 8 * SEND_WARPS * MAX_TOPK
                + 8 * (SEND_WARPS + RECV_WARPS) * MAX_TOPK  # the row copies' destinations
                + 8 * SEND_WARPS + 8 * MAX_RANKS  # senders: progress; the tails at the start
                + 19 * 16 + 128
                + self.stage_bytes * (SEND_WARPS + RECV_WARPS))

    @property
    def stage_bytes(self) -> int:
        """Shared memory of one warp's row sums: self.stages steps of a row."""
        return self.stages * WARP * self.vectors * 16

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_combine",
            config={"vectors": self.vectors},
            params=(
                Param("peer_bases", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("y", "ptr", "bfloat16", align=16),
                Param("comb_rows", "ptr", "int32", align=4),
                Param("comb_weights", "ptr", "float32", align=4),
                Param("chan_msgs", "ptr", "int32", align=4, min_elements=("ranks", 1)),
                # int32 ids, or int64 read as word pairs (id_words 2: `kernels.routing.load_id`).
                Param("topk_ids", "ptr", "int32", align=4),
                Param("id_words", "i32"),
                Param("out", "ptr", "bfloat16", align=16, writes=True),
                Param("home_weights", "ptr", "float32", align=4),
                Param("streams", "ptr", "int64", align=8, writes=True),
                Param("error", "ptr", "int32", align=4, writes=True),
                Param("num_tokens", "i32"),
                Param("max_tokens", "i32"),
                Param("topk", "i32"),
                Param("local_experts", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("weighted", "i32"),
                Param("skip_a2a", "i32"),
                Param("shared", "i32"),
                Param("shared_begin", "i32"),
                Param("shared_end", "i32"),
                Param("hidden", "i32"),
                Param("row_capacity", "i32"),
                Param("channels", "i32"),
                Param("active", "i32"),
                # CTAs launched: more than `active` places the channels one per TPC
                # (`kernels/placement.py`, through the `place` words); the others leave.
                Param("launched", "i32"),
                Param("place", "ptr", "int32", align=4, writes=True),
                Param("ring_slots", "i32"),
                Param("chunk_tokens", "i32"),
                Param("ring_offset", "i64"),
                Param("counters_offset", "i64"),
                Param("timeout_ns", "i64"),
                Param("trace", "ptr", "int64", align=8, writes=True),
                Param("tracing", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("launched", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes=dict(LIMITS),
        )

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, y: cute.Pointer, comb_rows: cute.Pointer,
                 comb_weights: cute.Pointer, chan_msgs: cute.Pointer, topk_ids: cute.Pointer,
                 id_words: Int32, out: cute.Pointer, home_weights: cute.Pointer,
                 streams: cute.Pointer,
                 error: cute.Pointer, num_tokens: Int32, max_tokens: Int32, topk: Int32,
                 local_experts: Int32, ranks: Int32, my_rank: Int32, weighted: Int32,
                 skip_a2a: Int32, shared: Int32, shared_begin: Int32, shared_end: Int32,
                 hidden: Int32, row_capacity: Int32, channels: Int32,
                 active: Int32, launched: Int32, place: cute.Pointer, ring_slots: Int32,
                 chunk_tokens: Int32, ring_offset: Int64,
                 counters_offset: Int64, timeout_ns: Int64, trace: cute.Pointer,
                 tracing: Int32, stream):
        self.kernel(peer_bases, y, comb_rows, comb_weights, chan_msgs, topk_ids, id_words, out,
                    home_weights, streams, error, num_tokens, max_tokens, topk, local_experts,
                    ranks, my_rank, weighted, skip_a2a, shared, shared_begin, shared_end,
                    hidden, row_capacity, channels, active, launched, place, ring_slots,
                    chunk_tokens, ring_offset, counters_offset, timeout_ns, trace,
                    tracing).launch(
            grid=(launched, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, peer_bases: cute.Pointer, y: cute.Pointer, comb_rows: cute.Pointer,
               comb_weights: cute.Pointer, chan_msgs: cute.Pointer, topk_ids: cute.Pointer,
               id_words: Int32, out: cute.Pointer, home_weights: cute.Pointer,
               streams: cute.Pointer,
               error: cute.Pointer, num_tokens: Int32, max_tokens: Int32, topk: Int32,
               local_experts: Int32, ranks: Int32, my_rank: Int32, weighted: Int32,
               skip_a2a: Int32, shared: Int32, shared_begin: Int32, shared_end: Int32,
               hidden: Int32, row_capacity: Int32, channels: Int32,
               active: Int32, launched: Int32, place: cute.Pointer, ring_slots: Int32,
               chunk_tokens: Int32, ring_offset: Int64,
               counters_offset: Int64, timeout_ns: Int64, trace: cute.Pointer, tracing: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        channel, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        smem = cutlass.memory.SmemAllocator()
        s_rows = smem.allocate_tensor(Int32, cute.make_layout(SEND_WARPS * MAX_CHUNK * MAX_TOPK),
                                      byte_alignment=16)
        s_w = smem.allocate_tensor(Float32, cute.make_layout(SEND_WARPS * MAX_CHUNK * MAX_TOPK),
                                   byte_alignment=16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(MAX_CHUNK * MAX_RANKS),
                                       byte_alignment=16)
        # A chunk's routes, two chunks' worth: the receivers sum one while warp 0 routes the next.
        s_items = smem.allocate_tensor(Int32, cute.make_layout(2 * MAX_CHUNK * MAX_RANKS),
                                       byte_alignment=16)
        s_mask = smem.allocate_tensor(Int32, cute.make_layout(2 * MAX_CHUNK), byte_alignment=16)
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(4 * MAX_RANKS + 8),
                                      byte_alignment=16)
        s_pos = smem.allocate_tensor(Int64, cute.make_layout(2 * MAX_RANKS), byte_alignment=16)
        s_ids = smem.allocate_tensor(Int32, cute.make_layout(2 * MAX_CHUNK * MAX_TOPK),
                                     byte_alignment=16)
        s_addr = smem.allocate_tensor(Int64, cute.make_layout(RECV_WARPS * (MAX_TOPK + 1)),
                                      byte_alignment=16)
        s_hw = smem.allocate_tensor(Float32, cute.make_layout(RECV_WARPS * MAX_TOPK),
                                    byte_alignment=16)
        s_sa = smem.allocate_tensor(Int64, cute.make_layout(SEND_WARPS * MAX_TOPK),
                                    byte_alignment=16)
        # Where each listed row goes, for the row copies (`_copy_rows`): a sender warp's
        # MAX_TOPK ring slots, then a receiver warp's MAX_TOPK output rows.
        s_da = smem.allocate_tensor(Int64, cute.make_layout(
            (SEND_WARPS + RECV_WARPS) * MAX_TOPK), byte_alignment=16)
        # Each sender warp's stream position after its last chunk (-1: none yet), and whether
        # it is done: what `_publish` publishes from.
        s_prog = smem.allocate_tensor(Int64, cute.make_layout(SEND_WARPS), byte_alignment=16)
        s_done = smem.allocate_tensor(Int32, cute.make_layout(SEND_WARPS), byte_alignment=16)
        # Each home's stream tail at the start (the senders' and `_publish`'s), read before any
        # sender records its end position over it.
        s_pub = smem.allocate_tensor(Int64, cute.make_layout(MAX_RANKS), byte_alignment=16)
        s_stage = smem.allocate_tensor(BFloat16, cute.make_layout(
            (SEND_WARPS + RECV_WARPS) * self.stage_bytes // 2), byte_alignment=128)
        # This warp's stages of row steps for its sums (`_row_sum`).
        stages = (s_stage.iterator + warp * (self.stage_bytes // 2)).align(128)
        s_channel = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        # Spare CTAs: one channel per TPC (kernels/placement.py); the others leave.
        channel = placed_channel(place, channel, active, launched, s_channel, tidx)
        if channel >= 0:
            peers = cute.make_tensor(peer_bases, cute.make_layout(ranks))
            here = peers[my_rank]
            counters = counters_layout(channels, ranks)
            ring = ring_layout(hidden * 2, ring_slots, channels, ranks)
            vectors = hidden // ROW_VECTOR
            if tidx < SEND_WARPS:
                s_prog[tidx] = Int64(-1)
                s_done[tidx] = Int32(0)
            if warp == SEND_WARPS + RECV_WARPS and lane < ranks:
                s_pub[lane] = cute.arch.load(gmem_ptr(Int64, streams.toint() + Int64(
                    counters((channel, lane, TAILS, COMBINE))) * 8, 8), Int64)
            if tracing != 0:
                if tidx == 0:
                    _trace_set(trace, channel, "start", cute.arch.globaltimer())
                if tidx > 0 and tidx < len(COMBINE_TRACE_FIELDS):
                    cute.arch.store(gmem_ptr(Int64, trace.toint() + Int64(trace_layout(
                        channel + 1, COMBINE_TRACE_FIELDS)((tidx, channel))) * 8, 8), Int64(0))
            cute.arch.sync_threads()

            # A row's steps, WARP * vectors 16-byte vectors each (both roles walk rows by them).
            steps = cute.ceil_div(vectors, WARP * self.vectors)
            if warp < SEND_WARPS:
                self._send(warp, lane, channel, peers, here, y, comb_rows, comb_weights,
                           chan_msgs, streams, error, max_tokens, topk, ranks, my_rank, weighted,
                           row_capacity, channels, ring_slots, chunk_tokens, ring_offset,
                           counters_offset, counters, ring, timeout_ns, steps, vectors,
                           s_rows, s_w, s_sa, s_da, s_prog, s_done, s_pub, stages, trace,
                           tracing)
            elif warp == SEND_WARPS + RECV_WARPS:
                self._publish(lane, channel, peers, ranks, my_rank, counters_offset, counters,
                              s_prog, s_done, s_pub)
            else:
                self._receive(warp - SEND_WARPS, lane, channel, peers, here, y, topk_ids,
                              id_words, out, home_weights, streams, error, num_tokens, topk,
                              local_experts, ranks, my_rank, weighted, skip_a2a, shared,
                              shared_begin, shared_end, channels, active, ring_slots,
                              chunk_tokens, ring_offset, counters_offset, counters, ring,
                              timeout_ns, steps, vectors, s_first, s_items, s_mask, s_flag,
                              s_pos, s_ids, s_addr, s_hw, s_da, stages, trace, tracing)
            cute.arch.sync_threads()
            if tracing != 0 and tidx == 0:
                _trace_set(trace, channel, "end", cute.arch.globaltimer())

    @cute.jit
    def _fits_half(self, ring_slots, topk):
        """1 where a token's K rows from a rank fit in half a ring. Unreduced or weighted at
        home, where a token brings up to K rows from a rank, a home chunk then takes as many
        tokens (up to chunk_tokens) as bring at most half a ring from every rank
        (`_route_chunk`), and a sender's chunk as many messages as fill at most half a ring
        (`_send`): every sender chunk holding a row of a home chunk starts within that chunk's
        rows, so it ends within a ring of the chunk's first row and goes out without waiting
        for the home side (for the slowest warp of the senders, whose progress is the published
        tail; a faster one may wait for credit). Where K rows fill more than half a ring (tiny
        rings), a home chunk is one token and a sender's chunk fills up to the whole ring."""
        return Int32(topk <= ring_slots // 2)

    # Expert side ---------------------------------------------------------------------------

    @cute.jit
    def _send(self, w, lane, channel, peers: cute.Tensor, here, y: cute.Pointer,
              comb_rows: cute.Pointer, comb_weights: cute.Pointer, chan_msgs: cute.Pointer,
              streams: cute.Pointer, error: cute.Pointer, max_tokens, topk, ranks, my_rank,
              weighted, row_capacity, channels, ring_slots, chunk_tokens, ring_offset,
              counters_offset, counters, ring, timeout_ns, steps, vectors, s_rows: cute.Tensor,
              s_w: cute.Tensor, s_sa: cute.Tensor, s_da: cute.Tensor, s_prog: cute.Tensor,
              s_done: cute.Tensor, s_pub: cute.Tensor, stages, trace: cute.Pointer, tracing):
        per_home = SEND_WARPS // ranks
        waited = Int64(0)
        s = w % ranks
        sub = w // ranks
        if sub < per_home:
            msgs = cute.make_tensor(chan_msgs, channel_messages_layout(ranks, channels).to_cute())
            n = msgs[(s, channel)]
            # Messages of the channels before this one, 16 loads in flight at a time.
            first = Int32(0)
            for c0 in cutlass.range(0, channel, 16):
                vals = [msgs[(s, cutlass.min(c0 + i, channel - 1))] for i in range(16)]
                for i in cutlass.range_constexpr(16):
                    if c0 + i < channel:
                        first = first + vals[i]
            # The stream's start (read before the kernel's first barrier: warp sub 0 records
            # the end over it while its siblings may not have started).
            pos = s_pub[s]
            head_word = here + counters_offset + Int64(counters((channel, s, HEADS, COMBINE))) * 8
            tail_word = _home_tail(peers, s, counters_offset, counters, channel, my_rank)
            head = pos
            alive = Int32(1)
            at = w * MAX_CHUNK * MAX_TOPK
            # A chunk is up to chunk_tokens messages whose items fit a ring: weighted, one item
            # a message; unreduced, a message's rows here (at most K, which the ring holds), as
            # many messages as fit in `fill` slots: half a ring where K rows fit in half a ring
            # (`_fits_half`), so the chunks that hold a home chunk's rows, each starting
            # before its last row, all fit while the home side has not handed back any of them.
            fill = ring_slots
            if weighted != AT_EXPERTS and self._fits_half(ring_slots, topk) != 0:
                fill = ring_slots // 2
            j0 = Int32(0)
            while j0 < n:
                cap = n - j0
                if cap > chunk_tokens:
                    cap = chunk_tokens
                # Items of the candidate messages: 1 each (weighted), or their rows here.
                mine = Int32(0)
                if lane < cap:
                    mine = Int32(1)
                    if weighted != AT_EXPERTS:
                        mine = self._rows_here(comb_rows, s, first + j0 + lane, topk, max_tokens)
                incl = mine
                for shift in cutlass.range_constexpr(3):
                    up = cute.arch.shuffle_sync_up(incl, 1 << shift)
                    if lane >= (1 << shift):
                        incl = incl + up
                # The messages whose items, with those before them, fit the ring (a prefix).
                cnt = cute.arch.popc(cute.arch.vote_ballot_sync(
                    lane < cap and incl <= fill))
                if cnt == 0:
                    cnt = Int32(1)  # not reached: a message's rows fit (Buffer checks K <= slots)
                total = cute.arch.shuffle_sync(incl, cnt - 1)
                if lane == 0 and alive != 0 and pos + Int64(total) - head > Int64(ring_slots):
                    start = Int64(0)
                    if tracing != 0:
                        start = cute.arch.globaltimer()
                    head, alive = _wait_at_least(head_word, pos + Int64(total) - Int64(ring_slots),
                                                 timeout_ns, error, s, Int32(PHASE_COMBINE))
                    if tracing != 0:
                        waited = waited + cute.arch.globaltimer() - start
                alive = cute.arch.shuffle_sync(alive, 0)
                if alive != 0:
                    # The rows and weights of this warp's messages of the chunk (its q-th at
                    # at + q * MAX_TOPK), every load in flight before the first is used.
                    words = (cnt - sub + per_home - 1) // per_home * topk
                    at_of = [_handle_word(lane + q * WARP, words, topk, sub, per_home,
                                          first + j0, s, max_tokens)
                             for q in range(MAX_CHUNK * MAX_TOPK // WARP)]
                    rows_v = [load_i32(comb_rows.toint() + a * 4) for a in at_of]
                    wts_v = [load_f32(comb_weights.toint() + a * 4) for a in at_of]
                    for q in cutlass.range_constexpr(MAX_CHUNK * MAX_TOPK // WARP):
                        i = lane + q * WARP
                        if i < words:
                            qq = i // topk
                            s_rows[at + qq * MAX_TOPK + i - qq * topk] = rows_v[q]
                            s_w[at + qq * MAX_TOPK + i - qq * topk] = wts_v[q]
                    cute.arch.sync_warp()
                    for m in cutlass.range(sub, cnt, per_home):
                        item = pos + Int64(cute.arch.shuffle_sync(incl - mine, m))
                        mat = at + (m - sub) // per_home * MAX_TOPK
                        # The message's rows here, moved to the front in k order.
                        row = Int32(-1)
                        wk = Float32(0.0)
                        if lane < topk:
                            row = s_rows[mat + lane]
                            wk = s_w[mat + lane]
                        # A row past the dispatch output's capacity (never written: its
                        # dispatch reported the overflow) adds nothing to a weighted sum and
                        # goes home as zeros unreduced, so every rank still gets each item.
                        keep = Int32(row >= 0)
                        if weighted == AT_EXPERTS and row >= row_capacity:
                            keep = Int32(0)
                        here_rows = cute.arch.vote_ballot_sync(keep != 0)
                        live = cute.arch.popc(here_rows)
                        cute.arch.sync_warp()
                        if keep != 0:
                            p = cute.arch.popc(here_rows & ((Int32(1) << lane) - Int32(1)))
                            s_rows[mat + p] = row
                            s_w[mat + p] = wk
                        cute.arch.sync_warp()
                        if weighted == AT_EXPERTS:
                            # The live rows' addresses, then their weighted sum.
                            if lane < live:
                                s_sa[w * MAX_TOPK + lane] = y.toint() + Int64(
                                    s_rows[mat + lane]) * Int64(vectors * 16)
                            cute.arch.sync_warp()
                            self._row_sum(lane, live, s_sa, w * MAX_TOPK, s_w, mat, True,
                                          self._ring_row(peers[s], ring_offset, ring,
                                                         ring_slots, channel, my_rank, item),
                                          steps, vectors, stages)
                        else:
                            self._send_rows(lane, w, peers[s], ring_offset, ring, item,
                                            ring_slots, channel, my_rank, y, live, s_rows, mat,
                                            s_sa, s_da, steps, vectors, stages, row_capacity)
                        cute.arch.sync_warp()
                if ranks > PUBLISH_MAX_RANKS:
                    # Every warp of s has written its share of the chunk: warp 0 of s fences
                    # and publishes it (each home's fence in its own warp, alongside the others').
                    cute.arch.barrier(barrier_id=1 + s, number_of_threads=WARP * per_home)
                    pos = pos + Int64(total)
                    j0 = j0 + cnt
                    if sub == 0 and lane == 0 and alive != 0:
                        cute.arch.fence_acq_rel_sys()  # with the relaxed store: a release
                        cute.arch.store(gmem_ptr(Int64, tail_word, 8), pos, sem="relaxed",
                                        scope="sys")
                else:
                    # This warp's share of the chunk is written: its progress, for `_publish`
                    # (the warps of s do not wait for each other).
                    pos = pos + Int64(total)
                    j0 = j0 + cnt
                    cute.arch.sync_warp()
                    if lane == 0 and alive != 0:
                        cute.arch.store(s_prog.iterator + w, pos, sem="release", scope="cta",
                                        ss="cta")
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.store(s_done.iterator + w, Int32(1), sem="release", scope="cta",
                                ss="cta")
            if sub == 0 and lane == 0:
                cute.arch.store(gmem_ptr(Int64, streams.toint() + Int64(
                    counters((channel, s, TAILS, COMBINE))) * 8, 8), pos)
        if tracing != 0 and lane == 0:
            _trace_max(trace, channel, "send_done", cute.arch.globaltimer())
            _trace_max(trace, channel, "credit_wait_ns", waited)

    @cute.jit
    def _publish(self, lane, channel, peers: cute.Tensor, ranks, my_rank, counters_offset,
                 counters, s_prog: cute.Tensor, s_done: cute.Tensor, s_pub: cute.Tensor):
        """The expert side's stream tails at each home rank, a lane a home s: while the sender
        warps of s work, the least of their progress words (a chunk every one of them has
        written) goes to s's tail, each time it grows, after one system-scope fence (the warps'
        release stores and this lane's acquire loads order their ring stores before it). Ends
        once every warp of s is done: they always finish, their own waits being bounded (one
        that gave up stops its progress, and so the tail, where it was). Only on
        PUBLISH_MAX_RANKS ranks or fewer."""
        per_home = SEND_WARPS // ranks
        if lane < ranks and per_home > 0 and ranks <= PUBLISH_MAX_RANKS:
            s = lane
            tail_word = _home_tail(peers, s, counters_offset, counters, channel, my_rank)
            published = s_pub[s]
            finished = Int32(0)
            while finished == 0:
                done = Int32(1)
                low = Int64(-1)
                for sub in cutlass.range(per_home):
                    w = s + sub * ranks
                    # Done before progress: a done warp's progress is final.
                    if cute.arch.load(s_done.iterator + w, Int32, sem="acquire", scope="cta",
                                      ss="cta") == 0:
                        done = Int32(0)
                    p = cute.arch.load(s_prog.iterator + w, Int64, sem="acquire", scope="cta",
                                       ss="cta")
                    if sub == 0 or p < low:
                        low = p
                if low > published:
                    cute.arch.fence_acq_rel_sys()  # with the relaxed store: a release
                    cute.arch.store(gmem_ptr(Int64, tail_word, 8), low, sem="relaxed",
                                    scope="sys")
                    published = low
                if done != 0:
                    finished = Int32(1)
                else:
                    nanosleep(PUBLISH_POLL_NS)

    @cute.jit
    def _rows_here(self, comb_rows: cute.Pointer, s, j, topk, max_tokens):
        """How many of message j of source s's k landed in a row here."""
        rows = cute.make_tensor(comb_rows, cute.make_layout((Int32(s) + 1) * max_tokens * topk))
        count = Int32(0)
        for k in cutlass.range(topk):
            if rows[(s * max_tokens + j) * topk + k] >= 0:
                count = count + 1
        return count

    @cute.jit
    def _row_sum(self, lane, n, s_a: cute.Tensor, at, s_wt: cute.Tensor, wat,
                 weigh: cutlass.Constexpr, dst_addr, steps, vectors, stages):
        """The bf16 row at `dst_addr` = the fp32 sum, in list order, of the n rows at addresses
        s_a[at ..] (each times its weight s_wt[wat ..] if `weigh`); zeros if n is 0.

        A step of the rows (WARP * vectors 16-byte vectors) at a time: the loads go through
        this warp's shared memory `stages` by cp.async, one (step, row) unit per stage, stages
        - 1 units in flight ahead of the sums; a lane reads back only what it copied itself.
        Every index is a counter advanced by one and a lane's part of a unit a fixed layout (its
        vectors lane + WARP * v), so a unit costs its copies, conversions and adds and little
        else. The first row of a step starts the sum and the others add to it in a loop of
        their own (a branch between the two would be made into predicated copies of both)."""
        step_vectors = WARP * self.vectors
        mine = cute.make_layout((self.vectors, ROW_VECTOR), stride=(WARP * ROW_VECTOR, 1))
        packed = cute.make_layout((self.vectors, ROW_VECTOR), stride=(ROW_VECTOR, 1))
        store_one = row_tiled_copy(1, BFloat16, ROW_VECTOR).get_slice(0)
        acc = cute.make_rmem_tensor(packed, Float32)
        res = cute.make_rmem_tensor(packed, BFloat16)
        dst_lane = dst_addr + Int64(lane * 16)
        if n == 0:
            acc.fill(0.0)
            res.store(acc.load().to(BFloat16))
            for step in cutlass.range(steps):
                self._store_step(res, dst_lane, step, lane, vectors, step_vectors, mine,
                                 store_one)
        elif vectors % step_vectors == 0:
            # Rows of whole steps (H = 7168 and 4096 among them): copies with no row-end
            # predicate, nor the no-ops the compiler spaces predicated copies with.
            self._sum_steps(lane, n, s_a, at, s_wt, wat, weigh, dst_lane, steps, vectors,
                            stages, acc, res, True)
        else:
            self._sum_steps(lane, n, s_a, at, s_wt, wat, weigh, dst_lane, steps, vectors,
                            stages, acc, res, False)
        cute.arch.sync_warp()  # the caller's next list reuses the addresses

    @cute.jit
    def _sum_steps(self, lane, n, s_a: cute.Tensor, at, s_wt: cute.Tensor, wat,
                   weigh: cutlass.Constexpr, dst_lane, steps, vectors, stages, acc: cute.Tensor,
                   res: cute.Tensor, whole: cutlass.Constexpr):
        """`_row_sum`'s n >= 1 rows, step after step; `whole`: every step lies inside the row."""
        (step_vectors, step_bytes, mine, stage_elems, lane_stage, load_one, lane_offset, l_k,
         l_step, l_slot) = self._start_loader(lane, n, s_a, at, steps, vectors, stages, whole)
        store_one = row_tiled_copy(1, BFloat16, ROW_VECTOR).get_slice(0)
        c_slot = Int32(0)
        for step in cutlass.range(steps):
            l_k, l_step, l_slot, c_slot, x = self._next_unit(
                l_k, l_step, l_slot, c_slot, n, steps, step_vectors, step_bytes, vectors,
                lane_offset, s_a, at, lane, lane_stage, stage_elems, mine, load_one, whole)
            self._accumulate(acc, x, s_wt, wat, weigh, True)
            for k in cutlass.range(1, n):
                l_k, l_step, l_slot, c_slot, x = self._next_unit(
                    l_k, l_step, l_slot, c_slot, n, steps, step_vectors, step_bytes,
                    vectors, lane_offset, s_a, at, lane, lane_stage, stage_elems, mine,
                    load_one, whole)
                self._accumulate(acc, x, s_wt, wat + k, weigh, False)
            res.store(acc.load().to(BFloat16))
            self._store_step(res, dst_lane, step, lane, vectors, step_vectors, mine,
                             store_one, whole)
        cute.arch.cp_async_wait_group(0)  # the loader's empty groups past the last unit

    def _start_loader(self, lane, n, s_a: cute.Tensor, at, steps, vectors, stages,
                      whole: cutlass.Constexpr):
        """The cp.async loader of a warp's row steps (`_sum_steps`, `_copy_steps`), started:
        stages - 1 (step, row) units of the n rows at s_a[at ..] in flight. Returns its fixed
        terms (a step's vectors and bytes, this lane's part of a unit, a stage's elements, this
        lane's stage, the copy atom, this lane's byte offset) and its next unit's counters (row
        l_k of step l_step, into stage l_slot). Plain Python: traced where it is called."""
        step_vectors = WARP * self.vectors
        step_bytes = step_vectors * 16
        mine = cute.make_layout((self.vectors, ROW_VECTOR), stride=(WARP * ROW_VECTOR, 1))
        stage_elems = step_vectors * ROW_VECTOR
        lane_stage = stages + lane * ROW_VECTOR
        load_one = row_tiled_copy(1, BFloat16, ROW_VECTOR, cpasync.CopyG2SOp(
            cache_mode=cpasync.LoadCacheMode.GLOBAL)).get_slice(0)
        lane_offset = Int64(lane * 16)
        l_k = Int32(0)
        l_step = Int32(0)
        l_slot = Int32(0)
        for _ in range(self.stages - 1):  # (unrolled as it is traced)
            l_k, l_step, l_slot = self._load_next(
                l_k, l_step, l_slot, n, steps, step_vectors, step_bytes, vectors,
                lane_offset, s_a, at, lane, lane_stage, stage_elems, mine, load_one, whole)
        return (step_vectors, step_bytes, mine, stage_elems, lane_stage, load_one, lane_offset,
                l_k, l_step, l_slot)

    @cute.jit
    def _store_step(self, res: cute.Tensor, dst_lane, step, lane, vectors, step_vectors, mine,
                    store_one, whole: cutlass.Constexpr = False):
        """Store this lane's part `res` of step `step` of the row whose lane address is
        `dst_lane`, vectors past the row's end left out."""
        t_dst = store_one.partition_D(cute.make_tensor(
            gmem_ptr(BFloat16, dst_lane + Int64(step * step_vectors * 16), 16), mine))
        if cutlass.const_expr(whole):
            cute.copy(store_one, store_one.partition_S(res), t_dst)
        else:
            cute.copy(store_one, store_one.partition_S(res), t_dst,
                      pred=self._lane_predicate(t_dst, lane, vectors - step * step_vectors))

    @cute.jit
    def _accumulate(self, acc: cute.Tensor, x: cute.Tensor, s_wt: cute.Tensor, wat,
                    weigh: cutlass.Constexpr, first: cutlass.Constexpr):
        """acc (fp32, [vectors, ROW_VECTOR]) = (first: 0, else acc) + x (bf16 pairs), each
        value times s_wt[wat] if `weigh`: one integer operation widens a value (`low_bf16`,
        `high_bf16`), then one multiply-add."""
        w = Float32(1.0)
        if cutlass.const_expr(weigh):
            w = s_wt[wat]
        for v in cutlass.range_constexpr(self.vectors):
            for j in cutlass.range_constexpr(PAIRS):
                lo = low_bf16(x[v, j])
                hi = high_bf16(x[v, j])
                if cutlass.const_expr(weigh):
                    lo = lo * w
                    hi = hi * w
                if cutlass.const_expr(first):
                    acc[v, 2 * j] = lo
                    acc[v, 2 * j + 1] = hi
                else:
                    acc[v, 2 * j] = acc[v, 2 * j] + lo
                    acc[v, 2 * j + 1] = acc[v, 2 * j + 1] + hi

    @cute.jit
    def _next_unit(self, l_k, l_step, l_slot, c_slot, n, steps, step_vectors, step_bytes,
                   vectors, lane_offset, s_a: cute.Tensor, at, lane, lane_stage, stage_elems,
                   mine, load_one, whole: cutlass.Constexpr):
        """Start the loader's next unit, wait for the oldest one (stage c_slot) and return its
        bf16 pairs (this lane's part) with the advanced counters."""
        l_k, l_step, l_slot = self._load_next(
            l_k, l_step, l_slot, n, steps, step_vectors, step_bytes, vectors, lane_offset, s_a,
            at, lane, lane_stage, stage_elems, mine, load_one, whole)
        cute.arch.cp_async_wait_group(self.stages - 1)
        # The unit's bf16 pairs as words: vector v's word j holds elements 2j (low half) and
        # 2j + 1 (high half).
        x = cute.make_rmem_tensor(cute.make_layout((self.vectors, PAIRS), stride=(PAIRS, 1)),
                                  Int32)
        cute.autovec_copy(cute.make_tensor(cute.recast_ptr(
            (lane_stage + c_slot * stage_elems).align(16), dtype=Int32),
            cute.make_layout((self.vectors, PAIRS), stride=(WARP * PAIRS, 1))), x)
        c_slot = (c_slot + 1) & (self.stages - 1)
        return l_k, l_step, l_slot, c_slot, x

    @cute.jit
    def _load_next(self, l_k, l_step, l_slot, n, steps, step_vectors, step_bytes, vectors,
                   lane_offset, s_a: cute.Tensor, at, lane, lane_stage, stage_elems, mine,
                   load_one, whole: cutlass.Constexpr):
        """Start the loader's unit (row l_k of step l_step, into stage l_slot) if there is one,
        commit its group (empty past the last unit), and return the next unit's counters."""
        if l_step < steps:
            src = cute.make_tensor(gmem_ptr(BFloat16, s_a[at + l_k] + lane_offset
                                            + Int64(l_step * step_bytes), 16), mine)
            t_src = load_one.partition_S(src)
            t_dst = load_one.partition_D(
                cute.make_tensor((lane_stage + l_slot * stage_elems).align(16), mine))
            if cutlass.const_expr(whole):
                cute.copy(load_one, t_src, t_dst)
            else:
                cute.copy(load_one, t_src, t_dst,
                          pred=self._lane_predicate(t_src, lane, vectors - l_step * step_vectors))
        cute.arch.cp_async_commit_group()
        l_k = l_k + 1
        if l_k == n:
            l_k = Int32(0)
            l_step = l_step + 1
        l_slot = (l_slot + 1) & (self.stages - 1)
        return l_k, l_step, l_slot

    @cute.jit
    def _lane_predicate(self, t_part: cute.Tensor, lane, remaining):
        """Per access of a lane's part of a row step (vector lane + WARP * v): inside the row's
        `remaining` vectors."""
        pred = cute.make_rmem_tensor(cute.make_layout(
            (1, cute.size(t_part, mode=[1]), cute.size(t_part, mode=[2]))), cutlass.Boolean)
        for v in cutlass.range_constexpr(cute.size(t_part, mode=[1])):
            pred[0, v, 0] = lane + WARP * v < remaining
        return pred

    @cute.jit
    def _send_rows(self, lane, w, peer, ring_offset, ring, item, ring_slots, channel, my_rank,
                   y: cute.Pointer, live, s_rows: cute.Tensor, at, s_sa: cute.Tensor,
                   s_da: cute.Tensor, steps, vectors, stages, row_capacity):
        """Unreduced: each of the message's `live` rows here (s_rows[at ..], in k order), to
        items item, item + 1...; a row past the output's capacity as zeros (`_copy_rows`)."""
        zero = Int32(0)
        if lane < live:
            row = s_rows[at + lane]
            zero = Int32(row >= row_capacity)
            s_sa[w * MAX_TOPK + lane] = y.toint() + Int64(
                cutlass.min(row, row_capacity - 1)) * Int64(vectors * 16)
            s_da[w * MAX_TOPK + lane] = self._ring_row(peer, ring_offset, ring, ring_slots,
                                                       channel, my_rank, item + Int64(lane))
        zeros = cute.arch.vote_ballot_sync(zero != 0)
        cute.arch.sync_warp()
        self._copy_rows(lane, live, s_sa, w * MAX_TOPK, s_da, w * MAX_TOPK, zeros, steps,
                        vectors, stages)

    @cute.jit
    def _copy_rows(self, lane, n, s_a: cute.Tensor, at, s_d: cute.Tensor, dat, zeros, steps,
                   vectors, stages):
        """The n bf16 rows at addresses s_a[at ..] to the addresses s_d[dat ..], as they are
        (row k as zeros where bit k of `zeros` is set: its source is read, not used). The rows
        stream through this warp's shared-memory `stages` by cp.async as `_row_sum`'s do,
        stages - 1 (step, row) units in flight, so a warp moving rows keeps as many loads
        outstanding as one summing them."""
        if n > 0:
            if vectors % (WARP * self.vectors) == 0:
                self._copy_steps(lane, n, s_a, at, s_d, dat, zeros, steps, vectors, stages, True)
            else:
                self._copy_steps(lane, n, s_a, at, s_d, dat, zeros, steps, vectors, stages,
                                 False)
        cute.arch.sync_warp()  # the caller's next list reuses the addresses

    @cute.jit
    def _copy_steps(self, lane, n, s_a: cute.Tensor, at, s_d: cute.Tensor, dat, zeros, steps,
                    vectors, stages, whole: cutlass.Constexpr):
        """`_copy_rows`' n >= 1 rows, step after step; `whole`: every step lies inside the row."""
        (step_vectors, step_bytes, mine, stage_elems, lane_stage, load_one, lane_offset, l_k,
         l_step, l_slot) = self._start_loader(lane, n, s_a, at, steps, vectors, stages, whole)
        c_slot = Int32(0)
        for step in cutlass.range(steps):
            remaining = vectors - step * step_vectors
            for k in cutlass.range(n):
                l_k, l_step, l_slot, c_slot, x = self._next_unit(
                    l_k, l_step, l_slot, c_slot, n, steps, step_vectors, step_bytes,
                    vectors, lane_offset, s_a, at, lane, lane_stage, stage_elems, mine,
                    load_one, whole)
                if (zeros >> k) & 1 != 0:
                    x.fill(0)
                dst = s_d[dat + k] + lane_offset + Int64(step * step_bytes)
                for v in cutlass.range_constexpr(self.vectors):
                    if cutlass.const_expr(whole):
                        cute.autovec_copy(x[v, None], cute.make_tensor(
                            gmem_ptr(Int32, dst + Int64(v * WARP * 16), 16),
                            cute.make_layout(PAIRS)))
                    else:
                        if lane + WARP * v < remaining:
                            cute.autovec_copy(x[v, None], cute.make_tensor(
                                gmem_ptr(Int32, dst + Int64(v * WARP * 16), 16),
                                cute.make_layout(PAIRS)))
        cute.arch.cp_async_wait_group(0)  # the loader's empty groups past the last unit

    # Home side -----------------------------------------------------------------------------

    @cute.jit
    def _receive(self, rw, lane, channel, peers: cute.Tensor, here, y: cute.Pointer,
                 topk_ids: cute.Pointer, id_words, out: cute.Pointer,
                 home_weights: cute.Pointer, streams: cute.Pointer, error: cute.Pointer,
                 num_tokens, topk, local_experts,
                 ranks, my_rank, weighted,
                 skip_a2a, shared, shared_begin, shared_end, channels, active, ring_slots,
                 chunk_tokens, ring_offset, counters_offset, counters, ring, timeout_ns, steps,
                 vectors, s_first: cute.Tensor,
                 s_items: cute.Tensor, s_mask: cute.Tensor, s_flag: cute.Tensor,
                 s_pos: cute.Tensor, s_ids: cute.Tensor, s_addr: cute.Tensor,
                 s_hw: cute.Tensor, s_da: cute.Tensor, stages, trace: cute.Pointer, tracing):
        threads = WARP * RECV_WARPS
        waited = Int64(0)
        routing = Int64(0)
        experts = local_experts * ranks
        t0, t1 = channel_tokens(channel, num_tokens, active)  # as dispatch split them
        # Chunks of chunk_tokens tokens; unreduced or weighted at home, as many of them as
        # bring at most half a ring from every rank (`_fits_half`), or one token where K rows
        # fill more than half a ring.
        group = chunk_tokens
        fitted = Int32(0)
        if weighted != AT_EXPERTS:
            fitted = self._fits_half(ring_slots, topk)
            if fitted == 0:
                group = Int32(1)
        if rw == 0 and lane < ranks:
            s_pos[lane] = cute.arch.load(gmem_ptr(Int64, streams.toint() + Int64(
                counters((channel, lane, HEADS, COMBINE))) * 8, 8), Int64)  # consumed
            s_pos[MAX_RANKS + lane] = s_pos[lane]  # tail seen
        if rw == 0 and lane == 0:
            s_flag[0] = Int32(1)  # alive
        cute.arch.barrier(barrier_id=9, number_of_threads=threads)
        # The routing warp's ids of a chunk, loaded a chunk ahead: they land while the chunk
        # before is routed, waited for and summed.
        n_ids = cute.make_rmem_tensor(cute.make_layout(MAX_CHUNK * MAX_TOPK // WARP), Int32)
        if rw == 0 and t0 < t1:
            self._load_ids(lane, topk_ids, id_words, t0, cutlass.min(group, t1 - t0) * topk,
                           topk, n_ids)
            routing = self._route_chunk(lane, t0, t1, group, fitted, ring_slots, 0, topk,
                                        topk_ids, id_words, experts, local_experts, my_rank,
                                        skip_a2a, shared, shared_begin, shared_end, ranks,
                                        weighted, n_ids, s_first, s_items, s_mask, s_flag,
                                        s_ids, routing, tracing)
        cute.arch.barrier(barrier_id=9, number_of_threads=threads)
        chunk = Int32(0)
        base = t0
        while base < t1:
            buf = chunk % 2
            g = s_flag[LENGTH_AT + buf]  # as warp 0 routed it
            # Where each token's items start in each rank's stream (warp 0 routed the chunk
            # while the receivers summed the one before), then wait for them to arrive.
            if rw == 0:
                if lane < ranks:
                    d = lane
                    run = s_pos[d]
                    for i in cutlass.range(g):
                        s_first[i * MAX_RANKS + d] = Int32(run - s_pos[d])
                        run = run + Int64(s_items[(buf * MAX_CHUNK + i) * MAX_RANKS + d])
                    need = run
                    ok = Int32(1)
                    if need > s_pos[MAX_RANKS + d] and s_flag[0] != 0:
                        start = Int64(0)
                        if tracing != 0:
                            start = cute.arch.globaltimer()
                        tail, ok = _wait_at_least(
                            here + counters_offset
                            + Int64(counters((channel, d, TAILS, COMBINE))) * 8,
                            need, timeout_ns, error, d, Int32(PHASE_COMBINE))
                        s_pos[MAX_RANKS + d] = tail
                        if tracing != 0:
                            waited = waited + cute.arch.globaltimer() - start
                    if ok == 0:
                        s_flag[0] = Int32(0)
                    s_flag[1 + d] = Int32(need - s_pos[d])  # items consumed from d
                if lane == 0:
                    s_flag[CLAIM_AT] = Int32(0)
            cute.arch.barrier(barrier_id=9, number_of_threads=threads)
            if rw == 0 and base + g < t1:
                routing = self._route_chunk(lane, base + g, t1, group, fitted, ring_slots,
                                            1 - buf, topk, topk_ids, id_words, experts,
                                            local_experts, my_rank, skip_a2a, shared,
                                            shared_begin, shared_end, ranks, weighted, n_ids,
                                            s_first, s_items, s_mask, s_flag, s_ids, routing,
                                            tracing)
            # The chunk's tokens, a warp each as they claim them (warp 0 joins once it has
            # routed the next chunk); their ids, as routed, in buffer `buf` of s_ids.
            chunk_ids = self._chunk_ids(s_ids, buf)
            i = self._claim(lane, s_flag)
            while i < g:
                t = base + i
                if s_flag[0] == 0:
                    t = t1  # a wait failed: nothing to read
                if t < t1 and weighted == AT_EXPERTS:
                    self._sum_token(lane, t, i, here, ring_offset, ring, ring_slots, channel,
                                    ranks, y, out, shared, shared_begin, shared_end,
                                    steps, vectors, s_first,
                                    cute.make_tensor(s_mask.iterator + buf * MAX_CHUNK,
                                                     cute.make_layout(MAX_CHUNK)),
                                    s_pos, s_addr, rw * (MAX_TOPK + 1), stages)
                if t < t1 and weighted == AT_HOME:
                    self._weigh_token(lane, t, i, here, ring_offset, ring, ring_slots, channel,
                                      topk, experts, local_experts, skip_a2a, my_rank, out,
                                      home_weights, steps, vectors, chunk_ids, s_first, s_pos,
                                      s_addr, s_hw, rw * (MAX_TOPK + 1), rw * MAX_TOPK, stages)
                if t < t1 and weighted == UNREDUCED:
                    self._copy_token(lane, t, i, here, ring_offset, ring, ring_slots, channel,
                                     topk, experts, local_experts, skip_a2a, my_rank, out,
                                     steps, vectors, chunk_ids, s_first, s_pos, s_addr,
                                     rw * (MAX_TOPK + 1), s_da, (SEND_WARPS + rw) * MAX_TOPK,
                                     stages)
                i = self._claim(lane, s_flag)
            cute.arch.barrier(barrier_id=9, number_of_threads=threads)
            # Credit back to every rank the chunk read from. Relaxed, as dispatch's: every
            # load from the chunk's slots has returned (its value summed into a stored row).
            if rw == 0 and lane < ranks:
                used = s_flag[1 + lane]
                if used > 0:
                    s_pos[lane] = s_pos[lane] + Int64(used)
                    if s_flag[0] != 0:
                        cute.arch.store(gmem_ptr(Int64, peers[lane] + counters_offset + Int64(
                            counters((channel, my_rank, HEADS, COMBINE))) * 8, 8), s_pos[lane],
                            sem="relaxed", scope="sys")
            cute.arch.barrier(barrier_id=9, number_of_threads=threads)
            base = base + g
            chunk = chunk + 1
        if rw == 0 and lane < ranks:
            cute.arch.store(gmem_ptr(Int64, streams.toint() + Int64(
                counters((channel, lane, HEADS, COMBINE))) * 8, 8), s_pos[lane])
        if tracing != 0:
            if lane < ranks:
                _trace_max(trace, channel, "tail_wait_ns", waited)
            if lane == 0:
                _trace_max(trace, channel, "recv_done", cute.arch.globaltimer())
                _trace_max(trace, channel, "route_ns", routing)

    @cute.jit
    def _route_chunk(self, lane, base, t1, group, fitted, ring_slots, buf, topk,
                     topk_ids: cute.Pointer, id_words, experts, local_experts, my_rank,
                     skip_a2a, shared, shared_begin, shared_end, ranks, weighted,
                     n_ids: cute.Tensor, s_first: cute.Tensor, s_items: cute.Tensor,
                     s_mask: cute.Tensor, s_flag: cute.Tensor, s_ids: cute.Tensor, routing,
                     tracing):
        """Warp 0: the routes of the chunk of tokens from `base` into buffer `buf` of s_ids,
        s_mask and s_items (each token's rank mask and its items per rank), its ids from `n_ids`
        (loaded a chunk ahead), its token count into s_flag[LENGTH_AT + buf], and the next
        chunk's ids into `n_ids`. A chunk is `group` tokens (fewer at the channel's end), or
        where `fitted`, the most of them whose items from every rank fill at most half a ring
        (at least one token): `_send`'s chunks then always go out (`_fits_half`). Returns
        `routing` plus the time it took (tracing on)."""
        routed = Int64(0)
        if tracing != 0:
            routed = cute.arch.globaltimer()
        g = cutlass.min(group, t1 - base)
        words = g * topk
        ids = self._chunk_ids(s_ids, buf)
        for q in cutlass.range_constexpr(MAX_CHUNK * MAX_TOPK // WARP):
            if q * WARP + lane < words:
                ids[q * WARP + lane] = n_ids[q]
        cute.arch.sync_warp()
        if lane < g:
            # A lane a token: its rank mask (`route_ids`; it counts nothing: s_first stands in
            # for its unused counts) and its items per rank: one where the mask has it, or
            # (unreduced, weighted at home) its valid pairs there, none from another rank
            # under skip_a2a (every rank dispatched only to its own experts; `_lane_pair`
            # agrees), counted in one pass over the pairs.
            mask, _ = route_ids(ids, lane, topk, base + lane, topk, experts, local_experts,
                                my_rank, skip_a2a, shared, shared_begin, shared_end, s_first,
                                False)
            s_mask[buf * MAX_CHUNK + lane] = mask
            # (The counts: a byte a rank, MAX_RANKS of them, in one word.)
            counts = Int64(0)
            if weighted != AT_EXPERTS:
                for k in cutlass.range(topk):
                    if valid_expert(ids, lane, k, topk, experts) != 0:
                        d = ids[lane * topk + k] // local_experts
                        if skip_a2a == 0 or d == my_rank:
                            counts = counts + (Int64(1) << Int64(8 * d))
            for d in cutlass.range(ranks):
                items = (mask >> d) & 1
                if weighted != AT_EXPERTS:
                    items = Int32((counts >> Int64(8 * d)) & Int64(255))
                s_items[(buf * MAX_CHUNK + lane) * MAX_RANKS + d] = items
        cute.arch.sync_warp()
        if fitted != 0:
            # The longest prefix of the tokens whose items from each rank, added, stay within
            # half a ring (the sums only grow along the lanes, so the lanes within are a prefix).
            within = Int32(lane < g)
            for d in cutlass.range(ranks):
                incl = Int32(0)
                if lane < g:
                    incl = s_items[(buf * MAX_CHUNK + lane) * MAX_RANKS + d]
                for shift in cutlass.range_constexpr(3):  # g <= MAX_CHUNK = 8 lanes
                    up = cute.arch.shuffle_sync_up(incl, 1 << shift)
                    if lane >= (1 << shift):
                        incl = incl + up
                if incl > ring_slots // 2:
                    within = Int32(0)
            g = cutlass.max(Int32(1), cute.arch.popc(cute.arch.vote_ballot_sync(within != 0)))
        if lane == 0:
            s_flag[LENGTH_AT + buf] = g
        if base + g < t1:
            self._load_ids(lane, topk_ids, id_words, base + g,
                           cutlass.min(group, t1 - base - g) * topk, topk, n_ids)
        cute.arch.sync_warp()
        if tracing != 0:
            routing = routing + cute.arch.globaltimer() - routed
        return routing

    @cute.jit
    def _chunk_ids(self, s_ids: cute.Tensor, buf):
        """Buffer `buf` of s_ids: a chunk's ids as warp 0 routed them, token i's K at row i."""
        return cute.make_tensor(s_ids.iterator + buf * (MAX_CHUNK * MAX_TOPK),
                                cute.make_layout(MAX_CHUNK * MAX_TOPK))

    @cute.jit
    def _claim(self, lane, s_flag: cute.Tensor):
        """The next token of the chunk for this warp (lane 0 takes it from the chunk's shared
        counter, s_flag[CLAIM_AT]; every lane returns it)."""
        i = Int32(0)
        if lane == 0:
            i = cute.arch.atomic_add(s_flag.iterator + CLAIM_AT, Int32(1))
        return cute.arch.shuffle_sync(i, 0)

    @cute.jit
    def _load_ids(self, lane, topk_ids: cute.Pointer, id_words, base, words, topk,
                  regs: cute.Tensor):
        """The `words` ids of the chunk from token `base` into `regs` (`load_id`: int32 or
        int64), lane + q * WARP in regs[q], every load in flight together (indices past the
        chunk read its last id again)."""
        for q in cutlass.range_constexpr(MAX_CHUNK * MAX_TOPK // WARP):
            regs[q] = load_id(topk_ids.toint(), Int64(base) * Int64(topk) + Int64(
                cutlass.min(q * WARP + lane, words - 1)), id_words)

    @cute.jit
    def _sum_token(self, lane, t, i, here, ring_offset, ring, ring_slots, channel, ranks,
                   y: cute.Pointer, out: cute.Pointer, shared, shared_begin, shared_end,
                   steps, vectors, s_first: cute.Tensor, s_mask: cute.Tensor,
                   s_pos: cute.Tensor, s_addr: cute.Tensor, at, stages):
        """out[t] = bf16(sum, in fp32, of the shared expert's row and the row from every rank t
        went to, in that order): the rows that exist listed first (their addresses at
        s_addr[at ..]), then summed (`_row_sum`)."""
        mask = s_mask[i]
        here_bit = Int32(0)
        addr = Int64(0)
        if lane == 0:
            here_bit = Int32(shared != 0) & Int32(t >= shared_begin) & Int32(t < shared_end)
            addr = y.toint() + Int64(t - shared_begin) * Int64(vectors * 16)
        if lane > 0 and lane <= ranks:
            d = lane - 1
            here_bit = (mask >> d) & 1
            item = s_pos[d] + Int64(s_first[i * MAX_RANKS + d])
            addr = self._ring_row(here, ring_offset, ring, ring_slots, channel, d, item)
        rows_bits = cute.arch.vote_ballot_sync(here_bit != 0)
        live = cute.arch.popc(rows_bits)
        if here_bit != 0:
            s_addr[at + cute.arch.popc(rows_bits & ((Int32(1) << lane) - Int32(1)))] = addr
        cute.arch.sync_warp()
        self._row_sum(lane, live, s_addr, at, s_addr, 0, False,
                      out.toint() + Int64(t) * Int64(vectors * 16), steps, vectors, stages)

    @cute.jit
    def _ring_row(self, base, ring_offset, ring, ring_slots, channel, rank, item):
        """The address of stream item `item` from `rank` in the ring of `channel` of the buffer
        at `base` (its slot: the item modulo the ring's slots)."""
        return base + ring_offset + Int64(ring((0, Int32(item % Int64(ring_slots)), channel,
                                                rank)))

    @cute.jit
    def _copy_token(self, lane, t, i, here, ring_offset, ring, ring_slots, channel, topk,
                    experts, local_experts, skip_a2a, my_rank, out: cute.Pointer, steps,
                    vectors, ids: cute.Tensor, s_first: cute.Tensor, s_pos: cute.Tensor,
                    s_addr: cute.Tensor, at, s_da: cute.Tensor, dat, stages):
        """Unreduced: out[t, k] = the row of (t, k) from its expert's rank, zeros where none
        (t's ids: row i of the chunk's `ids`). Lane k < topk lists pair k's ring slot (a pair
        that went nowhere: slot 0 of this rank's own stream, read and not used) and its
        output row; then `_copy_rows` moves them."""
        live, d, item = self._lane_pair(lane, ids, i, topk, experts, local_experts, skip_a2a,
                                        my_rank, s_first, s_pos)
        if live == 0:
            d = my_rank
            item = Int64(0)
        if lane < topk:
            s_addr[at + lane] = self._ring_row(here, ring_offset, ring, ring_slots, channel, d,
                                               item)
            s_da[dat + lane] = out.toint() + (Int64(t) * Int64(topk) + Int64(lane)) * Int64(
                vectors * 16)
        zeros = cute.arch.vote_ballot_sync(live == 0)
        cute.arch.sync_warp()
        self._copy_rows(lane, topk, s_addr, at, s_da, dat, zeros, steps, vectors, stages)

    @cute.jit
    def _lane_pair(self, lane, ids: cute.Tensor, i, topk, experts, local_experts, skip_a2a,
                   my_rank, s_first: cute.Tensor, s_pos: cute.Tensor):
        """Every lane of the warp: (1, rank, stream item) of pair k = lane of the chunk's token
        i (its ids: row i of the chunk's `ids`) as its rank returns it (a token's pairs to one
        rank come in k order), or (0, 0, 0) for a pair that went nowhere and for lanes past K.
        Each lane reads its own id; the checks against earlier pairs (`kernels.routing.
        valid_expert`'s rule) take them from the other lanes."""
        e = Int32(-1)
        if lane < topk:
            e = ids[i * topk + lane]
        if e < 0 or e >= experts:
            e = Int32(-1)
        twice = Int32(0)
        for j in cutlass.range_constexpr(MAX_TOPK):
            other = cute.arch.shuffle_sync(e, j)
            if j < lane and other == e:
                twice = Int32(1)
        if twice != 0:
            e = Int32(-1)
        live = Int32(e >= 0)
        d = Int32(0)
        if live != 0:
            d = e // local_experts
        low = d * local_experts
        idx = Int32(0)
        for j in cutlass.range_constexpr(MAX_TOPK):
            other = cute.arch.shuffle_sync(e, j)  # -1 where pair j is not valid
            if j < lane and other >= low and other < low + local_experts:
                idx = idx + 1
        if skip_a2a != 0 and d != my_rank:
            live = Int32(0)
        item = Int64(0)
        if live != 0:
            item = s_pos[d] + Int64(s_first[i * MAX_RANKS + d] + idx)
        return live, d, item

    @cute.jit
    def _weigh_token(self, lane, t, i, here, ring_offset, ring, ring_slots, channel, topk,
                     experts, local_experts, skip_a2a, my_rank, out: cute.Pointer,
                     home_weights: cute.Pointer, steps, vectors, ids: cute.Tensor,
                     s_first: cute.Tensor, s_pos: cute.Tensor, s_addr: cute.Tensor,
                     s_hw: cute.Tensor, at, wat, stages):
        """Weighted at home: out[t] = bf16(sum over t's live pairs k, in k order and fp32, of
        home_weights[t, k] * the row of (t, k)). Lane k < topk finds pair k's row and weight;
        the live ones are listed first (s_addr, s_hw), then summed (`_row_sum`). t's ids: row i
        of the chunk's `ids`."""
        addr = Int64(0)
        wk = Float32(0.0)
        live, d, item = self._lane_pair(lane, ids, i, topk, experts, local_experts, skip_a2a,
                                        my_rank, s_first, s_pos)
        if live != 0:
            addr = self._ring_row(here, ring_offset, ring, ring_slots, channel, d, item)
            wk = load_f32(home_weights.toint() + (Int64(t) * Int64(topk) + Int64(lane)) * 4)
        bits = cute.arch.vote_ballot_sync(live != 0)
        n = cute.arch.popc(bits)
        if live != 0:
            p = cute.arch.popc(bits & ((Int32(1) << lane) - Int32(1)))
            s_addr[at + p] = addr
            s_hw[wat + p] = wk
        cute.arch.sync_warp()
        self._row_sum(lane, n, s_addr, at, s_hw, wat, True,
                      out.toint() + Int64(t) * Int64(vectors * 16), steps, vectors, stages)


def combine_kernels() -> list:
    return [EpCombine(vectors) for vectors in COMBINE_VECTORS]
