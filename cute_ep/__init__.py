"""cute-ep: Mixture-of-Experts expert-parallel kernels, compiled ahead of time with the CuTe DSL.

The runtime needs only torch and cuda-python; the DSL is a build-time dependency.

Public surface:
- `Buffer(EPConfig(...))`: one per EP group; `dispatch` / `combine` (and their `_async` /
  `_wait` halves) returning `DispatchOutput` (expert-grouped rows + a `DispatchHandle`);
- `fused_silu`, `fused_silu_fp8`, `fused_silu_nvfp4`, `fused_silu_mxfp4`, `quantize_nvfp4`:
  the standalone kernels on torch tensors;
- `buffer_bytes(cfg)`: the GPU memory a config takes per rank, before allocating anything;
- `cute_ep.autograd.dispatch` / `combine`: the same with gradients, for training;
- everything is also a `torch.library` operator (`torch.ops.cute_ep.*`), used automatically
  under `torch.compile`, so layers compile with `fullgraph=True` and capture in CUDA graphs.
"""

__version__ = "0.1.0"

from cute_ep import torch_ops as _ops  # noqa: E402  (registers torch.ops.cute_ep.*)
from cute_ep.ep import (Buffer, ConfigMismatch, DispatchHandle, DispatchOutput,  # noqa: E402
                        PeerTimeout)
from cute_ep.nodes import NodeBuffer  # noqa: E402
from cute_ep.ops import block_memcpy, block_prefix_sum  # noqa: E402
from cute_ep.quant import quantize_nvfp4  # noqa: E402
from cute_ep.silu import (fused_silu, fused_silu_fp8, fused_silu_mxfp4,  # noqa: E402
                          fused_silu_nvfp4)
from layouts import EPConfig  # noqa: E402

del _ops


def buffer_bytes(cfg: EPConfig, channels: int | None = None) -> int:
    """Bytes of GPU memory one rank's `Buffer(cfg, sms=channels)` takes (its peer-visible rings,
    its local buffers, and one dispatch's outputs; channels defaults to the Buffer's default
    budget), computed from the layouts alone: no GPU, no allocation. `cute-ep layouts` prints
    the breakdown."""
    from layouts.buffers import total_bytes
    from layouts.channels import DEFAULT_CHANNELS

    return total_bytes(cfg, DEFAULT_CHANNELS if channels is None else channels)


__all__ = ["__version__", "Buffer", "NodeBuffer", "EPConfig", "DispatchOutput", "DispatchHandle",
           "PeerTimeout", "ConfigMismatch", "buffer_bytes", "fused_silu", "fused_silu_fp8",
           "fused_silu_nvfp4", "fused_silu_mxfp4", "quantize_nvfp4", "block_memcpy",
           "block_prefix_sum"]
