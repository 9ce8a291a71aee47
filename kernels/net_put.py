"""`net_put`: bytes moved between GPUs through NVSHMEM, the engine of the transport between nodes.

The bytes are `nbytes` of this PE's `src`, plus `row_bytes` times the int32 count at `src`'s
first word where `row_bytes` is positive (a slot whose header says how many rows follow it,
written on the device before the launch, so no host needs to know it). `ctas` CTAs share them,
CTA c the c-th run (runs begin on 16-byte boundaries; the last ends with the bytes). Each CTA
puts its run, all its threads together, into the same place of `dst` at PE `peer` (a symmetric
address: the same offset in every PE's NVSHMEM heap) with a signal: once those bytes have landed
there, one is added to the peer's `signal` word (`nvshmemx_putmem_signal_nbi_block` with
NVSHMEM_SIGNAL_ADD, then `nvshmem_quiet`). Thread 0 of CTA 0 then waits for this PE's own
`signal` to reach the value at `value` (an int64 in device memory: the CTAs' signals expected
since the word was zero, so that a CUDA graph replay reads each round's), as the dispatch waits
for a peer (`_wait_at_least`: bounded by `timeout_ns` of `%globaltimer`): a peer that never puts
makes it record `peer + 1` in `error` (the dispatch's error record, `layouts.buffers
.ERROR_FIELDS`; the first failure wins) and return, never hang.

Two PEs that launch it at each other exchange their buffers; with the value = the round times
the peer's CTAs (the signal words only grow) the same buffers serve round after round. Between
GPUs of one host NVSHMEM moves the bytes over NVLink; between hosts over the network.

Built ahead of time like every kernel here: NVSHMEM's device library (LLVM bitcode of
`nvidia-nvshmem-cu13`) is linked into the cubin (`kernels.build`), and the runtime initialises
the loaded module for NVSHMEM (`cute_ep.runtime.nvshmem`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint64

from kernels.dispatch.common import _wait_at_least
from kernels.memory import gmem_ptr, load_i32
from layouts.abi import GridRule, KernelSpec, Param

try:  # nvshmem4py's CuTe DSL device bindings: needed to build this kernel only
    import nvshmem.bindings.device.cute as nvshmem_device
except ImportError:  # pragma: no cover - the build extra installs it
    nvshmem_device = None

FAMILY = "net_put"
WARP = 32
SIGNAL_ADD = 10  # NVSHMEM_SIGNAL_ADD: the signal word grows by the value
PHASE_NET = 0  # the error record's phase: neither a dispatch's nor a combine's


class NetPut:
    # `kernels.build` links NVSHMEM's device library into this kernel's cubin; the manifest
    # marks it so that the runtime initialises its module for NVSHMEM after loading it.
    nvshmem = True

    def __init__(self, warps: int = 32):
        self.warps = warps

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"warps": self.warps},
            params=(
                Param("dst", "ptr", "uint8", align=16, writes=True),
                Param("src", "ptr", "uint8", align=16),
                Param("signal", "ptr", "int64", align=8, writes=True),
                Param("error", "ptr", "int32", align=4, writes=True),
                Param("nbytes", "i64"),
                Param("row_bytes", "i64"),
                Param("value", "ptr", "int64", align=8),
                Param("timeout_ns", "i64"),
                Param("peer", "i32"),
                Param("ctas", "i32"),
            ),
            block=(self.warps * WARP, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
        )

    @cute.jit
    def __call__(self, dst: cute.Pointer, src: cute.Pointer, signal: cute.Pointer,
                 error: cute.Pointer, nbytes: Int64, row_bytes: Int64, value: cute.Pointer,
                 timeout_ns: Int64, peer: Int32, ctas: Int32, stream):
        self.kernel(dst, src, signal, error, nbytes, row_bytes, value, timeout_ns, peer,
                    ctas).launch(
            grid=(ctas, 1, 1), block=(self.warps * WARP, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, dst: cute.Pointer, src: cute.Pointer, signal: cute.Pointer,
               error: cute.Pointer, nbytes: Int64, row_bytes: Int64, value: cute.Pointer,
               timeout_ns: Int64, peer: Int32, ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if row_bytes > 0:
            nbytes = nbytes + Int64(load_i32(src.toint())) * row_bytes
        vectors = nbytes // 16
        first = vectors * Int64(cta) // Int64(ctas) * 16
        end = vectors * Int64(cta + 1) // Int64(ctas) * 16
        if cta == ctas - 1:
            end = nbytes
        run = end - first
        # Every thread of the CTA takes part (a block put: on one host each copies its share
        # over NVLink with its own loads and stores, so the rate follows the threads: 128 MiB
        # from 24 CTAs in 1286 us at 4 warps a CTA, 496 at 32, perf/results/
        # net-put-2026-11-27-2xH200-warps.json; between hosts NVSHMEM's proxy sends it).
        # NVSHMEM's declarations take byte pointers of alignment 1 and a uint64 signal.
        nvshmem_device.putmem_signal_nbi_block(
            gmem_ptr(cutlass.Int8, dst.toint() + first, 1),
            gmem_ptr(cutlass.Int8, src.toint() + first, 1), Uint64(run),
            gmem_ptr(Uint64, signal.toint(), 8), Uint64(1), Int32(SIGNAL_ADD), peer)
        nvshmem_device.quiet()
        if tidx == 0 and cta == 0:
            target = cute.arch.load(gmem_ptr(Int64, value.toint(), 8), Int64, sem="relaxed",
                                    scope="gpu")
            _wait_at_least(signal.toint(), target, timeout_ns, error, peer, Int32(PHASE_NET))
        cute.arch.sync_threads()
