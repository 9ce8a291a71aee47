"""Where each channel's time goes in steady state: the per-channel timeline of a dispatch and of
its combine, beside the rows each channel received, on every visible GPU (one rank each).

    python perf/trace_channels.py [--formats bf16,fp8-input,nvfp4-input] [--sms 24]
                                  [--tokens 4096] [--json FILE]

`cute-ep bench`'s traced call comes after a barrier, so its stamps hold the ranks' launch skew.
Here each format runs WARMUP layers, then LAYERS more back to back with tracing on, and the trace
is zeroed in stream order before the last, which alone is read: the ranks are as far apart as a
model's layers leave them. For each stamp of `layouts.channels.TRACE_FIELDS` (dispatch) and
`COMBINE_TRACE_FIELDS` (combine), the table gives the earliest, median and latest channel (us from
the rank's first channel start; the `_us` fields are each channel's longest warp's wait). The
last column ties the two together: the correlation, over channels, of the rows a channel received
with the time its receivers finished. Channels own contiguous runs of their rank's tokens (as
many tokens each), so how many rows a channel receives varies with the routing.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

WARMUP = 3
LAYERS = 4


def rows_per_channel(ids_by_source: list, rank: int, local_experts: int,
                     ranges: list[tuple[int, int]]) -> list[int]:
    """Rows rank `rank` receives on each channel: for channel c, the (token, k) pairs of every
    source's tokens ranges[c] whose expert lives on `rank` (ids [T, K] per source)."""
    rows = []
    for begin, end in ranges:
        rows.append(sum(int(((ids[begin:end] // local_experts) == rank).sum())
                        for ids in ids_by_source))
    return rows


def timeline(trace: torch.Tensor, fields: tuple[str, ...], channels: int) -> dict:
    """Per field, each of the first `channels` channels' value (us): stamps from the earliest
    channel start, `_ns` waits (renamed `_us`) as they are; a stamp a channel never set is None."""
    t = trace[:channels].double().cpu()
    start = t[:, 0].min()
    out = {}
    for i, field in enumerate(fields):
        col = t[:, i]
        if field.endswith("_ns"):
            out[field[:-3] + "_us"] = [round(v / 1e3, 2) for v in col.tolist()]
        elif field != "start":
            out[field] = [round((v - start.item()) / 1e3, 2) if v > 0 else None
                          for v in col.tolist()]
    return out


def spread(values: list) -> tuple[float, float, float] | None:
    """(min, median, max) of the values set, None if there are none."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return vals[0], statistics.median(vals), vals[-1]


def correlation(a: list, b: list) -> float | None:
    """Pearson's correlation of two equally long lists (None where either has no spread)."""
    if len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(torch.corrcoef(torch.tensor([a, b], dtype=torch.float64))[0, 1])


def _probe(rank: int, world: int, formats: list[str], sms: int, tokens: int) -> list[dict]:
    import torch.distributed as dist

    from cute_ep.ep import Buffer
    from cute_ep.tools import bench
    from layouts import EPConfig
    from layouts.channels import COMBINE_TRACE_FIELDS, TRACE_FIELDS

    out = []
    for fmt in formats:
        cfg = EPConfig(7168, 8, 256, world, tokens, bench._layer_format(fmt))
        buf = Buffer(cfg, sms=sms)
        x, ids, w, y, quant = bench._inputs(cfg, tokens, 100 + rank, fmt)
        for _ in range(WARMUP):
            buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)
        torch.cuda.synchronize()
        dist.barrier()
        buf.trace_dispatch(True)
        buf.trace_combine(True)
        for layer in range(LAYERS):
            if layer == LAYERS - 1:
                buf.trace.zero_()
                buf.combine_trace.zero_()
            buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)
        torch.cuda.synchronize()
        active = buf.active_channels(None)  # as the calls above (no num_input_tokens)
        every = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(every, ids.contiguous())
        ranges = [buf.geo.token_range(c, tokens) for c in range(active)]
        out.append({"format": fmt, "channels": active,
                    "rows": rows_per_channel(every, rank, cfg.experts // world, ranges),
                    "dispatch": timeline(buf.trace, TRACE_FIELDS, active),
                    "combine": timeline(buf.combine_trace, COMBINE_TRACE_FIELDS, active)})
        buf.trace_dispatch(False)
        buf.trace_combine(False)
        buf.check()
        del buf
        torch.cuda.synchronize()
        dist.barrier()
    return out


def _table(results: list[list[dict]]):
    from rich.table import Table

    table = Table(title="per channel, steady state: earliest / median / latest (us)")
    for col in ("rank", "format", "op", "field", "channels"):
        table.add_column(col)
    table.add_column("corr. with rows", justify="right")
    for rank, per_format in enumerate(results):
        for entry in per_format:
            for op in ("dispatch", "combine"):
                end = "recv_done" if op == "dispatch" else "end"
                for field, values in entry[op].items():
                    s = spread(values)
                    if s is None:
                        continue
                    r = correlation(entry["rows"], values) if field == end else None
                    table.add_row(str(rank), entry["format"], op, field,
                                  f"{s[0]:.1f} / {s[1]:.1f} / {s[2]:.1f}",
                                  "" if r is None else f"{r:.2f}")
            rows = entry["rows"]
            table.add_row(str(rank), entry["format"], "", "rows received",
                          f"{min(rows)} / {statistics.median(rows):.0f} / {max(rows)}", "")
    return table


def main() -> None:
    from rich.console import Console

    from cute_ep.tools.spawn import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bf16,fp8-input,nvfp4-input")
    p.add_argument("--sms", type=int, default=24)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    formats = args.formats.split(",")
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("trace_channels needs two GPUs or more")
    results = run_ranks(_probe, world=world, limit_s=120 + 60 * len(formats), formats=formats,
                        sms=args.sms, tokens=args.tokens)
    Console().print(_table(results))
    if args.json:
        record = {"kind": "per-channel steady-state timeline (perf/trace_channels.py)",
                  "device": torch.cuda.get_device_name(0), "gpus": world,
                  "config": {"tokens": args.tokens, "hidden": 7168, "topk": 8, "experts": 256,
                             "sms": args.sms, "warmup": WARMUP, "layers": LAYERS},
                  "ranks": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
