"""Phase 1 of `ep_dispatch`, counts: every channel routes its tokens, counts them per expert and
destination rank, and publishes the counts in each destination's `counts` table (raised by its
count flag); the receivers' side reads them back (`_count`, `_sum_counts`) to place rows
before any message arrives."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.dispatch.common import (COUNT_UNROLL, COUNT_WORDS, MAX_TOPK, MSGS_AT, SHARED_AT,
                                     _stamp)
from kernels.memory import error_field, gmem_ptr, load_i32, store_i32
from kernels.routing import channel_tokens, route_token
from layouts.buffers import ERROR_COUNTS
from layouts.channels import (COUNT_ALL, COUNT_BEFORE, COUNT_KINDS, COUNT_MESSAGES, COUNT_OWN,
                              COUNT_SEGMENTS, COUNT_TOKENS, FLAG_PREFIXED, FLAG_ROUND,
                              COUNT_BLOCK, PREFIX_BLOCKS, count_block, count_blocks)


class CountsPhase:
    """Routing, counting and the counts' exchange."""

    @cute.jit
    def _publish_counts(self, tidx, channel, t0, t1, num_tokens, topk_ids: cute.Pointer,
                        id_words, topk,
                        experts, local_experts, my_rank, skip_a2a, shared, shared_begin,
                        shared_end, ranks, entries, peers: cute.Tensor, counts_offset, counts_at,
                        flags_offset, flags_at, parity, epoch, active, prefixed,
                        error: cute.Pointer, counted: cute.Tensor, trace: cute.Pointer, tracing):
        """All threads of the CTA: route the channel's tokens [t0, t1) (each valid (token, k)
        pair; a later k naming the same expert, or an id outside [0, E), dropped and reported),
        count them per expert and per destination rank in region 0 of `counted` (COUNT_WORDS
        words a region), write this (channel, source)'s `counts` entries into every destination
        under the round's parity, then raise its count flag there to the round's epoch
        (system-scope release after a fence). With prefixed counts (PREFIX_ALL) every token of
        the rank is routed, with block-prefixed ones (PREFIX_BLOCKS) every token of the
        channel's block (`layouts.channels.count_block`): those before t0 counted in region 1
        and those from t1 in region 2, and each entry goes out in its three kinds
        (`layouts.channels.counts_layout`)."""
        regions = Int32(1)
        first = t0
        last = t1
        if prefixed != 0:
            regions = Int32(COUNT_KINDS)
            first = Int32(0)
            last = num_tokens
            if prefixed == PREFIX_BLOCKS:
                block = count_block(channel)
                first, _ = channel_tokens(block, num_tokens, active)
                _, last = channel_tokens(cutlass.min(block + COUNT_BLOCK, active) - 1,
                                         num_tokens, active)
        for i in cutlass.range(tidx, regions * COUNT_WORDS, self.threads):
            counted[i] = Int32(0)
        cute.arch.sync_threads()
        for t in cutlass.range(first + tidx, last, self.threads):
            region = Int32(0)
            if t < t0:
                region = Int32(1)
            elif t >= t1:
                region = Int32(2)
            counts = cute.make_tensor(counted.iterator + region * COUNT_WORDS,
                                      cute.make_layout(COUNT_WORDS))
            mask, bad = route_token(topk_ids, id_words, t, topk, experts, local_experts,
                                    my_rank, skip_a2a, shared, shared_begin, shared_end, counts,
                                    True, MAX_TOPK)
            if bad != 0 and region == 0:
                cute.arch.atomic_or(error_field(error, "bad_ids"), bad, sem="relaxed",
                                    scope="gpu")
            for d in cutlass.range(ranks):
                if (mask >> d) & 1 != 0:
                    cute.arch.atomic_add(counts.iterator + MSGS_AT + d, Int32(1))
            if shared != 0 and t >= shared_begin and t < shared_end:
                cute.arch.atomic_add(counts.iterator + SHARED_AT, Int32(1))
        cute.arch.sync_threads()
        if tidx == 0:
            _stamp(trace, tracing, channel, "routed", cute.arch.globaltimer())
        kinds = Int32(1)
        if prefixed != 0:
            kinds = Int32(COUNT_KINDS)
        for i in cutlass.range(tidx, ranks * kinds * entries, self.threads):
            d = i // (kinds * entries)
            kind = (i - d * kinds * entries) // entries
            entry = i - (d * kinds + kind) * entries
            value = self._routed(counted, Int32(0), entry, d, t0, t1, first, last,
                                 local_experts, my_rank, shared)
            if kind == COUNT_BEFORE:
                value = self._routed(counted, Int32(1), entry, d, t0, t1, first, last,
                                     local_experts, my_rank, shared)
            elif kind == COUNT_ALL:
                value = value + self._routed(counted, Int32(1), entry, d, t0, t1, first, last,
                                             local_experts, my_rank, shared) \
                    + self._routed(counted, Int32(2), entry, d, t0, t1, first, last,
                                   local_experts, my_rank, shared)
            store_i32(peers[d] + counts_offset
                      + Int64(counts_at((entry, kind, channel, my_rank, parity))) * 4, value)
        if cutlass.const_expr(self.bulk):
            # `counted` is the receivers' ring, which their bulk copies (the async proxy) write
            # next.
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        if tidx < ranks:
            cute.arch.fence_acq_rel_sys()
            flag = peers[tidx] + flags_offset + Int64(flags_at((channel, my_rank, parity))) * 8
            # The fence makes this strong relaxed store a release (PTX's release pattern); a
            # release store would fence at system scope a second time.
            cute.arch.store(gmem_ptr(Int64, flag, 8),
                            epoch * FLAG_ROUND + Int64(active) + Int64(prefixed * FLAG_PREFIXED),
                            sem="relaxed", scope="sys")
        if tidx == 0:
            _stamp(trace, tracing, channel, "counts_sent", cute.arch.globaltimer())

    @cute.jit
    def _routed(self, counted: cute.Tensor, region, entry, d, t0, t1, first, last,
                local_experts, my_rank, shared):
        """Entry `entry` of destination d as region `region` of `counted` holds it (0: the
        channel's tokens [t0, t1), 1: the routed tokens [first, t0), 2: those of [t1, last))."""
        base = region * COUNT_WORDS
        value = Int32(0)
        if entry == COUNT_MESSAGES:
            value = counted[base + MSGS_AT + d]
        elif entry == COUNT_TOKENS:
            value = t1 - t0
            if region == 1:
                value = t0 - first
            elif region == 2:
                value = last - t1
        elif shared != 0 and entry == COUNT_SEGMENTS:
            if d == my_rank:
                value = counted[base + SHARED_AT]
        else:
            value = counted[base + d * local_experts + entry - COUNT_SEGMENTS - shared]
        return value

    @cute.jit
    def _count(self, here, counts_offset, counts_at, entry, c, s, parity,
               kind: cutlass.Constexpr = COUNT_OWN):
        """Entry `entry` of (channel c, source s)'s counts, of kind `kind`. A plain load: the
        receivers read the counts only after their flags' system-scope acquires (which also
        invalidate the SM's L1) and a barrier of the receiver threads, so the peers' words are
        visible to them."""
        return load_i32(here + counts_offset + Int64(counts_at((entry, kind, c, s, parity))) * 4)

    @cute.jit
    def _counts_before(self, here, counts_offset, counts_at, entry, s, parity, channel, active,
                       max_tokens, error: cute.Pointer, failed, prefixed):
        """(sum over the channels before `channel`, sum over the `active` channels) of entry
        `entry` of source s's counts: as s sent them (prefixed counts: two words; values outside
        0 <= before <= all <= max_tokens count 0 and are reported unless the layer already
        `failed`), else `_sum_counts`."""
        part = Int32(0)
        total = Int32(0)
        if prefixed == 0:
            part, total = self._sum_counts(here, counts_offset, counts_at, entry, s, parity,
                                           channel, active, max_tokens, error, failed)
        else:
            bad = Int32(0)
            if prefixed == PREFIX_BLOCKS:
                part, total, bad = self._sum_blocks(here, counts_offset, counts_at, entry, s,
                                                    parity, channel, active, max_tokens)
            else:
                part = self._count(here, counts_offset, counts_at, entry, channel, s, parity,
                                   COUNT_BEFORE)
                total = self._count(here, counts_offset, counts_at, entry, channel, s, parity,
                                    COUNT_ALL)
            if bad != 0 or part < 0 or part > total or total > max_tokens:
                part = Int32(0)
                total = Int32(0)
                if not failed:
                    cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                        sem="relaxed", scope="gpu")
        return part, total

    @cute.jit
    def _sum_blocks(self, here, counts_offset, counts_at, entry, s, parity, channel, active,
                    max_tokens):
        """From block-prefixed counts: (this channel's COUNT_BEFORE (the channels before it in
        its block) plus the COUNT_ALL of every block before its own, every block's COUNT_ALL in
        all (a block's read from its first channel, this channel's own block from this
        channel), whether a word read was out of range: a COUNT_ALL outside [0, max_tokens] or a
        negative COUNT_BEFORE)."""
        own = count_block(channel)
        part = self._count(here, counts_offset, counts_at, entry, channel, s, parity,
                           COUNT_BEFORE)
        blocks_before, total, bad = self._sum_over(
            here, counts_offset, counts_at, entry, s, parity, channel, own,
            count_blocks(active), COUNT_BLOCK, max_tokens, COUNT_ALL)
        if part < 0:
            bad = Int32(1)
        return part + blocks_before, total, bad

    @cute.jit
    def _sum_counts(self, here, counts_offset, counts_at, entry, s, parity, channel, active,
                    max_tokens, error: cute.Pointer, failed):
        """(sum over the channels before `channel`, sum over the `active` channels) of entry
        `entry` of source s's counts. A value outside [0, max_tokens] is counted 0 and reported
        unless the layer already `failed`."""
        part, total, bad = self._sum_over(here, counts_offset, counts_at, entry, s, parity,
                                          channel, channel, active, 1, max_tokens, COUNT_OWN)
        if bad != 0 and not failed:
            cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                sem="relaxed", scope="gpu")
        return part, total

    @cute.jit
    def _sum_over(self, here, counts_offset, counts_at, entry, s, parity, channel, own, n, step,
                  max_tokens, kind: cutlass.Constexpr):
        """(sum before `own`, sum of all, any out of range) of entry `entry` of source s's
        words of kind `kind` at channels 0, step, 2 step, ... (n of them), the one at `own` read
        from `channel` instead; a value outside [0, max_tokens] counts 0. Unrolled by
        COUNT_UNROLL (32 measured slower)."""
        part = Int32(0)
        total = Int32(0)
        bad = Int32(0)
        for i in cutlass.range(n, unroll=COUNT_UNROLL):
            first = i * step
            c = first
            if first == own:
                c = channel
            v = self._count(here, counts_offset, counts_at, entry, c, s, parity, kind)
            if v < 0 or v > max_tokens:
                bad = Int32(1)
                v = Int32(0)
            if first < own:
                part = part + v
            total = total + v
        return part, total, bad
