"""Bytes between two GPUs through NVSHMEM (`kernels/net_put.py`) beside NCCL moving the same bytes:
what the engine of the transport between nodes costs where it rides NVLink.

    python perf/bench_net_put.py [--mib 1,16,128] [--ctas 1,4,16,32] [--rounds 20] [--json FILE]

Two processes, a GPU each, each a PE (`cute_ep.runtime.nvshmem`, no network transport: one
host). A round: each rank puts `mib` MiB into the other's symmetric buffer with `ctas` CTAs
(a put with signal each) and waits for the other's; timed by CUDA events after a barrier, the
slower rank's median. Beside it, NCCL moving the same bytes each way (a send and a receive a
rank, `batch_isend_irecv`; NCCL_NVLS off). Between hosts the network's rate bounds both; on one host this shows the
overhead of the NVSHMEM path, not network speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def _rank(rank, world, sizes, ctas_list, rounds):
    import torch.distributed as dist

    from cute_ep.runtime import nvshmem
    from cute_ep.runtime.launch import runtime

    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    nvshmem.init()
    kernel = runtime().select("net_put")
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    peer = (rank + 1) % world
    rows = []
    for mib in sizes:
        nbytes = mib << 20
        dst = nvshmem.symmetric_bytes(nbytes)
        signal = nvshmem.symmetric_bytes(8).view(torch.int64)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        for ctas in ctas_list:
            signal.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            times = []
            for i in range(1, rounds + 1):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                value = torch.tensor([i * ctas], dtype=torch.int64, device="cuda")
                torch.cuda.synchronize()
                dist.barrier()
                start.record()
                kernel.launch(dst, src, signal, error, nbytes, 0, value, 10_000_000_000, peer,
                              ctas)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            assert error.tolist() == [0, 0, 0, 0], error.tolist()
            rows.append({"what": f"net_put, {ctas} CTAs", "mib": mib, "us": statistics.median(
                times[2:])})
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        from_peer = (rank - 1) % world
        times = []
        for _ in range(rounds):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            dist.barrier()
            start.record()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, src, peer),
                                                 dist.P2POp(dist.irecv, out, from_peer)]):
                work.wait()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        rows.append({"what": "NCCL send + receive", "mib": mib,
                     "us": statistics.median(times[2:])})
        nvshmem.free(dst)
    return rows


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from cute_ep.tools.spawn import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", default="1,16,128")
    p.add_argument("--ctas", default="1,4,16,32")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    sizes = [int(m) for m in args.mib.split(",")]
    ctas = [int(c) for c in args.ctas.split(",")]
    ranks = run_ranks(_rank, world=2, sizes=sizes, ctas_list=ctas, rounds=args.rounds,
                      limit_s=600)
    rows = []
    for per_rank in zip(*ranks):  # the slower rank's time of each row
        row = dict(per_rank[0])
        row["us"] = max(r["us"] for r in per_rank)
        row["gbs_each_way"] = row["mib"] * (1 << 20) / row["us"] / 1e3
        rows.append(row)
    table = Table(title=f"2 x {torch.cuda.get_device_name(0)}: one round, slower rank")
    for col in ("what", "MiB", "us", "GB/s each way"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for r in rows:
        table.add_row(r["what"], str(r["mib"]), f"{r['us']:.1f}", f"{r['gbs_each_way']:.1f}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "gpus": 2,
                       "command": "python perf/bench_net_put.py", "argv": vars(args),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
