"""The gate table (`kernels.gate_table`) against the formula, for every one of the 65536 bf16
gates, bit for bit, in both its forms (the value table of the "table" layout, the pairs of
"pairs"): the fp32 activation kernel (`fused_silu_fp32`) in its table layouts beside
the plain-torch reference of `cute_ep.reference.silu` on the same GPU, and beside the kernel's
own formula layout. Ups are 1 (so `z` is the gate's activation itself) and a spread of values.
Also how the tables are kept: built once per device and activation, readable from any stream,
built inside a CUDA graph that misses them.
"""

import pytest
import torch

from cute_ep.reference import silu as ref

pytestmark = pytest.mark.gpu

I = 4096  # 16 rows of gates hold every bf16 pattern once


def _every_gate(ups: torch.Tensor) -> torch.Tensor:
    """bf16 [16 * len(ups), 2I]: each block of 16 rows holds all 65536 gate patterns, with the
    up of that block."""
    gates = torch.arange(1 << 16, dtype=torch.int32, device="cuda").to(torch.int16)
    gates = gates.view(torch.bfloat16).view(16, I)
    blocks = []
    for up in ups.tolist():
        blocks.append(torch.cat([gates, torch.full((16, I), up, dtype=torch.bfloat16,
                                                   device="cuda")], dim=1))
    return torch.cat(blocks)


def _activation(x, layout, monkeypatch, limit=None, alpha=1.702):
    import cute_ep.silu
    from cute_ep.silu import _launch, _prepare

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: layout)
    row_offsets, _ = _prepare("fp32", x, None)
    out = torch.empty(x.shape[0], I, dtype=torch.float32, device="cuda")
    oai = None if limit is None else (limit, alpha)
    _launch("fp32", x, row_offsets, False, out.view(torch.uint8), swiglu_oai=oai)
    return out


