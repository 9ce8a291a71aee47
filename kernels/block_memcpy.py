"""`block_memcpy`: copy a byte buffer whose length is a multiple of 16, 128 bits per access.

The buffer is viewed as rows of 16 bytes (`layouts.byte_vectors`). A CTA owns a tile of
`threads * vectors_per_thread` rows; a tiled copy gives each thread `vectors_per_thread` rows,
strided by `threads` so that a warp's accesses are contiguous, all loads issued before the first
store. Rows past the end are predicated off, so any multiple of 16 bytes is copied exactly.
"""

import cutlass.cute as cute
from cutlass import Int32

from kernels.copy import copy_rows, vector_tiled_copy
from layouts import VECTOR_BYTES, byte_vectors
from layouts.abi import GridRule, KernelSpec, Param

FAMILY = "block_memcpy"


class BlockMemcpy:
    def __init__(self, threads: int = 256, vectors_per_thread: int = 4):
        self.threads = threads
        self.vectors_per_thread = vectors_per_thread
        self.rows_per_tile = threads * vectors_per_thread

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"threads": self.threads, "vectors_per_thread": self.vectors_per_thread},
            params=(
                Param("dst", "ptr", "uint8", align=VECTOR_BYTES, writes=True,
                      min_elements=("num_vectors", VECTOR_BYTES)),
                Param("src", "ptr", "uint8", align=VECTOR_BYTES,
                      min_elements=("num_vectors", VECTOR_BYTES)),
                Param("num_vectors", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("num_vectors", self.rows_per_tile)),
                  GridRule(constant=1), GridRule(constant=1)),
            # Byte offsets are 32-bit in the kernel.
            sizes={"bytes_per_tile": self.rows_per_tile * VECTOR_BYTES, "max_bytes": 1 << 31},
        )

    @cute.jit
    def __call__(self, dst: cute.Pointer, src: cute.Pointer, num_vectors: Int32, stream):
        self.kernel(dst, src, num_vectors, vector_tiled_copy(self.threads)).launch(
            grid=(cute.ceil_div(num_vectors, self.rows_per_tile), 1, 1),
            block=(self.threads, 1, 1),
            stream=stream,
        )

    # Tensors are built inside the kernel from raw pointers so that the kernel's parameters
    # stay the flat (pointer, pointer, int32) ABI the manifest records.
    @cute.kernel
    def kernel(self, dst: cute.Pointer, src: cute.Pointer, num_vectors: Int32,
               tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        layout = byte_vectors(num_vectors).to_cute()
        tiler = (self.rows_per_tile, VECTOR_BYTES)
        tile = ((None, None), bidx)
        copy_rows(tiled_copy, tidx,
                  cute.zipped_divide(cute.make_tensor(src, layout), tiler)[tile],
                  cute.zipped_divide(cute.make_tensor(dst, layout), tiler)[tile],
                  cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)[tile],
                  num_vectors)
