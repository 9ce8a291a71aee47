"""`store_rate`: how fast `ctas` CTAs, one an SM, write global memory and nothing else: the
ceiling of a dispatch receiver's row stores at an SM budget (`perf/bench_sm_stores.py`).

Each CTA of WARPS warps writes its own `bytes_per_cta` of `dst`, one PIECE after another, warp
w taking pieces w, w + WARPS, ...: "bulk" by bulk copies of a constant shared-memory piece
(`cp.async.bulk`, the receivers' path; at most GROUPS of a warp's stores in flight), "lanes" by
16-byte stores from registers (STEP vectors a lane at a time).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from kernels.bulk_copy import bulk_store
from kernels.copy import row_tiled_copy
from kernels.memory import gmem_ptr
from layouts.abi import GridRule, KernelSpec, Param

FAMILY = "store_rate"
MODES = ("bulk", "lanes")
WARPS = 8
WARP = 32
PIECE = 4096
GROUPS = 8
STEP = 8  # 16-byte vectors a lane stores per step ("lanes"): PIECE / (32 * 16)


class StoreRate:
    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"store_rate modes: {MODES}, not {mode!r}")
        self.mode = mode

    @property
    def smem_bytes(self) -> int:
        return WARPS * PIECE + 128 if self.mode == "bulk" else 0

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"mode": self.mode},
            params=(
                Param("dst", "ptr", "uint8", align=16, writes=True),
                Param("bytes_per_cta", "i64"),
                Param("ctas", "i32"),
            ),
            block=(WARPS * WARP, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes={"piece": PIECE},
        )

    @cute.jit
    def __call__(self, dst: cute.Pointer, bytes_per_cta: Int64, ctas: Int32, stream):
        self.kernel(dst, bytes_per_cta, ctas, row_tiled_copy(WARP, Uint8, 16)).launch(
            grid=(ctas, 1, 1), block=(WARPS * WARP, 1, 1), smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, dst: cute.Pointer, bytes_per_cta: Int64, ctas: Int32,
               copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        base = dst.toint() + Int64(cta) * bytes_per_cta
        pieces = Int32(bytes_per_cta // PIECE)
        if cutlass.const_expr(self.mode == "bulk"):
            smem = cutlass.memory.SmemAllocator()
            buf = smem.allocate_tensor(Uint8, cute.make_layout(WARPS * PIECE),
                                       byte_alignment=128)
            for i in cutlass.range(tidx, WARPS * PIECE, WARPS * WARP):
                buf[i] = Uint8(i % 251)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if lane == 0:
                for p in cutlass.range(warp, pieces, WARPS):
                    cute.arch.cp_async_bulk_wait_group(GROUPS - 1)
                    bulk_store(base + Int64(p) * PIECE, buf.iterator + warp * PIECE,
                               Int32(PIECE))
                    cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0)
        else:
            thr = copy.get_slice(lane)
            layout = cute.make_layout((PIECE // 16, 16), stride=(16, 1))
            tiler = (WARP * STEP, 16)
            for p in cutlass.range(warp, pieces, WARPS):
                g_dst = cute.zipped_divide(cute.make_tensor(
                    gmem_ptr(Uint8, base + Int64(p) * PIECE, 16), layout), tiler)
                t_dst = thr.partition_D(g_dst[((None, None), 0)])
                regs = cute.make_fragment_like(t_dst)
                regs.fill(p % 251)
                cute.copy(copy, regs, t_dst)


def store_rate_kernels() -> list:
    return [StoreRate(m) for m in MODES]
