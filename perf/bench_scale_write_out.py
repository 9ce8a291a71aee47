"""The dispatch's scale write-out alone on one GPU (`kernels/scale_write_out.py`, the dispatch's
own phase 4): staged scale rows (row-major, as the receivers leave them) into the output's
layout, FP8 transposed or NVFP4 128x4, at each CTA count, for the segments a dispatch of
`--tokens` per rank (uniform top-K of E experts over `--ranks`) gives one rank. Each output is
checked against `cute_ep.reference.ep.scale_layout_of_rows` before it is timed.

    python perf/bench_scale_write_out.py [--formats nvfp4,fp8] [--ctas 24,132] [--reps 20]
        [--l2 written,flushed] [--json FILE]

`--l2 written`: the staged rows are rewritten before each run (as the receivers just stored
them, so they start in L2); `flushed`: L2 is flushed instead. GB/s counts the staged bytes read
and the output bytes written; "an SM" divides it by the CTAs. For a profile, run one format
and CTA count under ncu, e.g. `ncu --set full python perf/bench_scale_write_out.py --formats
nvfp4 --ctas 24 --reps 1 --l2 written`.
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms

from cute_ep.reference.ep import scale_layout_of_rows, staged_segments
from cute_ep.runtime.launch import runtime


def segment_counts(tokens: int, topk: int, experts: int, ranks: int, seed: int = 0) -> list:
    """Rows each of rank 0's local experts receives from every rank's `tokens` tokens, each
    routed to `topk` distinct experts uniformly at random."""
    gen = torch.Generator().manual_seed(seed)
    local = experts // ranks
    counts = torch.zeros(local, dtype=torch.int64)
    for _ in range(ranks):
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]
        mine = ids[ids < local]
        counts += torch.bincount(mine, minlength=local)
    return counts.tolist()


def run(fmt: str, hidden: int, counts: list, ctas_list: list, reps: int, l2: list) -> list:
    kernel = runtime().select("scale_write_out", "cuda", format=fmt)
    if len(counts) > kernel.spec.sizes["max_segments"]:
        raise SystemExit(f"at most {kernel.spec.sizes['max_segments']} segments, got "
                         f"{len(counts)}")
    vector_bytes = kernel.spec.sizes["vector_bytes"]
    payload_vectors = (hidden // 2 if fmt == "nvfp4" else hidden) // vector_bytes
    words = hidden // 128 if fmt == "fp8" else -(-hidden // 64)
    off, first = staged_segments(fmt, counts)
    rows = off[-1]
    row_capacity = -(-rows // 4) * 4 + 4
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    source = torch.randint(-2 ** 31, 2 ** 31 - 1, (row_capacity, words), dtype=torch.int32,
                           device=dev, generator=gen)
    if fmt == "fp8":  # finite fp32 scales
        source = torch.rand(row_capacity, words, device=dev, generator=gen).view(torch.int32)
    staged = source.clone()
    want = scale_layout_of_rows(fmt, staged[:rows], hidden, counts, row_capacity)
    out = torch.empty_like(want)
    seg = [torch.tensor(v, dtype=torch.int32, device=dev) for v in (off, counts, first)]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    moved = rows * words * 4 + want.numel() * want.element_size()
    results = []
    for ctas in ctas_list:
        def launch():
            kernel.launch(staged, out, seg[0], seg[1], seg[2], len(counts), payload_vectors,
                          row_capacity, ctas)
        out.fill_(0x5A if fmt == "nvfp4" else float("nan"))
        launch()
        torch.cuda.synchronize()
        written = out if fmt == "nvfp4" else out[:, :rows]  # FP8: the rows' columns alone
        expected = want if fmt == "nvfp4" else want[:, :rows]
        exact = torch.equal(written.contiguous().view(torch.uint8),
                            expected.contiguous().view(torch.uint8))
        for state in l2:
            prep = (lambda: staged.copy_(source)) if state == "written" else None
            ms = median_ms(launch, reps, flush, prep=prep)
            gbs = moved / ms / 1e6
            results.append({"format": fmt, "hidden": hidden, "rows": rows, "ctas": ctas,
                            "l2": state, "us": ms * 1e3, "gbs": gbs, "gbs_per_sm": gbs / ctas,
                            "bytes": moved, "exact": exact})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="nvfp4,fp8")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ctas", default="24,132")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--l2", default="written,flushed")
    p.add_argument("--json")
    args = p.parse_args()
    counts = segment_counts(args.tokens, args.topk, args.experts, args.ranks)
    ctas = [int(c) for c in args.ctas.split(",")]
    l2 = args.l2.split(",")
    if not set(l2) <= {"written", "flushed"}:
        raise SystemExit(f"--l2 takes written and/or flushed, not {args.l2!r}")
    rows = []
    for fmt in args.formats.split(","):
        rows += run(fmt, args.hidden, counts, ctas, args.reps, l2)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{torch.cuda.get_device_name()}: the dispatch's scale write-out, "
                        f"{args.tokens} tokens a rank, top-{args.topk} of {args.experts}, "
                        f"{args.ranks} ranks (rank 0's rows)")
    for col in ("format", "rows", "CTAs", "L2", "us", "GB/s", "GB/s an SM", "exact"):
        table.add_column(col, justify="left" if col in ("format", "L2") else "right")
    for r in rows:
        table.add_row(r["format"], str(r["rows"]), str(r["ctas"]), r["l2"], f"{r['us']:.1f}",
                      f"{r['gbs']:.0f}", f"{r['gbs_per_sm']:.1f}", str(r["exact"]))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "config": vars(args),
                       "results": rows}, f, indent=1)
    if not all(r["exact"] for r in rows):
        raise SystemExit("a write-out differs from the reference")


if __name__ == "__main__":
    main()
