"""Every buffer of one expert-parallel layer, as a layout over its elements.

`EPConfig` holds the parameters (H, K, E, R, max_tokens_per_rank, format, fused shared expert)
and checks them; the functions below derive each buffer from it:

- peer-visible (read or written by other ranks over NVLink): dispatch's staging and batch
  headers, combine's rings, the counts and counters (`layouts.channels`, sized by the
  channels, not the tokens);
- local: the dispatch send buffer (fp8 / nvfp4 messages, quantized once), the dispatch round,
  the stream positions, the error record;
- dispatch outputs: expert-grouped rows, scales, row_offsets, expert_ids, src_info, counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up, flatten, make_layout
from layouts.channels import DEFAULT_CHANNELS, ChannelGeometry, channel_messages_layout
from layouts.config import EPConfig
from layouts.formats import ALIGN, token_format
from layouts.scales import scale_layout, scale_rows_capacity

# Byte size of each element type, by torch's name.
ELEMENT_BYTES = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "bfloat16": 2, "float16": 2, "int32": 4,
    "uint32": 4, "float32": 4, "int64": 8, "uint64": 8,
}
PHASES = 2  # dispatch, combine: the error record's phase is 1 + this order
# The words of the device error record, in order. bad_ids holds bits ERROR_ID_RANGE (an id
# outside [0, E) other than -1, an empty slot) and ERROR_ID_TWICE (a token listing one expert at two k).
ERROR_FIELDS = ("missing_rank", "phase", "bad_ids", "bad_counts")
ERROR_ID_RANGE, ERROR_ID_TWICE = 1, 2
# topk_ids come as int32 or int64 (torch's default integer, DeepEP's topk_idx); the kernels read
# an int64 id as its two 32-bit words, and one that int32 cannot hold as this id: out of range
# like any other (reported as ERROR_ID_RANGE, its pair dropped), never its low word.
ID_TOO_WIDE = -2
# bad_counts holds bits ERROR_COUNTS (a count outside [0, max tokens]), ERROR_CHANNELS (ranks
# split their tokens over different numbers of channels: different num_input_tokens) and
# ERROR_CAPACITY (a dispatch received more rows than its output holds: `EPConfig.recv_capacity`).
ERROR_COUNTS, ERROR_CHANNELS, ERROR_CAPACITY = 1, 2, 4
# How combine reduces a token's rows (its `weighted` argument): not at all (every (token, k)
# row comes home: [T, K, H]), on the expert side with dispatch's weights, or on the home side
# with weights given to combine (DeepEP's low-latency combine).
UNREDUCED, AT_EXPERTS, AT_HOME = 0, 1, 2


@dataclass(frozen=True)
class Buffer:
    name: str
    dtype: str
    layout: Layout  # coordinate -> element offset
    description: str

    @property
    def nbytes(self) -> int:
        return align_up(self.layout.cosize() * ELEMENT_BYTES[self.dtype], ALIGN)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of a contiguous torch tensor holding this buffer: the layout's modes
        reversed (torch's last dimension is CuTe's mode 0). Only for compact layouts."""
        if self.layout != make_layout(self.layout.shape):
            raise ValueError(f"{self.name}: {self.layout} is not compact column-major")
        return tuple(reversed(flatten(self.layout.shape)))


# Local -------------------------------------------------------------------------------------


def dispatch_send_buffer(cfg: EPConfig) -> Buffer:
    """(message byte, token): each local token's message, quantized once for every destination
    (fp8 and nvfp4; bf16 messages are built from `x` directly)."""
    msg = cfg.message.size
    return Buffer("dispatch_send", "uint8", Layout((msg, cfg.max_tokens_per_rank), (1, msg)),
                  "this rank's token messages, encoded once")


