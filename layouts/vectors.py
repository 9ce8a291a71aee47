"""A byte buffer seen as rows of 128-bit vectors: the unit every copy in cute-ep moves."""

from layouts.algebra import Layout

# One 128-bit access per thread: the widest global load/store on Hopper and Blackwell.
VECTOR_BYTES = 16


def byte_vectors(num_vectors) -> Layout:
    """`(num_vectors, 16) : (16, 1)`: row v holds bytes [16 v, 16 v + 16) of the buffer."""
    return Layout((num_vectors, VECTOR_BYTES), (VECTOR_BYTES, 1))
