"""Property-based hostile input for the standalone kernels (hypothesis): every malformed
argument gives a TypeError / ValueError naming it, never a crash or a launch; NaN and infinities
anywhere in the activations give exactly the reference's documented bytes."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")
from hypothesis import given, settings  # noqa: E402

from cute_ep import reference_fp4 as fp4  # noqa: E402
from cute_ep import reference_silu as ref  # noqa: E402

pytestmark = pytest.mark.gpu

M, I = 200, 256
OFFSETS = [0, 50, 50, 130, 200]


def _good():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(M, 2 * I, device="cuda", generator=gen).to(torch.bfloat16)
    offsets = torch.tensor(OFFSETS, dtype=torch.int32, device="cuda")
    scales = torch.ones(len(OFFSETS) - 1, device="cuda")
    return x, offsets, scales


def _calls():
    import cute_ep

    return {
        "fused_silu": lambda x, o, s: cute_ep.fused_silu(x, o),
        "fused_silu_fp8": lambda x, o, s: cute_ep.fused_silu_fp8(x, o),
        "fused_silu_nvfp4": lambda x, o, s: cute_ep.fused_silu_nvfp4(x, s, o),
        "fused_silu_mxfp4": lambda x, o, s: cute_ep.fused_silu_mxfp4(x, o),
        "quantize_nvfp4": lambda x, o, s: cute_ep.quantize_nvfp4(x, s, o),  # x [M, I]
    }


# (argument, mutation, words the error must contain): each keeps the others valid.
MUTATIONS = {
    "x float32": ("x", lambda t: t.float(), "x"),
    "x float16": ("x", lambda t: t.half(), "x"),
    "x on the CPU": ("x", lambda t: t.cpu(), "CUDA"),
    "x transposed": ("x", lambda t: t.t(), "x"),
    "x strided": ("x", lambda t: t[:, ::2], "contiguous"),
    "x misaligned": ("x", lambda t: t.flatten()[1:1 + t.numel() - t.shape[1]].view(
        -1, t.shape[1]), "x"),
    "x 1-D": ("x", lambda t: t.flatten(), "x"),
    "x odd width": ("x", lambda t: t[:, :t.shape[1] - 2].contiguous(), "x"),
    "offsets int64": ("o", lambda t: t.long(), "row_offsets"),
    "offsets 2-D": ("o", lambda t: t.view(1, -1), "row_offsets"),
    "offsets one entry": ("o", lambda t: t[:1].contiguous(), "row_offsets"),
    "offsets on the CPU": ("o", lambda t: t.cpu(), "CUDA"),
    "scales float64": ("s", lambda t: t.double(), "scales"),
    "scales too few": ("s", lambda t: t[:2].contiguous(), "scales"),
}


@settings(max_examples=60, deadline=None)
@given(call=st.sampled_from(sorted(_calls())), mutation=st.sampled_from(sorted(MUTATIONS)))
def test_malformed_arguments_are_refused_by_name(call, mutation):
    x, o, s = _good()
    if call == "quantize_nvfp4":
        x = x[:, :I].contiguous()  # quantize takes [M, K]
    arg, change, words = MUTATIONS[mutation]
    if arg == "s" and "nvfp4" not in call:
        return  # only the NVFP4 calls take per-segment scales
    args = {"x": x, "o": o, "s": s}
    args[arg] = change(args[arg])
    with pytest.raises((TypeError, ValueError)) as info:
        _calls()[call](args["x"], args["o"], args["s"])
        torch.cuda.synchronize()
    assert words.lower() in str(info.value).lower(), (call, mutation, str(info.value))


@settings(max_examples=25, deadline=None)
@given(spots=st.lists(st.tuples(st.integers(0, M - 1), st.integers(0, 2 * I - 1),
                                st.sampled_from([float("nan"), float("inf"), float("-inf"),
                                                 3e38, -0.0])), min_size=1, max_size=12))
def test_nan_and_inf_give_the_documented_bytes(spots):
    import cute_ep

    x, o, s = _good()
    for r, c, v in spots:
        x[r, c] = v
    z, want = cute_ep.fused_silu(x, o)[:M], ref.fused_silu(x, OFFSETS)
    # NaN payloads may differ between conversions; NaN where the reference has NaN, the same
    # bits everywhere else.
    assert torch.equal(z.isnan(), want.isnan())
    assert torch.equal(torch.where(z.isnan(), 0, z.view(torch.int16)),
                       torch.where(want.isnan(), 0, want.view(torch.int16)))
    rows = fp4.segment_scale_blocks(OFFSETS)[-1] * 128
    q, sc = cute_ep.fused_silu_nvfp4(x, s, o, scale_rows=rows)
    wq, ws = ref.fused_silu_nvfp4(x, OFFSETS, s, rows)
    assert torch.equal(q[:M], wq[:M]) and torch.equal(sc, ws)
    q, sc = cute_ep.fused_silu_mxfp4(x, o, scale_rows=rows)
    wq, ws = ref.fused_silu_mxfp4(x, OFFSETS, rows)
    assert torch.equal(q[:M], wq[:M]) and torch.equal(sc, ws)
