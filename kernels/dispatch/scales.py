"""Phase 4 of `ep_dispatch` (FP8 and NVFP4, packed rows), scales: once every CTA has finished the
round, all warps write `scale_rows` into the output's scale layout (FP8 transposed, NVFP4 128x4)
a tile of whole lines at a time."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.dispatch.common import (FP8_BLOCK, NVFP4_BLOCK, SEND_WARPS, TILE_COLS, TILE_ROWS,
                                     TILE_STRIDE, WARP)
from kernels.bulk_copy import bulk_prefetch_l2
from kernels.memory import gmem_ptr, load_i32, scale_offset, store_i32
from kernels.nvfp4 import segment_of
from layouts.buffers import scale_rows_layout
from layouts.scales import ATOM_BYTES, ATOM_ROWS

PAIR = 2  # FP8 tiles a warp loads before storing the first


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
    def _write_scales(self, warp, lane, channel, active, scales: cute.Pointer,
                      scale_rows: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                      s_first: cute.Tensor, s_tile: cute.Tensor, segments, row_capacity,
                      payload_vectors):
        """Once every CTA's receivers are done: the received rows' scales from `scale_rows` into
        the output's layout, whole tiles at a time through the warp's TILE_ROWS x 9 words of
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
