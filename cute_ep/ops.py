"""The standalone kernels as functions on torch tensors."""

from __future__ import annotations

import torch

from cute_ep.runtime.launch import check_tensor, runtime

VECTOR_BYTES = 16


def block_memcpy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy `src` into `dst` with 128-bit accesses; returns `dst`.

    Both must be contiguous CUDA tensors on the same device, 16-byte aligned, with the same
    number of bytes, a multiple of 16 (dtypes may differ: the bytes are copied as they are).
    """
    for name, t in (("dst", dst), ("src", src)):
        check_tensor(t, name=f"block_memcpy: {name}", dtype=None)
    nbytes = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != nbytes:
        raise ValueError(f"block_memcpy: dst has {dst.numel() * dst.element_size()} bytes, "
                         f"src has {nbytes}")
    if nbytes % VECTOR_BYTES:
        raise ValueError(f"block_memcpy: the byte count must be a multiple of {VECTOR_BYTES}, "
                         f"got {nbytes}")
    if dst.device != src.device:
        raise ValueError(f"block_memcpy: dst is on {dst.device}, src on {src.device}")
    kernel = runtime().select("block_memcpy", src.device)
    limit = kernel.spec.sizes["max_bytes"]
    if nbytes >= limit:
        raise ValueError(f"block_memcpy: {nbytes} bytes is over the kernel's limit of {limit - 1}")
    kernel.launch(dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8),
                  nbytes // VECTOR_BYTES)
    return dst


def block_prefix_sum(counts: torch.Tensor, exclusive: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Inclusive (default) or exclusive prefix sum of a 1-D int32 CUDA tensor.

    `out[i] = counts[0] + ... + counts[i]` (inclusive) or `... + counts[i-1]` (exclusive), with
    int32 wrap-around on overflow like the hardware. Both tensors must be 16-byte aligned.
    """
    check_tensor(counts, name="block_prefix_sum: counts", dtype="int32", align=16)
    if counts.dim() != 1:
        raise ValueError(f"block_prefix_sum: counts must be 1-D, got shape {tuple(counts.shape)}")
    if out is None:
        out = torch.empty_like(counts)
    elif out.shape != counts.shape:
        raise ValueError(f"block_prefix_sum: out has shape {tuple(out.shape)}, "
                         f"counts {tuple(counts.shape)}")
    kernel = runtime().select("block_prefix_sum", counts.device, exclusive=bool(exclusive))
    limit = kernel.spec.sizes["max_elements"]
    if counts.numel() > limit:
        raise ValueError(f"block_prefix_sum: {counts.numel()} elements is over the kernel's "
                         f"limit of {limit}")
    kernel.launch(out, counts, counts.numel())
    return out
