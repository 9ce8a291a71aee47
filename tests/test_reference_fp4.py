"""The NVFP4 reference on the CPU: e2m1 edge values, the block formula, the 128x4 placement."""

import math

import pytest
import torch

from cute_ep.reference import fp4
from layouts.scales import scale_layout

# (input, code): ties to even, the subnormal 0.5, saturation, signed zero, NaN and infinities.
EDGES = [
    (0.0, 0x0), (-0.0, 0x8), (1e-40, 0x0), (0.25, 0x0), (0.2500001, 0x1), (0.5, 0x1),
    (0.74999994, 0x1), (0.75, 0x2), (1.0, 0x2), (1.25, 0x2), (1.2500001, 0x3), (1.5, 0x3),
    (1.75, 0x4), (2.0, 0x4), (2.5, 0x4), (2.5000002, 0x5), (3.0, 0x5), (3.5, 0x6), (4.0, 0x6),
    (5.0, 0x6), (5.0000005, 0x7), (6.0, 0x7), (7.0, 0x7), (1e30, 0x7), (math.inf, 0x7),
    (-0.25, 0x8), (-0.75, 0xA), (-1.75, 0xC), (-5.0, 0xE), (-6.5, 0xF), (-math.inf, 0xF),
    (math.nan, 0x0),
]


def test_e2m1_edge_values():
    v = torch.tensor([e for e, _ in EDGES], dtype=torch.float32)
    got = fp4.e2m1_encode(v).tolist()
    assert got == [c for _, c in EDGES]


def test_e2m1_every_representable_value_round_trips_and_midpoints_go_even():
    for code in range(16):
        value = fp4.e2m1_decode(torch.tensor([code], dtype=torch.uint8))
        assert fp4.e2m1_encode(value).item() == code
    mags = fp4.E2M1_VALUES
    for i in range(7):
        mid = (mags[i] + mags[i + 1]) / 2
        want = i if i % 2 == 0 else i + 1
        assert fp4.e2m1_encode(torch.tensor([mid])).item() == want


