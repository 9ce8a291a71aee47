"""Run a function on every visible GPU, one process each, with a hard time limit (the demo,
the multi-GPU tests). A rank that does not finish in time is not just killed: first every rank
still running reports its Python stacks and its Buffers' device counters
(`cute_ep.ep.stall_report`), and the failure carries those reports, so a layer that stalls
says which wait never ended."""

from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

# NVLink multicast stays off: it can take a shared host's GPUs out of service.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
# Where Linux lists each PCI device's NUMA-local CPUs (`gpu_cpus`).
PCI_DEVICES = "/sys/bus/pci/devices"
# After one rank has failed, how long the others get to finish before they are reported as
# stalled (they may be waiting, on the device, for the rank that failed).
AFTER_FAILURE_S = 20.0
# How long the stalled ranks get to write their reports before they are killed.
REPORT_S = 30.0


class RanksFailed(AssertionError):
    """A rank raised, or did not finish in time; the message holds every failing rank's error
    and, for a rank that did not finish, its stall report."""


def cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux cpulist ("0-15,64-79")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_cpus(index: int) -> set[int] | None:
    """The CPUs this process may run on that sit on GPU `index`'s NUMA node (its PCI device's
    `local_cpulist`), or None where that is unknown or none of them are allowed."""
    props = torch.cuda.get_device_properties(index)
    try:
        bdf = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(os.path.join(PCI_DEVICES, bdf, "local_cpulist")) as f:
            local = cpu_list(f.read())
    except (AttributeError, OSError, ValueError):
        return None
    return (local & os.sched_getaffinity(0)) or None


def init_rank(rank: int, world: int, store_path: str, gpus: bool = True,
              bind_cpus: bool = False) -> None:
    """In a rank's process: multicast off, its GPU current, the NCCL group joined through a file
    store (no TCP port to race for between back-to-back runs). `gpus` False: a gloo group of
    CPU processes (the helper's own tests). `bind_cpus`: the process runs only on its GPU's
    NUMA node's CPUs (`gpu_cpus`), as a serving engine pins its ranks, so host times do not
    depend on where the scheduler moved it."""
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    init = f"file://{store_path}"
    if not gpus:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        return
    torch.cuda.set_device(rank)
    if bind_cpus and (cpus := gpu_cpus(rank)):
        os.sched_setaffinity(0, cpus)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def rank_report() -> str:
    """This process's Python stacks (every thread) and, if cute_ep.ep is in use, its Buffers'
    device counters."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, ident)}:\n{stack}")
    ep = sys.modules.get("cute_ep.ep")
    if ep is not None:
        parts.append("device state:\n" + ep.stall_report())
    return "\n".join(parts)


def _watch(rank: int, ask_path: str, results) -> None:
    """A rank's reporter thread: once the parent asks (creates `ask_path`; a file, since a
    multiprocessing Event's set() waits for every process that ever waited on it, dead ones
    included), send `rank_report()`."""
    while not os.path.exists(ask_path):
        time.sleep(0.25)
    try:
        text = rank_report()
    except BaseException as exc:  # the parent still gets something
        text = f"report failed: {type(exc).__name__}: {exc}"
    results.put((rank, "stalled", text))


def _entry(fn, rank, world, store_path, gpus, bind_cpus, results, ask_path, stacks_path,
           kwargs):
    import torch.distributed as dist

    # Stacks without the GIL, for a main thread stuck in a call that holds it.
    stacks = open(stacks_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Thread(target=_watch, args=(rank, ask_path, results), daemon=True,
                     name="stall-reporter").start()
    init_rank(rank, world, store_path, gpus, bind_cpus)
    try:
        results.put((rank, "ok", fn(rank, world, **kwargs)))
    except BaseException as exc:  # report everything, the parent decides
        results.put((rank, "failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int | None = None, limit_s: float = 180.0, gpus: bool = True,
              bind_cpus: bool = False, **kwargs) -> list:
    """`fn(rank, world, **kwargs)` on each rank (a GPU each; `gpus` False: CPU processes in a
    gloo group; `bind_cpus`: each on its GPU's NUMA node's CPUs, `init_rank`); returns the
    per-rank results, or raises with every failing rank's error. Ranks still running after
    `limit_s` (or AFTER_FAILURE_S after another rank failed) report their stacks and device
    state, then are killed: a hang fails, and says where it hung."""
    os.environ.update(SAFE_ENV)
    world = world or torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="cute-ep-ranks-")
    store_path = os.path.join(store_dir, "store")
    ask_path = os.path.join(store_dir, "report")
    stacks = [os.path.join(store_dir, f"stacks-{r}") for r in range(world)]
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store_path, gpus, bind_cpus,
                                              results, ask_path, stacks[r], kwargs), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, reports = {}, {}
    deadline = time.monotonic() + limit_s
    failed_at = None
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, kind, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                # A process that died without a word (a crash, os._exit) fails now, not at the
                # limit; what it put before dying is read first.
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if not dead:
                    continue
                time.sleep(0.5)
                while True:
                    try:
                        rank, kind, value = results.get_nowait()
                    except queue.Empty:
                        break
                    got[rank] = (kind, value)
                silent = [r for r in dead if r not in got]
                for r in silent:
                    got[r] = ("failed", f"the process exited with code {procs[r].exitcode} "
                                        f"before returning a result")
            else:
                got[rank] = (kind, value)
            if failed_at is None and any(kind == "failed" for kind, _ in got.values()):
                failed_at = time.monotonic()
                deadline = min(deadline, failed_at + AFTER_FAILURE_S)
        stalled = sorted(set(range(world)) - set(got))
        if stalled:
            reports = _collect_reports(stalled, procs, results, ask_path, stacks, got)
    finally:
        for p in procs:
            p.join(timeout=30 if not reports else 1)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    failed = {r: v for r, (kind, v) in got.items() if kind == "failed"}
    if reports or failed:
        lines = [f"rank {r}: {v}" for r, v in sorted(failed.items())]
        if reports:
            within = f"{AFTER_FAILURE_S} s of a rank's failure" if failed else f"{limit_s} s"
            lines.insert(0, f"ranks {sorted(reports)} did not finish within {within} (a hang); "
                            f"their stacks and device state follow")
            lines += [f"--- rank {r} (did not finish) ---\n{v}" for r, v in sorted(reports.items())]
        raise RanksFailed("\n".join(lines))
    return [got[r][1] for r in range(world)]


def _collect_reports(stalled, procs, results, ask_path, stacks, got) -> dict[int, str]:
    """Ask every rank for its report; a rank that sends none in REPORT_S gets SIGUSR1, whose
    stacks faulthandler writes without the GIL."""
    open(ask_path, "w").close()
    reports: dict[int, str] = {}
    end = time.monotonic() + REPORT_S
    while set(stalled) - set(reports) and time.monotonic() < end:
        try:
            rank, kind, value = results.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            break
        if kind == "stalled":
            if rank in stalled:
                reports[rank] = value
        else:  # finished after all, while the reports were asked for
            got[rank] = (kind, value)
            if rank in stalled:
                stalled = [r for r in stalled if r != rank]
    for r in stalled:
        if r in reports:
            continue
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
        try:
            with open(stacks[r]) as f:
                text = f.read()
        except OSError:
            text = ""
        reports[r] = "no report from the rank's reporter thread; faulthandler's stacks:\n" + \
            (text or "(none written: the process had exited)")
    return reports
