"""Figures from records (`cute_ep.tools.plot`, the plot extra): the numbers drawn are the
record's (the slowest rank's time at each SM budget, NCCL's per format, DeepEP's best; a
quantize run's median over its runs), and each figure is a PNG (`tests/test_plot_records.py`)."""

from __future__ import annotations

from cute_ep.tools.plot import bench_series, quant_records


def _rank(dispatch, combine, nccl):
    sweep = [{"sms": sms, "dispatch_us": d, "combine_us": c}
             for sms, d, c in zip((24, "all"), dispatch, combine)]
    return {"formats": {"bf16": {"throughput": {"sweep": sweep, "nccl_all_to_all_us": nccl}}}}


RECORD = {"date": "2026-11-26T00:00:00+00:00", "device": "NVIDIA H200", "gpus": 2,
          "config": {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256,
                     "sms_per_gpu": 132},
          "ranks": [_rank((500.0, 300.0), (400.0, 250.0), 260.0),
                    _rank((510.0, 290.0), (390.0, 260.0), 270.0)]}


def test_bench_series_takes_the_slowest_rank_at_each_budget():
    data = bench_series(RECORD)
    assert data["series"][("dispatch", "bf16")] == [(24, 510.0), (132, 300.0)]
    assert data["series"][("combine", "bf16")] == [(24, 400.0), (132, 260.0)]
    assert data["nccl"] == {"bf16": 270.0}


def test_quant_records_of_both_kinds_of_run():
    plain = {"records": [
        {"kernel": "k", "intermediate": 2048, "l2": "zero", "us": 10.0, "copy_us": 8.0},
        {"kernel": "k", "intermediate": 2048, "l2": "read", "us": 9.0, "copy_us": 8.0}]}
    assert quant_records(plain) == [{"kernel": "k", "intermediate": 2048, "us": 10.0,
                                     "copy_us": 8.0}]
    sides = {"pct_of_copy": {"fused_silu_fp8 I=7168 zero": {
        "main": [{"us": 1.0, "copy_us": 1.0}],
        "new": [{"us": 12.0, "copy_us": 9.0}, {"us": 10.0, "copy_us": 8.0},
                {"us": 11.0, "copy_us": 7.0}]}}}
    assert quant_records(sides) == [{"kernel": "fused_silu_fp8", "intermediate": 7168,
                                     "us": 11.0, "copy_us": 8.0}]
    assert quant_records(sides, side="main")[0]["us"] == 1.0
    assert quant_records(sides, l2="read") == []
