"""`cute_ep.autograd` on the CPU: the gradients of a small MoE layer against plain torch.

The ranks of a layer run as threads of this process, each with a stand-in for `Buffer`
(`_RankBuffer`) whose dispatch and combine are collectives over the threads: dispatch from
`cute_ep.reference.ep` with the handle a Buffer records (the row and weight of each (source,
message, k), messages in source-token order), and combine computed from that handle alone (its
weights, its `weighted` flag), as the combine kernel does. So the test runs every step of the
autograd functions (the unit-weight combine of the dispatch's backward, the BF16 dispatch of the
combine's backward and the row matching, the unreduced combine for the weights' gradient)
without a GPU; `tests/multigpu/test_autograd.py` runs the same layer on real Buffers.

Tolerance: the layer computes in bf16 (rows, expert outputs, combine outputs rounded to bf16),
the reference in fp32 from the same bf16 inputs, so gradients agree to bf16 rounding of a few
sums: |got - want| <= 2e-2 * max|want| per tensor.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from cute_ep import autograd
from cute_ep.ep import DispatchHandle, DispatchOutput, Routing
from cute_ep.reference import ep as reference
from layouts import EPConfig

TOLERANCE = 2e-2


class _World:
    """R ranks as threads: `exchange(rank, item)` returns every rank's item once all gave one."""

    def __init__(self, ranks: int):
        self.items = [None] * ranks
        self.barrier = threading.Barrier(ranks, timeout=60)

    def exchange(self, rank, item):
        self.items[rank] = item
        self.barrier.wait()
        items = list(self.items)
        self.barrier.wait()
        return items


