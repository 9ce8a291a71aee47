"""`quantize_nvfp4` into the 128x4 scale layout, rows taken in quads.

In the 128x4 layout (`layouts.scales`) the scale bytes of rows j, j + 32, j + 64 and j + 96 of
a 128-row block, four columns each, are one 16-byte piece; the bytes of one row alone are 4-byte
pieces 512 bytes apart. A warp that quantizes 32 consecutive blocks of one row
(`kernels.nvfp4.QuantizeNvfp4`) stores its 32 scale bytes into 8 lines, 4 bytes in each; on one
H200 at M = 8192, I = 7168 that kernel took 49.8 us with 128x4 scales and 45.9 us with linear
ones, a 32-byte piece a warp (`perf/results/quant-2026-11-26-H200-quads.json`).

Here the rows of each segment's 128-row block are taken in quads, {j, j + 32, j + 64, j + 96}
for j < 32 (in a segment's last, partial block only the rows below its row count: quads of 1 to
3 rows, one per row of the block up to 32), and the stream of chunks runs quad by quad, within a
quad column chunk by column chunk, and within a column chunk over the quad's rows: chunk =
`32 * steps` consecutive blocks of one row (lane l takes blocks l + 32 t), `steps` KB of input
copied in by the warp's lanes with `cp.async` as whole 512-byte warp accesses. A lane keeps its
scale byte of each row of the quad in one word, and once the quad's rows of a column chunk are
done, four lanes swap bytes (3 shuffles, 3 byte permutes) so that each holds one row's four
scales of a 4-column atom: each warp store writes 8 whole 16-byte pieces, where the row-at-a-time
kernel writes 4 bytes into each of 8 lines for every row. A warp takes an equal run of the
stream's chunks (`warp_run`); a quad split between two runs has each warp write the rows it
quantized. Each warp's chunks come through a ring of shared-memory stages, `stages - 1` chunks
ahead; a block's quantization is `kernels.nvfp4.quantize_nvfp4_pairs`, the padding pass
`kernels.nvfp4.zero_padding`: the bytes are those of `QuantizeNvfp4`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.bulk_copy import cp_async_16
from kernels.memory import scale_offset, store_i32
from kernels.nvfp4 import (ATOM_ROWS, BLOCK, BLOCK_BYTES, QuantizeLaunch, _ptr,
                           quantize_nvfp4_pairs, segment_of, warp_run, zero_padding)
from kernels.scan import WARP
from layouts.scales import ATOM_BYTES, ATOM_SCALE_COLUMNS

QUAD = 4  # rows of a quad: j, j + 32, j + 64, j + 96
QUAD_STRIDE = ATOM_ROWS // QUAD  # 32 rows between a quad's rows, and quads in a block


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    """`prmt.b32`: byte i of the result is byte `selector` nibble i of (b:a)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(v).ir_value(loc=loc, ip=ip)
                                           for v in (a, b, selector)],
                                 "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def _selector_table(nibble) -> int:
    """The four lanes' 16-bit `byte_perm` selectors, lane i's at bit 16 i: nibble(i, pos) for
    result byte pos."""
    return sum(sum(nibble(i, pos) << (4 * pos) for pos in range(4)) << (16 * i)
               for i in range(4))


# `transpose_quad`'s selectors for lane i of four: the first two place byte i of the words of
# lanes i ^ d at byte i ^ d (d = 0, 1; then d = 2, 3), the third takes bytes i and i ^ 1 from
# the first and the other two from the second.
SELECTORS = tuple(_selector_table(f) for f in (
    lambda i, pos: i if pos == i else i + 4,
    lambda i, pos: i if pos == i ^ 2 else i + 4,
    lambda i, pos: pos if pos in (i, i ^ 1) else pos + 4))


@cute.jit
def transpose_selectors(i):
    """Lane i's (of four) selectors of `transpose_quad`."""
    return tuple(Int32((Int64(table) >> Int64(16 * i)) & 0xFFFF) for table in SELECTORS)


@cute.jit
def transpose_quad(word, s1, s2, s3):
    """Four lanes 4m + i each with a word whose byte r is row r's scale of column 4m + i: each
    gets the word whose byte n is row i's scale of column 4m + n (a 4x4 byte transpose)."""
    x1 = cute.arch.shuffle_sync_bfly(word, 1)
    x2 = cute.arch.shuffle_sync_bfly(word, 2)
    x3 = cute.arch.shuffle_sync_bfly(word, 3)
    return byte_perm(byte_perm(word, x1, s1), byte_perm(x2, x3, s2), s3)


