"""Every buffer of one expert-parallel layer, as a layout over its elements.

`EPConfig` holds the parameters (H, K, E, R, max_tokens_per_rank, format, fused shared expert)
and checks them; the functions below derive each buffer from it:

- peer-visible (written by other ranks over NVLink), one copy per buffer group, two groups so a
  fast rank's next layer never overwrites data still being read:
  dispatch receive buffer, receive counts, combine receive buffer, arrival flags;
- local: the dispatch send buffer (each token's message, quantized once), per-expert counters;
- dispatch outputs: expert-grouped rows, scales, row_offsets, expert_ids, src_info, counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up, flatten, make_layout
from layouts.formats import ALIGN, MessageLayout, message_layout, token_format
from layouts.scales import scale_layout, scale_rows_capacity

# Byte size of each element type, by torch's name.
ELEMENT_BYTES = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "bfloat16": 2, "float16": 2, "int32": 4,
    "uint32": 4, "float32": 4, "int64": 8, "uint64": 8,
}
FP8_ROW_ALIGN = 4  # FP8 output pads every expert segment to 4 rows
BUFFER_GROUPS = 2
PHASES = 2  # dispatch, combine: the order of every per-phase mode below
# The words of the device error record, in order. bad_ids holds bits ERROR_ID_RANGE (an id
# outside [0, E)) and ERROR_ID_TWICE (a token listing one expert at two k).
ERROR_FIELDS = ("missing_rank", "phase", "bad_ids", "bad_counts")
ERROR_ID_RANGE, ERROR_ID_TWICE = 1, 2


@dataclass(frozen=True)
class EPConfig:
    hidden: int
    topk: int
    experts: int
    ranks: int
    max_tokens_per_rank: int
    format: str = "bf16"
    fused_shared_expert: bool = False

    def __post_init__(self):
        fmt = token_format(self.format)
        if self.ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {self.ranks}")
        if self.experts < 1 or self.experts % self.ranks:
            raise ValueError(f"experts ({self.experts}) must be a positive multiple of ranks "
                             f"({self.ranks}): E must be divisible by R")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"top-k ({self.topk}) must be between 1 and the number of experts "
                             f"({self.experts}): K <= E")
        if self.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        fmt.validate_hidden(self.hidden)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    @property
    def segments(self) -> int:
        """Grouped-GEMM segments on a rank: the local experts, plus the shared expert if fused."""
        return self.local_experts + int(self.fused_shared_expert)

    @property
    def message(self) -> MessageLayout:
        return message_layout(self.format, self.hidden, self.topk)

    @property
    def max_recv(self) -> int:
        """Rows a rank can receive: every token of every rank, once per expert it routes here."""
        rows = self.max_tokens_per_rank * min(self.experts, self.ranks * self.topk)
        return rows + self.max_tokens_per_rank * int(self.fused_shared_expert)

    @property
    def row_align(self) -> int:
        return FP8_ROW_ALIGN if self.format == "fp8" else 1

    @property
    def row_capacity(self) -> int:
        """Output rows including each segment's alignment padding."""
        return self.max_recv + (self.row_align - 1) * self.segments


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


# Peer-visible ------------------------------------------------------------------------------


def dispatch_recv_buffer(cfg: EPConfig) -> Buffer:
    """(message byte, token slot, source rank): a slot per token of every source rank."""
    msg, t = cfg.message.size, cfg.max_tokens_per_rank
    return Buffer("dispatch_recv", "uint8", Layout((msg, t, cfg.ranks), (1, msg, msg * t)),
                  "each source rank's token messages, written by that rank")


def recv_counts(cfg: EPConfig) -> Buffer:
    """(entry, source rank): what each source sent here this round, written before its arrival
    signal. Entry 0 is the number of token messages, entry 1 + g the rows for segment g."""
    entries = 1 + cfg.segments
    return Buffer("recv_counts", "int32", Layout((entries, cfg.ranks), (1, entries)),
                  "messages and rows per segment received from each source rank")


def combine_recv_buffer(cfg: EPConfig) -> Buffer:
    """(hidden, k slot, token): a row per (token, k), so unreduced [T, K, H] output fits too;
    with weights, a rank's pre-reduced partial sum goes to the slot of its first expert."""
    h, k = cfg.hidden, cfg.topk
    return Buffer("combine_recv", "bfloat16",
                  Layout((h, k, cfg.max_tokens_per_rank), (1, h, h * k)),
                  "expert outputs returning to this rank's tokens")


def arrival_flags(cfg: EPConfig) -> Buffer:
    """(phase, source rank): dispatch (0) and combine (1) arrival flags, one per pair."""
    return Buffer("arrival_flags", "uint64", Layout((2, cfg.ranks), (cfg.ranks, 1)),
                  "per-source arrival flags of the dispatch and combine phases")


def peer_buffers(cfg: EPConfig) -> list[Buffer]:
    return [dispatch_recv_buffer(cfg), recv_counts(cfg), combine_recv_buffer(cfg),
            arrival_flags(cfg)]


