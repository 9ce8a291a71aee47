"""perf/bench_dispatch_emulated.py's table: every figure of every configuration readable in an
80-column terminal (a figure a row, a configuration a column), as its records hold them."""

import io
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import bench_dispatch_emulated as bde  # noqa: E402

from layouts.channels import TRACE_FIELDS  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def _records():
    stamps = [f for f in TRACE_FIELDS[1:] if not f.endswith("_ns")]
    waits = [f for f in TRACE_FIELDS if f.endswith("_ns")]
    out = []
    for i, (fmt, ranks) in enumerate([("nvfp4-input", 2), ("fp8-input", 2), ("bf16", 4)]):
        trace = {f: 100.0 * (i + 1) + j + 0.25 for j, f in enumerate(stamps + waits)}
        out.append({"format": fmt, "ranks": ranks, "sms": 24, "dispatch_us": 171.04 + i,
                    "combine_us": 401.96 + i, "trace_us": trace})
    return out


def test_every_figure_shows_in_an_80_column_terminal():
    records = _records()
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(bde.dispatch_table("emulated ranks", records))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    for r in records:
        assert f"{r['dispatch_us']:.1f}" in text and f"{r['combine_us']:.1f}" in text
    # A row per figure: the two times and every traced field, each once, on one line with its
    # value for every configuration.
    for f in TRACE_FIELDS[1:]:
        label = f"{f[:-3]}, longest" if f.endswith("_ns") else f"{f}, at"
        rows = [line for line in lines if f"│ {label} " in line]
        assert len(rows) == 1, f
        for r in records:
            assert f"{r['trace_us'][f]:.1f}" in rows[0], (r["format"], f)


def test_no_records_is_an_empty_table_not_an_error():
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(bde.dispatch_table("none", []))
    assert "dispatch, all ranks" in console.export_text()


def test_channel_stamps_are_the_median_and_latest_channel_from_the_earliest_start():
    import torch

    fields = ("start", "routed", "end")
    # Two ranks of three channels, times in ns; the earliest start 1000 ns.
    a = torch.tensor([[[1000, 3000, 9000], [2000, 5000, 8000], [1500, 4000, 7000]],
                      [[1200, 2000, 6000], [1100, 6000, 10000], [1300, 3500, 7500]]])
    got = bde.channel_stamps([a], ["routed", "end"], fields)
    # routed - 1000: 2000, 4000, 3000, 1000, 5000, 2500 ns -> median 2.75 us, latest 5.0
    assert got == {"routed": [2.75, 5.0], "end": [6.75, 9.0]}
    # Over several traces, the median of each: a trace 1 us later everywhere and one 3 us later.
    got = bde.channel_stamps([a, a + 1000, a + 3000 * (torch.arange(3) == 1)], ["routed"],
                             fields)
    assert got == {"routed": [2.75, 5.0]}


def test_no_traced_dispatch_is_refused_before_anything_runs(monkeypatch, capsys):
    """`--traces 0` would leave the table without its stamps: refused at once, with why."""
    monkeypatch.setattr(sys, "argv", ["bench_dispatch_emulated.py", "--traces", "0"])
    with pytest.raises(SystemExit) as stop:
        bde.main()
    assert stop.value.code == 2
    assert "--traces: at least 1" in capsys.readouterr().err
