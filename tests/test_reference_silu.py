"""The fused SwiGLU reference on the CPU: the activation, the input views, the outputs."""

import math

import pytest
import torch

from cute_ep.reference import fp4
from cute_ep.reference import silu as ref


def _x(m, i, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 2 * i, generator=gen) * 3).to(torch.bfloat16)


def test_silu_mul_is_silu_of_gate_times_up():
    x = _x(7, 48)
    z = ref.silu_mul(x)
    xd = x.double()
    g, u = xd[:, :48], xd[:, 48:]
    exact = g / (1 + torch.exp(-g)) * u
    assert torch.allclose(z.double(), exact, rtol=4 * 2.0 ** -24, atol=1e-30)


def test_interleaved_is_the_same_activation_with_gate_and_up_alternating():
    x = _x(5, 64)
    inter = torch.stack([x[:, :64], x[:, 64:]], dim=-1).reshape(5, 128)
    assert torch.equal(ref.silu_mul(inter, interleaved=True), ref.silu_mul(x))
    assert torch.equal(ref.swiglu_oai(inter, True, 2.0, 1.5), ref.swiglu_oai(x, False, 2.0, 1.5))


def test_swiglu_oai_clamps_gate_above_and_up_both_ways():
    x = torch.tensor([[10.0, -10.0, 0.5, 10.0, -10.0, 0.25]], dtype=torch.bfloat16)
    z = ref.swiglu_oai(x, limit=7.0, alpha=1.702)
    g = [7.0, -10.0, 0.5]  # the gate is clamped from above only
    u = [7.0, -7.0, 0.25]
    for j in range(3):
        want = (u[j] + 1) * g[j] / (1 + math.exp(-1.702 * g[j]))
        assert z[0, j].item() == pytest.approx(want, rel=1e-6)


def test_only_valid_rows_and_transposed_fp8_scales():
    x = _x(10, 256)
    q, scales = ref.fused_silu_fp8(x, [0, 3, 3, 6])
    assert q.shape == (6, 256) and scales.shape == (2, 6)
    z = ref.silu_mul(x[:6])
    amax = z.reshape(6, 2, 128).abs().amax(-1)
    assert torch.equal(scales.t(), torch.clamp(amax, min=1e-4) / torch.full_like(amax, 448.0))
    assert ref.fused_silu(x, [0, 4]).shape == (4, 256)


def test_nvfp4_output_quantizes_each_segment_with_its_global_scale():
    x = _x(140, 32)
    offsets = [0, 130, 130, 140]
    gs = torch.tensor([2.0, 5.0, 0.25])
    codes, scales = ref.fused_silu_nvfp4(x, offsets, gs, 140 + 3 * 128)
    z = ref.silu_mul(x[:140])
    for lo, hi, g in ((0, 130, 2.0), (130, 140, 0.25)):
        want, _ = fp4.quantize_nvfp4(z[lo:hi], torch.full((hi - lo,), g))
        assert torch.equal(codes[lo:hi], want)
    # Segment 2 (rows 130..139) starts on the fresh block at scale row 256.
    first = fp4.segment_scale_blocks(offsets)
    assert first == [0, 2, 2, 3]
    _, linear = fp4.quantize_nvfp4(z[130:], torch.full((10,), 0.25))
    at = fp4._scale_offsets(torch.arange(256, 266), torch.arange(2), 32)
    assert torch.equal(scales[at.flatten()], linear.flatten())


def test_mxfp4_output_with_the_clamped_activation():
    x = _x(33, 64, seed=4) * 4
    codes, scales = ref.fused_silu_mxfp4(x, [0, 33], 33 + 128, swiglu_limit=7.0)
    z = ref.swiglu_oai(x, False, 7.0, 1.702)
    want, _ = fp4.quantize_mxfp4(z)
    assert torch.equal(codes, want)
    assert z.max() <= (7.0 + 1) * 7.0  # both clamps bound the output
