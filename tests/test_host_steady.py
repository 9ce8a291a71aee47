"""perf/host_steady.py's rank pinning, without a GPU."""

import sys

import pytest

sys.path.insert(0, "perf")
import host_steady  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def test_each_rank_pins_itself_to_a_cpu_of_its_own(monkeypatch):
    """Rank r takes the (r + 1)-th of its GPU's allowed CPUs (the first left to the system), so
    no two ranks share one; too few CPUs: no pinning."""
    import cute_ep.tools.spawn as spawn

    pinned = []
    monkeypatch.setattr(spawn, "gpu_cpus", lambda index: {8, 9, 10, 11})
    monkeypatch.setattr(host_steady.os, "sched_setaffinity", lambda pid, cpus: pinned.append(cpus))
    assert [host_steady._pin(r) for r in range(3)] == [9, 10, 11]
    assert pinned == [{9}, {10}, {11}]
    assert host_steady._pin(3) is None and len(pinned) == 3
    # Without a known GPU node: the process's allowed CPUs.
    monkeypatch.setattr(spawn, "gpu_cpus", lambda index: None)
    monkeypatch.setattr(host_steady.os, "sched_getaffinity", lambda pid: {0, 1})
    assert host_steady._pin(0) == 1
    assert host_steady._pin(1) is None
