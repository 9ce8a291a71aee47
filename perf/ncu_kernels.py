"""Launch every kernel the performance targets name once, at the target sizes, on one GPU, for
Nsight Compute to profile:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        -k regex:'FusedSilu|QuantizeNvfp4|kernelsepEp' python perf/ncu_kernels.py

- the fused SwiGLU family (bf16, FP8, NVFP4 with both input layouts, MXFP4 with both
  activations; `SILU_LAUNCHES`) and `quantize_nvfp4` at M=8192, I=7168 over 8 experts (the
  kernel targets' shape);
- one dispatch + combine per format through a one-rank `Buffer` with the throughput shape's
  per-rank load (4096 tokens, H=7168, K=8, 64 local experts): the receive expansion and the
  combine's weighted sums do the same HBM work as on each of 4 ranks; only the NVLink leg is
  local instead. (Kernels that spin on peers cannot be replayed by a profiler across processes.)

`--silu-only` skips the EP layer; `--layout thread,table` launches the SwiGLU family once per
layout named (`cute_ep.silu._layout`; default: the one chosen by size).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

# The kernels `silu_kernels` launches, in order, once per layout (`perf/compare_libraries.py`
# names Nsight Compute's launches by this list).
SILU_LAUNCHES = ("fused_silu", "fused_silu_fp8", "fused_silu_nvfp4",
                 "fused_silu_nvfp4 interleaved", "fused_silu_mxfp4",
                 "fused_silu_mxfp4 swiglu_oai")
QUANTIZE_LAUNCH = "quantize_nvfp4"


def silu_kernels(rows: int, i: int, experts: int, layouts=(None,)) -> None:
    from cute_ep.quant import quantize_nvfp4
    from cute_ep.silu import fused_silu, fused_silu_fp8, fused_silu_mxfp4, fused_silu_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2 * i, device="cuda", generator=gen).to(torch.bfloat16)
    offsets = torch.linspace(0, rows, experts + 1, device="cuda").round().to(torch.int32)
    gs = torch.ones(experts, device="cuda")
    import cute_ep.silu

    by_size = cute_ep.silu._layout
    for layout in layouts:
        cute_ep.silu._layout = by_size if layout is None else (lambda rows, sms: layout)
        fused_silu(x, offsets)
        fused_silu_fp8(x, offsets)
        fused_silu_nvfp4(x, gs, offsets)
        fused_silu_nvfp4(x, gs, offsets, interleaved=True)
        fused_silu_mxfp4(x, offsets)
        fused_silu_mxfp4(x, offsets, swiglu_limit=7.0)
    cute_ep.silu._layout = by_size
    quantize_nvfp4(x[:, :i].contiguous(), gs, offsets)
    torch.cuda.synchronize()


def ep_layer(tokens: int, hidden: int, topk: int, local_experts: int) -> None:
    import torch.distributed as dist

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            gen = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            ids = torch.rand(tokens, local_experts, device="cuda",
                             generator=gen).argsort(1)[:, :topk].to(torch.int32)
            w = torch.rand(tokens, topk, device="cuda", generator=gen)
            for fmt in ("bf16", "fp8", "nvfp4"):
                buf = Buffer(EPConfig(hidden, topk, local_experts, 1, tokens, fmt))
                y = torch.randn(buf.cfg.row_capacity, hidden, device="cuda",
                                generator=gen).to(torch.bfloat16)
                quant = {"global_scale": torch.tensor([1000.0], device="cuda")} \
                    if fmt == "nvfp4" else {}
                out = buf.dispatch(x, ids, w, **quant)
                buf.combine(y, out.handle)
                buf.check()
                del buf
        finally:
            dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--silu-only", action="store_true")
    p.add_argument("--layout", help="comma-separated SwiGLU layouts: thread, warp, table")
    args = p.parse_args()
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"})
    torch.cuda.set_device(0)
    silu_kernels(args.rows, args.intermediate, 8,
                 tuple(args.layout.split(",")) if args.layout else (None,))
    if not args.silu_only:
        ep_layer(args.tokens, args.hidden, 8, 64)


if __name__ == "__main__":
    main()
