"""NVSHMEM, the engine of the transport between nodes: bootstrapped over a torch.distributed
process group, its symmetric memory as torch tensors, and the modules of kernels that call it
initialised once they load.

`init(group)` (every rank of the group, once a process, on its CUDA device): rank 0 makes
NVSHMEM's unique id and the group broadcasts it, so `torchrun` on several hosts needs nothing
more; every rank joins as the PE of its rank in the group. NVSHMEM's own environment variables
choose the network between hosts (`NVSHMEM_REMOTE_TRANSPORT`, `NVSHMEM_IB_ENABLE_IBGDA`, ...);
between GPUs of one host it moves bytes over NVLink. Needs the `multinode` extra
(`nvshmem4py-cu13`, `nvidia-nvshmem-cu13`).
"""

from __future__ import annotations

import torch

__all__ = ["NvshmemUnavailable", "free", "host_version", "init", "init_module", "state",
           "symmetric_bytes"]

_STATE: dict | None = None


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM's Python package is not installed."""


def _core():
    try:
        import nvshmem.core as core
    except ImportError as exc:
        raise NvshmemUnavailable(
            "the transport between nodes runs on NVSHMEM: pip install 'cute-ep[multinode]' "
            "(nvshmem4py-cu13 and nvidia-nvshmem-cu13)") from exc
    return core


def state() -> dict | None:
    """This process's NVSHMEM membership ({"pe", "npes", "device"}), None before `init`."""
    return _STATE


def init(group=None) -> dict:
    """Join NVSHMEM as this rank of `group` (default: the world) on the current CUDA device, and
    return `state()`. Every rank of the group must call it (it is collective). A second call
    with a group of the same size and rank returns at once; another group is refused (NVSHMEM
    joins once a process)."""
    global _STATE
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("NVSHMEM is bootstrapped over torch.distributed: call "
                           "torch.distributed.init_process_group first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if _STATE is not None:
        if (_STATE["pe"], _STATE["npes"]) != (rank, world):
            raise RuntimeError(f"NVSHMEM was joined as PE {_STATE['pe']} of {_STATE['npes']}; "
                               f"this process cannot join again as rank {rank} of {world}")
        return _STATE
    core = _core()
    from cuda.core import Device

    index = torch.cuda.current_device()
    uid = core.get_unique_id(empty=rank != 0)
    box = [uid]
    root = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=root, group=group, device=torch.device("cuda", index))
    device = Device(index)
    device.set_current()
    core.init(device=device, uid=box[0], rank=rank, nranks=world, initializer_method="uid")
    _STATE = {"pe": rank, "npes": world, "device": index}
    return _STATE


def host_version() -> str | None:
    """The version of the NVSHMEM host library this process opens (as NVSHMEM reports it;
    the installed `nvidia-nvshmem-cu13`'s if it cannot be asked), None without NVSHMEM."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _core().get_version().libnvshmem_version
    except Exception:  # no package, or a host library nvshmem4py cannot open
        try:
            return version("nvidia-nvshmem-cu13")
        except PackageNotFoundError:
            return None


def init_module(module, key: str, built_with: str) -> None:
    """Initialise a loaded CUmodule of a kernel that calls NVSHMEM (`key`: its configuration,
    for errors; `built_with`: the NVSHMEM version whose device library it links): NVSHMEM's
    device-side state in it (this PE, the heap). `init` comes first, and the host library must
    be the version the cubin was built with (NVSHMEM refuses any other)."""
    if _STATE is None:
        raise RuntimeError(f"{key} calls NVSHMEM: call cute_ep.runtime.nvshmem.init(group) on "
                           f"every rank before its first launch")
    host = host_version()
    if host != built_with:
        raise RuntimeError(
            f"{key} was built against NVSHMEM {built_with}, but this process has "
            f"nvidia-nvshmem-cu13 {host}: install nvidia-nvshmem-cu13=={built_with}, or "
            f"rebuild the library here (cute-ep build) with the NVSHMEM you have")
    from nvshmem import bindings

    status = bindings.cumodule_init(int(module))
    if status:
        raise RuntimeError(f"NVSHMEM could not initialise the module of {key} "
                           f"(nvshmemx_cumodule_init returned {status})")


def symmetric_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in NVSHMEM's symmetric heap: at the same offset of every PE's
    heap when every rank allocates the same sizes in the same order (the allocation is
    collective). Release it with `free`."""
    if _STATE is None:
        raise RuntimeError("call cute_ep.runtime.nvshmem.init(group) before allocating")
    return _core().bytetensor((nbytes,), dtype=torch.uint8)


def free(tensor: torch.Tensor) -> None:
    """Release a `symmetric_bytes` tensor (collective, like the allocation)."""
    _core().free_tensor(tensor)
