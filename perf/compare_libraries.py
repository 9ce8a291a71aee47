"""Two kernel libraries side by side in Nsight Compute, one launch of each quantization kernel,
clocks as the card sets them:

    python perf/compare_libraries.py BEFORE_LIBRARY AFTER_LIBRARY [--intermediate 2048 7168]
        [--json FILE]

Per size, both libraries in turn (`CUTE_EP_LIBRARY`), `perf/ncu_kernels.py --silu-only` under
`ncu --clock-control none` (the card's clocks are never locked or changed): time, warp
instructions (which no clock moves), issue activity, long-scoreboard stalls and registers per
kernel. How far each kernel is from copy speed is `perf/bench_quant.py`'s question.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from ncu_kernels import QUANTIZE_LAUNCH, SILU_LAUNCHES  # noqa: E402

METRICS = {
    "gpu__time_duration.sum": "us",
    "sm__inst_executed.sum": "warp_instructions",
    "sm__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "warps_active_pct",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio":
        "long_scoreboard_per_issue",
    "launch__registers_per_thread": "registers",
}
KERNELS = "regex:FusedSilu|QuantizeNvfp4"


def parse(text: str) -> list[dict]:
    """Nsight Compute's `--csv` metrics output -> one dict per profiled launch, in launch order,
    with the METRICS under their short names (time in us)."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if not rows:
        return []
    header = {name: i for i, name in enumerate(rows[0])}
    launches: dict[int, dict] = {}
    for row in rows[1:]:
        name = METRICS.get(row[header["Metric Name"]])
        if name is None:
            continue
        value = float(row[header["Metric Value"]].replace(",", ""))
        if name == "us":
            unit = row[header["Metric Unit"]]
            value /= {"ns": 1e3, "us": 1.0, "usecond": 1.0, "msecond": 1e-3, "ms": 1e-3}[unit]
        launches.setdefault(int(row[header["ID"]]), {})[name] = value
    return [launches[i] for i in sorted(launches)]


def profile(library: str, intermediate: int) -> list[dict]:
    """The kernels of ncu_kernels.py's SwiGLU family and quantize_nvfp4 from `library`."""
    names = [*SILU_LAUNCHES, QUANTIZE_LAUNCH]
    cmd = ["ncu", "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv", "-k",
           KERNELS, sys.executable, str(Path(__file__).parent / "ncu_kernels.py"),
           "--silu-only", "--intermediate", str(intermediate)]
    env = dict(os.environ, CUTE_EP_LIBRARY=str(Path(library).resolve()))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    launches = parse(done.stdout)
    if done.returncode or len(launches) != len(names):
        raise RuntimeError(f"ncu on {library} (I={intermediate}) gave {len(launches)} launches "
                           f"for {len(names)} kernels, exit {done.returncode}:\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return [dict(kernel=n, intermediate=intermediate, **m) for n, m in zip(names, launches)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--intermediate", type=int, nargs="+", default=[2048, 7168])
    p.add_argument("--json", help="also write both libraries' launches to this file")
    args = p.parse_args()
    runs = {"before": [], "after": []}
    for i in args.intermediate:
        for side in ("before", "after"):
            runs[side] += profile(getattr(args, side), i)
    table = Table(title=f"Nsight Compute, one launch each: {args.before} -> "
                        f"{args.after}")
    for col in ("kernel", "I", "us", "change", "warp instr (M)", "issue %", "long sb / issue",
                "registers"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for b, a in zip(runs["before"], runs["after"]):
        table.add_row(b["kernel"], str(b["intermediate"]), f"{b['us']:.1f} -> {a['us']:.1f}",
                      f"{a['us'] / b['us'] - 1:+.1%}",
                      f"{b['warp_instructions'] / 1e6:.2f} -> {a['warp_instructions'] / 1e6:.2f}",
                      f"{b['issue_pct']:.0f} -> {a['issue_pct']:.0f}",
                      f"{b['long_scoreboard_per_issue']:.2f} -> "
                      f"{a['long_scoreboard_per_issue']:.2f}",
                      f"{b['registers']:.0f} -> {a['registers']:.0f}")
    Console(width=160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": args.before, "after": args.after, **runs}, f, indent=1)


if __name__ == "__main__":
    main()
