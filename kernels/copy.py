"""Copy building blocks shared by the kernels: 128-bit tiled copies over rows of vectors."""

import cutlass
import cutlass.cute as cute

from layouts import VECTOR_BYTES


def row_tiled_copy(threads: int, dtype, elements: int, op=None) -> cute.TiledCopy:
    """One row of `elements` values of `dtype` per thread per access, the row moved by one
    access of `op` (default `CopyUniversalOp`: 128 bits for 16 bytes; `cpasync.CopyG2SOp()` for
    an asynchronous global -> shared copy); call in `@cute.jit`."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp() if op is None else op, dtype,
                               num_bits_per_copy=elements * dtype.width)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads, 1), stride=(1, 0)),
                                   cute.make_layout((1, elements), stride=(0, 1)))


def vector_tiled_copy(threads: int) -> cute.TiledCopy:
    """One 16-byte row per thread per access (`CopyUniversalOp`, 128 bits); call in `@cute.jit`."""
    return row_tiled_copy(threads, cutlass.Uint8, VECTOR_BYTES)


@cute.jit
def row_predicate(t_coord: cute.Tensor, num_rows):
    """One predicate per access of a thread's partition: its row is below `num_rows`.
    Profile (ATOM_REST, REST...) of the partition."""
    pred = cute.make_rmem_tensor(
        cute.make_layout((1, cute.size(t_coord, mode=[1]), cute.size(t_coord, mode=[2]))),
        cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(pred, mode=[1])):
        pred[0, i, 0] = cute.elem_less(t_coord[(0, 0), i, 0][0], num_rows)
    return pred


@cute.jit
def copy_rows(tiled_copy: cute.TiledCopy, tidx, src: cute.Tensor, dst: cute.Tensor,
              coord: cute.Tensor, num_rows):
    """Copy one tile of 16-byte rows, rows at or past `num_rows` predicated off.

    `src`, `dst` and `coord` (the identity tensor's tile) share the tile's shape; every load of
    the thread is issued before its first store.
    """
    thr_copy = tiled_copy.get_slice(tidx)
    t_src = thr_copy.partition_S(src)
    t_dst = thr_copy.partition_D(dst)
    pred = row_predicate(thr_copy.partition_S(coord), num_rows)
    regs = cute.make_fragment_like(t_src)
    cute.copy(tiled_copy, t_src, regs, pred=pred)
    cute.copy(tiled_copy, regs, t_dst, pred=pred)
