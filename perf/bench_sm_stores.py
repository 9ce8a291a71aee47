"""How fast a number of SMs writes, or reads, global memory and does nothing else: the ceiling of
a dispatch receiver's row stores at an SM budget (a BF16 dispatch of 4096 tokens a rank, top-8 of
256 experts, writes about 470 MB of expert rows per rank on 2 GPUs) and of a combine's reads of
the same rows.

    python perf/bench_sm_stores.py [--mib 512] [--reps 20] [--ctas 8,16,24,32,66,132]

`store_rate` (kernels/store_rate.py): one CTA an SM, 8 warps, each writing 4 KiB pieces of its
CTA's share, by bulk copies from shared memory ("bulk") or by 16-byte stores from registers
("lanes"), beside torch's fill of the same bytes (every SM). `load_rate`: the same CTAs reading
the bytes by `cp.async` into shared memory, 4 pieces a warp in flight (each thread's XOR of what
it read is checked against the bytes). GB/s = bytes moved / median time; the last column divides
it by the CTAs: what one SM moves.
"""

import argparse

import numpy as np
import torch
from timing import median_ms, report_copies

from cute_ep.runtime.launch import runtime
from layouts.buffers import PLACE_SLOTS


def _sweep(rows, name, launch, budgets, total, piece, reps, flush):
    """`launch(bytes_per_cta, ctas)` timed at each CTA count of `budgets`, `total` bytes split
    into whole pieces a CTA; a row each into `rows`. Returns the last budget's (bytes_per_cta,
    ctas), whose bytes the caller checks."""
    for ctas in budgets:
        per_cta = total // ctas // piece * piece
        ms = median_ms(lambda: launch(per_cta, ctas), reps, flush)
        gbs = per_cta * ctas / ms / 1e6
        rows.append({"kernel": f"{name} ({gbs / ctas:.0f} GB/s an SM)", "ctas": ctas,
                     "us": ms * 1e3, "gbs": gbs, "gbs_per_cta": gbs / ctas})
    return per_cta, ctas


def _sms(text: str) -> set:
    """The SM indices `text` names: all, even, odd, or first-last[%step] ranges joined by '+'."""
    if text in ("all", "even", "odd"):
        return {s for s in range(PLACE_SLOTS) if text == "all" or s % 2 == (text == "odd")}
    sms = set()
    for part in text.split("+"):
        part, _, step = part.partition("%")
        first, _, last = part.partition("-")
        sms |= set(range(int(first), int(last or first) + 1, int(step or 1)))
    return sms


def _place(dst, flush, args) -> list:
    """store_place at each `--place` CTAs:SMs and warps a CTA: GB/s per SM that worked, with
    how many distinct SMs and TPCs (SM index // 2) those were, and the bytes checked."""
    rows = []
    by_warps = {w: runtime().select("store_place", "cuda", warps=w) for w in args.place_warps}
    piece = by_warps[args.place_warps[0]].spec.sizes["piece"]
    pieces = dst.numel() // piece
    # What every launch must leave: piece p holds the byte p % 251.
    want = (torch.arange(pieces, device="cuda") % 251).to(torch.uint8)[:, None].expand(pieces,
                                                                                      piece)
    smids = torch.zeros(2 * PLACE_SLOTS, dtype=torch.int32, device="cuda")
    claims = torch.zeros(2, dtype=torch.int32, device="cuda")
    for warps, kernel in by_warps.items():
        for pair in args.place.split("/"):
            ctas, which = pair.split(":")
            ctas, sms = int(ctas), _sms(which)
            allowed = torch.tensor([int(s in sms) for s in range(PLACE_SLOTS)],
                                   dtype=torch.int32, device="cuda")

            def prep():
                flush.zero_()
                claims.zero_()
                smids.zero_()
            ms = median_ms(lambda: kernel.launch(dst, smids, claims, allowed, pieces, ctas),
                           args.reps, flush, prep=prep)
            sm, done = smids[:ctas].tolist(), smids[PLACE_SLOTS:PLACE_SLOTS + ctas].tolist()
            assert sum(done) == pieces, "pieces lost or written twice"
            working = [s for s in sm if s in sms]
            assert claims[1].item() == len(working), "working CTAs miscounted"
            assert len(set(working)) == len(working), "two working CTAs on one SM"
            assert torch.equal(dst.view(pieces, piece), want), "store_place wrote other bytes"
            gbs = pieces * piece / ms / 1e6
            tpcs = len({s // 2 for s in working})
            rows.append({"kernel": f"store_place {warps} warps, {ctas} CTAs on {which} "
                                   f"({gbs / len(working):.0f} GB/s an SM, {tpcs} TPCs)",
                         "ctas": len(working), "us": ms * 1e3, "gbs": gbs,
                         "gbs_per_cta": gbs / len(working), "launched": ctas, "smids": sm,
                         "pieces": done})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ctas", default="8,16,24,32,66,132")
    parser.add_argument("--place", default=None,
                        help="CTAs:SMs pairs for store_place separated by '/', SMs as 'all', "
                             "'even', 'odd' or first-last[%%step] ranges joined by '+', e.g. "
                             "24:all/48:124-131: the store rate by warps a CTA and by the SMs "
                             "that work")
    parser.add_argument("--place-warps", default="8",
                        type=lambda v: [int(w) for w in v.split(",")])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total = args.mib << 20
    budgets = [int(c) for c in args.ctas.split(",")]
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    ms = median_ms(lambda: dst.fill_(7), args.reps, flush)
    rows.append({"kernel": "torch fill_ (every SM)", "ctas": "all", "us": ms * 1e3,
                 "gbs": total / ms / 1e6, "gbs_per_cta": None})
    for mode in ("bulk", "lanes"):
        kernel = runtime().select("store_rate", "cuda", mode=mode)
        piece = kernel.spec.sizes["piece"]
        per_cta, _ = _sweep(rows, f"store_rate {mode}", lambda share, n: kernel.launch(
            dst, share, n), budgets, total, piece, args.reps, flush)
        if mode == "bulk":  # what the bulk stores wrote: the pieces of shared memory
            piece_bytes = torch.arange(8 * piece, device="cuda") % 251
            got = dst[:per_cta].view(-1, piece)
            warps = torch.arange(got.shape[0], device="cuda") % 8
            want = piece_bytes.view(8, piece)[warps].to(torch.uint8)
            assert torch.equal(got, want), "bulk stores wrote other bytes"
    kernel = runtime().select("load_rate", "cuda")
    piece = kernel.spec.sizes["piece"]
    dst.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda"))
    sums = torch.empty(max(budgets), 256, dtype=torch.int32, device="cuda")
    per_cta, ctas = _sweep(rows, "load_rate cp.async", lambda share, n: kernel.launch(
        dst, sums[:n], share, n), budgets, total, piece, args.reps, flush)
    got = np.bitwise_xor.reduce(sums[:ctas].cpu().numpy(), axis=1)
    want = np.bitwise_xor.reduce(dst[:per_cta * ctas].view(torch.int32).view(ctas, -1).cpu()
                                 .numpy(), axis=1)
    assert np.array_equal(got, want), "load_rate read other bytes"
    if args.place:
        rows += _place(dst, flush, args)
    report_copies(f"{torch.cuda.get_device_name()}: {args.mib} MiB written or read, median of "
                  f"{args.reps}, L2 flushed", "CTAs", "GB/s = bytes moved / t", rows,
                  torch.cuda.get_device_name(), args.json)


if __name__ == "__main__":
    main()
