"""Property-based hostile input (hypothesis). Standalone kernels: every malformed argument gives
a TypeError / ValueError naming it, never a crash or a launch; NaN and infinities anywhere in
the activations, and degenerate global scales, give exactly the reference's bytes. The Buffer
(one rank): any values in x and any T up to the maximum give the reference's bytes, a larger T
the documented error; forbidden expert ids are dropped and reported, never misrouted."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")
from hypothesis import given, settings  # noqa: E402

from cute_ep.reference import fp4  # noqa: E402
from cute_ep.reference import silu as ref  # noqa: E402

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


def _fp8_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """e4m3 bytes equal, a NaN code (S.1111.111) matching any NaN code."""
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan = lambda b: (b & 0x7F) == 0x7F  # noqa: E731
    return bool(torch.equal(nan(g), nan(w)) and torch.equal(torch.where(nan(g), 0, g),
                                                            torch.where(nan(w), 0, w)))


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
    q, sc = cute_ep.fused_silu_fp8(x, o)
    wq, ws = ref.fused_silu_fp8(x, OFFSETS)
    assert _fp8_equal(q[:M], wq[:M])
    sc, ws = sc[:, :M], ws[:, :M]
    assert torch.equal(sc.isnan(), ws.isnan()) and torch.equal(sc.nan_to_num(), ws.nan_to_num())
    rows = fp4.segment_scale_blocks(OFFSETS)[-1] * 128
    q, sc = cute_ep.fused_silu_nvfp4(x, s, o, scale_rows=rows)
    wq, ws = ref.fused_silu_nvfp4(x, OFFSETS, s, rows)
    assert torch.equal(q[:M], wq[:M]) and torch.equal(sc, ws)
    q, sc = cute_ep.fused_silu_mxfp4(x, o, scale_rows=rows)
    wq, ws = ref.fused_silu_mxfp4(x, OFFSETS, rows)
    assert torch.equal(q[:M], wq[:M]) and torch.equal(sc, ws)


SCALES = [1.0, 37.5, 1e-30, 1e30, 0.0, float("inf"), float("nan"), -2.0]


@settings(max_examples=25, deadline=None)
@given(picks=st.lists(st.sampled_from(SCALES), min_size=len(OFFSETS) - 1,
                      max_size=len(OFFSETS) - 1))
def test_degenerate_global_scales_give_the_reference_bytes(picks):
    """Zero, negative, tiny, huge, infinite and NaN per-segment global scales: the same codes and
    scale bytes as the reference's arithmetic (whatever those bytes mean, no other bytes)."""
    import cute_ep

    x, o, _ = _good()
    s = torch.tensor(picks, dtype=torch.float32, device="cuda")
    rows = fp4.segment_scale_blocks(OFFSETS)[-1] * 128
    q, sc = cute_ep.fused_silu_nvfp4(x, s, o, scale_rows=rows)
    wq, ws = ref.fused_silu_nvfp4(x, OFFSETS, s, rows)
    assert torch.equal(q[:M], wq[:M]), picks
    assert torch.equal(sc, ws), picks
    xq = x[:, :I].contiguous()
    q, sc = cute_ep.quantize_nvfp4(xq, s, o, scale_rows=rows)
    wq, ws = fp4.quantize_nvfp4_segments(xq, OFFSETS, s, rows)
    assert torch.equal(q[:M], wq[:M]), picks
    assert torch.equal(sc, ws), picks


# The Buffer on a one-rank group -----------------------------------------------------------------

HIDDEN, TOPK, EXPERTS, MAX_T = 512, 4, 16, 48
VALUES = [float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 1e-40, -0.0]
# Added to a valid int64 id: each sum lies outside int32, and the first two keep the valid id
# as the low word.
WIDE = [2 ** 32, -2 ** 32, 2 ** 31, -2 ** 31 - 1 - EXPERTS, 2 ** 40]


