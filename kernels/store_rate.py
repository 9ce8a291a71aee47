"""`store_rate`: how fast `ctas` CTAs, one an SM, write global memory and nothing else: the
ceiling of a dispatch receiver's row stores at an SM budget (`perf/bench_sm_stores.py`).
`load_rate`: the same for reading (a combine's reads of the expert rows).

Each CTA of WARPS warps writes its own `bytes_per_cta` of `dst`, one PIECE after another, warp
w taking pieces w, w + WARPS, ...: "bulk" by bulk copies of a constant shared-memory piece
(`cp.async.bulk`, the receivers' path; at most GROUPS of a warp's stores in flight), "lanes" by
16-byte stores from registers (STEP vectors a lane at a time).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from kernels.bulk_copy import bulk_store, cp_async_16
from kernels.copy import row_tiled_copy
from kernels.memory import gmem_ptr, load_i32, store_i32, take_ticket
from kernels.placement import sm_id
from layouts.abi import GridRule, KernelSpec, Param
from layouts.buffers import PLACE_SLOTS

FAMILY = "store_rate"
MODES = ("bulk", "lanes")
WARPS = 8
WARP = 32
PIECE = 4096
GROUPS = 8
STEP = 8  # 16-byte vectors a lane stores per step ("lanes"): PIECE / (32 * 16)
LOAD_DEPTH = 4  # pieces a warp of `load_rate` has in flight: 16 KiB, 128 KiB a CTA


def _rate_spec(family: str, mode: str, buffers: tuple, smem_bytes: int) -> KernelSpec:
    """The ABI of a rate kernel: its buffers, then `bytes_per_cta` and `ctas`; one CTA of WARPS
    warps per `ctas`."""
    return KernelSpec(
        family=family,
        config={"mode": mode},
        params=buffers + (Param("bytes_per_cta", "i64"), Param("ctas", "i32")),
        block=(WARPS * WARP, 1, 1),
        grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
        smem_bytes=smem_bytes,
        sizes={"piece": PIECE},
    )


class StoreRate:
    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"store_rate modes: {MODES}, not {mode!r}")
        self.mode = mode

    @property
    def smem_bytes(self) -> int:
        return WARPS * PIECE + 128 if self.mode == "bulk" else 0

    def spec(self) -> KernelSpec:
        return _rate_spec(FAMILY, self.mode, (Param("dst", "ptr", "uint8", align=16, writes=True),),
                          self.smem_bytes)

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


class LoadRate:
    """Each CTA of WARPS warps reads its own `bytes_per_cta` of `src`, PIECE by PIECE, warp w
    taking pieces w, w + WARPS, ...: each lane copies its STEP 16-byte vectors of a piece into
    the warp's shared memory by `cp.async` (the combine's loads), LOAD_DEPTH pieces a warp in
    flight, then reads them back and folds them into a running XOR, which each thread writes to
    `sums` [ctas, WARPS * 32] (so no load is dropped, and a test can check that every word was
    read once)."""

    smem_bytes = WARPS * LOAD_DEPTH * PIECE

    def spec(self) -> KernelSpec:
        return _rate_spec("load_rate", "cp.async", (
            Param("src", "ptr", "uint8", align=16), Param("sums", "ptr", "int32", writes=True)),
            self.smem_bytes)

    @cute.jit
    def __call__(self, src: cute.Pointer, sums: cute.Pointer, bytes_per_cta: Int64, ctas: Int32,
                 stream):
        self.kernel(src, sums, bytes_per_cta, ctas).launch(
            grid=(ctas, 1, 1), block=(WARPS * WARP, 1, 1), smem=self.smem_bytes, stream=stream)

    @cute.jit
    def _issue(self, slots: cute.Tensor, warp, lane, base, p, slot):
        for v in cutlass.range_constexpr(STEP):
            at = (v * WARP + lane) * 16
            cp_async_16(slots.iterator + ((warp * LOAD_DEPTH + slot) * PIECE + at),
                        base + Int64(p) * PIECE + at)

    @cute.kernel
    def kernel(self, src: cute.Pointer, sums: cute.Pointer, bytes_per_cta: Int64, ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        smem = cutlass.memory.SmemAllocator()
        slots = smem.allocate_tensor(Uint8, cute.make_layout(WARPS * LOAD_DEPTH * PIECE),
                                     byte_alignment=128)
        words = cute.make_tensor(cute.recast_ptr(slots.iterator, dtype=Int32),
                                 cute.make_layout(WARPS * LOAD_DEPTH * PIECE // 4))
        base = src.toint() + Int64(cta) * bytes_per_cta
        pieces = Int32(bytes_per_cta // PIECE)
        mine = Int32(0)
        if warp < pieces:
            mine = (pieces - warp + WARPS - 1) // WARPS
        for k in cutlass.range_constexpr(LOAD_DEPTH - 1):
            if k < mine:
                self._issue(slots, warp, lane, base, warp + k * WARPS, k)
            cute.arch.cp_async_commit_group()
        acc = Int32(0)
        for i in cutlass.range(mine):
            ahead = i + LOAD_DEPTH - 1
            if ahead < mine:
                self._issue(slots, warp, lane, base, warp + ahead * WARPS, ahead % LOAD_DEPTH)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(LOAD_DEPTH - 1)  # this lane's vectors of piece i
            at = (warp * LOAD_DEPTH + i % LOAD_DEPTH) * (PIECE // 4)
            for v in cutlass.range_constexpr(STEP):
                for k in cutlass.range_constexpr(4):
                    acc = acc ^ words[at + (v * WARP + lane) * 4 + k]
        store_i32(sums.toint() + (Int64(cta) * (WARPS * WARP) + Int64(tidx)) * 4, acc)


def store_rate_kernels() -> list:
    return [StoreRate(m) for m in MODES] + [LoadRate()]


PLACE_WARPS = (8, 16, 32)
# PLACE_SLOTS (layouts.buffers): CTAs a store_place launch records, and SM indices its `allowed`
# table covers.


class StorePlace:
    """What bounds the per-SM store rate: the warps a CTA stores from and the SMs it runs on.

    `ctas` CTAs of `warps` warps; each writes its SM index to `smids[cta]` and the pieces it
    wrote to `smids[PLACE_SLOTS + cta]` (at most PLACE_SLOTS CTAs). A CTA works when
    `allowed[its SM index]` (int32, PLACE_SLOTS entries) is not 0, then counts itself in `claims[1]`; its warps take 4 KiB
    pieces of `dst` in turn from the ticket `claims[0]` until all `pieces` are written (piece p
    holds the byte p % 251, stored 16 bytes a lane), so the CTAs that work share the bytes by
    their speed."""

    def __init__(self, warps: int):
        if warps not in PLACE_WARPS:
            raise ValueError(f"store_place warps: {PLACE_WARPS}, not {warps}")
        self.warps = warps

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="store_place",
            config={"warps": self.warps},
            params=(Param("dst", "ptr", "uint8", align=16, writes=True),
                    Param("smids", "ptr", "int32", writes=True),
                    Param("claims", "ptr", "int32", writes=True),
                    Param("allowed", "ptr", "int32"),
                    Param("pieces", "i32"), Param("ctas", "i32")),
            block=(self.warps * WARP, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=0,
            sizes={"piece": PIECE},
        )

    @cute.jit
    def __call__(self, dst: cute.Pointer, smids: cute.Pointer, claims: cute.Pointer,
                 allowed: cute.Pointer, pieces: Int32, ctas: Int32, stream):
        self.kernel(dst, smids, claims, allowed, pieces, ctas,
                    row_tiled_copy(WARP, Uint8, 16)).launch(
            grid=(ctas, 1, 1), block=(self.warps * WARP, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, dst: cute.Pointer, smids: cute.Pointer, claims: cute.Pointer,
               allowed: cute.Pointer, pieces: Int32, ctas: Int32, copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        sm = sm_id()
        if tidx == 0:
            store_i32(smids.toint() + Int64(cta) * 4, sm)
        if load_i32(allowed.toint() + Int64(sm) * 4) != 0:
            if tidx == 0:
                take_ticket(claims.toint() + 4)
            thr = copy.get_slice(lane)
            layout = cute.make_layout((PIECE // 16, 16), stride=(16, 1))
            tiler = (WARP * STEP, 16)
            ticket = Int32(0)
            if lane == 0:
                ticket = take_ticket(claims.toint())
            p = cute.arch.shuffle_sync(ticket, 0)
            done = Int32(0)
            while p < pieces:
                done += 1
                if lane == 0:
                    ticket = take_ticket(claims.toint())
                g_dst = cute.zipped_divide(cute.make_tensor(
                    gmem_ptr(Uint8, dst.toint() + Int64(p) * PIECE, 16), layout), tiler)
                t_dst = thr.partition_D(g_dst[((None, None), 0)])
                regs = cute.make_fragment_like(t_dst)
                regs.fill(p % 251)
                cute.copy(copy, regs, t_dst)
                p = cute.arch.shuffle_sync(ticket, 0)
            if lane == 0:
                cute.arch.atomic_add(gmem_ptr(Int32, smids.toint() + Int64(PLACE_SLOTS + cta) * 4, 4),
                                     done, sem="relaxed", scope="gpu")


def store_place_kernels() -> list:
    return [StorePlace(w) for w in PLACE_WARPS]
