"""`cute_ep.autograd` between GPUs: a small MoE layer's gradients against plain torch.

Each rank runs the layer of `tests/test_autograd.py` on real Buffers (fp8 layers with a bf16
Buffer for the backward dispatch) and compares its x and topk_weights gradients, and the
gradients of its own experts' weights, with the plain-torch layer computed in every process
from the same inputs (tolerance: that file's, bf16 rounding of a few sums). The shared
expert's weight lives on every rank and sees only that rank's tokens, so its gradient is
compared after an all-reduce over the ranks (as data-parallel training sums it). One training step
also runs under `torch.compile` (graph breaks allowed: the backward and the expert loop run
eagerly) and must give the eager step's gradients within the same tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.multigpu

WORLDS = sorted({2, min(4, max(2, torch.cuda.device_count()))})


def _gradients(rank, world, fmt, shared):
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from tests.test_autograd import close, experts, inputs, layer, reference_layer

    cfg = EPConfig(hidden=512, topk=4, experts=8 * world, ranks=world, max_tokens_per_rank=256,
                   format=fmt, fused_shared_expert=shared)
    buf = Buffer(cfg)
    back = Buffer(dataclasses.replace(cfg, format="bf16")) if fmt != "bf16" else None
    weights = experts(cfg, 7, "cuda")
    rank_inputs = inputs(cfg, 3 + world, 200, "cuda")
    want = reference_layer(cfg, rank_inputs, weights)
    ref_w = [None if p.grad is None else p.grad.clone() for p in weights]
    for p in weights:
        p.grad = None
    for x, _, w, _ in rank_inputs:
        x.grad = w.grad = None
    got = layer(cfg, buf, back, rank_inputs, weights, rank)
    buf.check()
    close(got[0], want[rank][0], f"rank {rank} x.grad")
    close(got[1], want[rank][1], f"rank {rank} topk_weights.grad")
    mine = range(rank * cfg.local_experts, (rank + 1) * cfg.local_experts)
    for e in mine:
        close(weights[e].grad, ref_w[e], f"rank {rank} expert {e} weight grad")
    if shared:  # replicated on every rank, each sees its own tokens: sum as data parallelism does
        grad = weights[cfg.experts].grad.clone()
        torch.distributed.all_reduce(grad)
        close(grad, ref_w[cfg.experts], f"rank {rank} shared expert weight grad (all-reduced)")
    return True


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared-expert"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_gradients_of_a_moe_layer_match_plain_torch(world, fmt, shared):
    assert all(run_ranks(_gradients, world=world, fmt=fmt, shared=shared, limit_s=300))


def _compiled_step(rank, world):
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from tests.test_autograd import close, experts, inputs, layer

    cfg = EPConfig(hidden=512, topk=4, experts=8 * world, ranks=world, max_tokens_per_rank=256)
    buf = Buffer(cfg)
    grads = []
    for compiled in (False, True):
        weights = experts(cfg, 7, "cuda")
        rank_inputs = inputs(cfg, 5, 200, "cuda")

        def step():
            return layer(cfg, buf, None, rank_inputs, weights, rank)

        gx, gw = (torch.compile(step) if compiled else step)()
        grads.append((gx, gw, [p.grad for p in weights[rank * cfg.local_experts:
                                                         (rank + 1) * cfg.local_experts]]))
    buf.check()
    (ex, ew, eW), (cx, cw, cW) = grads
    close(cx, ex, f"rank {rank} compiled x.grad")
    close(cw, ew, f"rank {rank} compiled topk_weights.grad")
    for a, b in zip(cW, eW):
        close(a, b, f"rank {rank} compiled expert weight grad")
    return True


def test_a_compiled_training_step_gives_the_eager_gradients():
    assert all(run_ranks(_compiled_step, world=2, limit_s=300))
