"""`bulk_send`: a chunked all-to-all through shared memory with `cp.async.bulk` (Hopper's bulk
copy engine, no tensor map), the transport's building block for many bytes in flight per SM.

Each CTA owns the chunks `cta, cta + ctas, ...` of the (chunk, destination) list, destinations
rotated by this rank so that ranks start on different peers. One thread drives a ring of
`stages` shared-memory buffers: a bulk load (global -> shared, completion on the stage's
mbarrier) runs `stages - 2` chunks ahead of the bulk store (shared -> the destination's global
memory, which may be a peer GPU's NVLink-mapped buffer). A stage is reloaded once the store that
read it has finished *reading* shared memory, so the stores in flight over NVLink are not
bounded by shared memory. The CTA waits for all its stores to complete before it exits.

Source: `layouts.transport.bulk_chunks(chunk, chunks, R)` with rank = destination; each
destination d receives the same layout with rank = source at `peer_bases[d]`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from layouts.abi import GridRule, KernelSpec, Param
from layouts.transport import bulk_chunks

FAMILY = "bulk_send"


def _shared_address(ptr: cute.Pointer, loc, ip):
    """The 32-bit shared-window address of a shared-memory pointer."""
    return llvm.ptrtoint(T.i32(), ptr.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def evict_first_policy(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy that marks the lines a load brings in as the first to evict: for
    input read once, which then replaces its own lines instead of what L2 held before."""
    return Int64(llvm.inline_asm(T.i64(), [], "createpolicy.fractional.L2::evict_first.b64 $0;",
                                 "=l", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def bulk_load(dst: cute.Pointer, src_addr: Int64, nbytes: Int32, mbar: cute.Pointer,
              policy=None, *, loc=None, ip=None) -> None:
    """`cp.async.bulk` of `nbytes` (a multiple of 16, any runtime value) from global address
    `src_addr` into shared memory at `dst`, completing as transaction bytes on `mbar`. Both
    addresses 16-byte aligned. `policy`: an L2 cache policy (`evict_first_policy`), if any."""
    args = [_shared_address(dst, loc, ip), Int64(src_addr).ir_value(loc=loc, ip=ip),
            Int32(nbytes).ir_value(loc=loc, ip=ip), _shared_address(mbar, loc, ip)]
    text = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    if policy is None:
        text, constraints = text + " [$0], [$1], $2, [$3];", "r,l,r,r"
    else:
        args.append(Int64(policy).ir_value(loc=loc, ip=ip))
        text, constraints = text + ".L2::cache_hint [$0], [$1], $2, [$3], $4;", "r,l,r,r,l"
    llvm.inline_asm(None, args, text, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16(dst: cute.Pointer, src_addr: Int64, *, loc=None, ip=None) -> None:
    """`cp.async` of 16 bytes from global address `src_addr` into shared memory at `dst` (both
    16-byte aligned, through L2 only), in the thread's current group: complete for this thread
    after `cp_async_wait_group`, for the others after a barrier that follows it. (No L2 cache
    hint: the DSL's ptxas compiled `.L2::cache_hint` here into an LDGSTS that faulted.)"""
    llvm.inline_asm(None, [_shared_address(dst, loc, ip), Int64(src_addr).ir_value(loc=loc, ip=ip)],
                    "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16_fill(dst: cute.Pointer, src_addr: Int64, src_bytes: Int32, *, loc=None,
                     ip=None) -> None:
    """`cp_async_16` that reads only the first `src_bytes` (0 or 16) at `src_addr` and writes
    zeros over the rest of the 16 bytes at `dst`: with 0 nothing is read, so `src_addr` need only
    be a valid address."""
    llvm.inline_asm(None, [_shared_address(dst, loc, ip), Int64(src_addr).ir_value(loc=loc, ip=ip),
                           Int32(src_bytes).ir_value(loc=loc, ip=ip)],
                    "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def bulk_prefetch_l2(src_addr: Int64, nbytes: Int32, *, loc=None, ip=None) -> None:
    """`cp.async.bulk.prefetch.L2` of `nbytes` (a multiple of 16) at global address `src_addr`
    (16-byte aligned): the lines are brought into L2 and nothing waits for them, so a later load
    of them costs an L2 hit instead of a trip to HBM."""
    llvm.inline_asm(None, [Int64(src_addr).ir_value(loc=loc, ip=ip),
                           Int32(nbytes).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def init_stage_barriers(bars: cute.Pointer, stages: cutlass.Constexpr, leader):
    """`leader` initialises the `stages` mbarriers at `bars`, each completed by one arrival (the
    filler's expect_tx) and its bulk copy's bytes, and fences them for the async proxy; the
    caller's barrier then makes them visible to the threads that wait on them."""
    if leader:
        for s in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(bars + s, 1)
        cute.arch.mbarrier_init_fence()


@dsl_user_op
def bulk_store(dst_addr: Int64, src: cute.Pointer, nbytes: Int32, *, loc=None, ip=None) -> None:
    """`cp.async.bulk` of `nbytes` (a multiple of 16, any runtime value) from shared memory at
    `src` to global address `dst_addr` (a peer GPU's NVLink-mapped memory too), in the current
    bulk async-group. Both addresses 16-byte aligned."""
    llvm.inline_asm(None, [Int64(dst_addr).ir_value(loc=loc, ip=ip), _shared_address(src, loc, ip),
                           Int32(nbytes).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
                    "l,r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _gmem(addr, nbytes):
    ptr = cute.make_ptr(Uint8, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(nbytes))


def _whole(tensor):
    """One mode holding the whole tensor: a bulk copy moves it as a single operation."""
    return cute.group_modes(tensor, 0, cute.rank(tensor))


class BulkSend:
    def __init__(self, chunk_bytes: int = 16384, stages: int = 8, pull: bool = False):
        """`pull`: the same all-to-all driven by the receiver: each CTA bulk-loads its chunks
        from the peers' buffers (`peer_bases[s]`, laid out by destination) into shared memory
        and bulk-stores them into this rank's buffer (`src`, laid out by source): the two
        directions a transport can move its payloads over NVLink, side by side."""
        if stages < 2:
            raise ValueError("bulk_send needs at least 2 stages")
        self.chunk_bytes = chunk_bytes
        self.stages = stages
        self.pull = pull

    @property
    def smem_bytes(self) -> int:
        return self.chunk_bytes * self.stages + 8 * self.stages + 256

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"chunk_bytes": self.chunk_bytes, "stages": self.stages,
                    "pull": int(self.pull)},
            params=(
                Param("peer_bases", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("src", "ptr", "uint8", align=16),
                Param("chunks", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("ctas", "i32"),
            ),
            block=(32, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes={"chunk_bytes": self.chunk_bytes},
        )

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, src: cute.Pointer, chunks: Int32, ranks: Int32,
                 my_rank: Int32, ctas: Int32, stream):
        self.kernel(peer_bases, src, chunks, ranks, my_rank, ctas).launch(
            grid=(ctas, 1, 1), block=(32, 1, 1), smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, peer_bases: cute.Pointer, src: cute.Pointer, chunks: Int32, ranks: Int32,
               my_rank: Int32, ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        stages, chunk = self.stages, self.chunk_bytes
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint8, cute.make_layout((chunk, stages)), byte_alignment=128)
        full = smem.allocate_array(Int64, stages)
        load = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Uint8)
        store = cute.make_copy_atom(cpasync.CopyBulkS2GOp(), Uint8)
        init_stage_barriers(full, stages, tidx == 0)
        cute.arch.sync_threads()
        peers = cute.make_tensor(peer_bases, cute.make_layout(ranks))
        layout = bulk_chunks(chunk, chunks, ranks).to_cute()
        n = (ranks * chunks - cta + ctas - 1) // ctas
        if tidx == 0:
            lag = stages - 2  # stores run this many chunks behind loads
            for i in cutlass.range(n + lag):
                if i < n:
                    # Stage i % stages last held chunk i - stages; stores were issued up to
                    # i - 1 - lag = i + 1 - stages, so all but the newest have read shared memory.
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
                    item = cta + i * ctas
                    dest = (item + my_rank) % ranks
                    s = i % stages
                    g = _gmem(src.toint() + Int64(layout((0, item // ranks, dest))), chunk)
                    if cutlass.const_expr(self.pull):  # `dest` is the source rank here
                        g = _gmem(peers[dest] + Int64(layout((0, item // ranks, my_rank))), chunk)
                    cute.arch.mbarrier_arrive_and_expect_tx(full + s, chunk)
                    cute.copy(load, _whole(g), _whole(ring[None, s]), mbar_ptr=full + s)
                j = i - lag
                if j >= 0:
                    item = cta + j * ctas
                    dest = (item + my_rank) % ranks
                    s = j % stages
                    cute.arch.mbarrier_wait(full + s, (j // stages) % 2)
                    g = _gmem(peers[dest] + Int64(layout((0, item // ranks, my_rank))), chunk)
                    if cutlass.const_expr(self.pull):
                        g = _gmem(src.toint() + Int64(layout((0, item // ranks, dest))), chunk)
                    cute.copy(store, _whole(ring[None, s]), _whole(g))
                    cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0)
