"""Dispatch and combine with every rank emulated on one GPU (`Buffer.emulated`): the transport's
kernels without NVLink, so a time here is what the kernels themselves cost (counts, flow control,
expansion, reduction), not the link.

    python perf/bench_dispatch_emulated.py [--ranks 2,4] [--sms 24] [--tokens 4096] [--traces 5]
                                           [--direct-input] [--json FILE]
    python perf/bench_dispatch_emulated.py --combines [--tokens 128] [--experts 288] [--sms 20]
                                           [--ring-chunks 4] [--json FILE]

Each emulated rank runs its dispatch on its own CUDA stream; time = median over --reps of all
ranks' dispatches started together (events on a joining stream; the launches queued behind a
device sleep first, so the time is the GPU's and not the serial host launches'). One more
traced dispatch (`Buffer.trace_dispatch`) then gives where a channel's time goes: the latest
channel's %globaltimer stamps from the kernel's start, and every measured wait or step (`_ns`
fields of `layouts.channels.TRACE_FIELDS`, the longest channel's). With `--traces N`, N traced
dispatches, and the record's `channels_us` gives each stamp's median and latest channel (the
median over the N: one trace's stamps move by a microsecond or so).

`--combines` times instead the three combines of a decode step's bf16 tokens (slabs layout, every
token's ids distinct random experts): weighted at the experts (dispatch given the weights), weighted
at home (the weights given to combine: DeepEP's low-latency combine, the DeepEP face's) and
unreduced (no weights: each (token, k) row comes home); each with its traced channels' mean
finish of the senders and receivers and their waits (`layouts.channels.COMBINE_TRACE_FIELDS`).
"""

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from timing import sleep_cycles


def _time_all(bufs, args_of, reps, call=lambda buf, args: buf.dispatch(*args[0], **args[1])):
    """Median device us of every rank's `call` (default: its dispatch) started together (reps
    + 3 runs, 3 warm-ups). The ranks' calls are queued behind a sleep on the timing stream, so
    the time starts when the last rank's kernels are already queued: one Python thread launches
    every emulated rank one after another, host time that a GPU per process does not add (the
    host path is `profile_host.py`'s). A run whose launches outlast the sleep is repeated with
    a longer one."""
    streams = [torch.cuda.Stream() for _ in bufs]
    main = torch.cuda.current_stream()
    gate_us = 500.0 * len(bufs)
    cycles = sleep_cycles(gate_us)
    times = []
    while len(times) < reps + 3:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record(main)
        host = time.perf_counter()
        for buf, stream, args in zip(bufs, streams, args_of):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                call(buf, args)
        host = (time.perf_counter() - host) * 1e6
        for stream in streams:
            main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        if host > 0.8 * gate_us:  # the time may have started before the last launch
            gate_us *= 2
            cycles = sleep_cycles(gate_us)
            continue
        times.append(start.elapsed_time(end) * 1e3)
    for buf in bufs:
        buf.check()
    return statistics.median(times[3:]) if reps else None


def _dispatch_all(bufs, call):
    """Every rank's dispatch, side by side; their outputs."""
    streams = [torch.cuda.Stream() for _ in bufs]
    torch.cuda.synchronize()
    outs = []
    for buf, stream, c in zip(bufs, streams, call):
        with torch.cuda.stream(stream):
            outs.append(buf.dispatch(*c[0], **c[1]))
    torch.cuda.synchronize()
    return outs


def _rank_inputs(gen, cfg, tokens: int):
    """One rank's bf16 x [tokens, H], top-8 ids (distinct random experts) and fp32 weights,
    drawn from `gen` in that order."""
    x = torch.randn(tokens, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, cfg.experts, device="cuda", generator=gen).argsort(1)[:, :8].int()
    w = torch.rand(tokens, 8, device="cuda", generator=gen)
    return x, ids, w


