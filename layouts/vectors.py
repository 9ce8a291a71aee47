"""A byte buffer seen as rows of 128-bit vectors: the unit every copy in cute-ep moves."""

import cutlass.cute as cute

# One 128-bit access per thread: the widest global load/store on Hopper and Blackwell.
VECTOR_BYTES = 16


def byte_vectors(num_vectors):
    """`(num_vectors, 16) : (16, 1)`: row v holds bytes [16 v, 16 v + 16) of the buffer."""
    return cute.make_layout((num_vectors, VECTOR_BYTES), stride=(VECTOR_BYTES, 1))
