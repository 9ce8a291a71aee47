"""Phase 4 of `ep_dispatch` (FP8 and NVFP4, packed rows), scales: once every CTA has finished the
round, all warps write `scale_rows` into the output's scale layout (FP8 transposed, NVFP4 128x4)
a tile of whole lines at a time."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.dispatch.common import (BATCH, FP8_BLOCK, MAX_SEGMENTS, NVFP4_BLOCK, PIECE, PIECES,
                                     SEND_WARPS, SPLIT_MIN_WARPS, TILE_COLS, TILE_ROWS,
                                     TILE_STRIDE, WARP, WIDE_MIN_ROWS)
from kernels.bulk_copy import bulk_prefetch_l2, cp_async_16_fill
from kernels.memory import gmem_ptr, load_i32, scale_offset, store_i32
from kernels.nvfp4 import segment_of
from layouts.buffers import (NARROW_TILE_CHUNKS, NARROW_TILE_WORDS, WIDE_TILE_CHUNKS,
                             WIDE_TILE_ROWS, WIDE_TILE_WORDS, narrow_tile_word,
                             scale_rows_layout, wide_tile_word)
from layouts.scales import ATOM_BYTES, ATOM_ROWS

PAIR = 2  # FP8 tiles a warp loads before storing the first
# Registers a lane holds of the segments' first blocks (`_block_segment`): MAX_SEGMENTS over
# a warp's lanes.
SEGMENT_REGS = (MAX_SEGMENTS + WARP - 1) // WARP
LOAD_STEP = WARP // WIDE_TILE_CHUNKS  # rows one warp-wide 16-byte load covers in a wide tile
NARROW_LOAD_STEP = WARP // NARROW_TILE_CHUNKS  # rows one warp-wide 16-byte load covers
NARROW_HALF = PIECES * PIECE // 8  # words of one narrow tile, half a receiver warp's pieces


class ScalesPhase:
    """The scales' write-out."""

    @cute.jit
    def _scale_word(self, word, c, scale_cols):
        """Scale word c as stored: NVFP4's last word keeps only its valid columns."""
        if cutlass.const_expr(self.fmt == "nvfp4"):
            valid = scale_cols - c * 4
            if valid < 4:
                word = word & ((Int32(1) << (valid * 8)) - 1)
        return word

    @cute.jit
    def _message_scales(self, segment_rows, s_off: cute.Tensor, segments, scales: cute.Pointer,
                        scale_rows: cute.Pointer, payload_vectors, ranks, max_tokens,
                        row_capacity):
        """Whether this dispatch's NVFP4 receivers stage each message's scales once, in row
        s * max_tokens + t of `scale_rows` for source s's token t (SCALES_MESSAGES), and the
        write-out gathers every output row's from its message (`_write_narrow`), instead of a
        staged copy a row: packed rows of at least WIDE_MIN_ROWS in all (the narrow write-out),
        whole 16-byte staged rows, the placer/mover split (at most two ranks: a row's source is
        then the first unless the row lies past the first source's rows), and a `scale_rows` of
        at least ranks * max_tokens rows. Read from the row layout every CTA derives alike: the
        same answer in every receiver and at the kernel's end."""
        on = False
        if cutlass.const_expr(self.fmt == "nvfp4" and self.tiles_in_ring):
            words = self._staged_words(payload_vectors)
            scale_cols = payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK
            per_source = cutlass.min(self.recv_warps // ranks, BATCH)
            on = (segment_rows == 0 and s_off[segments] >= WIDE_MIN_ROWS
                  and s_off[segments] <= row_capacity and words % 4 == 0
                  and scale_cols % 4 == 0 and scale_rows.toint() % 16 == 0
                  and scales.toint() % 16 == 0 and per_source >= SPLIT_MIN_WARPS and ranks <= 2
                  and Int64(ranks) * Int64(max_tokens) <= Int64(row_capacity))
        return on

    @cute.jit
    def _write_scales(self, warp, lane, channel, active, scales: cute.Pointer,
                      scale_rows: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                      s_first: cute.Tensor, s_tile: cute.Tensor, segments, row_capacity,
                      payload_vectors, messages, src_info: cute.Pointer, s_totals: cute.Tensor,
                      ranks, max_tokens):
        """Once every CTA's receivers are done: the received rows' scales from `scale_rows` into
        the output's layout. Bulk receivers (`tiles_in_ring`) of at least WIDE_MIN_ROWS rows
        whose staged rows are whole 16-byte chunks take wide tiles (`_write_wide`), everything
        else `_write_tiles`. `messages` (`_message_scales`): NVFP4's scales were staged a
        message at a time."""
        if cutlass.const_expr(self.tiles_in_ring):
            words = self._staged_words(payload_vectors)
            aligned = (s_off[segments] >= WIDE_MIN_ROWS and words % 4 == 0
                       and scale_rows.toint() % 16 == 0 and scales.toint() % 16 == 0)
            if cutlass.const_expr(self.fmt == "fp8"):
                # A lane stores four rows of a block at once: whole groups of four rows.
                aligned = aligned and row_capacity % 4 == 0 and s_off[segments] % 4 == 0
            if aligned:
                if warp >= SEND_WARPS:
                    if cutlass.const_expr(self.fmt == "nvfp4"):
                        if messages:
                            self._write_narrow_messages(
                                warp - SEND_WARPS, lane, channel, active, scales, scale_rows,
                                s_off, s_raw, s_first, s_tile, segments, words, src_info,
                                s_totals, ranks, max_tokens)
                        else:
                            self._write_narrow(warp - SEND_WARPS, lane, channel, active,
                                               scales, scale_rows, s_off, s_raw, s_first,
                                               s_tile, segments, words)
                    else:
                        self._write_wide(warp - SEND_WARPS, lane, channel, active, scales,
                                         scale_rows, s_off, segments, s_tile, row_capacity,
                                         words)
            else:
                self._write_tiles(warp, lane, channel, active, scales, scale_rows, s_off, s_raw,
                                  s_first, s_tile, segments, row_capacity, payload_vectors)
        else:
            self._write_tiles(warp, lane, channel, active, scales, scale_rows, s_off, s_raw,
                              s_first, s_tile, segments, row_capacity, payload_vectors)

    def _staged_words(self, payload_vectors):
        """Words of a staged scale row: FP8's blocks, NVFP4's 4-scale columns."""
        if self.fmt == "fp8":
            return payload_vectors * self.vector_bytes // FP8_BLOCK
        return (payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK + 3) // 4

    @cute.jit
    def _write_wide(self, rw, lane, channel, active, scales: cute.Pointer,
                    scale_rows: cute.Pointer, s_off: cute.Tensor, segments, s_tile: cute.Tensor,
                    row_capacity, words):
        """FP8's write-out by the receiver warps, a wide tile at a time in the first
        WIDE_TILE_ROWS x WIDE_TILE_WORDS words of the warp's own pieces: staged rows q * 128 ..
        by WIDE_TILE_WORDS columns from c0. Each load is a 16-byte cp.async, 8 lanes a row, so
        a warp's load covers four whole 128-byte lines; the tiles shared out over every
        receiver warp of every CTA. A lane stores a 16-byte run of the transposed output (rows
        4l .. 4l + 3 of one block)."""
        gw = channel * self.recv_warps + rw
        nw = active * self.recv_warps
        tile = s_tile.iterator + rw * (PIECES * PIECE // 4)
        tiles_c = (words + WIDE_TILE_WORDS - 1) // WIDE_TILE_WORDS
        row_bytes = Int64(words) * 4
        rows = s_off[segments]
        n_units = (rows + WIDE_TILE_ROWS - 1) // WIDE_TILE_ROWS * tiles_c
        # Lane l reads back rows 4 l + p, 16 bytes of each: in the tile's swizzle
        # (`wide_tile_word`) those rows' chunk c lies at a fixed stride from row 4 l's, and a
        # quarter-warp's lanes read different bank groups.
        mine = cute.make_layout((4, 4), stride=(WIDE_TILE_WORDS, 1))
        w = cute.make_rmem_tensor(cute.make_layout((4, 4), stride=(4, 1)), Int32)
        four = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for u in cutlass.range(gw, n_units, nw):
            q = u // tiles_c
            c0 = u % tiles_c * WIDE_TILE_WORDS
            r0 = q * WIDE_TILE_ROWS
            valid = rows - r0
            self._load_wide(tile, lane, scale_rows.toint(), r0, row_bytes, valid, words - c0,
                            c0)
            out_at = scales.toint() + (Int64(r0) + Int64(lane * 4)) * 4  # + column * rows
            for c in cutlass.range_constexpr(WIDE_TILE_CHUNKS):
                if c0 + c * 4 < words:
                    cute.autovec_copy(cute.make_tensor(
                        (tile + wide_tile_word(lane * 4, c)).align(16), mine), w)
                    for j in cutlass.range_constexpr(4):
                        if c0 + c * 4 + j < words:
                            for p in cutlass.range_constexpr(4):
                                four[p] = w[p, j]
                            if lane * 4 < valid:
                                cute.autovec_copy(four, cute.make_tensor(gmem_ptr(
                                    Int32, out_at + Int64(c0 + c * 4 + j)
                                    * Int64(row_capacity) * 4, 16), cute.make_layout(4)))
            cute.arch.sync_warp()  # read back before the next tile's loads overwrite it

    @cute.jit
    def _write_narrow(self, rw, lane, channel, active, scales: cute.Pointer,
                      scale_rows: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                      s_first: cute.Tensor, s_tile: cute.Tensor, segments, words):
        """NVFP4's write-out by the receiver warps through two narrow tiles a warp (the halves
        of its pieces): NARROW_TILE_WORDS columns of a 128-row block each, the next unit's
        loads in flight while this one's atoms are stored. A unit is column tile u % tiles_c
        of block u // tiles_c, and H 7168's 112 columns are seven whole tiles (no half tile)."""
        gw, nw, tile, tiles_c, row_bytes, n_units, base, starts = self._narrow_units(
            rw, lane, channel, active, scale_rows, s_first, s_tile, segments, words)
        dq = nw // tiles_c
        dc = nw % tiles_c
        # The unit being loaded (ql, cl) runs one ahead of the unit being stored (q, cq).
        q = gw // tiles_c
        cq = gw % tiles_c
        if gw < n_units:
            self._load_narrow(tile, lane, base, starts, s_off, s_raw, s_first, q, cq, row_bytes,
                              words)
        cute.arch.cp_async_commit_group()
        ql, cl = self._next_unit(q, cq, dq, dc, tiles_c)
        i = Int32(0)
        for u in cutlass.range(gw, n_units, nw):
            if u + nw < n_units:
                self._load_narrow(tile + ((i + 1) & 1) * NARROW_HALF, lane, base, starts, s_off,
                                  s_raw, s_first, ql, cl, row_bytes, words)
            self._store_landed(tile + (i & 1) * NARROW_HALF, lane, q, cq, scales, words)
            i += 1
            q = ql
            cq = cl
            ql, cl = self._next_unit(ql, cl, dq, dc, tiles_c)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _narrow_units(self, rw, lane, channel, active, scale_rows: cute.Pointer,
                      s_first: cute.Tensor, s_tile: cute.Tensor, segments, words):
        """What both narrow write-outs start from: (gw, nw, tile, tiles_c, row_bytes, n_units,
        base, starts): this warp's index among the nw receiver warps of the active channels,
        its two narrow tiles (NARROW_HALF words apart), the column tiles a block, a staged
        row's bytes, the units (blocks x column tiles), the staged rows' address, and the
        segments' first blocks in registers (`_load_segment_starts`)."""
        gw = channel * self.recv_warps + rw
        nw = active * self.recv_warps
        tile = s_tile.iterator + rw * (PIECES * PIECE // 4)
        tiles_c = (words + NARROW_TILE_WORDS - 1) // NARROW_TILE_WORDS
        row_bytes = Int64(words) * 4
        n_units = s_first[segments] * tiles_c
        base = scale_rows.toint()
        starts = cute.make_rmem_tensor(cute.make_layout(SEGMENT_REGS), Int32)
        self._load_segment_starts(starts, s_first, segments, lane)
        return gw, nw, tile, tiles_c, row_bytes, n_units, base, starts

    @cute.jit
    def _store_landed(self, now, lane, q, cq, scales: cute.Pointer, words):
        """The narrow write-outs' step once the next unit's loads are issued: those committed,
        the unit at `now` waited for (its loads were the group before), stored as atoms
        (`_store_narrow`), and read back before the loads two units on overwrite it."""
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(1)
        cute.arch.sync_warp()
        self._store_narrow(now, lane, q, cq, scales, words)
        cute.arch.sync_warp()

    @cute.jit
    def _store_narrow(self, now, lane, q, cq, scales: cute.Pointer, words):
        """Narrow tile (block q, column tile cq), landed at `now`, stored as atoms: lane l's
        16-byte runs of rows l, l + 32, l + 64, l + 96, one a column word."""
        mine = cute.make_layout((4, 4), stride=(WARP * NARROW_TILE_WORDS, 1))
        w = cute.make_rmem_tensor(cute.make_layout((4, 4), stride=(4, 1)), Int32)
        four = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        c0 = cq * NARROW_TILE_WORDS
        out_at = scales.toint() + scale_offset(q * ATOM_ROWS + lane, 0, words)
        for c in cutlass.range_constexpr(NARROW_TILE_CHUNKS):
            if c0 + c * 4 < words:
                cute.autovec_copy(cute.make_tensor(
                    (now + narrow_tile_word(lane, c)).align(16), mine), w)
                for j in cutlass.range_constexpr(4):
                    if c0 + c * 4 + j < words:
                        for p in cutlass.range_constexpr(4):
                            four[p] = w[p, j]
                        self._store_atom_rows(out_at, c0 + c * 4 + j, four)

    @cute.jit
    def _write_narrow_messages(self, rw, lane, channel, active, scales: cute.Pointer,
                               scale_rows: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                               s_first: cute.Tensor, s_tile: cute.Tensor, segments, words,
                               src_info: cute.Pointer, s_totals: cute.Tensor, ranks,
                               max_tokens):
        """`_write_narrow` from scales staged a message at a time (SCALES_MESSAGES): a row's
        scales gathered from its message's staged row. The units (block-major) go to the warps
        in contiguous runs, so a warp's consecutive units mostly share their block and its rows'
        messages (`_unit_messages`), looked up once a block: set a for the block being loaded,
        set b for the block after it, read a block ahead, each as staged rows in m_row once
        its loads are needed."""
        gw, nw, tile, tiles_c, row_bytes, n_units, base, starts = self._narrow_units(
            rw, lane, channel, active, scale_rows, s_first, s_tile, segments, words)
        a_base = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
        a_tok = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
        b_base = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
        b_tok = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
        m_row = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
        lo = Int32(Int64(gw) * Int64(n_units) // Int64(nw))
        hi = Int32(Int64(gw + 1) * Int64(n_units) // Int64(nw))
        q = lo // tiles_c
        cq = lo - q * tiles_c
        if lo < hi:
            self._unit_messages(lane, starts, s_off, s_raw, s_first, s_totals, src_info, ranks,
                                q, max_tokens, a_base, a_tok)
            self._unit_messages(lane, starts, s_off, s_raw, s_first, s_totals, src_info, ranks,
                                q + 1, max_tokens, b_base, b_tok)
            self._message_rows(a_base, a_tok, m_row, max_tokens)
            self._load_narrow_messages(tile, lane, base, cq, row_bytes, words, m_row)
        cute.arch.cp_async_commit_group()
        i = Int32(0)
        for u in cutlass.range(lo, hi):
            # The next unit, the block after this one's where this one is its last column.
            cl = cq + 1
            ql = q
            if cl == tiles_c:
                cl = Int32(0)
                ql = q + 1
            if u + 1 < hi:
                if cl == 0:
                    # Its block's rows are set b's; the block after it goes to b.
                    self._message_rows(b_base, b_tok, m_row, max_tokens)
                    if u + 1 + tiles_c < hi:
                        self._unit_messages(lane, starts, s_off, s_raw, s_first, s_totals,
                                            src_info, ranks, ql + 1, max_tokens, b_base, b_tok)
                self._load_narrow_messages(tile + ((i + 1) & 1) * NARROW_HALF, lane, base, cl,
                                           row_bytes, words, m_row)
            self._store_landed(tile + (i & 1) * NARROW_HALF, lane, q, cq, scales, words)
            i += 1
            q = ql
            cq = cl
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _unit_messages(self, lane, starts: cute.Tensor, s_off: cute.Tensor, s_raw: cute.Tensor,
                       s_first: cute.Tensor, s_totals: cute.Tensor, src_info: cute.Pointer,
                       ranks, q, max_tokens, m_base: cute.Tensor, m_tok: cute.Tensor):
        """For rows lane + 32 j of 128-row block q: m_base[j] = s * max_tokens for the row's
        source s (a segment's rows come source after source, s_totals[s][g] of each; at most
        two sources, `_message_scales`), -1 past the segment's rows; m_tok[j] its source token
        (its `src_info` word), loaded here and read only a block later (`_message_rows`), so
        the loads' round trip overlaps the block before. Called by every lane
        (`_block_segment`)."""
        g = self._block_segment(starts, q)
        first_row = (q - s_first[g]) * ATOM_ROWS
        valid = s_raw[g] - first_row
        r0 = s_off[g] + first_row
        firsts = s_totals[g]  # the first source's rows of the segment
        for j in cutlass.range_constexpr(ATOM_ROWS // WARP):
            rho = lane + j * WARP
            # A load on every lane, row 0's past the segment (no branch around it, whose join
            # would wait for the load).
            inside = Int32(rho < valid)
            m_tok[j] = load_i32(src_info.toint() + Int64((r0 + rho) * inside) * 8)
            src = Int32(ranks > 1 and first_row + rho >= firsts)
            m_base[j] = (src * max_tokens + 1) * inside - 1

    @cute.jit
    def _message_rows(self, m_base: cute.Tensor, m_tok: cute.Tensor, m_row: cute.Tensor,
                      max_tokens):
        """`_unit_messages`' registers as staged rows: base + token, -1 past the segment or
        for a token out of range (then read as zeros)."""
        for j in cutlass.range_constexpr(ATOM_ROWS // WARP):
            row = m_base[j] + m_tok[j]
            if m_base[j] < 0 or m_tok[j] < 0 or m_tok[j] >= max_tokens:
                row = Int32(-1)
            m_row[j] = row

    @cute.jit
    def _next_unit(self, q, c, dq, dc, tiles_c):
        """The unit nw units past (block q, column tile c), nw = dq * tiles_c + dc (dc <
        tiles_c): (block, column tile)."""
        q = q + dq
        c = c + dc
        if c >= tiles_c:
            c -= tiles_c
            q += 1
        return q, c

    @cute.jit
    def _load_narrow(self, tile, lane, base, starts: cute.Tensor, s_off: cute.Tensor,
                     s_raw: cute.Tensor, s_first: cute.Tensor, q, cq, row_bytes, words):
        """Issue (not wait for) the loads of narrow tile (block q, column tile cq): lane l
        copies 16-byte chunk l % 4 of rows l // 4 + 8 k, k < 16, one address walked down the
        rows, each chunk at `narrow_tile_word` (whose swizzle is the same for all of a lane's
        rows); rows past the segment's count as zeros, not read."""
        g = self._block_segment(starts, q)
        first_row = (q - s_first[g]) * WIDE_TILE_ROWS
        r0 = s_off[g] + first_row
        valid = s_raw[g] - first_row
        cc = lane % NARROW_TILE_CHUNKS
        first = lane // NARROW_TILE_CHUNKS
        col = cq * NARROW_TILE_WORDS + cc * 4
        if col < words:
            src = Int64(base) + Int64(r0 + first) * row_bytes + Int64(col * 4)
            stride = row_bytes * NARROW_LOAD_STEP
            left = valid - first
            dst = tile + narrow_tile_word(first, cc)
            for k in cutlass.range_constexpr(WIDE_TILE_ROWS // NARROW_LOAD_STEP):
                at = src
                n = Int32(16)
                if k * NARROW_LOAD_STEP >= left:
                    at = Int64(base)
                    n = Int32(0)
                cp_async_16_fill(dst + k * NARROW_LOAD_STEP * NARROW_TILE_WORDS, at, n)
                src = src + stride

    @cute.jit
    def _load_narrow_messages(self, tile, lane, base, cq, row_bytes, words, m_row: cute.Tensor):
        """`_load_narrow` of column tile cq of the block whose rows' staged rows `_message_rows`
        put in m_row: row r's chunk from staged row m_row[r // 32] of lane r % 32; rows at -1
        as zeros. Every lane takes part in the shuffles; lanes past the last column load
        nothing."""
        cc = lane % NARROW_TILE_CHUNKS
        first = lane // NARROW_TILE_CHUNKS
        col = cq * NARROW_TILE_WORDS + cc * 4
        dst = tile + narrow_tile_word(first, cc)
        for k in cutlass.range_constexpr(WIDE_TILE_ROWS // NARROW_LOAD_STEP):
            row = cute.arch.shuffle_sync(m_row[k * NARROW_LOAD_STEP // WARP],
                                         first + (k * NARROW_LOAD_STEP) % WARP)
            at = Int64(base)
            n = Int32(0)
            if row >= 0 and col < words:
                at = Int64(base) + Int64(row) * row_bytes + Int64(col * 4)
                n = Int32(16)
            cp_async_16_fill(dst + k * NARROW_LOAD_STEP * NARROW_TILE_WORDS, at, n)

    @cute.jit
    def _load_segment_starts(self, starts: cute.Tensor, s_first: cute.Tensor, segments, lane):
        """Lane l's registers `starts[i]`: the first 128-row block of segment l + 32 i (past the
        last segment, a block no unit reaches), for `_block_segment`."""
        for i in cutlass.range_constexpr(SEGMENT_REGS):
            starts[i] = Int32(0x7FFFFFFF)
            if lane + i * WARP < segments:
                starts[i] = s_first[lane + i * WARP]

    @cute.jit
    def _block_segment(self, starts: cute.Tensor, q) -> Int32:
        """The segment of 128-row block `q` (the last one whose first block is at or before
        it; an empty segment shares its first block with the next): the segments starting at
        or before q, counted by every lane over its registers and summed over the warp. No
        shared-memory round trips, unlike a binary search of `s_first`."""
        n = Int32(0)
        for i in cutlass.range_constexpr(SEGMENT_REGS):
            if starts[i] <= q:
                n += 1
        return cute.arch.warp_redux_sync(n, "add") - 1

    @cute.jit
    def _load_wide(self, tile, lane, base, r0, row_bytes, valid, cols, c0):
        """FP8's staged rows r0 .. r0 + WIDE_TILE_ROWS of words c0 .. c0 + WIDE_TILE_WORDS into
        the wide tile at `tile`, swizzled (`_write_wide`): rows from `valid` on as zeros, not
        read; columns from `cols` on not loaded (the write-out reads only the tile's first
        `cols`). Lane l loads 16-byte chunk l % 8 of rows l // 8 + 4 k, k < 32, each load's
        address on its own (eight swizzles down the rows), eight loads a lane unrolled at a
        time. Waits for the copies and the warp."""
        cc = lane % WIDE_TILE_CHUNKS
        first = lane // WIDE_TILE_CHUNKS
        for kk in cutlass.range(WIDE_TILE_ROWS // LOAD_STEP // 8):
            for k8 in cutlass.range_constexpr(8):
                r = first + (kk * 8 + k8) * LOAD_STEP
                src = Int64(base)
                n = Int32(0)
                if r < valid and cc * 4 < cols:
                    src = base + (Int64(r0 + r) * row_bytes + Int64((c0 + cc * 4) * 4))
                    n = Int32(16)
                cp_async_16_fill(tile + wide_tile_word(r, cc), src, n)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()

    @cute.jit
    def _write_tiles(self, warp, lane, channel, active, scales: cute.Pointer,
                     scale_rows: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                     s_first: cute.Tensor, s_tile: cute.Tensor, segments, row_capacity,
                     payload_vectors):
        """The write-out, whole tiles at a time through the warp's TILE_ROWS x 9 words of
        shared memory (loads of 8 contiguous words a row, stores of whole lines), the tiles
        shared out over every warp of every CTA. FP8: 32 rows x 8 blocks of the transposed
        [H / 128, rows] (alignment rows included: their words were zeroed). NVFP4: 8 atoms of
        a 128-row block of the 128x4 layout, rows past the segment's count zero."""
        gw = channel * (SEND_WARPS + self.recv_warps) + warp
        nw = active * (SEND_WARPS + self.recv_warps)
        base = warp * TILE_ROWS * TILE_STRIDE
        col = lane % TILE_COLS
        # FP8: two tiles a pass, u and u + nw, the loads of both in flight before the first
        # store (a warp's passes follow each other, each about a load's round trip; an NVFP4
        # tile already has 32 loads a lane in flight).
        if cutlass.const_expr(self.fmt == "fp8"):
            words = payload_vectors * self.vector_bytes // FP8_BLOCK
            rows = s_off[segments]
            tiles_b = (words + TILE_COLS - 1) // TILE_COLS
            n_tiles = (rows + WARP - 1) // WARP * tiles_b
            # The staged rows of every 32-row group this warp starts (column tile 0) into L2
            # at once, ahead of the tiles' loads (one contiguous run a group).
            if lane == 0 and words % 4 == 0:
                for u in cutlass.range(gw, n_tiles, nw):
                    if u % tiles_b == 0:
                        r0 = u // tiles_b * WARP
                        bulk_prefetch_l2(scale_rows.toint() + Int64(scale_rows_layout(
                            words, row_capacity)((Int64(0), Int64(r0)))) * 4,
                            cutlass.min(Int32(WARP), rows - r0) * words * 4)
            vals = cute.make_rmem_tensor(cute.make_layout((TILE_COLS, PAIR)), Int32)
            for u in cutlass.range(gw, n_tiles, PAIR * nw):
                for t in cutlass.range_constexpr(PAIR):
                    ut = u + t * nw
                    r0 = ut // tiles_b * WARP
                    b = ut % tiles_b * TILE_COLS + col
                    for i in cutlass.range_constexpr(TILE_COLS):
                        rr = lane // TILE_COLS + i * (WARP // TILE_COLS)
                        v = Int32(0)
                        if ut < n_tiles and r0 + rr < rows and b < words:
                            v = load_i32(scale_rows.toint() + Int64(scale_rows_layout(
                                words, row_capacity)((Int64(b), Int64(r0 + rr)))) * 4)
                        vals[i, t] = v
                for t in cutlass.range_constexpr(PAIR):
                    ut = u + t * nw
                    if ut < n_tiles:
                        r0 = ut // tiles_b * WARP
                        for i in cutlass.range_constexpr(TILE_COLS):
                            s_tile[base + (lane // TILE_COLS + i * (WARP // TILE_COLS))
                                   * TILE_STRIDE + col] = vals[i, t]
                        cute.arch.sync_warp()
                        for j in cutlass.range_constexpr(TILE_COLS):
                            b = ut % tiles_b * TILE_COLS + j
                            if b < words and r0 + lane < rows:
                                store_i32(scales.toint() + (Int64(b) * Int64(row_capacity)
                                                            + Int64(r0 + lane)) * 4,
                                          s_tile[base + lane * TILE_STRIDE + j])
                        cute.arch.sync_warp()
        if cutlass.const_expr(self.fmt == "nvfp4"):
            rk = (payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK + 3) // 4
            tiles_c = (rk + TILE_COLS - 1) // TILE_COLS
            staged = scale_rows_layout(rk, row_capacity)
            # The staged rows of every 128-row block this warp starts (column tile 0) into L2
            # at once, ahead of the tiles' loads (one contiguous run a block).
            if lane == 0 and rk % 4 == 0:
                for u in cutlass.range(gw, s_first[segments] * tiles_c, nw):
                    if u % tiles_c == 0:
                        q = u // tiles_c
                        g = segment_of(s_first, segments, q)
                        first = (q - s_first[g]) * ATOM_ROWS
                        n = cutlass.min(Int32(ATOM_ROWS), s_raw[g] - first)
                        if n > 0:
                            bulk_prefetch_l2(scale_rows.toint() + Int64(staged(
                                (Int64(0), Int64(s_off[g] + first)))) * 4, Int32(n * rk * 4))
            four = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
            vals = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS * TILE_COLS // WARP), Int32)
            words = cute.make_rmem_tensor(cute.make_layout(TILE_COLS), Int32)
            for u in cutlass.range(gw, s_first[segments] * tiles_c, nw):
                q = u // tiles_c  # the 128-row scale block
                c0 = u % tiles_c * TILE_COLS
                g = segment_of(s_first, segments, q)
                first = (q - s_first[g]) * ATOM_ROWS  # its first row within segment g
                valid = s_raw[g] - first
                # Lane l writes the 16 bytes of rows l, l + 32, l + 64, l + 96 of each atom.
                out_at = scales.toint() + scale_offset(q * ATOM_ROWS + lane, 0, rk)
                if valid > WARP:
                    # Every load of the tile in flight before the first shared-memory store.
                    c = c0 + col
                    for i in cutlass.range_constexpr(ATOM_ROWS * TILE_COLS // WARP):
                        rr = lane // TILE_COLS + i * (WARP // TILE_COLS)
                        v = Int32(0)
                        if rr < valid and c < rk:
                            v = load_i32(scale_rows.toint() + Int64(staged(
                                (Int64(c), Int64(s_off[g] + first + rr)))) * 4)
                        vals[i] = v
                    for i in cutlass.range_constexpr(ATOM_ROWS * TILE_COLS // WARP):
                        s_tile[base + (lane // TILE_COLS + i * (WARP // TILE_COLS)) * TILE_STRIDE
                               + col] = vals[i]
                    cute.arch.sync_warp()
                    for j in cutlass.range_constexpr(TILE_COLS):
                        if c0 + j < rk:
                            for part in cutlass.range_constexpr(ATOM_ROWS // WARP):
                                four[part] = s_tile[base + (lane + part * WARP) * TILE_STRIDE + j]
                            self._store_atom_rows(out_at, c0 + j, four)
                    cute.arch.sync_warp()
                else:
                    # A block of at most 32 rows (a decode's experts): lane l's row, if any, read
                    # straight from its staged row, and the three rows past it zero.
                    for part in cutlass.range_constexpr(ATOM_ROWS // WARP):
                        four[part] = Int32(0)
                    for j in cutlass.range_constexpr(TILE_COLS):
                        words[j] = Int32(0)
                        if lane < valid and c0 + j < rk:
                            words[j] = load_i32(scale_rows.toint() + Int64(staged(
                                (Int64(c0 + j), Int64(s_off[g] + first + lane)))) * 4)
                    for j in cutlass.range_constexpr(TILE_COLS):
                        if c0 + j < rk:
                            four[0] = words[j]
                            self._store_atom_rows(out_at, c0 + j, four)

    @cute.jit
    def _store_atom_rows(self, row_at, atom, four: cute.Tensor):
        """The 16 bytes at `row_at` (a lane's row of a 128-row block, column 0, in the 128x4
        layout) plus atom `atom`'s 512: that row and the rows 32, 64 and 96 past it, their four
        scale bytes each (`four`)."""
        cute.autovec_copy(four, cute.make_tensor(
            gmem_ptr(Int32, row_at + Int64(atom) * ATOM_BYTES, 16),
            cute.make_layout(ATOM_ROWS // WARP)))
