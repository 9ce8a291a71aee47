"""How fast a number of SMs push bytes into the other GPUs of this host over NVLink and do nothing
else: the ceiling of a combine's row stores (16-byte stores from registers into the home ranks'
rings) at an SM budget, every rank pushing to every other rank at once, as a combine does.

    python perf/bench_remote_stores.py [--mib-per-peer 64] [--reps 10] [--ctas 24,32,66,132]
                                       [--json FILE]

Each rank splits the budget's CTAs evenly over its peers (budget // (world - 1) a peer) and runs
`store_rate` (kernels/store_rate.py: one CTA an SM, 8 warps, 4 KiB pieces; "lanes": 16-byte
stores from registers, the combine's path; "bulk": bulk copies from shared memory) into each
peer's part of a symmetric buffer, one launch a peer on a stream of its own, all started
together after a barrier, queued behind a device sleep (so the host's launches are not timed).
Time per rank = median over `reps` of the whole push; the table shows the slowest rank. GB/s =
bytes a rank pushes into its peers / time; per SM = that over the CTAs that pushed. Every
receiver checks the bytes each peer left in its part.
"""

import argparse

import torch
from timing import barrier_median_us, report_copies

from cute_ep.tools.spawn import run_ranks

MODES = ("lanes", "bulk")
# The device sleep the pushes' launches queue behind (`barrier_median_us`): a peer's checked
# launch takes the host tens of microseconds, a push of the default bytes about 0.7 ms.
GATE_US = 300.0


def split(budget: int, world: int, per_peer: int, piece: int) -> tuple[int, int]:
    """(CTAs a peer, bytes a CTA) of a push of at most `per_peer` bytes into each of world - 1
    peers by `budget` CTAs in all: the CTAs split evenly over the peers (at least one a peer),
    each CTA's share whole pieces."""
    if world < 2 or budget < 1 or piece < 1:
        raise ValueError(f"a push needs 2+ ranks, 1+ CTAs and a piece size; got world={world}, "
                         f"budget={budget}, piece={piece}")
    ctas = max(1, budget // (world - 1))
    share = per_peer // ctas // piece * piece
    if share == 0:
        raise ValueError(f"{per_peer} bytes a peer give {ctas} CTAs no whole {piece}-byte piece")
    return ctas, share


def expected(mode: str, ctas: int, share: int, piece: int, warps: int = 8) -> torch.Tensor:
    """The bytes `store_rate` leaves in `ctas` shares of `share` bytes: "lanes" fills a CTA's
    piece p with p % 251; "bulk" copies warp w's constant piece, bytes (w * piece + i) % 251,
    into pieces p with p % warps == w."""
    pieces = share // piece
    p = torch.arange(pieces)
    if mode == "lanes":
        one = (p % 251).to(torch.uint8)[:, None].expand(pieces, piece)
    elif mode == "bulk":
        pattern = (torch.arange(warps * piece) % 251).to(torch.uint8).view(warps, piece)
        one = pattern[p % warps]
    else:
        raise ValueError(f"modes: {MODES}, not {mode!r}")
    return one.reshape(-1).repeat(ctas)


def _rank(rank, world, per_peer, reps, budgets):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from cute_ep.runtime.launch import runtime

    recv = symm_mem.empty(world * per_peer, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(recv, dist.group.WORLD.group_name)
    peers = [d for d in range(world) if d != rank]
    # The part of peer d's buffer this rank writes: its slot `rank`.
    parts = {d: handle.get_buffer(d, (world * per_peer,), torch.uint8)[
        rank * per_peer:(rank + 1) * per_peer] for d in peers}
    streams = {d: torch.cuda.Stream() for d in peers}
    rows, bad = [], []
    for mode in MODES:
        kernel = runtime().select("store_rate", "cuda", mode=mode)
        piece = kernel.spec.sizes["piece"]
        for budget in budgets:
            ctas, share = split(budget, world, per_peer, piece)
            recv.zero_()
            torch.cuda.synchronize()
            dist.barrier()

            def push():
                main = torch.cuda.current_stream()
                for d in peers:
                    streams[d].wait_stream(main)
                    with torch.cuda.stream(streams[d]):
                        kernel.launch(parts[d], share, ctas)
                for d in peers:
                    main.wait_stream(streams[d])
            us = barrier_median_us(push, reps, gate_us=GATE_US)
            torch.cuda.synchronize()
            dist.barrier()
            want = expected(mode, ctas, share, piece).to("cuda")
            for s in peers:  # what peer s left in this rank's slot s
                if not torch.equal(recv[s * per_peer:s * per_peer + ctas * share], want):
                    bad.append(f"{mode} at {budget} CTAs: rank {s}'s bytes in rank {rank}")
            rows.append({"mode": mode, "ctas": ctas * len(peers), "us": us,
                         "bytes": ctas * share * len(peers)})
    return {"rows": rows, "bad": bad}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib-per-peer", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--ctas", default="24,32,66,132")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"bench_remote_stores needs 2+ GPUs of one host; {world} visible")
    results = run_ranks(_rank, world, limit_s=600, per_peer=args.mib_per_peer << 20,
                        reps=args.reps, budgets=[int(c) for c in args.ctas.split(",")])
    bad = [b for r in results for b in r["bad"]]
    if bad:
        raise SystemExit("wrong bytes: " + "; ".join(bad))
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        us = max(r["rows"][i]["us"] for r in results)
        gbs = row["bytes"] / us / 1e3
        rows.append({"kernel": f"store_rate {row['mode']} ({gbs / row['ctas']:.1f} GB/s an SM)",
                     "ctas": row["ctas"], "us": us, "gbs": gbs,
                     "gbs_per_cta": gbs / row["ctas"]})
    name = torch.cuda.get_device_name()
    report_copies(f"{world} x {name}: {args.mib_per_peer} MiB at most into each peer, every "
                  f"rank at once, slowest rank, median of {args.reps}", "CTAs per rank",
                  "GB/s out of each GPU", rows, f"{world} x {name}", args.json)


if __name__ == "__main__":
    main()
