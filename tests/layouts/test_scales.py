"""The 128x4 block-scaled scale layout against SPEC's offset formula, and per-expert placement."""

import pytest

from layouts.scales import expert_scale_blocks, scale_bytes, scale_layout, scale_rows_capacity

from .conftest import MODELS


def spec_offset(r, kb, elements, vector):
    rk = -(-(-(-elements // vector)) // 4)
    return (r // 128) * rk * 512 + (kb // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + kb % 4


def coord(r, k, vector):
    """(row, element) as a coordinate of the tiled layout's nested shape."""
    kb = k // vector
    return (((r % 32, (r // 32) % 4), r // 128), ((k % vector, kb % 4), kb // 4))


@pytest.mark.parametrize("rows,elements,vector", [(1, 16, 16), (130, 96, 16), (256, 256, 16),
                                                  (129, 64, 32), (40, 384, 32)])
def test_every_element_of_small_shapes(rows, elements, vector):
    layout = scale_layout(rows, elements, vector)
    for r in range(rows):
        for k in range(elements):
            assert layout(coord(r, k, vector)) == spec_offset(r, k // vector, elements, vector)


@pytest.mark.parametrize("name,hidden,topk,experts", MODELS)
@pytest.mark.parametrize("vector", [16, 32])
def test_random_samples_at_model_shapes(name, hidden, topk, experts, vector, rng):
    if hidden % vector:
        pytest.skip(f"{name}: hidden {hidden} is not a multiple of {vector}")
    rows = 4096 * min(experts, 8 * topk)
    layout = scale_layout(rows, hidden, vector)
    for _ in range(2000):
        r, k = rng.randrange(rows), rng.randrange(hidden)
        assert layout(coord(r, k, vector)) == spec_offset(r, k // vector, hidden, vector)


@pytest.mark.parametrize("rows,elements,vector", [(1, 16, 16), (200, 80, 16), (129, 96, 32)])
def test_atoms_tile_without_overlap(rows, elements, vector):
    """Every (row, scale column) of the padded tensor owns exactly one byte, none left over."""
    layout = scale_layout(rows, elements, vector)
    padded_rows, padded_elements = (layout.mode(i).size() for i in range(2))
    offsets = [layout(coord(r, kb * vector, vector))
               for r in range(padded_rows) for kb in range(padded_elements // vector)]
    assert sorted(offsets) == list(range(layout.cosize()))
    assert scale_bytes(rows, elements, vector) == padded_rows * padded_elements // vector


def test_bad_scale_parameters():
    with pytest.raises(ValueError, match="16 .NVFP4. or 32"):
        scale_layout(128, 64, 8)
    with pytest.raises(ValueError, match="multiple of the 16-element block"):
        scale_layout(128, 40, 16)


@pytest.mark.parametrize("counts", [[0, 0, 0], [1, 0, 300, 128, 127, 0, 129], [128] * 5,
                                    [4096 * 8] + [0] * 31])
def test_each_expert_starts_on_its_own_block(counts):
    first, offsets = expert_scale_blocks(counts)
    row_offsets = [sum(counts[:g]) for g in range(len(counts))]
    used = set()
    for g, n in enumerate(counts):
        assert first[g] == row_offsets[g] // 128 + offsets[g]
        blocks = set(range(first[g], first[g] + -(-n // 128)))
        assert not blocks & used, f"expert {g} shares a scale block"
        used |= blocks
    assert (max(used) + 1 if used else 0) * 128 <= scale_rows_capacity(sum(counts), len(counts))
