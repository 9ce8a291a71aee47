"""cute-ep: Mixture-of-Experts expert-parallel kernels, compiled ahead of time with the CuTe DSL.

The runtime needs only torch and cuda-python; the DSL is a build-time dependency.
"""

__version__ = "0.1.0"

from cute_ep.ops import block_memcpy, block_prefix_sum  # noqa: E402

__all__ = ["__version__", "block_memcpy", "block_prefix_sum"]
