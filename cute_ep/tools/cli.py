"""`cute-ep`: the command line (the demo, build the kernel library, inspect it, benchmark,
plot a record)."""

from __future__ import annotations

import argparse
import sys


def _build(argv) -> int:
    try:
        from kernels.build import main as build_main
    except ImportError as exc:
        print(f"cute-ep build needs the CuTe DSL ({exc}); install it with "
              "`pip install 'cute-ep[build]'`", file=sys.stderr)
        return 2
    return build_main(argv)


def _info(argv) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from cute_ep.runtime.library import KernelNotBuilt, Manifest, library_dir

    parser = argparse.ArgumentParser(prog="cute-ep info")
    parser.add_argument("--library", default=None, help="library folder")
    args = parser.parse_args(argv)
    console = Console()
    try:
        manifest = Manifest.load(args.library)
    except KernelNotBuilt as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 1
    gpus = _visible_gpus()
    table = Table(title=f"kernel library at {library_dir(args.library)} "
                        f"(DSL {manifest.data['dsl_version']})")
    for col in ("config", "arch", "cubin bytes", "runs here"):
        table.add_column(col, overflow="fold")
    for (key, arch), entry in sorted(manifest.entries.items()):
        here = ", ".join(f"cuda:{i}" for i, a in gpus if a == arch) or "-"
        table.add_row(escape(key), arch, str(entry.cubin.stat().st_size), here)
    console.print(table)
    if not gpus:
        console.print("no supported CUDA GPU visible: the library can be built and inspected here, "
                      "its kernels run on sm_90 (Hopper) and sm_100 (Blackwell) GPUs")
    return 0


