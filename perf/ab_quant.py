"""Two or more builds of the quantization kernels side by side in `perf/bench_quant.py`, runs
alternated in one session on one GPU:

    python perf/ab_quant.py --side main=TREE:LIBRARY --side new=.:build/lib-new \\
        [--runs 2] [--l2 zero --l2 read --l2 produced] [--intermediate 2048 ...]
        [--valid-rows N] [--json FILE]

A side is a name, a source tree (its `cute_ep` and `perf/bench_quant.py`: a change to the
kernels' parameters needs its own Python side too) and a kernel library folder. Each run calls
every side's bench once, in the order given, in a process of its own (`CUTE_EP_LIBRARY` and
`PYTHONPATH` set to the side's), so the sides see the same card, clocks and neighbours. The
table gives each FP4 kernel's percent of copy (every kernel's with `--all`) per side as the
range over runs, and each later side's median minus the first's; `--json` keeps every run's
records.

A tree without the change can be exported next to the working tree, e.g.
`git archive main cute_ep perf kernels layouts | tar -x -C build/tree-main`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_side(text: str) -> tuple[str, Path, Path]:
    """'name=TREE:LIBRARY' -> (name, tree, library)."""
    name, sep, rest = text.partition("=")
    tree, colon, library = rest.partition(":")
    if not (name and sep and tree and colon and library):
        raise argparse.ArgumentTypeError(f"a side is NAME=TREE:LIBRARY, got {text!r}")
    return name, Path(tree), Path(library)


def recorded_argv(argv: list[str]) -> list[str]:
    """The command line as a record keeps it: an absolute path (the machine's output folder,
    say) by its file name alone, alone or after `--option=`."""
    def strip(arg: str) -> str:
        key, eq, value = arg.partition("=")
        if eq and key.startswith("-") and os.path.isabs(value):
            return f"{key}={Path(value).name}"
        return Path(arg).name if os.path.isabs(arg) else arg
    return [strip(a) for a in argv]


def alternated(sides, runs: int):
    """(run, name, tree, library) for every run of every side, sides alternated within a run,
    with a progress bar."""
    from rich.progress import track

    steps = [(r, side) for r in range(runs) for side in sides]
    for r, (name, tree, library) in track(steps, description="bench runs"):
        yield r, name, tree, library


def run_side(tree: Path, library: Path, cmd: list[str],
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """`cmd` in a side's tree with its kernel library and its Python (`CUTE_EP_LIBRARY`,
    `PYTHONPATH`), output captured. Past `timeout` seconds the command and every process it
    started (its own session: the bench's rank processes) are killed, and the result says so
    (return code -SIGKILL)."""
    env = dict(os.environ, CUTE_EP_LIBRARY=str(library.resolve()),
               PYTHONPATH=str(tree.resolve()))
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nkilled after {timeout:g} s"
    except BaseException:  # the caller stopped (a signal, Ctrl-C): its side's processes too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def percent_of_copy(runs: dict[str, list[list[dict]]]) -> dict[tuple, dict[str, list[float]]]:
    """{side: [records of run 1, run 2, ...]} -> {(kernel, I, L2): {side: [% of copy a run]}}, in
    the first side's record order."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for side, side_runs in runs.items():
        for records in side_runs:
            for r in records:
                key = (r["kernel"], r["intermediate"], r["l2"])
                out.setdefault(key, {}).setdefault(side, []).append(
                    100.0 * r["copy_us"] / r["us"])
    return out


def summary_rows(table: dict[tuple, dict[str, list[float]]], sides: list[str]) -> list[list[str]]:
    """Rows (kernel, I, L2, each side's min-max, each later side's median change)."""
    rows = []
    for (kernel, i, l2), by_side in table.items():
        row = [kernel, str(i), l2]
        for side in sides:
            v = by_side.get(side)
            row.append(f"{min(v):.1f}-{max(v):.1f}" if v else "-")
        base = by_side.get(sides[0])
        for side in sides[1:]:
            v = by_side.get(side)
            row.append(f"{statistics.median(v) - statistics.median(base):+.1f}"
                       if v and base else "-")
        rows.append(row)
    return rows


def bench_arguments(l2: list[str] | None, intermediate: list[int] | None,
                    valid_rows: int | None = None) -> list[str]:
    """The arguments every side's bench_quant gets (default L2 state: zero)."""
    out = [a for s in (l2 or ["zero"]) for a in ("--l2", s)]
    out += [a for i in (intermediate or []) for a in ("--intermediate", str(i))]
    if valid_rows is not None:
        out += ["--valid-rows", str(valid_rows)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=parse_side, action="append", required=True,
                   help="NAME=TREE:LIBRARY (two or more; the first is the baseline)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--l2", action="append", choices=("zero", "read", "produced"))
    p.add_argument("--intermediate", type=int, action="append")
    p.add_argument("--valid-rows", type=int,
                   help="bench_quant's --valid-rows (every side's tree must know it)")
    p.add_argument("--all", action="store_true", help="also the bf16 and FP8 kernels' rows")
    p.add_argument("--json")
    args = p.parse_args()
    if len(args.side) < 2 or len({s[0] for s in args.side}) != len(args.side):
        p.error("give two or more sides with distinct names")
    extra = bench_arguments(args.l2, args.intermediate, args.valid_rows)
    runs: dict[str, list[list[dict]]] = {name: [] for name, _, _ in args.side}
    device = None
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        for r, name, tree, library in alternated(args.side, args.runs):
            out = Path(tmp) / f"{name}-{r}.json"
            done = run_side(tree, library, [sys.executable, str(
                (tree / "perf" / "bench_quant.py").resolve()), "--json", str(out), *extra])
            if done.returncode:
                raise SystemExit(f"side {name}, run {r + 1}: bench_quant exited "
                                 f"{done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
            got = json.loads(out.read_text())
            device = device or got["device"]
            runs[name].append(got["records"])
    sides = [name for name, _, _ in args.side]
    table = percent_of_copy(runs)
    if not args.all:
        table = {k: v for k, v in table.items() if "fp4" in k[0]}
    view = Table(title=f"{device}: percent of copy, {args.runs} runs a side, alternated "
                       f"({', '.join(sides)})")
    for col in ["kernel", "I", "L2", *sides, *(f"{s} - {sides[0]}" for s in sides[1:])]:
        view.add_column(col, justify="left" if col == "kernel" else "right")
    for row in summary_rows(table, sides):
        view.add_row(*row)
    Console(width=160).print(view)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "argv": recorded_argv(sys.argv[1:]),
                       "sides": {n: [str(t), str(lib)] for n, t, lib in args.side},
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
