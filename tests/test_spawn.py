"""The multi-process helper (`cute_ep.tools.spawn.run_ranks`) on CPU processes (a gloo group):
a rank that hangs fails the run at the helper's limit with that rank's Python stack, a rank
that dies fails it at once, and a rank that raises fails it without waiting out the limit for
the ranks left waiting on it. The stall report's per-channel runs are checked too."""

from __future__ import annotations

import os
import time

import pytest

from cute_ep.tools.spawn import AFTER_FAILURE_S, RanksFailed, run_ranks


def _rank_and_world(rank, world):
    return rank, world


def _last_rank_hangs(rank, world):
    if rank == world - 1:
        time.sleep(3600)  # stuck on the host
    return rank


def _last_rank_dies(rank, world):
    if rank == world - 1:
        os._exit(7)
    return rank


def _last_rank_raises_first_waits(rank, world, never):
    if rank == world - 1:
        raise ValueError("bad input on the last rank")
    while not os.path.exists(never):  # waits for what the rank that raised would have done
        time.sleep(0.1)
    return rank


def test_every_rank_returns():
    assert run_ranks(_rank_and_world, world=2, gpus=False, limit_s=60) == [(0, 2), (1, 2)]


def test_a_hung_rank_fails_at_the_limit_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failure:
        run_ranks(_last_rank_hangs, world=2, gpus=False, limit_s=8)
    assert time.monotonic() - start < 60
    text = str(failure.value)
    assert text.startswith("ranks [1] did not finish within 8 s (a hang)"), text
    report = text.split("--- rank 1 (did not finish) ---")[1]
    assert "thread MainThread" in report and "time.sleep(3600)" in report, report
    assert "rank 0" not in text.split("---")[0].replace("ranks [1]", ""), text


def test_a_rank_that_dies_fails_the_run_at_once():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 1: the process exited with code 7 before "
                                          "returning a result"):
        run_ranks(_last_rank_dies, world=2, gpus=False, limit_s=600)
    assert time.monotonic() - start < 60


def test_ranks_waiting_on_a_failed_one_are_reported_soon_after_it(tmp_path):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failure:
        run_ranks(_last_rank_raises_first_waits, world=2, gpus=False, limit_s=600,
                  never=str(tmp_path / "never"))
    assert time.monotonic() - start < AFTER_FAILURE_S + 60
    text = str(failure.value)
    assert f"ranks [0] did not finish within {AFTER_FAILURE_S} s of a rank's failure" in text
    assert "rank 1: ValueError: bad input on the last rank" in text
    assert "time.sleep(0.1)" in text.split("--- rank 0 (did not finish) ---")[1]


def test_stall_report_runs_show_the_channels_that_lag():
    from cute_ep.ep import _channel_runs

    assert _channel_runs([4] * 24) == "4"
    assert _channel_runs([5, 5, 4, 5]) == "5 (ch 0-1) 4 (ch 2) 5 (ch 3)"
    assert _channel_runs([0, 1]) == "0 (ch 0) 1 (ch 1)"


def test_stall_report_reads_count_flags_in_words_and_runs():
    from cute_ep.ep import _channel_runs
    from layouts.channels import count_flag, read_count_flag

    flags = [count_flag(2, 24, False)] * 3 + [count_flag(1, 24, False)]
    assert _channel_runs([read_count_flag(w) for w in flags]) == \
        "round 2, 24 channels (ch 0-2) round 1, 24 channels (ch 3)"


def test_a_cpulist_reads_as_its_cpus():
    from cute_ep.tools.spawn import cpu_list

    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list("5") == {5}
    assert cpu_list("\n") == set()


class _Props:
    pci_domain_id, pci_bus_id, pci_device_id = 0, 0x1B, 0


def test_a_gpus_cpus_are_its_numa_nodes_allowed_ones(tmp_path, monkeypatch):
    import torch

    from cute_ep.tools import spawn

    monkeypatch.setattr(spawn, "PCI_DEVICES", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 2, 9, 64})
    assert spawn.gpu_cpus(0) is None  # no such device listed
    (tmp_path / "0000:1b:00.0").mkdir()
    (tmp_path / "0000:1b:00.0" / "local_cpulist").write_text("0-3,64-67\n")
    assert spawn.gpu_cpus(0) == {1, 2, 64}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {20, 21})
    assert spawn.gpu_cpus(0) is None  # none of the node's CPUs allowed: left unbound
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: object())
    assert spawn.gpu_cpus(0) is None  # a torch without the PCI ids
