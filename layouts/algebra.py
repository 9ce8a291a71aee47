"""CuTe layouts as plain Python data, mirrored into the DSL by `Layout.to_cute()`.

A layout is a (shape, stride) pair of congruent nested tuples: the map from a coordinate to
`sum(coordinate_i * stride_i)`. Kept in plain Python so that the runtime, the build's manifest and
the tests can evaluate the same definitions without the DSL; inside a `@cute.jit` function the
same object becomes a `cute.Layout` (entries may then be DSL integers). The operations here are
the subset of CuTe's algebra that cute-ep's buffers need, with CuTe's conventions: linear indices
decompose colexicographically (mode 0 fastest), and `tile_to_shape` repeats an atom over a shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


def _is_tuple(x) -> bool:
    return isinstance(x, tuple)


def flatten(t) -> tuple:
    if not _is_tuple(t):
        return (t,)
    return tuple(leaf for mode in t for leaf in flatten(mode))


def _product(t):
    out = 1
    for v in flatten(t):
        out = out * v
    return out


def _congruent(a, b) -> bool:
    if _is_tuple(a) != _is_tuple(b):
        return False
    return not _is_tuple(a) or (len(a) == len(b) and all(map(_congruent, a, b)))


def ceil_div(a, b):
    return (a + b - 1) // b


def align_up(a, b):
    return ceil_div(a, b) * b


@dataclass(frozen=True)
class Layout:
    shape: tuple | int
    stride: tuple | int

    def __post_init__(self):
        if not _congruent(self.shape, self.stride):
            raise ValueError(f"shape {self.shape} and stride {self.stride} are not congruent")

    def size(self):
        """Number of coordinates in the domain."""
        return _product(self.shape)

    def cosize(self):
        """One past the largest offset (strides are non-negative in cute-ep's layouts)."""
        return sum((s - 1) * d for s, d in zip(flatten(self.shape), flatten(self.stride))) + 1

    def __call__(self, coord):
        """Offset of a (nested or flat) coordinate, or of a linear index (colexicographic)."""
        shapes, strides = flatten(self.shape), flatten(self.stride)
        if _is_tuple(coord):
            flat = flatten(coord)
            if len(flat) != len(shapes):
                raise ValueError(f"coordinate {coord} does not match shape {self.shape}")
        else:
            flat, rest = [], coord
            for s in shapes:
                flat.append(rest % s)
                rest //= s
        return sum(c * d for c, d in zip(flat, strides))

    def mode(self, i: int) -> "Layout":
        return Layout(self.shape[i], self.stride[i])

    def coordinates(self):
        """Every flat coordinate, in colexicographic order (mode 0 fastest)."""
        for rev in product(*(range(s) for s in reversed(flatten(self.shape)))):
            yield tuple(reversed(rev))

    def offsets(self) -> list:
        """Offset of every linear index 0 .. size-1."""
        return [self(c) for c in self.coordinates()]

    def to_cute(self):
        """The same layout as a DSL `cute.Layout` (call inside `@cute.jit`)."""
        import cutlass.cute as cute

        return cute.make_layout(self.shape, stride=self.stride)


def make_layout(shape, stride=None) -> Layout:
    """Compact column-major (mode 0 fastest) unless a stride is given, as in CuTe."""
    if stride is None:
        stride = _compact_colmajor(shape, 1)[0]
    return Layout(shape, stride)


def _compact_colmajor(shape, current):
    if not _is_tuple(shape):
        return current, current * shape
    out = []
    for mode in shape:
        s, current = _compact_colmajor(mode, current)
        out.append(s)
    return tuple(out), current


def tile_to_shape(atom: Layout, shape: tuple, order: tuple) -> Layout:
    """Repeat a rank-2 `atom` over `shape` (a multiple of the atom's shape per mode).

    Mode i of the result is `(atom_mode_i, shape_i // atom_size_i)`; the repeats are laid out
    after the atom's cosize, the mode named first in `order` fastest.
    """
    if len(shape) != 2 or len(order) != 2:
        raise ValueError("tile_to_shape takes a rank-2 shape and order")
    atom_sizes = [atom.mode(i).size() for i in range(2)]
    for i in range(2):
        if shape[i] % atom_sizes[i]:
            raise ValueError(f"shape {shape} is not a multiple of the atom {atom_sizes} in mode {i}")
    repeats = [shape[i] // atom_sizes[i] for i in range(2)]
    strides = [0, 0]
    step = atom.cosize()
    for i in order:
        strides[i] = step
        step *= repeats[i]
    return Layout(tuple((atom.shape[i], repeats[i]) for i in range(2)),
                  tuple((atom.stride[i], strides[i]) for i in range(2)))
