"""Block-scaled scale factors (NVFP4, MXFP4) in the layout Blackwell's block-scaled MMA reads.

The atom covers 128 rows x 4 scale columns in 512 bytes:
`((32, 4), (vector, 4)) : ((16, 4), (0, 1))` over (row, element): row r = r0 + 32 r1 goes to
`16 r0 + 4 r1`, the `vector` elements sharing a scale map to one byte (stride 0), scale column
c to `+c`. It is tiled over (rows padded to 128, elements padded to 4 scale columns) with the
column blocks fastest. Padding bytes are zero.

In dispatch output each local expert's scales start on a fresh 128-row block; `scales_offsets[g]`
counts the blocks that precede expert g's beyond `row_offsets[g] // 128`.
"""

from __future__ import annotations

from layouts.algebra import Layout, align_up, ceil_div, tile_to_shape

ATOM_ROWS = 128
ATOM_SCALE_COLUMNS = 4
ATOM_BYTES = 512


def scale_atom(vector: int) -> Layout:
    return Layout(((32, 4), (vector, ATOM_SCALE_COLUMNS)), ((16, 4), (0, 1)))


def scale_layout(rows: int, elements: int, vector: int) -> Layout:
    """(row, element) -> byte offset of that element's scale, for a rows x elements matrix."""
    if vector not in (16, 32):
        raise ValueError(f"scale vector must be 16 (NVFP4) or 32 (MXFP4), got {vector}")
    if elements % vector:
        raise ValueError(f"{elements} elements is not a multiple of the {vector}-element block")
    shape = (align_up(max(rows, 1), ATOM_ROWS), align_up(elements, vector * ATOM_SCALE_COLUMNS))
    return tile_to_shape(scale_atom(vector), shape, order=(1, 0))


def scale_bytes(rows: int, elements: int, vector: int) -> int:
    """Bytes of the scale tensor of a rows x elements matrix (padding included)."""
    return scale_layout(rows, elements, vector).cosize()


def blocks_per_row_block(elements: int, vector: int) -> int:
    """`RK`: 4-column atoms across one 128-row block."""
    return ceil_div(ceil_div(elements, vector), ATOM_SCALE_COLUMNS)


def expert_scale_blocks(counts: list[int]) -> tuple[list[int], list[int]]:
    """Per-expert placement of scales in dispatch output, from the rows each expert received.

    Returns (first 128-row scale block of each expert, scales_offsets), where
    `scales_offsets[g] = first_block[g] - row_offsets[g] // 128`.
    """
    first, offsets = [], []
    block = row = 0
    for count in counts:
        first.append(block)
        offsets.append(block - row // ATOM_ROWS)
        block += ceil_div(count, ATOM_ROWS)
        row += count
    return first, offsets


def scale_rows_capacity(max_rows: int, experts: int) -> int:
    """Scale rows dispatch output reserves: every expert may waste most of one 128-row block."""
    return max_rows + experts * ATOM_ROWS
