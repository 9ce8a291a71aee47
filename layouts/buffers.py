"""Every buffer of one expert-parallel layer, as a layout over its elements.

`EPConfig` holds the parameters (H, K, E, R, max_tokens_per_rank, format, fused shared expert)
and checks them; the functions below derive each buffer from it:

- peer-visible (written by other ranks over NVLink): dispatch's rings, counts and counters
  (`layouts.channels`, sized by the channels, not the tokens), and combine's receive buffer and
  arrival flags, one copy per buffer group, two groups so a fast rank's next layer never
  overwrites data still being read;
- local: the dispatch send buffer (fp8 / nvfp4 messages, quantized once), round counters;
- dispatch outputs: expert-grouped rows, scales, row_offsets, expert_ids, src_info, counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up, flatten, make_layout
from layouts.channels import DEFAULT_CHANNELS, ChannelGeometry
from layouts.config import EPConfig
from layouts.formats import ALIGN, token_format
from layouts.scales import scale_layout, scale_rows_capacity

# Byte size of each element type, by torch's name.
ELEMENT_BYTES = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "bfloat16": 2, "float16": 2, "int32": 4,
    "uint32": 4, "float32": 4, "int64": 8, "uint64": 8,
}
BUFFER_GROUPS = 2
PHASES = 2  # dispatch, combine: the order of every per-phase mode below
# The words of the device error record, in order. bad_ids holds bits ERROR_ID_RANGE (an id
# outside [0, E)) and ERROR_ID_TWICE (a token listing one expert at two k).
ERROR_FIELDS = ("missing_rank", "phase", "bad_ids", "bad_counts")
ERROR_ID_RANGE, ERROR_ID_TWICE = 1, 2


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


def combine_recv_buffer(cfg: EPConfig) -> Buffer:
    """(hidden, k slot, token): a row per (token, k), so unreduced [T, K, H] output fits too;
    with weights, a rank's pre-reduced partial sum goes to the slot of its first expert."""
    h, k = cfg.hidden, cfg.topk
    return Buffer("combine_recv", "bfloat16",
                  Layout((h, k, cfg.max_tokens_per_rank), (1, h, h * k)),
                  "expert outputs returning to this rank's tokens")


def arrival_flags(cfg: EPConfig) -> Buffer:
    """(source rank): combine's arrival flags, one per source."""
    return Buffer("arrival_flags", "uint64", Layout(cfg.ranks, 1),
                  "per-source arrival flags of combine")


def peer_buffers(cfg: EPConfig) -> list[Buffer]:
    """Combine's peer-visible buffers (one copy per buffer group); dispatch's rings and counts
    are `layouts.channels`."""
    return [combine_recv_buffer(cfg), arrival_flags(cfg)]


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
    """(message byte, token): each local token's message, quantized once for every destination
    (fp8 and nvfp4; bf16 messages are built from `x` directly)."""
    msg = cfg.message.size
    return Buffer("dispatch_send", "uint8", Layout((msg, cfg.max_tokens_per_rank), (1, msg)),
                  "this rank's token messages, encoded once")


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
    """The local state combine keeps between its kernels (the counters that order its rounds)
    and the device error record."""
    return [completion_counters(cfg), round_counters(cfg), error_words()]


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


def buffer_sizes(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> dict[str, dict[str, int]]:
    """Bytes of every buffer, by where it lives, for a layer on `channels` SMs."""
    geo = ChannelGeometry(cfg, channels)
    local = [*control_buffers(cfg)]
    if cfg.format != "bf16":
        local.insert(0, dispatch_send_buffer(cfg))
    return {
        "peer-visible (dispatch)": geo.peer_bytes(),
        "peer-visible (combine, per group)": {b.name: b.nbytes for b in peer_buffers(cfg)},
        "local": {**{b.name: b.nbytes for b in local},
                  "stream_positions": geo.peer_bytes()["counters"]},
        "dispatch outputs": {b.name: b.nbytes for b in dispatch_outputs(cfg)},
    }


def peer_visible_bytes(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> int:
    """Peer-visible bytes one rank maps: dispatch's channels and both combine groups."""
    return ChannelGeometry(cfg, channels).peer_offsets()["total"] + buffer_groups(cfg).cosize()


def total_bytes(cfg: EPConfig, channels: int = DEFAULT_CHANNELS) -> int:
    """GPU memory one rank needs for a layer: peer-visible, local buffers, outputs."""
    sizes = buffer_sizes(cfg, channels)
    return (peer_visible_bytes(cfg, channels) + sum(sizes["local"].values())
            + sum(sizes["dispatch outputs"].values()))
