"""Phase 1 of `ep_dispatch`, counts: every channel routes its tokens, counts them per expert and
destination rank, and publishes the counts in each destination's `counts` table (raised by its
count flag); the receivers' side reads them back (`_count`, `_sum_counts`) to place rows
before any message arrives."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.dispatch.common import (COUNT_UNROLL, FLAG_ROUND, MAX_EXPERTS, MAX_RANKS, MAX_TOPK,
                                     _stamp)
from kernels.memory import error_field, gmem_ptr, load_i32, store_i32
from kernels.routing import route_token
from layouts.buffers import ERROR_COUNTS
from layouts.channels import COUNT_MESSAGES, COUNT_SEGMENTS, COUNT_TOKENS


class CountsPhase:
    """Routing, counting and the counts' exchange."""

    @cute.jit
    def _publish_counts(self, tidx, channel, t0, t1, topk_ids: cute.Pointer, topk, experts,
                        local_experts, my_rank, skip_a2a, shared, shared_begin, shared_end, ranks,
                        entries, peers: cute.Tensor, counts_offset, counts_at, flags_offset,
                        flags_at, parity, epoch, active, error: cute.Pointer, s_cnt: cute.Tensor,
                        trace: cute.Pointer, tracing):
        """All threads of the CTA: route the channel's tokens [t0, t1) (each valid (token, k)
        pair; a later k naming the same expert, or an id outside [0, E), dropped and reported),
        count them per expert and per destination rank in `s_cnt`, write this (channel, source)'s
        `counts` entries into every destination under the round's parity, then raise its count
        flag there to the round's epoch (system-scope release after a fence)."""
        msgs_at = MAX_EXPERTS  # s_cnt[msgs_at + d]: messages to d; [shared_at]: shared tokens
        shared_at = MAX_EXPERTS + MAX_RANKS
        for i in cutlass.range(tidx, MAX_EXPERTS + 2 * MAX_RANKS + 8, self.threads):
            s_cnt[i] = Int32(0)
        cute.arch.sync_threads()
        for t in cutlass.range(t0 + tidx, t1, self.threads):
            mask, bad = route_token(topk_ids, t, topk, experts, local_experts, my_rank,
                                    skip_a2a, shared, shared_begin, shared_end, s_cnt, True,
                                    MAX_TOPK)
            if bad != 0:
                cute.arch.atomic_or(error_field(error, "bad_ids"), bad, sem="relaxed",
                                    scope="gpu")
            for d in cutlass.range(ranks):
                if (mask >> d) & 1 != 0:
                    cute.arch.atomic_add(s_cnt.iterator + msgs_at + d, Int32(1))
            if shared != 0 and t >= shared_begin and t < shared_end:
                cute.arch.atomic_add(s_cnt.iterator + shared_at, Int32(1))
        cute.arch.sync_threads()
        if tidx == 0:
            _stamp(trace, tracing, channel, "routed", cute.arch.globaltimer())
        for i in cutlass.range(tidx, ranks * entries, self.threads):
            d = i // entries
            entry = i - d * entries
            value = Int32(0)
            if entry == COUNT_MESSAGES:
                value = s_cnt[msgs_at + d]
            elif entry == COUNT_TOKENS:
                value = t1 - t0
            elif shared != 0 and entry == COUNT_SEGMENTS:
                if d == my_rank:
                    value = s_cnt[shared_at]
            else:
                value = s_cnt[d * local_experts + entry - COUNT_SEGMENTS - shared]
            store_i32(peers[d] + counts_offset
                       + Int64(counts_at((entry, channel, my_rank, parity))) * 4, value)
        cute.arch.sync_threads()
        if tidx < ranks:
            cute.arch.fence_acq_rel_sys()
            flag = peers[tidx] + flags_offset + Int64(flags_at((channel, my_rank, parity))) * 8
            # The fence makes this strong relaxed store a release (PTX's release pattern); a
            # release store would fence at system scope a second time.
            cute.arch.store(gmem_ptr(Int64, flag, 8), epoch * FLAG_ROUND + Int64(active),
                            sem="relaxed", scope="sys")
        if tidx == 0:
            _stamp(trace, tracing, channel, "counts_sent", cute.arch.globaltimer())

    @cute.jit
    def _count(self, here, counts_offset, counts_at, entry, c, s, parity):
        """Entry `entry` of (channel c, source s)'s counts. A plain load: the receivers read the
        counts only after their flags' system-scope acquires (which also invalidate the SM's L1)
        and a barrier of the receiver threads, so the peers' words are visible to them."""
        return load_i32(here + counts_offset + Int64(counts_at((entry, c, s, parity))) * 4)

    @cute.jit
    def _sum_counts(self, here, counts_offset, counts_at, entry, s, parity, channel, active,
                    max_tokens, error: cute.Pointer, failed):
        """(sum over the channels before `channel`, sum over the `active` channels) of entry
        `entry` of source s's counts. A value outside [0, max_tokens] is counted 0 and reported
        unless the layer already `failed`. Unrolled by COUNT_UNROLL (32 measured slower)."""
        part = Int32(0)
        total = Int32(0)
        bad = Int32(0)
        for c in cutlass.range(active, unroll=COUNT_UNROLL):
            v = self._count(here, counts_offset, counts_at, entry, c, s, parity)
            if v < 0 or v > max_tokens:
                bad = Int32(1)
                v = Int32(0)
            if c < channel:
                part = part + v
            total = total + v
        if bad != 0 and not failed:
            cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                sem="relaxed", scope="gpu")
        return part, total
