"""Run a function on every visible GPU, one process each, with a hard time limit (the demo,
the multi-GPU tests)."""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

# NVLink multicast stays off: it can take a shared host's GPUs out of service.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


class RanksFailed(AssertionError):
    """A rank raised, or did not finish in time; the message holds every failing rank's error."""


def init_rank(rank: int, world: int, store_path: str) -> None:
    """In a rank's process: multicast off, its GPU current, the NCCL group joined through a file
    store (no TCP port to race for between back-to-back runs)."""
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))


def _entry(fn, rank, world, store_path, results, kwargs):
    import torch.distributed as dist

    init_rank(rank, world, store_path)
    try:
        results.put((rank, True, fn(rank, world, **kwargs)))
    except BaseException as exc:  # report everything, the parent decides
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int | None = None, limit_s: float = 180.0, **kwargs) -> list:
    """`fn(rank, world, **kwargs)` on each rank; returns the per-rank results, or raises with every
    failing rank's error. Processes still running after `limit_s` are killed: a hang fails."""
    os.environ.update(SAFE_ENV)
    world = world or torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="cute-ep-ranks-")
    store_path = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store_path, results, kwargs),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=limit_s)
            got[rank] = (ok, value)
    except queue.Empty:
        raise RanksFailed(f"ranks {sorted(set(range(world)) - set(got))} did not finish within "
                             f"{limit_s} s (hang)") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        raise RanksFailed("\n".join(f"rank {r}: {v}" for r, v in sorted(failed.items())))
    return [got[r][1] for r in range(world)]
