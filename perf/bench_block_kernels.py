"""Bandwidth of block_memcpy against torch's device-to-device copy, in the same run.

    python perf/bench_block_kernels.py [--mib 1024] [--reps 50]

Figure: GB/s = (bytes read + bytes written) / median time = 2 * nbytes / t.
"""

import argparse

import torch
from rich.console import Console
from rich.table import Table
from timing import median_ms

import cute_ep


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    nbytes = args.mib << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for name, fn in (("torch copy_ (baseline)", lambda: dst.copy_(src)),
                     ("cute_ep.block_memcpy", lambda: cute_ep.block_memcpy(dst, src))):
        ms = median_ms(fn, args.reps, flush)
        rows.append((name, ms, 2 * nbytes / ms / 1e6))
    assert torch.equal(dst, src)
    table = Table(title=f"{torch.cuda.get_device_name()}: copy {args.mib} MiB, "
                        f"median of {args.reps}, L2 flushed")
    for col in ("kernel", "time (us)", "GB/s = 2*bytes/t", "vs baseline"):
        table.add_column(col)
    for name, ms, gbs in rows:
        table.add_row(name, f"{ms * 1e3:.1f}", f"{gbs:.0f}", f"{gbs / rows[0][2]:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
