"""Ahead-of-time build: compile the kernel matrix into cubins and a manifest, no GPU needed.

    python -m kernels.build [--ci] [--out DIR] [--arch sm_90a --arch sm_100a] [--force]

(also `cute-ep build`). Every configuration is compiled for every architecture with the CuTe DSL,
its PTX signature is checked against the kernel's declared parameter ABI, and the cubin is
written next to a `manifest.json` that the runtime reads. A configuration whose build key (kernel
source, layouts, ABI, DSL version, arch, config) is unchanged and whose cubin is intact is not
rebuilt. A configuration that fails is reported and the others still build.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import re
import struct
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr
from rich.markup import escape

from layouts.abi import ARCHES, MANIFEST, MANIFEST_FORMAT, KernelSpec, library_dir

KERNELS = Path(__file__).resolve().parent
REPO_FILES = KERNELS.parent

DSL_TYPES = {
    "uint8": cutlass.Uint8,
    "int8": cutlass.Int8,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "int32": cutlass.Int32,
    "uint32": cutlass.Uint32,
    "float32": cutlass.Float32,
    "int64": cutlass.Int64,
    "uint64": cutlass.Uint64,
}
SCALAR_TYPES = {"i32": cutlass.Int32, "i64": cutlass.Int64}


class BuildError(RuntimeError):
    pass


@dataclass
class Result:
    key: str
    arch: str
    status: str  # "built", "unchanged" or "failed"
    seconds: float = 0.0
    error: str = ""


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    removed: int = 0  # cubins of configurations no longer in the manifest, deleted

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "failed"]


def dsl_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass-dsl")


def package_version() -> str:
    """cute-ep's installed version, read from its metadata (importing the runtime would load
    torch and every API module just to build a kernel)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cute-ep")
    except PackageNotFoundError:
        return "unknown (not installed)"


