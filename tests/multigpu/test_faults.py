"""Faults: a rank killed in the middle of a layer, Ctrl-C while a kernel spins on a peer, and a
layer that stalls under the multi-process helper.

- The killed rank's peers raise the named timeout within the bound, and the next run on the same
  GPUs (fresh processes) is exact: nothing the dead process left behind breaks it.
- SIGINT to a rank blocked in `Buffer.check()` while its peer never arrives raises
  KeyboardInterrupt within a second or two, not after the kernel's timeout.
- A layer whose last rank never dispatches, under the production timeout: `run_ranks` fails at
  its own limit (not the kernel's 300 s) with every stalled rank's Python stack and Buffer
  counters, which show the waiting ranks inside dispatch with their round not advanced.
"""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from cute_ep.tools.spawn import RanksFailed, init_rank, run_ranks

pytestmark = pytest.mark.multigpu


def _report_and_exit(results, item):
    """Put `item`, flush the queue, and leave without the NCCL teardown (a peer is gone)."""
    results.put(item)
    results.close()
    results.join_thread()
    os._exit(0)


def _killed_layer(rank, world, store, results, timeout_s):
    from cute_ep.ep import Buffer
    from cute_ep.runtime.comm import PeerTimeout
    from layouts import EPConfig
    from tests.multigpu.test_ep import _inputs

    init_rank(rank, world, store)
    cfg = EPConfig(1024, 4, 8 * world, world, 128)
    buf = Buffer(cfg, timeout_s=timeout_s)
    xs, ids, ws = _inputs(cfg, 3, [128] * world)
    out = buf.dispatch(xs[rank], ids[rank], ws[rank])
    buf.check()
    start = time.monotonic()
    if rank == world - 1:
        os._exit(3)  # dies between dispatch and combine, its sends done, its combine never
    buf.combine(torch.zeros(cfg.row_capacity, cfg.hidden, dtype=torch.bfloat16, device="cuda"),
                out.handle)
    try:
        buf.check()
        message = "no error"
    except PeerTimeout as exc:
        message = str(exc)
    _report_and_exit(results, (rank, message, time.monotonic() - start))


def _spawn(target, world, folder, **kwargs):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(folder, "store")
    procs = [ctx.Process(target=target, args=(r, world, store, results), kwargs=kwargs,
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, results


def _collect(procs, results, count, limit_s):
    got = []
    try:
        for _ in range(count):
            got.append(results.get(timeout=limit_s))
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return sorted(got)


def _exact_layer(rank, world):
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from tests.multigpu.test_ep import _one_layer

    cfg = EPConfig(1024, 4, 8 * world, world, 128, "fp8")
    _one_layer(Buffer(cfg), cfg, rank, 9, [128] * world)
    return True


def test_a_killed_rank_times_out_its_peers_and_leaves_nothing_behind(tmp_path):
    world = torch.cuda.device_count()
    procs, results = _spawn(_killed_layer, world, tmp_path, timeout_s=2.0)
    got = _collect(procs, results, world - 1, limit_s=120)
    assert [r for r, _, _ in got] == list(range(world - 1)), got
    for rank, message, seconds in got:
        assert message.startswith(f"combine: rank {rank} timed out after 2 s waiting for rank "
                                  f"{world - 1}"), message
        assert seconds < 15, seconds
    assert procs[-1].exitcode == 3
    # Fresh processes on the same GPUs: exact again.
    assert all(run_ranks(_exact_layer, limit_s=180))


def _interrupted(rank, world, store, results):
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from tests.multigpu.test_ep import _inputs

    init_rank(rank, world, store)
    cfg = EPConfig(1024, 4, 8 * world, world, 64)
    buf = Buffer(cfg, timeout_s=60.0)
    if rank != 0:
        time.sleep(20)  # never dispatches
        os._exit(0)
    xs, ids, ws = _inputs(cfg, 4, [64] * world)
    buf.dispatch(xs[0], ids[0], ws[0])
    results.put(("waiting", time.monotonic()))
    try:
        buf.check()
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "interrupted"
    _report_and_exit(results, (outcome, time.monotonic()))


def test_ctrl_c_during_a_spin_returns_control(tmp_path):
    world = 2
    procs, results = _spawn(_interrupted, world, tmp_path)
    state, _ = results.get(timeout=120)
    assert state == "waiting"
    time.sleep(1.0)  # rank 0 is now inside check(), its receive kernel spinning on rank 1
    sent = time.monotonic()
    os.kill(procs[0].pid, signal.SIGINT)
    outcome, at = results.get(timeout=30)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    assert outcome == "interrupted"
    assert at - sent < 3.0, f"control came back {at - sent:.1f} s after Ctrl-C"


def _one_rank_never_dispatches(rank, world):
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from tests.multigpu.test_ep import _inputs

    cfg = EPConfig(1024, 4, 8 * world, world, 128)
    buf = Buffer(cfg)  # the production timeout: nothing on the device gives up first
    xs, ids, ws = _inputs(cfg, 3, [128] * world)
    if rank == world - 1:
        time.sleep(3600)  # a rank stuck on the host
    buf.dispatch(xs[rank], ids[rank], ws[rank])
    buf.check()  # waits for the rank that never comes
    return True


def test_a_stalled_layer_fails_with_every_ranks_stack_and_counters():
    world = torch.cuda.device_count()
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failure:
        run_ranks(_one_rank_never_dispatches, limit_s=40)
    seconds = time.monotonic() - start
    assert seconds < 120, seconds  # the helper's limit and its reports, not the kernel's timeout
    text = str(failure.value)
    assert f"ranks {list(range(world))} did not finish within 40" in text, text[:2000]
    for rank in range(world):
        report = text.split(f"--- rank {rank} (did not finish) ---")[1].split("--- rank")[0]
        assert "_one_rank_never_dispatches" in report, report
        assert "device state:" in report, report
        state = report.split("device state:")[1]
        if rank == world - 1:  # on the host, in its sleep, nothing launched
            assert "time.sleep(3600)" in report, report
            assert "host launched 0 dispatches" in state, state
        else:  # in check(), its dispatch launched and not finished: the round has not advanced
            assert "buf.check()" in report, report
            assert "host launched 1 dispatches, 0 combines; device round 0" in state, state
            # Every running rank raised its count flags here for round 1 (its 24 channels, the
            # default budget; 128 tokens a rank: prefixed counts); the silent rank's never came.
            flags = state.split("count flags parity 0: ")[1].split("\n")[0].split("; ")
            assert flags[world - 1] == f"rank {world - 1}: none", flags
            raised = "round 1, 24 channels, prefixed counts"
            assert all(f == f"rank {r}: {raised}" for r, f in enumerate(flags[:-1])), flags
