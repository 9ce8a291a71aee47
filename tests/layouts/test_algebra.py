"""The plain-Python layout algebra, and its agreement with the DSL's CuTe layouts."""

import pytest

from layouts.algebra import Layout, make_layout, tile_to_shape


def test_coordinates_and_linear_indices_agree():
    layout = Layout(((2, 3), 4), ((1, 8), 2))
    for i, coord in enumerate(layout.coordinates()):
        c0, c1, c2 = coord
        assert layout(coord) == c0 * 1 + c1 * 8 + c2 * 2
        assert layout(i) == layout(coord)
        # colexicographic: mode 0 fastest
        assert i == c0 + 2 * (c1 + 3 * c2)
    assert layout.size() == 24
    assert layout.cosize() == max(layout.offsets()) + 1


def test_make_layout_is_compact_column_major():
    layout = make_layout((3, (2, 5)))
    assert layout.stride == (1, (3, 6))
    assert sorted(layout.offsets()) == list(range(30))


def test_incongruent_shape_and_stride_are_refused():
    with pytest.raises(ValueError, match="congruent"):
        Layout((2, 3), (1,))


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_tile_to_shape_matches_block_formula(order):
    atom = Layout((4, 2), (2, 1))  # a 4x2 row-major block
    tiled = tile_to_shape(atom, (12, 6), order)
    blocks = (3, 3)
    for r in range(12):
        for c in range(6):
            br, bc = r // 4, c // 2
            block = br + blocks[0] * bc if order == (0, 1) else bc + blocks[1] * br
            assert tiled(((r % 4, br), (c % 2, bc))) == block * 8 + (r % 4) * 2 + c % 2
    with pytest.raises(ValueError, match="multiple of the atom"):
        tile_to_shape(atom, (10, 6), order)


@pytest.mark.build
def test_layouts_mirror_the_dsl():
    """The same (shape, stride) as a DSL `cute.Layout` gives the same offset at every coordinate."""
    import cutlass.cute as cute

    from layouts.buffers import EPConfig, combine_routes, scale_rows_layout
    from layouts.channels import ChannelGeometry, batch_header_layout
    from layouts.scales import scale_layout
    from layouts.swiglu import swiglu_views

    cfg = EPConfig(hidden=128, topk=2, experts=4, ranks=2, max_tokens_per_rank=3, format="fp8")
    mirrored = [
        scale_layout(130, 96, 16),
        scale_layout(40, 128, 32),
        ChannelGeometry(cfg, 3, stage_batches=2).headers(),
        batch_header_layout(3),
        scale_rows_layout(7, 5),
        ChannelGeometry(cfg, 3).counts(),
        ChannelGeometry(cfg, 3).combine_ring(),
        combine_routes(cfg)[0].layout,
        swiglu_views(5, 6, interleaved=True)[1].layout,
        tile_to_shape(Layout((4, 2), (2, 1)), (12, 6), (1, 0)),
    ]
    got = []

    @cute.jit
    def evaluate():
        for layout in mirrored:
            dsl = layout.to_cute()
            got.append((cute.size(dsl), cute.cosize(dsl),
                        [cute.crd2idx(_nest(c, layout.shape), dsl) for c in layout.coordinates()]))

    evaluate()
    for layout, (size, cosize, offsets) in zip(mirrored, got):
        assert (size, cosize) == (layout.size(), layout.cosize())
        assert offsets == layout.offsets()


def _nest(flat, shape):
    """Put a flat coordinate back into the nesting of `shape`."""
    it = iter(flat)

    def build(s):
        return tuple(build(m) for m in s) if isinstance(s, tuple) else next(it)

    return build(shape)
