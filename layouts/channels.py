"""Transport v2's geometry: chunked channels reused as rings, sized by the chunk geometry and not
by `max_tokens_per_rank`.

A layer runs on `channels` persistent CTAs per rank (the SM budget). Channel c of a source owns
a contiguous run of that source's tokens and moves them in **batches** of STAGE_BATCH_TOKENS. It
**stages** each batch once in the source's own peer-visible memory: the tokens' messages (payload
and scales) in `staging_layout`'s slots, and one **batch header** (every token's K expert ids, K
weights and source index, `batch_header_layout`) in `headers_layout`; both are rings of
`stage_batches` batches per channel. Every destination reads each batch's header over NVLink,
keeps the tokens that route to it, pulls their payloads from the staging and stores them
straight into its expert rows: each token crosses NVLink once per destination rank that hosts one
of its experts, and the source's SMs write it once (locally), whatever the number of
destinations. The source does no per-destination work per token.

The source publishes progress in each destination's `tails[c, source]` (batches staged,
counted across rounds, so nothing is reset between layers); the destination returns credit in
the source's `heads[c, destination]` (batches it is done with). A source restages a batch slot
only when every destination has returned credit for the batch it held, so the staging is reused
as many times as the round needs. Combine sends expert outputs back through rings (`ring_layout`)
of bf16 rows, `ring_chunks` chunks of `chunk_tokens` slots per (channel, source), in the order
dispatch delivered the messages (a weighted combine one row per message, an unreduced one a row
per expert of the message that lives there), so it needs no counts of its own.

Before any message, each channel tells every destination what it will send this round: the
`counts` entries (COUNT_MESSAGES, COUNT_TOKENS: the channel's tokens, so its batches; from
COUNT_SEGMENTS the rows for each segment) of (channel, source) under the round's parity, raised by
`count_flags` to the round's epoch. A destination places rows only once it holds every (channel,
source)'s counts, so its expert-grouped row order is fixed before the data arrives and each
message lands in its rows as it comes. A dispatch of at most PREFIXED_TOKENS tokens a rank (a
decode step's) sends each entry in three kinds (COUNT_KINDS): the channel's own, the sum over
the source's channels before it and over all of them (every channel routes all of its rank's
tokens to know them), so a receiving channel reads its own (channel, source) words only instead
of summing every channel's. A larger dispatch over at least BLOCK_PREFIX_CHANNELS channels sends
block-prefixed counts: the channels go in blocks of COUNT_BLOCK (`count_block`), each channel
routes the tokens of its block, and its entries' COUNT_BEFORE and COUNT_ALL kinds are the sums
over its block's channels before it and over its whole block; a receiving channel then reads
its own words and one channel's COUNT_ALL a block instead of every channel's.

Every function of a layout here also takes DSL integers, so a kernel evaluates the same layout.

Peer-visible bytes per rank = channels x (stage batches x (BATCH x staged message + header) +
ranks x ring slots x combine row) + counts + counters, independent of how many tokens a rank
holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up
from layouts.config import EPConfig
from layouts.formats import ALIGN, METADATA_FIELDS

DEFAULT_CHANNELS = 24  # the SM budget engines give communication (see cute_ep.ep)
COUNTER_BYTES = 8  # a 64-bit message count, written with a release store
PARITIES = 2  # counts of round n and n + 1 live side by side (see `counts_layout`)
DISPATCH, COMBINE = 0, 1  # the phase mode of `counters_layout`
TAILS, HEADS = 0, 1  # the kind mode of `counters_layout`
# The parts of a dispatch a launch runs (its `phases` bits): counts and send, receive (rows, the
# round's advance, the scales' write-out). One launch runs both; a dispatch with a receive hook
# runs them in two.
DISPATCH_SEND, DISPATCH_RECEIVE = 1, 2
# Tokens a dispatch channel stages together (a batch): one header, tails and credit per batch,
# staging slots reused a whole batch at a time.
STAGE_BATCH_TOKENS = 16
# The counts entries of (channel, source): its messages to this rank, its tokens this round (so
# its batches), then one per segment (the rows it fills there).
COUNT_MESSAGES, COUNT_TOKENS, COUNT_SEGMENTS = 0, 1, 2
# The kinds of a counts entry: the (channel, source)'s own count; with prefixed counts also the
# sum over the source's channels before it and over all its channels.
COUNT_OWN, COUNT_BEFORE, COUNT_ALL = 0, 1, 2
COUNT_KINDS = 3
# The kinds of counts a dispatch sends (its `prefixed` argument): each channel's own only,
# prefixed over all of the rank's channels (a decode step's), prefixed within blocks of
# COUNT_BLOCK channels (`count_block`).
PREFIX_NONE, PREFIX_ALL, PREFIX_BLOCKS = 0, 1, 2
PREFIX_NAMES = ("", ", prefixed counts", ", block-prefixed counts")
# Channels a block of block-prefixed counts groups: each channel routes its block's tokens (8 x
# its own), and a receiving channel reads one COUNT_ALL word a block.
COUNT_BLOCK = 8
# A count flag holds the round's epoch, the kind of its counts and, below it, the channels its
# source used: at most this many (`count_flag`).
MAX_CHANNELS = 255
FLAG_PREFIXED = MAX_CHANNELS + 1
FLAG_ROUND = len(PREFIX_NAMES) * FLAG_PREFIXED


def count_flag(epoch: int, channels: int, prefixed: int) -> int:
    """The count flag a source raises for round `epoch` of a dispatch over `channels` channels
    with counts of kind `prefixed` (PREFIX_NONE, PREFIX_ALL, PREFIX_BLOCKS; `counts_layout`)."""
    return epoch * FLAG_ROUND + FLAG_PREFIXED * int(prefixed) + channels


def read_count_flag(word: int) -> str:
    """A count flag in words: "round 3, 24 channels" (", prefixed counts" or ", block-prefixed
    counts" where they are), or "none" for a flag never raised."""
    if word == 0:
        return "none"
    epoch, rest = divmod(word, FLAG_ROUND)
    prefixed, channels = divmod(rest, FLAG_PREFIXED)
    return f"round {epoch}, {channels} channels" + PREFIX_NAMES[prefixed]


def count_block(channel):
    """The first channel of channel `channel`'s block of block-prefixed counts: COUNT_BLOCK
    channels a block (over `active` channels the last block holds the rest)."""
    return channel // COUNT_BLOCK * COUNT_BLOCK


def count_blocks(active):
    """The blocks of block-prefixed counts over `active` channels (the last may be partial)."""
    return (active + COUNT_BLOCK - 1) // COUNT_BLOCK


def ring_layout(item_bytes, slots, channels, ranks) -> Layout:
    """(byte, slot, channel, peer rank) -> byte offset of a set of rings: one ring of `slots`
    items per (channel, peer)."""
    return Layout((item_bytes, slots, channels, ranks),
                  (1, item_bytes, item_bytes * slots, item_bytes * slots * channels))


def staging_layout(item_bytes, slots, channels) -> Layout:
    """(byte, slot, channel) -> byte offset of a rank's staged messages: `slots` per channel."""
    return Layout((item_bytes, slots, channels), (1, item_bytes, item_bytes * slots))


def batch_header_layout(topk) -> Layout:
    """(k, field, token of the batch) -> int32 word of a batch header: the K values of each
    METADATA_FIELDS field (expert ids, router weights) of every token, a field's words of the
    batch contiguous (token-major, as in `topk_ids`). The tokens' source indices follow at
    `header_token_word`."""
    return Layout((topk, len(METADATA_FIELDS), STAGE_BATCH_TOKENS),
                  (1, STAGE_BATCH_TOKENS * topk, topk))


def header_token_word(topk, b):
    """Word of a batch header holding the source index of the batch's token b (with DIRECT_BIT
    where its payload was not staged)."""
    return len(METADATA_FIELDS) * STAGE_BATCH_TOKENS * topk + b


# A token word's top bit (int32): the token's payload stays in its source's direct input (the
# Buffer's `input` part, row = the index), not in the staging.
DIRECT_BIT = -(1 << 31)


def header_bytes(topk: int) -> int:
    """Bytes of one batch header, 16-byte aligned."""
    return align_up(4 * header_token_word(topk, STAGE_BATCH_TOKENS), ALIGN)


def headers_layout(item_bytes, batches, channels) -> Layout:
    """(byte, batch slot, channel) -> byte offset of a rank's batch headers: `batches` per
    channel."""
    return Layout((item_bytes, batches, channels), (1, item_bytes, item_bytes * batches))


def counts_layout(entries, channels, ranks) -> Layout:
    """(entry, kind, channel, source, parity) -> int32 word: what (channel, source) sends here
    in a round of that parity (kind COUNT_OWN, and with prefixed counts COUNT_BEFORE and
    COUNT_ALL: over the source's channels, or over its channel's block with block-prefixed
    counts). Round n + 2 reuses round n's words: a rank starts round n + 2 only after its
    round n + 1 received every source's counts, which each source sent after it had finished
    round n."""
    per_channel = entries * COUNT_KINDS
    return Layout((entries, COUNT_KINDS, channels, ranks, PARITIES),
                  (1, entries, per_channel, per_channel * channels,
                   per_channel * channels * ranks))


def count_flags_layout(channels, ranks) -> Layout:
    """(channel, source, parity) -> int64 word: the epoch (round + 1) of the counts there."""
    return Layout((channels, ranks, PARITIES), (1, channels, channels * ranks))


def counters_layout(channels, ranks) -> Layout:
    """(channel, rank, kind, phase) -> 64-bit word: kind TAILS = what source `rank` has made
    ready for this rank, kind HEADS = what destination `rank` is done with (dispatch: batches
    staged and consumed; combine: rows written and consumed); phase DISPATCH or COMBINE. The
    peer-visible counters and the local stream positions share this layout."""
    return Layout((channels, ranks, 2, 2), (1, channels, channels * ranks, 2 * channels * ranks))


def channel_messages_layout(ranks, channels) -> Layout:
    """(source, channel) -> int32 word: messages a dispatch received on that stream."""
    return Layout((ranks, channels), (1, ranks))


# What a traced dispatch records per channel (int64 each, `trace_layout`): %globaltimer at the
# kernel's start, once its tokens are routed (counted per destination), once its counts are
# sent, once every channel's counts arrived, once they are summed, once the row layout is known,
# when its receivers first saw a batch, read its first batch's header, placed that batch's rows
# and issued its pieces' row stores (fields still named `chunk_*`), when its last sender warp
# finished, when its last receiver warp had issued its rows' stores and when those were
# written, once the CTA counted itself done with the round, at the kernel's end; then, for the
# sender warp that spent the most on each, the nanoseconds it waited for staging credit, wrote batch
# headers, copied tokens, and fenced and published tails; last, the receivers' (RECV_TIMES).
SEND_TIMES = ("credit_wait_ns", "batch_ns", "copy_ns", "fence_ns")
# A receiver warp's time (the longest warp's, each part on its own): waiting for a batch's tail,
# reading a batch's header (ids, weights, tokens: over NVLink from another source) and finding
# its messages, placing them in their rows and issuing their pulls and stores, waiting for
# earlier pieces to land and be stored (bulk formats), and waiting at the end of its stream for
# the other warps of its source (bulk formats; between batches they do not wait for each other).
# Of the bulk formats' placing and draining, two waits on their own: for a piece to land from
# the source (`land_ns`) and for the stores that last read a piece to be done reading it before
# the next load into it (`free_ns`); `place_ns` and `drain_ns` are the rest.
RECV_TIMES = ("recv_wait_ns", "header_ns", "place_ns", "drain_ns", "sync_ns", "land_ns",
              "free_ns")
TRACE_FIELDS = ("start", "routed", "counts_sent", "counts_arrived", "counts_summed",
                "layout_ready", "first_batch", "chunk_read", "chunk_placed", "chunk_stored",
                "send_done", "recv_done", "rows_written",
                "round_done", "end", *SEND_TIMES, *RECV_TIMES)


# The combine's row sums walk a row a step at a time, each lane one of these many 16-byte
# vectors of it a step (kernels/combine.py builds one kernel per value).
COMBINE_VECTORS = (4, 7)


def combine_vectors(hidden: int) -> int:
    """A lane's 16-byte vectors a step of the combine's row sums over rows of `hidden` bf16
    values: the most of COMBINE_VECTORS whose steps (32 lanes' worth) cover a row exactly, so
    no step is partly idle and the fewest steps carry the loop's overhead (H 7168: 7, four
    steps); the first where none does."""
    whole = [v for v in COMBINE_VECTORS if (hidden // 8) % (32 * v) == 0]
    return max(whole) if whole else COMBINE_VECTORS[0]


# What a traced combine records per channel (int64 each): %globaltimer at the kernel's start,
# when its last sender warp and its last receiver warp finished, at the kernel's end; then the
# longest any sender warp waited for ring credit, any receiver waited for a rank's rows, and its
# receivers spent routing their chunks of tokens.
COMBINE_TRACE_FIELDS = ("start", "send_done", "recv_done", "end", "credit_wait_ns",
                        "tail_wait_ns", "route_ns")


def trace_layout(channels, fields=TRACE_FIELDS) -> Layout:
    """(field, channel) -> int64 word of a trace of `fields` (a dispatch's TRACE_FIELDS, a
    combine's COMBINE_TRACE_FIELDS)."""
    return Layout((len(fields), channels), (1, len(fields)))


def part_offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Parts of these byte sizes placed one after another: each one's offset, and the total
    ("total")."""
    offsets, at = {}, 0
    for name, nbytes in sizes.items():
        offsets[name] = at
        at += nbytes
    offsets["total"] = at
    return offsets


@dataclass(frozen=True)
class ChannelGeometry:
    cfg: EPConfig
    channels: int
    chunk_tokens: int = 8
    ring_chunks: int = 4
    stage_batches: int = 8
    # Rows of the direct input: tokens (bf16 x, or FP8 / NVFP4 codes and scales laid out as a
    # staged message) that a rank's receivers pull in place from its peer-visible memory, with
    # no staging; 0: none.
    input_rows: int = 0

    def __post_init__(self):
        for name in ("channels", "chunk_tokens", "ring_chunks", "stage_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.input_rows != 0 and (self.input_rows < 0 or self.cfg.layout == "sources" or
                                     self.input_rows > self.cfg.max_tokens_per_rank):
            raise ValueError(f"a direct input holds up to max_tokens_per_rank rows, for the "
                             f"packed or slabs layout; got {self.input_rows} rows, "
                             f"{self.cfg.layout}")
        if self.channels > MAX_CHANNELS:
            raise ValueError(f"at most {MAX_CHANNELS} channels (SMs) a Buffer, got "
                             f"{self.channels}: a count flag carries the channels its source "
                             f"used below the kind of its counts")

    @property
    def ring_slots(self) -> int:
        return self.chunk_tokens * self.ring_chunks

    @property
    def stage_slots(self) -> int:
        return STAGE_BATCH_TOKENS * self.stage_batches

    @property
    def header_bytes(self) -> int:
        return header_bytes(self.cfg.topk)

    @property
    def combine_row_bytes(self) -> int:
        return align_up(2 * self.cfg.hidden, ALIGN)

    @property
    def entries(self) -> int:
        return COUNT_SEGMENTS + self.cfg.segments

    def headers(self) -> Layout:
        """(header byte, batch slot, channel) -> byte offset in this rank's batch headers."""
        return headers_layout(self.header_bytes, self.stage_batches, self.channels)

    def staging(self) -> Layout:
        """(staged message byte, slot, channel) -> byte offset in this rank's staging."""
        return staging_layout(self.cfg.message.staged_bytes, self.stage_slots, self.channels)

    def combine_ring(self) -> Layout:
        """(row byte, slot, channel, source) -> byte offset in the combine rings."""
        return ring_layout(self.combine_row_bytes, self.ring_slots, self.channels,
                           self.cfg.ranks)

    def counts(self) -> Layout:
        return counts_layout(self.entries, self.channels, self.cfg.ranks)

    def count_flags(self) -> Layout:
        return count_flags_layout(self.channels, self.cfg.ranks)

    def counters(self) -> Layout:
        return counters_layout(self.channels, self.cfg.ranks)

    def peer_bytes(self) -> dict[str, int]:
        """Peer-visible bytes per rank, by part, in the order `peer_offsets` places them."""
        return {
            "staging": align_up(self.staging().cosize(), ALIGN),
            "batch_headers": align_up(self.headers().cosize(), ALIGN),
            "combine_rings": align_up(self.combine_ring().cosize(), ALIGN),
            "counts": align_up(self.counts().cosize() * 4, ALIGN),
            "count_flags": align_up(self.count_flags().cosize() * 8, ALIGN),
            "counters": align_up(self.counters().cosize() * COUNTER_BYTES, ALIGN),
            **({"input": align_up(self.input_rows * self.cfg.message.staged_bytes, ALIGN)}
               if self.input_rows else {}),
        }

    def peer_offsets(self) -> dict[str, int]:
        """Byte offset of each part of `peer_bytes` in the peer-visible region, and its size
        ("total")."""
        return part_offsets(self.peer_bytes())

    def token_range(self, channel: int, num_tokens: int) -> tuple[int, int]:
        """The source tokens [begin, end) channel `channel` sends: contiguous, balanced."""
        return channel_tokens(channel, num_tokens, self.channels)


# A dispatch of few tokens (decode) uses one channel per this many, up to the budget: a channel
# quantizes, sends and stores its tokens' rows on one SM, so decode wants every channel it can
# fill, and with prefixed counts more channels cost no channel more counts to read. 128 tokens a
# rank on 2 x H100 over every SM (FP8 from bf16, DeepEP's kernel-time method, 2026-11-27): 29.2
# us at one token a channel, 33.2 at two (before prefixed counts, four a channel on 48 SMs: 38.6).
TOKENS_PER_CHANNEL = 1
# A dispatch of at most this many tokens a rank (num_input_tokens, else max_tokens_per_rank) sends
# prefixed counts (`counts_layout`): each of its channels routes every token of the rank (at
# most 2 a thread at top-8), where summing the counts of every channel cost each receiving
# channel a chain of loads per channel.
PREFIXED_TOKENS = 256
# A larger dispatch over at least this many channels sends block-prefixed counts: summing every
# channel's counts took a receiving channel 17-20 us over 132 channels on 4 x H200 (5-7 over 24),
# where routing all of the rank's tokens in every channel cost 10-28 us more
# (ab-2026-11-28-4xH200-prefixed-prefill.json); a block's tokens are 8 channels' worth.
BLOCK_PREFIX_CHANNELS = 48


def token_bound(max_tokens: int, num_input_tokens: int | None) -> int:
    """The bound on a dispatch's tokens a rank that every rank agrees on: `num_input_tokens`,
    else the layer's `max_tokens`."""
    return int(max_tokens if num_input_tokens is None else num_input_tokens)


def active_channels(channels: int, max_tokens: int, num_input_tokens: int | None) -> int:
    """The channels a dispatch (and its combine) split each rank's tokens over: all `channels`
    of the budget, or for a small bound on the tokens (`num_input_tokens`, the same on every
    rank) one per TOKENS_PER_CHANNEL tokens, so fewer CTAs run, wait and count."""
    bound = token_bound(max_tokens, num_input_tokens)
    return min(channels, max(1, -(-bound // TOKENS_PER_CHANNEL)))


def prefixed_counts(max_tokens: int, num_input_tokens: int | None, active: int) -> int:
    """The kind of counts a dispatch of that bound over `active` channels sends
    (`counts_layout`): PREFIX_ALL for at most PREFIXED_TOKENS tokens a rank, else PREFIX_BLOCKS
    over at least BLOCK_PREFIX_CHANNELS channels, else PREFIX_NONE."""
    if token_bound(max_tokens, num_input_tokens) <= PREFIXED_TOKENS:
        return PREFIX_ALL
    return PREFIX_BLOCKS if active >= BLOCK_PREFIX_CHANNELS else PREFIX_NONE


def channel_tokens(channel: int, num_tokens: int, channels: int) -> tuple[int, int]:
    """[begin, end) of the contiguous, balanced run of tokens channel `channel` owns: the first
    `num_tokens % channels` channels hold one token more."""
    per, extra = divmod(num_tokens, channels)
    begin = channel * per + min(channel, extra)
    return begin, begin + per + int(channel < extra)