def test_nvfp4_block_formula_and_packing():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 64, generator=gen) * 3).to(torch.bfloat16)
    x[1, 16:32] = 0  # a zero block
    gs = torch.tensor([1.0, 2.0, 0.5, 448 * 6 / 3.0, 1e-3])
    codes, scales = fp4.quantize_nvfp4(x, gs)
    assert codes.shape == (5, 32) and scales.shape == (5, 4)
    assert scales[1, 1] == 0 and (codes[1, 8:16] == 0).all()
    for r in range(5):
        for b in range(4):
            blk = x[r, 16 * b:16 * (b + 1)].float()
            g = torch.tensor(float(gs[r]))
            amax = blk.abs().max()
            sf = (g * amax / torch.tensor(6.0)).clamp(max=448).to(torch.float8_e4m3fn)
            assert scales[r, b] == sf.view(torch.uint8)
            for i in range(16):
                q = blk[i] * g / sf.float() if sf.float() > 0 else torch.tensor(0.0)
                code = int(fp4.e2m1_encode(q.reshape(1)))
                byte = int(codes[r, 8 * b + i // 2])
                assert (byte >> (4 * (i % 2))) & 15 == code


def test_nvfp4_round_trip_error_is_within_half_a_step():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=gen)
    gs = torch.full((64,), 1.0)
    codes, scales = fp4.quantize_nvfp4(x, gs)
    back = fp4.dequantize_nvfp4(codes, scales, gs)
    sf = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    # Largest e2m1 step is 2 (between 4 and 6); the scale's own rounding adds < 1/16 relative.
    assert ((back - x).abs() <= sf * 1.0 + x.abs() * 0.07).all()


def test_nan_block_gets_a_nan_scale_and_inf_saturates():
    x = torch.zeros(1, 32)
    x[0, 3] = math.nan
    x[0, 16] = math.inf
    x[0, 17] = 1.0
    codes, scales = fp4.quantize_nvfp4(x, torch.ones(1))
    assert scales[0, 0] == 0x7F and (codes[0, :8] == 0).all()
    assert scales[0, 1].view(torch.float8_e4m3fn).float() == 448
    assert codes[0, 8] & 15 == 0x7


def _at(layout, r, k, block=16):
    """Byte of (row r, element k) in the 128x4 layout, through its nested coordinate."""
    kb = k // block
    return layout((((r % 32, (r // 32) % 4), r // 128), ((k % block, kb % 4), kb // 4)))


@pytest.mark.parametrize("k", [1536, 2880, 64])
def test_closed_form_scale_offsets_match_the_cute_layout(k):
    rows = torch.arange(300)
    kb = torch.arange(k // 16)
    closed = fp4._scale_offsets(rows, kb, k)
    layout = scale_layout(300, k, 16)
    for r in (0, 1, 31, 32, 127, 128, 200, 299):
        for c in sorted({0, 1, 3, min(4, k // 16 - 1), k // 16 - 1}):
            assert closed[r, c] == _at(layout, r, c * 16 + 7)


def test_segments_start_on_fresh_blocks_and_padding_is_zero():
    gen = torch.Generator().manual_seed(3)
    offsets = [0, 5, 5, 205, 206]  # an empty expert, one over a block boundary
    x = torch.randn(206, 64, generator=gen).to(torch.bfloat16)
    gs = torch.tensor([1.0, 2.0, 0.25, 4.0])
    codes, scales = fp4.quantize_nvfp4_segments(x, offsets, gs, 206 + 4 * 128)
    assert fp4.segment_scale_blocks(offsets) == [0, 1, 1, 3, 4]
    layout = scale_layout(206 + 4 * 128, 64, 16)
    for g, (a, b) in enumerate(zip(offsets, offsets[1:])):
        first = fp4.segment_scale_blocks(offsets)[g] * 128
        ref_codes, ref_scales = fp4.quantize_nvfp4(x[a:b], gs[g].repeat(b - a))
        assert torch.equal(codes[a:b], ref_codes)
        for i in range(b - a):
            for c in range(4):
                assert scales[_at(layout, first + i, 16 * c)] == ref_scales[i, c]
    used = {_at(layout, fp4.segment_scale_blocks(offsets)[g] * 128 + i, 16 * c)
            for g, (a, b) in enumerate(zip(offsets, offsets[1:])) for i in range(b - a)
            for c in range(4)}
    assert all(scales[j] == 0 for j in range(scales.numel()) if j not in used)


# (q = amax / 6, e8m0 code): exact powers, just above them, the subnormal corner, clamps, NaN.
E8M0_EDGES = [
    (1.0, 127), (1.0000001, 128), (0.75, 127), (0.5, 126), (6.0, 130), (2.0 ** 127, 254),
    (3e38, 254), (math.inf, 254), (2.0 ** -126, 1), (1.5 * 2.0 ** -127, 1), (2.0 ** -127, 0),
    (2.0 ** -140, 0), (0.0, 0), (math.nan, 255),
]


def test_e8m0_round_up_edge_values():
    q = torch.tensor([v for v, _ in E8M0_EDGES], dtype=torch.float32)
    assert fp4.e8m0_round_up(q).tolist() == [c for _, c in E8M0_EDGES]
    # The decoded scale is the smallest power of two at or above q.
    finite = q[(q > 2.0 ** -127) & (q < 2.0 ** 127)]
    scale = fp4.e8m0_decode(fp4.e8m0_round_up(finite)).double()
    assert (scale >= finite.double()).all() and (scale / 2 < finite.double()).all()


def test_mxfp4_never_saturates_because_of_its_scale():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-20, 20, (64, 1),
                                                                       generator=gen).float())
    codes, scales = fp4.quantize_mxfp4(x)
    assert codes.shape == (64, 128) and scales.shape == (64, 8)
    blocks = x.reshape(64, 8, 32)
    scaled = blocks / fp4.e8m0_decode(scales).unsqueeze(-1)
    assert scaled.abs().max() <= 6.0
    # Each code is the nearest e2m1 value of x / scale, so dequantizing errs by <= half a step
    # of the top binade (1.0) times the scale.
    err = (fp4.dequantize_mxfp4(codes, scales) - x).reshape(64, 8, 32).abs()
    assert (err <= fp4.e8m0_decode(scales).unsqueeze(-1)).all()


def test_mxfp4_zero_and_nan_blocks():
    x = torch.zeros(2, 64)
    x[0, 0] = -0.0
    x[0, 32:] = 3.0  # amax 3 -> q 0.5 -> scale 2^-1 -> every code is e2m1(6) = 7
    x[1, 40] = float("nan")
    codes, scales = fp4.quantize_mxfp4(x)
    assert scales.tolist() == [[0, 126], [0, 255]]
    assert (codes[0, :16] == 0).all() and (codes[0, 16:] == 0x77).all()
    assert (codes[1] == 0).all()


def test_mxfp4_segments_use_the_32_element_128x4_layout():
    x = torch.randn(200, 64)
    offsets = [0, 0, 130, 200]
    codes, scales = fp4.quantize_mxfp4_segments(x, offsets, 200 + 3 * 128)
    _, linear = fp4.quantize_mxfp4(x)
    layout = scale_layout(200 + 3 * 128, 64, 32)
    # Segment 1 starts at scale row 0, segment 2 on the fresh block at row 256.
    for row, scale_row in ((0, 0), (129, 129), (130, 256), (199, 325)):
        for kb in range(2):
            assert scales[_at(layout, scale_row, 32 * kb, 32)] == linear[row, kb]
    placed = torch.zeros_like(scales, dtype=torch.bool)
    for scale_row in [*range(130), *range(256, 326)]:
        for kb in range(2):
            placed[_at(layout, scale_row, 32 * kb, 32)] = True
    assert (scales[~placed] == 0).all()



def test_the_scale_layout_of_staged_rows_puts_each_segment_on_fresh_blocks():
    """`reference.ep.scale_layout_of_rows` (what a dispatch's scale write-out must leave),
    against the 128x4 layout's nested coordinates byte by byte: segment g's rows from its first
    fresh block, every byte it does not place zero; FP8 the rows transposed, columns past them
    zero, and too few staged rows refused."""
    from cute_ep.reference.ep import scale_layout_of_rows

    h, counts = 256, [3, 0, 130, 1]
    rows = sum(counts)
    staged = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows + 4, h // 64), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(5))
    out = scale_layout_of_rows("nvfp4", staged[:rows], h, counts, rows + 4)
    by_byte = staged.view(torch.uint8)
    layout = scale_layout(5 * 128, h, 16)
    placed = set()
    for g, (first_block, first_row) in enumerate([(0, 0), (1, 3), (1, 3), (3, 133)]):
        for j in range(counts[g]):
            for s in range(h // 16):
                at = _at(layout, first_block * 128 + j, 16 * s)
                placed.add(at)
                assert out[at] == by_byte[first_row + j, s]
    assert out.numel() == 4 * 128 * (h // 16)
    assert all(out[i] == 0 for i in range(out.numel()) if i not in placed)
    fp8 = torch.rand(12, 2)
    t = scale_layout_of_rows("fp8", fp8.view(torch.int32), 256, [3, 5], 16)
    assert torch.equal(t[:, :12], fp8.t()) and not t[:, 12:].any()
    with pytest.raises(ValueError, match="12 staged rows"):
        scale_layout_of_rows("fp8", fp8[:10].view(torch.int32), 256, [3, 5], 16)
