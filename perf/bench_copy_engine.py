"""The copy engine's rate for device-to-device copies of a bf16 dispatch's tokens on one GPU
(4096 x 7168 bf16, 58.7 MB by default), beside torch's `copy_` and an SM kernel:

    python perf/bench_copy_engine.py [--tokens 4096] [--hidden 7168] [--json FILE]

- `cuMemcpyDtoDAsync` of the whole tensor split over 1 to 16 streams (each its share);
- the copy-engine staging trial's plan: per round, one 2D copy of a share of every channel's run
  of tokens (24 channels, 4 rounds), from 1 to 8 streams (each a share of the channels);
- the four rounds' completion times (an event after each), alone and beside an SM kernel that
  writes another 58.7 MB three times on the current stream;
- with two GPUs visible, torch's `copy_` from GPU 0 to GPU 1.

Times are the median of 20 calls between CUDA events, each queued behind a device sleep so the
host's enqueueing is not timed (`perf/timing.py`); GB/s counts the bytes copied once. The
rounds' times are the median over 10 calls of each round's end, from a start event on the
copies' stream, also queued behind a sleep.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch
from timing import median_ms, sleep_cycles

CHANNELS = 24
ROUNDS = 4


class _Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_cuda = ctypes.CDLL("libcuda.so.1")


def _copy_1d(dst, src, nbytes, stream):
    err = _cuda.cuMemcpyDtoDAsync_v2(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                     ctypes.c_size_t(nbytes), ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"cuMemcpyDtoDAsync: CUresult {err}")


def _copy_2d(dst, src, pitch, width, height, stream):
    p = _Memcpy2D(srcMemoryType=2, srcDevice=src, srcPitch=pitch, dstMemoryType=2,
                  dstDevice=dst, dstPitch=pitch, WidthInBytes=width, Height=height)
    err = _cuda.cuMemcpy2DAsync_v2(ctypes.byref(p), ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"cuMemcpy2DAsync: CUresult {err}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    tokens, row = args.tokens, args.hidden * 2
    x = torch.randn(tokens, args.hidden, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = tokens * row
    main_stream = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(16)]
    run = tokens // CHANNELS

    def fan_out(k, plan):
        start = torch.cuda.Event()
        start.record(main_stream)
        for i in range(k):
            s = streams[i]
            s.wait_event(start)
            if plan == "1d":
                lo = i * (tokens // k)
                n = tokens // k if i < k - 1 else tokens - lo
                _copy_1d(y.data_ptr() + lo * row, x.data_ptr() + lo * row, n * row, s.cuda_stream)
            else:
                c0, c1 = i * CHANNELS // k, (i + 1) * CHANNELS // k
                for j in range(ROUNDS):
                    l0, l1 = j * run // ROUNDS, (j + 1) * run // ROUNDS
                    if c1 > c0:
                        at = (c0 * run + l0) * row
                        _copy_2d(y.data_ptr() + at, x.data_ptr() + at, run * row,
                                 (l1 - l0) * row, c1 - c0, s.cuda_stream)
            done = torch.cuda.Event()
            done.record(s)
            main_stream.wait_event(done)

    def median_us(fn):
        return median_ms(fn, 20, None, prep=lambda: None) * 1e3

    rows = [("torch copy_", median_us(lambda: y.copy_(x))),
            ("SM kernel (add_)", median_us(lambda: y.add_(x, alpha=0)))]
    rows += [(f"1D, {k} streams", median_us(lambda k=k: fan_out(k, "1d")))
             for k in (1, 2, 4, 8, 16)]
    rows += [(f"2D rounds, {k} streams", median_us(lambda k=k: fan_out(k, "2d")))
             for k in (1, 2, 4, 8)]
    if torch.cuda.device_count() > 1:
        z = torch.empty_like(x, device="cuda:1")
        rows.append(("peer copy_ GPU 0 -> 1", median_us(lambda: z.copy_(x))))

    x2, y2 = torch.randn_like(x), torch.empty_like(x)
    gate = sleep_cycles(500.0)
    rounds = {}
    for busy in (False, True):
        samples = []
        for _ in range(10):
            torch.cuda.synchronize()
            torch.cuda._sleep(gate)  # everything below is queued before the GPU reaches it
            start = torch.cuda.Event()
            start.record(main_stream)
            s = streams[0]
            s.wait_event(start)
            a = torch.cuda.Event(enable_timing=True)
            a.record(s)
            ends = []
            for j in range(ROUNDS):
                l0, l1 = j * run // ROUNDS, (j + 1) * run // ROUNDS
                _copy_2d(y.data_ptr() + l0 * row, x.data_ptr() + l0 * row, run * row,
                         (l1 - l0) * row, CHANNELS, s.cuda_stream)
                e = torch.cuda.Event(enable_timing=True)
                e.record(s)
                ends.append(e)
            if busy:
                for _ in range(3):
                    y2.add_(x2, alpha=0)
            done = torch.cuda.Event()
            done.record(s)
            main_stream.wait_event(done)
            torch.cuda.synchronize()
            samples.append([round(a.elapsed_time(e) * 1e3, 1) for e in ends])
        rounds["beside an SM kernel" if busy else "alone"] = [
            round(statistics.median(column), 1) for column in zip(*samples)]

    table = Table(title=f"{torch.cuda.get_device_name()}: copies of {nbytes / 1e6:.1f} MB, "
                        "median of 20")
    table.add_column("copy")
    table.add_column("us", justify="right")
    table.add_column("GB/s", justify="right")
    for name, us in rows:
        table.add_row(name, f"{us:.1f}", f"{nbytes / us / 1e3:.0f}")
    console = Console()
    console.print(table)
    for name, ends in rounds.items():
        console.print(f"2D rounds {name}: each round done at {ends} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "bytes": nbytes,
                       "copies_us": dict(rows), "round_ends_us": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
