"""`bulk_send` between GPUs over NVLink: what a given number of CTAs per rank moves when every
rank sends to every rank at once, pushed (each rank's CTAs store into the peers' buffers) and
pulled (each rank's CTAs load from the peers' buffers, the same kernel with `pull`), beside the
copy engine doing the same (torch `copy_` into the peers' buffers, one stream).

    python perf/bench_bulk_nvlink.py [--mib-per-rank 32] [--reps 10] [--ctas 8,16,24,32,132]

Each rank sends `mib-per-rank` MiB to each destination (itself included) into symmetric memory.
Time per rank = median over `reps` of one all-to-all started after a barrier; the table shows the
slowest rank. GB/s = bytes this rank sends to other ranks / time (what crosses its NVLinks).
"""

import argparse

import torch
from timing import barrier_median_us, report_copies

from cute_ep.tools.spawn import run_ranks
from layouts.transport import bulk_chunks

CONFIGS = [(16384, 8), (32768, 6)]


def _rank(rank, world, per_rank, reps, ctas_list):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from cute_ep.runtime.launch import runtime

    total = world * per_rank
    recv = symm_mem.empty(total, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(recv, dist.group.WORLD.group_name)
    bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device="cuda")
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    peers = [handle.get_buffer(d, (total,), torch.uint8) for d in range(world)]
    rows = []

    def copy_engine():
        for i in range(world):
            d = (rank + i) % world
            peers[d][rank * per_rank:(rank + 1) * per_rank].copy_(
                src[d * per_rank:(d + 1) * per_rank])

    rows.append({"kernel": "copy engine (copy_ to each peer)", "ctas": "-",
                 "us": barrier_median_us(copy_engine, reps)})
    # Pull: this rank's source in peer-visible memory, the peers' CTAs read it from there.
    staged = symm_mem.empty(total, dtype=torch.uint8, device="cuda")
    staged.copy_(src)
    staged_bases = torch.tensor(symm_mem.rendezvous(staged, dist.group.WORLD.group_name)
                                .buffer_ptrs, dtype=torch.int64, device="cuda")
    pulled = torch.zeros(total, dtype=torch.uint8, device="cuda")
    for chunk, stages in CONFIGS:
        chunks = per_rank // chunk
        assert bulk_chunks(chunk, chunks, world).cosize() == total
        for pull in (False, True):
            kernel = runtime().select("bulk_send", "cuda", chunk_bytes=chunk, stages=stages,
                                      pull=int(pull))
            peers_of, local = (staged_bases, pulled) if pull else (bases, src)
            for ctas in ctas_list:
                us = barrier_median_us(
                    lambda: kernel.launch(peers_of, local, chunks, world, rank, ctas), reps)
                rows.append({"kernel": f"bulk_{'pull' if pull else 'send'} {chunk >> 10} KiB "
                                       f"x {stages}", "ctas": ctas, "us": us})
    torch.cuda.synchronize()
    dist.barrier()
    # The last launches left in slot s what rank s sent here (pushed into `recv`, pulled into
    # `pulled`): compared by checksum in main().
    checks = recv.view(world, per_rank).view(torch.int64).sum(dim=1)
    pulled_checks = pulled.view(world, per_rank).view(torch.int64).sum(dim=1)
    return {"rows": rows, "checks": checks.tolist(), "pulled_checks": pulled_checks.tolist(),
            "sent_checks": src.view(world, per_rank).view(torch.int64).sum(dim=1).tolist()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib-per-rank", type=int, default=32)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--ctas", default="8,16,24,32,132")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    per_rank = args.mib_per_rank << 20
    results = run_ranks(_rank, world, limit_s=600, per_rank=per_rank, reps=args.reps,
                        ctas_list=[int(c) for c in args.ctas.split(",")])
    for d, res in enumerate(results):
        for s in range(world):
            assert res["checks"][s] == results[s]["sent_checks"][d], (s, d)
            assert res["pulled_checks"][s] == results[s]["sent_checks"][d], (s, d, "pull")
    remote = (world - 1) * per_rank
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        us = max(r["rows"][i]["us"] for r in results)
        rows.append(dict(row, us=us, gbs=remote / us / 1e3))
    report_copies(f"{world} x {torch.cuda.get_device_name()}: {args.mib_per_rank} MiB from "
                  f"every rank to every rank, slowest rank, median of {args.reps}",
                  "CTAs per rank", "GB/s out of each GPU", rows,
                  f"{world} x {torch.cuda.get_device_name()}", args.json)

if __name__ == "__main__":
    main()
