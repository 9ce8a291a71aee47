"""Dispatch and combine between nodes (`cute_ep.NodeBuffer`) on the GPUs of one host, beside the
intranode Buffer and NCCL's all_to_all of the same token bytes.

    python perf/bench_nodes.py [--gpus-per-node 1] [--tokens 4096] [--hidden 7168] [--topk 8]
                               [--experts 256] [--iters 10] [--json FILE]

Every GPU of the host is a rank; `--gpus-per-node` groups them into nodes (1: every GPU its own
node, so every byte between GPUs goes through NVSHMEM). On one host NVSHMEM moves its puts over
NVLink, so the figures are the overhead of the path between nodes, not a network's speed.

Each call is timed on the host from a synchronised start (a barrier) to its work's end (a device
synchronisation), median of `--iters` after 3 warm-ups, slowest rank: the path between nodes
reads its counts on the host, so GPU events alone would leave out its waits. The same clock times
the intranode Buffer (all GPUs as one node) and NCCL's all_to_all_single moving each token once
to every rank that hosts one of its experts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _timed(fn, iters):
    import torch.distributed as dist

    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _rank(rank, world, gpus_per_node, tokens, hidden, topk, experts, iters):
    import torch.distributed as dist

    from cute_ep import Buffer, NodeBuffer
    from layouts import EPConfig

    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(1)[:, :topk]
    ids = ids.to(torch.int32)
    w = torch.rand(tokens, topk, device="cuda", generator=gen)
    row = {}
    for name, cfg, make in (
            ("intranode Buffer", EPConfig(hidden, topk, experts, world, tokens), Buffer),
            (f"NodeBuffer, {world // gpus_per_node} x {gpus_per_node}",
             EPConfig(hidden, topk, experts, world, tokens, gpus_per_node=gpus_per_node),
             NodeBuffer)):
        buf = make(cfg)
        state = {}

        def dispatch():
            state["out"] = buf.dispatch(x, ids, w)

        row[name + " dispatch"] = _timed(dispatch, iters)
        out = state["out"]
        y = torch.randn(out.tokens.shape[0], hidden, device="cuda",
                        generator=gen).to(torch.bfloat16)
        row[name + " combine"] = _timed(lambda: buf.combine(y, out.handle), iters)
    # NCCL: each token once to every rank hosting one of its experts.
    owners = ids.long() // (experts // world)
    sends = [int((owners == r).any(1).sum()) for r in range(world)]
    counts = torch.tensor(sends, device="cuda")
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_buf = torch.empty(sum(sends), hidden, dtype=torch.bfloat16, device="cuda")
    recv_buf = torch.empty(int(recv_counts.sum()), hidden, dtype=torch.bfloat16, device="cuda")
    row["NCCL all_to_all"] = _timed(lambda: dist.all_to_all_single(
        recv_buf, send_buf, recv_counts.tolist(), sends), iters)
    return row


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from cute_ep.tools.spawn import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    world = torch.cuda.device_count()
    rows = run_ranks(_rank, world=world, limit_s=600, gpus_per_node=args.gpus_per_node,
                     tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                     experts=args.experts, iters=args.iters)
    slowest = {k: max(r[k] for r in rows) for k in rows[0]}
    table = Table(title=f"{world} x {torch.cuda.get_device_name(0)}: {args.tokens} tokens a rank, "
                        f"H {args.hidden}, top-{args.topk} of {args.experts}, bf16; host-timed "
                        f"call to its end, median, slowest rank")
    table.add_column("what")
    table.add_column("us", justify="right")
    for k, v in slowest.items():
        table.add_row(k, f"{v:.1f}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "gpus": world,
                       "command": "python perf/bench_nodes.py", "argv": vars(args),
                       "slowest_us": slowest, "ranks": rows}, f, indent=1)


if __name__ == "__main__":
    main()
