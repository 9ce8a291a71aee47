"""How many bytes per SM the bulk-copy send moves, against torch's copy of the same bytes.

    python perf/bench_bulk_copy.py [--mib-per-rank 48] [--ranks 4] [--reps 20]

On one GPU: R local buffers stand in for the ranks' receive buffers (no NVLink), so the figure is
what `bulk_send` can drive with a given number of CTAs (one per SM) before the link is the limit.
GB/s = bytes delivered / median time (each delivered byte is also read once).
"""

import argparse

import torch
from timing import median_ms, report_copies

from cute_ep.runtime.launch import runtime
from layouts.transport import bulk_chunks

CONFIGS = [(16384, 8), (8192, 12), (32768, 6)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib-per-rank", type=int, default=48)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ctas", default="8,16,24,32,64,132")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    r = args.ranks
    per_rank = args.mib_per_rank << 20
    src = torch.randint(0, 256, (r * per_rank,), dtype=torch.uint8, device="cuda")
    recv = torch.empty(r, r * per_rank, dtype=torch.uint8, device="cuda")
    bases = torch.tensor([recv[d].data_ptr() for d in range(r)], dtype=torch.int64, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    delivered = r * per_rank
    rows = []
    baseline = median_ms(lambda: recv[0, :delivered].copy_(src), args.reps, flush)
    rows.append({"kernel": "torch copy_ (baseline)", "ctas": "all", "us": baseline * 1e3,
                 "gbs": delivered / baseline / 1e6})
    for chunk, stages in CONFIGS:
        kernel = runtime().select("bulk_send", "cuda", chunk_bytes=chunk, stages=stages, pull=0)
        chunks = per_rank // chunk
        assert bulk_chunks(chunk, chunks, r).cosize() == r * per_rank
        for ctas in map(int, args.ctas.split(",")):
            ms = median_ms(lambda: kernel.launch(bases, src, chunks, r, 0, ctas), args.reps, flush)
            rows.append({"kernel": f"bulk_send chunk {chunk >> 10} KiB x {stages} stages",
                         "ctas": ctas, "us": ms * 1e3, "gbs": delivered / ms / 1e6})
    # the last launch left rank 0's slot of every destination filled
    for d in range(r):
        assert torch.equal(recv[d, :per_rank], src[d * per_rank:(d + 1) * per_rank])
    report_copies(f"{torch.cuda.get_device_name()}: {r} x {args.mib_per_rank} MiB to {r} local "
                  f"buffers, median of {args.reps}, L2 flushed", "CTAs",
                  "GB/s = bytes delivered / t", rows, torch.cuda.get_device_name(), args.json)

if __name__ == "__main__":
    main()
