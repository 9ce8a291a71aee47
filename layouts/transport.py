"""The mailbox a peer exchange writes into: arrival flags, then one slot per source rank.

`(flags: uint64[R] padded to 16 bytes)(slots: (slot byte, source rank))`. A source writes its
payload into slot [source] of every destination's mailbox, then raises flag [source] there.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up

FLAG_BYTES = 8


@dataclass(frozen=True)
class Mailbox:
    ranks: int
    slot_bytes: int

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {self.ranks}")
        if self.slot_bytes < 0 or self.slot_bytes % 16:
            raise ValueError(f"slot bytes must be a non-negative multiple of 16, got "
                             f"{self.slot_bytes}")

    @property
    def flags(self) -> Layout:
        """(source rank) -> byte offset of its arrival flag."""
        return Layout(self.ranks, FLAG_BYTES)

    @property
    def slots_offset(self) -> int:
        return align_up(self.ranks * FLAG_BYTES, 16)

    @property
    def slots(self) -> Layout:
        """(byte, source rank) -> byte offset, relative to `slots_offset`."""
        return Layout((self.slot_bytes, self.ranks), (1, self.slot_bytes))

    @property
    def nbytes(self) -> int:
        return self.slots_offset + self.slots.size()


def bulk_chunks(chunk_bytes: int, chunks, ranks) -> Layout:
    """(byte, chunk, rank) -> byte offset of a buffer cut into `chunks` chunks per rank, each rank's
    chunks contiguous: the sender's source (rank = destination) and the receiver's slots
    (rank = source) of a chunked all-to-all. `chunks` and `ranks` may be DSL integers."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk bytes must be a positive multiple of 16, got {chunk_bytes}")
    return Layout((chunk_bytes, chunks, ranks), (1, chunk_bytes, chunk_bytes * chunks))