def scale_words(cfg: EPConfig) -> int:
    """32-bit scale words of one row: FP8 one fp32 per 128 elements, NVFP4 four e4m3 bytes per
    64 elements (the last word padded); 0 for bf16."""
    if cfg.format == "fp8":
        return cfg.hidden // 128
    if cfg.format == "nvfp4":
        return -(-cfg.hidden // 64)
    return 0


# The dispatch's scale write-out moves staged rows (`scale_rows_layout`) to the output's layout
# through shared-memory tiles of WIDE_TILE_ROWS rows: FP8's of WIDE_TILE_WORDS words
# (`wide_tile_word`), NVFP4's of NARROW_TILE_WORDS, two a warp (`narrow_tile_word`).
WIDE_TILE_ROWS, WIDE_TILE_WORDS = 128, 32
WIDE_TILE_CHUNKS = WIDE_TILE_WORDS // 4  # 16-byte chunks of a tile row
NARROW_TILE_WORDS = 16
NARROW_TILE_CHUNKS = NARROW_TILE_WORDS // 4


def wide_tile_word(row, chunk):
    """Word offset of 16-byte chunk `chunk` of row `row` of an FP8 write-out tile: rows of
    WIDE_TILE_WORDS words, the chunk at position chunk ^ ((row >> 2) & 7), so that the eight
    lanes of a quarter-warp reading one chunk of rows 4 l + p (eight values of (row >> 2) & 7)
    hit eight different 16-byte bank groups. Also takes DSL integers (the kernel evaluates the
    same function)."""
    return row * WIDE_TILE_WORDS + ((chunk ^ ((row >> 2) & 7)) * 4)


def narrow_tile_word(row, chunk):
    """Word offset of 16-byte chunk `chunk` of row `row` of an NVFP4 write-out tile: rows of
    NARROW_TILE_WORDS words, the chunk at chunk ^ ((row >> 1) & 3). The eight lanes of a
    quarter-warp reading one chunk of rows l .. l + 7 (lane l reads rows l + 32 p), and the
    eight writing rows 2 i, 2 i + 1 whole, hit eight different 16-byte bank groups; rows 8
    apart share the swizzle, so a lane's loads down rows l // 4 + 8 k land a constant apart.
    Also takes DSL integers."""
    return row * NARROW_TILE_WORDS + ((chunk ^ ((row >> 1) & 3)) * 4)


# FP8 packed rows, at most this many in all (a decode step's): the dispatch's receivers store
# each row's scales straight into the output's transposed [H / 128, rows], a 4-byte store a
# block, and the dispatch skips its write-out of `scale_rows` (and the grid-wide wait before
# it). More rows take the write-out, whose stores are whole lines.
DIRECT_SCALE_ROWS = 2048


def scale_rows_layout(words, rows) -> Layout:
    """(scale word, row) -> int32 word of the row-major scale buffer: a row's `words` words
    contiguous. Also takes DSL integers (the dispatch kernel evaluates the same layout)."""
    return Layout((words, rows), (1, words))


def dispatch_scale_rows(cfg: EPConfig) -> Buffer | None:
    """(scale word, row): the received rows' scales row by row, as the receivers store them
    (one contiguous run a row), before the dispatch writes them out in the output's layout (FP8
    transposed, NVFP4 128x4) a whole tile at a time (the packed and sources layouts). None for
    bf16 and for the slabs layout (whose decode-sized dispatch stores the output's layout
    directly)."""
    words = scale_words(cfg)
    if not words or cfg.layout == "slabs":
        return None
    return Buffer("dispatch_scale_rows", "int32", scale_rows_layout(words, cfg.row_capacity),
                  "received rows' scales, row-major, before the output layout")


def dispatch_round() -> Buffer:
    """The number of dispatches completed (a round's counts carry it + 1 as their epoch)."""
    return Buffer("dispatch_round", "int64", Layout(1, 1), "dispatches completed")


# A launch's words (`dispatch_done`, `combine_place`): the channels that finished (the last
# advances the round and resets it); then the placement of a launch with spare CTAs
# (`kernels/placement.py`): channels taken, CTAs arrived, and a bit per TPC that holds a channel.
TPC_WORDS = 4  # 128 TPCs: 256 SMs
PLACE_SLOTS = 64 * TPC_WORDS  # SM indices a placement table covers (`kernels.store_rate`)
LAUNCH_FIELDS = ("finished", "taken", "arrived") + tuple(f"tpcs{i}" for i in range(TPC_WORDS))


def launch_words(name: str, what: str) -> Buffer:
    return Buffer(name, "int32", Layout(len(LAUNCH_FIELDS), 1), what)


def dispatch_done() -> Buffer:
    """LAUNCH_FIELDS of the current dispatch: its finished channels, and its placement."""
    return launch_words("dispatch_done", "finished channels and placement of a dispatch")


def combine_place() -> Buffer:
    """LAUNCH_FIELDS of the current combine's placement ("finished" unused)."""
    return launch_words("combine_place", "placement of a combine")


def error_words() -> Buffer:
    """(field): what went wrong on the device, ERROR_FIELDS in order; zero when nothing did."""
    return Buffer("error", "int32", Layout(len(ERROR_FIELDS), 1),
                  "missing rank + 1, its phase, bad expert id bits, inconsistent counts")


def control_buffers(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> list[Buffer]:
    """The local state the transport keeps between calls: the dispatch round, every stream's
    position (`layouts.channels.counters_layout`: messages sent, messages consumed) and the
    device error record."""
    positions = ChannelGeometry(cfg, channels).counters()
    return [dispatch_round(), dispatch_done(), combine_place(),
            Buffer("stream_positions", "int64", positions,
                   "messages sent / consumed per (channel, rank, kind, phase)"),
            error_words()]


# Dispatch handle: what combine needs from the dispatch ---------------------------------------


def combine_routes(cfg: EPConfig) -> list[Buffer]:
    """Per received message (slot j of source s): the output row and router weight of each k
    that landed here (row -1: not here), the source token index, and each source's count."""
    k, t, r = cfg.topk, cfg.max_tokens_per_rank, cfg.ranks
    per_k = Layout((k, t, r), (1, k, k * t))
    return [
        Buffer("route_rows", "int32", per_k, "output row of (k, message, source), or -1"),
        Buffer("route_weights", "float32", per_k, "router weight of (k, message, source)"),
        Buffer("route_tokens", "int32", Layout((t, r), (1, t)),
               "source token index of (message, source)"),
        Buffer("route_messages", "int32", Layout(r, 1), "messages received from each source"),
    ]


def channel_messages(cfg: EPConfig, channels: int) -> Buffer:
    """(source, channel): messages a dispatch received from each (source, channel) stream, the
    order combine sends their rows back in."""
    return Buffer("route_channels", "int32", channel_messages_layout(cfg.ranks, channels),
                  "messages received per (source, channel)")


# Dispatch outputs --------------------------------------------------------------------------


def output_tokens(cfg: EPConfig) -> Buffer:
    """(element, row): received rows grouped by segment, in the format's element type."""
    fmt = token_format(cfg.format)
    if fmt.payload_bits == 16:
        return Buffer("tokens", "bfloat16", Layout((cfg.hidden, cfg.row_capacity),
                                                   (1, cfg.hidden)), "expert-grouped rows")
    width = fmt.payload_bytes(cfg.hidden)
    return Buffer("tokens", "uint8", Layout((width, cfg.row_capacity), (1, width)),
                  "expert-grouped rows (quantized codes)")


def output_scales(cfg: EPConfig) -> Buffer | None:
    fmt = token_format(cfg.format)
    if cfg.format == "fp8":
        blocks = cfg.hidden // fmt.block
        return Buffer("scales", "float32", Layout((cfg.row_capacity, blocks), (1, cfg.row_capacity)),
                      "fp32 scales, transposed [H/128, rows]")
    if fmt.block > 1:
        rows = scale_rows_capacity(cfg.recv_rows, cfg.segments)
        return Buffer("scales", "uint8", scale_layout(rows, cfg.hidden, fmt.block),
                      f"{cfg.format} scales in 128x4 blocks, each segment on its own block")
    return None


def output_metadata(cfg: EPConfig) -> list[Buffer]:
    out = [
        Buffer("row_offsets", "uint32", Layout(cfg.segments + 1, 1), "segment boundaries"),
        Buffer("expert_ids", "int32", Layout(cfg.segments, 1), "local expert id per segment"),
        Buffer("src_info", "int32", Layout((cfg.row_capacity, 2), (2, 1)),
               "(source token index, k slot) per row"),
        Buffer("recv_counts_per_expert", "int32", Layout(cfg.segments, 1),
               "rows received per segment"),
    ]
    if token_format(cfg.format).payload_bits == 4:
        out.append(Buffer("scales_offsets", "int32", Layout(cfg.segments, 1),
                          "extra 128-row scale blocks before each segment"))
    if cfg.layout == "sources":
        out += [Buffer("recv_topk_ids", "int32", Layout((cfg.topk, cfg.row_capacity),
                                                        (1, cfg.topk)),
                       "each row's K expert ids made local (-1: another rank's)"),
                Buffer("recv_topk_weights", "float32", Layout((cfg.topk, cfg.row_capacity),
                                                              (1, cfg.topk)),
                       "each row's K weights (0 where the expert is another rank's)")]
    return out


def dispatch_outputs(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> list[Buffer]:
    """Everything one dispatch allocates: its outputs and its handle for combine."""
    scales = output_scales(cfg)
    return [output_tokens(cfg), *([scales] if scales else []), *output_metadata(cfg),
            *combine_routes(cfg), channel_messages(cfg, channels)]


def dispatch_rows(counts: list[list[int]], row_align: int = 1) -> tuple[list[int], dict]:
    """Row order of dispatch output from counts[segment][source].

    Rows are grouped by segment, inside a segment by source rank, inside (segment, source) by
    arrival index j (the source-token order). Segments start on multiples of `row_align`.
    Returns (row_offsets, {(segment, source, j): row}).
    """
    offsets, rows, row = [0], {}, 0
    for g, per_source in enumerate(counts):
        for s, n in enumerate(per_source):
            for j in range(n):
                rows[(g, s, j)] = row + j
            row += n
        row = align_up(row, row_align)
        offsets.append(row)
    return offsets, rows


def buffer_sizes(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> dict[str, dict[str, int]]:
    """Bytes of every buffer, by where it lives, for a layer on `channels` SMs."""
    local = [*control_buffers(cfg, channels)]
    if cfg.format != "bf16":
        local.insert(0, dispatch_send_buffer(cfg))
    if dispatch_scale_rows(cfg) is not None:
        local.insert(1, dispatch_scale_rows(cfg))
    return {
        "peer-visible": ChannelGeometry(cfg, channels).peer_bytes(),
        "local": {b.name: b.nbytes for b in local},
        "dispatch outputs": {b.name: b.nbytes for b in dispatch_outputs(cfg, channels)},
    }


def peer_visible_bytes(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> int:
    """Peer-visible bytes one rank maps: the staging, rings, counts and counters of its
    channels."""
    return ChannelGeometry(cfg, channels).peer_offsets()["total"]


def total_bytes(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> int:
    """GPU memory one rank needs for a layer: peer-visible, local buffers, outputs."""
    sizes = buffer_sizes(cfg, channels)
    return (peer_visible_bytes(cfg, channels) + sum(sizes["local"].values())
            + sum(sizes["dispatch outputs"].values()))
