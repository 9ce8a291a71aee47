"""The between-node parts of a rank (`layouts.nodes`): their indexing and sizes."""

import pytest

from layouts import EPConfig
from layouts.channels import ChannelGeometry
from layouts.formats import ALIGN
from layouts.nodes import NetGeometry, remote_slice


@pytest.mark.parametrize("nodes", [2, 3, 4, 8])
def test_each_node_keeps_one_slice_per_other_node(nodes):
    for node in range(nodes):
        slices = [remote_slice(n, node, nodes) for n in range(nodes) if n != node]
        assert sorted(slices) == list(range(nodes - 1))
        with pytest.raises(ValueError, match="no slice for itself"):
            remote_slice(node, node, nodes)


def test_a_layer_on_one_node_has_no_net_parts():
    cfg = EPConfig(256, 2, 8, 4, 16, gpus_per_node=4)
    with pytest.raises(ValueError, match="1 node"):
        NetGeometry(ChannelGeometry(cfg, 2))


def _small(fmt="bf16", ranks=6, gpus=2):
    cfg = EPConfig(256, 2, 2 * ranks, ranks, 16, fmt, gpus_per_node=gpus)
    return NetGeometry(ChannelGeometry(cfg, 3, chunk_tokens=2, ring_chunks=1, stage_batches=2))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_every_part_is_compact_and_one_to_one(fmt):
    """Each layout maps its coordinates onto 0 .. cosize - 1 once each (no two items share a
    word, nothing between them is wasted)."""
    net = _small(fmt)
    for layout in (net.staging(), net.headers(), net.counts(), net.count_flags(), net.tails(),
                   net.credits(), net.combine_rings(), net.combine_counters(),
                   net.node_reduce_rings()):
        offsets = layout.offsets()
        assert sorted(offsets) == list(range(layout.cosize())), layout


def test_a_remote_nodes_slice_mirrors_a_sources_staging_and_rings():
    """Per remote node: the staging, headers and combine rings of one source inside a node
    (`ChannelGeometry`), and the counts of every rank of this node."""
    net = _small(ranks=6, gpus=2)  # 3 nodes: 2 remote
    ch = net.channels
    assert net.remotes == 2
    assert net.staging().cosize() == 2 * ch.staging().cosize()
    assert net.headers().cosize() == 2 * ch.headers().cosize()
    assert net.combine_rings().cosize() == 2 * ch.combine_ring().cosize() // net.cfg.ranks
    assert net.counts().cosize() == ch.counts().cosize() // net.cfg.ranks * 2 * 2
    assert net.credits().cosize() == ch.channels * net.cfg.node_ranks * 2
    assert net.node_reduce_rings().cosize() == ch.combine_ring().cosize() // 3


def test_the_symmetric_parts_follow_each_other_aligned():
    net = _small("fp8")
    sizes, offsets = net.symmetric_bytes(), net.symmetric_offsets()
    at = 0
    for name, nbytes in sizes.items():
        assert offsets[name] == at and at % ALIGN == 0 and nbytes % ALIGN == 0
        at += nbytes
    assert offsets["total"] == at == sum(sizes.values())


def test_a_deepseek_shaped_layer_on_two_nodes_of_eight():
    """H 7168, top-8 of 256 experts, 16 ranks as 2 x 8, 24 channels: one remote node, whose
    staging slice is a source's staging inside a node."""
    cfg = EPConfig(7168, 8, 256, 16, 4096, gpus_per_node=8)
    ch = ChannelGeometry(cfg, 24)
    net = NetGeometry(ch)
    sizes = net.symmetric_bytes()
    assert net.remotes == 1
    assert sizes["net_staging"] == ch.peer_bytes()["staging"]
    assert sizes["net_staging"] == 24 * ch.stage_slots * cfg.message.staged_bytes
