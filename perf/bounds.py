"""What the hardware allows a dispatch and a combine at an SM budget, beside what they took and
the dispatch issue's targets, from records already committed:

    python perf/bounds.py BENCH_RECORD --deepep DEEPEP_RECORD --rates SM_RATES_RECORD
        [--placed PLACEMENT_RECORD] [--json F]

Per rank, at the bench's first SM budget (24), for each format the bench ran:
- bytes the budget's SMs must **store**: the expert rows (`rows` x `token_bytes`: payload and
  scales), the staged copy of the scales a packed FP8 / NVFP4 dispatch writes before its
  write-out, and each of the rank's tokens once into its own staging (`message_bytes`); for the
  combine, one reduced row per (token, rank) pair into the home ring and the output rows;
- bytes they must **load**: the messages the receivers pull, the tokens the senders read, the
  staged scales read back; for the combine, the expert rows and the home ring's rows;
- bytes that cross **NVLink** into the rank: its peers' messages (the bench's
  `sent_tokens_to_peers`, the same on every rank of a uniform routing).
Each divided by its rate gives a time no kernel can beat: stores and loads at the per-SM rates of
`perf/bench_sm_stores.py` times the budget, NVLink at the fastest device-to-device copy the bench
timed in the same lease. The bound is the largest of the three (they are taken as independent, so
it is a floor, not an estimate). A target below its bound cannot be met at that budget.

`--placed`: a `bench_sm_stores.py --place` record; the store rate is then the best per-SM rate
its `store_place` rows reached with the budget's number of SMs working (SMs placed one per TPC
store faster than the scheduler's default placement of equal shares, whose slowest SMs set
`store_rate`'s time; kernels/placement.py).
"""

from __future__ import annotations

import argparse
import json

# The dispatch issue's targets at 24 SMs, as a multiple of DeepEP's time (its FP8 dispatch for
# cute-ep's FP8 and NVFP4): (DeepEP field, ratio at 2 GPUs, ratio at 4 and more).
TARGETS = {
    ("dispatch", "bf16"): ("dispatch_bf16", 1.1, 0.9),
    ("dispatch", "fp8-input"): ("dispatch_fp8", 1.0, 1.0),
    ("dispatch", "nvfp4-input"): ("dispatch_fp8", 0.6, 0.6),
    ("combine", "bf16"): ("combine", 0.85, 0.85),
}
SCALED = {"fp8", "fp8-input", "nvfp4", "nvfp4-input"}


def _rate(rates: dict, mode: str, ctas: int) -> float:
    """GB/s per SM of the `mode` kernel ("store_rate bulk", "load_rate") at `ctas` CTAs."""
    for row in rates["rows"]:
        if row["kernel"].startswith(mode) and row["ctas"] == ctas:
            return row["gbs_per_cta"]
    raise ValueError(f"no {mode!r} row at {ctas} CTAs in the rates record")


def bytes_moved(op: str, fmt: str, hidden: int, tokens: int, sweep: dict, tp: dict) -> dict:
    """Per-rank bytes stored, loaded and received over NVLink by one call (see the module)."""
    rows, row_bytes = sweep["rows"], sweep["token_bytes"]
    received, msg = sweep["received_tokens"], tp["message_bytes"]
    if op == "combine":
        row = hidden * 2
        return {"store": received * row + tokens * row, "load": rows * row + received * row,
                "nvlink": tp["sent_tokens_to_peers"] * row}
    payload = {"bf16": 2, "fp8": 1, "fp8-input": 1, "nvfp4": 0.5, "nvfp4-input": 0.5}[fmt]
    scales = row_bytes - int(hidden * payload)
    staged = rows * scales if fmt in SCALED else 0
    return {"store": rows * row_bytes + staged + tokens * msg,
            "load": received * msg + tokens * msg + staged,
            "nvlink": tp["sent_tokens_to_peers"] * msg}