def _layouts(argv) -> int:
    from rich.console import Console
    from rich.table import Table

    from layouts import FORMATS, EPConfig, buffer_sizes
    from layouts.buffers import peer_visible_bytes, total_bytes
    from layouts.channels import DEFAULT_CHANNELS

    parser = argparse.ArgumentParser(
        prog="cute-ep layouts",
        description="Print the token message byte map and the buffer sizes of one EP layer.")
    parser.add_argument("--format", choices=sorted(FORMATS), default="bf16")
    parser.add_argument("--hidden", type=int, default=7168, help="H (default: DeepSeek-V3's)")
    parser.add_argument("--topk", type=int, default=8, help="K")
    parser.add_argument("--experts", type=int, default=256, help="E")
    parser.add_argument("--ranks", type=int, default=8, help="R")
    parser.add_argument("--max-tokens", type=int, default=4096, help="max tokens per rank")
    parser.add_argument("--shared-expert", action="store_true", help="fused shared expert")
    parser.add_argument("--recv-capacity", type=int, default=None,
                        help="received rows a rank's dispatch output holds (default: the "
                             "worst case)")
    parser.add_argument("--sms", type=int, default=DEFAULT_CHANNELS,
                        help=f"SM budget = dispatch channels (default {DEFAULT_CHANNELS})")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs of one host (default: every rank on one): with fewer than "
                             "ranks, also the parts of the transport between nodes")
    args = parser.parse_args(argv)
    console = Console()
    try:
        cfg = EPConfig(args.hidden, args.topk, args.experts, args.ranks, args.max_tokens,
                       args.format, args.shared_expert, recv_capacity=args.recv_capacity,
                       gpus_per_node=args.gpus_per_node)
    except ValueError as exc:
        console.print(f"[red]invalid config:[/] {exc}")
        return 2
    msg = cfg.message
    table = Table(title=f"{cfg.format} message: H={cfg.hidden}, K={cfg.topk} "
                        f"({msg.size} bytes, 16-byte aligned segments)")
    for col in ("segment", "bytes", "offset", "elements x bytes"):
        table.add_column(col, justify="right" if col != "segment" else "left")
    end = 0
    for seg in msg.segments:
        if seg.offset > end:
            table.add_row("[dim]padding[/]", str(seg.offset - end), str(end), "")
        table.add_row(seg.name, str(seg.nbytes), str(seg.offset),
                      f"{seg.elements} x {seg.element_bytes}")
        end = seg.offset + seg.nbytes
    if msg.size > end:
        table.add_row("[dim]padding[/]", str(msg.size - end), str(end), "")
    console.print(table)

    sizes = Table(title=f"buffers: E={cfg.experts} over R={cfg.ranks} ranks "
                        f"({cfg.local_experts} local), max {cfg.max_tokens_per_rank} tokens "
                        f"per rank, up to {cfg.max_recv} received rows"
                        + (f", outputs for {cfg.recv_rows}" if cfg.recv_capacity else ""))
    for col in ("where", "buffer", "bytes", "MiB"):
        sizes.add_column(col, justify="right" if col in ("bytes", "MiB") else "left")
    for where, buffers in buffer_sizes(cfg, args.sms).items():
        for name, nbytes in buffers.items():
            sizes.add_row(where, name, f"{nbytes:,}", f"{nbytes / 2**20:.1f}")
    console.print(sizes)
    console.print(f"GPU memory per rank for this layer on {args.sms} SMs: "
                  f"{total_bytes(cfg, args.sms) / 2**20:.1f} MiB, of which "
                  f"{peer_visible_bytes(cfg, args.sms) / 2**20:.1f} MiB peer-visible "
                  "(dispatch's staging and batch headers, combine's rings, counts and counters), then "
                  "local buffers and dispatch outputs")
    if cfg.nodes > 1:
        from layouts.nodes import NodeSlots, node_config

        slots = NodeSlots(cfg)
        inner = node_config(cfg)
        parts = Table(title=f"between nodes: {cfg.nodes} nodes of {cfg.node_ranks} GPUs "
                            f"(cute_ep.NodeBuffer)")
        for col in ("where", "buffer", "bytes", "MiB"):
            parts.add_column(col, justify="right" if col in ("bytes", "MiB") else "left")
        for name, nbytes in slots.symmetric_bytes().items():
            parts.add_row("NVSHMEM symmetric heap", name, f"{nbytes:,}", f"{nbytes / 2**20:.1f}")
        console.print(parts)
        console.print(f"NVSHMEM symmetric heap per rank for this layer: "
                      f"{slots.symmetric_offsets()['total'] / 2**20:.1f} MiB; the node's "
                      f"intranode Buffer ({inner.ranks} ranks, {inner.experts} experts, "
                      f"{inner.max_tokens_per_rank} input rows a rank): "
                      f"{total_bytes(inner, args.sms) / 2**20:.1f} MiB per rank")
    return 0


def _visible_gpus() -> list[tuple[int, str]]:
    import torch

    from cute_ep.runtime.launch import ARCH_OF_CAPABILITY

    if not torch.cuda.is_available():
        return []
    return [(i, ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(i), "unsupported"))
            for i in range(torch.cuda.device_count())]


def _bench(argv) -> int:
    from cute_ep.tools.bench import main as bench_main

    return bench_main(argv)


def _plot(argv) -> int:
    from cute_ep.tools.plot import main as plot_main

    return plot_main(argv)


def _demo(argv) -> int:
    from cute_ep.tools.demo import main as demo_main

    return demo_main(argv)


COMMANDS = {"demo": _demo, "build": _build, "info": _info, "layouts": _layouts,
            "bench": _bench, "plot": _plot}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: cute-ep {demo,build,info,layouts,bench,plot} [options]\n\n"
              "  demo      a DeepSeek-V3-shaped MoE layer on every GPU, checked against the "
              "reference\n            (no GPU: the reference alone, with emulated ranks)\n"
              "  build     compile the kernel library (needs the build extra; no GPU needed)\n"
              "  info      list the library's configs and the GPUs that can run them\n"
              "  layouts   the token message byte map and buffer sizes of one EP layer\n"
              "  bench     the performance harness (one process per GPU; JSON in perf/results)\n"
              "  plot      a figure (PNG) from a bench or quantize record (needs the plot extra)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