class QuantizeNvfp4Quads(QuantizeLaunch):
    """quantize_nvfp4 with 128x4 scales, rows in quads (the module's docstring)."""

    order = "quads"

    def __init__(self, e2m1: str, warps: int = 16, stages: int = 2, steps: int = 2):
        super().__init__("128x4", e2m1, warps, stages, steps)

    @cute.kernel
    def kernel(self, x: cute.Pointer, row_offsets: cute.Pointer, global_scales: cute.Pointer,
               codes: cute.Pointer, scales: cute.Pointer, num_segments: Int32, rows: Int32,
               hidden: Int32, grid_ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = tidx % WARP
        stages = self.stages
        ring, table, s_off, s_first, s_gs, offset, gs_mine, valid_rows = self._start(
            row_offsets, global_scales, num_segments, rows, tidx)
        blocks = hidden // BLOCK
        me = bidx * self.warps + warp
        warps = grid_ctas * self.warps
        row_bytes = Int64(hidden) * 2
        per_row = (blocks + self.chunk - 1) // self.chunk  # column chunks of a row
        # This warp's run if every row is valid, its first chunks requested at once.
        begin, n = warp_run(me, warps, rows * per_row)
        base, quad, k, q, l_base, l_quad, l_k, l_q = self._first_loads(
            ring, warp, lane, x.toint(), rows, per_row, begin, n, blocks, row_bytes)
        total = self._tables(table, s_off, s_first, s_gs, row_offsets, num_segments, offset,
                             gs_mine, valid_rows, rows, tidx)
        if total < rows:  # a capacity: drain the first loads, split the valid rows
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()
            begin, n = warp_run(me, warps, total * per_row)
            base, quad, k, q, l_base, l_quad, l_k, l_q = self._first_loads(
                ring, warp, lane, x.toint(), total, per_row, begin, n, blocks, row_bytes)

        s1, s2, s3 = transpose_selectors(lane % QUAD)
        rk = (blocks + ATOM_SCALE_COLUMNS - 1) // ATOM_SCALE_COLUMNS
        # Lane 4m + i follows row i of the quad: its segment.
        mine = lane % QUAD
        seg = Int32(0)
        if n > 0:
            seg = segment_of(s_off, num_segments, base + mine * QUAD_STRIDE)
        words = cute.make_rmem_tensor(cute.make_layout(self.steps), Int32)
        for t in cutlass.range_constexpr(self.steps):
            words[t] = Int32(0)
        low = q  # the quad's first row this warp quantizes in this column chunk
        for i in cutlass.range(n):
            cute.arch.sync_warp()  # every lane has read the stage loaded next
            if i + stages - 1 < n:
                self._load(ring, (i + stages - 1) % stages, warp, lane, x.toint(),
                           l_base + l_q * QUAD_STRIDE, l_k, blocks, row_bytes)
                l_base, l_quad, l_k, l_q = self._next(total, per_row, l_base, l_quad, l_k,
                                                      l_q)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(stages - 1)  # this lane's pieces of chunk i are in
            cute.arch.sync_warp()  # and every other lane's
            row = base + q * QUAD_STRIDE
            gs = s_gs[cute.arch.shuffle_sync(seg, q)]
            codes_row = codes.toint() + Int64(row) * Int64(hidden // 2)
            for t in cutlass.range_constexpr(self.steps):
                col = k * self.chunk + t * WARP + lane
                if col < blocks:
                    pairs = cute.make_rmem_tensor(cute.make_layout(BLOCK // 2), Int32)
                    cute.autovec_copy(ring[None, lane + t * WARP, i % stages, warp], pairs)
                    out = cute.make_rmem_tensor(cute.make_layout(2), Int32)
                    byte = quantize_nvfp4_pairs(pairs, out, gs, self.e2m1, table)
                    cute.autovec_copy(out, cute.make_tensor(
                        _ptr(Int32, codes_row + Int64(col) * 8, 8), cute.make_layout(2)))
                    words[t] = words[t] | ((byte & 0xFF) << (8 * q))
            if (q + 1 == quad) | (i + 1 == n):
                # The quad's rows low..q of this column chunk are done: lane 4m + i writes row
                # i's scales of 4-column atom m of the chunk (if this warp quantized that row).
                unit = (s_first[seg] * ATOM_ROWS + base + mine * QUAD_STRIDE - s_off[seg])
                piece = scales.toint() + scale_offset(unit, 0, rk)
                for t in cutlass.range_constexpr(self.steps):
                    word = transpose_quad(words[t], s1, s2, s3)
                    atom = (k * self.chunk + t * WARP) // ATOM_SCALE_COLUMNS + lane // QUAD
                    if (mine >= low) & (mine <= q) & (atom < rk):
                        store_i32(piece + Int64(atom) * ATOM_BYTES, word)
                    words[t] = Int32(0)
                low = Int32(0)
            if i + 1 < n:
                base, quad, k, q = self._next(total, per_row, base, quad, k, q)
                if k + q == 0:  # a new quad: each lane's row moved on by one or 97
                    while (seg + 1 < num_segments) & (base + mine * QUAD_STRIDE
                                                        >= s_off[seg + 1]):
                        seg = seg + 1

        # The padding last, after this warp's blocks (the flushes wrote whole 4-column words,
        # padding columns included).
        zero_padding(scales, s_off, s_first, num_segments, blocks, me, warps, lane,
                     columns_written=True)

    @cute.jit
    def _first_loads(self, ring: cute.Tensor, warp, lane, x_base, total, per_row, begin, n,
                     blocks, row_bytes):
        """The `stages - 1` chunks from `begin` of a run of `n` (stream of `total` rows), one
        group each (empty past the run); returns the position (base, quad, k, q) of the run's
        first chunk, then that of the chunk after them."""
        base, quad, k, q = Int32(0), Int32(0), Int32(0), Int32(0)
        if n > 0:
            base, quad, k, q = self._position(total, per_row, begin)
        l_base, l_quad, l_k, l_q = base, quad, k, q
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < n:
                self._load(ring, s, warp, lane, x_base, l_base + l_q * QUAD_STRIDE, l_k, blocks,
                           row_bytes)
                l_base, l_quad, l_k, l_q = self._next(total, per_row, l_base, l_quad, l_k, l_q)
            cute.arch.cp_async_commit_group()
        return base, quad, k, q, l_base, l_quad, l_k, l_q

    @cute.jit
    def _position(self, total, per_row, chunk):
        """(the quad's first row, its rows, column chunk, row of the quad) of stream chunk
        `chunk` over `total` rows: T // 128 whole blocks first, 32 quads of 4 rows each
        (4 * per_row chunks a quad); the last block's T % 128 = 32 a + b rows make b quads of
        a + 1 rows, then 32 - b of a (if a > 0)."""
        whole = total // ATOM_ROWS * ATOM_ROWS * per_row  # chunks of the whole blocks
        base = Int32(0)
        quad = Int32(QUAD)
        rest = Int32(0)  # the chunk within its quad
        if chunk < whole:
            block = chunk // (ATOM_ROWS * per_row)
            rest = chunk - block * (ATOM_ROWS * per_row)
            j = rest // (QUAD * per_row)
            rest = rest - j * (QUAD * per_row)
            base = block * ATOM_ROWS + j
        else:
            left = chunk - whole
            tail = total % ATOM_ROWS
            a = tail // QUAD_STRIDE
            b = tail % QUAD_STRIDE
            longer = b * (a + 1) * per_row  # chunks of the b quads of a + 1 rows
            j = Int32(0)
            if left < longer:
                quad = a + 1
                j = left // (quad * per_row)
                rest = left - j * (quad * per_row)
            else:
                quad = a
                j = (left - longer) // (quad * per_row)
                rest = left - longer - j * (quad * per_row)
                j = j + b
            base = total // ATOM_ROWS * ATOM_ROWS + j
        k = rest // quad
        return base, quad, k, rest - k * quad

    @cute.jit
    def _next(self, total, per_row, base, quad, k, q):
        """The chunk after (base, quad, k, q): the quad's next row, else the next column
        chunk's first, else the next quad's (past the stream's end if there is none)."""
        q = q + 1
        if q == quad:
            q = Int32(0)
            k = k + 1
            if k == per_row:
                k = Int32(0)
                # The next j of the block, or the next block's first.
                base = base + 1
                if base % QUAD_STRIDE == 0:
                    base = base + (ATOM_ROWS - QUAD_STRIDE)
                quad = cutlass.min((total - base + QUAD_STRIDE - 1) // QUAD_STRIDE, QUAD)
        return base, quad, k, q

    @cute.jit
    def _load(self, ring: cute.Tensor, s, warp, lane, x_base, row, k, blocks, row_bytes):
        """This lane's pieces of column chunk `k` of `row` into stage s: bytes 16 lane + 512 j
        of the chunk, at the same offsets in the stage; pieces of columns past `blocks` are not
        copied."""
        stage = ring[None, None, s, warp].iterator
        src = x_base + Int64(row) * row_bytes + Int64(k * self.chunk * BLOCK_BYTES + lane * 16)
        for j in cutlass.range_constexpr(2 * self.steps):
            if k * self.chunk + (lane + j * WARP) // 2 < blocks:
                cp_async_16(stage + (lane * 4 + j * (WARP * 4)), src + j * (WARP * 16))
