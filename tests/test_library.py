"""The manifest, config keys and argument checks: everything of the runtime that needs no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_ep.runtime.launch import Kernel, Launcher, check_tensor
from cute_ep.runtime.library import Entry, KernelNotBuilt, Manifest, library_dir
from layouts.abi import GridRule, KernelSpec, Param, config_key


def _library_or_skip() -> Manifest:
    try:
        return Manifest.load()
    except KernelNotBuilt as exc:
        if os.environ.get("CI"):
            raise  # CI builds the library before the tests: a missing one is a failure there
        pytest.skip(str(exc))


def test_config_key_is_canonical():
    assert config_key("f", {"b": True, "a": 3}) == "f[a=3,b=1]"
    assert config_key("f", {"a": 3, "b": True}) == config_key("f", {"b": 1, "a": 3})


def test_grid_rules():
    assert GridRule(constant=1).evaluate({}) == 1
    assert GridRule(ceil_div=("n", 1024)).evaluate({"n": 0}) == 0
    assert GridRule(ceil_div=("n", 1024)).evaluate({"n": 1025}) == 2
    assert GridRule(ceil_div=("n", 1), max=1).evaluate({"n": 7}) == 1


def test_a_bound_launch_computes_the_grid_the_rules_give():
    """`Launcher.grid_of` (from the varying arguments, the constants bound once) == the spec's
    grid rules evaluated on all the named scalars, for every kernel of the library and any split
    of its scalars into fixed and varying."""
    import random

    rng = random.Random(0)
    for entry in _library_or_skip().entries.values():
        kernel = Kernel(entry, function=None, device_index=0)
        spec = entry.spec
        for _ in range(20):
            scalars = {p.name: rng.choice([0, 1, 7, 129, 4096, 1 << 20])
                       for p in spec.params if p.kind != "ptr"}
            # A scalar fixed at build time must be bound to the value the kernel was built for.
            scalars.update({k: v for k, v in spec.config.items() if k in scalars})
            fixed = {k: v for k, v in scalars.items() if rng.random() < 0.5}
            varying = tuple(p.name for p in spec.params if p.name not in fixed)
            launcher = Launcher(kernel, varying, fixed)
            values = [scalars.get(name, 0) for name in varying]
            want = [rule.evaluate(scalars) for rule in spec.grid]
            assert launcher.grid_of(values) == want, spec.key


def test_a_bind_names_every_parameter_once_and_a_launch_passes_each_varying_one():
    spec = KernelSpec(
        family="f", config={"x": 2},
        params=(Param("out", "ptr", "int32", align=16), Param("n", "i32"), Param("x", "i32"),
                Param("big", "i64")),
        block=(128, 1, 1), grid=(GridRule(ceil_div=("n", 8), max=4), GridRule(constant=1),
                                 GridRule(constant=1)),
        smem_bytes=0, sizes={})
    entry = Entry(spec=spec, arch="sm_90a", symbol="k", cubin=Path("k.cubin"), sha256="")
    kernel = Kernel(entry, function=None, device_index=0)
    with pytest.raises(TypeError, match="missing"):
        Launcher(kernel, ("out", "n"), {"x": 2})
    with pytest.raises(TypeError, match="both"):
        Launcher(kernel, ("out", "n", "x", "big"), {"x": 2})
    with pytest.raises(TypeError, match="no parameters"):
        Launcher(kernel, ("out", "n", "x", "big", "extra"), {})
    with pytest.raises(ValueError, match="built for x=2"):
        Launcher(kernel, ("out", "n", "big"), {"x": 3})
    with pytest.raises(ValueError, match="does not fit i32"):
        Launcher(kernel, ("out", "x", "big"), {"n": 1 << 31})
    with pytest.raises(TypeError, match="must be an int"):
        Launcher(kernel, ("out", "x", "big"), {"n": 1.0})
    launcher = kernel.bind(("out", "n", "big"), x=2)
    assert launcher.grid_of([0, 17, 0]) == [3, 1, 1]
    assert launcher.grid_of([0, 1000, 0]) == [4, 1, 1]
    with pytest.raises(TypeError, match="takes 3 varying arguments, got 2"):
        launcher(0, 17)


def _recorded_launches(monkeypatch) -> list[tuple]:
    """Every cuLaunchKernel call from now on, as its arguments (no driver: a recorder stands in
    for it, and torch's current stream is handle 77)."""
    from cute_ep.runtime import launch

    calls = []
    monkeypatch.setattr(launch, "_LAUNCH", lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(launch, "_current_raw_stream", lambda device_index: 77)
    return calls


def test_a_bound_launch_looks_up_the_grid_of_the_scalars_it_reads(monkeypatch):
    """The grid is remembered by the varying scalar its rule reads: a new value of that scalar
    gets its own grid, another scalar's value does not matter, a zero grid launches nothing; the
    handles go to the driver as pointers, the sizes as ints."""
    import ctypes
    import struct

    calls = _recorded_launches(monkeypatch)
    spec = KernelSpec(
        family="f", config={},
        params=(Param("out", "ptr", "int32", align=16), Param("n", "i32"), Param("big", "i64")),
        block=(128, 1, 1), grid=(GridRule(ceil_div=("n", 8), max=4), GridRule(constant=1),
                                 GridRule(constant=1)),
        smem_bytes=256, sizes={})
    entry = Entry(spec=spec, arch="sm_90a", symbol="k", cubin=Path("k.cubin"), sha256="")
    launcher = Kernel(entry, function=0x1234, device_index=0).bind(("out", "n", "big"))
    for n, big, grid in [(17, 1, (3, 1, 1)), (17, 2, (3, 1, 1)), (1000, 3, (4, 1, 1)),
                         (9, 4, (2, 1, 1)), (17, 5, (3, 1, 1))]:
        launcher(0x5000, n, big)
        function, *sizes, stream, argv, extra = calls.pop()
        assert tuple(sizes) == (*grid, 128, 1, 1, 256) and all(type(v) is int for v in sizes)
        assert (function.value, stream.value, extra) == (0x1234, 77, None)
        assert isinstance(argv, ctypes.c_void_p)
        out, n_packed, big_packed = struct.unpack_from("=qi4xq", launcher._packed)
        assert (out, n_packed, big_packed) == (0x5000, n, big)
    launcher(0x5000, 0, 6)  # no tokens: nothing to launch
    assert calls == []


def test_a_grid_past_32_bits_is_refused_not_truncated(monkeypatch):
    calls = _recorded_launches(monkeypatch)
    spec = KernelSpec(
        family="f", config={}, params=(Param("n", "i64"),), block=(32, 1, 1),
        grid=(GridRule(ceil_div=("n", 1)), GridRule(constant=1), GridRule(constant=1)),
        smem_bytes=0, sizes={})
    entry = Entry(spec=spec, arch="sm_90a", symbol="k", cubin=Path("k.cubin"), sha256="")
    launcher = Kernel(entry, function=1, device_index=0).bind(("n",))
    with pytest.raises(ValueError, match="does not fit 32-bit"):
        launcher(1 << 32)
    launcher((1 << 32) - 1)
    assert calls.pop()[1] == (1 << 32) - 1


def test_spec_round_trips_through_json():
    spec = KernelSpec(
        family="f", config={"x": 2},
        params=(Param("out", "ptr", "int32", align=16, min_elements=("n", 4), writes=True),
                Param("n", "i32")),
        block=(128, 1, 1), grid=(GridRule(ceil_div=("n", 8), max=4), GridRule(constant=1),
                                 GridRule(constant=1)),
        smem_bytes=64, sizes={"tile": 8})
    assert KernelSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_param_rejects_unknown_types():
    with pytest.raises(ValueError, match="unknown element type"):
        Param("x", "ptr", "complex64")
    with pytest.raises(ValueError, match="unknown kind"):
        Param("n", "u16")


def test_the_built_library_lists_every_kernel_for_both_arches():
    manifest = _library_or_skip()
    families = {e.spec.family for e in manifest.entries.values()}
    assert {"block_memcpy", "block_prefix_sum"} <= families
    for family in families:
        assert {a for (k, a), e in manifest.entries.items() if e.spec.family == family} == \
            {"sm_90a", "sm_100a"}, family
    for entry in manifest.entries.values():
        assert entry.cubin.read_bytes()[:4] == b"\x7fELF"
        assert entry.symbol.encode() in entry.cubin.read_bytes()
        # cute_ep::cutlass::<family>[_<format>], mangled as a local entity (profilers demangle
        # it); `cutlass` in the name keeps ptxas's register allocation (kernels/build.py).
        name = entry.spec.family.removeprefix("ep_")
        if "format" in entry.spec.config:
            name += "_" + entry.spec.config["format"]
        if entry.spec.config.get("bulk") == 0:
            name += "_registers"
        if entry.spec.config.get("scales") == "pow2":
            name += "_pow2"
        assert entry.symbol == f"_ZZN7cute_ep7cutlassEE{len(name)}{name}_0", entry.symbol


def test_the_manifest_keeps_each_kernels_registers_and_the_transport_does_not_spill():
    """Registers and stack bytes come from each cubin's .nv.info; the combine kernel, whose
    row sums are register-bound, keeps its values in registers (a name without `cutlass` made
    ptxas spill 152 bytes of them: kernels/build.py), with at least 128 a thread (its 13 warps
    allow up to 152)."""
    manifest = _library_or_skip()
    for e in manifest.data["kernels"]:
        assert 0 < e["registers"] <= 255 and e["stack_bytes"] >= 0, e["cubin"]
        if e["spec"]["family"] == "ep_combine":
            assert e["stack_bytes"] == 0 and e["registers"] >= 128, e


def test_missing_library_names_the_build_command(tmp_path):
    with pytest.raises(KernelNotBuilt, match=f"cute-ep build --out {tmp_path}"):
        Manifest.load(tmp_path)


def test_missing_config_names_the_config_and_the_build_command():
    manifest = _library_or_skip()
    with pytest.raises(KernelNotBuilt, match=r"block_memcpy\[threads=3\].*sm_90a.*cute-ep build"):
        manifest.lookup("block_memcpy[threads=3]", "sm_90a")
    with pytest.raises(KernelNotBuilt, match="block_prefix_sum.*'exclusive': 7"):
        manifest.select("block_prefix_sum", "sm_90a", exclusive=7)


def test_library_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_EP_LIBRARY", str(tmp_path))
    assert library_dir() == tmp_path
    assert library_dir("elsewhere") == library_dir("elsewhere")


def test_launch_arguments_are_checked_against_the_abi():
    manifest = _library_or_skip()
    entry = manifest.select("block_prefix_sum", "sm_90a", exclusive=False)
    kernel = Kernel(entry, function=None, device_index=0)
    x = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        kernel.check_args((x, x))
    with pytest.raises(ValueError, match="does not fit i32"):
        kernel.check_args((x, x, 1 << 31))
    with pytest.raises(TypeError, match="n must be an int"):
        kernel.check_args((x, x, 2.0))
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        kernel.check_args((x, x, 8))


def test_scalars_must_match_the_compiled_config():
    manifest = _library_or_skip()
    entry = next(e for (k, a), e in manifest.entries.items()
                 if e.spec.family == "peer_exchange" and a == "sm_90a")
    built = entry.spec.config["ranks"]
    kernel = Kernel(entry, function=None, device_index=0)
    table = torch.zeros(2 * built, dtype=torch.int64)
    x = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"ranks={2 * built}, the kernel was built for ranks={built}"):
        kernel.check_args((table, x, x, 1, 2 * built, 0, table, 10**9,
                           torch.zeros(4, dtype=torch.int32)))


def test_tensor_checks_name_what_is_wrong():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        check_tensor([1, 2], name="x", dtype="int32")
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        check_tensor(torch.zeros(4), name="x", dtype="float32")


def test_import_needs_neither_the_dsl_nor_a_gpu():
    code = ("import sys, cute_ep; assert 'cutlass' not in sys.modules, 'runtime imported the DSL'; "
            "print(cute_ep.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == __import__("cute_ep").__version__


def test_a_launch_writes_each_varying_argument_where_the_driver_reads_it():
    """The argument block the driver gets (an array of addresses, one per parameter): a
    varying value packed by the launch and a fixed one written at bind both read back, at
    their widths, through it."""
    import ctypes

    spec = KernelSpec(
        family="f", config={},
        params=(Param("a", "ptr", "int32", align=4), Param("n", "i32"), Param("m", "i32"),
                Param("big", "i64"), Param("last", "i32")),
        block=(128, 1, 1), grid=(GridRule(ceil_div=("n", 1)), GridRule(constant=1),
                                 GridRule(constant=1)),
        smem_bytes=0, sizes={})
    entry = Entry(spec=spec, arch="sm_90a", symbol="k", cubin=Path("k.cubin"), sha256="")
    launcher = Kernel(entry, function=None, device_index=0).bind(("a", "n", "big", "last"), m=7)
    launcher._pack(launcher._packed, 0, 0x12_3456_7890, -5, -(1 << 40), 1 << 30)
    argv = launcher._argv
    assert ctypes.c_uint64.from_address(argv[0]).value == 0x12_3456_7890
    assert ctypes.c_int32.from_address(argv[1]).value == -5
    assert ctypes.c_int32.from_address(argv[2]).value == 7
    assert ctypes.c_int64.from_address(argv[3]).value == -(1 << 40)
    assert ctypes.c_int32.from_address(argv[4]).value == 1 << 30



def test_launch_ex_structs_match_the_driver_abi():
    """`cuLaunchKernelEx`'s structures as cuda.h lays them out on a 64-bit host, and the
    attribute and property numbers as the driver bindings name them."""
    import ctypes

    from cute_ep.runtime import launch
    from cute_ep.runtime.launch import driver

    assert ctypes.sizeof(launch._AccessPolicyWindow) == 32
    assert ctypes.sizeof(launch._LaunchAttribute) == 72
    assert launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(launch._LaunchConfig) == 56
    assert (launch._LaunchConfig.stream.offset, launch._LaunchConfig.attrs.offset,
            launch._LaunchConfig.num_attrs.offset) == (32, 40, 48)
    assert launch._ACCESS_POLICY_WINDOW == int(
        driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW)
    assert launch._ACCESS_PROPERTY_STREAMING == int(
        driver.CUaccessProperty.CU_ACCESS_PROPERTY_STREAMING)


def test_a_bound_launch_follows_torch_current_stream(monkeypatch):
    """The stream argument a bound launch keeps is remade when torch's current stream changes:
    each launch goes to the stream current at its call, also after switching back."""
    from cute_ep.runtime import launch

    calls = _recorded_launches(monkeypatch)
    streams = iter([77, 77, 91, 77, 0])
    monkeypatch.setattr(launch, "_current_raw_stream", lambda device_index: next(streams))
    spec = KernelSpec(
        family="f", config={}, params=(Param("out", "ptr", "int32", align=16), Param("n", "i32")),
        block=(32, 1, 1), grid=(GridRule(ceil_div=("n", 8)), GridRule(constant=1),
                                GridRule(constant=1)),
        smem_bytes=0, sizes={})
    entry = Entry(spec=spec, arch="sm_90a", symbol="k", cubin=Path("k.cubin"), sha256="")
    launcher = Kernel(entry, function=0x1234, device_index=0).bind(("out", "n"))
    for _ in range(5):
        launcher(0x5000, 17)
    assert [args[-3].value for args in calls] == [77, 77, 91, 77, None]  # 0: the default stream
    # A value its parameter cannot hold is refused as such, not as a wrong count.
    import struct

    monkeypatch.setattr(launch, "_current_raw_stream", lambda device_index: 77)
    with pytest.raises(struct.error):
        launcher(0x5000, 1 << 31)
    assert len(calls) == 5
