"""CuTe layouts of cute-ep's buffers.

Every buffer a kernel touches is described here once, as a CuTe layout; kernels and the build
take their shapes, strides and byte sizes from these functions. Each function works on plain
Python integers (for the build and the tests) and on DSL integers (inside a `@cute.jit`).
"""

from layouts.vectors import VECTOR_BYTES, byte_vectors

__all__ = ["VECTOR_BYTES", "byte_vectors"]
