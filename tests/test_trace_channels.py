"""perf/trace_channels.py's CPU parts: rows per channel against a pair-by-pair count, the
timeline's units and origin, the spread and the correlation."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import trace_channels as tc  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def test_rows_per_channel_counts_every_sources_pairs_whose_expert_lives_here():
    gen = torch.Generator().manual_seed(3)
    experts, ranks, topk, tokens = 16, 2, 4, 30
    ids = [torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk] for _ in range(ranks)]
    ranges = [(0, 11), (11, 21), (21, 30)]
    for rank in range(ranks):
        want = []
        for begin, end in ranges:
            n = 0
            for src in ids:
                for t in range(begin, end):
                    n += sum(1 for e in src[t].tolist() if e // (experts // ranks) == rank)
            want.append(n)
        assert tc.rows_per_channel(ids, rank, experts // ranks, ranges) == want
    both = [sum(r) for r in zip(*(tc.rows_per_channel(ids, r, 8, ranges) for r in range(2)))]
    assert both == [ranks * topk * (e - b) for b, e in ranges]  # every pair lands somewhere


def test_timeline_measures_stamps_from_the_first_start_and_keeps_waits():
    fields = ("start", "recv_done", "wait_ns")
    trace = torch.tensor([[5_000, 9_000, 2_500], [4_000, 0, 1_000], [7_000, 8_000, 0]])
    out = tc.timeline(trace, fields, channels=2)
    assert out == {"recv_done": [5.0, None], "wait_us": [2.5, 1.0]}


def test_spread_and_correlation():
    assert tc.spread([3.0, None, 1.0, 2.0]) == (1.0, 2.0, 3.0)
    assert tc.spread([None]) is None
    assert tc.correlation([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert tc.correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert tc.correlation([1, 1, 1], [1, 2, 3]) is None
