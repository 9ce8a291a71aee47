"""What an SM moves when it expands messages into rows (dispatch's receive side on its own), by
warps through registers, by one thread's bulk copies through shared memory, and by both at once
in one CTA (`row_expand` modes warps, bulk, mixed, bulk2).

    python perf/bench_row_expand.py [--msg-bytes 14336,7392,4032] [--copies 2,4]
                                    [--ctas 24,132] [--mib 128] [--reps 20] [--json PATH]

On one GPU, `row_expand` (kernels/row_expand.py) copies each message of a `--mib` MiB source into
`copies` rows. GB/s = bytes read + bytes written / median time (L2 flushed before each run), and
per CTA; the baseline is torch's copy of the same rows (every SM).
"""

import argparse

import torch
from timing import median_ms, report_copies

from cute_ep.runtime.launch import runtime


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--msg-bytes", default="14336,7392,4032")
    parser.add_argument("--copies", default="2,4")
    parser.add_argument("--ctas", default="24,132")
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kernels = {mode: runtime().select("row_expand", "cuda", mode=mode)
               for mode in ("warps", "bulk", "mixed", "bulk2")}
    rows = []
    for msg_bytes in map(int, args.msg_bytes.split(",")):
        msgs = (args.mib << 20) // msg_bytes
        src = torch.randint(0, 256, (msgs, msg_bytes), dtype=torch.uint8, device="cuda")
        for copies in map(int, args.copies.split(",")):
            dst = torch.empty(msgs, copies, msg_bytes, dtype=torch.uint8, device="cuda")
            moved = msgs * msg_bytes * (1 + copies)
            what = f"{msg_bytes} B x {copies} rows"
            ms = median_ms(lambda: dst.copy_(src[:, None, :].expand(msgs, copies, msg_bytes)),
                           args.reps, flush)
            rows.append({"kernel": f"torch copy_, {what}", "ctas": "all", "us": ms * 1e3,
                         "gbs": moved / ms / 1e6})
            for mode, kernel in kernels.items():
                for ctas in map(int, args.ctas.split(",")):
                    dst.zero_()
                    ms = median_ms(lambda: kernel.launch(src.view(-1), dst.view(-1), msgs,
                                                         msg_bytes, copies, ctas),
                                   args.reps, flush)
                    if not torch.equal(dst, src[:, None, :].expand(msgs, copies, msg_bytes)):
                        raise SystemExit(f"row_expand {mode} {what}: wrong bytes")
                    rows.append({"kernel": f"row_expand {mode}, {what}", "ctas": ctas,
                                 "us": ms * 1e3, "gbs": moved / ms / 1e6,
                                 "gbs_per_cta": moved / ms / 1e6 / ctas})
    for row in rows:
        if "gbs_per_cta" in row:
            row["kernel"] += f" ({row['gbs_per_cta']:.1f} GB/s per CTA)"
    report_copies(f"{torch.cuda.get_device_name()}: messages into rows, {args.mib} MiB of "
                  f"messages, median of {args.reps}, L2 flushed", "CTAs",
                  "GB/s = bytes read + written / t", rows, torch.cuda.get_device_name(),
                  args.json)


if __name__ == "__main__":
    main()
