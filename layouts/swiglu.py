"""Views of the SwiGLU input `[M, 2I]` (bf16): gate and up as two `[M, I]` layouts.

Halves: `[gate | up]`, gate in columns [0, I), up in [I, 2I).
Interleaved: gate_i and up_i alternate, gate in even columns, up in odd ones.
Offsets are in elements of the input.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.algebra import Layout


@dataclass(frozen=True)
class View:
    offset: int
    layout: Layout

    def __call__(self, row: int, col: int) -> int:
        return self.offset + self.layout((row, col))


def swiglu_views(rows: int, intermediate: int, interleaved: bool) -> tuple[View, View]:
    """(gate, up) views of a row-major `[rows, 2 * intermediate]` tensor."""
    if intermediate < 1:
        raise ValueError(f"intermediate size must be positive, got {intermediate}")
    width = 2 * intermediate
    if interleaved:
        return (View(0, Layout((rows, intermediate), (width, 2))),
                View(1, Layout((rows, intermediate), (width, 2))))
    return (View(0, Layout((rows, intermediate), (width, 1))),
            View(intermediate, Layout((rows, intermediate), (width, 1))))
