"""On the GPU: the kernels under torch.compile(fullgraph=True) (inductor) and replayed from a CUDA
graph give exactly the eager bytes; dispatch + combine of a one-rank Buffer likewise."""

import pytest
import torch

import cute_ep
from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.gpu


def _block(h, offsets, gs):
    z = cute_ep.fused_silu(h, offsets)
    q, s = cute_ep.quantize_nvfp4(z, gs, offsets)
    q8, s8 = cute_ep.fused_silu_fp8(h, offsets, interleaved=True)
    q4, s4 = cute_ep.fused_silu_mxfp4(h, offsets, swiglu_limit=7.0)
    qn, sn = cute_ep.fused_silu_nvfp4(h, gs, offsets)
    return z, q, s, q8, s8, q4, s4, qn, sn


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(700, 2 * 2048, device="cuda", generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([0, 100, 100, 350, 690], dtype=torch.int32, device="cuda")
    gs = torch.tensor([1.0, 2.0, 0.5, 4.0], device="cuda")
    return h, offsets, gs


def _valid(outs, rows=690, i=2048):
    """What the kernels define: the rows below row_offsets[-1] and the scale bytes of the 128-row
    blocks the segments use (the rest of a scale buffer is never written)."""
    from cute_ep.reference.fp4 import scale_block_bytes, segment_scale_blocks

    z, q, s, q8, s8, q4, s4, qn, sn = outs
    blocks = segment_scale_blocks([0, 100, 100, 350, 690])[-1]
    nv, mx = blocks * scale_block_bytes(i, 16), blocks * scale_block_bytes(i, 32)
    return [z[:rows], q[:rows], s[:nv], q8[:rows], s8[:, :rows], q4[:rows], s4[:mx], qn[:rows],
            sn[:nv]]


def _same(a, b):
    for i, (x, y) in enumerate(zip(_valid(a), _valid(b))):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"output {i} differs"


def test_compiled_and_graph_replayed_kernels_equal_eager():
    h, offsets, gs = _inputs()
    eager = _block(h, offsets, gs)
    torch._dynamo.reset()
    compiled = torch.compile(_block, fullgraph=True)
    _same(compiled(h, offsets, gs), eager)

    compiled(h, offsets, gs)  # warm (modules loaded, compiled) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(h, offsets, gs)
    h2 = torch.randn_like(h.float()).to(torch.bfloat16)
    h.copy_(h2)
    graph.replay()
    torch.cuda.synchronize()
    _same(captured, _block(h2, offsets, gs))


def _layer_compiled(rank, world):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    results = {}
    for fmt in ("bf16", "fp8", "nvfp4"):
        cfg = EPConfig(1024, 4, 16, world, 64, fmt)
        buf = Buffer(cfg, timeout_s=300)  # ranks may finish compiling seconds apart
        gen = torch.Generator(device="cuda").manual_seed(7 + rank)
        x = torch.randn(50, 1024, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(50, 16, device="cuda", generator=gen).argsort(1)[:, :4].int()
        w = torch.rand(50, 4, device="cuda", generator=gen)
        y = torch.randn(cfg.row_capacity, 1024, device="cuda", generator=gen).to(torch.bfloat16)
        quant = {"global_scale": torch.tensor([300.0], device="cuda")} if fmt == "nvfp4" else {}

        layer = _layer(buf, quant)
        eager = layer(x, ids, w, y)
        torch._dynamo.reset()
        got = torch.compile(layer, fullgraph=True)(x, ids, w, y)
        buf.check()
        n = int(eager[1][-1])
        results[fmt] = (torch.equal(got[0][:n].view(torch.uint8), eager[0][:n].view(torch.uint8))
                        and torch.equal(got[1], eager[1]) and torch.equal(got[2][:n], eager[2][:n])
                        and torch.equal(got[3], eager[3]))
    return results


def _layer(buf, quant):
    def layer(x, ids, w, y):
        out = buf.dispatch(x, ids, w, **quant)
        return out.tokens, out.row_offsets, out.src_info, buf.combine(y, out.handle)

    return layer


def test_dispatch_and_combine_compile_as_one_graph():
    for fmt, same in run_ranks(_layer_compiled, world=1, limit_s=300)[0].items():
        assert same, f"{fmt}: the compiled layer differs from eager"
