"""Figures of a bench record and of a committed quantize record (`cute-ep plot`, the plot
extra) are PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_plot import RECORD

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def test_figures_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from cute_ep.tools.cli import main

    deepep = tmp_path / "deepep.json"
    deepep.write_text(json.dumps({"best": {"dispatch_bf16": {"sms": 24, "us": 330.0}}}))
    record = tmp_path / "bench.json"
    record.write_text(json.dumps(RECORD))
    bench_png, quant_png = tmp_path / "bench.png", tmp_path / "quant.png"
    assert main(["plot", "bench", str(record), "--deepep", str(deepep), "-o",
                 str(bench_png)]) == 0
    quant = ROOT / "perf/results/quant-2026-11-26-H200-padding.json"
    assert main(["plot", "quant", str(quant), "--key", "lease_11", "-o", str(quant_png)]) == 0
    for png in (bench_png, quant_png):
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, png
