"""`quantize_nvfp4` with each scale layout (and each 128x4 kernel) beside `copy_` of the same
bytes, in the default and the clean L2 state, on one GPU:

    python perf/quantize_layouts.py [--intermediate 2048 --intermediate 7168] [--experts 8]
                                    [--reps 50] [--json FILE]

8192 rows over `--experts` experts (8, as `perf/bench_quant.py`; with 60, say, their boundaries
fall inside 128-row blocks); the 128x4 scales once through each kernel (`cute_ep.quant._order`:
"rows" a row at a time, "quads" four rows at a time), then the linear layout (always the row
kernel). With 8 experts both layouts write the same number of scale bytes (whole 128-row blocks,
K / 16 a multiple of 4), so the difference is how the stores meet memory; bytes moved count each
layout's own (128x4 with its padding rows).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_quant import copy_baseline_ms, l2_prep
from rich.console import Console
from rich.table import Table
from timing import median_ms


def main() -> None:
    import cute_ep.quant
    from cute_ep.quant import quantize_nvfp4
    from cute_ep.reference.fp4 import scale_block_bytes, segment_scale_blocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intermediate", type=int, action="append")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json")
    args = p.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    by_size = cute_ep.quant._order
    rows = []
    for i in args.intermediate or [2048, 7168]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(8192, i, device="cuda", generator=gen).to(torch.bfloat16)
        offsets = torch.linspace(0, 8192, args.experts + 1, device="cuda").round().to(torch.int32)
        gs = torch.ones(args.experts, device="cuda")
        blocks = segment_scale_blocks(offsets.tolist())[-1]
        moved = 8192 * i * 2 + 8192 * i // 2
        cases = [("128x4", "rows", moved + blocks * scale_block_bytes(i, 16)),
                 ("128x4", "quads", moved + blocks * scale_block_bytes(i, 16)),
                 ("linear", "rows", moved + 8192 * i // 16)]
        for state in ("zero", "read"):
            for scales, order, nbytes in cases:
                cute_ep.quant._order = lambda *a, order=order: order
                fn = lambda scales=scales: quantize_nvfp4(x, gs, offsets, scales=scales)  # noqa: E731
                fn()
                copy = statistics.median(copy_baseline_ms(nbytes, args.reps, flush, state))
                ms = median_ms(fn, args.reps, flush, prep=l2_prep(state, flush, x))
                rows.append({"I": i, "experts": args.experts, "l2": state, "scales": scales, "kernel": order,
                             "us": ms * 1e3, "copy_us": copy * 1e3, "pct": 100 * copy / ms})
    cute_ep.quant._order = by_size
    table = Table(title=f"{torch.cuda.get_device_name()}: quantize_nvfp4 by scale layout, "
                        f"{args.experts} experts, percent of copy_ (median of {args.reps})")
    for col in ("I", "L2", "scales", "kernel", "us", "copy us", "of copy"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["I"]), r["l2"], r["scales"], r["kernel"], f"{r['us']:.2f}",
                      f"{r['copy_us']:.2f}", f"{r['pct']:.1f}%")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
