"""Bandwidth of the quantize and fused SwiGLU kernels against a device-to-device copy of the same
number of bytes, in the same run, on one GPU.

    python perf/bench_quant.py [--rows 8192] [--intermediate 2048 --intermediate 7168]
                               [--experts 8] [--reps 50] [--layout thread|warp|table]
                               [--l2 zero|read|produced ...] [--valid-rows N] [--json FILE]
                               [--plot FILE]

For each kernel: bytes = what it must read (the bf16 input rows, row_offsets) + what it writes
(codes or values, scales including the zero padding); GB/s = bytes / median time. The baseline
copies bytes / 2 with `torch.Tensor.copy_` (so it too reads + writes `bytes`), timed the same way
(CUDA events, L2 flushed before every repetition, the launches queued behind a device sleep so
the time is the GPU's, not the host's Python path: `timing.median_ms`). A copy's time depends on
where its buffers lie in memory (the same bytes took 24.4 to 25.8 us on an H200, by where the
pair was allocated), so the baseline copies between COPY_PLACEMENTS pairs of buffers allocated side
by side and takes the median of their times; the JSON keeps each pair's. `--layout` forces the
SwiGLU kernels' layout (`cute_ep.silu._layout`; by default it is chosen by size as in use), to
compare layouts in one run. `--valid-rows N` spreads the experts over the first N rows only, the
input keeping all `--rows` (a capacity buffer, as a fixed-size decode step has): bytes and the
baseline are the valid rows', so the figure shows what the rows past them cost.

`--l2` sets what L2 holds when each repetition starts (several: each in turn, the same
kernels and baseline); every state flushes 256 MB first:
- `zero` (the default): the flush buffer is zeroed, so L2 is full of dirty lines of no use,
  written back while the timed kernel runs;
- `read`: the flush buffer is read instead, so L2 holds clean lines of no use;
- `produced`: zeroed, then the kernel's input (the copy's source) rewritten in place, as the
  kernel that produced it would leave L2.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table
from timing import median_ms


def cases(rows: int, i: int, experts: int, valid: int | None = None):
    """(name, callable, bytes moved, input tensor) of every kernel at this size; `valid`: the
    rows the experts span (default all), the bytes those rows move."""
    from cute_ep.quant import quantize_nvfp4
    from cute_ep.reference.fp4 import scale_block_bytes, segment_scale_blocks
    from cute_ep.silu import fused_silu, fused_silu_fp8, fused_silu_mxfp4, fused_silu_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2 * i, device="cuda", generator=gen).to(torch.bfloat16)
    valid = rows if valid is None else valid
    offsets = torch.linspace(0, valid, experts + 1, device="cuda").round().to(torch.int32)
    gs = torch.ones(experts, device="cuda")
    read = valid * 2 * i * 2 + offsets.numel() * 4
    # The scale bytes written: every used 128-row block of every expert, padding included.
    blocks = segment_scale_blocks(offsets.tolist())[-1]
    fp4_scales = {v: blocks * scale_block_bytes(i, v) for v in (16, 32)}
    out = [
        ("fused_silu (bf16)", lambda: fused_silu(x, offsets), read + valid * i * 2, x),
        ("fused_silu interleaved (bf16)", lambda: fused_silu(x, offsets, interleaved=True),
         read + valid * i * 2, x),
        ("fused_silu_nvfp4", lambda: fused_silu_nvfp4(x, gs, offsets),
         read + valid * i // 2 + fp4_scales[16], x),
        ("fused_silu_nvfp4 interleaved",
         lambda: fused_silu_nvfp4(x, gs, offsets, interleaved=True),
         read + valid * i // 2 + fp4_scales[16], x),
        ("fused_silu_mxfp4", lambda: fused_silu_mxfp4(x, offsets),
         read + valid * i // 2 + fp4_scales[32], x),
        ("fused_silu_mxfp4 swiglu_oai", lambda: fused_silu_mxfp4(x, offsets, swiglu_limit=7.0),
         read + valid * i // 2 + fp4_scales[32], x),
    ]
    if i % 128 == 0:
        out.insert(2, ("fused_silu_fp8", lambda: fused_silu_fp8(x, offsets),
                       read + valid * i + valid * i // 128 * 4, x))
    half = x[:, :i].contiguous()  # quantize_nvfp4 reads [rows, I]
    out.append(("quantize_nvfp4 (128x4)", lambda: quantize_nvfp4(half, gs, offsets),
                valid * i * 2 + valid * i // 2 + fp4_scales[16], half))
    return out


L2_STATES = ("zero", "read", "produced")


def l2_prep(state: str, flush: torch.Tensor, produced: torch.Tensor):
    """What runs before each repetition for L2 `state` (`produced`: the tensor rewritten);
    None for `zero`: `median_ms`'s own flush, which zeroes the buffer."""
    if state == "zero":
        return None
    if state == "read":
        return lambda: flush.max()
    return lambda: (flush.zero_(), produced.mul_(1))


