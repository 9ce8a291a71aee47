"""The AOT build on a machine without a GPU: manifest, ABI check, incremental rebuilds, failures."""

import hashlib
import json
from pathlib import Path

import pytest

from layouts.abi import ARCHES

pytestmark = [pytest.mark.build, pytest.mark.source_tree]  # (tests/conftest.py)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from kernels.build import build
    from kernels.matrix import ci_matrix

    out = tmp_path_factory.mktemp("library")
    report = build(ci_matrix(), out, progress=False)
    return out, report


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_ci_subset_has_every_family_for_both_arches(built):
    from kernels.matrix import full_matrix

    out, report = built
    assert not report.failed
    entries = _manifest(out)["kernels"]
    families = {k.spec().family for k in full_matrix()}
    assert {(e["spec"]["family"], e["arch"]) for e in entries} == \
        {(f, a) for f in families for a in ("sm_90a", "sm_100a")}
    for e in entries:
        cubin = (out / e["cubin"]).read_bytes()
        assert cubin[:4] == b"\x7fELF"
        assert hashlib.sha256(cubin).hexdigest() == e["sha256"]
        assert e["symbol"].encode() in cubin
        assert [p["name"] for p in e["spec"]["params"]]  # the ABI is recorded
        assert e["spec"]["block"][0] > 0


def test_net_put_links_the_nvshmem_device_library_of_each_arch(built):
    """The kernel that calls NVSHMEM (`kernels.net_put`) is built without a GPU: each arch's
    cubin carries NVSHMEM's device code from that arch's bitcode (`kernels.build
    .nvshmem_bitcode`; the one bitcode of versions that ship one), and the manifest marks it
    with that NVSHMEM's version for the runtime's module initialisation; no other kernel is
    marked."""
    from importlib.metadata import version

    import nvidia.nvshmem

    from kernels.build import cubin_nvshmem_version, nvshmem_bitcode

    out, _ = built
    entries = _manifest(out)["kernels"]
    marked = {(e["spec"]["family"], e["arch"], e["nvshmem"]) for e in entries
              if e.get("nvshmem")}
    assert marked == {("net_put", a, version("nvidia-nvshmem-cu13"))
                      for a in ("sm_90a", "sm_100a")}
    for e in entries:
        if e.get("nvshmem"):
            cubin = (out / e["cubin"]).read_bytes()
            assert b"nvshmemi_device_state" in cubin or b"nvshmemi" in cubin
            # the device code's own version, which nvshmemx_cumodule_init checks
            assert cubin_nvshmem_version(cubin) == version("nvidia-nvshmem-cu13")
            assert e["stack_bytes"] >= 0 and e["registers"] > 0
    for arch, sm in (("sm_90a", "90"), ("sm_100a", "100")):
        with nvshmem_bitcode(arch) as path:
            per_arch = Path(*nvidia.nvshmem.__path__, "lib", f"libnvshmem_device_sm_{sm}.bc")
            if per_arch.exists():
                assert Path(path) == per_arch
            else:  # libNVVM's copy of the version's one bitcode
                assert Path(path).name.startswith("libnvshmem_device-")
            from nvshmem.bindings.device.cute import _bitcode
            assert _bitcode.NVSHMEM_DEVICE_BITCODE.path == path


def test_unchanged_configs_are_not_rebuilt_and_damaged_ones_are(built):
    from kernels.build import build
    from kernels.matrix import ci_matrix

    out, _ = built
    again = build(ci_matrix(), out, progress=False)
    assert again.count("unchanged") == len(again.results) and not again.failed

    victim = _manifest(out)["kernels"][0]
    (out / victim["cubin"]).write_bytes(b"damaged")
    repaired = build(ci_matrix(), out, progress=False)
    rebuilt = [(r.key, r.arch) for r in repaired.results if r.status == "built"]
    assert rebuilt == [(victim["spec"]["key"], victim["arch"])]
    assert hashlib.sha256((out / victim["cubin"]).read_bytes()).hexdigest() == victim["sha256"]


def test_a_rebuild_removes_cubins_the_manifest_no_longer_lists(built):
    from kernels.build import build
    from kernels.matrix import ci_matrix

    out, _ = built
    stale = out / "sm_90a" / "ep_combine-000000000000.cubin"
    stale.write_bytes(b"an old configuration")
    report = build(ci_matrix(), out, progress=False)
    assert report.removed == 1 and not stale.exists()
    listed = {e["cubin"] for e in _manifest(out)["kernels"]}
    assert {str(p.relative_to(out)) for p in out.glob("*/*.cubin")} == listed


def _broken_kernel():
    """A kernel whose compilation fails: the build must report it and carry on."""
    import cutlass.cute as cute

    from layouts.abi import GridRule, KernelSpec, Param

    class Broken:
        def spec(self):
            return KernelSpec(family="broken", config={}, params=(Param("n", "i32"),),
                              block=(32, 1, 1), grid=(GridRule(constant=1),) * 3)

        @cute.jit
        def __call__(self, n, stream):
            raise RuntimeError("this kernel does not compile")

    return Broken()


