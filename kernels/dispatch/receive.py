"""Phase 3 of `ep_dispatch`, receive: the receiver warps derive the row layout from the counts,
take each source's batches as its tail advances, read their headers, place every message in the
rows of its local experts, pull the payload over NVLink and store it to each row (BF16 by bulk
copies through shared-memory pieces, FP8 and NVFP4 through registers with their scales into
`scale_rows`), record combine's routes and return credit."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from kernels.bulk_copy import bulk_load, bulk_store
from kernels.copy import row_predicate
from kernels.dispatch.common import (BATCH, DONE_AT, FP8_BLOCK, HEADER_REGS, IDS, IDS_AT, LAG,
                                     MAP_AT, MAX_RANKS, MAX_SEGMENTS, MAX_STAGE_BATCHES, MAX_TOPK,
                                     NVFP4_BLOCK, PAD_BARRIER, PHASE_DISPATCH, PIECE, PIECES,
                                     PLAN_BATCH_AT, PLAN_CNT_AT, PLAN_SLOTS, PLAN_SLOTS_A_WARP,
                                     PLAN_STAGE_AT, PLAN_TOK_AT, PLAN_WORDS, RECV_TIME_WORDS,
                                     ROWS, ROWS_AT, SCALES_BULK, SCALES_LANES, SCALES_MESSAGES,
                                     SCALES_SLABS, SCALES_VECTORS,
                                     SCALE_REGS, SCRATCH, SEGS_AT, SEND_WARPS, SPLIT_MIN_WARPS,
                                     SROWS_AT, STAGE_AT, TOKS_AT, WARP, WEIGHTS, _lap, _stamp,
                                     _stamp_max, _wait_at_least)
from kernels.memory import error_field, gmem_ptr, store_f32, store_i32
from kernels.scan import warp_exclusive_scan
from layouts.buffers import (DIRECT_SCALE_ROWS, ERROR_CAPACITY, ERROR_CHANNELS, ERROR_COUNTS,
                             scale_rows_layout)
from layouts.channels import (COUNT_BLOCK, COUNT_MESSAGES, COUNT_SEGMENTS, COUNT_TOKENS,
                              DIRECT_BIT, DISPATCH, FLAG_PREFIXED, FLAG_ROUND, HEADS,
                              PREFIX_BLOCKS, RECV_TIMES, SEND_TIMES, TAILS, count_block,
                              count_blocks, batch_header_layout, channel_messages_layout,
                              header_token_word, headers_layout, staging_layout)
from layouts.config import SOURCE_ROWS
from layouts.scales import ATOM_ROWS


class ReceivePhase:
    """The receiver warps."""

    @cute.jit
    def _receive(self, rt, channel, peers: cute.Tensor, here, streams: cute.Pointer,
                 error: cute.Pointer, tokens: cute.Pointer, scales: cute.Pointer,
                 scale_rows: cute.Pointer,
                 scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
                 expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
                 comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                 comb_counts: cute.Pointer, chan_msgs: cute.Pointer, recv_ids: cute.Pointer,
                 recv_weights: cute.Pointer, max_tokens, topk,
                 local_experts, ranks, my_rank, shared, skip_a2a, shared_begin, shared_end,
                 header_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                 row_capacity, segment_rows, channels, active, headers_offset, staging_offset,
                 counts_offset, flags_offset, counters_offset, counters, counts_at, flags_at,
                 parity, epoch, timeout_ns, s_next: cute.Tensor, s_totals: cute.Tensor,
                 s_off: cute.Tensor, s_tot: cute.Tensor, s_raw: cute.Tensor, s_first: cute.Tensor,
                 s_src: cute.Tensor, s_rows: cute.Tensor, s_wts: cute.Tensor,
                 s_ring: cute.Tensor, s_full: cute.Pointer, s_piece: cute.Tensor,
                 s_time: cute.Tensor, warp_copy: cute.TiledCopy, trace: cute.Pointer, tracing,
                 pad_by_senders, prefixed, input_offset, s_plan: cute.Pointer,
                 s_planw: cute.Tensor):
        """The receiver warps (thread rt of recv_warps * 32). `pad_by_senders`: this launch's
        sender warps zero the FP8 alignment rows (`_pad_after_send`), not the receivers.
        `prefixed`: the kind of counts the sources sent (PREFIX_NONE, PREFIX_ALL,
        PREFIX_BLOCKS; `layouts.channels.counts_layout`)."""
        threads = self.recv_threads
        rwarp = rt // WARP
        lane = rt % WARP
        segments = local_experts + shared
        # 3a. Every (channel, source)'s counts of this round (prefixed counts: this channel's of
        # every source; block-prefixed: those of this channel and of the first channel of every
        # other block). A source that split its tokens over another number of channels (another
        # num_input_tokens), or sent counts of another kind, is reported, not waited for past
        # its channels.
        blocks = count_blocks(active)
        own_block = count_block(channel)
        flags = ranks * active
        if prefixed == PREFIX_BLOCKS:
            flags = ranks * blocks
        elif prefixed != 0:
            flags = ranks
        for i in cutlass.range(rt, flags, threads):
            s = i // active
            c = i - s * active
            if prefixed == PREFIX_BLOCKS:
                s = i // blocks
                c = (i - s * blocks) * COUNT_BLOCK
                if c == own_block:
                    c = channel
            elif prefixed != 0:
                s = i
                c = channel
            flag, ok = _wait_at_least(here + flags_offset + Int64(flags_at((c, s, parity))) * 8,
                                      epoch * FLAG_ROUND, timeout_ns, error, s,
                                      Int32(PHASE_DISPATCH))
            if ok != 0 and flag % FLAG_ROUND != Int64(active) + Int64(prefixed * FLAG_PREFIXED):
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_CHANNELS),
                                    sem="relaxed", scope="gpu")
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rt == 0:
            _stamp(trace, tracing, channel, "counts_arrived", cute.arch.globaltimer())
        failed = cute.arch.load(error, Int32, sem="relaxed", scope="gpu") != 0 or \
            (cute.arch.load(error_field(error, "bad_counts"), Int32, sem="relaxed",
                            scope="gpu") & ERROR_CHANNELS) != 0
        # Per source: messages of this channel, messages of the channels before it, in total;
        # the tokens of its channel (so its batches).
        if rt < ranks:
            # Loaded whether or not the layer failed (they are this rank's own words), so the
            # loads need not wait for the error words; a failed layer discards them unreported.
            n = self._count(here, counts_offset, counts_at, COUNT_MESSAGES, channel, rt, parity)
            ntok = self._count(here, counts_offset, counts_at, COUNT_TOKENS, channel, rt, parity)
            before, total = self._counts_before(here, counts_offset, counts_at, COUNT_MESSAGES,
                                                rt, parity, channel, active, max_tokens, error,
                                                failed, prefixed)
            if failed:
                n = Int32(0)
                ntok = Int32(0)
                before = Int32(0)
                total = Int32(0)
            else:
                if n < 0 or n > max_tokens or ntok < n or ntok > max_tokens:
                    cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                        sem="relaxed", scope="gpu")
                    n = Int32(0)
                    ntok = Int32(0)
            if total > max_tokens:
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                    sem="relaxed", scope="gpu")
                n = Int32(0)
                ntok = Int32(0)
                total = Int32(0)
            s_src[rt] = n
            s_src[3 * MAX_RANKS + rt] = Int32(0)  # set once a warp of source rt gives up
            for j in cutlass.range_constexpr(MAX_STAGE_BATCHES):
                s_src[(DONE_AT + j) * MAX_RANKS + rt] = Int32(0)
            s_src[4 * MAX_RANKS + rt] = ntok
            cute.make_tensor(chan_msgs, channel_messages_layout(ranks, channels).to_cute())[
                (rt, channel)] = n
            s_src[MAX_RANKS + rt] = before
            s_src[2 * MAX_RANKS + rt] = total
        # Per (source, segment): rows before this channel's and in all, a thread each (the
        # channels' counts loaded together); then per segment, the sources in order.
        for i in cutlass.range(rt, ranks * segments, threads):
            s = i // segments
            g = i - s * segments
            part, total = self._counts_before(here, counts_offset, counts_at, COUNT_SEGMENTS + g,
                                              s, parity, channel, active, max_tokens, error,
                                              failed, prefixed)
            if failed:
                part = Int32(0)
                total = Int32(0)
            s_next[s * MAX_SEGMENTS + g] = part
            s_totals[s * MAX_SEGMENTS + g] = total
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rt == 0:
            _stamp(trace, tracing, channel, "counts_summed", cute.arch.globaltimer())
        for g in cutlass.range(rt, segments, threads):
            run = Int32(0)
            for s in cutlass.range(ranks):
                s_next[s * MAX_SEGMENTS + g] = s_next[s * MAX_SEGMENTS + g] + run
                run = run + s_totals[s * MAX_SEGMENTS + g]
            s_raw[g] = run
            if segment_rows > 0:
                s_tot[g] = segment_rows  # slabs: every segment the worst case long
            else:
                s_tot[g] = (run + self.row_align - 1) // self.row_align * self.row_align
            if cutlass.const_expr(self.fmt == "nvfp4"):
                s_first[g] = (run + ATOM_ROWS - 1) // ATOM_ROWS
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rwarp == 0:
            warp_exclusive_scan(s_tot, s_off, segments, lane)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                warp_exclusive_scan(s_first, s_first, segments, lane)
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if segment_rows == SOURCE_ROWS:
            # Rows by source: source s's messages from row base[s] (the messages of the sources
            # before it); the output's rows end at the messages in all (s_off[segments], which
            # the capacity check and the scales' write-out read).
            if rt == 0:
                run = Int32(0)
                for s in cutlass.range(ranks):
                    s_src[5 * MAX_RANKS + s] = run
                    run = run + s_src[2 * MAX_RANKS + s]
                for g in cutlass.range(segments):
                    s_off[g] = Int32(0)
                s_off[segments] = run
            cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        # The segment offsets (and nvfp4 scale blocks), once per rank; padding, shared out.
        if channel == 0:
            offsets = cute.make_tensor(row_offsets, cute.make_layout(segments + 1))
            for g in cutlass.range(rt, segments + 1, threads):
                offsets[g] = s_off[g]
            for g in cutlass.range(rt, segments, threads):
                cute.make_tensor(expert_ids, cute.make_layout(segments))[g] = g - shared
                cute.make_tensor(seg_counts, cute.make_layout(segments))[g] = s_raw[g]
                if cutlass.const_expr(self.fmt == "nvfp4"):
                    cute.make_tensor(scales_offsets, cute.make_layout(segments))[g] = \
                        s_first[g] - s_off[g] // ATOM_ROWS
            for s in cutlass.range(rt, ranks, threads):
                cute.make_tensor(comb_counts, cute.make_layout(ranks))[s] = \
                    s_src[2 * MAX_RANKS + s]
            if rt == 0 and s_off[segments] > row_capacity:
                # More rows than the output holds (a receive capacity below the worst case):
                # rows past it are not written (`_place`), nor the padding and the scales.
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_CAPACITY),
                                    sem="relaxed", scope="gpu")
        payload_bytes = Int64(payload_vectors) * self.vector_bytes
        blocks = payload_vectors * self.vector_bytes // FP8_BLOCK
        scale_cols = payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK
        rk = (scale_cols + 3) // 4
        # Padding: the warps of every channel take a segment each in turn; the sender warps once
        # they have sent, where this launch has them (the receivers tell them the layout is
        # ready at PAD_BARRIER and go on to the batches), else the receiver warps here.
        if cutlass.const_expr(self.row_align > 1):
            # (Slabs leave the rows past a segment's count undefined; an overflow, everything
            # past the capacity.)
            if pad_by_senders != 0:
                cute.arch.barrier_arrive(barrier_id=PAD_BARRIER, number_of_threads=self.threads)
            elif segment_rows == 0 and s_off[segments] <= row_capacity:
                self._zero_row_padding(channel * self.recv_warps + rwarp,
                                       active * self.recv_warps, lane, tokens, scales,
                                       scale_rows, src_info, s_off, s_raw, segments,
                                       payload_bytes, blocks, row_capacity)

        # 3b. The messages of source s (warps rwarp = s, s + ranks, ... share them: each copies
        # its share of every payload, the first of them does the rest).
        # Warps per source: a batch's messages go one per warp, so more warps than a batch's
        # messages would idle (the rest of the warps then have no source).
        per_source = cutlass.min(self.recv_warps // ranks, BATCH)
        s = rwarp % ranks
        sub = rwarp // ranks
        for i in cutlass.range(rt, ranks * segments, threads):
            s_next[(i // segments) * MAX_SEGMENTS + i % segments] += s_off[i % segments]
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if sub > 0 and sub < per_source:
            # This warp's own copy of the next free row of each segment for source s (warp s
            # keeps source s's in place).
            for g in cutlass.range(lane, segments, WARP):
                s_next[rwarp * MAX_SEGMENTS + g] = s_next[s * MAX_SEGMENTS + g]
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rt == 0:
            _stamp(trace, tracing, channel, "layout_ready", cute.arch.globaltimer())
        split = Int32(0)
        if cutlass.const_expr(self.bulk):
            split = Int32(per_source >= SPLIT_MIN_WARPS)
            if split != 0 and sub < per_source:
                self._expand_split(
                    lane, sub, per_source, s, channel, peers, here, streams, error, tokens, scales,
                    scale_rows, segment_rows, src_info, comb_rows, comb_weights, comb_tokens,
                    max_tokens, topk, local_experts, ranks, my_rank, shared, skip_a2a, shared_begin,
                    shared_end, header_bytes, stage_bytes, stage_batches, payload_vectors,
                    scales_offset, row_capacity, channels, headers_offset, staging_offset,
                    counters_offset, counters, timeout_ns, s_next, s_off, s_first, s_src, s_rows,
                    s_wts, s_ring, s_full, s_piece, s_time, rwarp, payload_bytes, blocks,
                    scale_cols, rk, recv_ids, recv_weights, trace, tracing, input_offset,
                    s_plan + s * 2 * PLAN_SLOTS, s_planw, s * PLAN_WORDS)
        if split == 0 and sub < per_source:
            self._expand(lane, sub, per_source, s, channel, peers, here, streams, error, tokens,
                         scales, scale_rows, segment_rows, src_info, comb_rows, comb_weights,
                         comb_tokens, max_tokens, topk, local_experts, ranks, my_rank, shared,
                         skip_a2a, shared_begin, shared_end, header_bytes, stage_bytes,
                         stage_batches, payload_vectors,
                         scales_offset, row_capacity, channels, headers_offset, staging_offset,
                         counters_offset, counters, timeout_ns, s_next, s_off, s_first, s_src,
                         s_rows, s_wts, s_ring, s_full, s_piece, s_time, rwarp, warp_copy,
                         payload_bytes, blocks, scale_cols, rk, recv_ids, recv_weights, trace,
                         tracing, input_offset)

    @cute.jit
    def _expand(self, lane, sub, per_source, s, channel, peers: cute.Tensor, here,
                streams: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
                scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows,
                src_info: cute.Pointer, comb_rows: cute.Pointer,
                comb_weights: cute.Pointer, comb_tokens: cute.Pointer, max_tokens, topk,
                local_experts, ranks, my_rank, shared, skip_a2a, shared_begin, shared_end,
                header_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                row_capacity, channels, headers_offset, staging_offset, counters_offset,
                counters, timeout_ns, s_next: cute.Tensor, s_off: cute.Tensor,
                s_first: cute.Tensor, s_src: cute.Tensor, s_scratch: cute.Tensor,
                s_wts: cute.Tensor, s_ring: cute.Tensor, s_full: cute.Pointer,
                s_piece: cute.Tensor, s_time: cute.Tensor, rwarp, warp_copy: cute.TiledCopy,
                payload_bytes, blocks, scale_cols, rk, recv_ids: cute.Pointer,
                recv_weights: cute.Pointer, trace: cute.Pointer, tracing, input_offset):
        """One warp of source s: s's batches of this channel in order, once each is published,
        until the last message from s has landed. Every warp of s reads the batch's header and
        places the rows of its messages (so each keeps the same next-row counters), the whole
        batch at once; message m of the batch is then pulled from the source's staging by warp
        m % per_source and stored to its rows. The last warp of s to finish a batch hands it
        back to s (BF16: the batch before it, whose last pieces land while this one is placed;
        the last once every piece has landed), counted per staging slot in shared memory: the
        warps do not wait for each other between batches, only at the end of the stream."""
        stage = staging_layout(stage_bytes, stage_batches * BATCH, channels)
        headers = headers_layout(header_bytes, stage_batches, channels)
        hdr = batch_header_layout(topk)
        n, first_msg, ntok, batches, consumed, tail_word, head_word, staging = self._stream(
            s, channel, my_rank, peers, here, streams, counters, counters_offset, staging_offset,
            s_src)
        inputs = peers[s] + input_offset  # s's direct input (tokens whose word has DIRECT_BIT)
        scratch = rwarp * SCRATCH
        wts = rwarp * BATCH * MAX_TOPK
        next_at = rwarp * MAX_SEGMENTS
        lo = my_rank * local_experts
        vec = self.vector_bytes
        layout = cute.make_layout((payload_vectors, vec), stride=(vec, 1))
        tiler = (WARP * self.tile_vectors, vec)
        g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = warp_copy.get_slice(lane)
        tiles = cute.ceil_div(payload_vectors, WARP * self.tile_vectors)
        msg_bytes, scale_bytes, scale_mode, pieces = self._message_moves(
            payload_bytes, stage_bytes, blocks, rk, scale_cols, segment_rows, s_off,
            local_experts + shared, False)
        pieces_at = s_ring.iterator + rwarp * PIECES * PIECE
        full = s_full + rwarp * PIECES
        held = rwarp * PIECES  # s_piece words: what each piece of the ring holds
        issued = Int32(0)  # pieces loaded and stored by this warp, over the whole stream
        drained = Int32(0)
        # The pieces issued once the previous batch was placed: that batch goes back to s, and
        # its half of the warp's rows is taken again, only once the warp has drained that far.
        # So a batch's loads land while the next batch's header is read and its rows placed,
        # and no batch ends by emptying the ring.
        batch_mark = Int32(0)
        tail = consumed
        alive = Int32(1)
        placed = Int32(0)  # messages of s this warp has seen
        # This warp's RECV_TIMES (traced calls, `_lap`), after the sender warps' times.
        times = SEND_WARPS * len(SEND_TIMES) + rwarp * RECV_TIME_WORDS
        if tracing != 0 and lane == 0:
            for f in cutlass.range_constexpr(len(RECV_TIMES)):
                s_time[times + f] = Int64(0)
        # The next batch's header (ids, weights, source tokens), loaded into registers before
        # this batch's messages are placed once its source has published it, so its loads over
        # NVLink land while they are (`have` = 1: the registers hold the batch about to be
        # taken).
        n_ids = cute.make_rmem_tensor(cute.make_layout(HEADER_REGS), Int32)
        n_wts = cute.make_rmem_tensor(cute.make_layout(HEADER_REGS), Float32)
        have = Int32(0)
        n_tok = Int32(-1)
        i = Int32(0)
        while i < batches and placed < n:
            at = consumed + Int64(i)
            # Every warp of s waits for the batch itself (one lane polls).
            tail, alive = self._wait_batch(lane, i, at, tail, alive, tail_word, timeout_ns,
                                           error, s, channel, trace, tracing, s_time, times)
            if alive != 0:
                slot = Int32(at % Int64(stage_batches))
                head = peers[s] + headers_offset + Int64(headers((0, slot, channel)))
                if cutlass.const_expr(self.bulk):
                    if lane == 0:
                        cute.arch.fence_proxy("async.global")  # the tail's acquire, then bulk
                in_batch = cutlass.min(Int32(BATCH), ntok - i * BATCH)
                _lap(s_time, times, None, tracing, lane)
                cnt, tok, direct, comes, m_of, have, n_tok = self._take_batch(
                    lane, s, head, in_batch, i, at, tail, have, n_tok, n_ids, n_wts, hdr, topk,
                    batches, ntok, stage_batches, peers, headers_offset, headers, channel, lo,
                    local_experts, shared, skip_a2a, my_rank, shared_begin, shared_end, placed,
                    n, error, s_scratch, s_wts, scratch, wts)
                tok = self._map_messages(lane, tok, direct, comes, m_of, cnt, max_tokens, error,
                                         s_scratch, scratch, slot, True)
                if lane == 0 and i == 0:
                    _stamp_max(trace, tracing, channel, "chunk_read", cute.arch.globaltimer())
                _lap(s_time, times, "header_ns", tracing, lane)
                issued, drained = self._place(
                    lane, sub, per_source, s, cnt, first_msg + placed, topk, max_tokens,
                    my_rank, shared, shared_begin, shared_end, staging, inputs, stage, channel,
                    tokens, scales, scale_rows, segment_rows, src_info, comb_rows,
                    comb_weights, comb_tokens, scales_offset, row_capacity, s_next, s_off,
                    s_first, s_scratch, s_wts, scratch, i % 2, wts, next_at,
                    s_src[5 * MAX_RANKS + s], recv_ids, recv_weights, shared,
                    pieces_at, full, s_piece, held, pieces, msg_bytes,
                    payload_bytes, blocks, scale_cols, rk, scale_mode, scale_bytes, layout,
                    tiler, g_crd, thr, tiles, warp_copy, payload_vectors, issued, drained,
                    trace, tracing, Int32(i == 0), s_time, times)
                _lap(s_time, times, "place_ns", tracing, lane)
                if lane == 0 and i == 0:
                    _stamp_max(trace, tracing, channel, "chunk_stored", cute.arch.globaltimer())
                placed = placed + cnt
            done_through = at + 1  # the batches (counted across rounds) this warp is done with
            if cutlass.const_expr(self.bulk):
                # The previous batch's pieces have landed: that batch goes back to s now, this
                # one after the next (its last pieces land while the next is placed). A ring of
                # one batch cannot wait for the next: its batch goes back at once.
                target = batch_mark
                if stage_batches == 1:
                    target = issued
                _lap(s_time, times, None, tracing, lane)
                drained = self._drain_pieces(
                    target, lane, drained, msg_bytes, payload_bytes, pieces_at, full, s_piece,
                    held, tokens, topk, s_scratch, scale_rows, scales, scale_mode,
                    scales_offset, scale_bytes, scale_cols, row_capacity, s_time, times, tracing)
                _lap(s_time, times, "drain_ns", tracing, lane)
                batch_mark = issued
                if stage_batches > 1:
                    done_through = at
            # A warp whose wait failed says so to the other warps of s (the word is only ever
            # set in this kernel); they give up at their next batch.
            if alive == 0 and lane == 0:
                s_src[3 * MAX_RANKS + s] = Int32(1)
            if s_src[3 * MAX_RANKS + s] != 0:
                alive = Int32(0)
            if alive == 0:
                placed = n  # a rank timed out: the rest of this stream is given up
            elif lane == 0:
                # The last warp of s to finish this batch hands back to s the slots of the
                # batches through `done_through` (every warp of s is done with them). No barrier:
                # a warp goes on to its next batch while the others finish this one; it is at
                # most a ring ahead (s refills a slot only once it is handed back), so a slot's
                # count of finished warps reaches per_source once per use. A reduction to the
                # maximum: hand-backs of two batches may land in either order. Relaxed: the
                # warps' headers and payloads are loaded (their values in shared memory or
                # stored to rows), which is all the source needs.
                slot_done = cute.arch.atomic_add(
                    (s_src.iterator + (DONE_AT + i % stage_batches) * MAX_RANKS + s), Int32(1),
                    sem="relaxed", scope="cta")
                if slot_done + 1 == per_source * (i // stage_batches + 1):
                    cute.arch.red(gmem_ptr(Int64, head_word, 8), done_through, op="max",
                                  dtype=Int64, sem="relaxed", scope="sys")
            i = i + 1
        if cutlass.const_expr(self.bulk):
            # Every piece has landed before the stream's slots go back to s.
            _lap(s_time, times, None, tracing, lane)
            drained = self._drain_pieces(
                issued, lane, drained, msg_bytes, payload_bytes, pieces_at, full, s_piece,
                held, tokens, topk, s_scratch, scale_rows, scales, scale_mode,
                scales_offset, scale_bytes, scale_cols, row_capacity, s_time, times, tracing)
            _lap(s_time, times, "drain_ns", tracing, lane)
            if per_source > 1:
                cute.arch.barrier(barrier_id=2 + s, number_of_threads=WARP * per_source)
                _lap(s_time, times, "sync_ns", tracing, lane)
        # The batches past s's last message here are not read at all: they all go back to s.
        if placed < n and alive != 0:  # the batches held fewer messages than the counts said
            if lane == 0:
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                    sem="relaxed", scope="gpu")
        self._end_stream(lane, sub, alive, s, channel, streams, counters, head_word, consumed,
                         batches, trace, tracing, s_time, times)

    @cute.jit
    def _expand_split(self, lane, sub, per_source, s, channel, peers: cute.Tensor, here,
                      streams: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
                      scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows,
                      src_info: cute.Pointer, comb_rows: cute.Pointer,
                      comb_weights: cute.Pointer, comb_tokens: cute.Pointer, max_tokens, topk,
                      local_experts, ranks, my_rank, shared, skip_a2a, shared_begin, shared_end,
                      header_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                      row_capacity, channels, headers_offset, staging_offset, counters_offset,
                      counters, timeout_ns, s_next: cute.Tensor, s_off: cute.Tensor,
                      s_first: cute.Tensor, s_src: cute.Tensor, s_scratch: cute.Tensor,
                      s_wts: cute.Tensor, s_ring: cute.Tensor, s_full: cute.Pointer,
                      s_piece: cute.Tensor, s_time: cute.Tensor, rwarp, payload_bytes, blocks,
                      scale_cols, rk, recv_ids: cute.Pointer, recv_weights: cute.Pointer,
                      trace: cute.Pointer, tracing, input_offset, plans: cute.Pointer,
                      s_planw: cute.Tensor, pw):
        """Source s's warps split into a placer (sub 0: reads each batch's
        header, places its messages' rows into a plan, records what combine needs) and
        per_source - 1 movers (each pulls its share of a plan's messages into their rows), so
        the movers never wait on a header and the rows are placed once, not per warp. Plans
        go round PLAN_SLOTS slots (rows in the scratch of s's first warps, `_plan_rows`; the
        rest at s_planw[pw ..]), each ready (`plans[slot]`, the placer's arrival) and free
        again (`plans[PLAN_SLOTS + slot]`, every mover's, as soon as the pieces of that plan's
        messages are stored); the staging slots go back to s as `_expand` gives them. The
        movers take turns at a plan's odd messages: plan r's message m is mover (m + r) %
        movers's."""
        stage = staging_layout(stage_bytes, stage_batches * BATCH, channels)
        headers = headers_layout(header_bytes, stage_batches, channels)
        hdr = batch_header_layout(topk)
        n, first_msg, ntok, batches, consumed, tail_word, head_word, staging = self._stream(
            s, channel, my_rank, peers, here, streams, counters, counters_offset, staging_offset,
            s_src)
        inputs = peers[s] + input_offset
        pbase = s * SCRATCH  # the placer's scratch (warp s)
        movers = per_source - 1
        ready = plans
        free = plans + PLAN_SLOTS
        msg_bytes, scale_bytes, scale_mode, pieces = self._message_moves(
            payload_bytes, stage_bytes, blocks, rk, scale_cols, segment_rows, s_off,
            local_experts + shared, True)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            if scale_mode == SCALES_VECTORS:
                if self._message_scales(segment_rows, s_off, local_experts + shared, scales,
                                        scale_rows, payload_vectors, ranks, max_tokens,
                                        row_capacity):
                    scale_mode = Int32(SCALES_MESSAGES)
        pieces_at = s_ring.iterator + rwarp * PIECES * PIECE
        full = s_full + rwarp * PIECES
        held = rwarp * PIECES
        times = SEND_WARPS * len(SEND_TIMES) + rwarp * RECV_TIME_WORDS
        if tracing != 0 and lane == 0:
            for f in cutlass.range_constexpr(len(RECV_TIMES)):
                s_time[times + f] = Int64(0)
        alive = Int32(1)
        placed = Int32(0)
        if sub == 0:
            # The placer: every batch of s in order, as `_expand`'s warps take them.
            scratch = pbase
            wts = rwarp * BATCH * MAX_TOPK
            next_at = rwarp * MAX_SEGMENTS
            lo = my_rank * local_experts
            n_ids = cute.make_rmem_tensor(cute.make_layout(HEADER_REGS), Int32)
            n_wts = cute.make_rmem_tensor(cute.make_layout(HEADER_REGS), Float32)
            have = Int32(0)
            n_tok = Int32(-1)
            tail = consumed
            r = Int32(0)  # plans written
            i = Int32(0)
            while i < batches and placed < n and alive != 0:
                at = consumed + Int64(i)
                tail, alive = self._wait_batch(lane, i, at, tail, alive, tail_word, timeout_ns,
                                               error, s, channel, trace, tracing, s_time, times)
                if alive != 0:
                    slot = Int32(at % Int64(stage_batches))
                    head = peers[s] + headers_offset + Int64(headers((0, slot, channel)))
                    in_batch = cutlass.min(Int32(BATCH), ntok - i * BATCH)
                    _lap(s_time, times, None, tracing, lane)
                    cnt, tok, direct, comes, m_of, have, n_tok = self._take_batch(
                        lane, s, head, in_batch, i, at, tail, have, n_tok, n_ids, n_wts, hdr,
                        topk, batches, ntok, stage_batches, peers, headers_offset, headers,
                        channel, lo, local_experts, shared, skip_a2a, my_rank, shared_begin,
                        shared_end, placed, n, error, s_scratch, s_wts, scratch, wts)
                    slot3 = r % PLAN_SLOTS
                    tok = self._map_messages(lane, tok, direct, comes, m_of, cnt, max_tokens,
                                             error, s_scratch, scratch, slot, False)
                    if lane == 0 and i == 0:
                        _stamp_max(trace, tracing, channel, "chunk_read", cute.arch.globaltimer())
                    _lap(s_time, times, "header_ns", tracing, lane)
                    # The plan slot is free once every mover has stored the pieces of the plan
                    # PLAN_SLOTS before this one.
                    if r >= PLAN_SLOTS:
                        cute.arch.mbarrier_wait(free + slot3, (r // PLAN_SLOTS - 1) % 2)
                    _lap(s_time, times, "free_ns", tracing, lane)
                    if comes != 0 and m_of < cnt:
                        at_stage = slot * BATCH + lane
                        if direct != 0:
                            at_stage = -1 - tok
                        s_planw[pw + PLAN_STAGE_AT + slot3 * BATCH + m_of] = at_stage
                        s_planw[pw + PLAN_TOK_AT + slot3 * BATCH + m_of] = tok
                    self._place_plan(lane, s, cnt, first_msg + placed, topk, my_rank, shared,
                                     shared_begin, shared_end, segment_rows, row_capacity,
                                     s_next, s_off, s_first, s_scratch, scratch,
                                     self._plan_rows(s, ranks, slot3), next_at,
                                     s_src[5 * MAX_RANKS + s], s_time, times, tracing)
                    if lane == 0:
                        s_planw[pw + PLAN_CNT_AT + slot3] = cnt
                        s_planw[pw + PLAN_BATCH_AT + slot3] = i
                        # The placer is done with the batch's header: one of s's warps for the
                        # slot's count, before the plan is announced, so that the last of them
                        # is always a mover (which hands the batch before back).
                        cute.arch.atomic_add(
                            (s_src.iterator + (DONE_AT + i % stage_batches) * MAX_RANKS + s),
                            Int32(1), sem="relaxed", scope="cta")
                    cute.arch.sync_warp()  # the plan written before it is announced
                    if lane == 0:
                        cute.arch.mbarrier_arrive(ready + slot3)
                        if i == 0:
                            _stamp_max(trace, tracing, channel, "chunk_placed",
                                       cute.arch.globaltimer())
                    # What combine needs of the plan's messages, while the movers pull them (the
                    # plan's rows are only read from here on, and its slot is this warp's to
                    # reuse).
                    self._record(lane, s, first_msg + placed, cnt, topk, max_tokens, src_info,
                                 comb_rows, comb_weights, comb_tokens, s_scratch, s_wts, scratch,
                                 self._plan_rows(s, ranks, slot3), wts, segment_rows, recv_ids,
                                 recv_weights, shared)
                    cute.arch.sync_warp()  # every lane's reads of the batch done
                    _lap(s_time, times, "drain_ns", tracing, lane)
                    r = r + 1
                    placed = placed + cnt
                if alive == 0 and lane == 0:
                    s_src[3 * MAX_RANKS + s] = Int32(1)
                if s_src[3 * MAX_RANKS + s] != 0:
                    alive = Int32(0)
                i = i + 1
            # The end of the stream: a plan of -1 messages.
            slot3 = r % PLAN_SLOTS
            if r >= PLAN_SLOTS:
                cute.arch.mbarrier_wait(free + slot3, (r // PLAN_SLOTS - 1) % 2)
            if lane == 0:
                s_planw[pw + PLAN_CNT_AT + slot3] = Int32(-1)
                s_planw[pw + PLAN_BATCH_AT + slot3] = i
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(ready + slot3)
            if placed < n and alive != 0:
                if lane == 0:
                    cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                        sem="relaxed", scope="gpu")
        else:
            # A mover: its share of every plan, in order.
            mv = sub - 1
            issued = Int32(0)
            drained = Int32(0)
            batch_mark = Int32(0)
            r = Int32(0)
            going = Int32(1)
            while going != 0:
                slot3 = r % PLAN_SLOTS
                _lap(s_time, times, None, tracing, lane)
                cute.arch.mbarrier_wait(ready + slot3, (r // PLAN_SLOTS) % 2)
                _lap(s_time, times, "recv_wait_ns", tracing, lane)
                cnt = s_planw[pw + PLAN_CNT_AT + slot3]
                if cnt < 0:
                    going = Int32(0)
                else:
                    i = s_planw[pw + PLAN_BATCH_AT + slot3]
                    at = consumed + Int64(i)
                    if cutlass.const_expr(self.bulk):
                        if lane == 0:
                            cute.arch.fence_proxy("async.global")  # the tail's acquire, then bulk
                    rows0 = self._plan_rows(s, ranks, slot3)
                    # The plan before goes free as soon as its pieces are stored (a ring of one
                    # batch: this one, below, once the batch is done).
                    owed = Int32(0)
                    if r >= 1 and stage_batches > 1:
                        owed = Int32(1)
                    for m in cutlass.range((mv + movers - r % movers) % movers, cnt, movers):
                        msg = self._message_at(staging, inputs, stage, channel,
                                               s_planw[pw + PLAN_STAGE_AT + slot3 * BATCH + m],
                                               msg_bytes)
                        # Its scales' staged row (SCALES_MESSAGES): source s's token.
                        msg_row = s * max_tokens + s_planw[pw + PLAN_TOK_AT + slot3 * BATCH + m]
                        for p in cutlass.range(pieces):
                            issued, drained = self._pull_piece(
                                lane, msg, rows0 + m * ROWS, p, issued, drained, msg_row,
                                msg_bytes,
                                payload_bytes, pieces_at, full, s_piece, held, tokens, topk,
                                s_scratch, scale_rows, scales, scale_mode, scales_offset,
                                scale_bytes, scale_cols, row_capacity, s_time, times, tracing)
                        if owed != 0 and drained >= batch_mark:
                            cute.arch.sync_warp()  # every lane is done reading its rows
                            if lane == 0:
                                cute.arch.mbarrier_arrive(free + (r - 1) % PLAN_SLOTS)
                            owed = Int32(0)
                    if lane == 0 and i == 0:
                        _stamp_max(trace, tracing, channel, "chunk_stored",
                                   cute.arch.globaltimer())
                    # As `_expand`: the previous batch's pieces have landed and been stored; that
                    # batch goes back to s now (with a ring of one batch, this one at once).
                    target = batch_mark
                    done_through = at
                    if stage_batches == 1:
                        target = issued
                        done_through = at + 1
                    _lap(s_time, times, None, tracing, lane)
                    drained = self._drain_pieces(
                        target, lane, drained, msg_bytes, payload_bytes, pieces_at, full,
                        s_piece, held, tokens, topk, s_scratch, scale_rows, scales,
                        scale_mode, scales_offset, scale_bytes, scale_cols, row_capacity,
                        s_time, times, tracing)
                    _lap(s_time, times, "drain_ns", tracing, lane)
                    batch_mark = issued
                    # The plan whose pieces are all stored now, if not freed above: the one
                    # before (a ring of one batch: this one), once every lane is done reading it.
                    cute.arch.sync_warp()
                    if lane == 0:
                        if stage_batches == 1:
                            cute.arch.mbarrier_arrive(free + slot3)
                        elif owed != 0:
                            cute.arch.mbarrier_arrive(free + (r - 1) % PLAN_SLOTS)
                    if s_src[3 * MAX_RANKS + s] != 0:
                        alive = Int32(0)
                    if alive != 0 and lane == 0:
                        slot_done = cute.arch.atomic_add(
                            (s_src.iterator + (DONE_AT + i % stage_batches) * MAX_RANKS + s),
                            Int32(1), sem="relaxed", scope="cta")
                        if slot_done + 1 == per_source * (i // stage_batches + 1):
                            cute.arch.red(gmem_ptr(Int64, head_word, 8), done_through, op="max",
                                          dtype=Int64, sem="relaxed", scope="sys")
                    r = r + 1
            # Every piece has landed and been stored: the last plan goes free (the placer may be
            # waiting for it to end the stream) and the stream's slots go back to s.
            _lap(s_time, times, None, tracing, lane)
            drained = self._drain_pieces(
                issued, lane, drained, msg_bytes, payload_bytes, pieces_at, full, s_piece, held,
                tokens, topk, s_scratch, scale_rows, scales, scale_mode, scales_offset,
                scale_bytes, scale_cols, row_capacity, s_time, times, tracing)
            _lap(s_time, times, "drain_ns", tracing, lane)
            cute.arch.sync_warp()
            if lane == 0 and stage_batches > 1 and r >= 1:
                cute.arch.mbarrier_arrive(free + (r - 1) % PLAN_SLOTS)
        cute.arch.barrier(barrier_id=2 + s, number_of_threads=WARP * per_source)
        _lap(s_time, times, "sync_ns", tracing, lane)
        if s_src[3 * MAX_RANKS + s] != 0:
            alive = Int32(0)
        self._end_stream(lane, sub, alive, s, channel, streams, counters, head_word, consumed,
                         batches, trace, tracing, s_time, times)

    @cute.jit
    def _wait_batch(self, lane, i, at, tail, alive, tail_word, timeout_ns, error: cute.Pointer,
                    s, channel, trace: cute.Pointer, tracing, s_time: cute.Tensor, times):
        """Batch `at` (the i-th of this round) of source s published: lane 0 polls its tail
        unless it has seen it (or the stream is dead), and the warp learns whether it came.
        Returns (tail, alive), tail as lane 0 saw it."""
        if lane == 0:
            if tail <= at and alive != 0:
                _lap(s_time, times, None, tracing, lane)
                tail, alive = _wait_at_least(tail_word, at + 1, timeout_ns, error, s,
                                             Int32(PHASE_DISPATCH))
                _lap(s_time, times, "recv_wait_ns", tracing, lane)
        alive = cute.arch.shuffle_sync(alive, 0)
        if lane == 0 and i == 0:
            _stamp_max(trace, tracing, channel, "first_batch", cute.arch.globaltimer())
        return tail, alive

    @cute.jit
    def _end_stream(self, lane, sub, alive, s, channel, streams: cute.Pointer, counters,
                    head_word, consumed, batches, trace: cute.Pointer, tracing,
                    s_time: cute.Tensor, times):
        """The end of source s's stream, every warp of s past it: the first hands every batch
        of the round back to s and remembers them consumed (unless a wait failed); each warp's
        rows are written before the CTA ends; the traced stamps and this warp's times."""
        if sub == 0 and lane == 0 and alive != 0:
            cute.arch.red(gmem_ptr(Int64, head_word, 8), consumed + Int64(batches), op="max",
                          dtype=Int64, sem="relaxed", scope="sys")
            cute.arch.store(gmem_ptr(Int64, streams.toint() + Int64(
                counters((channel, s, HEADS, DISPATCH))) * 8, 8), consumed + Int64(batches))
        if lane == 0:
            _stamp_max(trace, tracing, channel, "recv_done", cute.arch.globaltimer())
        if cutlass.const_expr(self.bulk):
            cute.arch.cp_async_bulk_wait_group(0)  # every lane's rows written before the CTA ends
        if lane == 0:
            _stamp_max(trace, tracing, channel, "rows_written", cute.arch.globaltimer())
        if tracing != 0 and lane == 0:
            for f in cutlass.range_constexpr(len(RECV_TIMES)):
                _stamp_max(trace, tracing, channel, RECV_TIMES[f], s_time[times + f])

    @cute.jit
    def _stream(self, s, channel, my_rank, peers: cute.Tensor, here, streams: cute.Pointer,
                counters, counters_offset, staging_offset, s_src: cute.Tensor):
        """Source s's stream on this channel: (its messages, the messages of the channels
        before, its tokens, batches, the batches consumed before this round, the address of
        its tail word here, of this rank's head word there, its staging there)."""
        n = s_src[s]
        first_msg = s_src[MAX_RANKS + s]
        ntok = s_src[4 * MAX_RANKS + s]
        batches = (ntok + BATCH - 1) // BATCH
        consumed = cute.arch.load(gmem_ptr(Int64, streams.toint() + Int64(
            counters((channel, s, HEADS, DISPATCH))) * 8, 8), Int64)
        tail_word = here + counters_offset + Int64(counters((channel, s, TAILS, DISPATCH))) * 8
        head_word = peers[s] + counters_offset + Int64(
            counters((channel, my_rank, HEADS, DISPATCH))) * 8
        return (n, first_msg, ntok, batches, consumed, tail_word, head_word,
                peers[s] + staging_offset)

    @cute.jit
    def _message_moves(self, payload_bytes, stage_bytes, blocks, rk, scale_cols, segment_rows,
                       s_off: cute.Tensor, segments, vectors: cutlass.Constexpr):
        """How the bulk path moves a source's messages: (bytes a message, scale bytes a row,
        scale mode, pieces a message). BF16 rows (16-byte multiples: H is a multiple of 8) move
        by bulk copies through the warp's pieces. FP8 and NVFP4 messages move whole (payload,
        then scales at scales_offset): the pieces holding scale bytes also store those to each
        row's scales (`_store_piece`, by the scale mode; `vectors`, the placer/mover split's
        movers: SCALES_VECTORS where the rows' scales would be bulk-stored)."""
        msg_bytes = Int64(payload_bytes)
        scale_bytes = Int32(0)
        scale_mode = Int32(SCALES_BULK)
        if cutlass.const_expr(self.fmt != "bf16"):
            msg_bytes = Int64(stage_bytes)
            scale_bytes = (blocks if self.fmt == "fp8" else rk) * 4
            if segment_rows > 0:
                scale_mode = Int32(SCALES_SLABS)
            elif self._direct_scales(s_off, segments):
                scale_mode = Int32(SCALES_SLABS)  # a decode step's rows: straight to the output
            elif scale_bytes % 16 != 0 or (self.fmt == "nvfp4" and scale_cols % 4 != 0):
                scale_mode = Int32(SCALES_LANES)
            elif cutlass.const_expr(vectors):
                # The movers store a row's scale bytes themselves, 16 bytes a lane: a bulk
                # copy of a few hundred bytes costs its issuing thread as much as a row's.
                scale_mode = Int32(SCALES_VECTORS)
        return msg_bytes, scale_bytes, scale_mode, Int32((msg_bytes + PIECE - 1) // PIECE)

    @cute.jit
    def _take_batch(self, lane, s, head, in_batch, i, at, tail, have, n_tok, n_ids: cute.Tensor,
                    n_wts: cute.Tensor, hdr, topk, batches, ntok, stage_batches,
                    peers: cute.Tensor, headers_offset, headers, channel, lo, local_experts,
                    shared, skip_a2a, my_rank, shared_begin, shared_end, placed, n,
                    error: cute.Pointer, s_scratch: cute.Tensor, s_wts: cute.Tensor, scratch,
                    wts):
        """Batch i of source s (its header at `head`) into the warp's scratch, as `_expand` and
        the split's placer read it: its ids, weights and segments; the next batch's header
        loaded ahead into n_ids / n_wts when its source has published it. Returns (messages,
        this lane's token, whether it is a direct row, whether this lane's token comes, its
        message index, have, n_tok), have / n_tok those of the header ahead; `_map_messages`
        then records the messages."""
        # The batch's ids and weights (into shared memory) and source tokens: loaded
        # while the previous batch was placed, or now (all in flight together).
        if have == 0:
            n_tok = self._load_header(lane, head, hdr, in_batch, topk, n_ids, n_wts)
        for j in cutlass.range_constexpr(HEADER_REGS):
            w = lane + j * WARP
            if w < in_batch * topk:
                s_scratch[scratch + IDS_AT + w] = n_ids[j]
                s_wts[wts + w] = n_wts[j]
        tok = n_tok
        direct = Int32(0)
        if tok < 0:  # DIRECT_BIT: the payload is row tok of s's direct input
            direct = Int32(1)
            tok = tok & Int32(~DIRECT_BIT)
        cute.arch.sync_warp()
        # The next batch's, once its source has published it (lane 0 saw its tail:
        # acquired with this one's).
        have = Int32(0)
        ahead = cute.arch.shuffle_sync(Int32(tail > at + 1), 0)
        if ahead != 0 and i + 1 < batches:
            nslot = Int32((at + 1) % Int64(stage_batches))
            n_tok = self._load_header(
                lane, peers[s] + headers_offset + Int64(headers((0, nslot, channel))),
                hdr, cutlass.min(Int32(BATCH), ntok - (i + 1) * BATCH), topk, n_ids,
                n_wts)
            have = Int32(1)
        # Each (token, k)'s local segment: -1 for another rank's expert, an id outside
        # the experts, or a later k naming an expert an earlier k named (the sender
        # counted the same pairs).
        for w in cutlass.range(lane, in_batch * topk, WARP):
            c = w // topk
            k = w - c * topk
            e = s_scratch[scratch + IDS_AT + w]
            g = Int32(-1)
            if e >= lo and e < lo + local_experts:
                g = e - lo + shared
                for k2 in cutlass.range(k):
                    if s_scratch[scratch + IDS_AT + c * topk + k2] == e:
                        g = Int32(-1)
            if skip_a2a != 0 and s != my_rank:
                g = Int32(-1)
            s_scratch[scratch + SEGS_AT + w] = g
        cute.arch.sync_warp()
        # The batch's messages: its tokens with a segment here, or this rank's own
        # shared-expert tokens, in order.
        comes = Int32(0)
        if lane < in_batch:
            for k in cutlass.range(topk):
                if s_scratch[scratch + SEGS_AT + lane * topk + k] >= 0:
                    comes = Int32(1)
            if shared != 0 and s == my_rank and tok >= shared_begin and \
                    tok < shared_end:
                comes = Int32(1)
        ballot = cute.arch.vote_ballot_sync(comes != 0)
        cnt = cute.arch.popc(ballot)
        if placed + cnt > n:  # more than the counts said: never past them
            cute.arch.atomic_or(error_field(error, "bad_counts"),
                                Int32(ERROR_COUNTS), sem="relaxed", scope="gpu")
            cnt = n - placed
        m_of = cute.arch.popc(ballot & ((Int32(1) << lane) - 1))
        return cnt, tok, direct, comes, m_of, have, n_tok

    @cute.jit
    def _map_messages(self, lane, tok, direct, comes, m_of, cnt, max_tokens,
                      error: cute.Pointer, s_scratch: cute.Tensor, scratch, slot,
                      stage_too: cutlass.Constexpr):
        """After `_take_batch`: each message's token of the batch and source token into the
        warp's scratch (`stage_too`: and its staging slot, or its direct input row). Returns the
        lane's token, 0 where it was out of range."""
        if comes != 0 and m_of < cnt:
            if tok < 0 or tok >= max_tokens:
                cute.arch.atomic_or(error_field(error, "bad_counts"),
                                    Int32(ERROR_COUNTS), sem="relaxed", scope="gpu")
                tok = Int32(0)
            s_scratch[scratch + MAP_AT + m_of] = lane
            s_scratch[scratch + TOKS_AT + m_of] = tok
            if cutlass.const_expr(stage_too):
                s_scratch[scratch + STAGE_AT + m_of] = slot * BATCH + lane
                if direct != 0:
                    s_scratch[scratch + STAGE_AT + m_of] = -1 - tok
        cute.arch.sync_warp()
        return tok

    @cute.jit
    def _place_rows(self, lane, s, cnt, first, topk, my_rank, shared, shared_begin, shared_end,
                    segment_rows, row_capacity, s_next: cute.Tensor, s_off: cute.Tensor,
                    s_first: cute.Tensor, s_scratch: cute.Tensor, scratch, rows0, next_at,
                    src_base, scale_rows_too: cutlass.Constexpr):
        """The rows of a batch's `cnt` messages (messages first .. of source s; map and segments
        in the warp's scratch) at word `rows0` of s_scratch, message m's at rows0 + m * ROWS,
        k = topk its shared-expert row (`scale_rows_too`: NVFP4's scale-row positions too, at
        SROWS_AT). The lanes' last writes are not yet synchronised."""
        # The (message, k) pairs of the batch, message-major, 32 at a time: lanes holding the
        # same segment take consecutive rows in lane order (so in message order), the group's
        # last lane moving the segment's next row past them; a message's k name distinct
        # segments.
        pairs = cnt * topk
        for w0 in cutlass.range(0, pairs, WARP):
            w = w0 + lane
            m = w // topk
            k = w - m * topk
            g = Int32(-1)
            c = Int32(0)
            if w < pairs:
                c = s_scratch[scratch + MAP_AT + m]
                g = s_scratch[scratch + SEGS_AT + c * topk + k]
            row = Int32(-1)
            if segment_rows == SOURCE_ROWS:
                # One row per message, sources in order, each in its token order: held by the
                # message's first local k.
                if g >= 0:
                    row = src_base + first + m
                    for k2 in cutlass.range(k):
                        if s_scratch[scratch + SEGS_AT + c * topk + k2] >= 0:
                            row = Int32(-1)
            else:
                # Pairs with no segment here match only themselves (a key no segment has).
                key = -2 - lane
                if g >= 0:
                    key = g
                same = cute.arch.match_sync(0xFFFFFFFF, key)
                rank = cute.arch.popc(Int32(same) & ((Int32(1) << lane) - 1))
                if g >= 0:
                    row = s_next[next_at + g] + rank
                cute.arch.sync_warp()  # every lane has read the counters before they move
                if g >= 0 and rank == cute.arch.popc(Int32(same)) - 1:
                    s_next[next_at + g] = row + 1
                if cutlass.const_expr(self.fmt == "nvfp4" and scale_rows_too):
                    if g >= 0:
                        s_scratch[scratch + SROWS_AT + m * ROWS + k] = \
                            row - s_off[g] + s_first[g] * ATOM_ROWS
            if w < pairs:
                if row >= row_capacity:
                    row = -2 - row  # past the output's capacity: recorded, not written
                s_scratch[rows0 + m * ROWS + k] = row
            # The next pairs' lanes read the counters these lanes just moved.
            cute.arch.sync_warp()
        # Each message's shared-expert row (k = topk): this rank's own tokens in order.
        if lane < cnt:
            tok = s_scratch[scratch + TOKS_AT + lane]
            row = Int32(-1)
            if shared != 0 and s == my_rank and tok >= shared_begin and tok < shared_end:
                row = tok - shared_begin  # segment 0
            if cutlass.const_expr(self.fmt == "nvfp4" and scale_rows_too):
                s_scratch[scratch + SROWS_AT + lane * ROWS + topk] = row
            if row >= row_capacity:
                row = -2 - row
            s_scratch[rows0 + lane * ROWS + topk] = row

    @cute.jit
    def _plan_rows(self, s, ranks, slot):
        """The word of s_scratch where plan `slot`'s rows of source s begin (message m's at +
        m * ROWS): PLAN_SLOTS_A_WARP plans in the scratch of each of s's first warps (warps s,
        s + ranks, ...)."""
        warp = s + (slot // PLAN_SLOTS_A_WARP) * ranks
        return warp * SCRATCH + ROWS_AT + (slot % PLAN_SLOTS_A_WARP) * BATCH * ROWS

    @cute.jit
    def _place_plan(self, lane, s, cnt, first, topk, my_rank, shared, shared_begin, shared_end,
                    segment_rows, row_capacity, s_next: cute.Tensor, s_off: cute.Tensor,
                    s_first: cute.Tensor, s_scratch: cute.Tensor, scratch, rows0, next_at,
                    src_base, s_time: cute.Tensor, times, tracing):
        """The placer's `_place` without the pulls and the record: the rows of a batch's `cnt`
        messages (messages first .. of source s) into the plan at word `rows0` (message m's at
        rows0 + m * ROWS)."""
        self._place_rows(lane, s, cnt, first, topk, my_rank, shared, shared_begin, shared_end,
                         segment_rows, row_capacity, s_next, s_off, s_first, s_scratch, scratch,
                         rows0, next_at, src_base, False)
        cute.arch.sync_warp()
        _lap(s_time, times, "place_ns", tracing, lane)

    @cute.jit
    def _load_header(self, lane, at, hdr, hn, topk, n_ids: cute.Tensor, n_wts: cute.Tensor):
        """Load the ids and weights of the hn tokens of the batch header at global address `at`
        into the lanes' registers (word w = lane + j * WARP of the batch in n_ids[j],
        n_wts[j]); returns lane c's source token (c < hn; -1 for the other lanes). The loads are
        not waited for."""
        words = cute.make_layout(header_token_word(topk, BATCH))
        head = cute.make_tensor(gmem_ptr(Int32, at, 16), words)
        head_f = cute.make_tensor(gmem_ptr(Float32, at, 16), words)
        for j in cutlass.range_constexpr(HEADER_REGS):
            w = lane + j * WARP
            if w < hn * topk:
                c = w // topk
                k = w - c * topk
                n_ids[j] = head[hdr((k, IDS, c))]
                n_wts[j] = head_f[hdr((k, WEIGHTS, c))]
        tok = Int32(-1)
        if lane < hn:
            tok = head[header_token_word(topk, lane)]
        return tok

    @cute.jit
    def _place(self, lane, sub, per_source, s, cnt, first, topk, max_tokens, my_rank, shared,
               shared_begin, shared_end, staging, inputs, stage, channel, tokens: cute.Pointer,
               scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows,
               src_info: cute.Pointer, comb_rows: cute.Pointer, comb_weights: cute.Pointer,
               comb_tokens: cute.Pointer, scales_offset, row_capacity, s_next: cute.Tensor,
               s_off: cute.Tensor, s_first: cute.Tensor, s_scratch: cute.Tensor,
               s_wts: cute.Tensor, scratch, half, wts, next_at, src_base,
               recv_ids: cute.Pointer, recv_weights: cute.Pointer, local_base,
               pieces_at: cute.Pointer, full: cute.Pointer, s_piece: cute.Tensor, held, pieces,
               msg_bytes, payload_bytes, blocks, scale_cols, rk, scale_mode, scale_bytes, layout,
               tiler, g_crd, thr, tiles, warp_copy: cute.TiledCopy, payload_vectors, issued,
               drained, trace: cute.Pointer, tracing, first_batch, s_time: cute.Tensor, times):
        """A batch's `cnt` messages (messages first .. first + cnt - 1 of source s here): their
        rows, 32 (message, k) pairs at a time (lanes of one segment ranked by `match.any`); what
        combine needs of them (the first warp of s); then this warp's messages m = sub,
        sub + per_source, ... pulled from the source's staging into their rows. The rows go to
        half `half` of the warp's batch rows.
        Returns the warp's (issued, drained) pieces of the bulk path."""
        vec = self.vector_bytes
        rows0 = scratch + ROWS_AT + half * BATCH * ROWS  # message m's at rows0 + m * ROWS
        self._place_rows(lane, s, cnt, first, topk, my_rank, shared, shared_begin, shared_end,
                         segment_rows, row_capacity, s_next, s_off, s_first, s_scratch, scratch,
                         rows0, next_at, src_base, True)
        cute.arch.sync_warp()
        if sub == 0:
            self._record(lane, s, first, cnt, topk, max_tokens, src_info, comb_rows,
                         comb_weights, comb_tokens, s_scratch, s_wts, scratch, rows0, wts,
                         segment_rows, recv_ids, recv_weights, local_base)
        if lane == 0 and first_batch != 0:
            _stamp_max(trace, tracing, channel, "chunk_placed", cute.arch.globaltimer())
        if cutlass.const_expr(self.bulk):
            # Every piece of this warp's messages of the batch through the warp's ring.
            for m in cutlass.range(sub, cnt, per_source):
                msg = self._message_at(staging, inputs, stage, channel,
                                       s_scratch[scratch + STAGE_AT + m], msg_bytes)
                for p in cutlass.range(pieces):
                    issued, drained = self._pull_piece(
                        lane, msg, rows0 + m * ROWS, p, issued, drained, Int32(-1), msg_bytes,
                        payload_bytes, pieces_at, full, s_piece, held, tokens, topk, s_scratch,
                        scale_rows, scales, scale_mode, scales_offset, scale_bytes,
                        scale_cols, row_capacity, s_time, times, tracing)
        else:
            for m in cutlass.range(sub, cnt, per_source):
                msg = self._message_at(staging, inputs, stage, channel,
                                       s_scratch[scratch + STAGE_AT + m], msg_bytes)
                rows_at = rows0 + m * ROWS
                scale_words = blocks if self.fmt == "fp8" else rk
                sregs = self._load_scales(lane, msg, scales_offset, scale_words, scale_cols)
                g_src = cute.zipped_divide(cute.make_tensor(gmem_ptr(Uint8, msg, 16), layout),
                                           tiler)
                for tile in cutlass.range(tiles):
                    pred = row_predicate(thr.partition_S(g_crd[((None, None), tile)]),
                                         payload_vectors)
                    t_src = thr.partition_S(g_src[((None, None), tile)])
                    regs = cute.make_fragment_like(t_src)
                    cute.copy(warp_copy, t_src, regs, pred=pred)
                    for k in cutlass.range(topk + 1):
                        r = s_scratch[rows_at + k]
                        if r >= 0:
                            g_dst = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                                Uint8, tokens.toint() + Int64(r) * payload_bytes, vec),
                                layout), tiler)
                            cute.copy(warp_copy, regs,
                                      thr.partition_D(g_dst[((None, None), tile)]),
                                      pred=row_predicate(
                                          thr.partition_S(g_crd[((None, None), tile)]),
                                          payload_vectors))
                self._store_scales(lane, msg, sregs, scales, scale_rows, segment_rows,
                                   scales_offset, row_capacity, topk, scale_words, scale_cols,
                                   rk, s_scratch, rows_at, scratch + SROWS_AT + m * ROWS)
        return issued, drained

    @cute.jit
    def _message_at(self, staging, inputs, stage, channel, staged, msg_bytes):
        """Where a message's bytes are: its staging slot (`staged` >= 0), or row -1 - staged of
        its source's direct input (rows of `msg_bytes`, laid out as staged messages)."""
        msg = inputs + Int64(-1 - staged) * Int64(msg_bytes)
        if staged >= 0:
            msg = staging + Int64(stage((0, staged, channel)))
        return msg

    @cute.jit
    def _pull_piece(self, lane, msg, rows_at, p, issued, drained, msg_row, msg_bytes,
                    payload_bytes,
                    ring: cute.Pointer, full: cute.Pointer, s_piece: cute.Tensor, held,
                    tokens: cute.Pointer, topk, s_scratch: cute.Tensor,
                    scale_rows: cute.Pointer, scales: cute.Pointer, scale_mode, scales_offset,
                    scale_bytes, scale_cols, row_capacity, s_time: cute.Tensor, times, tracing):
        """Bulk-load piece p of a message (staged at `msg`, its rows at word `rows_at` of
        s_scratch) into the warp's next piece of shared memory once the stores that read it
        last are done reading it; then store the oldest piece if LAG pieces are in flight.
        Returns (issued, drained)."""
        at = issued % PIECES
        offset = Int64(p) * PIECE
        nbytes = cutlass.min(Int32(PIECE), Int32(Int64(msg_bytes) - offset))
        # Piece `issued - PIECES` last held this one; of each lane's store groups committed since
        # (one per piece drained), at most PIECES - 1 - LAG are newer than its own.
        _lap(s_time, times, "place_ns", tracing, lane)
        cute.arch.cp_async_bulk_wait_group(PIECES - 1 - LAG, read=True)
        cute.arch.sync_warp()  # every lane's stores have read the piece
        _lap(s_time, times, "free_ns", tracing, lane)
        if lane == 0:
            if cutlass.const_expr(self.fmt != "bf16"):
                if scale_mode != SCALES_BULK:
                    # The lanes' loads of scale words from the piece this one replaces
                    # (`_store_piece`) before the bulk load writes it. Bulk-stored scales are
                    # read by the async proxy alone, which the wait above already orders.
                    cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive_and_expect_tx(full + at, nbytes)
            bulk_load(ring + at * PIECE, msg + offset, nbytes, full + at)
        s_piece[held + at] = rows_at * 64 + p  # (its rows, the piece): every lane writes it
        if cutlass.const_expr(self.fmt == "nvfp4"):  # its scales' staged row (SCALES_MESSAGES)
            s_piece[self.ring_shape[0] + held + at] = msg_row
        cute.arch.sync_warp()  # ... before any lane reads it back in `_store_piece`
        issued = issued + 1
        if issued - drained > LAG:
            drained = self._store_piece(lane, drained, msg_bytes, payload_bytes, ring, full,
                                        s_piece, held, tokens, topk, s_scratch,
                                        scale_rows, scales, scale_mode, scales_offset,
                                        scale_bytes, scale_cols, row_capacity, s_time, times,
                                        tracing, "place_ns")
        return issued, drained

    @cute.jit
    def _drain_pieces(self, until, lane, drained, msg_bytes, payload_bytes, ring: cute.Pointer,
                      full: cute.Pointer, s_piece: cute.Tensor, held, tokens: cute.Pointer,
                      topk, s_scratch: cute.Tensor, scale_rows: cute.Pointer,
                      scales: cute.Pointer, scale_mode, scales_offset, scale_bytes, scale_cols,
                      row_capacity, s_time: cute.Tensor, times, tracing):
        """`_store_piece` until the warp has stored `until` pieces; returns drained."""
        while drained < until:
            drained = self._store_piece(lane, drained, msg_bytes, payload_bytes, ring, full,
                                        s_piece, held, tokens, topk, s_scratch,
                                        scale_rows, scales, scale_mode, scales_offset,
                                        scale_bytes, scale_cols, row_capacity, s_time, times,
                                        tracing, "drain_ns")
        return drained

    @cute.jit
    def _store_piece(self, lane, drained, msg_bytes, payload_bytes, ring: cute.Pointer,
                     full: cute.Pointer, s_piece: cute.Tensor, held, tokens: cute.Pointer, topk,
                     s_scratch: cute.Tensor, scale_rows: cute.Pointer,
                     scales: cute.Pointer, scale_mode, scales_offset, scale_bytes, scale_cols,
                     row_capacity, s_time: cute.Tensor, times, tracing,
                     part: cutlass.Constexpr):
        """Wait for the warp's oldest piece in flight to land and store it to every row of its
        message (an async group a piece in every lane): the payload bytes it holds by bulk
        stores to the rows; FP8 and NVFP4 scale bytes it holds by `scale_mode` (SCALES_BULK:
        bulk stores to the rows of `scale_rows`; SCALES_LANES: the lanes' word stores there,
        NVFP4's padding bytes cleared; SCALES_SLABS: the lanes' stores into FP8's transposed
        output).
        Returns drained + 1."""
        at = drained % PIECES
        _lap(s_time, times, part, tracing, lane)
        cute.arch.mbarrier_wait(full + at, (drained // PIECES) % 2)
        _lap(s_time, times, "land_ns", tracing, lane)
        what = s_piece[held + at]
        rows_at = what // 64
        offset = Int64(what - rows_at * 64) * PIECE
        end = offset + Int64(cutlass.min(Int32(PIECE), Int32(Int64(msg_bytes) - offset)))
        pay = Int32(cutlass.min(end, Int64(payload_bytes)) - offset)  # <= 0: scales only
        sc_lo = cutlass.max(offset, Int64(scales_offset))  # the scale bytes the piece holds
        sc_hi = cutlass.min(end, Int64(scales_offset) + Int64(scale_bytes))
        # Lane k stores the piece to the message's row k, all of them at once; every lane
        # commits a group a piece (empty where it has no row), so the lanes' counts agree.
        if lane < topk + 1:
            r = s_scratch[rows_at + lane]
            if r >= 0:
                if pay > 0:
                    bulk_store(tokens.toint() + Int64(r) * payload_bytes + offset,
                               ring + at * PIECE, pay)
                if cutlass.const_expr(self.fmt != "bf16"):
                    if scale_mode == SCALES_BULK and sc_hi > sc_lo:
                        bulk_store(scale_rows.toint() + Int64(r) * Int64(scale_bytes)
                                   + sc_lo - Int64(scales_offset),
                                   ring + at * PIECE + Int32(sc_lo - offset),
                                   Int32(sc_hi - sc_lo))
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(self.fmt != "bf16"):
            if (scale_mode == SCALES_VECTORS or scale_mode == SCALES_MESSAGES) and \
                    sc_hi > sc_lo:
                # A 16-byte vector of the piece's scale bytes a lane, loaded once and stored to
                # every row of the message (SCALES_MESSAGES: once, to the message's own row).
                msg_row = s_piece[self.ring_shape[0] + held + at]
                vec = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                for v in cutlass.range(lane, Int32(sc_hi - sc_lo) // 16, WARP):
                    cute.autovec_copy(cute.make_tensor(cute.recast_ptr(
                        (ring + at * PIECE + Int32(sc_lo - offset) + v * 16).align(16),
                        dtype=Int32), cute.make_layout(4)), vec)
                    if scale_mode == SCALES_MESSAGES:
                        self._store_scale_vector(vec, scale_rows, msg_row, scale_bytes, sc_lo,
                                                 scales_offset, v)
                    else:
                        for k in cutlass.range(topk + 1):
                            r = s_scratch[rows_at + k]
                            if r >= 0:
                                self._store_scale_vector(vec, scale_rows, r, scale_bytes, sc_lo,
                                                         scales_offset, v)
            if scale_mode != SCALES_BULK and scale_mode != SCALES_VECTORS and \
                    scale_mode != SCALES_MESSAGES and sc_hi > sc_lo:
                words = cute.make_tensor(cute.recast_ptr((ring + at * PIECE).align(16),
                                                         dtype=Int32),
                                         cute.make_layout(PIECE // 4))
                first = Int32((sc_lo - Int64(scales_offset)) // 4)  # the piece's first word
                for k in cutlass.range(topk + 1):
                    r = s_scratch[rows_at + k]
                    if r >= 0:
                        for c in cutlass.range(first + lane, Int32(sc_hi - Int64(scales_offset))
                                               // 4, WARP):
                            at_word = Int32((Int64(scales_offset) - offset) // 4) + c
                            word = self._scale_word(words[at_word], c, scale_cols)
                            if scale_mode == SCALES_LANES:
                                store_i32(scale_rows.toint() + (Int64(r) * Int64(scale_bytes)
                                                                + Int64(c) * 4), word)
                            else:
                                store_i32(self._fp8_scale_at(scales, c, r, row_capacity), word)
        return drained + 1

    @cute.jit
    def _store_scale_vector(self, vec: cute.Tensor, scale_rows: cute.Pointer, row, scale_bytes,
                            sc_lo, scales_offset, v):
        """Scale vector v (16 bytes, from the message's scale byte sc_lo on) into staged row
        `row` of `scale_rows`."""
        cute.autovec_copy(vec, cute.make_tensor(gmem_ptr(
            Int32, scale_rows.toint() + Int64(row) * Int64(scale_bytes)
            + sc_lo - Int64(scales_offset) + Int64(v) * 16, 16), cute.make_layout(4)))

    @cute.jit
    def _record(self, lane, s, first, cnt, topk, max_tokens, src_info: cute.Pointer,
                comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                s_scratch: cute.Tensor, s_wts: cute.Tensor, scratch, rows0, wts, segment_rows,
                recv_ids: cute.Pointer, recv_weights: cute.Pointer, local_base):
        """What combine needs of the batch's messages first .. first + cnt - 1 of source s (row
        and weight per k, source token), and src_info of every row they filled (message m's rows
        at word rows0 + m * ROWS of s_scratch; its weights are those of its token of the batch,
        `MAP_AT`)."""
        for i in cutlass.range(lane, cnt * topk, WARP):
            m = i // topk
            k = i - m * topk
            at = (Int64(s) * Int64(max_tokens) + Int64(first + m)) * Int64(topk) + Int64(k)
            row = s_scratch[rows0 + m * ROWS + k]
            if row < -1:
                row = -2 - row  # a row past the capacity: combine reads zeros for it
            store_i32(comb_rows.toint() + at * 4, row)
            weight = s_wts[wts + s_scratch[scratch + MAP_AT + m] * topk + k]
            if segment_rows == SOURCE_ROWS:
                # Rows by source: the message's row, with its K ids made local (-1 where the
                # expert lives elsewhere) and their weights (0 there); combine adds the row once
                # (weight 1), DeepEP's unweighted reduction.
                r = s_scratch[rows0 + m * ROWS]
                for k2 in cutlass.range(topk):
                    r = cutlass.max(r, s_scratch[rows0 + m * ROWS + k2])
                g = s_scratch[scratch + SEGS_AT + s_scratch[scratch + MAP_AT + m] * topk + k]
                local_id = Int32(-1)
                local_weight = Float32(0.0)
                if g >= 0:
                    local_id = g - local_base
                    local_weight = weight
                if r >= 0:
                    at_row = (Int64(r) * Int64(topk) + Int64(k)) * 4
                    store_i32(recv_ids.toint() + at_row, local_id)
                    store_f32(recv_weights.toint() + at_row, local_weight)
                weight = Float32(1.0)
            store_f32(comb_weights.toint() + at * 4, weight)
        if lane < cnt:
            store_i32(comb_tokens.toint()
                      + (Int64(s) * Int64(max_tokens) + Int64(first + lane)) * 4,
                      s_scratch[scratch + TOKS_AT + lane])
        for i in cutlass.range(lane, cnt * (topk + 1), WARP):
            m = i // (topk + 1)
            k = i - m * (topk + 1)
            r = s_scratch[rows0 + m * ROWS + k]
            if r >= 0:
                slot = Int32(-1)
                if k < topk:
                    slot = k
                store_i32(src_info.toint() + Int64(r) * 8, s_scratch[scratch + TOKS_AT + m])
                store_i32(src_info.toint() + Int64(r) * 8 + 4, slot)

    @cute.jit
    def _load_scales(self, lane, msg, scales_offset, words, scale_cols):
        """A message's scale words lane, lane + 32, ... (the first SCALE_REGS of each lane) into
        registers, loaded before any of the message's stores so that they travel with its
        payload's loads (NVFP4: a last partial word's padding bytes cleared)."""
        sregs = cute.make_rmem_tensor(cute.make_layout(SCALE_REGS), Int32)
        src = cute.make_tensor(gmem_ptr(Int32, msg + Int64(scales_offset), 16),
                               cute.make_layout(words))
        for q in cutlass.range_constexpr(SCALE_REGS):
            c = lane + q * WARP
            word = Int32(0)
            if c < words:
                word = self._scale_word(src[c], c, scale_cols)
            sregs[q] = word
        return sregs

    @cute.jit
    def _store_scales(self, lane, msg, sregs: cute.Tensor, scales: cute.Pointer,
                      scale_rows: cute.Pointer, segment_rows, scales_offset, row_capacity, topk,
                      words, scale_cols, rk, s_scratch: cute.Tensor, rows_at, srows_at):
        """A message's scales into every row it filled: the words `_load_scales` holds, then any
        beyond them, loaded here. Packed rows: into `scale_rows` (row r's words contiguous),
        from which the dispatch's end writes the output's layout; slabs: straight into the
        output (fp8: transposed [H / 128, rows])."""
        src = cute.make_tensor(gmem_ptr(Int32, msg + Int64(scales_offset), 16),
                               cute.make_layout(words))
        for k in cutlass.range(topk + 1):
            r = s_scratch[rows_at + k]
            if r >= 0:
                for q in cutlass.range_constexpr(SCALE_REGS):
                    c = lane + q * WARP
                    if c < words:
                        self._store_scale(scales, scale_rows, segment_rows, c, sregs[q], r,
                                          s_scratch[srows_at + k], row_capacity, rk, words)
                for c in cutlass.range(lane + SCALE_REGS * WARP, words, WARP):
                    self._store_scale(scales, scale_rows, segment_rows, c,
                                      self._scale_word(src[c], c, scale_cols), r,
                                      s_scratch[srows_at + k], row_capacity, rk, words)

    @cute.jit
    def _store_scale(self, scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows, c, word,
                     row, scale_row, row_capacity, rk, words):
        """Scale word c of a row: packed, word c of row `row` of `scale_rows`; slabs (FP8 only),
        block c's fp32 scale of row `row` in the transposed output."""
        if segment_rows <= 0:
            store_i32(scale_rows.toint() + Int64(scale_rows_layout(words, row_capacity)(
                (Int64(c), Int64(row)))) * 4, word)
        else:
            if cutlass.const_expr(self.fmt == "fp8"):
                store_i32(self._fp8_scale_at(scales, c, row, row_capacity), word)

    @cute.jit
    def _fp8_scale_at(self, scales: cute.Pointer, c, row, row_capacity):
        """The address of block c's fp32 scale of row `row` in FP8's transposed output scales
        ([H / 128, row_capacity])."""
        return scales.toint() + (Int64(c) * Int64(row_capacity) + Int64(row)) * 4

    @cute.jit
    def _direct_scales(self, s_off: cute.Tensor, segments):
        """Whether this dispatch's FP8 packed rows take their scales straight into the output
        (at most DIRECT_SCALE_ROWS rows in all, read from the row layout every CTA derives
        alike): the same answer in every receiver and at the kernel's end."""
        direct = False
        if cutlass.const_expr(self.fmt == "fp8"):
            direct = s_off[segments] <= DIRECT_SCALE_ROWS
        return direct

    @cute.jit
    def _zero_row_padding(self, warp_id, warps, lane, tokens: cute.Pointer,
                          scales: cute.Pointer, scale_rows: cute.Pointer,
                          src_info: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                          segments, payload_bytes, blocks, row_capacity):
        """FP8: zero the alignment rows after each segment's rows (payload words, their scales in
        `scale_rows`, or in the output where the rows' scales go there (`_direct_scales`),
        src_info -1): warp `warp_id` of `warps` (every channel's receivers) takes segments
        warp_id, warp_id + warps, ..., its lanes the segment's padding words."""
        direct = self._direct_scales(s_off, segments)
        vectors = Int32(payload_bytes // 16)  # FP8 payload rows are whole 16-byte vectors
        zeros = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        zeros.fill(0)
        for g in cutlass.range(warp_id, segments, warps):
            pad_begin = s_off[g] + s_raw[g]
            pad_rows = s_off[g + 1] - pad_begin
            for i in cutlass.range(lane, pad_rows * vectors, WARP):
                cute.autovec_copy(zeros, cute.make_tensor(gmem_ptr(
                    Int32, tokens.toint() + Int64(pad_begin) * payload_bytes + Int64(i) * 16, 16),
                    cute.make_layout(4)))
            for i in cutlass.range(lane, pad_rows * blocks, WARP):
                if direct:
                    store_i32(self._fp8_scale_at(scales, i % blocks, pad_begin + i // blocks,
                                                 row_capacity), Int32(0))
                else:
                    store_i32(scale_rows.toint() + Int64(scale_rows_layout(blocks, row_capacity)(
                        (Int64(i % blocks), Int64(pad_begin + i // blocks)))) * 4, Int32(0))
            for i in cutlass.range(lane, pad_rows * 2, WARP):
                store_i32(src_info.toint() + Int64(pad_begin) * 8 + Int64(i) * 4, Int32(-1))