def _same_bits(got: torch.Tensor, want: torch.Tensor):
    """Equal bit patterns, any NaN equal to any NaN."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(torch.int32) != want.view(torch.int32)) & ~nan
    assert not bad.any(), (f"{int(bad.sum())} differ, first at gate bits "
                           f"{int(bad.nonzero()[0, 1]) + I * int(bad.nonzero()[0, 0] % 16):#06x}")


UPS = torch.tensor([1.0, -3.0, 0.3, 1e-20, 7.5e30, 0.0])


@pytest.mark.parametrize("layout", ["thread", "table", "pairs"])
def test_silu_of_every_bf16_gate(layout, monkeypatch):
    x = _every_gate(UPS)
    got = _activation(x, layout, monkeypatch)
    _same_bits(got, ref.silu_mul(x))
    if layout != "thread":
        _same_bits(got, _activation(x, "thread", monkeypatch))


@pytest.mark.parametrize("limit, alpha", [(7.0, 1.702), (1e30, 1.0), (0.5, 1e-3), (100.0, 60.0),
                                          (7.0, -2.0), (3e38, 1e30)])
@pytest.mark.parametrize("layout", ["thread", "table", "pairs"])
def test_swiglu_oai_of_every_bf16_gate(layout, limit, alpha, monkeypatch):
    """Limits and alphas that move the clamped gates and the sigmoid's saturation across the
    table's range; gates the table leaves to the formula (outside it, or with a zero value)
    take the formula."""
    x = _every_gate(UPS)
    got = _activation(x, layout, monkeypatch, limit, alpha)
    _same_bits(got, ref.swiglu_oai(x, False, limit, alpha))


# The tables' layout in bf16 gate bits: magnitudes LOW_T16..HIGH_T16, both signs.
LOW_T16, HIGH_T16 = 0x32FF, 0x4300
PER_SIGN = HIGH_T16 - LOW_T16 + 1
ENTRIES = 2 * PER_SIGN
SPLIT_PER_SIGN = (PER_SIGN + 3) // 4 * 4  # each sign's values padded to 16 bytes


@pytest.mark.parametrize("limit, alpha", [(7.0, 1.702), (0.5, 1e-3)])
def test_split_values_are_the_values_by_sign(limit, alpha):
    """The split value table (after the pairs and the values: the positive gates' values by
    magnitude, then the negative ones', each padded with NaN to 16 bytes) holds the value
    table's entries bit for bit."""
    from cute_ep.silu import _gate_inputs

    _, table = _gate_inputs(torch.device("cuda", torch.cuda.current_device()), (limit, alpha))
    assert table.numel() == 3 * ENTRIES + 2 * SPLIT_PER_SIGN
    values = table[2 * ENTRIES:3 * ENTRIES].view(PER_SIGN, 2).t()  # entry 2 j + sign
    split = table[3 * ENTRIES:].view(2, SPLIT_PER_SIGN)
    _same_bits(split[:, :PER_SIGN].contiguous(), values.contiguous())
    assert torch.isnan(split[:, PER_SIGN:]).all()


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """Halves [g | u] -> interleaved (g_i, u_i) pairs."""
    g, u = x.chunk(2, dim=1)
    return torch.stack([g, u], dim=2).reshape(x.shape)


@pytest.mark.parametrize("limit, alpha", [(7.0, 1.702), (1e30, 1.0), (0.5, 1e-3), (100.0, 60.0),
                                          (7.0, -2.0)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_swiglu_oai_mxfp4_stream_of_every_bf16_gate(interleaved, limit, alpha, monkeypatch):
    """The MXFP4 table stream (its gates looked up in pairs in the split table) for every bf16
    gate against the reference's codes and scales."""
    import cute_ep.silu
    from cute_ep.silu import fused_silu_mxfp4

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: "table")
    x = _every_gate(UPS)
    if interleaved:
        x = _interleave(x)
    m = x.shape[0]
    offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
    codes, scales = fused_silu_mxfp4(x, offsets, interleaved=interleaved, swiglu_limit=limit,
                                     swiglu_alpha=alpha)
    want_codes, want_scales = ref.fused_silu_mxfp4(x, [0, m], m + 128, interleaved, limit, alpha)
    used = -(-m // 128) * 128 * (I // 32)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales[:used], want_scales[:used])


def test_tables_are_built_once_and_read_from_any_stream(monkeypatch):
    """A second call finds the same tensors (no rebuild); a call on another stream, right after
    the first build of a new activation, is exact."""
    import cute_ep.silu
    from cute_ep.silu import _gate_inputs, fused_silu_mxfp4

    device = torch.device("cuda", torch.cuda.current_device())
    first = _gate_inputs(device, (5.5, 1.25))
    again = _gate_inputs(device, (5.5, 1.25))
    assert first[0] is again[0] and first[1] is again[1]
    assert torch.equal(first[0].cpu(), torch.tensor([5.5, 1.25]))
    assert _gate_inputs(device, (5.5, 1.5))[1] is not first[1]

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: "table")
    x = _every_gate(UPS[:2])
    offsets = torch.tensor([0, x.shape[0]], dtype=torch.int32, device="cuda")
    want = fused_silu_mxfp4(x, offsets, swiglu_limit=6.5, swiglu_alpha=1.125)
    side = torch.cuda.Stream()
    cute_ep.silu._GATES.pop((device.index, (3.25, 0.75)), None)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = fused_silu_mxfp4(x, offsets, swiglu_limit=3.25, swiglu_alpha=0.75)
        same = fused_silu_mxfp4(x, offsets, swiglu_limit=6.5, swiglu_alpha=1.125)
    torch.cuda.current_stream().wait_stream(side)
    codes, scales = ref.fused_silu_mxfp4(x, [0, x.shape[0]], x.shape[0] + 128, False, 3.25, 0.75)
    used = 128 * (I // 32)  # one 128-row block of e8m0 scales holds the 32 rows
    assert torch.equal(got[0], codes) and torch.equal(got[1][:used], scales[:used])
    assert torch.equal(same[0], want[0]) and torch.equal(same[1][:used], want[1][:used])


def test_a_graph_that_misses_the_table_builds_its_own(monkeypatch):
    """Captured with an activation no call has used yet: the graph builds the table itself (the
    cache keeps nothing made inside the capture) and its replays are exact."""
    import cute_ep.silu
    from cute_ep.silu import fused_silu_mxfp4

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: "table")
    x = _every_gate(UPS[:2])
    offsets = torch.tensor([0, x.shape[0]], dtype=torch.int32, device="cuda")
    key = (x.device.index, (2.75, 3.5))
    cute_ep.silu._GATES.pop(key, None)
    fused_silu_mxfp4(x, offsets, swiglu_limit=1.0)  # modules loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes, scales = fused_silu_mxfp4(x, offsets, swiglu_limit=2.75, swiglu_alpha=3.5)
    assert key not in cute_ep.silu._GATES
    want_codes, want_scales = ref.fused_silu_mxfp4(x, [0, x.shape[0]], x.shape[0] + 128, False,
                                                   2.75, 3.5)
    used = 128 * (I // 32)  # one 128-row block of e8m0 scales holds the 32 rows
    for _ in range(2):
        codes.zero_()
        scales.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(codes, want_codes)
        assert torch.equal(scales[:used], want_scales[:used])
