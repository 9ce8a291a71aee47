"""`row_expand`: copy each message into several rows, the receive side of dispatch on its own, in
several ways, to measure what an SM can move each way (`perf/bench_row_expand.py`).

Message m (`msg_bytes` bytes at src + m * msg_bytes) goes to rows m * copies .. m * copies +
copies - 1 of dst (rows `msg_bytes` apart). CTA c takes messages c, c + ctas, ...

- mode "warps": WARPS warps, each taking every WARPS-th of the CTA's messages; a warp loads a
  tile of the message into registers (TILE_VECTORS 16-byte vectors per lane, all loads in
  flight) and stores it to every row, as dispatch's receiver warps do.
- mode "bulk": one thread drives a ring of shared-memory stages: a bulk load (global ->
  shared, `cp.async.bulk`, completion on the stage's mbarrier) runs `stages - 2` messages ahead
  of the bulk stores (shared -> each row); a stage is reloaded once its stores have read it.
- mode "mixed": both at once in one CTA, as dispatch runs its sender beside its receivers: one
  bulk-copy thread takes the CTA's even messages, WARPS warps its odd ones.
- mode "bulk2": two bulk-copy threads (in two warps, half the stages each) take the even and
  the odd messages: a sender and a receiver that both copy in bulk.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from kernels.bulk_copy import bulk_load, bulk_store
from kernels.copy import row_predicate, row_tiled_copy
from kernels.memory import gmem_ptr
from layouts.abi import GridRule, KernelSpec, Param

FAMILY = "row_expand"
WARP = 32
WARPS = 8
TILE_VECTORS = 32
VECTOR = 16
MODES = ("warps", "bulk", "mixed", "bulk2")
# Per mode: (warps of register copies, bulk-copy threads).
SHAPE = {"warps": (WARPS, 0), "bulk": (0, 1), "mixed": (WARPS, 1), "bulk2": (0, 2)}


class RowExpand:
    def __init__(self, mode: str, stage_bytes: int = 192 * 1024):
        if mode not in MODES:
            raise ValueError(f"row_expand modes: {MODES}, not {mode!r}")
        self.mode = mode
        self.copy_warps, self.drivers = SHAPE[mode]
        self.stage_bytes = stage_bytes if self.drivers else 0
        self.threads = WARP * (self.drivers + self.copy_warps)

    @property
    def smem_bytes(self) -> int:
        return self.stage_bytes + 8 * 64 + 128 if self.drivers else 0

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"mode": self.mode},
            params=(
                Param("src", "ptr", "uint8", align=16),
                Param("dst", "ptr", "uint8", align=16, writes=True),
                Param("msgs", "i32"),
                Param("msg_bytes", "i32"),
                Param("copies", "i32"),
                Param("ctas", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            # msg_bytes: a multiple of 16; with bulk copies at most stage_bytes / (3 x threads).
            sizes={"stage_bytes": self.stage_bytes, "vector_bytes": VECTOR},
        )

    @cute.jit
    def __call__(self, src: cute.Pointer, dst: cute.Pointer, msgs: Int32, msg_bytes: Int32,
                 copies: Int32, ctas: Int32, stream):
        self.kernel(src, dst, msgs, msg_bytes, copies, ctas,
                    row_tiled_copy(WARP, Uint8, VECTOR)).launch(
            grid=(ctas, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Pointer, dst: cute.Pointer, msgs: Int32, msg_bytes: Int32,
               copies: Int32, ctas: Int32, warp_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        parts = (self.drivers + (1 if self.copy_warps else 0))
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(self.drivers > 0):
            ring = smem.allocate_tensor(Uint8, cute.make_layout(self.stage_bytes),
                                        byte_alignment=128)
            full = smem.allocate_array(Int64, 64)
            share = self.stage_bytes // self.drivers
            stages = cutlass.min(share // msg_bytes, 64 // self.drivers)
            if tidx == 0:
                for s in cutlass.range(stages * self.drivers):
                    cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if warp < self.drivers and tidx % WARP == 0:
                self._bulk(warp, parts, cta, src, dst, msgs, msg_bytes, copies, ctas,
                           ring.iterator + warp * share, full + warp * stages, stages)
        if cutlass.const_expr(self.copy_warps > 0):
            if warp >= self.drivers:
                self._warps(warp - self.drivers, parts - 1, parts, tidx % WARP, cta, src, dst,
                            msgs, msg_bytes, copies, ctas, warp_copy)

    @cute.jit
    def _warps(self, warp, part, parts, lane, cta, src: cute.Pointer, dst: cute.Pointer, msgs,
               msg_bytes, copies, ctas, warp_copy: cute.TiledCopy):
        """The CTA's messages part, part + parts, ..., every WARPS-th of them per warp."""
        vectors = msg_bytes // VECTOR
        layout = cute.make_layout((vectors, VECTOR), stride=(VECTOR, 1))
        tiler = (WARP * TILE_VECTORS, VECTOR)
        g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = warp_copy.get_slice(lane)
        tiles = cute.ceil_div(vectors, WARP * TILE_VECTORS)
        for m in cutlass.range(cta + (part + warp * parts) * ctas, msgs, ctas * parts * WARPS):
            g_src = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                Uint8, src.toint() + Int64(m) * Int64(msg_bytes), 16), layout), tiler)
            for tile in cutlass.range(tiles):
                pred = row_predicate(thr.partition_S(g_crd[((None, None), tile)]), vectors)
                t_src = thr.partition_S(g_src[((None, None), tile)])
                regs = cute.make_fragment_like(t_src)
                cute.copy(warp_copy, t_src, regs, pred=pred)
                for k in cutlass.range(copies):
                    g_dst = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                        Uint8, dst.toint() + (Int64(m) * Int64(copies) + Int64(k))
                        * Int64(msg_bytes), 16), layout), tiler)
                    cute.copy(warp_copy, regs, thr.partition_D(g_dst[((None, None), tile)]),
                              pred=pred)

    @cute.jit
    def _bulk(self, part, parts, cta, src: cute.Pointer, dst: cute.Pointer, msgs, msg_bytes,
              copies, ctas, ring: cute.Pointer, full: cute.Pointer, stages):
        """One thread: the CTA's messages part, part + parts, ..., through `stages` stages of
        `msg_bytes` at `ring` (mbarriers at `full`)."""
        n = (msgs - cta - part * ctas + parts * ctas - 1) // (parts * ctas)
        lag = stages - 2  # stores run this many messages behind loads
        for i in cutlass.range(n + lag):
            if i < n:
                # Stage i % stages last held message i - stages, whose stores were issued before
                # the newest one: all but that group have read shared memory.
                cute.arch.cp_async_bulk_wait_group(1, read=True)
                s = i % stages
                cute.arch.mbarrier_arrive_and_expect_tx(full + s, msg_bytes)
                bulk_load(ring + s * msg_bytes,
                          src.toint() + Int64(cta + (part + i * parts) * ctas) * Int64(msg_bytes),
                          msg_bytes, full + s)
            j = i - lag
            if j >= 0:
                m = cta + (part + j * parts) * ctas
                s = j % stages
                cute.arch.mbarrier_wait(full + s, (j // stages) % 2)
                for k in cutlass.range(copies):
                    bulk_store(dst.toint() + (Int64(m) * Int64(copies) + Int64(k))
                               * Int64(msg_bytes), ring + s * msg_bytes, msg_bytes)
                cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0)


def row_expand_kernels() -> list:
    return [RowExpand(mode) for mode in MODES]
