"""Where the Python time of a dispatch and a combine call goes, on one GPU.

    python perf/profile_host.py [--ranks 2] [--tokens 4096] [--format bf16] [--calls 200]
                                [--json FILE]
    python perf/profile_host.py --launch-cost [--json FILE]
    python perf/profile_host.py --paths [--formats bf16,fp8-input,nvfp4-input] [--json FILE]

Every rank of the layer is emulated on this GPU (`Buffer.emulated`, a stream per rank), so the
host path is exactly the one a multi-GPU run takes. Each round launches every rank's dispatch
and then its combine, timing each Python call from entry to return (the GPU work still queued),
and waits for the round. Prints the median host time per call (rounds without the profiler),
then the functions that took the most of it (cProfile over as many more rounds, self time
first).

`--launch-cost` instead times single host steps in bursts of 32 after a synchronisation (far
below the launch queue's depth, so no call waits for the GPU): a torch kernel (`add_` on one
element), `torch.empty`, `Kernel.launch` (the checked path) and a bound `Launcher` call (the
path `Buffer` takes) of the same tiny `block_memcpy`, and the first read of a carved output
field (an FP8 decode call's scales) as `_Carve.view` makes it and as it made it before.

`--cold` times a decode call's host steps (`--tokens` 128, 2 ranks emulated, launches replaced
by no-ops) each alone, cold (after a synchronisation and a 1 ms sleep, as `cute-ep bench`'s host
column calls after its barrier) and hot (bursts of 32): a bound launch, torch.empty, the
dispatch's outputs (its two allocations and their objects), its input checks, the whole
dispatch and combine calls.

`--split` splits a decode call's host time (one rank, `--tokens` 128, real launches, no
profiler) by replacing its parts in turn, in rounds that interleave every variant so the host's
drifting speed falls on all alike: the whole call; its launch replaced by a no-op; that and its
tokens allocation replaced by one tensor made once; beside them, the same launch alone, the tokens
allocation alone, a one-element torch `add_` (a torch kernel launch's cost on this host) and the
CPU probe (`cpu_probe_us`). Bursts of 32 calls, outputs kept until the burst ends (released
untimed); the median and the least burst over `--rounds`.

`--paths` compares, in one process on one Buffer (2 ranks emulated, `--tokens` 128, launches
replaced by no-ops), a decode dispatch through the one-pass path (`Buffer.dispatch`) and
through the general, checked path (`Buffer._checked_dispatch`): bursts of 32 calls of each,
alternated 60 times, so a host whose speed drifts between processes still compares them.
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.table import Table


def _inputs(cfg, tokens, gen, fmt):
    """One rank's call in bench format `fmt` (`cute_ep.tools.bench.quantized_input`)."""
    from cute_ep.tools.bench import quantized_input

    x = torch.randn(tokens, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, cfg.experts, device="cuda", generator=gen).argsort(1)[
        :, :cfg.topk].int()
    w = torch.rand(tokens, cfg.topk, device="cuda", generator=gen)
    quant = {"global_scale": torch.tensor([100.0], device="cuda")} \
        if cfg.format == "nvfp4" else {}
    return (quantized_input(x, fmt, quant), ids, w), quant


def _round(bufs, streams, calls, y, times):
    outs = []
    for buf, stream, (args, quant) in zip(bufs, streams, calls):
        with torch.cuda.stream(stream):
            start = time.perf_counter()
            outs.append(buf.dispatch(*args, **quant))
            times["dispatch"].append((time.perf_counter() - start) * 1e6)
    for buf, stream, out in zip(bufs, streams, outs):
        with torch.cuda.stream(stream):
            start = time.perf_counter()
            buf.combine(y[:out.tokens.shape[0]], out.handle)
            times["combine"].append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()


def _burst_us(fn, n=32, reps=40):
    """Median and least host microseconds per call of `fn` over `reps` bursts of `n` calls."""
    per = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(per), min(per)


