"""Figures from benchmark records (matplotlib, the optional `plot` extra: `pip install
'cute-ep[plot]'`):

- `bench_figure`: a `cute-ep bench` record's dispatch and combine time against the SM budget, one
  line per format (the slowest rank's median), beside DeepEP (a `perf/record_deepep.py` record,
  when given: its best time at its SM budget) and NCCL all_to_all_single of the same token bytes
  (a horizontal line: it has no SM budget to set);
- `quantize_figure`: each quantize / fused SwiGLU kernel's time as a share of a device-to-device
  copy of the same bytes, from `perf/bench_quant.py` records or an `perf/ab_quant.py` run.

`cute-ep plot bench|quant RECORD -o FILE` draws either from a committed record; `cute-ep bench
--plot FILE` and `perf/bench_quant.py --plot FILE` draw the run they just made.
"""

from __future__ import annotations

import statistics
from pathlib import Path

FORMAT_COLORS = {"bf16": "tab:blue", "fp8": "tab:orange", "nvfp4": "tab:green"}
# DeepEP's record keys by (phase, format); it has no NVFP4 dispatch, and one combine (BF16).
DEEPEP_KEYS = {("dispatch", "bf16"): "dispatch_bf16", ("dispatch", "fp8"): "dispatch_fp8",
               ("combine", "bf16"): "combine"}


DPI = 110  # the figures' resolution (the documents' figures too: docs/figures.py)


