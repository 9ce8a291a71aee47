"""perf/bench_remote_stores.py's CPU parts: how a budget's CTAs split over the peers, and the
bytes `store_rate` leaves, against which every receiver checks what its peers pushed."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import bench_remote_stores as brs  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


@pytest.mark.parametrize("budget,world,per_peer,want", [
    (24, 4, 64 << 20, (8, 8 << 20)),       # 3 peers: 8 CTAs each, 8 MiB a CTA
    (132, 4, 64 << 20, (44, 1523712)),     # 64 MiB / 44 rounded down to 4 KiB pieces
    (24, 2, 1 << 20, (24, 40960)),         # one peer takes every CTA
    (2, 4, 1 << 20, (1, 1 << 20)),         # fewer CTAs than peers: one a peer
])
def test_the_budget_splits_evenly_over_the_peers_in_whole_pieces(budget, world, per_peer, want):
    ctas, share = brs.split(budget, world, per_peer, 4096)
    assert (ctas, share) == want
    assert share % 4096 == 0 and ctas * share <= per_peer


def test_a_split_without_a_whole_piece_or_peer_is_refused():
    with pytest.raises(ValueError, match="no whole"):
        brs.split(24, 2, 4096 * 23, 4096)
    with pytest.raises(ValueError, match="2\\+ ranks"):
        brs.split(24, 1, 1 << 20, 4096)


def test_the_expected_bytes_are_each_modes_pattern():
    piece = 16
    lanes = brs.expected("lanes", 2, 3 * piece, piece).view(2, 3, piece)
    assert torch.equal(lanes[1, 2], torch.full((piece,), 2, dtype=torch.uint8))
    assert torch.equal(lanes[0], lanes[1])  # each CTA's share starts at piece 0
    bulk = brs.expected("bulk", 1, 10 * piece, piece, warps=8).view(10, piece)
    # Piece 9 is warp 1's: its constant piece holds bytes (piece + i) % 251.
    assert bulk[9].tolist() == [(piece + i) % 251 for i in range(piece)]
    assert torch.equal(bulk[8], bulk[0])
    with pytest.raises(ValueError, match="modes"):
        brs.expected("other", 1, piece, piece)