COPY_PLACEMENTS = 4


def copy_baseline_ms(nbytes: int, reps: int, flush: torch.Tensor, state: str = "zero"
                     ) -> list[float]:
    """Median times (ms) of `copy_` of nbytes / 2 bytes between each of COPY_PLACEMENTS
    (source, destination) pairs, all allocated before any is timed (so each lies elsewhere),
    L2 as `state` leaves it (`produced`: the source rewritten)."""
    pairs = []
    for _ in range(COPY_PLACEMENTS):
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        pairs.append((src, torch.empty_like(src)))
    return [median_ms(lambda: dst.copy_(src), reps, flush, prep=l2_prep(state, flush, src))
            for src, dst in pairs]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--intermediate", type=int, action="append")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--layout", choices=["thread", "warp", "table"],
                        help="force the SwiGLU kernels' layout (default: chosen by size)")
    parser.add_argument("--l2", choices=L2_STATES, action="append",
                        help="what L2 holds when each repetition starts (default: zero)")
    parser.add_argument("--valid-rows", type=int,
                        help="rows the experts span (default: all): a capacity buffer")
    parser.add_argument("--json", help="also write the records to this file")
    parser.add_argument("--plot", help="also draw each kernel's share of copy (PNG; needs the "
                                       "plot extra), for the first --l2 state")
    args = parser.parse_args()
    if args.valid_rows is not None and not 0 < args.valid_rows <= args.rows:
        parser.error(f"--valid-rows must be in 1..{args.rows}, got {args.valid_rows}")
    if args.layout:
        import cute_ep.silu

        cute_ep.silu._layout = lambda rows, sms: args.layout
    sizes = args.intermediate or [2048, 7168]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    states = args.l2 or ["zero"]
    records = []
    for i in sizes:
        for name, fn, nbytes, inp in track(cases(args.rows, i, args.experts, args.valid_rows),
                                           description=f"I={i}", transient=True):
            fn()  # load the module before timing
            for state in states:
                copies = copy_baseline_ms(nbytes, args.reps, flush, state)
                copy_ms = statistics.median(copies)
                ms = median_ms(fn, args.reps, flush, prep=l2_prep(state, flush, inp))
                records.append({"kernel": name, "layout": args.layout or "by size", "l2": state,
                                "rows": args.rows, "valid_rows": args.valid_rows or args.rows,
                                "intermediate": i,
                                "bytes": nbytes, "us": ms * 1e3, "gbps": nbytes / ms / 1e6,
                                "copy_us": copy_ms * 1e3, "copy_gbps": nbytes / copy_ms / 1e6,
                                "copy_us_placements": [t * 1e3 for t in copies]})
    spread = (f"{args.valid_rows} of {args.rows} rows" if args.valid_rows
              else f"{args.rows} rows")
    table = Table(title=f"{torch.cuda.get_device_name()}: {spread} over {args.experts} "
                        f"experts, median of {args.reps}, L2 flushed ({', '.join(states)}); "
                        f"baseline: copy_ of bytes/2 "
                        f"(median of {COPY_PLACEMENTS} buffer pairs); "
                        f"layout {args.layout or 'by size'}")
    for col in ("kernel", "I", "L2", "MB moved", "time (us)", "GB/s", "copy (us)", "copy GB/s",
                "of copy"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in records:
        table.add_row(r["kernel"], str(r["intermediate"]), r["l2"], f"{r['bytes'] / 1e6:.1f}",
                      f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{r['copy_us']:.1f}",
                      f"{r['copy_gbps']:.0f}", f"{r['gbps'] / r['copy_gbps']:.0%}")
    Console(width=140).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    if args.plot:
        from cute_ep.tools.plot import quant_records, quantize_figure

        state = states[0]
        quantize_figure(quant_records({"records": records}, l2=state), args.plot,
                        f"{torch.cuda.get_device_name()}: {spread} over {args.experts} experts, "
                        f"L2 {state}")


if __name__ == "__main__":
    main()