def save_figure(fig, path: str | Path) -> Path:
    """Write `fig` to `path` as a PNG and release it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("plots need matplotlib: pip install 'cute-ep[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_series(record: dict, field: str = "{phase}_us") -> dict:
    """{(phase, format): [(SMs, us)]}, the slowest rank's time at each SM budget ('all' as the
    GPU's SM count) in sweep field `field` (its {phase} dispatch or combine; points no rank
    recorded it at left out, as in records from before the field), and {format: NCCL all_to_all us} (slowest rank)."""
    every = record["config"].get("sms_per_gpu", 132)
    series, nccl = {}, {}
    ranks = record["ranks"]
    for fmt in ranks[0]["formats"]:
        per = [r["formats"][fmt]["throughput"] for r in ranks]
        nccl[fmt] = max(p["nccl_all_to_all_us"] for p in per)
        for i, point in enumerate(per[0]["sweep"]):
            sms = every if point["sms"] in ("all", None) else int(point["sms"])
            for phase in ("dispatch", "combine"):
                key = field.format(phase=phase)
                if any(key in p["sweep"][i] for p in per):
                    us = max(p["sweep"][i][key] for p in per)
                    series.setdefault((phase, fmt), []).append((sms, us))
    for points in series.values():
        points.sort()
    return {"series": series, "nccl": nccl}


def bench_figure(record: dict, path: str | Path, deepep: dict | None = None) -> Path:
    """Write the time-against-SM-budget figure of a `cute-ep bench` record to `path` (PNG)."""
    plt = _pyplot()
    data = bench_series(record)
    cfg = record["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, phase in zip(axes, ("dispatch", "combine")):
        for (ph, fmt), points in sorted(data["series"].items()):
            if ph != phase:
                continue
            xs, ys = zip(*points)
            color = FORMAT_COLORS.get(fmt)
            ax.plot(xs, ys, "o--", lw=1, color=color, label=f"cute-ep {fmt}")
            if phase == "dispatch" or fmt == "bf16":  # combine returns bf16 whatever came in
                ax.axhline(data["nccl"][fmt], color=color, ls=":", lw=1,
                           label=f"NCCL all_to_all {fmt}")
            key = DEEPEP_KEYS.get((phase, fmt))
            if deepep is not None and key in deepep.get("best", {}):
                best = deepep["best"][key]
                ax.plot([best["sms"]], [best["us"]], "s", color=color, ms=9, mfc="none",
                        mew=2, label=f"DeepEP {fmt}")
        ax.set_title(f"{phase}")
        ax.set_xlabel("SM budget (SMs per GPU)")
        ax.set_ylabel("time per call (us, slowest rank)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{record['gpus']} x {record['device']}, {record['date'][:10]}: "
                 f"{cfg['tokens']} tokens per rank, H {cfg['hidden']}, top-{cfg['topk']} of "
                 f"{cfg['experts']} experts", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def quant_records(data: dict, side: str | None = None, l2: str = "zero") -> list[dict]:
    """Flat records {kernel, intermediate, us, copy_us} of L2 state `l2`: from a
    `perf/bench_quant.py` JSON (`records`) or an `perf/ab_quant.py` run (`pct_of_copy`, keyed
    "<kernel> I=<n> <l2>", each side's runs: their median; `side` picks one, default the
    last)."""
    if "records" in data:
        return [{"kernel": r["kernel"], "intermediate": r.get("intermediate", r.get("I")),
                 "us": r["us"], "copy_us": r["copy_us"]}
                for r in data["records"] if r.get("l2", "zero") == l2]
    out = []
    for key, sides in data["pct_of_copy"].items():
        kernel, size, state = key.rsplit(" ", 2)
        if state != l2:
            continue
        runs = sides[side or list(sides)[-1]]
        out.append({"kernel": kernel, "intermediate": int(size.removeprefix("I=")),
                    "us": statistics.median(r["us"] for r in runs),
                    "copy_us": statistics.median(r["copy_us"] for r in runs)})
    return out


def quantize_figure(records: list[dict], path: str | Path, title: str) -> Path:
    """Bars of each kernel's share of copy bandwidth (copy time / kernel time, the same bytes),
    grouped by intermediate size, to `path` (PNG)."""
    plt = _pyplot()
    kernels = list(dict.fromkeys(r["kernel"] for r in records))
    sizes = sorted({r["intermediate"] for r in records})
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / max(1, len(sizes))
    for j, size in enumerate(sizes):
        pct = {r["kernel"]: 100.0 * r["copy_us"] / r["us"] for r in records
               if r["intermediate"] == size}
        xs = [i + (j - (len(sizes) - 1) / 2) * width for i in range(len(kernels))]
        ys = [pct.get(k, 0.0) for k in kernels]
        bars = ax.bar(xs, ys, width, label=f"I = {size}")
        for bar, y in zip(bars, ys):
            if y:
                ax.text(bar.get_x() + bar.get_width() / 2, y + 1, f"{y:.0f}", ha="center",
                        fontsize=7)
    ax.axhline(100, color="k", lw=1, ls=":")
    ax.set_xticks(range(len(kernels)))
    ax.set_xticklabels(kernels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("% of copy bandwidth (same bytes)")
    ax.set_ylim(0, 110)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> int:
    """`cute-ep plot bench RECORD [--deepep RECORD] -o FILE`, `cute-ep plot quant RECORD [--key
    K] [--side S] [--l2 STATE] -o FILE`."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="cute-ep plot", description="a figure from a record")
    p.add_argument("what", choices=("bench", "quant"))
    p.add_argument("record", help="a JSON record (perf/results)")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    p.add_argument("--deepep", help="bench: a perf/record_deepep.py record to draw beside")
    p.add_argument("--key", help="quant: the record's entry holding the run (e.g. lease_11)")
    p.add_argument("--side", help="quant: the ab_quant side to draw (default: the last)")
    p.add_argument("--l2", default="zero", help="quant: the L2 state (default zero)")
    p.add_argument("--title", help="quant: the figure's title")
    args = p.parse_args(argv)
    data = json.loads(Path(args.record).read_text())
    if args.what == "bench":
        deepep = json.loads(Path(args.deepep).read_text()) if args.deepep else None
        print(bench_figure(data, args.out, deepep))
        return 0
    run = data[args.key] if args.key else data
    records = quant_records(run, args.side, args.l2)
    if not records:
        raise SystemExit(f"no records of L2 state {args.l2!r} in {args.record}")
    title = args.title or f"{data.get('device', '')}: {Path(args.record).name}, L2 {args.l2}"
    print(quantize_figure(records, args.out, title))
    return 0