def launch_cost() -> dict:
    from cute_ep.runtime.launch import runtime

    dev = torch.device("cuda", torch.cuda.current_device())
    kernel = runtime().select("block_memcpy", dev)
    src = torch.zeros(16, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    bound = kernel.bind(tuple(p.name for p in kernel.spec.params))
    one = torch.zeros(1, device=dev)
    carve, storage = _fp8_decode_carve(dev)
    flat = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
    steps = {
        "torch add_ (one element)": lambda: one.add_(1),
        "torch.empty (1 MiB)": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        "Kernel.launch (checked)": lambda: kernel.launch(dst, src, 1),
        "bound Launcher call": lambda: bound(dst.data_ptr(), src.data_ptr(), 1),
        "output field read (sliced, viewed: before)": lambda: _sliced_view(carve, flat, "scales"),
        "output field read (_Carve.view)": lambda: carve.view(storage, "scales"),
    }
    return {name: [_burst_us(fn) for _ in range(3)] for name, fn in steps.items()}


def _fp8_decode_carve(dev):
    """The carve of an FP8 decode Buffer's small outputs (128 tokens a rank, 2 ranks emulated,
    H 7168, top-8 of 256), as the Buffer plans it, and one allocation of it."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    buf = Buffer.emulated(EPConfig(7168, 8, 256, 2, 128, "fp8"), timeout_s=60.0)[0]
    carve = buf._output_carve
    return carve, torch.UntypedStorage(carve.end, device=dev)


def _sliced_view(carve, flat, name):
    """A carved field made as `_Carve.view` made it before 2026-11-29: the byte block sliced,
    then viewed as the dtype and as the shape."""
    at, shape, dtype, nbytes = carve.parts[name]
    return flat[at:at + nbytes].view(dtype).view(shape)


def _cold_us(fn, n=200):
    """Median host microseconds of `fn` called alone after a synchronisation and 1 ms idle."""
    per = []
    for _ in range(n):
        torch.cuda.synchronize()
        time.sleep(1e-3)
        start = time.perf_counter()
        fn()
        per.append((time.perf_counter() - start) * 1e6)
    return statistics.median(per)


def _decode_buffer(fmt: str, tokens: int, sms: int):
    """(buffer, dispatch args, its keywords) of a decode call in bench format `fmt`, 2 ranks
    emulated, launches replaced by no-ops."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(7168, 8, 256, 2, tokens, fmt.removesuffix("-input"))
    buf = Buffer.emulated(cfg, sms=sms, timeout_s=60.0)[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    args, quant = _inputs(cfg, tokens, gen, fmt)
    quant["num_input_tokens"] = tokens
    buf._dispatch_launch = buf._common_launch = buf._combine_launch = buf._encode_launch = \
        lambda *values: None
    return buf, args, quant


def host_paths(formats: list[str], tokens: int, sms: int, reps: int = 60) -> dict:
    """{format: {path: (least, median) us a call}}: the one-pass and the general path of the
    same decode dispatch, bursts of 32 alternated `reps` times."""
    result = {}
    for fmt in formats:
        buf, (x, ids, w), quant = _decode_buffer(fmt, tokens, sms)
        gs = quant.get("global_scale")
        if gs is None and buf._common_dispatch(x, ids, w, tokens) is None:
            raise SystemExit(f"{fmt}: this call does not take the one-pass path")
        calls = {"one-pass": lambda: buf.dispatch(x, ids, w, **quant),
                 "general": lambda: buf._checked_dispatch(x, ids, w, False, tokens, gs)}
        times = {name: [] for name in calls}
        for _ in range(reps):
            for name, fn in calls.items():
                times[name].append(_burst_us(fn, reps=1)[0])
        result[fmt] = {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}
    return result


def cold_steps(fmt: str, tokens: int, sms: int) -> dict:
    """{step: (cold us, hot us)} of a decode call's host steps, launches replaced by no-ops."""
    from cute_ep.runtime.launch import runtime

    dev = torch.device("cuda", torch.cuda.current_device())
    kernel = runtime().select("block_memcpy", dev)
    src = torch.zeros(16, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    bound = kernel.bind(tuple(p.name for p in kernel.spec.params))
    buf, (x, ids, w), quant = _decode_buffer(fmt, tokens, sms)
    y = torch.randn(buf.cfg.row_capacity, buf.cfg.hidden, device="cuda").to(torch.bfloat16)
    out = buf.dispatch(x, ids, w, **quant)
    steps = {
        "bound Launcher call (block_memcpy)": lambda: bound(dst.data_ptr(), src.data_ptr(), 1),
        "torch.empty (1 MiB)": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        # Through the Buffer's own method, so the step times what a dispatch allocates.
        "the dispatch's outputs": lambda: buf._dispatch_outputs(out.handle.routing),
        "dispatch input checks": lambda: buf._checked_inputs(
            x, ids, w, tokens, quant.get("global_scale")),
        "dispatch call, no launch": lambda: buf.dispatch(x, ids, w, **quant),
        "combine call, no launch": lambda: buf.combine(y, out.handle),
    }
    return {name: (_cold_us(fn), _burst_us(fn)[0]) for name, fn in steps.items()}


def split_call(formats: list[str], tokens: int, rounds: int) -> dict:
    """{format: {part: (median, least) us a call}} of `--split` (see the module docstring)."""
    from cute_ep.ep import Buffer
    from cute_ep.tools.bench import _inputs as bench_inputs, _layer_format, cpu_probe_us
    from layouts import EPConfig

    result = {}
    for fmt in formats:
        cfg = EPConfig(7168, 8, 256, 1, tokens, _layer_format(fmt))
        buf = Buffer.emulated(cfg, timeout_s=60.0)[0]
        x, ids, w, y, quant = bench_inputs(cfg, tokens, 100, fmt)  # as `host_steady` calls
        quant = dict(quant, num_input_tokens=tokens)
        for _ in range(20):
            buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)
        # The launch the call makes: the one-pass path's (`Buffer._common_dispatch`).
        launch, tokens_like = buf._common_launch, buf._tokens_like
        captured = []
        buf._common_launch = lambda *values: captured.append(values)
        out = buf.dispatch(x, ids, w, **quant)
        buf._common_launch = launch
        if not captured:
            raise SystemExit(f"{fmt}: this call does not take the one-pass path")
        one_tokens = tokens_like.new_empty(*buf._tokens_shape)
        one = torch.zeros(1, device="cuda")
        kept = []

        def burst(fn, n=32):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                kept.append(fn())
            us = (time.perf_counter() - start) / n * 1e6
            kept.clear()
            return us

        def call(no_launch=False, no_alloc=False):
            if no_launch:
                buf._common_launch = lambda *values: None
            if no_alloc:
                buf._tokens_like = SimpleNamespace(new_empty=lambda *shape: one_tokens)
            try:
                return burst(lambda: buf.dispatch(x, ids, w, **quant))
            finally:
                buf._common_launch, buf._tokens_like = launch, tokens_like

        parts = {
            "dispatch call": call,
            "dispatch call, launch a no-op": lambda: call(no_launch=True),
            "dispatch call, launch a no-op, tokens made once": lambda: call(True, True),
            "combine call": lambda: burst(lambda: buf.combine(y, out.handle)),
            "the dispatch's launch alone": lambda: burst(lambda: launch(*captured[0])),
            "the tokens allocation alone": lambda: burst(
                lambda: tokens_like.new_empty(*buf._tokens_shape)),
            "torch add_ (one element)": lambda: burst(lambda: one.add_(1)),
            "CPU probe / 100": lambda: cpu_probe_us() / 100,
        }
        times = {name: [] for name in parts}
        for _ in range(rounds):
            for name, fn in parts.items():
                times[name].append(fn())
        torch.cuda.synchronize()
        buf.check()
        result[fmt] = {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}
    return result


def main():
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--format", default="bf16")
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=None, help="write the medians and quantiles here")
    parser.add_argument("--launch-cost", action="store_true",
                        help="time single host steps (a launch, an allocation) instead")
    parser.add_argument("--cold", action="store_true",
                        help="time a decode call's host steps cold and hot instead")
    parser.add_argument("--paths", action="store_true",
                        help="compare the one-pass and the general dispatch path instead")
    parser.add_argument("--split", action="store_true",
                        help="split a decode call's host time into its parts instead")
    parser.add_argument("--rounds", type=int, default=30, help="--split: interleaved rounds")
    parser.add_argument("--formats", default="bf16,fp8-input,nvfp4-input",
                        help="--paths, --split: the bench formats")
    args = parser.parse_args()
    if args.split:
        tokens = 128 if args.tokens == 4096 else args.tokens  # a decode call unless told
        split = split_call(args.formats.split(","), tokens, args.rounds)
        table = Table(title=f"host us a call, {tokens} tokens, one rank: median (least) of "
                            f"{args.rounds} interleaved rounds of bursts of 32")
        table.add_column("part")
        for fmt in split:
            table.add_column(fmt, justify="right")
        for name in next(iter(split.values())):
            table.add_row(name, *(f"{split[f][name][0]:.1f} ({split[f][name][1]:.1f})"
                                  for f in split))
        Console().print(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"),
                           "device": torch.cuda.get_device_name(), "tokens": tokens,
                           "rounds": args.rounds, "us_median_least": split}, f, indent=1)
        return
    if args.paths:
        tokens = 128 if args.tokens == 4096 else args.tokens  # a decode call unless told
        paths = host_paths(args.formats.split(","), tokens, args.sms)
        table = Table(title=f"host us per dispatch call, {tokens} tokens, launches no-op'd: "
                            f"least and median of 60 bursts of 32, the paths alternated")
        for col in ("format", "one-pass", "general", "one-pass / general"):
            table.add_column(col)
        for fmt, p in paths.items():
            table.add_row(fmt, *(f"{lo:.1f} ({med:.1f})" for lo, med in p.values()),
                          f"{p['one-pass'][1] / p['general'][1]:.2f}")
        Console().print(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"),
                           "device": torch.cuda.get_device_name(), "tokens": tokens,
                           "us_least_median": paths}, f, indent=1)
        return
    if args.cold:
        steps = cold_steps(args.format, args.tokens, args.sms)
        table = Table(title=f"host us per step, {args.format}, {args.tokens} tokens: cold "
                            f"(after a synchronisation and 1 ms idle, median of 200) and hot "
                            f"(bursts of 32)")
        for col in ("step", "cold us", "hot us"):
            table.add_column(col)
        for name, (cold, hot) in steps.items():
            table.add_row(name, f"{cold:.1f}", f"{hot:.1f}")
        Console().print(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"),
                           "device": torch.cuda.get_device_name(), "format": args.format,
                           "tokens": args.tokens, "cold_hot_us": steps}, f, indent=1)
        return
    if args.launch_cost:
        costs = launch_cost()
        table = Table(title="host us per call, bursts of 32 (median, least) x 3 runs")
        table.add_column("step")
        table.add_column("us")
        for name, runs in costs.items():
            table.add_row(name, "  ".join(f"{m:.1f} ({lo:.1f})" for m, lo in runs))
        Console().print(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"),
                           "device": torch.cuda.get_device_name(),
                           "us_median_least": costs}, f, indent=1)
        return
    if args.calls < 10:
        raise SystemExit("--calls: at least 10")

    from cute_ep.tools.bench import FORMATS

    if args.format not in FORMATS:
        raise SystemExit(f"--format: one of {', '.join(FORMATS)}")
    cfg = EPConfig(args.hidden, 8, 256, args.ranks, args.tokens,
                   args.format.removesuffix("-input"))
    bufs = Buffer.emulated(cfg, sms=args.sms, timeout_s=60.0)
    streams = [torch.cuda.Stream() for _ in bufs]
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = [_inputs(cfg, args.tokens, gen, args.format) for _ in bufs]
    y = torch.randn(cfg.row_capacity, cfg.hidden, device="cuda", generator=gen).to(
        torch.bfloat16)
    times = {"dispatch": [], "combine": []}
    for _ in range(5):  # warm-up: kernels loaded, allocator blocks cached per stream
        _round(bufs, streams, calls, y, times)
    times = {"dispatch": [], "combine": []}
    for _ in range(args.calls // args.ranks):  # timed without the profiler's own overhead
        _round(bufs, streams, calls, y, times)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls // args.ranks):
        _round(bufs, streams, calls, y, {"dispatch": [], "combine": []})
    profile.disable()
    for buf in bufs:
        buf.check()

    console = Console()
    table = Table(title=f"host time per call, {args.format}, {args.ranks} emulated ranks, "
                        f"{args.tokens} tokens/rank, H={args.hidden}, {args.sms} SMs")
    for col in ("call", "median us", "p10 us", "p90 us", "calls"):
        table.add_column(col)
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        table.add_row(name, f"{statistics.median(ts):.1f}", f"{q[0]:.1f}", f"{q[-1]:.1f}",
                      str(len(ts)))
    console.print(table)
    if args.json:
        record = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                  "format": args.format, "ranks": args.ranks, "tokens": args.tokens,
                  "hidden": args.hidden, "sms": args.sms, "calls": args.calls,
                  **{f"{name}_us": {"median": statistics.median(ts),
                                    "p10": statistics.quantiles(ts, n=10)[0],
                                    "p90": statistics.quantiles(ts, n=10)[-1]}
                     for name, ts in times.items()}}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    console.print(text.getvalue())


if __name__ == "__main__":
    main()
