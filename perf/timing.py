"""Timing shared by the benchmarks."""

import statistics
import time

import torch


def sleep_cycles(us: float) -> int:
    """Clock cycles of `torch.cuda._sleep` that last about `us` microseconds on this GPU."""
    probe = 1 << 20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return max(1, int(probe * us / (start.elapsed_time(end) * 1e3)))


def barrier_median_us(fn, reps: int, gate_us: float = 0.0) -> float:
    """Median CUDA-event time of `fn` in us over `reps` runs (2 warm-up runs first) of a
    multi-GPU benchmark, each started after a synchronisation and a barrier of the default
    process group (so every rank starts it together). The host's launch path is in the time
    unless `gate_us` > 0: the start event and `fn`'s launches then queue behind a device sleep
    that long (as `median_ms` gates them), for launches that take the host a while."""
    import torch.distributed as dist

    cycles = sleep_cycles(gate_us) if gate_us > 0 else 0
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if cycles:
            torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def median_ms(fn, reps: int, flush: torch.Tensor, gate_us: float = 200.0, prep=None) -> float:
    """Median CUDA-event time of `fn` in ms over `reps` runs (3 warm-up runs first), with
    `flush` zeroed before each run to evict L2 (or `prep()` run instead, outside the timed
    region).

    The time is the GPU's: each run's start event and `fn`'s launches are queued behind a device
    sleep of `gate_us`, so the GPU never waits for the host's Python path inside the timed
    region (a slow host would otherwise add its launch time to the kernel's). A run whose host
    path outlasts the sleep is repeated with a sleep twice as long."""
    cycles = sleep_cycles(gate_us)
    times = []
    while len(times) < reps + 3:
        if prep is None:
            flush.zero_()
        else:
            prep()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        host = time.perf_counter()
        start.record()
        fn()
        end.record()
        host = (time.perf_counter() - host) * 1e6
        end.synchronize()
        if host > 0.8 * gate_us:  # the GPU may have reached `start` before the last launch
            gate_us *= 2
            cycles = sleep_cycles(gate_us)
            continue
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def report_copies(title: str, ctas_column: str, gbs_column: str, rows: list[dict], device: str,
                  json_path: str | None) -> None:
    """Print (kernel, CTAs, us, GB/s) rows as a rich table and write them, with the device and
    the command line, to `json_path` when given."""
    import json
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("kernel", ctas_column, "time (us)", gbs_column):
        table.add_column(col)
    for row in rows:
        table.add_row(row["kernel"], str(row["ctas"]), f"{row['us']:.1f}", f"{row['gbs']:.0f}")
    Console().print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": device, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
