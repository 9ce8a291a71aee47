"""Draw the figures of docs/design.md and docs/performance.md from the repository's own data
(no GPU needed; matplotlib: `pip install 'cute-ep[plot]'`).

    python docs/figures.py [--record perf/results/bench-....json] [--format bf16] [--sms 24]
                           [--out docs/figures]

writes into docs/figures/ (or --out):

- dispatch-timeline.png: one traced dispatch and combine of a `cute-ep bench` record
  (`ranks[i].formats.<format>.throughput.sweep[j].dispatch_trace_us` / `combine_trace_us`);
- decode-timeline.png: a traced decode dispatch with every stamp of `layouts.channels.
  TRACE_FIELDS` (the `trace_run` of an emulated-rank record);
- rings.png: one rank's peer-visible memory as `layouts.channels.ChannelGeometry.peer_bytes()`
  lays it out for a DeepSeek-V3-shaped layer, and one channel's staging ring;
- bench-2xH100.png, bench-2xH200.png and quantize-H200.png (docs/performance.md, the README):
  `cute-ep plot`'s figures of bench records beside DeepEP's, and of the quantize kernels' share
  of copy (`cute_ep.tools.plot`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle, Wedge  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cute_ep.tools.plot import (bench_figure, quant_records, quantize_figure,  # noqa: E402
                                 save_figure)
from layouts.channels import (STAGE_BATCH_TOKENS, ChannelGeometry,  # noqa: E402
                              channel_tokens)
from layouts.config import EPConfig  # noqa: E402

OUT = ROOT / "docs" / "figures"
BENCH = "perf/results/bench-2026-11-26-2xH100.json"
DECODE = "perf/results/emulated-2026-11-25-H200-nvfp4-scales.json"
# The performance figures: (bench record, DeepEP record beside it); (quantize record, its entry,
# the side that is the library in use).
BENCH_PAIRS = {"bench-2xH100.png": ("perf/results/bench-2026-11-26-2xH100.json",
                                    "perf/results/deepep-2026-11-26-2xH100.json"),
               "bench-2xH200.png": ("perf/results/bench-2026-11-23-2xH200-bulk.json",
                                    "perf/results/deepep-2026-11-23-2xH200-bulk.json")}
QUANT = ("perf/results/quant-2026-11-26-H200-padding.json", "lease_11", "pe")
COLORS = {"counts": "#8c8c8c", "wait": "#d9d9d9", "layout": "#b07aa1", "send": "#4e79a7",
          "recv": "#f28e2b", "scales": "#59a14f", "tail": "#e15759"}


def _sweep_entry(record: dict, rank: int, fmt: str, sms) -> dict:
    sweep = record["ranks"][rank]["formats"][fmt]["throughput"]["sweep"]
    for entry in sweep:
        if str(entry["sms"]) == str(sms):
            return entry
    raise SystemExit(f"no sweep entry with sms={sms} for {fmt} (have "
                     f"{[e['sms'] for e in sweep]})")


def _gantt(ax, bars, stamps, title, xmax):
    """Horizontal bars (label, begin, end, color) top to bottom, each labelled with its span;
    dotted lines at the `stamps` (name, us), which the title lists."""
    for i, (label, begin, end, color) in enumerate(bars):
        ax.barh(i, end - begin, left=begin, height=0.6, color=color, edgecolor="black",
                linewidth=0.5)
        ax.text(end + xmax * 0.006, i, f"{begin:.1f}-{end:.1f}", va="center", fontsize=7)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    for _, t in stamps:
        ax.axvline(t, color="black", linestyle=":", linewidth=0.6)
    ax.set_xlim(0, xmax * 1.15)
    ax.set_xlabel("us after the rank's first channel started", fontsize=8)
    listed = ", ".join(f"{name} {t:.1f}" for name, t in stamps)
    ax.set_title(f"{title}\nstamps (us): {listed}", fontsize=8.5, loc="left")
    ax.tick_params(axis="x", labelsize=7)


def _waits(ax, items, title):
    """Horizontal bars of durations (label, us, color)."""
    for i, (label, value, color) in enumerate(items):
        ax.barh(i, value, height=0.6, color=color, edgecolor="black", linewidth=0.5)
        ax.text(value, i, f" {value:.1f}", va="center", fontsize=7)
    ax.set_yticks(range(len(items)), [it[0] for it in items], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(v for _, v, _ in items) * 1.35 or 1)
    ax.set_xlabel("us (the channel that spent the most)", fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=7)


def dispatch_timeline(record_path: str, fmt: str, sms, rank: int) -> Path:
    record = json.loads((ROOT / record_path).read_text())
    entry = _sweep_entry(record, rank, fmt, sms)
    d, c = entry["dispatch_trace_us"], entry.get("combine_trace_us")
    cfg = record["config"]
    rows = 2 if c else 1
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.2 * rows + 0.6),
                             gridspec_kw={"width_ratios": [3, 1.25]}, squeeze=False)
    xmax = max(d["end"], c["end"] if c else 0)
    bars = [("route, count, send counts", 0.0, d["counts_sent"], COLORS["counts"]),
            ("wait for every channel's counts", d["counts_sent"], d["counts_arrived"],
             COLORS["wait"]),
            ("sum counts, row layout", d["counts_arrived"], d["layout_ready"], COLORS["layout"]),
            ("senders: stage batches", d["counts_sent"], d["send_done"], COLORS["send"]),
            ("receivers: headers, pull, rows", d["layout_ready"],
             d.get("recv_done", d["end"]), COLORS["recv"])]
    if "recv_done" in d and d["end"] > d["recv_done"]:
        bars.append(("round done, scales out", d["recv_done"], d["end"], COLORS["scales"]))
    stamps = [(k, d[k]) for k in ("counts_sent", "counts_arrived", "layout_ready", "send_done",
                                  "end") if k in d]
    how = "GPU time" if record.get("timing") == "gpu" else "host launch included"
    _gantt(axes[0][0], bars, stamps, f"dispatch ({entry['dispatch_us']:.0f} us by CUDA events, "
           f"{how})", xmax)
    _waits(axes[0][1], [("sender: credit wait", d["credit_wait_us"], COLORS["wait"]),
                        ("sender: per-batch work", d["batch_us"], COLORS["send"]),
                        ("sender: token copies", d["copy_us"], COLORS["send"]),
                        ("sender: fence, publish", d["fence_us"], COLORS["tail"]),
                        ("receiver: tail wait", d["recv_wait_us"], COLORS["recv"])],
           "dispatch waits and steps")
    if c:
        _gantt(axes[1][0], [("senders (expert side): rows into rings", 0.0, c["send_done"],
                             COLORS["send"]),
                            ("receivers (home side): sum rows", 0.0, c["recv_done"],
                             COLORS["recv"])],
               [(k, c[k]) for k in ("send_done", "recv_done", "end")],
               f"combine ({entry['combine_us']:.0f} us by CUDA events)", xmax)
        _waits(axes[1][1], [("sender: credit wait", c["credit_wait_us"], COLORS["wait"]),
                            ("receiver: tail wait", c["tail_wait_us"], COLORS["recv"]),
                            ("receiver: routing", c["route_us"], COLORS["layout"])],
               "combine waits and steps")
    fig.suptitle(f"One traced dispatch and combine: {record_path}, rank {rank}, {fmt}, "
                 f"{sms} SMs\n{record['gpus']} x {record['device']}, {cfg['tokens']} tokens a "
                 f"rank, H={cfg['hidden']}, top-{cfg['topk']} of {cfg['experts']}; each stamp "
                 "is the latest channel's", fontsize=9.5)
    fig.tight_layout()
    return save_figure(fig, OUT / "dispatch-timeline.png")


def decode_timeline(record_path: str = DECODE, fmt: str = "bf16", ranks: int = 4) -> Path:
    record = json.loads((ROOT / record_path).read_text())
    run = record["trace_run"]["decode"]
    entry = next(r for r in run["records"] if r["format"] == fmt and r["ranks"] == ranks)
    t = entry["trace_us"]
    bars = [("route (count per expert, rank)", 0.0, t["routed"], COLORS["counts"]),
            ("write counts, raise flags", t["routed"], t["counts_sent"], COLORS["counts"]),
            ("wait for every channel's counts", t["counts_sent"], t["counts_arrived"],
             COLORS["wait"]),
            ("sum counts", t["counts_arrived"], t["counts_summed"], COLORS["layout"]),
            ("row layout, padding", t["counts_summed"], t["layout_ready"], COLORS["layout"]),
            ("senders: stage batches", t["counts_sent"], t["send_done"], COLORS["send"]),
            ("first batch's tail seen", t["layout_ready"], t["first_batch"], COLORS["wait"]),
            ("read its first header chunk", t["first_batch"], t["chunk_read"], COLORS["recv"]),
            ("place the chunk's rows", t["chunk_read"], t["chunk_placed"], COLORS["recv"]),
            ("pull and store its messages", t["chunk_placed"], t["chunk_stored"],
             COLORS["recv"]),
            ("rest of the receiving", t["chunk_stored"], t["recv_done"], COLORS["recv"]),
            ("rows written, round advanced", t["recv_done"], t["round_done"], COLORS["scales"]),
            ("to the kernel's end", t["round_done"], t["end"], COLORS["scales"])]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    _gantt(ax, bars, [("layout_ready", t["layout_ready"]), ("end", t["end"])],
           f"decode dispatch, {fmt}, {ranks} emulated ranks on one {run['device']}, "
           f"{run['tokens']} tokens a rank, {entry['sms']} SMs ({entry['dispatch_us']:.1f} us "
           "by CUDA events)", t["end"])
    fig.suptitle(f"Every dispatch trace stamp: {record_path} (trace_run); each stamp is the "
                 "latest channel's", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, OUT / "decode-timeline.png")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def rings(channels: int = 24) -> Path:
    cfg = EPConfig(7168, 8, 256, ranks=8, max_tokens_per_rank=4096)
    geo = ChannelGeometry(cfg, channels)
    parts, offsets = geo.peer_bytes(), geo.peer_offsets()
    total = offsets["total"]
    shapes = {"staging": geo.staging(), "batch_headers": geo.headers(),
              "combine_rings": geo.combine_ring(), "counts": geo.counts(),
              "count_flags": geo.count_flags(), "counters": geo.counters()}
    modes = {"staging": "(byte, slot, channel)", "batch_headers": "(byte, batch slot, channel)",
             "combine_rings": "(byte, slot, channel, source)",
             "counts": "(entry, channel, source, parity) int32",
             "count_flags": "(channel, source, parity) int64",
             "counters": "(channel, rank, tail|head, phase) int64"}
    colors = {"staging": COLORS["send"], "batch_headers": COLORS["layout"],
              "combine_rings": COLORS["recv"], "counts": COLORS["counts"],
              "count_flags": COLORS["tail"], "counters": COLORS["scales"]}

    fig = plt.figure(figsize=(12, 7.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.5], width_ratios=[1.15, 1])

    # The region, to scale.
    ax = fig.add_subplot(grid[0, :])
    for name, nbytes in parts.items():
        ax.add_patch(Rectangle((offsets[name] / 2**20, 0), nbytes / 2**20, 1,
                               facecolor=colors[name], edgecolor="black", linewidth=0.5))
    for name in ("staging", "combine_rings"):
        mid = (offsets[name] + parts[name] / 2) / 2**20
        ax.text(mid, 0.5, f"{name}\n{_mib(parts[name])}", ha="center", va="center", fontsize=9)
    tail = [n for n in parts if n not in ("staging", "combine_rings")]
    for i, name in enumerate(tail):
        x = offsets[name] / 2**20
        ax.annotate(f"{name}: {_mib(parts[name])} at byte {offsets[name]:,}",
                    xy=(x, 1 if name != "batch_headers" else 0),
                    xytext=(x - 62 if name != "batch_headers" else x + 4,
                            1.25 + 0.28 * i if name != "batch_headers" else -0.55),
                    fontsize=8, arrowprops={"arrowstyle": "-", "linewidth": 0.5})
    ax.set_xlim(0, total / 2**20)
    ax.set_ylim(-0.9, 2.3)
    ax.set_yticks([])
    ax.set_xlabel("MiB from the start of the rank's peer-visible region", fontsize=8)
    ax.set_title(f"peer_offsets(): one rank's peer-visible memory, {_mib(total)}: "
                 f"EPConfig(7168, 8, 256, ranks=8, max_tokens_per_rank=4096), bf16, "
                 f"{channels} channels", fontsize=9, loc="left")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    # Each part's bytes, log scale, with its layout's shape.
    ax = fig.add_subplot(grid[1, 0])
    names = list(parts)
    ax.barh(range(len(names)), [parts[n] for n in names], color=[colors[n] for n in names],
            edgecolor="black", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    for i, n in enumerate(names):
        shape = shapes[n].shape
        ax.text(parts[n] * 1.3, i, f"{_mib(parts[n])}  {modes[n]}\nshape {shape}", va="center",
                fontsize=7)
    ax.set_xlim(1e3, 1e11)
    ax.set_xlabel("bytes (log scale)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("peer_bytes() by part, from each layout's cosize", fontsize=9, loc="left")

    # One channel's staging ring: an example state, positions counted across rounds.
    ax = fig.add_subplot(grid[1, 1])
    slots = geo.stage_batches
    tokens = channel_tokens(0, cfg.max_tokens_per_rank, channels)
    per_round = math.ceil((tokens[1] - tokens[0]) / STAGE_BATCH_TOKENS)
    tail = 2 * per_round + 6  # batches staged and published: the third round, 6 batches in
    head = tail - 5  # the least credit any destination has returned
    writing = tail  # the batch the senders stage now (needs head >= writing - slots + 1)
    assert head >= writing - slots + 1
    staging, headers = geo.staging(), geo.headers()
    slot_states = (("being staged", COLORS["send"]), ("staged, awaiting credit", COLORS["recv"]),
                   ("credited: free", "#ffffff"))
    for slot in range(slots):
        held = max(p for p in range(writing + 1) if p % slots == slot)
        color = slot_states[0 if held == writing else 1 if held >= head else 2][1]
        a0 = 90 - 360 * (slot + 1) / slots
        ax.add_patch(Wedge((0, 0), 1.0, a0, a0 + 360 / slots, width=0.42, facecolor=color,
                           edgecolor="black", linewidth=0.6))
        mid = math.radians(a0 + 180 / slots)
        ax.text(0.79 * math.cos(mid), 0.79 * math.sin(mid), f"slot {slot}\nbatch {held}",
                ha="center", va="center", fontsize=7)
    for label, pos, radius in ((f"tail = {tail}\n(batches staged)", tail, 1.32),
                               (f"head = {head}\n(least credit)", head, 1.32)):
        ang = math.radians(90 - 360 * (pos % slots) / slots)
        ax.annotate(label, xy=(1.02 * math.cos(ang), 1.02 * math.sin(ang)),
                    xytext=(radius * math.cos(ang) + (0.25 if math.cos(ang) >= 0 else -0.25),
                            radius * math.sin(ang)),
                    ha="center", fontsize=7.5, arrowprops={"arrowstyle": "->", "linewidth": 0.8})
    msg = cfg.message.staged_bytes
    ax.text(0, 0, f"{slots} slots\n{STAGE_BATCH_TOKENS} tokens each", ha="center", va="center",
            fontsize=8)
    s = writing % slots
    ax.text(-1.8, -1.5,
            f"slot {s} of channel 0: {STAGE_BATCH_TOKENS} messages of {msg:,} B at staging bytes "
            f"{staging((0, s * STAGE_BATCH_TOKENS, 0)):,}.."
            f"{staging((0, (s + 1) * STAGE_BATCH_TOKENS, 0)) - 1:,};\n"
            f"its header ({geo.header_bytes:,} B: ids, weights, token indices) at batch_headers "
            f"byte {headers((0, s, 0)):,}.\n"
            f"Channel 0 owns tokens {tokens[0]}..{tokens[1] - 1}: {per_round} batches a round; "
            "positions count on across rounds.\n"
            "A slot is restaged once every destination's head has passed the batch it held.\n"
            f"(Combine's rings: {geo.ring_slots} bf16 rows per (channel, source).)",
            fontsize=7, va="top")
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black", linewidth=0.5)
               for _, c in slot_states]
    ax.legend(handles, [name for name, _ in slot_states],
              fontsize=7, loc="upper right", bbox_to_anchor=(1.12, 1.02))
    ax.set_xlim(-1.8, 1.8)
    ax.set_ylim(-2.25, 1.55)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"channel 0's staging ring (stage_batches={slots}), an example state",
                 fontsize=9, loc="left")
    fig.tight_layout()
    return save_figure(fig, OUT / "rings.png")


def main(argv=None) -> int:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", default=BENCH, help="a cute-ep bench record")
    parser.add_argument("--format", default="bf16")
    parser.add_argument("--sms", default="24")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--out", default=str(OUT), help="folder for the PNGs")
    args = parser.parse_args(argv)
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    for path in (dispatch_timeline(args.record, args.format, args.sms, args.rank),
                 decode_timeline(), rings(), *performance_figures()):
        print(f"{path}: {path.stat().st_size:,} bytes")
    return 0


def performance_figures() -> list[Path]:
    """The bench figure (time against SM budget beside DeepEP and NCCL) and the quantize figure
    (each kernel's share of copy), as `cute-ep plot` draws them."""
    figures = []
    for name, pair in BENCH_PAIRS.items():
        bench, deepep = (json.loads((ROOT / p).read_text()) for p in pair)
        figures.append(bench_figure(bench, OUT / name, deepep))
    record, entry, side = QUANT
    quant = json.loads((ROOT / record).read_text())
    return [*figures,
            quantize_figure(quant_records(quant[entry], side), OUT / "quantize-H200.png",
                            f"H200, 2026-11-26: share of copy bandwidth, 8192 rows over 8 "
                            f"experts, L2 state zero ({Path(record).name})")]


if __name__ == "__main__":
    sys.exit(main())
