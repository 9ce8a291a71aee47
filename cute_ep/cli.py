"""`cute-ep`: the command line (build the kernel library, inspect it)."""

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

    from cute_ep.library import KernelNotBuilt, Manifest, library_dir

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


def _visible_gpus() -> list[tuple[int, str]]:
    import torch

    from cute_ep.runtime import ARCH_OF_CAPABILITY

    if not torch.cuda.is_available():
        return []
    return [(i, ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(i), "unsupported"))
            for i in range(torch.cuda.device_count())]


COMMANDS = {"build": _build, "info": _info}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: cute-ep {build,info} [options]\n\n"
              "  build   compile the kernel library (needs the build extra; no GPU needed)\n"
              "  info    list the library's configs and the GPUs that can run them",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
