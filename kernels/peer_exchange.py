"""`peer_exchange`: every rank writes a payload into every rank's mailbox, with signalling.

The transport primitive of intranode expert parallelism, over NVLink peer memory. CTA d sends the
payload to rank d: it copies it with 128-bit tiled copies into slot [my_rank] of d's mailbox
(`layouts.transport.Mailbox`), then, after a CTA barrier, one thread issues a system-scope
acquire-release fence and a system-scope release store of the round's epoch into d's flag
[my_rank]. CTA d then waits for flag [d] of its own mailbox to reach that epoch with system-scope
acquire loads. The wait is bounded by `timeout_ns` of `%globaltimer`: a rank that never arrives
makes the waiter record `missing rank + 1` in `error[0]` (first failure wins) and return, never
hang.

Peer addresses come from a device table of the mailbox's base on every rank (symmetric memory).
Flags only grow, one epoch per round, so nothing resets them. The epoch of pair (me, d) lives in
device memory (`epochs[d]`, owned by CTA d), so the launch has no per-round host argument and a
captured CUDA graph replays correctly.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.copy import copy_rows, vector_tiled_copy
from layouts import VECTOR_BYTES, byte_vectors
from layouts.abi import GridRule, KernelSpec, Param
from layouts.transport import FLAG_BYTES, Mailbox

FAMILY = "peer_exchange"


class PeerExchange:
    def __init__(self, ranks: int, threads: int = 256, vectors_per_thread: int = 4):
        self.ranks = ranks
        self.threads = threads
        self.vectors_per_thread = vectors_per_thread
        self.rows_per_tile = threads * vectors_per_thread
        self.slots_offset = Mailbox(ranks, 0).slots_offset

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"ranks": self.ranks, "threads": self.threads,
                    "vectors_per_thread": self.vectors_per_thread},
            params=(
                Param("peer_table", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("mailbox", "ptr", "uint8", align=16, writes=True),
                Param("payload", "ptr", "uint8", align=16,
                      min_elements=("num_vectors", VECTOR_BYTES)),
                Param("num_vectors", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("epochs", "ptr", "int64", align=8, writes=True, min_elements=("ranks", 1)),
                Param("timeout_ns", "i64"),
                Param("error", "ptr", "int32", align=4, writes=True),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(constant=self.ranks), GridRule(constant=1), GridRule(constant=1)),
            sizes={"slots_offset": self.slots_offset, "flag_bytes": FLAG_BYTES},
        )

    @cute.jit
    def __call__(self, peer_table: cute.Pointer, mailbox: cute.Pointer, payload: cute.Pointer,
                 num_vectors: Int32, ranks: Int32, my_rank: Int32, epochs: cute.Pointer,
                 timeout_ns: Int64, error: cute.Pointer, stream):
        self.kernel(peer_table, mailbox, payload, num_vectors, ranks, my_rank, epochs, timeout_ns,
                    error, vector_tiled_copy(self.threads)).launch(grid=(self.ranks, 1, 1), block=(self.threads, 1, 1),
                                              stream=stream)

    @cute.kernel
    def kernel(self, peer_table: cute.Pointer, mailbox: cute.Pointer, payload: cute.Pointer,
               num_vectors: Int32, ranks: Int32, my_rank: Int32, epochs: cute.Pointer,
               timeout_ns: Int64, error: cute.Pointer, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        peer, _, _ = cute.arch.block_idx()
        table = cute.make_tensor(peer_table, cute.make_layout(self.ranks))
        peer_base = table[peer]
        slot_bytes = num_vectors * VECTOR_BYTES

        # Send: payload -> slot [my_rank] of the peer's mailbox.
        slot = cute.make_ptr(cutlass.Uint8,
                             peer_base + self.slots_offset + Int64(my_rank) * Int64(slot_bytes),
                             cute.AddressSpace.gmem, assumed_align=VECTOR_BYTES)
        layout = byte_vectors(num_vectors).to_cute()
        tiler = (self.rows_per_tile, VECTOR_BYTES)
        g_src = cute.zipped_divide(cute.make_tensor(payload, layout), tiler)
        g_dst = cute.zipped_divide(cute.make_tensor(slot, layout), tiler)
        g_coord = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        for tile in cutlass.range(cute.ceil_div(num_vectors, self.rows_per_tile)):
            copy_rows(tiled_copy, tidx, g_src[((None, None), tile)], g_dst[((None, None), tile)],
                      g_coord[((None, None), tile)], num_vectors)

        # Signal: every thread's writes are ordered before the flag by the barrier, the
        # system-scope fence and the release store.
        cute.arch.sync_threads()
        if tidx == 0:
            round_epochs = cute.make_tensor(epochs, cute.make_layout(self.ranks))
            epoch = round_epochs[peer] + 1
            round_epochs[peer] = epoch
            cute.arch.fence_acq_rel_sys()
            flag = cute.make_ptr(Int64, peer_base + Int64(my_rank) * FLAG_BYTES,
                                 cute.AddressSpace.gmem, assumed_align=FLAG_BYTES)
            cute.arch.store(flag, epoch, sem="release", scope="sys")

            # Wait for rank `peer` in this rank's own mailbox, bounded in time.
            mine = cute.make_ptr(Int64, mailbox.toint() + Int64(peer) * FLAG_BYTES,
                                 cute.AddressSpace.gmem, assumed_align=FLAG_BYTES)
            start = cute.arch.globaltimer()
            arrived = cute.arch.load(mine, Int64, sem="acquire", scope="sys") >= epoch
            waited = Int64(0)
            while not arrived and waited < timeout_ns:
                arrived = cute.arch.load(mine, Int64, sem="acquire", scope="sys") >= epoch
                waited = cute.arch.globaltimer() - start
            if not arrived:
                cute.arch.atomic_cas(error, cmp=Int32(0), val=Int32(peer + 1), sem="relaxed",
                                     scope="gpu")
        cute.arch.sync_threads()
