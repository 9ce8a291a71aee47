"""`block_prefix_sum`: inclusive or exclusive scan of int32 counts by one CTA.

The building block of `row_offsets`: one block walks the input in tiles of
`threads * 4` elements, each thread owning 4 consecutive counts (one 128-bit access). A tile is
scanned in registers (per thread), across each warp (shuffles) and across warps (shared memory),
then offset by the running total of the tiles before it. Full tiles move through a 128-bit tiled
copy; the last, partial tile through a 32-bit one with a predicate per element, so any length
works without touching memory past the end.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from kernels.scan import WARP, warp_inclusive_sum
from layouts.abi import GridRule, KernelSpec, Param

FAMILY = "block_prefix_sum"
VALUES_PER_THREAD = 4  # 4 x int32 = one 128-bit access


class BlockPrefixSum:
    def __init__(self, exclusive: bool, threads: int = 512):
        if threads % WARP or threads // WARP > WARP:
            raise ValueError(f"threads must be a multiple of {WARP} and at most {WARP * WARP}")
        self.exclusive = exclusive
        self.threads = threads
        self.warps = threads // WARP
        self.tile = threads * VALUES_PER_THREAD

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"exclusive": self.exclusive, "threads": self.threads},
            params=(
                Param("out", "ptr", "int32", align=16, writes=True, min_elements=("n", 1)),
                Param("counts", "ptr", "int32", align=16, min_elements=("n", 1)),
                Param("n", "i32"),
            ),
            block=(self.threads, 1, 1),
            # One CTA scans everything; an empty input launches nothing.
            grid=(GridRule(ceil_div=("n", 1), max=1),
                  GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            # 32-bit tile arithmetic: keep (tile index + 1) * tile clear of overflow.
            sizes={"elements_per_tile": self.tile, "max_elements": 1 << 30},
        )

    @property
    def smem_bytes(self) -> int:
        # Warp totals, then their exclusive prefix and the tile total.
        return (self.warps + 1) * 4

    @cute.jit
    def __call__(self, out: cute.Pointer, counts: cute.Pointer, n: Int32, stream):
        thr_layout = cute.make_layout(self.threads)
        val_layout = cute.make_layout(VALUES_PER_THREAD)
        wide = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128),
            thr_layout, val_layout)
        narrow = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=32),
            thr_layout, val_layout)
        self.kernel(out, counts, n, wide, narrow).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Pointer, counts: cute.Pointer, n: Int32,
               wide: cute.TiledCopy, narrow: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        smem = cutlass.memory.SmemAllocator()
        s_warp = smem.allocate_tensor(Int32, cute.make_layout(self.warps + 1), byte_alignment=16)

        layout = cute.make_layout(n)
        g_in = cute.zipped_divide(cute.make_tensor(counts, layout), (self.tile,))
        g_out = cute.zipped_divide(cute.make_tensor(out, layout), (self.tile,))
        g_coord = cute.zipped_divide(cute.make_identity_tensor(layout.shape), (self.tile,))

        carry = Int32(0)
        num_tiles = cute.ceil_div(n, self.tile)
        for t in cutlass.range(num_tiles):
            full = (t + 1) * self.tile <= n
            vals = cute.make_fragment_like(wide.get_slice(tidx).partition_S(g_in[(None, t)]))
            if full:
                cute.copy(wide, wide.get_slice(tidx).partition_S(g_in[(None, t)]), vals)
            else:
                self._load_partial(narrow, tidx, g_in[(None, t)], g_coord[(None, t)], n, vals)

            # Scan this thread's values in registers.
            scanned = cute.make_fragment_like(vals)
            running = Int32(0)
            for i in cutlass.range_constexpr(VALUES_PER_THREAD):
                running = running + vals[i]
                scanned[i] = running

            # Inclusive scan of the thread totals across the warp.
            warp_incl = warp_inclusive_sum(running, lane)
            if lane == WARP - 1:
                s_warp[warp] = warp_incl
            cute.arch.sync_threads()

            # The first warp turns the warp totals into exclusive offsets and the tile total.
            if warp == 0:
                total = Int32(0)
                if lane < self.warps:
                    total = s_warp[lane]
                incl = warp_inclusive_sum(total, lane)
                tile_total = cute.arch.shuffle_sync(incl, WARP - 1)
                if lane < self.warps:
                    s_warp[lane] = incl - total
                if lane == 0:
                    s_warp[self.warps] = tile_total
            cute.arch.sync_threads()

            base = carry + s_warp[warp] + warp_incl - running
            for i in cutlass.range_constexpr(VALUES_PER_THREAD):
                value = base + scanned[i]
                if cutlass.const_expr(self.exclusive):
                    value = value - vals[i]
                scanned[i] = value
            carry = carry + s_warp[self.warps]
            # Everyone has read this tile's shared totals before the next tile overwrites them.
            cute.arch.sync_threads()

            if full:
                cute.copy(wide, scanned, wide.get_slice(tidx).partition_D(g_out[(None, t)]))
            else:
                self._store_partial(narrow, tidx, scanned, g_out[(None, t)], g_coord[(None, t)], n)

    # Partial tiles: 32-bit accesses, one predicate per element. Register fragments of the wide
    # and the narrow partition hold the same 4 values in the same flat order.
    @cute.jit
    def _predicate(self, thr, coord, n):
        t_coord = thr.partition_S(coord)  # ((1, 4), 1): one element per access
        pred = cute.make_rmem_tensor(
            cute.make_layout((cute.size(t_coord, mode=[0, 1]), cute.size(t_coord, mode=[1]))),
            cutlass.Boolean)
        for i in cutlass.range_constexpr(cute.size(pred, mode=[0])):
            pred[i, 0] = cute.elem_less(t_coord[(0, i), 0], n)
        return pred

    @cute.jit
    def _load_partial(self, narrow: cute.TiledCopy, tidx, g_tile, coord, n, vals):
        thr = narrow.get_slice(tidx)
        t_src = thr.partition_S(g_tile)
        regs = cute.make_fragment_like(t_src)
        regs.fill(0)
        cute.copy(narrow, t_src, regs, pred=self._predicate(thr, coord, n))
        for i in cutlass.range_constexpr(VALUES_PER_THREAD):
            vals[i] = regs[i]

    @cute.jit
    def _store_partial(self, narrow: cute.TiledCopy, tidx, vals, g_tile, coord, n):
        thr = narrow.get_slice(tidx)
        t_dst = thr.partition_D(g_tile)
        regs = cute.make_fragment_like(t_dst)
        for i in cutlass.range_constexpr(VALUES_PER_THREAD):
            regs[i] = vals[i]
        cute.copy(narrow, regs, t_dst, pred=self._predicate(thr, coord, n))
