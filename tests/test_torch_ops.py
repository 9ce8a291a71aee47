"""The torch.library operators: registered, fake implementations give the eager shapes and
dtypes, and calls through the public API trace with torch.compile(fullgraph=True) (meta tensors
on the CPU; the GPU tests run the same on real data)."""

import pytest
import torch

import cute_ep
from layouts.scales import scale_layout, scale_rows_capacity

BF16 = torch.bfloat16


def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_every_operator_is_registered():
    for name in ("fused_silu", "fused_silu_fp8", "fused_silu_nvfp4", "fused_silu_mxfp4",
                 "quantize_nvfp4", "dispatch", "combine"):
        assert hasattr(torch.ops.cute_ep, name), name


@pytest.mark.parametrize("segments", [None, 5])
def test_fake_shapes_match_the_eager_contract(segments):
    m, i = 300, 7168
    x = _meta(m, 2 * i)
    offsets = None if segments is None else _meta(segments + 1, dtype=torch.int32)
    s = 1 if segments is None else segments
    z = torch.ops.cute_ep.fused_silu(x, offsets, False)
    assert (z.shape, z.dtype) == ((m, i), BF16)
    q, sc = torch.ops.cute_ep.fused_silu_fp8(x, offsets, True)
    assert (q.shape, q.dtype, sc.shape, sc.dtype) == ((m, i), torch.float8_e4m3fn,
                                                      (i // 128, m), torch.float32)
    fp4_16 = scale_layout(scale_rows_capacity(m, s), i, 16).cosize()
    fp4_32 = scale_layout(scale_rows_capacity(m, s), i, 32).cosize()
    q, sc = torch.ops.cute_ep.fused_silu_nvfp4(x, _meta(s, dtype=torch.float32), offsets, False,
                                               None)
    assert (q.shape, q.dtype, sc.shape, sc.dtype) == ((m, i // 2), torch.uint8, (fp4_16,),
                                                      torch.uint8)
    q, sc = torch.ops.cute_ep.fused_silu_mxfp4(x, offsets, False, 7.0, 1.702, 4096)
    assert sc.shape == (scale_layout(4096, i, 32).cosize(),) and q.shape == (m, i // 2)
    q, sc = torch.ops.cute_ep.fused_silu_mxfp4(x, offsets, False, None, 1.702, None)
    assert sc.shape == (fp4_32,)
    xq = _meta(m, i)
    q, sc = torch.ops.cute_ep.quantize_nvfp4(xq, _meta(s, dtype=torch.float32), offsets, "linear",
                                             None)
    assert (q.shape, sc.shape) == ((m, i // 2), (m, i // 16))
    q, sc = torch.ops.cute_ep.quantize_nvfp4(xq, _meta(s, dtype=torch.float32), offsets, "128x4",
                                             None)
    assert sc.shape == (fp4_16,)


def test_an_expert_block_compiles_as_one_graph():
    """silu -> NVFP4 quantize, and the fp8 / mxfp4 variants, through the public functions:
    fullgraph=True raises on any graph break (e.g. if a call fell back to its eager body)."""

    def block(h, offsets, gs):
        z = cute_ep.fused_silu(h, offsets)
        q, s = cute_ep.quantize_nvfp4(z, gs, offsets)
        q8, s8 = cute_ep.fused_silu_fp8(h, offsets, interleaved=True)
        q4, s4 = cute_ep.fused_silu_mxfp4(h, offsets, swiglu_limit=7.0)
        qn, sn = cute_ep.fused_silu_nvfp4(h, 2.0, offsets)
        return q, s, q8, s8, q4, s4, qn, sn

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    h = _meta(256, 2 * 1024)
    offsets = _meta(9, dtype=torch.int32)
    outs = compiled(h, offsets, _meta(8, dtype=torch.float32))
    assert outs[0].shape == (256, 512) and outs[2].shape == (256, 1024)
    assert outs[6].shape == (256, 512) and outs[7].dtype == torch.uint8


def test_the_dispatch_operator_needs_a_live_buffer():
    with pytest.raises(ValueError, match="no live cute_ep Buffer has op_id"):
        torch.ops.cute_ep.dispatch(10**9, _meta(4, 128), _meta(4, 2, dtype=torch.int32), None,
                                   False, None, None)
