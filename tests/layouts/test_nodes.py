"""The parts of the transport between nodes (`layouts.nodes`): their indexing and sizes."""

import pytest

from layouts import EPConfig
from layouts.formats import ALIGN
from layouts.nodes import (HEADER_BYTES, LEGS, NodeSlots, node_config, token_row_bytes)


def _is_compact_and_one_to_one(layout):
    return sorted(layout.offsets()) == list(range(layout.cosize()))


def test_a_layer_on_one_node_has_no_parts_between_nodes():
    with pytest.raises(ValueError, match="1 node"):
        NodeSlots(EPConfig(256, 2, 8, 4, 16, gpus_per_node=4))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_a_token_row_holds_the_widest_input_and_its_metadata(fmt):
    cfg = EPConfig(512, 4, 16, 4, 16, fmt, gpus_per_node=2)
    widest = {"bf16": 2 * 512, "fp8": max(2 * 512, 512 + 4 * 4),
              "nvfp4": max(2 * 512, 256 + 32)}[fmt]
    row = token_row_bytes(cfg)
    assert row % ALIGN == 0 and widest + 4 * 9 <= row < widest + 4 * 9 + ALIGN


@pytest.mark.parametrize("nodes,gpus", [(2, 1), (3, 2), (4, 8)])
def test_slots_and_their_rows_tile_each_part_once(nodes, gpus):
    ranks = nodes * gpus
    cfg = EPConfig(256, 2, 4 * ranks, ranks, 5, "fp8", gpus_per_node=gpus)
    slots = NodeSlots(cfg)
    for leg in LEGS:
        layout = slots.slots(leg)
        assert _is_compact_and_one_to_one(layout)
        assert layout.shape == (slots.slot_bytes(leg), nodes)
        rows = slots.rows(leg)
        # The same mapping as a plain formula: slot i's header, then its rows back to back.
        row, slot = slots.row_bytes(leg), slots.slot_bytes(leg)
        for byte, r, i in rows.coordinates():
            assert HEADER_BYTES + rows((byte, r, i)) == i * slot + HEADER_BYTES + r * row + byte
        assert slot == HEADER_BYTES + cfg.max_tokens_per_rank * row
        assert slots.slot_bytes(leg) % ALIGN == 0


def test_the_symmetric_heap_is_its_parts_back_to_back_each_aligned():
    cfg = EPConfig(7168, 8, 256, 16, 4096, "fp8", gpus_per_node=8)
    slots = NodeSlots(cfg)
    sizes, at = slots.symmetric_bytes(), slots.symmetric_offsets()
    assert list(sizes) == ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
                           "signals", "boxes"]
    assert all(at[name] % ALIGN == 0 for name in sizes)
    assert at["total"] == sum(sizes.values())
    token = 2 * 7168 + 4 * 17  # bf16 x is the widest input; 8 ids, 8 weights, the index
    assert token_row_bytes(cfg) == -(-token // 16) * 16
    assert sizes["dispatch_send"] == 2 * (16 + 4096 * token_row_bytes(cfg))
    assert sizes["combine_recv"] == 2 * (16 + 4096 * 2 * 7168)
    assert sizes["signals"] == 32 and sizes["boxes"] == 32
    assert slots.signals()((1, 0)) == 2  # the credit word of dispatch


def test_a_node_s_buffer_is_its_ranks_and_experts_with_room_for_its_held_sources():
    cfg = EPConfig(7168, 8, 256, 16, 4096, "nvfp4", gpus_per_node=8)
    inner = node_config(cfg)
    assert (inner.ranks, inner.experts, inner.max_tokens_per_rank, inner.gpus_per_node) == \
        (8, 128, 2 * 4096, None)
    assert inner.local_experts == cfg.local_experts and inner.format == "nvfp4"


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("fmt,nodes,gpus", [("bf16", 2, 1), ("fp8", 2, 4), ("nvfp4", 4, 2),
                                            ("bf16", 3, 2)])
def test_a_node_s_buffer_holds_the_rows_of_the_layer(fmt, nodes, gpus, shared):
    """A GPU receives at most what it would on one node, so the node's Buffer has the layer's
    output rows: `combine` takes expert outputs sized by the layer's config."""
    cfg = EPConfig(7168, 8, 48 * nodes * gpus, nodes * gpus, 4096, fmt, gpus_per_node=gpus,
                   fused_shared_expert=shared)
    inner = node_config(cfg)
    assert inner.max_tokens_per_rank == (nodes + shared) * 4096
    assert (inner.row_capacity, inner.segments, inner.max_recv >= cfg.max_recv) == \
        (cfg.row_capacity, cfg.segments, True)
