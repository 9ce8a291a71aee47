"""The gate table (`kernels.gate_table`) against the formula, for every one of the 65536 bf16
gates, bit for bit: the fp32 activation kernel (`fused_silu_fp32`) in its table layout beside
the plain-torch reference of `cute_ep.reference.silu` on the same GPU, and beside the kernel's
own formula layout. Ups are 1 (so `z` is the gate's activation itself) and a spread of values.
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
    params = None
    if limit is not None:
        params = torch.tensor([limit, alpha], dtype=torch.float32, device="cuda")
    _launch("fp32", x, row_offsets, False, out.view(torch.uint8), activation_params=params)
    return out


def _same_bits(got: torch.Tensor, want: torch.Tensor):
    """Equal bit patterns, any NaN equal to any NaN."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(torch.int32) != want.view(torch.int32)) & ~nan
    assert not bad.any(), (f"{int(bad.sum())} differ, first at gate bits "
                           f"{int(bad.nonzero()[0, 1]) + I * int(bad.nonzero()[0, 0] % 16):#06x}")


UPS = torch.tensor([1.0, -3.0, 0.3, 1e-20, 7.5e30, 0.0])


@pytest.mark.parametrize("layout", ["thread", "table"])
def test_silu_of_every_bf16_gate(layout, monkeypatch):
    x = _every_gate(UPS)
    got = _activation(x, layout, monkeypatch)
    _same_bits(got, ref.silu_mul(x))
    if layout == "table":
        _same_bits(got, _activation(x, "thread", monkeypatch))


@pytest.mark.parametrize("limit, alpha", [(7.0, 1.702), (1e30, 1.0), (0.5, 1e-3), (100.0, 60.0),
                                          (7.0, -2.0), (3e38, 1e30)])
@pytest.mark.parametrize("layout", ["thread", "table"])
def test_swiglu_oai_of_every_bf16_gate(layout, limit, alpha, monkeypatch):
    """Limits and alphas that move the clamped gates and the sigmoid's saturation across the
    table's range; gates the table leaves to the formula (outside it, or with a zero value)
    take the formula."""
    x = _every_gate(UPS)
    got = _activation(x, layout, monkeypatch, limit, alpha)
    _same_bits(got, ref.swiglu_oai(x, False, limit, alpha))
