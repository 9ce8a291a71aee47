"""Transport v2's geometry: chunked channels reused as rings, sized by the chunk geometry and not
by `max_tokens_per_rank`.

A layer runs on `channels` persistent CTAs per rank (the SM budget). Channel c of a source owns
a contiguous run of that source's tokens and streams their messages to every destination rank
into that destination's ring (c, source): `ring_chunks` chunks of `chunk_tokens` message slots.
The source publishes progress in the destination's `tails[c, source]` (messages written, counted
across rounds, so nothing is reset between layers); the destination's receiver returns credit in
the source's `heads[c, destination]` (messages consumed). A sender may write message m of a
channel only when m - head < ring slots, so the ring is reused as many times as the round needs.
Combine sends expert outputs back through rings of bf16 rows of the same shape.

Peer-visible bytes per rank = channels x ranks x ring slots x (message + combine row) + counters,
independent of how many tokens a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up
from layouts.buffers import EPConfig
from layouts.formats import ALIGN

COUNTER_BYTES = 8  # a 64-bit message count, written with a release store


@dataclass(frozen=True)
class ChannelGeometry:
    cfg: EPConfig
    channels: int
    chunk_tokens: int = 8
    ring_chunks: int = 4

    def __post_init__(self):
        for name in ("channels", "chunk_tokens", "ring_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def ring_slots(self) -> int:
        return self.chunk_tokens * self.ring_chunks

    @property
    def combine_row_bytes(self) -> int:
        return align_up(2 * self.cfg.hidden, ALIGN)

    def dispatch_ring(self) -> Layout:
        """(message byte, slot, channel, source) -> byte offset in the dispatch rings."""
        msg, slots = self.cfg.message.size, self.ring_slots
        return Layout((msg, slots, self.channels, self.cfg.ranks),
                      (1, msg, msg * slots, msg * slots * self.channels))

    def combine_ring(self) -> Layout:
        """(row byte, slot, channel, source) -> byte offset in the combine rings."""
        row, slots = self.combine_row_bytes, self.ring_slots
        return Layout((row, slots, self.channels, self.cfg.ranks),
                      (1, row, row * slots, row * slots * self.channels))

    def counters(self) -> Layout:
        """(channel, rank, kind, phase) -> 64-bit word: kind 0 = tails written into this rank by
        source `rank`, kind 1 = heads returned to this rank by destination `rank`; phase 0
        dispatch, 1 combine."""
        c, r = self.channels, self.cfg.ranks
        return Layout((c, r, 2, 2), (1, c, c * r, 2 * c * r))

    def peer_bytes(self) -> dict[str, int]:
        """Peer-visible bytes per rank, by part."""
        return {
            "dispatch_rings": align_up(self.dispatch_ring().cosize(), ALIGN),
            "combine_rings": align_up(self.combine_ring().cosize(), ALIGN),
            "counters": align_up(self.counters().cosize() * COUNTER_BYTES, ALIGN),
        }

    def token_range(self, channel: int, num_tokens: int) -> tuple[int, int]:
        """The source tokens [begin, end) channel `channel` sends: contiguous, balanced."""
        per, extra = divmod(num_tokens, self.channels)
        begin = channel * per + min(channel, extra)
        return begin, begin + per + (channel < extra)
