"""The memory of the transport between nodes (`EPConfig.gpus_per_node`): what a rank holds in
NVSHMEM's symmetric heap for the ranks of the other nodes, and how it is indexed. Every rank's
heap has the same parts at the same offsets, so a put names its destination's part by the
offset of its own.

A token crosses to another node once. Rank (n, l) (node n, local index l) puts it into rank
(m, l)'s net staging. Node m's ranks pull it from there over NVLink, as they pull a source's
staging inside a node. Combine comes back the reverse way: node m sums a token's rows at (m, l)
(`node_reduce_rings`, peer-visible inside the node), then puts one row into (n, l)'s net
combine rings.

A part that holds something for each remote node has one slice per remote node, N - 1 of them
(N nodes), by the source's distance d = (n - m) mod N: slice d - 1 (`remote_slice`).

| part | layout | what |
|---|---|---|
| `net_staging` | (byte, slot, channel, remote) | messages the remote node's rank of this local index put here |
| `net_headers` | (byte, batch slot, channel, remote) | their batches' headers |
| `net_counts` | (entry, kind, channel, local destination, remote, parity), int32 | what (channel, that source) sends to each rank of this node |
| `net_count_flags` | (channel, remote, parity), int64 | the epoch of those counts (the signal of their put) |
| `net_tails` | (channel, remote), int64 | batches that source has put here (the signal of each batch's put) |
| `net_credits` | (channel, local index, remote), int64 | batches of this rank's that rank (remote, local index) is done with (its NVSHMEM atomics) |
| `net_combine_rings` | (row byte, slot, channel, remote) | rows the remote node summed for this rank's tokens |
| `net_combine_counters` | (channel, remote, tail or head), int64 | those rows put here, and taken |

`node_reduce_rings` (row byte, slot, channel, local source) is peer-visible inside the node,
beside `ChannelGeometry`'s parts: the rows node-local ranks push to this rank for the tokens
whose home is this rank's local index on another node.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout, align_up
from layouts.channels import (COUNT_KINDS, COUNTER_BYTES, PARITIES, ChannelGeometry,
                              part_offsets, ring_layout, staging_layout)
from layouts.formats import ALIGN


def remote_slice(source_node: int, node: int, nodes: int) -> int:
    """The slice of rank on `node`'s per-remote-node parts that holds `source_node`'s: its
    distance, (source_node - node) mod nodes, less one. Not for `node` itself."""
    d = (source_node - node) % nodes
    if d == 0:
        raise ValueError(f"node {node} keeps no slice for itself")
    return d - 1


@dataclass(frozen=True)
class NetGeometry:
    """The between-node parts of one rank for a layer whose intranode parts are `channels`'
    (`ChannelGeometry`): the same channels, staging slots and combine rings, one set per remote
    node."""

    channels: ChannelGeometry

    def __post_init__(self):
        if self.cfg.nodes < 2:
            raise ValueError(f"the layer is on {self.cfg.nodes} node: nothing crosses between "
                             f"nodes (set gpus_per_node below ranks)")

    @property
    def cfg(self):
        return self.channels.cfg

    @property
    def remotes(self) -> int:
        return self.cfg.nodes - 1

    def staging(self) -> Layout:
        """(message byte, slot, channel, remote) -> byte offset in `net_staging`."""
        ch = self.channels
        per_node = staging_layout(self.cfg.message.staged_bytes, ch.stage_slots, ch.channels)
        return Layout((*per_node.shape, self.remotes), (*per_node.stride, per_node.cosize()))

    def headers(self) -> Layout:
        """(header byte, batch slot, channel, remote) -> byte offset in `net_headers`."""
        ch = self.channels
        return ring_layout(ch.header_bytes, ch.stage_batches, ch.channels, self.remotes)

    def counts(self) -> Layout:
        """(entry, kind, channel, local destination, remote, parity) -> int32 word."""
        e, k, c, g = self.channels.entries, COUNT_KINDS, self.channels.channels, \
            self.cfg.node_ranks
        return Layout((e, k, c, g, self.remotes, PARITIES),
                      (1, e, e * k, e * k * c, e * k * c * g, e * k * c * g * self.remotes))

    def count_flags(self) -> Layout:
        """(channel, remote, parity) -> int64 word."""
        c = self.channels.channels
        return Layout((c, self.remotes, PARITIES), (1, c, c * self.remotes))

    def tails(self) -> Layout:
        """(channel, remote) -> int64 word."""
        c = self.channels.channels
        return Layout((c, self.remotes), (1, c))

    def credits(self) -> Layout:
        """(channel, local index, remote) -> int64 word."""
        c, g = self.channels.channels, self.cfg.node_ranks
        return Layout((c, g, self.remotes), (1, c, c * g))

    def combine_rings(self) -> Layout:
        """(row byte, slot, channel, remote) -> byte offset in `net_combine_rings`."""
        ch = self.channels
        return ring_layout(ch.combine_row_bytes, ch.ring_slots, ch.channels, self.remotes)

    def combine_counters(self) -> Layout:
        """(channel, remote, tail or head) -> int64 word."""
        c = self.channels.channels
        return Layout((c, self.remotes, 2), (1, c, c * self.remotes))

    def node_reduce_rings(self) -> Layout:
        """(row byte, slot, channel, local source) -> byte offset in `node_reduce_rings`
        (peer-visible inside the node)."""
        ch = self.channels
        return ring_layout(ch.combine_row_bytes, ch.ring_slots, ch.channels, self.cfg.node_ranks)

    def symmetric_bytes(self) -> dict[str, int]:
        """Bytes per rank in NVSHMEM's symmetric heap, by part, in `symmetric_offsets`' order."""
        return {
            "net_staging": align_up(self.staging().cosize(), ALIGN),
            "net_headers": align_up(self.headers().cosize(), ALIGN),
            "net_combine_rings": align_up(self.combine_rings().cosize(), ALIGN),
            "net_counts": align_up(self.counts().cosize() * 4, ALIGN),
            "net_count_flags": align_up(self.count_flags().cosize() * 8, ALIGN),
            "net_tails": align_up(self.tails().cosize() * COUNTER_BYTES, ALIGN),
            "net_credits": align_up(self.credits().cosize() * COUNTER_BYTES, ALIGN),
            "net_combine_counters": align_up(self.combine_counters().cosize() * COUNTER_BYTES,
                                             ALIGN),
        }

    def symmetric_offsets(self) -> dict[str, int]:
        """Byte offset of each part of `symmetric_bytes` in the symmetric region, and its size
        ("total")."""
        return part_offsets(self.symmetric_bytes())

    def node_bytes(self) -> dict[str, int]:
        """Peer-visible bytes inside the node that the transport between nodes adds."""
        return {"node_reduce_rings": align_up(self.node_reduce_rings().cosize(), ALIGN)}