class _RankBuffer:
    """One rank's stand-in for `cute_ep.Buffer` (see the module text)."""

    def __init__(self, cfg: EPConfig, rank: int, world: _World, sms: int = 24):
        self.cfg, self.rank, self.world, self.sms = cfg, rank, world, sms

    def dispatch(self, x, topk_ids, topk_weights=None, *, skip_a2a=False,
                 num_input_tokens=None, global_scale=None):
        cfg = self.cfg
        everyone = self.world.exchange(self.rank, (x.detach(), topk_ids, topk_weights))
        xs = [e[0] for e in everyone]
        ids = [e[1].long() for e in everyone]
        res = reference.dispatch(cfg, xs, ids)[self.rank]
        t_max, k = cfg.max_tokens_per_rank, cfg.topk
        rows = torch.full((cfg.ranks, t_max, k), -1, dtype=torch.int32)
        weights = torch.zeros(cfg.ranks, t_max, k)
        tokens = torch.zeros(cfg.ranks, t_max, dtype=torch.int32)
        messages = torch.zeros(cfg.ranks, dtype=torch.int32)
        placed = torch.nonzero(res.source_rank >= 0).flatten()
        for s in range(cfg.ranks):
            here = (ids[s] // cfg.local_experts) == self.rank
            senders = torch.nonzero(here.any(dim=1)).flatten()  # in token order
            messages[s] = len(senders)
            tokens[s, : len(senders)] = senders.int()
            slot_of = {int(t): m for m, t in enumerate(senders)}
            for row in placed:
                if int(res.source_rank[row]) != s or int(res.src_info[row, 1]) < 0:
                    continue
                t, kk = int(res.src_info[row, 0]), int(res.src_info[row, 1])
                rows[s, slot_of[t], kk] = row
                weights[s, slot_of[t], kk] = everyone[s][2][t, kk]
        routing = Routing(channels=1, num_tokens=x.shape[0], weighted=topk_weights is not None,
                          skip_a2a=skip_a2a, shared_begin=0,
                          shared_end=x.shape[0] if cfg.fused_shared_expert else 0,
                          topk_ids=topk_ids.int())
        shared = [(int(row), int(res.src_info[row, 0])) for row in placed
                  if int(res.src_info[row, 1]) < 0]
        handle = DispatchHandle._of(dict(routing=routing, rows=rows, weights=weights,
                                         tokens=tokens, messages=messages,
                                         channels=messages[None, :].clone(), shared_rows=shared,
                                         _flat=None, _carve=None))
        return DispatchOutput._of(dict(tokens=res.tokens, scales=res.scales,
                                       row_offsets=res.row_offsets.int(),
                                       expert_ids=res.expert_ids, src_info=res.src_info,
                                       counts=res.counts, handle=handle, scales_offsets=None,
                                       _flat=None, _carve=None))

    def combine(self, y, handle):
        cfg = self.cfg
        everyone = self.world.exchange(self.rank, (y.detach(), handle))
        r = handle.routing
        h, k = cfg.hidden, cfg.topk
        acc = torch.zeros((r.num_tokens, h) if r.weighted else (r.num_tokens, k, h))
        for d, (yd, hd) in enumerate(everyone):  # the expert side d, its rows from this rank
            s = self.rank
            for m in range(int(hd.messages[s])):
                t = int(hd.tokens[s, m])
                part = torch.zeros(h)
                for kk in range(k):
                    row = int(hd.rows[s, m, kk])
                    if row < 0:
                        continue
                    if r.weighted:
                        part += float(hd.weights[s, m, kk]) * yd[row].float()
                    else:
                        acc[t, kk] = yd[row].float()
                if r.weighted:
                    acc[t] += part.to(torch.bfloat16).float()  # a rank's sum, rounded once
        if r.weighted:  # the shared expert's rows, unweighted (the kernel reads them from y)
            for row, t in handle.shared_rows:
                acc[t] += y[row].float()
        return acc.to(torch.bfloat16)


def _run(ranks, fn):
    """fn(rank) on one thread per rank; the results by rank (an exception re-raised)."""
    results, errors = [None] * ranks, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def experts(cfg, seed, device="cpu"):
    """One weight per expert, then the shared expert's (used only when it is fused)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(cfg.hidden, cfg.hidden, generator=gen) / cfg.hidden ** 0.5)
            .to(device).requires_grad_() for _ in range(cfg.experts + 1)]


def inputs(cfg, seed, tokens, device="cpu"):
    """Every rank's (x, topk_ids, topk_weights, d loss / d z), the same in every process."""
    out = []
    for r in range(cfg.ranks):
        gen = torch.Generator().manual_seed(seed * 31 + r)
        x = torch.randn(tokens, cfg.hidden, generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, cfg.experts, generator=gen).argsort(1)[:, : cfg.topk]
        w = torch.rand(tokens, cfg.topk, generator=gen)
        g = torch.randn(tokens, cfg.hidden, generator=gen)
        out.append((x.to(device).requires_grad_(), ids.to(device), w.to(device).requires_grad_(),
                    g.to(device)))
    return out


def _fake_quant(cfg, x):
    """What an FP8 dispatch's rows hold, with the gradient passed straight through."""
    if cfg.format != "fp8":
        return x.float()
    q, s = reference.quantize_fp8_blockwise(x.detach())
    deq = reference.dequantize_fp8_blockwise(q, s.t())
    return x.float() + (deq.float() - x.float()).detach()


def reference_layer(cfg, rank_inputs, weights):
    """Plain torch, fp32: z[t] = sum_k w[t, k] * (x[t] @ W[e(t, k)]) (+ the shared expert);
    every rank's (x.grad, w.grad), the weights' gradients accumulated into `weights`."""
    grads = []
    for x, ids, w, g in rank_inputs:
        x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        xs = _fake_quant(cfg, x)
        z = xs @ weights[-1] if cfg.fused_shared_expert else \
            torch.zeros(x.shape[0], cfg.hidden, device=x.device)
        for kk in range(cfg.topk):
            for e in range(cfg.experts):
                pick = ids[:, kk] == e
                if pick.any():
                    z = z.index_add(0, torch.nonzero(pick).flatten(),
                                    w[pick, kk, None] * (xs[pick] @ weights[e]))
        (z * g).sum().backward()
        grads.append((x.grad, w.grad))
    return grads


def layer(cfg, buf, back, rank_inputs, weights, rank):
    """The layer on rank `rank` through cute_ep.autograd (`back`: the bf16 Buffer of an fp8
    layer); returns (x.grad, topk_weights.grad), the weights' gradients accumulated."""
    x, ids, w, g = rank_inputs[rank]
    rows, out = autograd.dispatch(buf, x, ids, w, backward=back)
    y = torch.zeros(cfg.row_capacity, cfg.hidden, dtype=torch.bfloat16, device=x.device)
    offsets = out.row_offsets.tolist()
    shared = int(cfg.fused_shared_expert)
    for seg in range(cfg.segments):
        e = -1 if seg < shared else rank * cfg.local_experts + seg - shared
        lo = offsets[seg]
        n = int(out.counts[seg])
        if n:
            idx = torch.arange(lo, lo + n, device=x.device)
            y = y.index_copy(0, idx, (rows[idx].float() @ weights[e]).to(torch.bfloat16))
    z = autograd.combine(buf, y, out)
    (z.float() * g).sum().backward()
    return x.grad, w.grad


def close(got, want, what):
    bound = TOLERANCE * float(want.abs().max())
    err = float((got.float() - want.float()).abs().max())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared-expert"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_gradients_of_a_moe_layer_match_plain_torch(ranks, fmt, shared):
    cfg = EPConfig(hidden=256, topk=2, experts=4 * ranks, ranks=ranks, max_tokens_per_rank=32,
                   format=fmt, fused_shared_expert=shared)
    world = _World(ranks)
    bufs = [_RankBuffer(cfg, r, world) for r in range(ranks)]
    backs = None
    if fmt != "bf16":
        bf16 = dataclasses.replace(cfg, format="bf16")
        backs = [_RankBuffer(bf16, r, world) for r in range(ranks)]
    weights = experts(cfg, 7)
    rank_inputs = inputs(cfg, 3, 24)
    want = reference_layer(cfg, rank_inputs, weights)
    # The expert weights' gradients: the layer's, summed over ranks (each rank's experts see
    # every rank's tokens), against the reference run on the same inputs.
    ref_w = [None if p.grad is None else p.grad.clone() for p in weights]
    for p in weights:
        p.grad = None
    got = _run(ranks, lambda r: layer(cfg, bufs[r], backs[r] if backs else None, rank_inputs,
                                      weights, r))
    for r in range(ranks):
        close(got[r][0], want[r][0], f"rank {r} x.grad")
        close(got[r][1], want[r][1], f"rank {r} topk_weights.grad")
    for e, p in enumerate(weights):
        assert (p.grad is None) == (ref_w[e] is None), f"expert {e}"
        if p.grad is not None:
            close(p.grad, ref_w[e], f"expert {e} weight grad")


def test_refusals():
    cfg = EPConfig(hidden=256, topk=2, experts=4, ranks=1, max_tokens_per_rank=8, format="fp8")
    buf = _RankBuffer(cfg, 0, _World(1))
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    w = torch.ones(4, 2)
    with pytest.raises(ValueError, match="bf16 dispatch"):
        autograd.dispatch(buf, x, ids, w)
    with pytest.raises(ValueError, match="topk_weights"):
        autograd.dispatch(buf, x, ids, None)
    other = _RankBuffer(dataclasses.replace(cfg, format="bf16", hidden=512), 0, _World(1))
    with pytest.raises(ValueError, match="backward Buffer must have config"):
        autograd.dispatch(buf, x, ids, w, backward=other)
    nvfp4 = _RankBuffer(dataclasses.replace(cfg, format="nvfp4"), 0, _World(1))
    with pytest.raises(NotImplementedError, match="nvfp4"):
        autograd.dispatch(nvfp4, x, ids, w)
