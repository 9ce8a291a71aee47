"""Host time of decode dispatch and combine calls on every GPU of this host, beside how fast the
host thread itself runs at that moment.

    python perf/host_steady.py [--pin] [--layers 200] [--tokens 128] [--formats F,...]
                               [--json FILE]

Each rank builds a decode layer per format (`cute-ep bench`'s inputs), queues `--layers` layers
back to back (`cute_ep.tools.bench._host_us`: each call's wall and thread CPU time, the layer's
outputs released untimed) and runs the CPU probe (`cpu_probe_us`: a fixed pure-Python loop)
before and after. Where the host is a virtual machine whose vCPUs change speed, a call's time
follows the probe's, so the table shows both. `--pin`: each rank first pins itself to a core of
its own (one its GPU is local to), to tell the vCPU's speed from the scheduler moving it.
"""

import argparse
import ctypes
import json
import os
import sys

from rich.console import Console
from rich.table import Table

FORMATS = "bf16,fp8-input,nvfp4-input"


def _current_cpu() -> int:
    """The CPU this thread runs on now (glibc's sched_getcpu), -1 where unknown."""
    try:
        return ctypes.CDLL(None).sched_getcpu()
    except (OSError, AttributeError):
        return -1


def _pin(rank: int) -> int | None:
    """Pin this process to a CPU of its own: the (rank + 1)-th of the allowed CPUs its GPU is
    local to (the first is left to the system). Returns it, or None where there are too few."""
    from cute_ep.tools.spawn import gpu_cpus

    cpus = sorted(gpu_cpus(rank) or os.sched_getaffinity(0))
    if len(cpus) < rank + 2:
        return None
    os.sched_setaffinity(0, {cpus[rank + 1]})
    return cpus[rank + 1]


def rank_host(rank: int, world: int, formats: list[str], layers: int, tokens: int,
              pin: bool) -> dict:
    """One rank: per format, the steady host times and the probe around them."""
    import torch

    from cute_ep.ep import Buffer
    from cute_ep.tools.bench import _host_us, _inputs, _layer_format, cpu_probe_us
    from layouts import EPConfig

    out = {"pinned": _pin(rank) if pin else None, "formats": {}}
    for fmt in formats:
        cfg = EPConfig(7168, 8, 256, world, tokens, _layer_format(fmt))
        buf = Buffer(cfg)
        x, ids, w, y, quant = _inputs(cfg, tokens, 100 + rank, fmt)
        quant = dict(quant, num_input_tokens=tokens)
        for _ in range(20):
            buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)
        torch.cuda.synchronize()
        before = cpu_probe_us()
        host = _host_us(buf, x, ids, w, y, quant, layers, barrier_each=False)
        after = cpu_probe_us()
        buf.check()
        out["formats"][fmt] = {**{f"{k}_us": v for k, v in host.items()},
                               "probe_us": (before + after) / 2, "cpu": _current_cpu()}
        del buf
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pin", action="store_true", help="each rank on a core of its own")
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--formats", default=FORMATS, help="comma-separated")
    p.add_argument("--json", metavar="FILE", help="write the per-rank results here")
    args = p.parse_args(argv)

    import torch

    from cute_ep.tools.spawn import run_ranks

    formats = args.formats.split(",")
    world = torch.cuda.device_count()
    ranks = run_ranks(rank_host, world, limit_s=60 + 20 * len(formats), formats=formats,
                      layers=args.layers, tokens=args.tokens, pin=args.pin)
    t = Table(title=f"steady host us per call, {args.tokens} tokens/rank, {args.layers} layers"
                    f"{', pinned' if args.pin else ''} (medians, wall / thread CPU; the wall "
                    f"times' 10th-90th percentiles; probe = the CPU probe's us)")
    for col in ("rank", "cpu", "format", "dispatch", "p10-p90", "combine", "p10-p90", "probe"):
        t.add_column(col, justify="left" if col == "format" else "right")
    for r, res in enumerate(ranks):
        for fmt, v in res["formats"].items():
            t.add_row(str(r), str(v["cpu"]), fmt,
                      f"{v['dispatch_us']:.1f} / {v['dispatch_cpu_us']:.1f}",
                      f"{v['dispatch_p10_us']:.1f}-{v['dispatch_p90_us']:.1f}",
                      f"{v['combine_us']:.1f} / {v['combine_cpu_us']:.1f}",
                      f"{v['combine_p10_us']:.1f}-{v['combine_p90_us']:.1f}",
                      f"{v['probe_us']:.0f}")
    Console().print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "gpus": world,
                       "argv": sys.argv[1:] if argv is None else list(argv),
                       "pin": args.pin, "layers": args.layers, "tokens": args.tokens,
                       "ranks": ranks}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
