"""`cute-ep demo`: one DeepSeek-V3-shaped MoE layer, end to end, checked against the reference.

On every visible Hopper / Blackwell GPU (one process each): route random tokens top-8 over 256
experts, `Buffer.dispatch` them (BF16, FP8, NVFP4), run each local expert's SwiGLU MLP in torch
(grouped by `row_offsets`, `cute_ep.silu.fused_silu` between the two GEMMs), `Buffer.combine` the
outputs, and check both halves against `cute_ep.reference`, which every rank recomputes for all
ranks from the same seeds in plain torch: the dispatched rows byte for byte, the combined layer
output within the bf16 rounding bound.

With no supported GPU it says so, builds the kernel library (if the DSL is installed), and runs
the same layer through the reference alone with emulated ranks, at 1/8 of the width so a laptop
CPU finishes in seconds.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

FORMATS = ("bf16", "fp8", "nvfp4")


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    experts: int
    topk: int


DEEPSEEK_V3 = Shape(hidden=7168, intermediate=2048, experts=256, topk=8)
CPU_SHAPE = Shape(hidden=896, intermediate=256, experts=256, topk=8)  # 1/8 of the width


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cute-ep demo", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank (default 256 on GPUs, 32 emulated)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    p.add_argument("--ranks", type=int, default=4, help="emulated ranks without a GPU")
    p.add_argument("--cpu", action="store_true",
                   help="run the emulated reference even if GPUs are visible")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    from rich.console import Console

    args = parser().parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise SystemExit(f"unknown format(s) {bad}; choose from {', '.join(FORMATS)}")
    console = Console()
    gpus = _supported_gpus()
    if gpus and not args.cpu:
        tokens = args.tokens or 256
        return _on_gpus(console, len(gpus), tokens, formats, args.seed)
    if not gpus:
        console.print("[yellow]No supported GPU is visible[/] (cute-ep runs on Hopper sm_90 and "
                      "Blackwell sm_100). Building the kernel library, then running the same "
                      "layer through the plain-torch reference with emulated ranks.")
        _build_library(console)
    tokens = args.tokens or 32
    if args.ranks < 1 or CPU_SHAPE.experts % args.ranks:
        raise SystemExit(f"--ranks must divide {CPU_SHAPE.experts}")
    return _emulated(console, args.ranks, tokens, formats, args.seed)


# The layer, shared by the kernel path and the reference --------------------------------------


class ExpertWeights:
    """Every expert's SwiGLU MLP, from one seed (the same values on every rank and device):
    w13 [E, 2I, H] ([gate | up] rows) and w2 [E, H, I], bf16, scaled for unit-size outputs."""

    def __init__(self, shape: Shape, device, seed: int):
        gen = torch.Generator(device=device).manual_seed(10_000 + seed)
        h, i, e = shape.hidden, shape.intermediate, shape.experts
        self.w13 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16)
        self.w13 /= h ** 0.5
        self.w2 = torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16)
        self.w2 /= i ** 0.5


def layer_inputs(shape: Shape, ranks: int, tokens: int, seed: int, device):
    """Every rank's (x bf16 [T, H], topk_ids int32 [T, K], topk_weights fp32 [T, K]): softmax
    router probabilities over random logits, top-K, renormalised."""
    xs, ids, ws = [], [], []
    for r in range(ranks):
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + r)
        xs.append(torch.randn(tokens, shape.hidden, generator=gen, device=device)
                  .to(torch.bfloat16))
        probs = torch.randn(tokens, shape.experts, generator=gen, device=device).softmax(-1)
        w, i = probs.topk(shape.topk, dim=-1)
        ids.append(i.to(torch.int32))
        ws.append((w / w.sum(-1, keepdim=True)).float())
    return xs, ids, ws


def global_scale(xs) -> float:
    """One NVFP4 global scale for the layer: the largest |x| maps to e4m3 max x e2m1 max."""
    amax = max(float(x.float().abs().max()) for x in xs)
    return 448.0 * 6.0 / amax


def dispatched_inputs(cfg, out, gs: float | None) -> torch.Tensor:
    """The dispatched rows as bf16 [rows, H], dequantized (FP8: blockwise scales; NVFP4: the
    128x4 scales of each expert's blocks, under the global scale)."""
    from cute_ep.reference.ep import dequantize_fp8_blockwise, nvfp4_row_scales
    from cute_ep.reference.fp4 import dequantize_nvfp4

    n = int(out.row_offsets[-1])
    if cfg.format == "bf16":
        return out.tokens[:n]
    if cfg.format == "fp8":
        return dequantize_fp8_blockwise(out.tokens[:n], out.scales).to(torch.bfloat16)
    linear = nvfp4_row_scales(out, cfg.hidden, n)
    gsv = torch.full((n,), gs, dtype=torch.float32, device=out.tokens.device)
    return dequantize_nvfp4(out.tokens[:n], linear, gsv).to(torch.bfloat16)


def expert_outputs(shape: Shape, rank: int, ranks: int, x_rows: torch.Tensor,
                   row_offsets: torch.Tensor, capacity: int, weights: ExpertWeights,
                   activation) -> torch.Tensor:
    """bf16 [capacity, H]: rows of segment g through local expert g's MLP
    (`activation(h, row_offsets)` = silu(gate) * up between the GEMMs); rows past the valid
    ones zero."""
    offsets = [int(v) for v in row_offsets.tolist()]
    local = shape.experts // ranks
    dev = x_rows.device
    h = torch.zeros(capacity, 2 * shape.intermediate, dtype=torch.bfloat16, device=dev)
    for g in range(local):
        lo, hi = offsets[g], offsets[g + 1]
        if hi > lo:
            h[lo:hi] = x_rows[lo:hi] @ weights.w13[rank * local + g].t()
    z = activation(h, row_offsets)
    y = torch.zeros(capacity, shape.hidden, dtype=torch.bfloat16, device=dev)
    for g in range(local):
        lo, hi = offsets[g], offsets[g + 1]
        if hi > lo:
            y[lo:hi] = z[lo:hi] @ weights.w2[rank * local + g].t()
    return y


def reference_layer(shape: Shape, cfg, xs, ids, ws, weights: ExpertWeights, gs):
    """Every rank's dispatch output and combined layer output, plus the per-element bound
    2^-7 x sum_k |w_k y_k| (bf16 rounding of the partial sums and of the result), in plain
    torch."""
    from cute_ep.reference import ep as reference
    from cute_ep.reference import silu as reference_silu

    disp = reference.dispatch(cfg, xs, ids, global_scales=[gs] * cfg.ranks if gs else None)
    ys = []
    for r, d in enumerate(disp):
        x_rows = dispatched_inputs(cfg, d, gs)
        ys.append(expert_outputs(shape, r, cfg.ranks, x_rows, d.row_offsets, cfg.row_capacity,
                                 weights, lambda h, o: _reference_silu(reference_silu, h, o)))
    tokens = [x.shape[0] for x in xs]
    out = reference.combine(cfg, ys, disp, tokens, ws)
    mags = reference.combine(cfg, [y.abs() for y in ys], disp, tokens, [w.abs() for w in ws])
    bounds = [2.0 ** -7 * m.float() + 1e-6 for m in mags]
    return disp, out, bounds


def _reference_silu(reference_silu, h, row_offsets):
    offsets = [int(v) for v in row_offsets.tolist()]
    z = torch.zeros(h.shape[0], h.shape[1] // 2, dtype=torch.bfloat16, device=h.device)
    z[:offsets[-1]] = reference_silu.fused_silu(h, offsets)[:offsets[-1]]
    return z


# On GPUs -------------------------------------------------------------------------------------


def _on_gpus(console, world, tokens, formats, seed) -> int:
    from cute_ep.tools.spawn import RanksFailed, run_ranks

    console.print(f"cute-ep demo: {world} GPU(s), one process each; DeepSeek-V3 MoE layer "
                  f"(H={DEEPSEEK_V3.hidden}, I={DEEPSEEK_V3.intermediate}, "
                  f"E={DEEPSEEK_V3.experts}, top-{DEEPSEEK_V3.topk}), {tokens} tokens per rank")
    try:
        ranks = run_ranks(_rank_layers, world, limit_s=600, tokens=tokens, formats=formats,
                          seed=seed)
    except RanksFailed as exc:
        console.print(f"[red]demo failed[/]\n{exc}")
        return 1
    rows = []
    for i, fmt in enumerate(formats):
        per = [r[i] for r in ranks]
        rows.append({
            "format": fmt, "ranks": world, "tokens": tokens,
            "received": sum(p["rows"] for p in per),
            "dispatch_equal": all(p["dispatch_equal"] for p in per),
            "err": max(p["err"] for p in per), "within": all(p["within"] for p in per),
            "dispatch_us": max(p["dispatch_us"] for p in per),
            "experts_us": max(p["experts_us"] for p in per),
            "combine_us": max(p["combine_us"] for p in per),
        })
    _print_table(console, rows, kernels=True)
    return 0 if all(r["dispatch_equal"] and r["within"] for r in rows) else 1


def _rank_layers(rank, world, tokens, formats, seed) -> list[dict]:
    from cute_ep.ep import Buffer
    from cute_ep.reference import ep as reference
    from cute_ep.silu import fused_silu
    from layouts import EPConfig

    shape, dev = DEEPSEEK_V3, torch.device("cuda", rank)
    weights = ExpertWeights(shape, dev, seed)
    xs, ids, ws = layer_inputs(shape, world, tokens, seed, dev)
    results = []
    for fmt in formats:
        cfg = EPConfig(shape.hidden, shape.topk, shape.experts, world, tokens, fmt)
        buf = Buffer(cfg)
        gs = global_scale(xs) if fmt == "nvfp4" else None
        quant = {"global_scale": torch.tensor([gs], device=dev)} if gs else {}

        def layer(buf):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            ev[0].record()
            out = buf.dispatch(xs[rank], ids[rank], ws[rank], **quant)
            ev[1].record()
            x_rows = dispatched_inputs(cfg, out, gs)
            y = expert_outputs(shape, rank, world, x_rows, out.row_offsets, cfg.row_capacity,
                               weights, lambda h, o: fused_silu(h, o))
            ev[2].record()
            combined = buf.combine(y, out.handle)
            ev[3].record()
            ev[3].synchronize()
            buf.check()
            return out, combined, [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(3)]

        layer(buf)  # loads the kernels' modules
        torch.distributed.barrier()
        out, combined, times = layer(buf)
        disp, ref_out, bounds = reference_layer(shape, cfg, xs, ids, ws, weights, gs)
        err = (combined.float() - ref_out[rank].float()).abs()
        results.append({
            "rows": int(out.counts.sum()),
            "dispatch_equal": reference.dispatch_mismatch(cfg, out, disp[rank]) is None,
            "err": float(err.max()) if err.numel() else 0.0,
            "within": bool((err <= bounds[rank]).all()),
            "dispatch_us": times[0], "experts_us": times[1], "combine_us": times[2],
        })
        del buf
    return results


# Without a GPU -------------------------------------------------------------------------------


def _emulated(console, ranks, tokens, formats, seed) -> int:
    from layouts import EPConfig

    shape = CPU_SHAPE
    console.print(f"cute-ep demo (reference only): {ranks} emulated ranks on the CPU; a "
                  f"DeepSeek-V3-shaped layer at 1/8 width (H={shape.hidden}, "
                  f"I={shape.intermediate}, E={shape.experts}, top-{shape.topk}), {tokens} "
                  f"tokens per rank")
    weights = ExpertWeights(shape, "cpu", seed)
    xs, ids, ws = layer_inputs(shape, ranks, tokens, seed, "cpu")
    rows, unquantized = [], None
    for fmt in ["bf16"] + [f for f in formats if f != "bf16"]:
        cfg = EPConfig(shape.hidden, shape.topk, shape.experts, ranks, tokens, fmt)
        gs = global_scale(xs) if fmt == "nvfp4" else None
        start = time.perf_counter()
        disp, out, _ = reference_layer(shape, cfg, xs, ids, ws, weights, gs)
        seconds = time.perf_counter() - start
        if fmt == "bf16":
            unquantized = out  # what the token format's quantization is measured against
        rel = max(float((o.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))
                  for o, b in zip(out, unquantized))
        if fmt in formats:
            rows.append({"format": fmt, "ranks": ranks, "tokens": tokens,
                         "received": sum(int(d.counts.sum()) for d in disp),
                         "per_rank": [int(d.counts.sum()) for d in disp], "rel_vs_bf16": rel,
                         "seconds": seconds})
    _print_table(console, rows, kernels=False)
    console.print("Data flow: each rank sends a token once to every rank hosting one of its "
                  "experts; the receiver expands it into one row per local expert, grouped by "
                  "expert (row_offsets), then by source rank and token; the experts' outputs "
                  "return as one weighted partial sum per (token, rank) and are added at home. "
                  "On GPUs `cute-ep demo` runs the kernels and checks them against this reference.")
    return 0


def _print_table(console, rows, kernels: bool) -> None:
    from rich.table import Table

    if kernels:
        t = Table(title="cute-ep kernels vs the plain-torch reference (slowest rank's times)")
        for col in ("format", "ranks", "tokens/rank", "rows received", "dispatch == reference",
                    "layer max |err|", "within bf16 bound", "dispatch us", "experts us",
                    "combine us"):
            t.add_column(col, justify="left" if col == "format" else "right")
        for r in rows:
            t.add_row(r["format"], str(r["ranks"]), str(r["tokens"]), str(r["received"]),
                      "[green]byte-exact[/]" if r["dispatch_equal"] else "[red]DIFFERS[/]",
                      f"{r['err']:.3g}", "[green]yes[/]" if r["within"] else "[red]NO[/]",
                      f"{r['dispatch_us']:.0f}", f"{r['experts_us']:.0f}",
                      f"{r['combine_us']:.0f}")
        console.print(t)
        console.print("dispatch == reference: rows, offsets, src_info and scales byte for byte; "
                      "layer: combine output vs the reference layer, element-wise within "
                      "2^-7 x sum_k |w_k y_k|. Times: one layer after a warm-up, host launch "
                      "included (`cute-ep bench` measures properly).")
    else:
        t = Table(title="reference layer, emulated ranks (no kernels ran)")
        for col in ("format", "ranks", "tokens/rank", "rows received (per rank)",
                    "rel. error vs unquantized", "seconds"):
            t.add_column(col, justify="left" if col == "format" else "right")
        for r in rows:
            t.add_row(r["format"], str(r["ranks"]), str(r["tokens"]),
                      f"{r['received']} ({', '.join(map(str, r['per_rank']))})",
                      f"{r['rel_vs_bf16']:.2e}", f"{r['seconds']:.2f}")
        console.print(t)


def _supported_gpus() -> list[int]:
    from cute_ep.runtime.launch import ARCH_OF_CAPABILITY

    if not torch.cuda.is_available():
        return []
    return [i for i in range(torch.cuda.device_count())
            if torch.cuda.get_device_capability(i) in ARCH_OF_CAPABILITY]


def _build_library(console) -> None:
    try:
        from kernels.build import build
        from kernels.matrix import full_matrix
    except ImportError as exc:
        console.print(f"(the CuTe DSL is not installed, so the library is not built here: {exc})")
        return
    from cute_ep.runtime.library import library_dir

    out = library_dir(None)
    report = build(full_matrix(), out, progress=True)
    console.print(f"kernel library at {out}: {report.count('built')} built, "
                  f"{report.count('unchanged')} unchanged, {report.count('failed')} failed "
                  f"(sm_90a and sm_100a cubins; `cute-ep info` lists them)")


if __name__ == "__main__":
    raise SystemExit(main())
