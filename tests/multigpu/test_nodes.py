"""Dispatch and combine between nodes (`cute_ep.nodes.NodeBuffer`), on two GPUs as two nodes of
one GPU each: every byte between the two goes through NVSHMEM, and the outputs are checked
against the intranode path's reference (the checks of tests/multigpu/test_ep.py)."""

import os
import time

import pytest
import torch

from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.multigpu
pytest.importorskip("nvshmem.core", reason="the multinode extra (nvshmem4py-cu13) is not "
                                           "installed")

SHAPE = dict(hidden=512, topk=4, experts=16, max_tokens_per_rank=64)


def _node_buffer(world, fmt, timeout_s=30.0, gpus=1, shared=False):
    from cute_ep.nodes import NodeBuffer
    from layouts import EPConfig

    # One host, no network transport (NVSHMEM's default would look for InfiniBand devices).
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    cfg = EPConfig(**SHAPE, ranks=world, format=fmt, gpus_per_node=gpus,
                   fused_shared_expert=shared)
    return cfg, NodeBuffer(cfg, timeout_s=timeout_s)


def _layers(rank, world, fmt, prequantized, gpus=1, shared=False):
    from cute_ep.reference import ep as reference
    from cute_ep.reference.ep import quantize_fp8_blockwise
    from tests.multigpu.test_ep import (_check_combine, _check_dispatch, _expert_outputs,
                                        _global_scales, _inputs)

    cfg, buf = _node_buffer(world, fmt, gpus=gpus, shared=shared)
    # No peer mapping between nodes: a node's Buffer maps its own node's ranks only.
    assert len(buf.inner.channel_bases.tolist()) == gpus
    if gpus == 1:
        assert buf.inner.channel_bases.tolist() == [buf.inner.sym.data_ptr()]
    checked = 0
    for seed, tokens in ((3, [37, 64, 5, 60][:world]), (4, [64, 1, 0, 33][:world]),
                         (5, [0, 50, 64, 2][:world])):
        xs, ids, ws = _inputs(cfg, seed, tokens)  # seed 3 and 5: int64 ids
        gs = _global_scales(cfg, seed)
        x, quant = xs[rank], {}
        if fmt == "nvfp4":
            scale = torch.tensor([gs[rank]], dtype=torch.float32, device="cuda")
            if prequantized:
                from cute_ep.quant import quantize_nvfp4

                x = quantize_nvfp4(x, scale, scales="linear")
            else:
                quant = {"global_scale": scale}
        elif fmt == "fp8" and prequantized:
            x = tuple(quantize_fp8_blockwise(x))
        out = buf.dispatch(x, ids[rank], ws[rank], **quant)
        refs = reference.dispatch(cfg, xs, ids, global_scales=gs)
        what = f"{fmt}{' pre-quantized' if prequantized else ''}" \
               f"{' shared expert' if shared else ''} {world // gpus} x {gpus} T={tokens} " \
               f"seed={seed}"
        _check_dispatch(cfg, out, refs[rank], what)
        ys = [_expert_outputs(cfg, d, d.num_rows, gs) for d in refs]
        combined = buf.combine(ys[rank].clone(), out.handle)
        want = reference.combine(cfg, ys, refs, tokens, ws)[rank]
        bound = reference.combine(cfg, [y.abs() for y in ys], refs, tokens,
                                  [w.abs() for w in ws])[rank]
        _check_combine(combined, want, bound.float() * 2.0 ** -6, what)
        checked += refs[rank].num_rows
    buf.check()
    return checked


@pytest.mark.parametrize("fmt,prequantized", [("bf16", False), ("fp8", False), ("fp8", True),
                                              ("nvfp4", False), ("nvfp4", True)])
def test_two_nodes_of_one_gpu_match_the_intranode_reference(fmt, prequantized):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rows = run_ranks(_layers, world=2, limit_s=240, fmt=fmt, prequantized=prequantized)
    assert all(r > 0 for r in rows)


@pytest.mark.parametrize("fmt,prequantized", [("bf16", False), ("fp8", False), ("nvfp4", True)])
def test_a_fused_shared_expert_between_nodes_matches_the_intranode_reference(fmt, prequantized):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rows = run_ranks(_layers, world=2, limit_s=240, fmt=fmt, prequantized=prequantized,
                     shared=True)
    assert all(r > 0 for r in rows)


@pytest.mark.parametrize("fmt,prequantized,shared", [("bf16", False, False), ("fp8", True, False),
                                                     ("nvfp4", False, False),
                                                     ("bf16", False, True)])
def test_two_nodes_of_two_gpus_match_the_intranode_reference(fmt, prequantized, shared):
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    rows = run_ranks(_layers, world=4, limit_s=240, fmt=fmt, prequantized=prequantized, gpus=2,
                     shared=shared)
    assert all(r > 0 for r in rows)


def _absent(rank, world):
    from cute_ep.runtime.comm import PeerTimeout

    _, buf = _node_buffer(world, "bf16", timeout_s=3.0)
    if rank == 1:
        time.sleep(8.0)  # never dispatches; stays alive until rank 0 has given up
        return None
    x = torch.randn(8, SHAPE["hidden"], device="cuda").to(torch.bfloat16)
    ids = torch.arange(8 * 4, device="cuda").view(8, 4) % SHAPE["experts"]
    buf.dispatch(x, ids, torch.rand(8, 4, device="cuda"))  # returns: nothing waits on the host
    try:
        buf.check()
    except PeerTimeout as e:
        return str(e)
    return "no timeout"


def test_a_node_that_never_sends_is_named_by_rank_and_node():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    message = run_ranks(_absent, world=2, limit_s=120)[0]
    assert message.startswith("dispatch between nodes: rank 0 (node 0) timed out after 3 s "
                              "waiting for rank 1 (node 1)"), message


def _graph(rank, world, fmt, replays, shared=False):
    """Dispatch, a stand-in for the experts and combine captured in one CUDA graph, replayed on
    new tokens and routing: each replay against the reference."""
    from tests.multigpu.test_ep import graph_replays

    cfg, buf = _node_buffer(world, fmt, shared=shared)
    graph_replays(buf, cfg, rank, [SHAPE["max_tokens_per_rank"] - 7 * r for r in range(world)],
                  replays)
    buf.check()
    return True


@pytest.mark.parametrize("fmt,shared", [("bf16", False), ("fp8", False), ("bf16", True)])
def test_cuda_graph_replays_between_nodes_stay_exact(fmt, shared):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert all(run_ranks(_graph, world=2, limit_s=240, fmt=fmt, replays=4, shared=shared))


def _rounds(rank, world, rounds):
    """Back-to-back layers between nodes with changing inputs, token counts and routing (all to
    one rank's experts, or half the experts idle), each against the reference: every round
    reuses the slots its hand-back freed."""
    from tests.multigpu.test_ep import _one_layer

    cfg, buf = _node_buffer(world, "bf16")
    rows = 0
    for i in range(rounds):
        tokens = [(i * 53 + 17 * r) % (SHAPE["max_tokens_per_rank"] + 1) for r in range(world)]
        rows += _one_layer(buf, cfg, rank, 1000 + i, tokens, ("uniform", "hot", "sparse")[i % 3])
    return rows


def test_rounds_back_to_back_between_nodes_stay_exact():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert all(r > 0 for r in run_ranks(_rounds, world=2, limit_s=300, rounds=30))
