"""The demo's reference layer (what `cute-ep demo` shows without a GPU and checks the kernels
against on GPUs), against a direct per-token computation that uses no dispatch or combine."""

import torch

from cute_ep.tools import demo
from layouts import EPConfig

SHAPE = demo.Shape(hidden=256, intermediate=128, experts=16, topk=4)


def _direct(x, ids, w, weights, token_rows=None):
    """out[t] = sum_k w[t, k] * mlp_{ids[t, k]}(x[t]), each MLP on the token's row alone."""
    from cute_ep.reference.silu import silu_mul

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    rows = x if token_rows is None else token_rows
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = rows[t:t + 1] @ weights.w13[e].t()
            y = silu_mul(h).to(torch.bfloat16) @ weights.w2[e].t()
            out[t] += float(w[t, k]) * y[0].float()
    return out


def test_the_reference_layer_equals_each_token_through_its_experts():
    ranks, tokens = 4, 6
    weights = demo.ExpertWeights(SHAPE, "cpu", seed=3)
    xs, ids, ws = demo.layer_inputs(SHAPE, ranks, tokens, seed=3, device="cpu")
    cfg = EPConfig(SHAPE.hidden, SHAPE.topk, SHAPE.experts, ranks, tokens, "bf16")
    disp, out, bounds = demo.reference_layer(SHAPE, cfg, xs, ids, ws, weights, None)
    assert sum(int(d.counts.sum()) for d in disp) == ranks * tokens * SHAPE.topk
    for r in range(ranks):
        want = _direct(xs[r], ids[r], ws[r], weights)
        err = (out[r].float() - want).abs()
        # The layer rounds each rank's partial sum and the result to bf16: within the bound.
        assert bool((err <= bounds[r]).all()), float((err - bounds[r]).max())


def test_quantized_formats_feed_the_experts_their_dequantized_rows():
    """FP8 / NVFP4: the layer equals the direct computation on the reference-quantized tokens,
    and differs from the unquantized layer by the format's (small, nonzero) error."""
    from cute_ep.reference.ep import dequantize_fp8_blockwise, quantize_fp8_blockwise
    from cute_ep.reference.fp4 import dequantize_nvfp4, quantize_nvfp4

    ranks, tokens = 2, 5
    weights = demo.ExpertWeights(SHAPE, "cpu", seed=4)
    xs, ids, ws = demo.layer_inputs(SHAPE, ranks, tokens, seed=4, device="cpu")
    base = demo.reference_layer(SHAPE, EPConfig(SHAPE.hidden, SHAPE.topk, SHAPE.experts, ranks,
                                                tokens, "bf16"), xs, ids, ws, weights, None)[1]
    gs = demo.global_scale(xs)
    for fmt, limit in (("fp8", 0.08), ("nvfp4", 0.3)):
        cfg = EPConfig(SHAPE.hidden, SHAPE.topk, SHAPE.experts, ranks, tokens, fmt)
        _, out, bounds = demo.reference_layer(SHAPE, cfg, xs, ids, ws, weights,
                                              gs if fmt == "nvfp4" else None)
        for r in range(ranks):
            if fmt == "fp8":
                q, s = quantize_fp8_blockwise(xs[r])
                rows = dequantize_fp8_blockwise(q, s.t().contiguous())
            else:
                codes, sf = quantize_nvfp4(xs[r], torch.full((tokens,), gs))
                rows = dequantize_nvfp4(codes, sf, torch.full((tokens,), gs))
            want = _direct(xs[r], ids[r], ws[r], weights, rows.to(torch.bfloat16))
            assert bool(((out[r].float() - want).abs() <= bounds[r]).all()), fmt
            rel = float((out[r].float() - base[r].float()).norm() / base[r].float().norm())
            assert 0 < rel < limit, (fmt, rel)


def test_demo_without_a_gpu_runs_the_reference_and_says_so(capsys, monkeypatch):
    monkeypatch.setattr(demo, "_supported_gpus", lambda: [])
    monkeypatch.setattr(demo, "_build_library", lambda console: console.print("(build)"))
    assert demo.main(["--tokens", "4", "--ranks", "2", "--formats", "bf16,nvfp4"]) == 0
    text = capsys.readouterr().out
    assert "No supported GPU is visible" in text and "(build)" in text
    assert "reference layer, emulated ranks" in text and "nvfp4" in text


def test_demo_refuses_unknown_formats():
    import pytest

    with pytest.raises(SystemExit, match="unknown format"):
        demo.main(["--formats", "int4"])
