"""perf/compare_libraries.py: Nsight Compute's CSV metrics become one record per launch."""

import sys

import pytest

sys.path.insert(0, "perf")
from compare_libraries import parse  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"')


def _row(launch, metric, unit, value):
    return (f'"{launch}","10","python3","host","kernel_FusedSilu_0","1","7","(1024, 1, 1)",'
            f'"(132, 1, 1)","0","9.0","Command line profiler metrics","{metric}","{unit}",'
            f'"{value}"')


def test_launches_in_order_with_their_metrics():
    text = "\n".join([
        "==PROF== Connected to process 10",
        HEAD,
        _row(1, "gpu__time_duration.sum", "ns", "122,048"),
        _row(1, "sm__inst_executed.sum", "inst", "60,960,572"),
        _row(1, "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "45.10"),
        _row(0, "gpu__time_duration.sum", "us", "39.80"),
        _row(0, "sm__issue_active.avg.pct_of_peak_sustained_active", "%", "66.2"),
        _row(0, "launch__registers_per_thread", "register/thread", "64"),
        "==PROF== Disconnected from process 10",
    ])
    launches = parse(text)
    assert launches == [
        {"us": 39.8, "issue_pct": 66.2, "registers": 64.0},
        {"us": 122.048, "warp_instructions": 60960572.0},
    ]


def test_no_csv_is_no_launch():
    assert parse("==PROF== Connected to process 10\nno kernels matched\n") == []


def test_an_unknown_time_unit_is_an_error():
    with pytest.raises(KeyError):
        parse("\n".join([HEAD, _row(0, "gpu__time_duration.sum", "fortnight", "1")]))
