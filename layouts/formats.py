"""Token formats and the byte layout of one token message.

A message is `[payload][scales][metadata]`, each segment starting on a 16-byte boundary and the
whole message a multiple of 16 bytes, so every segment moves with 128-bit accesses. Metadata is
what a receiver needs to place and later return the token: its index on the source rank, its K
expert ids and its K router weights. (Its rows need no more: a receiver takes a channel's
messages in source-token order, `layouts.channels`.)

Each segment is a layout from (byte within element, element) to the byte offset in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up

ALIGN = 16
# The per-k metadata fields of a message, in order; each is K 32-bit words.
METADATA_FIELDS = ("expert_ids", "weights")


@dataclass(frozen=True)
class TokenFormat:
    name: str
    payload_bits: int  # bits per hidden element on the wire
    block: int  # elements per scale (1: no scales)
    scale_bytes: int  # bytes per scale
    description: str

    def validate_hidden(self, hidden: int) -> None:
        if hidden <= 0:
            raise ValueError(f"hidden size must be positive, got {hidden}")
        if self.block > 1 and hidden % self.block:
            raise ValueError(f"{self.name}: hidden size {hidden} must be a multiple of the "
                             f"{self.block}-element scale block")
        if (hidden * self.payload_bits) % 8:
            raise ValueError(f"{self.name}: hidden size {hidden} must be even (two 4-bit codes "
                             f"per byte)")

    def payload_bytes(self, hidden: int) -> int:
        return hidden * self.payload_bits // 8

    def scales_per_token(self, hidden: int) -> int:
        return hidden // self.block if self.block > 1 else 0


FORMATS = {
    f.name: f
    for f in (
        TokenFormat("bf16", 16, 1, 0, "bf16 payload, no scales"),
        TokenFormat("fp8", 8, 128, 4, "e4m3 payload, fp32 scale per 128 elements (DeepSeek)"),
        TokenFormat("nvfp4", 4, 16, 1, "e2m1 payload (element 2i in the low nibble), e4m3 scale "
                    "per 16 elements"),
        TokenFormat("mxfp4", 4, 32, 1, "e2m1 payload, e8m0 scale per 32 elements"),
    )
}


def token_format(name: str) -> TokenFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown token format {name!r}; one of {sorted(FORMATS)}") from None


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int  # byte offset of the segment in the message
    elements: int
    element_bytes: int

    @property
    def layout(self) -> Layout:
        """(byte within element, element) -> byte offset in the message."""
        return Layout((self.element_bytes, self.elements), (1, self.element_bytes))

    @property
    def nbytes(self) -> int:
        return self.elements * self.element_bytes

    def byte_offset(self, element: int, byte: int = 0) -> int:
        return self.offset + self.layout((byte, element))

    @property
    def element_offset(self) -> int:
        """Where the segment starts, counted in its own elements (a kernel views the message as
        an array of this element type and indexes it from here)."""
        if self.offset % self.element_bytes:
            raise ValueError(f"{self.name} at byte {self.offset} is not aligned to its "
                             f"{self.element_bytes}-byte elements")
        return self.offset // self.element_bytes

    @property
    def element_layout(self) -> Layout:
        """(element) -> element offset from the segment's start."""
        return Layout(self.elements, 1)


@dataclass(frozen=True)
class MessageLayout:
    format: TokenFormat
    hidden: int
    topk: int
    segments: tuple[Segment, ...]
    size: int  # bytes, a multiple of ALIGN

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def metadata(self) -> Layout:
        """(k, field) -> 32-bit word of the message, for the per-k fields METADATA_FIELDS (expert
        id, router weight); the source token index is word `metadata_base - 1`."""
        return metadata_layout(self.topk)

    @property
    def staged_bytes(self) -> int:
        """Bytes of the message a source stages for its destinations to read: payload and
        scales (the metadata travels in the batch's header, `layouts.channels`)."""
        return self.segment("src_token").offset

    @property
    def metadata_base(self) -> int:
        """Word of the message where `metadata`'s (0, 0) lies."""
        return self.segment(METADATA_FIELDS[0]).element_offset


def metadata_layout(topk) -> Layout:
    """(k, field) -> 32-bit word from a message's first per-k field (METADATA_FIELDS packed one
    after another); `topk` may be a DSL integer."""
    return Layout((topk, len(METADATA_FIELDS)), (1, topk))


def message_layout(fmt: TokenFormat | str, hidden: int, topk: int) -> MessageLayout:
    fmt = token_format(fmt) if isinstance(fmt, str) else fmt
    fmt.validate_hidden(hidden)
    if topk < 1:
        raise ValueError(f"top-k must be at least 1, got {topk}")
    segments = []
    offset = 0

    def add(name, elements, element_bytes, aligned=True):
        nonlocal offset
        start = align_up(offset, ALIGN) if aligned else offset
        segments.append(Segment(name, start, elements, element_bytes))
        offset = start + elements * element_bytes

    payload = fmt.payload_bytes(hidden)
    if fmt.payload_bits >= 8:
        add("payload", hidden, fmt.payload_bits // 8)
    else:  # sub-byte codes: the payload is a byte array
        add("payload", payload, 1)
    if fmt.block > 1:
        add("scales", fmt.scales_per_token(hidden), fmt.scale_bytes)
    # Metadata: one 16-byte-aligned run, the fields packed.
    add("src_token", 1, 4)
    for name in METADATA_FIELDS:
        add(name, topk, 4, aligned=False)
    return MessageLayout(fmt, hidden, topk, tuple(segments), align_up(offset, ALIGN))