def test_a_failed_config_does_not_stop_the_others(tmp_path):
    from kernels.build import build
    from kernels.matrix import ci_matrix

    report = build([_broken_kernel(), *ci_matrix()], tmp_path, arches=("sm_90a",), progress=False)
    assert [(r.key, r.status) for r in report.failed] == [("broken[]", "failed")]
    assert "does not compile" in report.failed[0].error
    assert report.count("built") == _jobs(ci_matrix(), ("sm_90a",))
    assert "broken" not in {e["spec"]["family"] for e in _manifest(tmp_path)["kernels"]}


def test_ptx_signature_is_checked_against_the_declared_abi():
    from kernels.build import BuildError, ptx_signature

    ptx = """.visible .entry k_0(
        .param .u64 .ptr .global .align 16 k_0_param_0,
        .param .align 8 .b8 k_0_param_1[16],
        .param .u32 k_0_param_2
    )"""
    assert ptx_signature(ptx) == ("k_0", [8, 16, 4])
    with pytest.raises(BuildError, match="one kernel entry"):
        ptx_signature(ptx + ptx.replace("k_0", "k_1"))


def test_cli_writes_the_ci_subset_where_asked(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cute_ep.tools.cli", "build", "--ci", "--no-progress",
                           "--out", str(tmp_path / "lib")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    from kernels.matrix import ci_matrix

    expected = _jobs(ci_matrix(), ARCHES)
    assert len(_manifest(tmp_path / "lib")["kernels"]) == expected
    assert f"{expected} built, 0 unchanged, 0 failed" in done.stdout


def _fp4_kernel(name, e2m1):
    from kernels.dispatch import EpDispatch
    from kernels.encode import EpEncode
    from kernels.nvfp4 import QuantizeNvfp4
    from kernels.quantize_quads import QuantizeNvfp4Quads
    from kernels.silu import FusedSilu

    return {"quantize_nvfp4": lambda: QuantizeNvfp4("128x4", e2m1),
            "quantize_nvfp4 quads": lambda: QuantizeNvfp4Quads(e2m1),
            "ep_encode_nvfp4": lambda: EpEncode("nvfp4", e2m1),
            "ep_dispatch_nvfp4": lambda: EpDispatch("nvfp4", e2m1=e2m1),
            "fused_silu_nvfp4": lambda: FusedSilu("nvfp4", True, e2m1=e2m1),
            "fused_silu_mxfp4": lambda: FusedSilu("mxfp4", True, "swiglu_oai", e2m1=e2m1)}[name]()


@pytest.mark.build
@pytest.mark.parametrize("name", ["quantize_nvfp4", "quantize_nvfp4 quads", "ep_encode_nvfp4",
                                  "ep_dispatch_nvfp4", "fused_silu_nvfp4", "fused_silu_mxfp4"])
def test_fp4_kernels_use_the_hardware_e2m1_conversion_only_on_sm_100a(name):
    from kernels.build import compile_with_ptx
    from kernels.matrix import full_matrix

    hw, sw = _fp4_kernel(name, "hardware"), _fp4_kernel(name, "software")
    assert hw.arches == ("sm_100a",) and sw.arches == ("sm_90a",)
    assert {k.spec().key for k in full_matrix()} >= {hw.spec().key, sw.spec().key}
    hw_ptx = compile_with_ptx(hw, hw.spec(), "sm_100a")[2]
    sw_ptx = compile_with_ptx(sw, sw.spec(), "sm_90a")[2]
    assert "cvt.rn.satfinite.e2m1x2.f32" in hw_ptx
    assert "cvt.rn.satfinite.e2m1x2.f32" not in sw_ptx
    # Every division is the correctly rounded one: the references divide the same way.
    for ptx in (hw_ptx, sw_ptx):
        assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx


def _jobs(kernels, arches) -> int:
    """Configurations x architectures the build compiles (a kernel may name its arches)."""
    return sum(a in getattr(k, "arches", ARCHES) for k in kernels for a in arches)


@pytest.mark.build
def test_every_kernel_asks_for_at_most_the_shared_memory_a_block_may_have():
    from kernels.matrix import full_matrix

    limit = 227 * 1024  # per block on sm_90a and sm_100a, opted in
    for kernel in full_matrix():
        spec = kernel.spec()
        assert 0 <= spec.smem_bytes <= limit, (spec.key, spec.smem_bytes)


@pytest.mark.build
def test_dispatch_receivers_of_the_bulk_formats_pull_by_bulk_copies():
    from kernels.build import compile_with_ptx
    from kernels.dispatch import FORMATS, EpDispatch
    from kernels.dispatch.common import BULK_FORMATS

    kernels = [EpDispatch("bf16"), EpDispatch("fp8"), EpDispatch("nvfp4", e2m1="software"),
               EpDispatch("nvfp4", bulk=False, e2m1="software")]
    assert {k.fmt for k in kernels} == set(FORMATS)
    for kernel in kernels:
        bulk = kernel.fmt in BULK_FORMATS and kernel.spec().config["bulk"] == 1
        ptx = compile_with_ptx(kernel, kernel.spec(), "sm_90a")[2]
        pulls = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
        stores = "cp.async.bulk.global.shared::cta.bulk_group" in ptx
        assert pulls == stores == bulk, kernel.spec().key
        # the pieces' shared memory
        assert (kernel.ring_bytes > 100 * 1024) == bulk


@pytest.mark.parametrize("warps", [1, 8, 27, 28, 32])
def test_split_gate_arena_regions_are_disjoint(warps):
    """SwiGLU-OAI's FP4 stream arena (`kernels.silu.split_arena`): the split table's halves lie
    SPLIT_SIGN_BYTES apart (a gate's sign bit times 4), each warp's stages are 128-byte aligned,
    and no two regions overlap or leave the arena."""
    from kernels.gate_table import SPLIT_HALF_BYTES, SPLIT_SIGN_BYTES
    from kernels.silu import RING_WARP_BYTES, split_arena

    assert SPLIT_SIGN_BYTES == 4 * 0x8000
    first, gap, later, size = split_arena(warps)
    regions = [(0, SPLIT_HALF_BYTES), (SPLIT_SIGN_BYTES, SPLIT_SIGN_BYTES + SPLIT_HALF_BYTES)]
    for w in range(warps):
        at = first + w * RING_WARP_BYTES if w < gap else later + (w - gap) * RING_WARP_BYTES
        assert at % 128 == 0
        regions.append((at, at + RING_WARP_BYTES))
    regions.sort()
    assert regions[0][0] >= 0 and regions[-1][1] <= size
    for (_, end), (start, _) in zip(regions, regions[1:]):
        assert end <= start


@pytest.mark.build
def test_the_quad_transpose_selectors_swap_four_lanes_bytes():
    """`kernels.quantize_quads.transpose_quad` on a model of its shuffles and `prmt.b32`: lane i
    of four, whose word holds row r's scale of column i in byte r, ends with row i's scales of
    the four columns, column n in byte n."""
    import random

    from kernels.quantize_quads import SELECTORS

    def prmt(a, b, selector):
        pool = [(a >> (8 * n)) & 0xFF for n in range(4)] + [(b >> (8 * n)) & 0xFF for n in range(4)]
        return sum(pool[(selector >> (4 * n)) & 7] << (8 * n) for n in range(4))

    rng = random.Random(0)
    for _ in range(100):
        words = [rng.getrandbits(32) for _ in range(4)]
        for i in range(4):
            s1, s2, s3 = ((table >> (16 * i)) & 0xFFFF for table in SELECTORS)
            x = [words[i ^ d] for d in range(4)]  # shuffle_sync_bfly by 0, 1, 2, 3
            got = prmt(prmt(x[0], x[1], s1), prmt(x[2], x[3], s2), s3)
            assert got == sum(((words[n] >> (8 * i)) & 0xFF) << (8 * n) for n in range(4))


def test_a_kernels_build_key_covers_every_module_it_is_built_from(tmp_path, monkeypatch):
    """ep_dispatch is a package of phase modules, and ep_combine imports from it: each build key
    hashes them all (and what they import in turn), so a change to any phase rebuilds both."""
    from pathlib import Path

    import kernels.build as build
    from kernels.combine import EpCombine
    from kernels.dispatch import EpDispatch

    here = Path(build.__file__).resolve().parent
    names = {str(p.relative_to(here)) for p in build.kernel_sources(EpDispatch("bf16"))}
    phases = {f"dispatch/{m}.py" for m in ("__init__", "common", "counts", "send", "receive",
                                           "scales")}
    assert phases | {"routing.py", "memory.py", "bulk_copy.py", "nvfp4.py"} <= names, names
    assert "division.py" in names  # imported by nvfp4.py, not by any dispatch module
    combine = {str(p.relative_to(here)) for p in build.kernel_sources(EpCombine())}
    assert {"combine.py", "dispatch/common.py"} <= combine, combine

    # A change to one phase module changes the digest of both kernels.
    before = (build.source_digest(EpDispatch("bf16")), build.source_digest(EpCombine()))
    send = here / "dispatch" / "send.py"
    real = Path.read_bytes

    def read_bytes(path):
        data = real(path)
        return data + b"\n# changed\n" if Path(path).resolve() == send else data

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    after = (build.source_digest(EpDispatch("bf16")), build.source_digest(EpCombine()))
    assert before[0] != after[0] and before[1] != after[1]
