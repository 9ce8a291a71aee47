"""perf/bounds.py: the floors of a dispatch and a combine from a bench record's byte counts and
the per-SM rates, checked on a small record worked out by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import bounds  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def _records(deepep_bf16_us: float):
    tp = {"message_bytes": 2100, "sent_tokens_to_peers": 80, "p2p_copy_gbps": 200.0,
          "sweep": [{"sms": 24, "rows": 400, "token_bytes": 2048, "received_tokens": 150,
                     "lockstep_dispatch_us": 1.5, "lockstep_combine_us": 1.25}]}
    slower = {**tp, "sweep": [{**tp["sweep"][0], "lockstep_dispatch_us": 2.0}]}
    bench = {"gpus": 2, "device": "test GPU",
             "config": {"hidden": 1024, "tokens": 100, "sms": [24, "all"]},
             "ranks": [{"rank": 0, "formats": {"bf16": {"throughput": tp}}},
                       {"rank": 1, "formats": {"bf16": {"throughput": slower}}}]}
    deepep = {"best": {"dispatch_bf16": {"us": deepep_bf16_us}, "combine": {"us": 1.0}}}
    rates = {"rows": [{"kernel": "store_rate bulk (50 GB/s an SM)", "ctas": 24,
                       "gbs_per_cta": 50.0},
                      {"kernel": "store_rate bulk (60 GB/s an SM)", "ctas": 16,
                       "gbs_per_cta": 60.0},
                      {"kernel": "load_rate cp.async (100 GB/s an SM)", "ctas": 24,
                       "gbs_per_cta": 100.0}]}
    return bench, deepep, rates


def test_floors_are_the_bytes_over_their_rates_and_the_largest_wins():
    dispatch, combine = bounds.bounds(*_records(0.8))
    # dispatch: rows 400 x 2048 + the 100 tokens' messages into staging, stored by 24 SMs at
    # 50 GB/s; the 150 pulled messages and the 100 read, loaded at 100 GB/s an SM; 80 peer
    # messages over NVLink at 200 GB/s.
    assert dispatch["bytes"] == {"store": 400 * 2048 + 100 * 2100,
                                 "load": 150 * 2100 + 100 * 2100, "nvlink": 80 * 2100}
    assert dispatch["bound_us"]["store"] == pytest.approx(1_029_200 / 1200e3, rel=1e-12)
    assert dispatch["bound_us"]["load"] == pytest.approx(525_000 / 2400e3, rel=1e-12)
    assert dispatch["bound_us"]["nvlink"] == pytest.approx(168_000 / 200e3, rel=1e-12)
    assert dispatch["bound_by"] == "store"
    assert dispatch["measured_us"] == 2.0  # the slowest rank's
    # 2 GPUs: BF16 dispatch target 1.1 x DeepEP's 0.8 us = 0.88 >= the 0.858 us floor.
    assert dispatch["target_us"] == pytest.approx(0.88) and dispatch["reachable"]
    # combine: one reduced row per (token, rank) pair and the output stored; the expert rows
    # and the ring loaded; the peer's rows over NVLink, which bounds it.
    assert combine["bytes"] == {"store": 150 * 2048 + 100 * 2048,
                                "load": 400 * 2048 + 150 * 2048, "nvlink": 80 * 2048}
    assert combine["bound_by"] == "nvlink"
    assert combine["floor_us"] == pytest.approx(163_840 / 200e3, rel=1e-12)
    assert combine["target_us"] == pytest.approx(0.85) and combine["reachable"]


def test_a_target_under_its_floor_is_not_reachable():
    dispatch, _ = bounds.bounds(*_records(0.7))  # 1.1 x 0.7 = 0.77 us < the 0.858 us floor
    assert not dispatch["reachable"]


def test_a_budget_the_rates_record_lacks_is_refused():
    bench, deepep, rates = _records(0.8)
    bench["config"]["sms"] = [32]
    with pytest.raises(ValueError, match="32 CTAs"):
        bounds.bounds(bench, deepep, rates)


def test_a_placement_record_sets_the_store_rate_from_its_best_placed_row():
    """`--placed`: the best store_place rate with the budget's SMs working (62 of 55 and 62 at
    24; the 16-SM row and store_rate's 50 are not used), so the store floor falls with it."""
    bench, deepep, rates = _records(0.8)
    placed = {"rows": [{"kernel": "store_place 8 warps, 24 CTAs on all", "ctas": 24,
                        "gbs_per_cta": 55.0},
                       {"kernel": "store_place 8 warps, 48 CTAs on 0-46%2", "ctas": 24,
                        "gbs_per_cta": 62.0},
                       {"kernel": "store_place 8 warps, 48 CTAs on 0-30%2", "ctas": 16,
                        "gbs_per_cta": 70.0}]}
    dispatch, _ = bounds.bounds(bench, deepep, rates, placed)
    assert dispatch["bound_us"]["store"] == pytest.approx(1_029_200 / (24 * 62e3), rel=1e-12)
    with pytest.raises(ValueError, match="no store_place row with 24"):
        bounds.bounds(bench, deepep, rates, {"rows": placed["rows"][2:]})
