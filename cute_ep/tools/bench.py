"""The performance harness (`cute-ep bench`, `python perf/bench.py`): one process per GPU.

For each token format, on every rank, with the same inputs each time:
- **throughput** (`--tokens` per rank, default 4096): `Buffer.dispatch` and `Buffer.combine`,
  each bracketed by CUDA events after a device synchronisation, a barrier and an L2 flush; the
  calls are queued behind the flush, so the events time the GPU's work as DeepEP's and NCCL's
  benchmarks do, not the host's launch path (whose time the decode section reports); median of
  `--iters` (>= 50) after 5 warm-ups; once per SM budget of
  `--sms` (`Buffer(sms=)`: the SMs the layer's communication occupies; "all" = every SM);
  and the same calls by the method of DeepEP's normal-mode test (its `tests/test_intranode.py`
  and `bench` helper): warm-ups, one L2 flush, then `--iters` calls back to back with no
  barrier or synchronisation between them, each bracketed by CUDA events, the first dropped and
  the rest averaged (`lockstep_dispatch_us`, `lockstep_combine_us`). Ranks that wait for each
  other's data then run in step, so the ranks' launch skew the barrier-timed median includes
  is left out, as it is from DeepEP's printed figures;
- **where dispatch's time goes**: one traced dispatch per budget (`Buffer.trace_dispatch`): when
  each channel sent its counts, had every rank's, knew its row layout, finished sending, ended,
  and how long its sender waited for ring credit and for its stores; the traced call follows
  TRACE_LEAD untraced calls queued back to back, so the ranks run it in step as lockstep times
  them (one call after a barrier carries the ranks' launch skew into its waits);
- **baselines in the same run**: NCCL `all_to_all_single` moving the same token bytes (each token
  once to every rank hosting one of its experts; it produces no expert-grouped rows), and a
  copy-engine peer-to-peer copy of this rank's outgoing bytes into every peer's memory, one
  stream per peer (the practical NVLink ceiling); and for bf16 and fp8-input, the torch gather a
  user of DeepEP's normal mode runs after its dispatch (one row per received token) to reach
  these expert-grouped rows (`deepep_gather_us`; DeepEP's dispatch + it compares with ours);
- **decode** (`--decode-tokens` per rank, default 128, passed as `num_input_tokens`; a Buffer of
  `--decode-sms`, by default every SM as DeepEP's low-latency kernels take, of which a decode
  step's channels, one per `TOKENS_PER_CHANNEL` tokens, run on as many): eager and
  CUDA-graph replay times of dispatch and of dispatch + combine (combine = the difference), the
  host time of one call (the Python call returning, no synchronisation), and the kernels' own
  time by the method of DeepEP's `tests/test_low_latency.py` (its `bench_kineto`): a large
  matmul and an all-reduce line the ranks up, then LOCKSTEP_LAYERS layers run back to back, and
  the profiler's mean GPU time per layer of the dispatch kernels (the encoder's included) and of
  the combine kernel, so the figure compares with that test's printout.

Figures, each with its formula in the output:
- DeepEP's metric: received token rows, own rank included, x bytes per token row / time, with
  bytes per token row = payload + scales (BF16 2H, FP8 H + 4H/128, NVFP4 H/2 + H/16);
  combine: the same rows x 2H / time;
- NVLink bytes this GPU's tokens put on the links / time (per message to a peer: the staged
  payload and scales the peer pulls; per batch of 16 tokens and peer: the batch header the peer
  reads).

The launching process prints rich tables (the slowest rank's figure for each cell) and writes a
JSON record (device, GPU count, library version, config, every rank's numbers) under `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from cute_ep.tools.spawn import RanksFailed, run_ranks

# "fp8-input": an fp8 layer given its tokens already quantized, (codes, scales), as DeepEP's
# FP8 dispatch takes them (its benchmark quantizes before timing); "fp8" quantizes in the call.
# "nvfp4-input" likewise: NVFP4 codes and linear e4m3 scales, quantized before timing.
FORMATS = ("bf16", "fp8", "fp8-input", "nvfp4", "nvfp4-input")
WARMUP = 5
FLUSH_BYTES = 256 << 20


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cute-ep bench", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (throughput)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per rank (decode)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    p.add_argument("--sms", default="24,all",
                   help="comma-separated SM budgets for the throughput sweep ('all': every SM); "
                        "the first is the headline")
    p.add_argument("--decode-sms", default="all",
                   help="the decode Buffer's SM budget ('all': every SM, as DeepEP's "
                        "low-latency kernels take)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="perf/results", help="folder for the JSON record")
    p.add_argument("--plot", metavar="FILE",
                   help="also draw time against SM budget (PNG; needs the plot extra)")
    p.add_argument("--deepep-record", metavar="JSON",
                   help="with --plot: a perf/record_deepep.py record to draw beside")
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip the per-kernel breakdown (torch profiler)")
    p.add_argument("--direct-input", action="store_true",
                   help="pass x (bf16, or the -input formats' codes and scales) from the "
                        "Buffer's direct input (Buffer(direct_input=True).input_buffer()), "
                        "which its receivers pull in place")
    p.add_argument("--stage-batches", type=int, default=None,
                   help="the throughput Buffers' dispatch staging depth in batches of 16 tokens "
                        "(Buffer(stage_batches=); default: the Buffer's)")
    p.add_argument("--ring-chunks", type=int, default=None,
                   help="the throughput Buffers' combine ring depth in chunks "
                        "(Buffer(ring_chunks=); default: the Buffer's)")
    p.add_argument("--bind-cpus", action="store_true",
                   help="run each rank on its GPU's NUMA node's CPUs (as a serving engine pins "
                        "its ranks): host times then do not depend on where the scheduler "
                        "moved a rank")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="group the GPUs into nodes of this many and time cute_ep.NodeBuffer "
                        "(NVSHMEM between the nodes: on one host its puts ride NVLink, so this "
                        "is the path's overhead, not a network's speed) beside NCCL and the "
                        "intranode Buffer, at the first SM budget")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.iters < 50:
        raise SystemExit("--iters must be at least 50 (medians of fewer runs are not reported)")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise SystemExit(f"unknown format {f!r}; choose from {', '.join(FORMATS)}")
    budgets = [_sm_budget(s.strip()) for s in args.sms.split(",")]
    try:
        decode_sms = _sm_budget(args.decode_sms)
        if decode_sms is not None and decode_sms < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--decode-sms takes 'all' or a positive number, not "
                         f"{args.decode_sms!r}") from None
    try:  # the Buffer's own check of the rings' depths, before any rank starts
        from cute_ep.ep import ring_geometry

        ring_geometry(None, False, args.stage_batches, args.ring_chunks)
    except ValueError as e:
        raise SystemExit(f"--stage-batches / --ring-chunks: {e}") from None
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        raise SystemExit(f"cute-ep bench needs 2+ GPUs of one host; "
                         f"{torch.cuda.device_count()} visible")
    world = torch.cuda.device_count()
    try:
        ranks = run_ranks(_worker, world, limit_s=900, bind_cpus=args.bind_cpus, args=args,
                          formats=formats, budgets=budgets)
    except RanksFailed as exc:
        raise SystemExit(f"benchmark failed:\n{exc}") from None
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "gpus": world,
        "library_version": _version(),
        # "gpu": events time the GPU's work, the calls queued behind the L2 flush (records
        # without this key timed from an idle GPU, the host's launch included).
        "timing": "gpu",
        "config": {"tokens": args.tokens, "decode_tokens": args.decode_tokens,
                   "decode_sms": args.decode_sms,
                   "hidden": args.hidden, "topk": args.topk, "experts": args.experts,
                   "iters": args.iters, "sms": [s or "all" for s in budgets],
                   "sms_per_gpu": torch.cuda.get_device_properties(0).multi_processor_count,
                   "routing": "uniform random top-k, distinct experts per token",
                   **({"direct_input": True} if args.direct_input else {}),
                   **({"bind_cpus": True} if args.bind_cpus else {}),
                   **({"stage_batches": args.stage_batches} if args.stage_batches else {}),
                   **({"ring_chunks": args.ring_chunks} if args.ring_chunks else {})},
        "ranks": ranks,
    }
    if args.gpus_per_node:
        record["config"]["gpus_per_node"] = args.gpus_per_node
        _print_nodes(record, formats)
    else:
        _print(record, formats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = record_path(out, record["date"][:10], f"{world}x{card_name(record['device'])}")
    path.write_text(json.dumps(record, indent=1))
    print(f"JSON record: {path}")
    if args.plot:
        from cute_ep.tools.plot import bench_figure

        deepep = json.loads(Path(args.deepep_record).read_text()) if args.deepep_record else None
        print(f"figure: {bench_figure(record, args.plot, deepep)}")
    return 0


def _version() -> str:
    from cute_ep import __version__

    return __version__


# One rank ------------------------------------------------------------------------------------


# The SM clocks of a GPU (MHz): now, the most it may run at, and the application clock it runs
# kernels at. A store-bound kernel's time scales with the SM clock where a link-bound one's does
# not, so records of different machines compare only beside their clocks.
_CLOCKS = ("clocks.sm", "clocks.max.sm", "clocks.applications.graphics")


def gpu_clocks(index: int, run=subprocess.run) -> dict[str, int] | None:
    """`_CLOCKS` of GPU `index` (this process's numbering) by nvidia-smi, or None where it cannot
    say (no nvidia-smi, a field it does not know)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = visible.split(",")[index].strip() if visible else str(index)  # an index or a UUID
    try:
        done = run(["nvidia-smi", f"--query-gpu={','.join(_CLOCKS)}",
                    "--format=csv,noheader,nounits", "-i", gpu],
                   capture_output=True, text=True, timeout=30)
        values = [int(v) for v in done.stdout.strip().split(",")]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode or len(values) != len(_CLOCKS):
        return None
    return dict(zip(("sm_mhz", "max_sm_mhz", "application_sm_mhz"), values))


def _worker(rank, world, args, formats, budgets) -> dict:
    out = {"rank": rank, "formats": {}, "clocks": gpu_clocks(torch.cuda.current_device())}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    if args.gpus_per_node:
        for fmt in formats:
            out["formats"][fmt] = {"nodes": _nodes(rank, world, args, fmt, budgets[0], flush)}
        return out
    for fmt in formats:
        out["formats"][fmt] = {
            "throughput": _throughput(rank, world, args, fmt, budgets, flush),
            "decode": _decode(rank, world, args, fmt, flush),
        }
        if args.stages:
            out["formats"][fmt]["stages"] = {
                "throughput": _stages(world, args, fmt, args.tokens, rank),
                "decode": _stages(world, args, fmt, args.decode_tokens, rank),
            }
    return out


def _layer_format(fmt: str) -> str:
    """The Buffer format a bench format runs on."""
    return fmt.removesuffix("-input")


def quantized_input(x: torch.Tensor, fmt: str, quant: dict):
    """x as bench format `fmt` passes it to dispatch: bf16 tokens as they are; for "fp8-input"
    and "nvfp4-input" the (codes, scales) tuple of the layer's format, as a caller quantizes
    upstream (NVFP4 under `quant`'s global scale, which the call then no longer takes)."""
    if fmt == "fp8-input":
        from cute_ep.reference.ep import quantize_fp8_blockwise

        return tuple(quantize_fp8_blockwise(x))
    if fmt == "nvfp4-input":
        from cute_ep.quant import quantize_nvfp4

        return quantize_nvfp4(x, quant.pop("global_scale"), scales="linear")
    return x


def _inputs(cfg, tokens, seed, fmt=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, cfg.experts, device="cuda", generator=gen).argsort(1)[:, :cfg.topk]
    w = torch.rand(tokens, cfg.topk, device="cuda", generator=gen)
    y = torch.randn(cfg.row_capacity, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    quant = {"global_scale": torch.tensor([448.0 * 6 / 4], device="cuda")} \
        if cfg.format == "nvfp4" else {}
    return quantized_input(x, fmt, quant), ids.to(torch.int32), w, y, quant


def _timed_steps(steps, iters, flush, group=None) -> list[list[float]]:
    """Per-iteration GPU times (us) of each of `steps`, run in order every iteration after
    sync + barrier + L2 flush, one CUDA event between consecutive steps. The flush (256 MiB of
    stores, about 90 us) is queued first, so the first step's launch reaches the GPU while it
    is still busy: the GPU's time of the steps, without the host's launch path or an idle GPU
    waiting for it (host time is measured on its own)."""
    import torch.distributed as dist

    times = [[] for _ in steps]
    for i in range(iters + WARMUP):
        torch.cuda.synchronize()
        dist.barrier(group)
        flush.zero_()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
        ev[0].record()
        for step, after in zip(steps, ev[1:]):
            step()
            after.record()
        ev[-1].synchronize()
        if i >= WARMUP:
            for t, a, b in zip(times, ev, ev[1:]):
                t.append(a.elapsed_time(b) * 1e3)
    return times


def _timed(fn, iters, flush, group=None) -> list[float]:
    """Per-iteration GPU times (us) of fn()."""
    return _timed_steps([fn], iters, flush, group)[0]


def _lockstep_us(fn, iters, flush) -> float:
    """Mean GPU time (us) of fn() by DeepEP's normal-mode method: WARMUP calls, a barrier and one
    L2 flush, then `iters` calls back to back with no barrier or synchronisation between them,
    each between two CUDA events; the first call's time is dropped."""
    import torch.distributed as dist

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    flush.zero_()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e3 for a, b in ev][1:]
    return sum(times) / len(times)


def _lockstep_times(buf, x, ids, w, y, quant, iters, flush) -> dict:
    """Dispatch back to back, then combine of one dispatch's handle back to back (as DeepEP's
    test times its dispatch and its combine), each by `_lockstep_us`."""
    out = buf.dispatch(x, ids, w, **quant)
    d = _lockstep_us(lambda: buf.dispatch(x, ids, w, **quant), iters, flush)
    c = _lockstep_us(lambda: buf.combine(y, out.handle), iters, flush)
    buf.check()
    return {"lockstep_dispatch_us": d, "lockstep_combine_us": c}


def _layer_times(buf, x, ids, w, y, quant, iters, flush) -> dict:
    """Median dispatch and combine times (us), timed in the same iterations."""
    last = {}

    def dispatch():
        last["out"] = buf.dispatch(x, ids, w, **quant)

    d_times, c_times = _timed_steps([dispatch, lambda: buf.combine(y, last["out"].handle)],
                                    iters, flush)
    buf.check()
    return {"dispatch_us": statistics.median(d_times), "combine_us": statistics.median(c_times),
            "out": last["out"]}


def _throughput(rank, world, args, fmt, budgets, flush) -> dict:
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(args.hidden, args.topk, args.experts, world, args.tokens, _layer_format(fmt))
    x, ids, w, y, quant = _inputs(cfg, args.tokens, 1 + rank, fmt)
    msg = cfg.message
    token_bytes, to_rank = _wire(cfg, fmt, ids)
    sent = [int(m.sum()) for m in to_rank]
    sent_peers = sum(n for d, n in enumerate(sent) if d != rank)
    sweep = []
    first_out = None
    # The direct input: bf16 x, or pre-quantized (codes, scales) (FP8 / NVFP4 "-input").
    direct = args.direct_input and (cfg.format == "bf16" or type(x) is tuple)
    for sms in budgets:
        buf = Buffer(cfg, sms=sms, direct_input=direct, stage_batches=args.stage_batches,
                     ring_chunks=args.ring_chunks)
        x_in = direct_input(buf, x) if direct else x
        t = _layer_times(buf, x_in, ids, w, y, quant, args.iters, flush)
        out = t.pop("out")
        t.update(_lockstep_times(buf, x_in, ids, w, y, quant, args.iters, flush))
        if first_out is None:
            first_out = out
        received = int(out.handle.messages.sum())
        from_peers = received - int(out.handle.messages[rank])
        rows = int(out.row_offsets[-1])
        sweep.append({
            "sms": sms or "all", **t,
            "received_tokens": received, "rows": rows, "token_bytes": token_bytes,
            "dispatch_deepep_gbps": received * token_bytes / t["dispatch_us"] / 1e3,
            # What crosses NVLink: per message, the staged payload and scales a destination
            # pulls; per batch and peer, the header it reads.
            "dispatch_nvlink_gbps": (sent_peers * msg.staged_bytes
                                     + _batches(buf, args.tokens) * (world - 1)
                                     * buf.geo.header_bytes) / t["dispatch_us"] / 1e3,
            "combine_deepep_gbps": received * 2 * cfg.hidden / t["combine_us"] / 1e3,
            "combine_nvlink_gbps": from_peers * 2 * cfg.hidden / t["combine_us"] / 1e3,
            "ctas": _ctas(buf, args.tokens),
            # The traced dispatch is the timed one's call: the direct input's rows where the
            # timed calls read them there (x would be staged, a different dispatch).
            **_dispatch_trace(buf, x_in, ids, w, quant), **_combine_trace(buf, y, out),
        })
        del buf

    # Baseline 1: NCCL all_to_all_single of the same token bytes.
    nccl, received = _nccl_all_to_all(to_rank, token_bytes, args.tokens, args.iters, flush)

    # Baseline 2: copy-engine copies of this rank's outgoing message bytes into each peer.
    p2p = _p2p_copy_us(rank, world, [n * msg.size for n in sent], args.tokens * msg.size,
                       args.iters, flush)
    # Like for like with DeepEP's normal mode, whose dispatch gives one row per received token:
    # the gather its user then runs to reach these expert-grouped rows.
    gather = _gather_us(first_out, cfg, fmt, args.iters, flush) \
        if fmt in GATHER_FORMATS else None
    return {
        "sweep": sweep,
        "deepep_gather_us": gather,
        "nccl_all_to_all_us": nccl,
        "nccl_deepep_gbps": received * token_bytes / nccl / 1e3,
        "nccl_nvlink_gbps": sent_peers * token_bytes / nccl / 1e3,
        "p2p_copy_us": p2p,
        "p2p_copy_gbps": sent_peers * msg.size / p2p / 1e3 if p2p else None,
        "sent_tokens_to_peers": sent_peers,
        "message_bytes": msg.size,
    }


def direct_input(buf, x):
    """x written into `buf`'s direct input, as the layer before would have written it: its
    first rows (bf16 x, or (codes, scales)), the views a dispatch then reads in place."""
    if type(x) is tuple:
        views = tuple(v[:x[0].shape[0]] for v in buf.input_buffer())
        for view, part in zip(views, x):
            view.copy_(part)
        return views
    view = buf.input_buffer()[:x.shape[0]]
    view.copy_(x)
    return view


def _wire(cfg, fmt, ids) -> tuple[int, list]:
    """What the baselines move: a token's bytes (payload, and scales but for bf16) and, per
    rank d, which of this rank's tokens go there (an expert of d among their ids)."""
    msg = cfg.message
    token_bytes = msg.segment("payload").nbytes + \
        (msg.segment("scales").nbytes if fmt != "bf16" else 0)
    dest = ids.long() // cfg.local_experts
    return token_bytes, [(dest == d).any(1) for d in range(cfg.ranks)]


def _nccl_all_to_all(to_rank, token_bytes, tokens, iters, flush) -> tuple[float, int]:
    """NCCL's all_to_all_single of `token_bytes` a token, each token (of `tokens`) once to every
    rank d where `to_rank[d]` is set: (median us, tokens received)."""
    import torch.distributed as dist

    sent = [int(m.sum()) for m in to_rank]
    wire = torch.randint(0, 256, (tokens, token_bytes), dtype=torch.uint8, device="cuda")
    send_counts = torch.tensor(sent, device="cuda")
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    a2a_in = torch.cat([wire[m] for m in to_rank]).contiguous()
    a2a_out = torch.empty(int(recv_counts.sum()), token_bytes, dtype=torch.uint8, device="cuda")
    splits = dict(output_split_sizes=recv_counts.tolist(), input_split_sizes=sent)
    nccl = statistics.median(_timed(lambda: dist.all_to_all_single(a2a_out, a2a_in, **splits),
                                    iters, flush))
    return nccl, int(recv_counts.sum())


def _nodes(rank, world, args, fmt, sms, flush) -> dict:
    """`--gpus-per-node`: NodeBuffer's dispatch and combine (medians and lockstep, as
    `_throughput` times the Buffer's), the intranode Buffer over the same GPUs, and NCCL's
    all_to_all of the same token bytes."""
    import os

    from cute_ep.ep import Buffer
    from cute_ep.nodes import NodeBuffer
    from layouts import EPConfig

    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # the GPUs of this host
    kwargs = {} if sms is None else {"sms": sms}
    out = {"gpus_per_node": args.gpus_per_node, "sms": sms or "all"}
    for name, gpus, make in (("nodes", args.gpus_per_node, NodeBuffer),
                             ("intranode", None, Buffer)):
        cfg = EPConfig(args.hidden, args.topk, args.experts, world, args.tokens,
                       _layer_format(fmt), gpus_per_node=gpus)
        x, ids, w, _, quant = _inputs(cfg, args.tokens, 1 + rank, fmt)
        buf = make(cfg, **kwargs)
        inner = getattr(buf, "inner", buf)
        y = torch.randn(inner.cfg.row_capacity, cfg.hidden, device="cuda").to(torch.bfloat16)
        t = _layer_times(buf, x, ids, w, y, quant, args.iters, flush)
        t.pop("out")
        t.update(_lockstep_times(buf, x, ids, w, y, quant, args.iters, flush))
        out[name] = t
        del buf
    token_bytes, to_rank = _wire(cfg, fmt, ids)
    out["nccl_all_to_all_us"], _ = _nccl_all_to_all(to_rank, token_bytes, args.tokens,
                                                     args.iters, flush)
    return out


# The formats DeepEP's normal mode dispatches: bf16, and FP8 given pre-quantized.
GATHER_FORMATS = ("bf16", "fp8-input")


def gather_index(messages: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """For each of a dispatch's `n_rows` expert-grouped rows, the row of DeepEP's recv_x that
    holds its token: recv_x has one row per received message, sources in order, each in its
    message (token) order; `messages` [R] counts them per source and `rows` [R, max_tokens, K]
    is the handle's row of (source, message, k), -1 where none. Rows no pair fills (FP8's
    alignment padding) take row 0."""
    messages, rows = messages.long(), rows.long()
    first = torch.cumsum(messages, 0) - messages  # recv_x row of each source's first message
    j = torch.arange(rows.shape[1], device=rows.device)
    src = (first[:, None] + j[None, :])[:, :, None].expand_as(rows)
    live = (rows >= 0) & (j[None, :, None] < messages[:, None, None])
    idx = torch.zeros(n_rows, dtype=torch.long, device=rows.device)
    idx[rows[live]] = src[live]
    return idx


def _gather_us(out, cfg, fmt, iters, flush) -> float:
    """GPU time (us) of the gather a DeepEP user runs after its dispatch to reach `out`'s rows:
    DeepEP's recv_x holds one row per received token, sources in order and each in its token
    order (a message of cute-ep's, in the same order), and torch's `index_select` copies the row
    of every (token, expert) pair into cute-ep's expert-grouped order (FP8: the codes and the
    [rows, H / 128] fp32 scales, DeepEP's layout of them). The gather runs on every SM, as an
    engine would run it."""
    n_rows, n_recv = int(out.row_offsets[-1]), int(out.handle.messages.sum())
    idx = gather_index(out.handle.messages, out.handle.rows, n_rows)
    h_ = cfg.hidden
    if fmt == "bf16":
        recv = torch.randn(n_recv, h_, device="cuda").to(torch.bfloat16)
        dst = torch.empty(n_rows, h_, dtype=torch.bfloat16, device="cuda")

        def gather():
            torch.index_select(recv, 0, idx, out=dst)
    else:
        codes = torch.randint(0, 256, (n_recv, h_), dtype=torch.uint8, device="cuda")
        scales = torch.rand(n_recv, h_ // 128, device="cuda")
        dst_codes = torch.empty(n_rows, h_, dtype=torch.uint8, device="cuda")
        dst_scales = torch.empty(n_rows, h_ // 128, device="cuda")

        def gather():
            torch.index_select(codes, 0, idx, out=dst_codes)
            torch.index_select(scales, 0, idx, out=dst_scales)
    return statistics.median(_timed(gather, iters, flush))


# Untraced calls queued back to back before a traced one (`_traced`): the ranks wait for each
# other's data in them, so the traced call starts in step on every rank.
TRACE_LEAD = 3


def _dispatch_trace(buf, x, ids, w, quant) -> dict:
    """One traced dispatch (`Buffer.trace_dispatch`) after TRACE_LEAD untraced ones back to back:
    `dispatch_trace_us`, per TRACE_FIELDS stamp the latest channel's time from this rank's
    earliest start (us), per wait the longest channel's; `dispatch_trace_median_us`, the median
    channel's of each (one late channel sets the first, not the second)."""
    from layouts.channels import TRACE_FIELDS

    latest, median = _traced(buf.trace_dispatch, lambda: buf.trace,
                             lambda: buf.dispatch(x, ids, w, **quant), TRACE_FIELDS)
    return {"dispatch_trace_us": latest, "dispatch_trace_median_us": median}


def _combine_trace(buf, y, out) -> dict:
    """The same for one combine of `out` (`Buffer.trace_combine`, COMBINE_TRACE_FIELDS):
    `combine_trace_us`, `combine_trace_median_us`."""
    from layouts.channels import COMBINE_TRACE_FIELDS

    latest, median = _traced(buf.trace_combine, lambda: buf.combine_trace,
                             lambda: buf.combine(y, out.handle), COMBINE_TRACE_FIELDS)
    return {"combine_trace_us": latest, "combine_trace_median_us": median}


def _traced(switch, recorded, run, fields) -> tuple[dict, dict]:
    """`run` once traced (`switch` on, then off), queued behind TRACE_LEAD untraced calls after a
    barrier: one traced call straight after the barrier started when its rank's host got there,
    and a peer that launched milliseconds later (seen on every-SM combines of 2 and 4 H200s)
    showed up as that long a wait on the others' timelines."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(TRACE_LEAD):
        run()
    switch(True)  # the trace's zeroing is queued behind the untraced calls
    run()
    torch.cuda.synchronize()
    trace = recorded().double().cpu()
    switch(False)
    ran = trace[:, 0] > 0  # a decode step's channels past its active ones never start
    if ran.any():
        trace = trace[ran]
    start = trace[:, 0].min()
    latest, median = {}, {}
    for i, field in enumerate(fields):
        if field.endswith("_ns"):
            latest[field[:-3] + "_us"] = trace[:, i].max().item() / 1e3
            median[field[:-3] + "_us"] = trace[:, i].median().item() / 1e3
        elif field != "start":
            latest[field] = (trace[:, i].max() - start).item() / 1e3
            median[field] = (trace[:, i].median() - start).item() / 1e3
    return latest, median


def _batches(buf, tokens) -> int:
    """Batches of 16 tokens a rank's channels stage for `tokens` tokens."""
    from layouts.channels import STAGE_BATCH_TOKENS, active_channels

    active = active_channels(buf.sms, buf.cfg.max_tokens_per_rank, None)
    return sum(-(-(end - begin) // STAGE_BATCH_TOKENS)
               for begin, end in (buf.geo.token_range(c, tokens) for c in range(active)))


def _ctas(buf, tokens) -> dict:
    """CTAs each communicating kernel launches at this budget (what `sms` sets)."""
    return {"dispatch": buf.sms, "combine": buf.sms}


STAGE_KERNELS = ("Encode", "Dispatch", "Combine")
STAGE_ITERS = 20


def _stages(world, args, fmt, tokens, rank) -> dict:
    """Mean GPU time (us) of each kernel of one dispatch + combine (default budget), from the torch
    profiler's kernel records over STAGE_ITERS layers, each after a barrier. A receive kernel's
    time includes its wait for the slowest peer's send."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(args.hidden, args.topk, args.experts, world, tokens, _layer_format(fmt))
    buf = Buffer(cfg)
    x, ids, w, y, quant = _inputs(cfg, tokens, 200 + rank, fmt)
    for _ in range(WARMUP):
        buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STAGE_ITERS):
            torch.cuda.synchronize()
            dist.barrier()
            buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)
        torch.cuda.synchronize()
    buf.check()
    del buf
    totals = kernel_totals(prof.key_averages())
    return {"tokens": tokens, **{f"{k.lower()}_us": v / STAGE_ITERS for k, v in totals.items()}}


def kernel_totals(items) -> dict[str, float]:
    """{"Encode", "Dispatch", "Combine": GPU time (us) of that family's kernels, summed} of the
    torch profiler's `key_averages()` (the kernels are named cute_ep::cutlass::<family>...,
    `kernels/build.py`)."""
    totals = dict.fromkeys(STAGE_KERNELS, 0.0)
    for item in items:
        m = re.search(r"cute_ep::cutlass::(encode|dispatch|combine)", item.key)
        if m and m.group(1).capitalize() in totals:
            total = getattr(item, "device_time_total", None)
            if total is None:
                total = item.cuda_time_total
            totals[m.group(1).capitalize()] += total
    return totals


LOCKSTEP_LAYERS = 30  # as DeepEP's bench_kineto (num_tests)


def _lockstep_kernel_us(buf, x, ids, w, y, quant) -> dict:
    """Mean kernel time (us) per layer of dispatch (its encoder included) and combine, by
    DeepEP's low-latency test's method: a large matmul and an all-reduce, then LOCKSTEP_LAYERS
    layers back to back with no barrier between them (ranks that wait for each other's data run
    in step), each kernel's GPU time from the profiler."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    def layer():
        buf.combine(y, buf.dispatch(x, ids, w, **quant).handle)

    for _ in range(WARMUP):
        layer()
    a = torch.randn(8192, 8192, device="cuda")
    b = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a @ b
        dist.all_reduce(torch.ones(1, device="cuda"))
        for _ in range(LOCKSTEP_LAYERS):
            layer()
        torch.cuda.synchronize()
    buf.check()
    totals = kernel_totals(prof.key_averages())
    return {"kernel_dispatch_us": (totals["Encode"] + totals["Dispatch"]) / LOCKSTEP_LAYERS,
            "kernel_combine_us": totals["Combine"] / LOCKSTEP_LAYERS}


def _p2p_copy_us(rank, world, nbytes, slot, iters, flush) -> float | None:
    """Median time (us) of copying nbytes[d] to every peer d at once (copy engine, a stream per
    peer) into peer-mapped symmetric memory (`slot` bytes per source, the same on every rank)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(world * slot, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    src = torch.randint(0, 256, (slot,), dtype=torch.uint8, device="cuda")
    peers = [d for d in range(world) if d != rank and nbytes[d]]
    dsts = {d: handle.get_buffer(d, (nbytes[d],), torch.uint8, rank * slot) for d in peers}
    streams = {d: torch.cuda.Stream() for d in peers}

    def copy():
        main = torch.cuda.current_stream()
        for d in peers:
            streams[d].wait_stream(main)
            with torch.cuda.stream(streams[d]):
                dsts[d].copy_(src[:nbytes[d]], non_blocking=True)
        for d in peers:
            main.wait_stream(streams[d])

    return statistics.median(_timed(copy, iters, flush)) if peers else None


def _decode(rank, world, args, fmt, flush) -> dict:
    import torch.distributed as dist

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    t = args.decode_tokens
    cfg = EPConfig(args.hidden, args.topk, args.experts, world, t, _layer_format(fmt))
    buf = Buffer(cfg, sms=_sm_budget(args.decode_sms))
    x, ids, w, y, quant = _inputs(cfg, t, 100 + rank, fmt)
    quant = dict(quant, num_input_tokens=t)  # the decode path: channels sized for t tokens
    eager = _layer_times(buf, x, ids, w, y, quant, args.iters, flush)
    eager.pop("out")

    # Host time of a call: the Python call returning, GPU work still queued. Cold: each layer
    # after a synchronisation and a barrier (the host idle before the call, its caches and
    # clocks as they come back); steady: the layers back to back, the host never waiting for
    # the GPU, as in a model's eager forward.
    host = _host_us(buf, x, ids, w, y, quant, args.iters, barrier_each=True)
    probe = cpu_probe_us()
    steady = _host_us(buf, x, ids, w, y, quant, args.iters, barrier_each=False)
    probe = (probe + cpu_probe_us()) / 2

    # CUDA graphs: dispatch alone, and the whole layer (combine = the difference).
    dist.barrier()
    g_dispatch, g_layer = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dispatch):
        buf.dispatch(x, ids, w, **quant)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.cuda.graph(g_layer):
        out = buf.dispatch(x, ids, w, **quant)
        buf.combine(y, out.handle)
    torch.cuda.synchronize()
    dist.barrier()
    graph_d = statistics.median(_timed(g_dispatch.replay, args.iters, flush))
    graph_l = statistics.median(_timed(g_layer.replay, args.iters, flush))
    buf.check()
    del g_dispatch, g_layer
    traces = {**_dispatch_trace(buf, x, ids, w, quant),
              **_combine_trace(buf, y, buf.dispatch(x, ids, w, **quant))}
    buf.check()
    kernels = _lockstep_kernel_us(buf, x, ids, w, y, quant)
    del buf
    return {"tokens": t, **traces, **kernels,
            "eager_dispatch_us": eager["dispatch_us"], "eager_combine_us": eager["combine_us"],
            "graph_dispatch_us": graph_d, "graph_layer_us": graph_l,
            "graph_combine_us": graph_l - graph_d,
            "host_dispatch_us": host["dispatch"], "host_combine_us": host["combine"],
            "steady_host_dispatch_us": steady["dispatch"],
            "steady_host_combine_us": steady["combine"],
            "steady_host_dispatch_cpu_us": steady["dispatch_cpu"],
            "steady_host_combine_cpu_us": steady["combine_cpu"],
            "steady_host_dispatch_p10_us": steady["dispatch_p10"],
            "steady_host_dispatch_p90_us": steady["dispatch_p90"],
            "steady_host_combine_p10_us": steady["combine_p10"],
            "steady_host_combine_p90_us": steady["combine_p90"],
            "steady_host_probe_us": probe}


def _sm_budget(value: str) -> int | None:
    """An SM budget of `--sms` or `--decode-sms` as `Buffer(sms=)` takes it: None for "all"."""
    return None if value == "all" else int(value)


PROBE_ADDS = 20000  # the CPU probe's loop


def cpu_probe_us(reps: int = 20) -> float:
    """Median microseconds of a fixed pure-Python loop (PROBE_ADDS additions): how fast this
    host thread runs interpreter work right now. Taken around the steady host times, it tells a
    slow host from a slow call: on a virtual machine the same call's time follows the probe's
    (2 x H200 host: 620-700 us at full speed, 1100-1200 when its vCPU ran at about 55%)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        total = 0
        for i in range(PROBE_ADDS):
            total += i
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _host_us(buf, x, ids, w, y, quant, layers: int, barrier_each: bool) -> dict[str, float]:
    """Median host microseconds of a dispatch and of a combine call over `layers` layers: each
    after a synchronisation and a barrier (`barrier_each`), or queued back to back after one,
    no synchronisation between them (the launch queue holds two calls a layer, far below its
    depth, so no call waits for the GPU). Each timer holds its call alone: a layer's outputs
    are released after both calls, untimed (dropping the previous layer's outputs is the
    caller's work, not the next call's). `*_cpu`: this thread's CPU time in the same calls
    (wall time well above it is time the host thread waited: descheduled or blocked)."""
    import torch.distributed as dist

    wall, cpu = time.perf_counter, time.thread_time
    times = {"dispatch": [], "combine": [], "dispatch_cpu": [], "combine_cpu": []}
    for layer in range(layers):
        if barrier_each or layer == 0:
            torch.cuda.synchronize()
            dist.barrier()
        c0 = cpu()
        t0 = wall()
        out = buf.dispatch(x, ids, w, **quant)
        t1 = wall()
        c1 = cpu()
        t2 = wall()
        res = buf.combine(y, out.handle)
        t3 = wall()
        c2 = cpu()
        times["dispatch"].append((t1 - t0) * 1e6)
        times["combine"].append((t3 - t2) * 1e6)
        times["dispatch_cpu"].append((c1 - c0) * 1e6)
        times["combine_cpu"].append((c2 - c1) * 1e6)
        del out, res
    torch.cuda.synchronize()
    got = {k: statistics.median(v) for k, v in times.items()}
    # The spread of the calls' wall times: a host whose vCPU slows for part of the layers shows
    # it here, where the median alone cannot tell a slow phase from a slow call.
    for k in ("dispatch", "combine"):
        got[f"{k}_p10"], got[f"{k}_p90"] = _quantile(times[k], 0.1), _quantile(times[k], 0.9)
    return got


def _quantile(values: list[float], q: float) -> float:
    """The value at rank round(q * (n - 1)) of the sorted values (nearest rank)."""
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def card_name(device: str) -> str:
    """The card's model in a device name: "NVIDIA H100 80GB HBM3" -> "H100" (a word of letters
    then digits, the first after the vendor), else the name's last word."""
    import re

    words = device.split()
    model = next((w for w in words if re.fullmatch(r"[A-Z]+\d+[A-Za-z]*", w)), None)
    return model or words[-1]


def record_path(folder: Path, day: str, machine: str) -> Path:
    """bench-<day>-<machine>.json, or -2, -3, ... after it: a record is never overwritten."""
    path, n = folder / f"bench-{day}-{machine}.json", 1
    while path.exists():
        n += 1
        path = folder / f"bench-{day}-{machine}-{n}.json"
    return path


# Report --------------------------------------------------------------------------------------


def _print_traces(console, record, formats) -> None:
    """Where a dispatch's and a combine's time went: their traced timelines (the slowest rank's
    figure per cell)."""
    from rich.table import Table

    ranks = record["ranks"]
    first = ranks[0]["formats"][formats[0]]
    for op in ("dispatch", "combine"):
        key = f"{op}_trace_us"
        if key not in first["throughput"]["sweep"][0]:
            continue
        fields = list(first["throughput"]["sweep"][0][key])
        t = Table(title=f"{op} timeline (us from the kernel's start; waits: longest channel), "
                        f"one traced {op}, slowest rank")
        for col in ("format", "tokens/rank", "SMs", *fields):
            t.add_column(col, justify="left" if col == "format" else "right")
        for fmt in formats:
            per = [r["formats"][fmt] for r in ranks]
            for i, point in enumerate(per[0]["throughput"]["sweep"]):
                cells = [p["throughput"]["sweep"][i][key] for p in per]
                t.add_row(fmt, str(record["config"]["tokens"]), str(point["sms"]),
                          *(f"{max(c[f] for c in cells):.1f}" for f in fields))
            if key in per[0].get("decode", {}):
                cells = [p["decode"][key] for p in per]
                t.add_row(fmt, str(per[0]["decode"]["tokens"]), "default",
                          *(f"{max(c[f] for c in cells):.1f}" for f in fields))
        console.print(t)


def _print_nodes(record, formats) -> None:
    """`--gpus-per-node`'s table: the slowest rank's time of each call."""
    from rich.console import Console
    from rich.table import Table

    cfg, ranks = record["config"], record["ranks"]
    g = cfg["gpus_per_node"]
    t = Table(title=f"{record['gpus']} x {record['device']} as {record['gpus'] // g} nodes of "
                    f"{g}: {cfg['tokens']} tokens/rank, H={cfg['hidden']} K={cfg['topk']} "
                    f"E={cfg['experts']}, us (slowest rank); NVSHMEM rides NVLink here")
    for col in ("format", "layer", "dispatch", "combine", "lockstep dispatch",
                "lockstep combine", "NCCL a2a"):
        t.add_column(col, justify="left" if col in ("format", "layer") else "right")
    for fmt in formats:
        per = [r["formats"][fmt]["nodes"] for r in ranks]
        for name, label in (("nodes", "NodeBuffer"), ("intranode", "Buffer, one node")):
            t.add_row(fmt, label, *(f"{max(p[name][k] for p in per):.1f}" for k in (
                "dispatch_us", "combine_us", "lockstep_dispatch_us", "lockstep_combine_us")),
                f"{max(p['nccl_all_to_all_us'] for p in per):.1f}" if name == "nodes" else "")
    Console(width=160).print(t)


def _print(record, formats) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    cfg = record["config"]
    ranks = record["ranks"]
    worst = max  # every cell is the slowest rank's time (lowest rank's GB/s)
    clocks = [r.get("clocks") for r in ranks]
    if any(clocks):  # records from before the clocks lack them
        console.print("SM clocks, MHz (now / max / application): " + ", ".join(
            f"rank {r}: " + (f"{c['sm_mhz']} / {c['max_sm_mhz']} / {c['application_sm_mhz']}"
                             if c else "unknown") for r, c in enumerate(clocks)))

    t = Table(title=f"{record['gpus']} x {record['device']}: throughput, {cfg['tokens']} tokens/"
                    f"rank, H={cfg['hidden']} K={cfg['topk']} E={cfg['experts']}, median of "
                    f"{cfg['iters']} (slowest rank shown)")
    # Records from before the lockstep columns lack them.
    lockstep = "lockstep_dispatch_us" in ranks[0]["formats"][formats[0]]["throughput"][
        "sweep"][0]
    for col in ("format", "SMs", "dispatch us", "DeepEP GB/s", "NVLink GB/s",
                "combine us", "DeepEP GB/s ", "NVLink GB/s ",
                *(("lockstep dispatch us", "lockstep combine us") if lockstep else ()),
                "NCCL a2a us", "P2P copy us", "gather us"):
        t.add_column(col, justify="left" if col == "format" else "right")
    for fmt in formats:
        per = [r["formats"][fmt]["throughput"] for r in ranks]
        for i, point in enumerate(per[0]["sweep"]):
            cells = [p["sweep"][i] for p in per]
            t.add_row(fmt, str(point["sms"]),
                      f"{worst(c['dispatch_us'] for c in cells):.1f}",
                      f"{min(c['dispatch_deepep_gbps'] for c in cells):.0f}",
                      f"{min(c['dispatch_nvlink_gbps'] for c in cells):.0f}",
                      f"{worst(c['combine_us'] for c in cells):.1f}",
                      f"{min(c['combine_deepep_gbps'] for c in cells):.0f}",
                      f"{min(c['combine_nvlink_gbps'] for c in cells):.0f}",
                      *((f"{worst(c['lockstep_dispatch_us'] for c in cells):.1f}",
                         f"{worst(c['lockstep_combine_us'] for c in cells):.1f}")
                        if lockstep else ()),
                      f"{worst(p['nccl_all_to_all_us'] for p in per):.1f}" if i == 0 else "",
                      f"{worst(p['p2p_copy_us'] or 0 for p in per):.1f}" if i == 0 else "",
                      f"{worst(p['deepep_gather_us'] for p in per):.1f}"
                      if i == 0 and per[0].get("deepep_gather_us") is not None else "")
    console.print(t)
    _print_traces(console, record, formats)
    console.print("DeepEP GB/s = received token rows (own rank included) x bytes per token row "
                  "(payload + scales) / time; combine: the same rows x 2H / time. NVLink GB/s = "
                  "bytes of this GPU's tokens that crossed to other GPUs (dispatch: staged "
                  "payload + scales per message, a header per batch of 16 tokens) / time. "
                  "NCCL a2a: all_to_all_single of the same token bytes; P2P copy: copy-engine "
                  "copies of this GPU's outgoing message bytes into every peer at once. gather: "
                  "torch index_select of one row per received token (DeepEP's recv_x) into "
                  "these expert-grouped rows, every SM: DeepEP's dispatch + gather is what "
                  "compares with cute-ep's dispatch. dispatch us / combine us: median, each "
                  "call after a barrier (the ranks' launch skew included); lockstep: mean of "
                  "calls back to back, as DeepEP's test_intranode.py times its own.")

    d = Table(title=f"decode: {cfg['decode_tokens']} tokens/rank, "
                    f"{cfg.get('decode_sms', 24)} SMs, median of {cfg['iters']} "
                    f"(slowest rank shown)")
    columns = {"graph dispatch us": "graph_dispatch_us", "graph combine us": "graph_combine_us",
               "graph layer us": "graph_layer_us", "kernel dispatch us": "kernel_dispatch_us",
               "kernel combine us": "kernel_combine_us", "eager dispatch us": "eager_dispatch_us",
               "eager combine us": "eager_combine_us", "host us / dispatch call":
               "host_dispatch_us", "host us / combine call": "host_combine_us",
               "steady host us / dispatch": "steady_host_dispatch_us",
               "steady host us / combine": "steady_host_combine_us"}
    # Records from before the kernel columns lack them.
    columns = {col: k for col, k in columns.items() if k in ranks[0]["formats"][formats[0]][
        "decode"]}
    d.add_column("format")
    for col in columns:
        d.add_column(col, justify="right")
    for fmt in formats:
        per = [r["formats"][fmt]["decode"] for r in ranks]
        d.add_row(fmt, *(f"{worst(p[k] for p in per):.1f}" for k in columns.values()))
    console.print(d)
    console.print("graph combine = graph layer (dispatch + combine) - graph dispatch; kernel = "
                  f"mean GPU time of the dispatch (encoder included) and combine kernels over "
                  f"{LOCKSTEP_LAYERS} layers back to back after one all-reduce, from the "
                  "profiler, as DeepEP's test_low_latency.py times its kernels; host us = time "
                  "for the Python call to return, GPU work still queued, each layer after a "
                  "barrier (the host idle before it); steady host us = the same in layers "
                  "queued back to back, as a model's eager forward calls them.")

    if "stages" not in ranks[0]["formats"][formats[0]]:
        return
    s = Table(title=f"per-kernel GPU time (us), mean of {STAGE_ITERS} layers, default SM "
                    f"budget (slowest rank shown)")
    s.add_column("format")
    s.add_column("tokens/rank", justify="right")
    # The kernels as the record names them (a record keeps the kernel names of its version).
    kernels = [k for k in ranks[0]["formats"][formats[0]]["stages"]["throughput"]
               if k.endswith("_us")]
    for k in kernels:
        s.add_column(k[:-3], justify="right")
    for fmt in formats:
        for case in ("throughput", "decode"):
            per = [r["formats"][fmt]["stages"][case] for r in ranks]
            s.add_row(fmt, str(per[0]["tokens"]),
                      *(f"{worst(p[k] for p in per):.1f}" for k in kernels))
    console.print(s)
    console.print("Dispatch and Combine include the wait for the slowest peer's data.")


if __name__ == "__main__":
    raise SystemExit(main())