def kernel_sources(kernel) -> list[Path]:
    """The `kernels/` files a kernel's class is built from: its module and, transitively, every
    `kernels` module it imports (a package's `__init__.py` and the submodules named)."""
    todo = [Path(inspect.getsourcefile(type(kernel))).resolve()]
    seen: list[Path] = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        for dotted in re.findall(r"^from kernels\.([\w.]+) import", path.read_text(), re.M):
            base = KERNELS.joinpath(*dotted.split("."))
            todo += [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
            # `from kernels.pkg.mod import` runs the package's __init__ too.
            for i in range(1, dotted.count(".") + 1):
                init = KERNELS.joinpath(*dotted.split(".")[:i], "__init__.py")
                if init.is_file():
                    todo.append(init)
    return seen


def source_digest(kernel) -> str:
    """Hash of every source file a kernel's cubin depends on, beside the DSL itself."""
    files = [*sorted(kernel_sources(kernel)), KERNELS / "build.py"]
    files += sorted((REPO_FILES / "layouts").glob("*.py"))
    h = hashlib.sha256()
    for f in files:  # kernels/ files by their path there (a package's modules share names)
        h.update((str(f.relative_to(KERNELS)) if f.is_relative_to(KERNELS) else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def nvshmem_library_version() -> str:
    """The version of the NVSHMEM library (the `nvidia-nvshmem-cu13` wheel) whose device
    bitcode a kernel that calls NVSHMEM links. The host library that initialises its module
    must be the same version: the manifest records it for the runtime to check."""
    from importlib.metadata import version

    return version("nvidia-nvshmem-cu13")


def nvshmem_version() -> str:
    """The NVSHMEM device library's version and its DSL bindings' (`nvshmem4py-cu13`)."""
    from importlib.metadata import version

    return f"{nvshmem_library_version()}/{version('nvshmem4py-cu13')}"


def build_key(kernel, spec: KernelSpec, arch: str) -> str:
    h = hashlib.sha256()
    parts = [source_digest(kernel), dsl_version(), arch, json.dumps(spec.to_json(), sort_keys=True)]
    if getattr(kernel, "nvshmem", False):
        parts.append(nvshmem_version())
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_args(spec: KernelSpec) -> list:
    """Placeholder arguments with the types, and alignments the kernel may assume."""
    import cuda.bindings.driver as driver

    args = []
    for p in spec.params:
        if p.kind == "ptr":
            args.append(make_ptr(DSL_TYPES[p.dtype], 1 << 20, cute.AddressSpace.gmem,
                                 assumed_align=p.align))
        else:
            args.append(SCALAR_TYPES[p.kind](0))
    args.append(driver.CUstream(0))
    return args


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ENTRY = re.compile(r"\.visible\s+\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM_ARRAY = re.compile(r"\.param\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]")
_PARAM_SCALAR = re.compile(r"\.param\s+\.[usbf](\d+)\b")


def ptx_signature(ptx: str) -> tuple[str, list[int]]:
    """The kernel symbol and the byte size of each parameter, read from PTX."""
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise BuildError(f"expected one kernel entry in the PTX, found {len(entries)}")
    symbol, body = entries[0]
    sizes = []
    for line in (s.strip() for s in body.split(",")):
        if not line:
            continue
        if m := _PARAM_ARRAY.search(line):
            sizes.append(int(m.group(1)))
        elif m := _PARAM_SCALAR.search(line):
            sizes.append(int(m.group(1)) // 8)
        else:
            raise BuildError(f"unrecognised PTX parameter: {line}")
    return symbol, sizes


def symbol_prefix(spec: KernelSpec) -> str:
    """What a kernel's function is named: `cute_ep::cutlass::<family>[_<format>]` (the family
    without its `ep_`) in the C++ ABI's mangling of a local entity,
    `_ZZN7cute_ep7cutlassEE<length><name>`, to which the DSL appends `_0`, read as the entity's
    discriminator. Profilers show `cute_ep::cutlass::dispatch_fp8` (DeepEP's
    test_low_latency.py finds its kernels by `dispatch` and `combine`).

    The `cutlass` in the name is load-bearing: ptxas allocates registers differently for a
    kernel whose name lacks it. Built without it on 2026-11-26 (same PTX but the name),
    `ep_combine` got 80 registers and a 152-byte stack of spills instead of 146 registers and
    none, and ran 100 us slower at 24 SMs on 2 x H100; `cubin_resources` reads both numbers and
    the manifest keeps them."""
    name = spec.family.removeprefix("ep_")
    if "format" in spec.config:
        name += f"_{spec.config['format']}"
    if spec.config.get("bulk") == 0:
        name += "_registers"  # dispatch's register-path receivers
    if spec.config.get("scales") == "pow2":
        name += "_pow2"  # FP8 scales rounded up to powers of two
    return f"_ZZN7cute_ep7cutlassEE{len(name)}{name}"


# The .nv.info attributes `cubin_resources` reads: registers a thread, and the stack frame
# (spilled registers and local arrays) in bytes.
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2F, 0x11
_EIFMT_SVAL = 0x04  # an attribute with a 16-bit size and that many bytes of value


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """`{"registers": per thread, "stack_bytes": frame}` of a one-kernel cubin, read from its
    ELF `.nv.info` section (attributes of (format, id, 16-bit size, value); a register count or
    frame size value is (symbol index, u32))."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise BuildError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    found = {}
    for i in range(shnum):
        name_at, offset, size = section(i)
        end = cubin.index(b"\0", names_at + name_at)
        if cubin[names_at + name_at:end] != b".nv.info":
            continue
        at = offset
        while at < offset + size:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt != _EIFMT_SVAL:
                at += 4 if fmt in (0x02, 0x03) else 2
                continue
            length, = struct.unpack_from("<H", cubin, at + 2)
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and length >= 8:
                found.setdefault(attr, struct.unpack_from("<I", cubin, at + 8)[0])
            at += 4 + length
    if _EIATTR_REGCOUNT not in found:
        raise BuildError("the cubin's .nv.info has no register count")
    return {"registers": found[_EIATTR_REGCOUNT], "stack_bytes": found.get(_EIATTR_FRAME_SIZE, 0)}


def compile_kernel(kernel, spec: KernelSpec, arch: str) -> tuple[str, bytes]:
    """Compile one configuration for one arch; returns (symbol, cubin)."""
    symbol, cubin, _ = compile_with_ptx(kernel, spec, arch)
    return symbol, cubin


def cubin_nvshmem_version(cubin: bytes) -> str | None:
    """The NVSHMEM version whose device code a cubin carries: its `nvshmemi_device_lib_version_d`
    (major, minor, patch: three int32), the value `nvshmemx_cumodule_init` compares with the
    host library's; None in a cubin without it. Read from the ELF symbol table (a symbol's
    value is its offset in its section)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    # (type, offset, size, link) of each section header
    headers = [struct.unpack_from("<4xI16xQQI", cubin, shoff + i * shentsize) for i in range(shnum)]
    for kind, offset, size, link in headers:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = headers[link][1]
        for at in range(offset, offset + size, 24):
            name, shndx, value, length = struct.unpack_from("<I2xHQQ", cubin, at)
            end = cubin.index(b"\0", names + name)
            if cubin[names + name:end] == b"nvshmemi_device_lib_version_d" and length == 12:
                base = headers[shndx][1]
                return ".".join(map(str, struct.unpack_from("<3i", cubin, base + value)))
    return None


# An explicit section on a function (`define ... section ".text.compute"`), which libNVVM's
# verifier refuses ("Explicit section marker ... is not allowed", NVVM_ERROR_INVALID_IR).
_FUNCTION_SECTION = re.compile(r'^((?:define|declare) [^\n]*?) section "[^"\n]*"', re.M)


def _bitcode_cache() -> Path:
    """Where the build keeps the bitcode it derives from NVSHMEM's: the user's cache folder
    ($XDG_CACHE_HOME, else ~/.cache), under cute-ep."""
    import os

    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "cute-ep" / "nvshmem"


def libnvvm_bitcode(path: str) -> str:
    """A copy of the LLVM bitcode at `path` that libNVVM accepts: without explicit function
    sections. NVSHMEM 3.4's one `libnvshmem_device.bc` (clang-built) puts its transfer
    functions (`nvshmemi_transfer_quiet`, `..._put_signal`, ...) in section ".text.compute";
    libNVVM rejects the whole module for it. A section means nothing in PTX, which has none,
    so dropping it leaves the code as it was. The rewrite goes through the DSL's own LLVM
    (read the bitcode, print it as text, edit, parse and write it back), so it needs no other
    tool (the DSL's `LlvmIrArtifact`); it takes some 20 s and 2 GB once, and its result is
    kept, by the hash of the input, the DSL version and the edit, in `_bitcode_cache()`. The
    device code stays this NVSHMEM's: its version symbol (`nvshmemi_device_lib_version_d`,
    checked in `compile_with_ptx`) and device state are untouched."""
    from cutlass._mlir._mlir_libs._cutlass_ir import LlvmIrArtifact

    data = Path(path).read_bytes()
    digest = hashlib.sha256(
        data + dsl_version().encode() + _FUNCTION_SECTION.pattern.encode()).hexdigest()[:16]
    cached = _bitcode_cache() / f"{Path(path).stem}-{digest}.bc"
    if cached.is_file():
        return str(cached)
    text = _FUNCTION_SECTION.sub(r"\1", str(LlvmIrArtifact.from_bitcode(data)))
    out = LlvmIrArtifact.from_textual_form(text.encode()).get_bitcode()
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, suffix=".part", delete=False) as f:
        f.write(out)
    Path(f.name).replace(cached)  # whole or absent, for builds running side by side
    return str(cached)


@contextlib.contextmanager
def nvshmem_bitcode(arch: str):
    """While a kernel that calls NVSHMEM compiles for `arch` (sm_90a, sm_100a): the NVSHMEM
    device bitcode of that SM architecture (`libnvshmem_device_sm_90.bc`, as 3.8 ships),
    or, for versions without those (3.4.5, the one torch 2.11 installs), a copy of their one
    `libnvshmem_device.bc` of every architecture that libNVVM accepts (`libnvvm_bitcode`).
    nvshmem4py picks the file by the current GPU, which a build machine need not have (nor
    the one the cubin is for). 3.4.5's one bitcode is compiled for sm_90 (fine on sm_100a)
    and has no IBGDA: a kernel built from it reaches another node through NVSHMEM's proxy
    thread (IBRC, UCX), not GPU-initiated verbs."""
    from nvshmem.bindings.device.cute import _bitcode
    from nvshmem.core.init_fini import find_device_bitcode_library
    from nvshmem.core.nvshmem_types import NvshmemInvalid

    try:
        path = find_device_bitcode_library(arch=re.fullmatch(r"sm_(\d+)a?", arch).group(1))
    except NvshmemInvalid:  # no per-arch file: the version's one bitcode, if it has it
        path = find_device_bitcode_library(arch=None)
        if Path(path).name != "libnvshmem_device.bc":
            raise BuildError(f"NVSHMEM {nvshmem_library_version()} has no device bitcode for "
                             f"{arch} (found {Path(path).name})") from None
        path = libnvvm_bitcode(path)
    chosen = _bitcode._device_bitcode_path
    _bitcode._device_bitcode_path = lambda: path
    try:
        yield path
    finally:
        _bitcode._device_bitcode_path = chosen


def compile_with_ptx(kernel, spec: KernelSpec, arch: str) -> tuple[str, bytes, str]:
    """Compile one configuration for one arch; returns (symbol, cubin, PTX). A kernel that
    calls NVSHMEM (`kernel.nvshmem`) links its device library for that arch."""
    device_function = getattr(kernel, "kernel", None)  # every kernel class's @cute.kernel
    if hasattr(device_function, "set_name_prefix"):
        device_function.set_name_prefix(symbol_prefix(spec), remove_cutlass_symbol=True,
                                        keep_mangled_name=False)
    linked = nvshmem_bitcode(arch) if getattr(kernel, "nvshmem", False) else \
        contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="cute-ep-build-") as tmp, linked:
        compiled = cute.compile(
            kernel, *compile_args(spec),
            options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {tmp}")
        compiled.artifacts  # materialises the dumped files
        ptx_files = list(Path(tmp).glob("*.ptx"))
        cubin_files = list(Path(tmp).glob("*.cubin"))
        if len(ptx_files) != 1 or len(cubin_files) != 1:
            raise BuildError(f"expected one PTX and one cubin from the DSL, got "
                             f"{[p.name for p in Path(tmp).iterdir()]}")
        ptx = ptx_files[0].read_text()
        cubin = cubin_files[0].read_bytes()
    if getattr(kernel, "nvshmem", False):
        # NVSHMEM refuses a module whose device code is of another version than its host
        # library's (status 7); the manifest records the version the wheel says it is.
        carried, wanted = cubin_nvshmem_version(cubin), nvshmem_library_version()
        if carried is None or carried.split(".") != wanted.split(".")[:3]:
            raise BuildError(f"the cubin carries NVSHMEM device code of version {carried}, "
                             f"not {wanted}, the installed nvidia-nvshmem-cu13")
    symbol, sizes = ptx_signature(ptx)
    declared = [p.size for p in spec.params]
    if sizes != declared:
        raise BuildError(
            f"PTX parameters of {symbol} have byte sizes {sizes}, the declared ABI "
            f"{[(p.name, p.kind) for p in spec.params]} has {declared}")
    return symbol, cubin, ptx


def _cubin_name(key: str, arch: str) -> str:
    family = key.split("[", 1)[0]
    return f"{arch}/{family}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.cubin"


def _load_existing(out: Path) -> dict[tuple[str, str], dict]:
    file = out / MANIFEST
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError:
        return {}
    if data.get("format") != MANIFEST_FORMAT:
        return {}
    return {(e["spec"]["key"], e["arch"]): e for e in data.get("kernels", [])}


def _intact(out: Path, entry: dict) -> bool:
    path = out / entry["cubin"]
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]


def build(kernels: list, out: Path, arches=ARCHES, force: bool = False,
          progress: bool = True) -> Report:
    """Compile `kernels` x `arches` into `out`, keeping the unchanged entries already there."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out.mkdir(parents=True, exist_ok=True)
    existing = _load_existing(out)
    entries: dict[tuple[str, str], dict] = {}
    report = Report()
    # A kernel may declare the architectures it is for (e.g. one that uses an sm_100a-only
    # instruction); the others are built for every requested architecture.
    jobs = [(k, k.spec(), arch) for k in kernels for arch in arches
            if arch in getattr(k, "arches", ARCHES)]
    keys = [(spec.key, arch) for _, spec, arch in jobs]
    if len(set(keys)) != len(keys):
        raise BuildError("the kernel matrix declares the same configuration twice")

    console = Console(stderr=True)
    with Progress(TextColumn("[bold]building[/] {task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  disable=not progress, transient=False) as bar:
        task = bar.add_task("", total=len(jobs))
        for kernel, spec, arch in jobs:
            bar.update(task, description=f"{escape(spec.key)} {arch}")
            key = build_key(kernel, spec, arch)
            old = existing.get((spec.key, arch))
            if not force and old and old.get("build_key") == key and _intact(out, old):
                if "registers" not in old:  # listed by a build before the manifest kept them
                    old = {**old, **cubin_resources((out / old["cubin"]).read_bytes())}
                entries[(spec.key, arch)] = old
                report.results.append(Result(spec.key, arch, "unchanged"))
                bar.advance(task)
                continue
            start = time.perf_counter()
            try:
                symbol, cubin = compile_kernel(kernel, spec, arch)
            except Exception as exc:  # one bad config must not stop the others
                detail = _ANSI.sub("", "".join(traceback.format_exception_only(type(exc), exc)))
                detail = "\n".join(line for line in detail.splitlines() if line.strip())
                report.results.append(Result(spec.key, arch, "failed", error=detail))
                console.print(f"[red]failed[/] {escape(spec.key)} {arch}: "
                              f"{escape(' '.join(detail.splitlines()[:2])[:300])}")
                bar.advance(task)
                continue
            rel = _cubin_name(spec.key, arch)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(cubin)
            entries[(spec.key, arch)] = {
                "arch": arch,
                "symbol": symbol,
                "cubin": rel,
                "sha256": hashlib.sha256(cubin).hexdigest(),
                **cubin_resources(cubin),
                "build_key": key,
                "spec": spec.to_json(),
                **({"nvshmem": nvshmem_library_version()} if getattr(kernel, "nvshmem", False)
                   else {}),
            }
            report.results.append(
                Result(spec.key, arch, "built", seconds=time.perf_counter() - start))
            bar.advance(task)

    manifest = {
        "format": MANIFEST_FORMAT,
        "cute_ep_version": package_version(),
        "dsl_version": dsl_version(),
        "kernels": [entries[k] for k in sorted(entries)],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    # Cubins of configurations the manifest no longer lists would only bloat a wheel.
    listed = {(out / e["cubin"]).resolve() for e in manifest["kernels"]}
    for path in out.glob("*/*.cubin"):
        if path.resolve() not in listed:
            path.unlink()
            report.removed += 1
    return report


def print_report(report: Report, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kernel library at {out}")
    for col in ("config", "arch", "status", "seconds"):
        table.add_column(col)
    style = {"built": "green", "unchanged": "dim", "failed": "red"}
    for r in report.results:
        table.add_row(escape(r.key), r.arch, f"[{style[r.status]}]{r.status}[/]",
                      f"{r.seconds:.1f}" if r.status == "built" else "")
    console = Console()
    console.print(table)
    console.print(f"{report.count('built')} built, {report.count('unchanged')} unchanged, "
                  f"{report.count('failed')} failed"
                  + (f", {report.removed} stale cubins removed" if report.removed else ""))
    for r in report.failed:
        console.print(f"[red]{escape(r.key)} {r.arch}[/]\n{escape(r.error)}")


def main(argv=None) -> int:
    from kernels.matrix import ci_matrix, full_matrix

    parser = argparse.ArgumentParser(prog="cute-ep build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="library folder (default: $CUTE_EP_LIBRARY, else inside the package)")
    parser.add_argument("--arch", action="append", choices=ARCHES,
                        help="target architecture (repeatable; default: all)")
    parser.add_argument("--ci", action="store_true",
                        help="one config of every kernel family only")
    parser.add_argument("--force", action="store_true", help="rebuild unchanged configs too")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    out = library_dir(args.out)
    kernels = ci_matrix() if args.ci else full_matrix()
    report = build(kernels, out, arches=tuple(args.arch or ARCHES), force=args.force,
                   progress=not args.no_progress)
    print_report(report, out)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
