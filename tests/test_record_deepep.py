"""perf/record_deepep.py: a DeepEP test_intranode log becomes a JSON record beside the bench
record of its lease."""

import json
import subprocess
import sys

import pytest

sys.path.insert(0, "perf")
from record_deepep import parse, parse_low_latency  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)

LOG = """[config] num_tokens=4096, hidden=7168, num_topk=8
[layout] Kernel performance: 0.034 ms
[testing] Running with BF16, without top-k (async=False, previous=False) ... passed
[testing] Running with FP8, with top-k (async=True, previous=True) ... passed
[testing] Running with FP8, without top-k (async=True, previous=True) ... failed
[tuning] SMs 24, NVL chunk 4: 101.00 GB/s (NVL), 900.00 us
[tuning] Best dispatch (FP8): SMs 24, NVL chunk 26, 340.19 GB/s (NVL), t: 321.20 us
[tuning] Best dispatch (BF16): SMs 24, NVL chunk 8, 401.88 GB/s (NVL), t: 527.31 us
[tuning] Best combine: SMs 24, NVL chunk 9: 355.82 GB/s (NVL), t: 595.57 us
"""


def test_the_best_lines_and_cases_are_read_exactly():
    record = parse(LOG)
    assert record["config"] == {"tokens": 4096, "hidden": 7168, "topk": 8}
    assert (record["cases_passed"], record["cases_failed"]) == (2, 1)
    assert record["best"] == {
        "dispatch_fp8": {"sms": 24, "nvl_chunk": 26, "nvl_gbps": 340.19, "us": 321.2},
        "dispatch_bf16": {"sms": 24, "nvl_chunk": 8, "nvl_gbps": 401.88, "us": 527.31},
        "combine": {"sms": 24, "nvl_chunk": 9, "nvl_gbps": 355.82, "us": 595.57}}


def test_a_verdict_after_interleaved_output_is_its_cases_and_no_other():
    """A warning printed inside a case's line puts its verdict on a later line; a case that
    never printed one (the run died) does not take the next case's."""
    split = LOG.replace(
        "(async=False, previous=False) ... passed",
        "(async=False, previous=False) .../face.py:98: UserWarning: NVLink chunk sizes\n"
        "  recv_x = buffer.dispatch(**args)\n passed")
    assert (parse(split)["cases_passed"], parse(split)["cases_failed"]) == (2, 1)
    dead = LOG.replace("(async=True, previous=True) ... passed", "(async=True, previous=True) ...")
    assert (parse(dead)["cases_passed"], parse(dead)["cases_failed"]) == (1, 1)


def test_a_log_without_config_or_results_is_refused():
    with pytest.raises(ValueError, match="not a DeepEP"):
        parse("Traceback (most recent call last):\n")
    with pytest.raises(ValueError, match="did not finish"):
        parse(LOG.split("[tuning]")[0])


def test_the_record_lands_beside_the_bench_record(tmp_path):
    bench = tmp_path / "bench-2026-11-22-4xH200.json"
    bench.write_text(json.dumps({"date": "2026-11-22T23:23:09+00:00", "device": "NVIDIA H200",
                                 "gpus": 4}))
    log = tmp_path / "deepep.log"
    log.write_text(LOG)
    subprocess.run([sys.executable, "perf/record_deepep.py", str(log), "--beside", str(bench)],
                   check=True, capture_output=True)
    record = json.loads((tmp_path / "deepep-2026-11-22-4xH200.json").read_text())
    assert (record["beside"], record["gpus"], record["best"]["dispatch_bf16"]["us"]) == \
        (bench.name, 4, 527.31)


LL_LOG = """Allocating buffer size: 1234.5 MB ...
[rank 1] Dispatch + combine bandwidth: 40.10 GB/s, avg_t=101.50 us, min_t=99.00 us, max_t=110.00 us
[rank 0] Dispatch + combine bandwidth: 41.20 GB/s, avg_t=98.25 us, min_t=97.00 us, max_t=105.00 us
[rank 0] Dispatch bandwidth: 80.00 GB/s, avg_t=33.10 us | Combine bandwidth: 90.00 GB/s, avg_t=55.50 us
[rank 1] Dispatch bandwidth: 78.50 GB/s, avg_t=34.25 us | Combine bandwidth: 91.00 GB/s, avg_t=54.75 us
[rank 0] Dispatch send/recv time: 10.00 + 20.00 us | Combine send/recv time: 15.00 + 30.00 us
[rank 1] Dispatch send/recv time: 11.50 + 19.25 us | Combine send/recv time: 14.00 + 31.00 us
"""


def test_a_low_latency_log_gives_every_rank_and_the_slowest():
    record = parse_low_latency(LL_LOG)
    assert (record["dispatch_us"], record["combine_us"]) == (34.25, 55.5)
    assert record["ranks"][1] == {
        "dispatch_combine_us": 101.5, "dispatch_us": 34.25, "dispatch_gbps": 78.5,
        "combine_us": 54.75, "combine_gbps": 91.0, "dispatch_send_us": 11.5,
        "dispatch_recv_us": 19.25, "combine_send_us": 14.0, "combine_recv_us": 31.0}
    with pytest.raises(ValueError, match="not a finished DeepEP test_low_latency log"):
        parse_low_latency(LL_LOG.split("[rank 0] Dispatch bandwidth")[0])


@pytest.mark.parametrize("face", [False, True])
def test_a_low_latency_record_is_named_for_its_test_and_side(tmp_path, face):
    bench = tmp_path / "bench-2026-11-26-2xH200.json"
    bench.write_text(json.dumps({"date": "2026-11-26T08:00:00+00:00", "device": "NVIDIA H200",
                                 "gpus": 2}))
    log = tmp_path / "ll.log"
    log.write_text(LL_LOG)
    subprocess.run([sys.executable, "perf/record_deepep.py", str(log), "--beside", str(bench),
                    *(["--face"] if face else [])], check=True, capture_output=True)
    name = ("deepep_face-ll-" if face else "deepep-ll-") + "2026-11-26-2xH200.json"
    record = json.loads((tmp_path / name).read_text())
    assert record["beside"] == bench.name and record["dispatch_us"] == 34.25
    assert ("cute_ep.deepep" in record["baseline"]) == face
    assert "test_low_latency.py" in record["baseline"]


def test_the_committed_baselines_name_a_committed_bench_record():
    from pathlib import Path

    records = sorted(Path("perf/results").glob("deepep-*.json"))
    assert records
    for path in records:
        record = json.loads(path.read_text())
        bench = json.loads((path.parent / record["beside"]).read_text())
        assert (record["date"], record["gpus"]) == (bench["date"], bench["gpus"])
        if path.name.startswith("deepep-ll-"):  # test_low_latency.py: every rank's times
            assert len(record["ranks"]) == record["gpus"]
            assert record["dispatch_us"] == max(r["dispatch_us"] for r in record["ranks"])
            assert record["combine_us"] == max(r["combine_us"] for r in record["ranks"])
            continue
        assert record["cases_failed"] == 0 and set(record["best"]) == {
            "dispatch_fp8", "dispatch_bf16", "combine"}
