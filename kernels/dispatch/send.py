"""Phase 2 of `ep_dispatch`, send: the sender warps stage the channel's tokens batch by batch in
this rank's own peer-visible staging (header and messages), wait for every destination's credit
before reusing a batch slot, and publish each batch in every destination's `tails`."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from kernels.bulk_copy import bulk_prefetch_l2
from kernels.copy import row_predicate
from kernels.dispatch.common import (BATCH, FP8_BLOCK, IDS, MAX_RANKS, NVFP4_BLOCK, SCALE_REGS,
                                     SEND_WARPS, WARP, WEIGHTS, _await_credit, _stamp_max)
from kernels.memory import gmem_ptr, load_f32, load_i32, store_i32
from kernels.routing import load_id
from layouts.channels import (DIRECT_BIT, DISPATCH, SEND_TIMES, TAILS, batch_header_layout,
                              header_token_word, headers_layout, staging_layout)


class SendPhase:
    """The sender warps."""

    @cute.jit
    def _send(self, sw, lane, channel, t0, t1, peers: cute.Tensor, here, source: cute.Pointer,
              scale_source: cute.Pointer, scale_stride, topk_ids: cute.Pointer, id_words,
              topk_weights: cute.Pointer, streams: cute.Pointer, error: cute.Pointer, topk,
              ranks, my_rank, has_weights, header_bytes, source_stride, load_bytes, stage_bytes,
              stage_batches, channels, headers_offset, staging_offset, counters_offset,
              counters, timeout_ns, payload_vectors, scales_offset, send_copy: cute.TiledCopy,
              s_arrive: cute.Tensor, s_head: cute.Tensor, s_time: cute.Tensor,
              trace: cute.Pointer, tracing, direct):
        """Sender warp `sw`: every batch of the channel's tokens into the next batch slot of this
        rank's staging, this warp's share of its header words and its tokens b = sw,
        sw + SEND_WARPS, ...; the last warp done with a batch publishes it. `direct`: the
        tokens stay in the Buffer's input part, where the receivers pull them: the header's
        token words carry DIRECT_BIT and no payload is staged."""
        stage = staging_layout(stage_bytes, stage_batches * BATCH, channels)
        headers = headers_layout(header_bytes, stage_batches, channels)
        hdr = batch_header_layout(topk)
        credit_at = here + counters_offset  # destinations' credit lands in these counters
        mine = sw * MAX_RANKS  # this warp's words of the per-destination arrays
        times = sw * len(SEND_TIMES)
        # Batches this channel staged in earlier rounds (the same count for every destination).
        position = cute.arch.load(gmem_ptr(
            Int64, streams.toint() + Int64(counters((channel, 0, TAILS, DISPATCH))) * 8, 8), Int64)
        if lane < ranks:
            s_head[mine + lane] = Int64(-1)  # nothing seen yet: the first wait reads it
        if lane < len(SEND_TIMES):
            s_time[times + lane] = Int64(0)
        alive = Int32(1)
        cute.arch.sync_warp()
        # The message bytes a sender moves (payload and scales) as rows of 16-byte vectors, in
        # tiles of SEND_VECTORS[format] vectors per lane.
        load_vectors = load_bytes // 16
        layout = cute.make_layout((load_vectors, 16), stride=(16, 1))
        tiler = (WARP * self.send_vectors, 16)
        g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = send_copy.get_slice(lane)
        tiles = cute.ceil_div(load_vectors, WARP * self.send_vectors)
        batches = (t1 - t0 + BATCH - 1) // BATCH
        for i in cutlass.range(batches):
            at = position + Int64(i)  # the batch's place in the channel's stream
            slot = Int32(at % Int64(stage_batches))
            batch = t0 + i * BATCH
            n = cutlass.min(Int32(BATCH), t1 - batch)
            # This warp's tokens of the batch (lane j: token sw + j * SEND_WARPS) are brought
            # into L2 while it waits for credit: each token's loads below then cost an L2 hit,
            # not a trip to HBM that the warp would wait for one token after another.
            if alive != 0 and direct == 0:
                self._prefetch_token(sw + lane * SEND_WARPS, n, batch, source, source_stride,
                                     load_bytes, scale_source, scale_stride, payload_vectors)
            start = Int64(0)
            if tracing != 0:
                start = cute.arch.globaltimer()
            # The slot is free once every destination is done with the batch it held.
            ok = Int32(1)
            if lane < ranks and alive != 0:
                ok = _await_credit(credit_at, counters, channel, lane,
                                   at - Int64(stage_batches) + 1, s_head, mine + lane, timeout_ns,
                                   error)
            if cute.arch.vote_ballot_sync(ok == 0) != 0:
                alive = Int32(0)
            if tracing != 0 and lane == 0:
                s_time[times] += cute.arch.globaltimer() - start
                start = cute.arch.globaltimer()
            if alive != 0:
                # The header: ids and weights as [n, K] words, as in topk_ids (this warp's
                # share), then the tokens' indices.
                head = cute.make_tensor(gmem_ptr(Int32, here + headers_offset + Int64(
                    headers((0, slot, channel))), 16), cute.make_layout(
                    header_token_word(topk, BATCH)))
                head_f = cute.make_tensor(gmem_ptr(Float32, head.iterator.toint(), 16),
                                          cute.make_layout(header_token_word(topk, BATCH)))
                for w in cutlass.range(sw * WARP + lane, n * topk, SEND_WARPS * WARP):
                    b = w // topk
                    k = w - b * topk
                    from_at = Int64(batch) * Int64(topk) + Int64(w)
                    head[hdr((k, IDS, b))] = load_id(topk_ids.toint(), from_at, id_words)
                    weight = Float32(0.0)
                    if has_weights != 0:
                        weight = load_f32(topk_weights.toint() + from_at * 4)
                    head_f[hdr((k, WEIGHTS, b))] = weight
                if sw == SEND_WARPS - 1 and lane < n:
                    word = batch + lane
                    if direct != 0:
                        word = word | DIRECT_BIT
                    head[header_token_word(topk, lane)] = word
                if tracing != 0 and lane == 0:
                    s_time[times + 1] += cute.arch.globaltimer() - start
                    start = cute.arch.globaltimer()
                staged = n
                if direct != 0:
                    staged = Int32(0)
                for b in cutlass.range(sw, staged, SEND_WARPS):
                    tok = batch + b
                    staged_at = here + staging_offset + Int64(stage((0, slot * BATCH + b,
                                                                     channel)))
                    g_src = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                        Uint8, source.toint() + Int64(tok) * Int64(source_stride), 16),
                        layout), tiler)
                    g_dst = cute.zipped_divide(cute.make_tensor(
                        gmem_ptr(Uint8, staged_at, 16), layout), tiler)
                    for tile in cutlass.range(tiles):
                        pred = row_predicate(thr.partition_S(g_crd[((None, None), tile)]),
                                             load_vectors)
                        t_src = thr.partition_S(g_src[((None, None), tile)])
                        regs = cute.make_fragment_like(t_src)
                        cute.copy(send_copy, t_src, regs, pred=pred)
                        cute.copy(send_copy, regs, thr.partition_D(g_dst[((None, None), tile)]),
                                  pred=pred)
                    # The scales from their own rows (the payload above is the codes alone):
                    # always for FP8, for NVFP4 when the caller quantized (scale_stride != 0).
                    if cutlass.const_expr(self.fmt == "fp8"):
                        self._copy_scale_row(lane, scale_source, tok, scale_stride, staged_at,
                                             scales_offset, payload_vectors)
                    if cutlass.const_expr(self.fmt == "nvfp4"):
                        if scale_stride != 0:
                            self._copy_scale_row(lane, scale_source, tok, scale_stride,
                                                 staged_at, scales_offset, payload_vectors)
                if tracing != 0 and lane == 0:
                    s_time[times + 2] += cute.arch.globaltimer() - start
            # This warp's share of the batch is written. The warp that completes the batch
            # (the last of SEND_WARPS to arrive at its slot's counter) fences once at system
            # scope, covering every warp's stores (each arrived after its own), and publishes
            # the batch to every destination. It does so before it arrives at any later batch,
            # so a later batch is published after this one: tails only grow.
            cute.arch.sync_warp()
            if alive != 0 and lane == 0:
                start = Int64(0)
                if tracing != 0:
                    start = cute.arch.globaltimer()
                old = cute.arch.atomic_add(s_arrive.iterator + slot, Int32(1), sem="acq_rel",
                                           scope="cta")
                if old == SEND_WARPS - 1:
                    # The slot's next batch starts only after every destination returned credit
                    # for this one, so the counter is reset before anyone arrives there again.
                    s_arrive[slot] = Int32(0)
                    cute.arch.fence_acq_rel_sys()
                    # After the fence, strong relaxed stores are releases (PTX's release
                    # pattern): one system-scope fence a batch, not one a destination more.
                    for d in cutlass.range(ranks):
                        tail = peers[d] + counters_offset + Int64(
                            counters((channel, my_rank, TAILS, DISPATCH))) * 8
                        cute.arch.store(gmem_ptr(Int64, tail, 8), at + 1, sem="relaxed",
                                        scope="sys")
                if tracing != 0:
                    s_time[times + 3] += cute.arch.globaltimer() - start
            cute.arch.sync_warp()
        # Direct: the receivers pull the tokens from this rank's input part until they hand
        # back its last batch; this launch ends after that, so stream order keeps the input
        # unchanged while any rank reads it.
        if direct != 0 and alive != 0 and sw == 0:
            if lane < ranks:
                _await_credit(credit_at, counters, channel, lane, position + Int64(batches),
                              s_head, mine + lane, timeout_ns, error)
            cute.arch.sync_warp()
        if sw == 0 and lane == 0:
            cute.arch.store(gmem_ptr(Int64, streams.toint()
                                 + Int64(counters((channel, 0, TAILS, DISPATCH))) * 8, 8),
                            position + Int64(batches))
        if lane == 0:
            _stamp_max(trace, tracing, channel, "send_done", cute.arch.globaltimer())
            for f in cutlass.range_constexpr(len(SEND_TIMES)):
                _stamp_max(trace, tracing, channel, SEND_TIMES[f], s_time[times + f])

    @cute.jit
    def _prefetch_token(self, b, n, batch, source: cute.Pointer, source_stride, load_bytes,
                        scale_source: cute.Pointer, scale_stride, payload_vectors):
        """Token `batch + b` of the batch (if b < n): its message bytes and its scale row
        (FP8; NVFP4 when the caller quantized) prefetched into L2, where 16-byte aligned."""
        if b < n:
            tok = batch + b
            row = source.toint() + Int64(tok) * Int64(source_stride)
            nbytes = load_bytes // 16 * 16
            if nbytes > 0:
                if ((row | Int64(nbytes)) & Int64(15)) == Int64(0):
                    bulk_prefetch_l2(row, nbytes)
            if cutlass.const_expr(self.fmt != "bf16"):
                if scale_stride != 0:
                    srow = scale_source.toint() + Int64(tok) * Int64(scale_stride)
                    sbytes = self._scale_words(payload_vectors) * 4 // 16 * 16
                    if sbytes > 0:
                        if (srow & Int64(15)) == Int64(0):
                            bulk_prefetch_l2(srow, sbytes)

    def _scale_words(self, payload_vectors):
        """32-bit scale words of a message: FP8's fp32 words (H / 128), NVFP4's e4m3 bytes four
        to a word (H / 64 words)."""
        payload_bytes = payload_vectors * self.vector_bytes
        if self.fmt == "nvfp4":
            return payload_bytes * 2 // NVFP4_BLOCK // 4
        return payload_bytes // FP8_BLOCK

    @cute.jit
    def _copy_scale_row(self, lane, scale_source: cute.Pointer, tok, scale_stride, staged_at,
                        scales_offset, payload_vectors):
        """Token `tok`'s scale row into its staged message, a 32-bit word a lane: up to
        SCALE_REGS words a lane are loaded before any is stored (one load latency a row, where
        a load then a store per 32 words waited for each load in turn)."""
        words = self._scale_words(payload_vectors)
        src = scale_source.toint() + Int64(tok) * Int64(scale_stride)
        dst = staged_at + Int64(scales_offset)
        regs = cute.make_rmem_tensor(cute.make_layout(SCALE_REGS), Int32)
        for w0 in cutlass.range(0, words, WARP * SCALE_REGS):
            for q in cutlass.range_constexpr(SCALE_REGS):
                w = w0 + q * WARP + lane
                if w < words:
                    regs[q] = load_i32(src + Int64(w) * 4)
            for q in cutlass.range_constexpr(SCALE_REGS):
                w = w0 + q * WARP + lane
                if w < words:
                    store_i32(dst + Int64(w) * 4, regs[q])
