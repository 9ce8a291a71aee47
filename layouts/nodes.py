"""The memory of the transport between nodes (`EPConfig.gpus_per_node`, `cute_ep.NodeBuffer`):
what a rank holds in NVSHMEM's symmetric heap. Every rank's heap has the same parts at the same
offsets, so a put names its destination's part by the offset of its own.

Each network leg (dispatch, then combine) has N send slots and N receive slots (N nodes). A
dispatch sends, from send slot m, this rank's tokens for node m to their holder there (GPU
r // N of node m holds the tokens of sources r); the holder's receive slot i holds those of its
i-th held source. A combine sends, from send slot i, the partial sums of held source i's tokens
back to it; their home's receive slot m holds node m's. A slot is a 16-byte header (rows,
round, bytes a row, 0: int32) and then up to `max_tokens_per_rank` rows.

| part | layout | what |
|---|---|---|
| `dispatch_send`, `dispatch_recv` | (byte, slot) | token rows: payload, K ids, K weights, index |
| `combine_send`, `combine_recv` | (byte, slot) | partial sums, bf16 [H] a row |
| `signals` | (kind, leg), int64 | data: CTAs of the puts that landed; credit: slots handed back |
| `boxes` | (byte, box) | the 16 bytes each hand-back puts |

A holder's node dispatch takes N x max_tokens_per_rank input rows (`node_config`): held source
s's token t at row s x T + t. With a fused shared expert one more block follows, the rank's own
T tokens, routed nowhere: the node's shared expert takes those rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from layouts.algebra import Layout, align_up
from layouts.channels import part_offsets
from layouts.config import EPConfig
from layouts.formats import ALIGN

HEADER_BYTES = 16  # a slot's header: (rows, round, bytes a row, 0) as int32
LEGS = ("dispatch", "combine")
SIGNAL_KINDS = ("data", "credit")


def node_input_blocks(cfg: EPConfig) -> int:
    """Blocks of max_tokens_per_rank rows in a holder's node input: one a held source (N), and
    with a fused shared expert one more, the rank's own tokens (the shared expert's rows)."""
    return cfg.nodes + int(cfg.fused_shared_expert)


def node_config(cfg: EPConfig) -> EPConfig:
    """The config of one node's intranode Buffer: its G ranks and E / N experts, and room for
    the node input's blocks (`node_input_blocks` x max_tokens_per_rank rows)."""
    nodes = cfg.nodes
    # A GPU receives at most what it would on one node (its experts' rows from every source,
    # and its own tokens once for the shared expert), so its rows are the layer's: without a
    # shared expert the worst case says so itself, with one the node input's larger token
    # bound would add (N + 1) x T shared rows where T come.
    capacity = cfg.max_recv if cfg.fused_shared_expert else None
    return dataclasses.replace(cfg, experts=cfg.experts // nodes, ranks=cfg.node_ranks,
                               max_tokens_per_rank=node_input_blocks(cfg) *
                               cfg.max_tokens_per_rank, gpus_per_node=None,
                               recv_capacity=capacity)


def token_row_bytes(cfg: EPConfig) -> int:
    """Bytes of a token as it crosses the network: the widest input the layer takes (bf16 x, or
    pre-quantized codes and scales), K int32 ids, K float32 weights and its int32 index, 16-byte
    aligned."""
    h = cfg.hidden
    quantized = {"bf16": 0, "fp8": h + 4 * (h // 128), "nvfp4": h // 2 + h // 16}[cfg.format]
    return align_up(max(2 * h, quantized) + 4 * (2 * cfg.topk + 1), ALIGN)


@dataclass(frozen=True)
class NodeSlots:
    """A rank's parts of the transport between nodes for layer `cfg`."""

    cfg: EPConfig

    def __post_init__(self):
        if self.cfg.nodes < 2:
            raise ValueError(f"the layer is on {self.cfg.nodes} node: nothing crosses between "
                             f"nodes (set gpus_per_node below ranks)")

    @property
    def nodes(self) -> int:
        return self.cfg.nodes

    def row_bytes(self, leg: str) -> int:
        """Bytes of one row of `leg`'s slots: a token's (dispatch) or a bf16 sum's (combine)."""
        return token_row_bytes(self.cfg) if leg == "dispatch" else 2 * self.cfg.hidden

    def slot_bytes(self, leg: str) -> int:
        return HEADER_BYTES + self.cfg.max_tokens_per_rank * self.row_bytes(leg)

    def slots(self, leg: str) -> Layout:
        """(byte, slot) -> byte offset in `leg`'s send or receive part."""
        b = self.slot_bytes(leg)
        return Layout((b, self.nodes), (1, b))

    def rows(self, leg: str) -> Layout:
        """(row byte, row, slot) -> byte offset in `leg`'s part, past the slot's header (add
        HEADER_BYTES)."""
        r = self.row_bytes(leg)
        return Layout((r, self.cfg.max_tokens_per_rank, self.nodes), (1, r, self.slot_bytes(leg)))

    def signals(self) -> Layout:
        """(signal kind, leg) -> int64 word."""
        return Layout((len(SIGNAL_KINDS), len(LEGS)), (len(LEGS), 1))

    def symmetric_bytes(self) -> dict[str, int]:
        """Bytes per rank in NVSHMEM's symmetric heap, by part, in `symmetric_offsets`' order."""
        parts = {}
        for leg in LEGS:
            size = align_up(self.slots(leg).cosize(), ALIGN)
            parts[f"{leg}_send"] = size
            parts[f"{leg}_recv"] = size
        parts["signals"] = align_up(self.signals().cosize() * 8, ALIGN)
        parts["boxes"] = 2 * HEADER_BYTES
        return parts

    def symmetric_offsets(self) -> dict[str, int]:
        """Byte offset of each part of `symmetric_bytes` in the symmetric region, and its size
        ("total")."""
        return part_offsets(self.symmetric_bytes())
