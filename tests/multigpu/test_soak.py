"""Soak: thousands of dispatch/combine rounds on every GPU, nothing lost, nothing hung, nothing
leaked. A short soak (SHORT_ROUNDS, every scenario) runs with the multi-GPU suite; the long one
only when asked for: `python -m pytest -m soak` (CUTE_EP_SOAK_ROUNDS, default 10000).
`tests/gpu/test_soak_emulated.py` runs the same scenarios, interleaved, on emulated ranks of one
GPU.

Twelve scenarios (three formats; T per rank drawn from 0 to the maximum, both included; uniform,
hot and sparse routing; skip_a2a; a fused shared expert; unweighted combine; Buffers of two EP
groups over the same GPUs, interleaved) are each checked
against `cute_ep.reference` in full the first time they run. Every later round of a scenario
must reproduce that verified round exactly: a checksum of every defined output byte (expert
rows, scales, src_info, row_offsets, counts, the combined output), computed on the device with
integer arithmetic, so a round costs no host synchronisation. The rounds are drawn at random
(the same sequence on every rank). At the end: no checksum differed, no device error was
recorded, the completion counters are back to zero, the round counters equal the number of
calls, and the GPU memory allocated is what it was before the first round.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter

import pytest
import torch

from cute_ep.reference.fp4 import scale_block_bytes
from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.multigpu

ROUNDS = int(os.environ.get("CUTE_EP_SOAK_ROUNDS", "10000"))
SHORT_ROUNDS = 300
HIDDEN, TOPK, EXPERTS, MAX_TOKENS = 1024, 4, 32, 192
CHECK_EVERY = 500
# A healthy round takes a few milliseconds: the limits leave room for start-up and a slow host,
# not for a layer that stalls (the failure then carries every rank's stacks and counters).
START_S, ROUND_S = 120.0, 0.05


def _scenarios(world):
    """(format, fused shared expert, tokens per rank, routing, skip_a2a, weighted)."""
    rng = random.Random(7)
    out = []
    for i, fmt in enumerate(("bf16", "fp8", "nvfp4") * 4):
        tokens = [rng.choice([0, MAX_TOKENS, rng.randrange(1, MAX_TOKENS)]) for _ in range(world)]
        if i == 0:
            tokens = [0] * world
        if i == 1:
            tokens = [MAX_TOKENS] * world
        kind = i // 3
        routing = ("uniform", "hot", "sparse", "uniform")[kind]
        skip_a2a = kind == 3 and fmt != "nvfp4"
        if skip_a2a:
            tokens = [max(tokens[0], 64)] * world  # allreduce mode: every rank holds them all
        shared = kind == 2
        weighted = shared or fmt == "nvfp4" or i % 2 == 0
        out.append((fmt, shared, tokens, routing, skip_a2a, weighted))
    return out


def _checksum(t: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[2] int64: the sum of the tensor's 32-bit words and their position-weighted sum (so a
    permutation of rows shows), over rows below `valid_rows` (a device scalar) if given."""
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    words = t.contiguous().view(torch.uint8).reshape(t.shape[0] if t.dim() > 1 else 1, -1)
    words = words.view(torch.int32).to(torch.int64)
    if valid_rows is not None:
        keep = torch.arange(words.shape[0], device=t.device) < valid_rows
        words = words * keep.unsqueeze(1)
    pos = torch.arange(words.numel(), device=t.device).reshape(words.shape) % 65521 + 1
    return torch.stack([words.sum(), (words * pos).sum()])


