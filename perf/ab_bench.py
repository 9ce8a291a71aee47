"""Two or more builds of the transport side by side in `cute-ep bench`, runs alternated on the
same GPUs (the sides see the same cards, clocks and NVLinks):

    python perf/ab_bench.py --side main=TREE:LIBRARY --side new=.:build/lib-new [--runs 2]
        [--side-args 'new=--ring-chunks 8'] [--json FILE] [--run-timeout S] [-- BENCH ARGUMENTS]
        (bench arguments e.g. -- --formats bf16,fp8 --sms 24 --no-stages)

A side is a name, a source tree (its `cute_ep`, whose Python drives its kernels) and a kernel
library folder; each run calls every side's `cute-ep bench` once, in the order given, in its own
processes (`CUTE_EP_LIBRARY` and `PYTHONPATH` set to the side's), with the bench arguments
after `--` and then the side's own (`--side-args NAME=ARGS`: two sides of one tree and library
that differ in a Buffer setting such as `--ring-chunks`). The table gives, per operation,
format and SM budget (and decode's CUDA-graph times), each side's slowest-rank time as the range
over runs, and each later side's median change from the first; a second table the traced
calls' stamps and waits (TRACE_FIELDS) per side, when the bench recorded them; `--json` keeps every run's
record. Stopped by SIGTERM (an outer time limit), it kills the running side's processes and
reports the runs it has. A tree without the change can be exported next to the working tree, e.g.
`git archive main cute_ep perf kernels layouts | tar -x -C build/tree-main`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this tree's cute_ep reads records
from ab_quant import (alternated, parse_side, recorded_argv, run_side,  # noqa: E402
                      summary_rows)

# Decode figures a side-by-side table shows: (record field, the table's SMs label).
DECODE = (("graph_dispatch_us", "decode"), ("graph_combine_us", "decode"),
          ("kernel_dispatch_us", "decode kernels"), ("kernel_combine_us", "decode kernels"))


def bench_times(record: dict) -> dict[tuple, float]:
    """{(operation, format, SMs): the slowest rank's time in us} of a `cute-ep bench` record:
    throughput dispatch and combine at each SM budget, decode's graph-replayed dispatch and
    combine (SMs "decode") and, where recorded, their kernels' time by DeepEP's low-latency
    method (SMs "decode kernels"); where recorded, the throughput calls timed back to back by
    DeepEP's normal-mode method (SMs "<budget> lockstep")."""
    from cute_ep.tools.plot import bench_series

    out = {(phase, fmt, f"{sms}{label}"): us
           for field, label in (("{phase}_us", ""), ("lockstep_{phase}_us", " lockstep"))
           for (phase, fmt), points in bench_series(record, field)["series"].items()
           for sms, us in points}
    ranks = record["ranks"]
    for fmt in ranks[0]["formats"]:
        decode = [r["formats"][fmt].get("decode") for r in ranks]
        if all(decode):
            for key, label in DECODE:
                if all(key in d for d in decode):
                    out[(key.split("_")[1], fmt, label)] = max(d[key] for d in decode)
    return out


# The traced calls' stamps and waits a side-by-side table shows (us, the slowest rank's).
TRACE_FIELDS = {"dispatch": ("counts_arrived", "first_batch", "send_done", "recv_done", "end",
                             "fence_us", "copy_us", "credit_wait_us", "recv_wait_us",
                             "header_us", "place_us", "drain_us", "sync_us", "land_us",
                             "free_us"),
                "combine": ("send_done", "end", "tail_wait_us", "credit_wait_us")}


def trace_times(record: dict) -> dict[tuple, float]:
    """{(operation, format, SMs, field): the slowest rank's value} of the traced dispatch and
    combine a `cute-ep bench` record keeps per format and SM budget (TRACE_FIELDS)."""
    out: dict[tuple, float] = {}
    for rank in record["ranks"]:
        for fmt, entry in rank["formats"].items():
            for point in entry["throughput"]["sweep"]:
                sms = str(record["config"]["sms_per_gpu"] if point["sms"] == "all"
                          else point["sms"])
                for op, fields in TRACE_FIELDS.items():
                    trace = point.get(f"{op}_trace_us") or {}
                    for field in fields:
                        if field in trace:
                            key = (op, fmt, sms, field)
                            out[key] = max(out.get(key, float("-inf")), trace[field])
    return out


def trace_rows(runs: dict[str, list[dict]], sides: list[str]) -> list[list[str]]:
    """Rows (operation, format, SMs, field, each side's median over its runs) of the traced
    calls, in the first side's order; a field a side did not record is '-'."""
    per_side = {side: [trace_times(r) for r in records] for side, records in runs.items()}
    rows = []
    for key in per_side[sides[0]][0]:
        cells = []
        for side in sides:
            values = sorted(t[key] for t in per_side[side] if key in t)
            cells.append(f"{values[len(values) // 2]:.1f}" if values else "-")
        rows.append([*key, *cells])
    return rows


def collect(runs: dict[str, list[dict]]) -> dict[tuple, dict[str, list[float]]]:
    """{side: [bench records]} -> {(operation, format, SMs): {side: [us a run]}}, in the first
    side's order."""
    table: dict[tuple, dict[str, list[float]]] = {}
    for side, records in runs.items():
        for record in records:
            for key, us in bench_times(record).items():
                table.setdefault(key, {}).setdefault(side, []).append(us)
    return table


class _Stopped(Exception):
    """SIGTERM arrived: report the runs so far."""


def _stop(signum, frame):
    raise _Stopped()


def parse_side_args(text: str) -> tuple[str, list[str]]:
    """'NAME=ARGS' -> (NAME, the arguments split as a shell would)."""
    name, sep, rest = text.partition("=")
    if not (name and sep and rest.strip()):
        raise argparse.ArgumentTypeError(f"--side-args is NAME=ARGS, got {text!r}")
    return name, shlex.split(rest)


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=parse_side, action="append", required=True,
                   help="NAME=TREE:LIBRARY (two or more; the first is the baseline)")
    p.add_argument("--side-args", type=parse_side_args, action="append", default=[],
                   help="NAME=ARGS: bench arguments for side NAME alone, after the shared ones")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--run-timeout", type=float, default=900.0,
                   help="seconds one side's bench may take before it is killed and the side "
                        "reported as failed (a build that stalls must not stop the others)")
    args = p.parse_args(argv)
    if len(args.side) < 2 or len({s[0] for s in args.side}) != len(args.side):
        p.error("give two or more sides with distinct names")
    own = dict(args.side_args)
    if len(own) != len(args.side_args) or not own.keys() <= {s[0] for s in args.side}:
        p.error("--side-args names a side once, and only a side given by --side")
    from rich.console import Console
    from rich.table import Table

    runs: dict[str, list[dict]] = {name: [] for name, _, _ in args.side}
    failed: dict[str, str] = {}  # a side whose bench failed is reported and not run again
    stopped = False
    signal.signal(signal.SIGTERM, _stop)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for r, name, tree, library in alternated(args.side, args.runs):
                if name in failed:
                    continue
                out = Path(tmp) / f"{name}-{r}"
                done = run_side(tree, library, [sys.executable, "-m", "cute_ep.tools.cli",
                                                "bench", "--out", str(out), *bench_args,
                                                *own.get(name, [])],
                                timeout=args.run_timeout)
                records = sorted(out.glob("bench-*.json"))
                if done.returncode or not records:
                    failed[name] = (f"run {r + 1}: cute-ep bench exited {done.returncode}\n"
                                    f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
                    print(f"side {name} failed ({failed[name]})", file=sys.stderr)
                    continue
                runs[name].append(json.loads(records[-1].read_text()))
        except _Stopped:
            stopped = True
            print("stopped by SIGTERM: the runs so far "
                  f"({', '.join(f'{n} {len(v)}' for n, v in runs.items())})", file=sys.stderr)
    sides = [name for name, _, _ in args.side if runs[name]]
    if not sides or sides[0] != args.side[0][0]:
        raise SystemExit(f"the baseline side {args.side[0][0]} failed: {failed}")
    runs = {name: runs[name] for name in sides}
    if args.json:
        with open(args.json, "w") as f:
            first = runs[sides[0]][0]
            json.dump({"device": first["device"], "gpus": first["gpus"], "argv": recorded_argv(sys.argv[1:]),
                       "sides": {n: [str(t), str(lib)] for n, t, lib in args.side},
                       **({"side_args": {n: a for n, a in own.items()}} if own else {}),
                       "failed": failed, "stopped": stopped, "runs": runs}, f, indent=1)
    first = runs[sides[0]][0]
    view = Table(title=f"{first['gpus']} x {first['device']}: us per call (slowest rank), "
                       f"{args.runs} runs a side, alternated ({', '.join(sides)})")
    for col in ["operation", "format", "SMs", *sides, *(f"{s} - {sides[0]}" for s in sides[1:])]:
        view.add_column(col, justify="left" if col in ("operation", "format") else "right")
    for row in summary_rows(collect(runs), sides):
        view.add_row(*row)
    console = Console(width=160)
    console.print(view)
    traces = trace_rows(runs, sides)
    if traces:
        view = Table(title="where the time goes: one traced call per run, the slowest rank's "
                           "stamp or wait (us), median over runs")
        for col in ["operation", "format", "SMs", "field", *sides]:
            view.add_column(col, justify="left" if col in ("operation", "format", "field")
                            else "right")
        for row in traces:
            view.add_row(*row)
        console.print(view)


if __name__ == "__main__":
    main()
