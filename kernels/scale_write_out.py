"""`scale_write_out`: phase 4 of `ep_dispatch` alone (`kernels.dispatch.scales`), for measuring
and profiling it on one GPU (`perf/bench_scale_write_out.py`): `ctas` CTAs of the dispatch's
warps write staged scale rows (`scale_rows`, row-major) into the output's scale layout (FP8
transposed [H / 128, row_capacity] fp32, NVFP4 the 128x4 layout with every segment on fresh
128-row blocks), exactly as a dispatch does once its round is done. The segment layout a
dispatch's receivers derive from the counts (`s_off`, `s_raw`, `s_first`) comes in as arguments:
row offsets [segments + 1], rows [segments] and, for NVFP4, first 128-row blocks [segments + 1].
The code that runs is the dispatch's own (`EpDispatch._write_scales`), so a change to it shows
here as in the dispatch.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8

from kernels.dispatch import EpDispatch
from kernels.dispatch.common import MAX_SEGMENTS, WARP, WIDE_MIN_ROWS
from layouts.abi import GridRule, KernelSpec, Param

FAMILY = "scale_write_out"
SEGMENT_WORDS = 3 * (MAX_SEGMENTS + 4)  # s_off, s_raw, s_first


class ScaleWriteOut(EpDispatch):
    """The write-out of a bulk-receiving `EpDispatch(fmt)` (FP8 or NVFP4, sm_90a's software
    e2m1 for NVFP4: the write-out does not depend on it)."""

    def __init__(self, fmt: str):
        if fmt not in ("fp8", "nvfp4"):
            raise ValueError(f"scale_write_out formats: fp8, nvfp4, not {fmt!r}")
        super().__init__(fmt, bulk=True, e2m1="software" if fmt == "nvfp4" else None)

    @property
    def write_out_smem_bytes(self) -> int:
        pieces, piece = self.ring_shape
        tiles = 0 if self.tiles_in_ring else 4 * self.tile_words
        return 4 * SEGMENT_WORDS + pieces * piece + tiles + 3 * 128

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family=FAMILY,
            config={"format": self.fmt},
            params=(
                Param("scale_rows", "ptr", "int32", align=16),
                Param("scales", "ptr", "uint8" if self.fmt == "nvfp4" else "float32",
                      align=16, writes=True),
                # [segments + 1] row offsets and first blocks, [segments] rows (the caller
                # keeps segments <= MAX_SEGMENTS).
                Param("seg_off", "ptr", "int32", align=4, min_elements=("segments", 1)),
                Param("seg_raw", "ptr", "int32", align=4, min_elements=("segments", 1)),
                Param("seg_first", "ptr", "int32", align=4, min_elements=("segments", 1)),
                Param("segments", "i32"),
                Param("payload_vectors", "i32"),
                Param("row_capacity", "i32"),
                Param("ctas", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.write_out_smem_bytes,
            # For callers without the DSL: the message vectors, the segments the shared memory
            # holds, the rows from which the wide tiles run.
            sizes={"vector_bytes": self.vector_bytes, "max_segments": MAX_SEGMENTS,
                   "wide_min_rows": WIDE_MIN_ROWS},
        )

    @cute.jit
    def __call__(self, scale_rows: cute.Pointer, scales: cute.Pointer, seg_off: cute.Pointer,
                 seg_raw: cute.Pointer, seg_first: cute.Pointer, segments: Int32,
                 payload_vectors: Int32, row_capacity: Int32, ctas: Int32, stream):
        self.kernel(scale_rows, scales, seg_off, seg_raw, seg_first, segments, payload_vectors,
                    row_capacity, ctas).launch(grid=(ctas, 1, 1), block=(self.threads, 1, 1),
                                               smem=self.write_out_smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, scale_rows: cute.Pointer, scales: cute.Pointer, seg_off: cute.Pointer,
               seg_raw: cute.Pointer, seg_first: cute.Pointer, segments: Int32,
               payload_vectors: Int32, row_capacity: Int32, ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        smem = cutlass.memory.SmemAllocator()
        s_off = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_raw = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4),
                                       byte_alignment=16)
        pieces, piece = self.ring_shape
        s_ring = smem.allocate_tensor(Uint8, cute.make_layout(pieces * piece), byte_alignment=128)
        if cutlass.const_expr(self.tiles_in_ring):
            s_tile = cute.make_tensor(cute.recast_ptr(s_ring.iterator, dtype=Int32),
                                      cute.make_layout(self.tile_words))
        else:
            s_tile = smem.allocate_tensor(Int32, cute.make_layout(self.tile_words),
                                          byte_alignment=16)
        offsets = cute.make_tensor(seg_off, cute.make_layout(segments + 1))
        firsts = cute.make_tensor(seg_first, cute.make_layout(segments + 1))
        raws = cute.make_tensor(seg_raw, cute.make_layout(segments))
        for g in cutlass.range(tidx, segments + 1, self.threads):
            s_off[g] = offsets[g]
            s_first[g] = firsts[g]
            if g < segments:
                s_raw[g] = raws[g]
        cute.arch.sync_threads()
        # Rows staged a row at a time (the harness stages no messages).
        self._write_scales(warp, lane, cta, ctas, scales, scale_rows, s_off, s_raw, s_first,
                           s_tile, segments, row_capacity, payload_vectors, False, scale_rows,
                           s_raw, Int32(1), Int32(0))


def scale_write_out_kernels() -> list:
    return [ScaleWriteOut("nvfp4"), ScaleWriteOut("fp8")]
