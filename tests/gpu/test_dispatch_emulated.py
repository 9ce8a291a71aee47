"""The whole layer (dispatch, then combine) with every rank emulated on one GPU
(`Buffer.emulated`: each rank's buffers local, a CUDA stream per rank so their kernels run side by
side), against `cute_ep.reference`: the ring transport's flow control, counts, row placement and
stream positions across many rounds, without NVLink."""

from __future__ import annotations

import pytest
import torch

from tests.multigpu.test_ep import _expert_outputs, _global_scales, _inputs

pytestmark = pytest.mark.gpu


def _layer(bufs, seed, tokens, routing="uniform", weighted=True, skip_a2a=False):
    from cute_ep.reference import ep as reference
    from cute_ep.reference.ep import dispatch_mismatch

    cfg = bufs[0].cfg
    xs, ids, ws = _inputs(cfg, seed, tokens, routing, same_everywhere=skip_a2a)
    gs = _global_scales(cfg, seed)
    streams = [torch.cuda.Stream() for _ in bufs]
    torch.cuda.synchronize()
    outs = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        quant = {} if gs is None else {
            "global_scale": torch.tensor([gs[r]], dtype=torch.float32, device="cuda")}
        with torch.cuda.stream(stream):
            outs.append(buf.dispatch(xs[r], ids[r], ws[r] if weighted else None,
                                     skip_a2a=skip_a2a, **quant))
    torch.cuda.synchronize()
    for buf in bufs:
        buf.check()
    refs = reference.dispatch(cfg, xs, ids, skip_a2a=skip_a2a, global_scales=gs)
    what = f"{cfg.format} R={cfg.ranks} T={tokens} {routing} seed={seed}"
    for r in range(cfg.ranks):
        problem = dispatch_mismatch(cfg, outs[r], refs[r])
        assert problem is None, f"{what}, rank {r}: {problem}"
    ys = [_expert_outputs(cfg, d, d.num_rows, gs) for d in refs]
    torch.cuda.synchronize()  # the ranks' streams read what the default stream just wrote
    combined = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        with torch.cuda.stream(stream):
            combined.append(buf.combine(ys[r].clone(), outs[r].handle))
    torch.cuda.synchronize()
    for buf in bufs:
        buf.check()
    want = reference.combine(cfg, ys, refs, tokens, ws if weighted else None)
    for r in range(cfg.ranks):
        if weighted:
            bound = reference.combine(cfg, [y.abs() for y in ys], refs, tokens,
                                      [w.abs() for w in ws])[r].float() * 2.0 ** -6
            err = (combined[r].float() - want[r].float()).abs()
            assert err.numel() == 0 or (err - bound).max().item() <= 0, \
                f"{what}, rank {r}: combine off by {err.max().item():g}"
        else:
            assert torch.equal(combined[r], want[r]), f"{what}, rank {r}: unreduced combine"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms,hidden", [(2, 8, 2048), (4, 24, 2048), (3, 5, 2048),
                                              (2, 24, 7168), (4, 16, 7168)])
def test_emulated_ranks_match_the_reference_round_after_round(fmt, ranks, sms, hidden):
    """Rings wrap many times per round (up to 1024 tokens a channel of 8-32 slots); 7168 moves
    a bf16 payload in two tiles per warp."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(hidden, 8, 16 * ranks, ranks, 1024, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    seed = 10 * ranks
    for tokens in ([1024] * ranks, [0] * ranks, [1] * ranks,
                   [(0, 1, 300, 1024)[r % 4] for r in range(ranks)]):
        seed += 1
        _layer(bufs, seed, tokens)
    for routing in ("hot", "sparse"):
        seed += 1
        _layer(bufs, seed, [700] * ranks, routing)
    _layer(bufs, seed + 1, [257] * ranks, weighted=False)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_emulated_shared_expert_and_skip_a2a(fmt):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 4, 32, 4, 512, fmt, fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=12)
    _layer(bufs, 1, [512, 3, 0, 200])
    _layer(bufs, 2, [500] * 4, skip_a2a=True)
    _layer(bufs, 3, [512] * 4, routing="hot")
