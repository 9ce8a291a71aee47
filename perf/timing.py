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
