"""The NVSHMEM runtime's checks and the manifest's mark, without a GPU (the transfers themselves:
tests/multigpu/test_nvshmem.py)."""

import sys

import pytest

from cute_ep.runtime import nvshmem


def test_joining_needs_torch_distributed_first():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        nvshmem.init()


def test_a_module_or_an_allocation_before_joining_says_to_join():
    assert nvshmem.state() is None
    with pytest.raises(RuntimeError, match=r"net_put\[warps=4\] calls NVSHMEM: call "
                                           r"cute_ep.runtime.nvshmem.init"):
        nvshmem.init_module(object(), "net_put[warps=4]", "3.4.5")
    with pytest.raises(RuntimeError, match="init"):
        nvshmem.symmetric_bytes(64)


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(nvshmem.NvshmemUnavailable, match=r"cute-ep\[multinode\]"):
        nvshmem._core()


def test_a_module_built_against_another_nvshmem_is_refused_by_name(monkeypatch):
    """NVSHMEM initialises a module only with the host library of the version its device code
    came from; the runtime says which versions met, before NVSHMEM's bare status 7."""
    monkeypatch.setattr(nvshmem, "_STATE", {"pe": 0, "npes": 2, "device": 0})
    monkeypatch.setattr(nvshmem, "host_version", lambda: "3.8.0")
    with pytest.raises(RuntimeError, match=r"net_put\[warps=4\] was built against NVSHMEM "
                                           r"3\.4\.5, but this process has nvidia-nvshmem-cu13 "
                                           r"3\.8\.0: install nvidia-nvshmem-cu13==3\.4\.5"):
        nvshmem.init_module(object(), "net_put[warps=4]", "3.4.5")


def test_the_manifest_marks_the_kernels_that_call_nvshmem(tmp_path):
    from cute_ep.runtime.library import Manifest
    from layouts.abi import MANIFEST_FORMAT

    spec = {"family": "net_put", "config": {"warps": 4}, "params": [], "block": [128, 1, 1],
            "grid": [{"constant": 1, "ceil_div": None, "max": None}] * 3, "smem_bytes": 0,
            "sizes": {}}
    other = {**spec, "family": "block_memcpy"}
    data = {"format": MANIFEST_FORMAT, "kernels": [
        {"arch": "sm_90a", "symbol": "a", "cubin": "a.cubin", "sha256": "0", "spec": spec,
         "nvshmem": "3.4.5"},
        {"arch": "sm_90a", "symbol": "b", "cubin": "b.cubin", "sha256": "0", "spec": other}]}
    manifest = Manifest(tmp_path, data)
    assert manifest.lookup("net_put[warps=4]", "sm_90a").nvshmem == "3.4.5"
    assert manifest.select("block_memcpy", "sm_90a").nvshmem is None