def _placed_rate(placed: dict, ctas: int) -> float:
    """The best GB/s per SM of the `store_place` rows with `ctas` SMs working."""
    rates = [row["gbs_per_cta"] for row in placed["rows"]
             if row["kernel"].startswith("store_place") and row["ctas"] == ctas]
    if not rates:
        raise ValueError(f"no store_place row with {ctas} SMs working in the placement record")
    return max(rates)


def bounds(bench: dict, deepep: dict, rates: dict, placed: dict | None = None) -> list[dict]:
    cfg = bench["config"]
    gpus = bench["gpus"]
    first = cfg["sms"][0]
    store, load = _rate(rates, "store_rate bulk", first), _rate(rates, "load_rate", first)
    if placed is not None:
        store = _placed_rate(placed, first)
    # NVLink: the fastest device-to-device copy of the lease, any rank, any format.
    nvlink = max(r["formats"][f]["throughput"]["p2p_copy_gbps"]
                 for r in bench["ranks"] for f in r["formats"])
    out = []
    for fmt in bench["ranks"][0]["formats"]:
        for op in ("dispatch", "combine"):
            if op == "combine" and fmt != "bf16":
                continue  # every format's combine moves bf16 rows
            worst = None
            measured = max(r["formats"][fmt]["throughput"]["sweep"][0][f"lockstep_{op}_us"]
                           for r in bench["ranks"])
            for rank in bench["ranks"]:
                tp = rank["formats"][fmt]["throughput"]
                sweep = tp["sweep"][0]
                moved = bytes_moved(op, fmt, cfg["hidden"], cfg["tokens"], sweep, tp)
                us = {"store": moved["store"] / (store * first) / 1e3,
                      "load": moved["load"] / (load * first) / 1e3,
                      "nvlink": moved["nvlink"] / nvlink / 1e3}
                row = {"op": op, "format": fmt, "sms": first, "rank": rank["rank"],
                       "measured_us": measured,
                       "bytes": moved, "bound_us": us, "floor_us": max(us.values()),
                       "bound_by": max(us, key=us.get)}
                if worst is None or row["floor_us"] > worst["floor_us"]:
                    worst = row
            target = TARGETS.get((op, fmt))
            if target:
                field, two, more = target
                worst["target_us"] = deepep["best"][field]["us"] * (two if gpus == 2 else more)
                worst["reachable"] = worst["floor_us"] <= worst["target_us"]
            out.append(worst)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench")
    p.add_argument("--deepep", required=True, help="perf/record_deepep.py's normal-mode record")
    p.add_argument("--rates", required=True, help="perf/bench_sm_stores.py's record")
    p.add_argument("--placed", default=None,
                   help="perf/bench_sm_stores.py --place's record: the store rate of SMs "
                        "placed one per TPC")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bench, deepep, rates = (json.load(open(f)) for f in (args.bench, args.deepep, args.rates))
    placed = json.load(open(args.placed)) if args.placed else None
    rows = bounds(bench, deepep, rates, placed)
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"{bench['gpus']} x {bench['device']}: floors at {rows[0]['sms']} SMs "
                        "(us; measured: lockstep, slowest rank)")
    for col in ("op", "format", "measured", "store", "load", "NVLink", "floor", "target",
                "reachable"):
        table.add_column(col, justify="left" if col in ("op", "format") else "right")
    for r in rows:
        b = r["bound_us"]
        table.add_row(r["op"], r["format"], f"{r['measured_us']:.1f}", f"{b['store']:.1f}",
                      f"{b['load']:.1f}", f"{b['nvlink']:.1f}", f"{r['floor_us']:.1f}",
                      f"{r['target_us']:.1f}" if "target_us" in r else "-",
                      {True: "yes", False: f"no ({r['bound_by']})"}.get(r.get("reachable"), "-"))
    Console(width=110).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": args.bench, "deepep": args.deepep, "rates": args.rates,
                       "placed": args.placed,
                       "command": "python perf/bounds.py " + " ".join(
                           [args.bench, "--deepep", args.deepep, "--rates", args.rates]
                           + (["--placed", args.placed] if args.placed else [])),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