def _buffer_properties(rank, world, examples):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cute_ep.ep import Buffer
    from cute_ep.reference import ep as reference
    from layouts import EPConfig

    bufs = {fmt: Buffer(EPConfig(HIDDEN, TOPK, EXPERTS, 1, MAX_T, fmt))
            for fmt in ("bf16", "fp8", "nvfp4")}

    def inputs(seed, t):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(t, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(t, EXPERTS, device="cuda", generator=gen).argsort(1)[:, :TOPK].int()
        w = torch.rand(t, TOPK, device="cuda", generator=gen)
        return x, ids, w

    def reported(buf):
        """What buf.check() raised of bad input (its ValueError's message), or None."""
        try:
            buf.check()
        except ValueError as exc:
            return str(exc)
        return None

    def identity_sums(combined, x, w, keep):
        """A combine of identity experts (y = the dispatched rows): each token is itself times
        the sum of its kept pairs' weights, within bf16 rounding."""
        want = x.float() * (w * keep).sum(1, keepdim=True)
        err = (combined.float() - want).abs()
        assert (err <= 2 ** -7 * (x.float().abs() * (w * keep).sum(1, keepdim=True)) + 1e-30
                ).all(), float(err.max())

    def same_rows(fmt, out, want):
        """The dispatch output `out` holds the reference's rows `want`, byte for byte."""
        n = want.num_rows
        assert out.row_offsets.tolist() == want.row_offsets.tolist()
        assert torch.equal(out.src_info[:n], want.src_info[:n])
        if fmt == "fp8":
            assert _fp8_equal(out.tokens[:n], want.tokens[:n]), "fp8 codes"
            assert torch.equal(out.scales[:, :n].isnan(), want.scales[:, :n].isnan())
            assert torch.equal(out.scales[:, :n].nan_to_num(), want.scales[:, :n].nan_to_num())
        elif fmt == "nvfp4":
            assert torch.equal(out.tokens[:n], want.tokens[:n]), "nvfp4 codes"
            assert torch.equal(reference.nvfp4_row_scales(out, HIDDEN, n),
                               reference.nvfp4_row_scales(want, HIDDEN, n)), "nvfp4 scales"
        else:
            assert torch.equal(out.tokens[:n].view(torch.int16), want.tokens[:n].view(torch.int16))

    @settings(max_examples=examples, deadline=None, derandomize=True)
    @given(fmt=st.sampled_from(sorted(bufs)), t=st.integers(0, MAX_T + 3),
           seed=st.integers(0, 2 ** 20), gs=st.sampled_from([1.0, 300.0, 1e-20]),
           spots=st.lists(st.tuples(st.integers(0, MAX_T - 1), st.integers(0, HIDDEN - 1),
                                    st.sampled_from(VALUES)), max_size=10))
    def values_and_token_counts(fmt, t, seed, gs, spots):
        """Any T up to max_tokens_per_rank and any values in x: the reference's bytes; beyond
        it, the documented error before anything is launched."""
        buf = bufs[fmt]
        x, ids, w = inputs(seed, t)
        for r, c, v in spots:
            if r < t:
                x[r, c] = v
        quant = {"global_scale": torch.tensor([gs], device="cuda")} if fmt == "nvfp4" else {}
        if t > MAX_T:
            try:
                buf.dispatch(x, ids, w, **quant)
            except ValueError as exc:
                assert f"exceeds max_tokens_per_rank={MAX_T}" in str(exc), str(exc)
                return
            raise AssertionError(f"T={t} > {MAX_T} was accepted")
        out = buf.dispatch(x, ids, w, **quant)
        buf.check()
        same_rows(fmt, out, reference.dispatch(
            buf.cfg, [x], [ids], global_scales=[gs] if fmt == "nvfp4" else None)[0])
        buf.combine(torch.zeros(buf.cfg.row_capacity, HIDDEN, dtype=torch.bfloat16,
                                device="cuda"), out.handle)
        buf.check()

    @settings(max_examples=examples, deadline=None, derandomize=True)
    @given(t=st.integers(1, MAX_T), seed=st.integers(0, 2 ** 20),
           bad=st.lists(st.tuples(st.integers(0, MAX_T - 1), st.integers(0, TOPK - 1),
                                  st.sampled_from(["negative", "too large", "twice"])),
                        max_size=6))
    def forbidden_ids(t, seed, bad):
        """Negative, too-large and repeated expert ids: those (token, k) are dropped from the
        dispatch and its combine and reported once by check(); every other pair is exact."""
        buf = bufs["bf16"]
        x, ids, w = inputs(seed, t)
        for r, k, kind in bad:
            if r < t and kind == "negative":
                ids[r, k] = -2 - k  # -1 is an empty slot, not an error
            elif r < t and kind == "too large":
                ids[r, k] = EXPERTS + k
            elif r < t and k > 0:
                ids[r, k] = ids[r, 0]  # whatever k = 0 holds
        # Kept: valid ids not already listed at an earlier k of the token (the first copy stays).
        keep = torch.tensor([[float(0 <= v < EXPERTS and v not in row[:k])
                              for k, v in enumerate(row)] for row in ids.tolist()],
                            device="cuda").reshape(t, TOPK)
        out = buf.dispatch(x, ids, w)
        combined = buf.combine(out.tokens.clone(), out.handle)  # identity experts
        raised = reported(buf)
        assert (raised is not None) == bool((keep == 0).any()), (raised, keep)
        assert int(out.row_offsets[-1]) == int(keep.sum())
        identity_sums(combined, x, w, keep)
        buf.check()  # reported once: nothing left over for the next call

    @settings(max_examples=examples, deadline=None, derandomize=True)
    @given(fmt=st.sampled_from(sorted(bufs)), t=st.integers(1, MAX_T),
           seed=st.integers(0, 2 ** 20), at_home=st.booleans(),
           wide=st.lists(st.tuples(st.integers(0, MAX_T - 1), st.integers(0, TOPK - 1),
                                   st.sampled_from(WIDE + ["empty"])), max_size=4))
    def wide_ids(fmt, t, seed, at_home, wide):
        """int64 ids (DeepEP's topk_idx dtype): the reference's rows, as for int32 ids. An id
        that int32 cannot hold, though its low word names a valid expert, is out of range: its
        pair is dropped from the dispatch and its combine and reported by check(), never read
        as its low word."""
        buf = bufs[fmt]
        x, ids, w = inputs(seed, t)
        ids = ids.long()
        for r, k, add in wide:
            if r < t and add == "empty":
                ids[r, k] = -1  # an empty slot: its high word all ones, not reported
            elif r < t:
                ids[r, k] += add
        fits = (ids >= -2 ** 31) & (ids < 2 ** 31)
        keep = (ids >= 0).float() * fits  # inputs() gives distinct valid ids: the rest kept
        quant = {"global_scale": torch.tensor([1.0], device="cuda")} if fmt == "nvfp4" else {}
        out = buf.dispatch(x, ids, None if at_home else w, **quant)
        y = out.tokens.clone() if fmt == "bf16" else torch.zeros(
            buf.cfg.row_capacity, HIDDEN, dtype=torch.bfloat16, device="cuda")
        combined = buf.combine(y, out.handle, topk_weights=w if at_home else None)
        raised = reported(buf)
        assert (raised is not None) == bool((~fits).any()), (raised, ids.tolist())
        assert raised is None or f"an expert id outside [0, {EXPERTS})" in raised, raised
        # The reference takes the dropped pairs as empty slots (-1), found from the int64 values.
        same_rows(fmt, out, reference.dispatch(
            buf.cfg, [x], [torch.where(fits, ids, -1).int()],
            global_scales=[1.0] if fmt == "nvfp4" else None)[0])
        if fmt == "bf16":  # identity experts: each token's kept weights times itself
            identity_sums(combined, x, w, keep)
        buf.check()

    values_and_token_counts()
    forbidden_ids()
    wide_ids()
    return True


def test_buffer_takes_any_values_any_token_count_forbidden_and_wide_ids():
    from cute_ep.tools.spawn import run_ranks

    assert run_ranks(_buffer_properties, world=1, examples=40, limit_s=300) == [True]
