"""SwiGLU input views against plain index formulas."""

import pytest

from layouts.swiglu import swiglu_views


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rows,inter", [(1, 1), (3, 5), (4, 16)])
def test_gate_and_up_views(rows, inter, interleaved):
    gate, up = swiglu_views(rows, inter, interleaved)
    seen = set()
    for m in range(rows):
        for i in range(inter):
            if interleaved:
                want_g, want_u = m * 2 * inter + 2 * i, m * 2 * inter + 2 * i + 1
            else:
                want_g, want_u = m * 2 * inter + i, m * 2 * inter + inter + i
            assert (gate(m, i), up(m, i)) == (want_g, want_u)
            seen |= {want_g, want_u}
    assert seen == set(range(rows * 2 * inter)), "gate and up must cover the input exactly once"


def test_bad_intermediate_size():
    with pytest.raises(ValueError, match="intermediate size"):
        swiglu_views(4, 0, False)