def group_offsets(cfg: EPConfig) -> dict[str, int]:
    """Byte offset of each peer-visible buffer inside one buffer group (16-byte aligned)."""
    offsets, at = {}, 0
    for b in peer_buffers(cfg):
        offsets[b.name] = at
        at += b.nbytes
    offsets["group_bytes"] = at
    return offsets


def buffer_groups(cfg: EPConfig) -> Layout:
    """(byte in group, group): the symmetric allocation holding both buffer groups."""
    size = group_offsets(cfg)["group_bytes"]
    return Layout((size, BUFFER_GROUPS), (1, size))


# Local -------------------------------------------------------------------------------------


def dispatch_send_buffer(cfg: EPConfig) -> Buffer:
    """(message byte, token): each local token's message, encoded once for every destination."""
    msg = cfg.message.size
    return Buffer("dispatch_send", "uint8", Layout((msg, cfg.max_tokens_per_rank), (1, msg)),
                  "this rank's token messages, encoded once")


def send_counts(cfg: EPConfig) -> Buffer:
    """(entry, destination rank): what this rank sends each destination this round, entries as
    in `recv_counts`; copied into the destination's `recv_counts` before its arrival flag."""
    entries = 1 + cfg.segments
    return Buffer("send_counts", "int32", Layout((entries, cfg.ranks), (1, entries)),
                  "messages and rows per segment sent to each destination rank")


def destination_slots(cfg: EPConfig) -> Buffer:
    """(token, destination rank): the token's slot in that destination's receive buffer, or -1
    where none of its experts lives there."""
    t = cfg.max_tokens_per_rank
    return Buffer("destination_slots", "int32", Layout((t, cfg.ranks), (1, t)),
                  "each token's slot at every destination rank")


def expert_positions(cfg: EPConfig) -> Buffer:
    """(k, token): the token's index among this rank's tokens routed to expert topk_ids[t, k]."""
    k = cfg.topk
    return Buffer("expert_positions", "int32", Layout((k, cfg.max_tokens_per_rank), (1, k)),
                  "each (token, k)'s position among the tokens of its expert")


def completion_counters(cfg: EPConfig) -> Buffer:
    """(destination rank or R for 'all destinations', phase): CTAs finished sending to each
    destination, then destinations finished; the last one resets it."""
    r1 = cfg.ranks + 1
    return Buffer("completion_counters", "int32", Layout((r1, PHASES), (1, r1)),
                  "finished senders per destination and phase; reset by the last")


def round_counters(cfg: EPConfig) -> Buffer:
    """(buffer group, phase): the epoch of the last round completed; a round's flags are raised
    to it + 1."""
    return Buffer("round_counters", "int64", Layout((BUFFER_GROUPS, PHASES), (1, BUFFER_GROUPS)),
                  "epoch per buffer group and phase")


def error_words() -> Buffer:
    """(field): what went wrong on the device, ERROR_FIELDS in order; zero when nothing did."""
    return Buffer("error", "int32", Layout(len(ERROR_FIELDS), 1),
                  "missing rank + 1, its phase, bad expert id bits, inconsistent counts")


def control_buffers(cfg: EPConfig) -> list[Buffer]:
    """The local state the transport keeps between its kernels: plan results, counts, the
    counters that order the rounds, and the error word."""
    return [destination_slots(cfg), expert_positions(cfg), send_counts(cfg),
            completion_counters(cfg), round_counters(cfg), error_words()]


def expert_counters(cfg: EPConfig) -> Buffer:
    """(segment, source rank): rows each local segment receives from each source."""
    return Buffer("expert_counters", "int32", Layout((cfg.segments, cfg.ranks), (cfg.ranks, 1)),
                  "per (segment, source) received rows; reset by their consumer")


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
        rows = scale_rows_capacity(cfg.max_recv, cfg.segments)
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
    return out


def dispatch_outputs(cfg: EPConfig) -> list[Buffer]:
    """Everything one dispatch allocates: its outputs and its handle for combine."""
    scales = output_scales(cfg)
    return [output_tokens(cfg), *([scales] if scales else []), *output_metadata(cfg),
            *combine_routes(cfg)]


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


def buffer_sizes(cfg: EPConfig) -> dict[str, dict[str, int]]:
    """Bytes of every buffer, by where it lives (peer-visible ones: per buffer group)."""
    return {
        "peer-visible (per group)": {b.name: b.nbytes for b in peer_buffers(cfg)},
        "local": {b.name: b.nbytes
                  for b in (dispatch_send_buffer(cfg), expert_counters(cfg), *control_buffers(cfg))},
        "dispatch outputs": {b.name: b.nbytes for b in dispatch_outputs(cfg)},
    }


def total_bytes(cfg: EPConfig) -> int:
    """GPU memory one rank needs for a layer: both buffer groups, local buffers, outputs."""
    sizes = buffer_sizes(cfg)
    return (buffer_groups(cfg).cosize() + sum(sizes["local"].values())
            + sum(sizes["dispatch outputs"].values()))
