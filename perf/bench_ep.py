"""Time one dispatch + combine layer on every visible GPU (one process each).

    python perf/bench_ep.py [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256]
                            [--format bf16] [--iters 50]

Each iteration starts after a device synchronisation and a barrier, then CUDA events bracket
`Buffer.dispatch` (plan, encode, send, wait + expand) and `Buffer.combine` (send, wait + reduce),
host launch time included. Reported per rank, median over the iterations:
- DeepEP's metric: received token messages (own rank included) x bytes per token / time;
- the expert rows produced, and the bytes that left this GPU for other GPUs.
Baseline in the same run and the same way: NCCL `all_to_all_single` moving the same token
payloads (each token's payload once to every rank hosting one of its experts), timed alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.multiprocessing as mp

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank, world, port, args, results):
    import torch.distributed as dist

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    os.environ.update(SAFE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    cfg = EPConfig(args.hidden, args.topk, args.experts, world, args.tokens, args.format)
    buf = Buffer(cfg)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(args.tokens, args.experts, device="cuda", generator=gen).argsort(1)[:, :args.topk]
    ids = ids.to(torch.int32)
    w = torch.rand(args.tokens, args.topk, device="cuda", generator=gen)
    y = torch.randn(cfg.row_capacity, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    # NVFP4: one global scale on every rank, mapping randn's amax (about 5) near e4m3's top.
    quant = {"global_scale": torch.full((1,), 448.0, device="cuda")} \
        if args.format == "nvfp4" else {}
    payload = cfg.message.segment("payload").nbytes
    dest_ranks = ids.long() // cfg.local_experts
    to_rank = [(dest_ranks == d).any(1) for d in range(world)]
    send_counts = torch.tensor([int(m.sum()) for m in to_rank], device="cuda")
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    wire = x.view(torch.uint8)[:, :payload]
    a2a_in = torch.cat([wire[m] for m in to_rank]).contiguous()
    a2a_out = torch.empty(int(recv_counts.sum()), payload, dtype=torch.uint8, device="cuda")
    a2a_split = dict(output_split_sizes=[int(c) for c in recv_counts.tolist()],
                     input_split_sizes=[int(c) for c in send_counts.tolist()])
    times = {"dispatch": [], "combine": [], "nccl": []}
    for i in range(args.iters + 5):
        torch.cuda.synchronize()
        dist.barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        dist.all_to_all_single(a2a_out, a2a_in, **a2a_split)
        ev[1].record()
        torch.cuda.synchronize()
        if i >= 5:
            times["nccl"].append(ev[0].elapsed_time(ev[1]) * 1e3)
    for i in range(args.iters + 5):
        torch.cuda.synchronize()
        dist.barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        out = buf.dispatch(x, ids, w, **quant)
        ev[1].record()
        buf.combine(y, out.handle)
        ev[2].record()
        torch.cuda.synchronize()
        if i >= 5:
            times["dispatch"].append(ev[0].elapsed_time(ev[1]) * 1e3)
            times["combine"].append(ev[1].elapsed_time(ev[2]) * 1e3)
    buf.check()
    messages = out.handle.messages.tolist()
    rows = int(out.row_offsets[-1])
    sent_remote = sum(int(to_rank[d].sum()) for d in range(world) if d != rank)
    results.put((rank, {k: statistics.median(v) for k, v in times.items()}, sum(messages), rows,
                 sent_remote, payload))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--format", default="bf16", choices=["bf16", "fp8", "nvfp4"])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    os.environ.update(SAFE_ENV)
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, results)) for r in range(world)]
    for pr in procs:
        pr.start()
    got = sorted(results.get(timeout=600) for _ in range(world))
    for pr in procs:
        pr.join()
    name = torch.cuda.get_device_name(0)
    print(f"{world} x {name}, {args.tokens} tokens/rank, H={args.hidden} K={args.topk} "
          f"E={args.experts} {args.format}, median of {args.iters}")
    bf16_row = 2 * args.hidden
    for rank, t, messages, rows, sent, payload in got:
        d, c = t["dispatch"], t["combine"]
        print(f"rank {rank}: dispatch {d:8.1f} us  {messages * payload / d / 1e3:7.1f} GB/s "
              f"(DeepEP metric: {messages} received tokens x {payload} B)  "
              f"{sent * payload / d / 1e3:6.1f} GB/s to peers ({sent} messages); {rows} rows | "
              f"combine {c:8.1f} us  {messages * bf16_row / c / 1e3:7.1f} GB/s "
              f"({messages} x {bf16_row} B) | NCCL all_to_all_single of the dispatch payloads "
              f"{t['nccl']:8.1f} us  {messages * payload / t['nccl'] / 1e3:7.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
