"""Timing shared by the single-GPU benchmarks."""

import statistics

import torch


def median_ms(fn, reps: int, flush: torch.Tensor) -> float:
    """Median CUDA-event time of `fn` in ms over `reps` runs (3 warm-up runs first), with
    `flush` zeroed before each run to evict L2."""
    times = []
    for _ in range(reps + 3):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])