def _round_checksum(cfg, out, combined) -> torch.Tensor:
    n = out.row_offsets[-1].long()
    parts = [_checksum(out.tokens, n), _checksum(out.src_info, n),
             _checksum(out.row_offsets.unsqueeze(0)), _checksum(out.counts.unsqueeze(0)),
             _checksum(combined)]
    if cfg.format == "fp8":
        parts.append(_checksum(out.scales.t().contiguous(), n))
    if cfg.format == "nvfp4":
        blocks = ((out.counts.long() + 127) // 128).sum()
        used = blocks * scale_block_bytes(cfg.hidden, 16)
        sc = out.scales.reshape(-1, 4)  # one word per row of the view
        parts.append(_checksum(sc, used // 4))
        parts.append(_checksum(out.scales_offsets.unsqueeze(0)))
    return torch.cat(parts)


def _log(rank, start, what):
    print(f"[rank {rank} {time.monotonic() - start:7.1f} s] {what}", file=sys.stderr, flush=True)


def prepare(cfgs, world, rank_inputs):
    """Every scenario's inputs and reference outputs for the ranks `rank_inputs` lists:
    [{rank: {...}}] per scenario, with `cfgs[fmt, shared]` the Buffers' configs."""
    from cute_ep.reference import ep as reference
    from tests.multigpu.test_ep import _expert_outputs, _global_scales, _inputs

    prepared = []
    for s, (fmt, shared, tokens, routing, skip_a2a, weighted) in enumerate(_scenarios(world)):
        cfg = cfgs[fmt, shared]
        xs, ids, ws = _inputs(cfg, 500 + s, tokens, routing, same_everywhere=skip_a2a)
        gs = _global_scales(cfg, 0)
        if gs is not None:
            gs = [gs[0]] * world  # one global scale for the layer
        refs = reference.dispatch(cfg, xs, ids, skip_a2a=skip_a2a, global_scales=gs)
        ys = [_expert_outputs(cfg, d, d.num_rows, gs) for d in refs]
        wants = reference.combine(cfg, ys, refs, tokens, ws if weighted else None)
        scales = reference.combine(cfg, [y.abs() for y in ys], refs, tokens,
                                   [w.abs() for w in ws] if weighted else None)
        per_rank = {}
        for rank in rank_inputs:
            quant = {"global_scale": torch.tensor([gs[rank]], device="cuda")} if gs else {}
            per_rank[rank] = {
                "key": (fmt, shared), "x": xs[rank], "ids": ids[rank],
                "w": ws[rank] if weighted else None, "y": ys[rank].clone(), "quant": quant,
                "skip_a2a": skip_a2a, "ref": refs[rank], "want": wants[rank],
                "scale": scales[rank], "weighted": weighted, "checksum": None,
                "what": f"scenario {s} {fmt}{' shared' if shared else ''} {routing} "
                        f"{'skip_a2a ' if skip_a2a else ''}T={tokens} rank {rank}"}
        prepared.append(per_rank)
    return prepared


def dispatch_combine(buf, p):
    out = buf.dispatch(p["x"], p["ids"], p["w"], skip_a2a=p["skip_a2a"], **p["quant"])
    return out, buf.combine(p["y"], out.handle)


def verify_first_round(buf, p, out, combined) -> None:
    """A scenario's first round in full against the reference; its checksum becomes the key."""
    from tests.multigpu.test_ep import _check_combine, _check_dispatch

    _check_dispatch(buf.cfg, out, p["ref"], p["what"])
    if p["weighted"]:
        _check_combine(combined, p["want"], p["scale"].float() * 2.0 ** -6, p["what"])
    else:
        assert torch.equal(combined, p["want"]), p["what"]
    p["checksum"] = _round_checksum(buf.cfg, out, combined)


def buffer_counters(bufs, world, order) -> dict:
    """Per Buffer: (device rounds, CTAs counted, error record, calls made, stream positions as
    [phase, kind (sent, consumed), peer rank, channel])."""
    scenarios = _scenarios(world)
    # Calls per Buffer: each scenario's verified first round, then its rounds in `order`.
    calls = Counter((scenarios[s][0], scenarios[s][1]) for s in [*range(len(scenarios)), *order])
    return {key: (int(buf.dispatch_epoch), buf.dispatch_done.tolist(), buf.error.tolist(),
                  calls[key], buf.streams.view(2, 2, world, -1).tolist())
            for key, buf in bufs.items()}


def _soak(rank, world, rounds):
    import torch.distributed as dist

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    start = time.monotonic()
    # Two EP groups over the same GPUs: the shared-expert Buffers live in a second process
    # group, so layers of the two groups interleave.
    second = dist.new_group(list(range(world)))
    bufs = {}
    for fmt in ("bf16", "fp8", "nvfp4"):
        for shared in (False, True):
            cfg = EPConfig(HIDDEN, TOPK, EXPERTS, world, MAX_TOKENS, fmt, shared)
            bufs[fmt, shared] = Buffer(cfg, group=second if shared else None)
    if os.environ.get("CUTE_EP_SOAK_TRACE"):  # stall reports then carry every timeline
        for b in bufs.values():
            b.trace_dispatch()
            b.trace_combine()
    _log(rank, start, f"{len(bufs)} Buffers built")
    prepared = [p[rank] for p in prepare({k: b.cfg for k, b in bufs.items()}, world, [rank])]
    _log(rank, start, f"{len(prepared)} scenarios prepared")

    for p in prepared:
        buf = bufs[p["key"]]
        out, combined = dispatch_combine(buf, p)
        buf.check()
        verify_first_round(buf, p, out, combined)
        _log(rank, start, f"verified {p['what']}")
    del out, combined
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    before = torch.cuda.memory_allocated()

    order = random.Random(11).choices(range(len(prepared)), k=rounds)
    first_wrong = None
    for i, s in enumerate(order):
        p = prepared[s]
        buf = bufs[p["key"]]
        out, combined = dispatch_combine(buf, p)
        wrong += (_round_checksum(buf.cfg, out, combined) != p["checksum"]).any()
        del out, combined
        if (i + 1) % CHECK_EVERY == 0 or i + 1 == rounds:
            for b in bufs.values():
                b.check()  # synchronises; raises a timeout or bad input seen on the device
            if int(wrong) and first_wrong is None:
                first_wrong = i
            _log(rank, start, f"{i + 1} rounds")
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    return {"wrong": int(wrong), "first_wrong": first_wrong, "before": before, "after": after,
            "counters": buffer_counters(bufs, world, order)}


def check_results(results, world) -> None:
    for rank, r in enumerate(results):
        assert r["wrong"] == 0, f"rank {rank}: {r['wrong']} rounds differed, first {r['first_wrong']}"
        assert r["after"] == r["before"], f"rank {rank}: GPU memory {r['before']} -> {r['after']}"
        for key, (rounds, done, error, n, streams) in r["counters"].items():
            assert rounds == n, f"rank {rank} {key}: {rounds} dispatch rounds, {n} calls"
            assert not any(done), f"rank {rank} {key}: launch words left set: {done}"
            assert error == [0, 0, 0, 0], f"rank {rank} {key}: device error {error}"
            # Every batch this rank staged was consumed by every peer (dispatch stages a batch
            # once for all destinations: one stream, peer word 0), and every combine row it
            # sent to a peer was consumed there.
            for peer in range(world):
                theirs = results[peer]["counters"][key][4]
                for phase, sent in ((0, streams[0][0][0]), (1, streams[1][0][peer])):
                    assert sent == theirs[phase][1][rank], \
                        f"{key}: rank {rank} sent {sent} on phase {phase}, " \
                        f"rank {peer} consumed {theirs[phase][1][rank]}"


def _run_soak(rounds):
    world = torch.cuda.device_count()
    start = time.monotonic()
    results = run_ranks(_soak, rounds=rounds, limit_s=START_S + ROUND_S * rounds)
    seconds = time.monotonic() - start
    print(f"soak: {rounds} rounds on {world} GPUs in {seconds:.1f} s")
    check_results(results, world)
    record = os.environ.get("CUTE_EP_SOAK_RECORD")
    if record:  # a JSON record of the passed run (perf/results)
        import json

        with open(record, "w") as f:
            json.dump({"test": "tests/multigpu/test_soak.py", "rounds": rounds, "gpus": world,
                       "device": torch.cuda.get_device_name(0), "seconds": round(seconds, 1),
                       "scenarios": len(_scenarios(world)), "passed": True,
                       "buffers": {f"{fmt}{' +shared' if shared else ''}": rank0[3]
                                   for (fmt, shared), rank0 in results[0]["counters"].items()}},
                      f, indent=1)


def test_short_soak_of_every_scenario_stays_exact():
    """A few hundred rounds of all twelve scenarios, interleaved: part of every multi-GPU run."""
    _run_soak(SHORT_ROUNDS)


@pytest.mark.soak
@pytest.mark.skipif(ROUNDS < 1, reason="CUTE_EP_SOAK_ROUNDS < 1")
def test_soak_rounds_stay_exact_without_leaks_or_drift():
    _run_soak(ROUNDS)