def combines(ranks: int, sms: int, tokens: int, experts: int, hidden: int, reps: int,
              ring_chunks: int | None) -> dict:
    """`--combines`' row: us of each combine mode over every rank (median of `reps`), and the
    weighted-at-home combine's traced channels (mean over the ranks' active channels, us)."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from layouts.channels import COMBINE_TRACE_FIELDS

    cfg = EPConfig(hidden, 8, experts, ranks, tokens, "bf16", layout="slabs")
    geometry = {} if ring_chunks is None else {"ring_chunks": ring_chunks}
    bufs = Buffer.emulated(cfg, sms=sms, timeout_s=30.0, **geometry)
    gen = torch.Generator(device="cuda").manual_seed(ranks)
    weighted, plain, weights = [], [], []
    for _ in range(ranks):
        x, ids, w = _rank_inputs(gen, cfg, tokens)
        weighted.append(((x, ids, w), {"num_input_tokens": tokens}))
        plain.append(((x, ids, None), {"num_input_tokens": tokens}))
        weights.append(w)
    y = torch.randn(cfg.row_capacity, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    row = {"ranks": ranks, "sms": sms, "tokens": tokens, "experts": experts,
           "ring_chunks": bufs[0].geo.ring_chunks}
    outs = _dispatch_all(bufs, weighted)
    row["at_experts_us"] = _time_all(bufs, outs, reps, lambda b, o: b.combine(y, o.handle))
    outs = _dispatch_all(bufs, plain)
    row["unreduced_us"] = _time_all(bufs, outs, reps, lambda b, o: b.combine(y, o.handle))
    at_home = list(zip(outs, weights))

    def home(b, ow):
        return b.combine(y, ow[0].handle, topk_weights=ow[1])
    row["at_home_us"] = _time_all(bufs, at_home, reps, home)
    for b in bufs:
        b.trace_combine(True)
    _time_all(bufs, at_home, 0, home)
    active = outs[0].handle.routing.channels
    trace = torch.stack([b.combine_trace[:active] for b in bufs]).double() / 1e3
    trace[:, :, 1:4] -= trace[:, :, :1]  # the stamps from each channel's start
    row["at_home_trace_mean_us"] = {f: round(trace[:, :, i].mean().item(), 1)
                                    for i, f in enumerate(COMBINE_TRACE_FIELDS) if i > 0}
    return row


def channel_stamps(traces: list, stamps: list[str], fields: tuple) -> dict:
    """Where the channels were at each stamp, from traced dispatches (`traces`: each a [ranks,
    channels, fields] tensor of %globaltimer ns, `fields` naming its last dimension): per stamp,
    [the median channel's, the latest channel's] us from the earliest channel's start, each the
    median over the traces."""
    per = {f: ([], []) for f in stamps}
    for trace in traces:
        us = trace.double() / 1e3
        start = us[:, :, fields.index("start")].min()
        for f in stamps:
            at = (us[:, :, fields.index(f)] - start).flatten().tolist()
            per[f][0].append(statistics.median(at))
            per[f][1].append(max(at))
    return {f: [round(statistics.median(m), 2), round(statistics.median(x), 2)]
            for f, (m, x) in per.items()}


def dispatch_table(title: str, records: list[dict]) -> Table:
    """The dispatch records as a table a terminal of any width shows whole: a row per figure
    (the times, then the traced stamps from the start and the longest waits, us), a column per
    format, ranks and SMs."""
    table = Table(title=title)
    table.add_column("us", no_wrap=True)
    for r in records:
        table.add_column(f"{r['format']} {r['ranks']} ranks {r['sms']} SMs", justify="right")
    table.add_row("dispatch, all ranks", *(f"{r['dispatch_us']:.1f}" for r in records))
    table.add_row("combine", *(f"{r['combine_us']:.1f}" for r in records))
    for f in (list(records[0]["trace_us"]) if records else []):
        label = f"{f[:-3]}, longest" if f.endswith("_ns") else f"{f}, at"
        table.add_row(label, *(f"{r['trace_us'][f]:.1f}" for r in records))
    return table


def main():
    from cute_ep.ep import Buffer
    from cute_ep.tools.bench import direct_input, quantized_input
    from layouts import EPConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--sms", default="24")
    # fp8-input, nvfp4-input: a layer given its tokens already quantized, (codes, scales).
    parser.add_argument("--formats", default="bf16,fp8,fp8-input")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--traces", type=int, default=1,
                        help="traced dispatches a configuration: its record's channels_us gives "
                             "each stamp's median and latest channel, the median over them")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--combines", action="store_true",
                        help="time the combines of a decode step's bf16 tokens instead")
    parser.add_argument("--experts", type=int, default=None,
                        help="experts (default 256; --combines: 288)")
    parser.add_argument("--direct-input", action="store_true",
                        help="x (bf16, or a -input format's codes and scales) written into each "
                             "rank's direct input (Buffer input_rows), which dispatch reads in "
                             "place, as `cute-ep bench --direct-input`")
    parser.add_argument("--ring-chunks", type=int, default=None,
                        help="--combines: the combine rings' chunks (default: the Buffer's)")
    args = parser.parse_args()
    if args.traces < 1:
        parser.error("--traces: at least 1 (the table's stamps come from the traced dispatches)")
    if args.combines:
        tokens = 128 if args.tokens == 4096 else args.tokens  # a decode step unless told
        rows = [combines(r, sms, tokens, args.experts or 288, args.hidden, args.reps,
                         args.ring_chunks)
                for r in map(int, args.ranks.split(",")) for sms in map(int, args.sms.split(","))]
        table = Table(title=f"{torch.cuda.get_device_name()}: emulated ranks, {tokens} tokens a "
                            f"rank, H={args.hidden} K=8, combine us (median of {args.reps}); "
                            f"weighted at home: its channels' mean finish and waits")
        fields = list(rows[0]["at_home_trace_mean_us"])
        for col in ("ranks", "SMs", "ring chunks", "at experts", "at home", "unreduced",
                    *fields):
            table.add_column(col)
        for r in rows:
            table.add_row(str(r["ranks"]), str(r["sms"]), str(r["ring_chunks"]),
                          *(f"{r[k]:.1f}" for k in ("at_experts_us", "at_home_us",
                                                    "unreduced_us")),
                          *(f"{v}" for v in r["at_home_trace_mean_us"].values()))
        Console().print(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "hidden": args.hidden,
                           "reps": args.reps, "combines": rows}, f, indent=1)
        return
    records = []
    from layouts.channels import TRACE_FIELDS

    stamps = [f for f in TRACE_FIELDS[1:] if not f.endswith("_ns")]
    waits = [f for f in TRACE_FIELDS if f.endswith("_ns")]
    for name in args.formats.split(","):
        fmt = name.removesuffix("-input")
        for r in map(int, args.ranks.split(",")):
            for sms in map(int, args.sms.split(",")):
                cfg = EPConfig(args.hidden, 8, args.experts or 256, r, args.tokens, fmt)
                # The direct input: bf16 x, or pre-quantized (codes, scales) ("-input").
                direct = args.direct_input and (fmt == "bf16" or name.endswith("-input"))
                bufs = Buffer.emulated(cfg, sms=sms, timeout_s=30.0,
                                       **({"input_rows": args.tokens} if direct else {}))
                gen = torch.Generator(device="cuda").manual_seed(r)
                call = []
                for buf in bufs:
                    x, ids, w = _rank_inputs(gen, cfg, args.tokens)
                    quant = {"global_scale": torch.tensor([100.0], device="cuda")} \
                        if fmt == "nvfp4" else {}
                    x = quantized_input(x, name, quant)
                    call.append(((direct_input(buf, x) if direct else x, ids, w), quant))
                us = _time_all(bufs, call, args.reps)
                # Combine of one dispatch, repeated; random expert outputs (one tensor all
                # ranks read, to keep memory to one row_capacity x H).
                outs = _dispatch_all(bufs, call)
                y = torch.randn(cfg.row_capacity, args.hidden, device="cuda",
                                generator=gen).to(torch.bfloat16)
                combine_us = _time_all(bufs, outs, args.reps,
                                       lambda buf, out: buf.combine(y, out.handle))
                del outs
                for buf in bufs:
                    buf.trace_dispatch(True)
                traces = []
                for _ in range(args.traces):
                    _time_all(bufs, call, 0)
                    traces.append(torch.stack([buf.trace for buf in bufs]).cpu())
                trace = traces[-1].double() / 1e3  # us
                start = trace[:, :, 0].min()
                cells = [f"{(trace[:, :, TRACE_FIELDS.index(f)].max() - start).item():.1f}"
                         for f in stamps]
                longest = [f"{trace[:, :, TRACE_FIELDS.index(f)].max().item():.1f}"
                           for f in waits]
                records.append({"format": name, "ranks": r, "sms": sms, "dispatch_us": us,
                                "combine_us": combine_us,
                                "trace_us": dict(zip(stamps + waits, map(float, cells + longest))),
                                "channels_us": channel_stamps(traces, stamps, TRACE_FIELDS)})
                del bufs
    Console().print(dispatch_table(
        f"{torch.cuda.get_device_name()}: emulated ranks, {args.tokens} tokens/rank, "
        f"H={args.hidden} K=8 E={args.experts or 256}, median of {args.reps}", records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tokens": args.tokens,
                       "hidden": args.hidden, "reps": args.reps, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
