"""`quantize_nvfp4` on the GPU against `cute_ep.reference.fp4`, byte for byte."""

import pytest
import torch

from cute_ep.reference import fp4

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[1, 2], ids=["steps1", "steps2"])
def steps(request, monkeypatch):
    """Both chunk sizes of the kernel whatever the input size (`cute_ep.quant._steps` picks one
    by size in use)."""
    import cute_ep.quant

    monkeypatch.setattr(cute_ep.quant, "_steps", lambda *args: request.param)
    return request.param


# Each scale layout with each of its kernels (`cute_ep.quant._order` picks one by input size).
KERNELS = [("linear", "rows"), ("128x4", "rows"), ("128x4", "quads")]


@pytest.fixture(params=KERNELS, ids=["linear", "128x4-rows", "128x4-quads"])
def scales(request, monkeypatch):
    """A scale layout, its kernel forced whatever the input size."""
    import cute_ep.quant

    layout, order = request.param
    monkeypatch.setattr(cute_ep.quant, "_order", lambda *args: order)
    return layout


def _rows(m, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m + 3, k, device="cuda", generator=gen)
    x *= torch.exp2(torch.randint(-12, 12, (m + 3, 1), device="cuda", generator=gen).float())
    if m > 2:
        x[1, :16] = 0  # a zero block
        x[2, 16:32] *= 1e-30  # a block whose scale underflows to zero
    return x.to(torch.bfloat16)


def _launch(scales, steps, x, offsets, gs, codes, sc, m, k, order=None):
    """The quantize_nvfp4 kernel launched directly into the caller's outputs (`m` input rows,
    `offsets` a list), past the Python wrapper's checks and allocation; `order` None: the one
    `cute_ep.quant._order` picks."""
    import cute_ep.quant
    from cute_ep.runtime.launch import runtime

    index = torch.cuda.current_device()
    order = order or cute_ep.quant._order(x.numel() * 2, index, scales)
    kernel, grid = cute_ep.quant._quantizer(runtime(), index, scales, steps, order)
    kernel.launch_checked_by_caller(x, torch.tensor(offsets, dtype=torch.int32, device="cuda"),
                                    gs, codes, sc, len(offsets) - 1, m, k, grid)


def _offsets(m):
    # Five experts, two of them empty, the rest splitting m unevenly.
    a, b = m // 3, (2 * m) // 3 + (m > 0)
    return [0, a, a, min(b, m), m, m]


@pytest.mark.parametrize("k", [32, 400, 1040, 1536, 2048, 2880, 7168])
@pytest.mark.parametrize("m", [0, 1, 127, 128, 129, 4096])
@pytest.mark.parametrize("spare", [3, 0], ids=["capacity", "all_rows"])
def test_quantize_nvfp4_matches_the_reference(m, k, scales, steps, spare):
    """Rows past the offsets' end (`spare` of them: the input a capacity, so the kernel splits
    its work again once it has read the offsets) or none."""
    from cute_ep.quant import quantize_nvfp4

    x = _rows(m, k, m * 31 + k)[:m + spare]
    offsets = _offsets(m)
    gs = torch.tensor([1.0, 0.5, 3.0, 2.0 ** 10, 1e-3], device="cuda")
    codes, sc = quantize_nvfp4(x, gs, torch.tensor(offsets, dtype=torch.int32, device="cuda"),
                               scales=scales)
    counts = [offsets[g + 1] - offsets[g] for g in range(5)]
    per_row = torch.repeat_interleave(gs, torch.tensor(counts, device="cuda"))
    if scales == "linear":
        want_codes, want_scales = fp4.quantize_nvfp4(x[:m], per_row)
        assert torch.equal(sc[:m], want_scales)
    else:
        rows = m + 5 * 128
        want_codes, want_scales = fp4.quantize_nvfp4_segments(x, offsets, gs, rows)
        used = fp4.segment_scale_blocks(offsets)[-1] * fp4.scale_block_bytes(k, 16)
        assert torch.equal(sc[:used], want_scales[:used])
    assert torch.equal(codes[:m], want_codes)


@pytest.mark.parametrize("order", ["rows", "quads"])
@pytest.mark.parametrize("k", [1040, 2048])  # 65 blocks (3 padding columns) and 128
def test_scale_padding_is_written_and_nothing_past_the_used_blocks(k, steps, order):
    """Into outputs pre-filled with a sentinel: the 128x4 padding (rows past each segment up to
    its 128-row block, columns past K / 16) is written as zeros, and no byte past the used
    blocks or past the valid rows' codes is touched."""
    from cute_ep.quant import fp4_scale_bytes

    m, sentinel = 300, 0xA5
    x, offsets = _rows(m, k, 7), [0, 1, 1, 129, 200, 290]
    rows = m + 5 * 128
    gs = torch.tensor([1.0, 0.5, 3.0, 2.0 ** 10, 1e-3], device="cuda")
    codes = torch.full((m, k // 2), sentinel, dtype=torch.uint8, device="cuda")
    sc = torch.full((fp4_scale_bytes(rows, k, 16),), sentinel, dtype=torch.uint8, device="cuda")
    _launch("128x4", steps, x, offsets, gs, codes, sc, m, k, order)
    want_codes, want = fp4.quantize_nvfp4_segments(x, offsets, gs, rows)
    used = fp4.segment_scale_blocks(offsets)[-1] * fp4.scale_block_bytes(k, 16)
    assert torch.equal(sc[:used], want[:used])
    assert (sc[used:] == sentinel).all()
    assert torch.equal(codes[:290], want_codes[:290]) and (codes[290:] == sentinel).all()


@pytest.mark.parametrize("order", ["rows", "quads"])
@pytest.mark.parametrize("k", [1040, 2048])
def test_padding_of_every_tail_shape(k, order):
    """Segments ending anywhere in a 128-row block (n = count % 128 from 1 to 127: slots whose
    rows are all padding, or all but 1, 2 or 3 of their 4), whole blocks and an empty one, into
    outputs pre-filled with a sentinel: every padding byte is zero and nothing past the used
    blocks is written (`zero_padding_atoms`, or `zero_scale_padding` where K / 16 is not a
    multiple of 4 for the row kernel)."""
    from cute_ep.quant import fp4_scale_bytes

    counts = [1, 31, 32, 33, 0, 63, 64, 65, 95, 96, 97, 127, 128, 129, 255, 300]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    m, sentinel = offsets[-1], 0xA5
    x = _rows(m, k, 13)[:m]
    gs = torch.rand(len(counts), device="cuda") + 0.5
    rows = m + 128 * len(counts)
    codes = torch.full((m, k // 2), sentinel, dtype=torch.uint8, device="cuda")
    sc = torch.full((fp4_scale_bytes(rows, k, 16),), sentinel, dtype=torch.uint8, device="cuda")
    _launch("128x4", 2, x, offsets, gs, codes, sc, m, k, order)
    want_codes, want = fp4.quantize_nvfp4_segments(x, offsets, gs, rows)
    used = fp4.segment_scale_blocks(offsets)[-1] * fp4.scale_block_bytes(k, 16)
    assert torch.equal(sc[:used], want[:used])
    assert (sc[used:] == sentinel).all()
    assert torch.equal(codes, want_codes)


def test_offsets_past_the_input_are_taken_as_its_end(scales, steps):
    """Offsets that end past the input's M rows (a caller's error the host cannot see): the
    kernel quantizes the M rows it was given as if the offsets stopped at M, and writes no code
    past them nor any scale byte past the layout's M + 128 S rows."""
    from cute_ep.quant import fp4_scale_bytes

    m, k, sentinel = 200, 2048, 0xA5
    x, offsets, clamped = _rows(m, k, 11)[:m], [0, 100, 260, 300], [0, 100, 200, 200]
    gs = torch.tensor([1.0, 0.5, 2.0], device="cuda")
    rows = m + 3 * 128
    codes = torch.full((m + 64, k // 2), sentinel, dtype=torch.uint8, device="cuda")
    if scales == "linear":
        sc = torch.full((m + 64, k // 16), sentinel, dtype=torch.uint8, device="cuda")
    else:
        sc = torch.full((fp4_scale_bytes(rows, k, 16) + 4096,), sentinel, dtype=torch.uint8,
                        device="cuda")
    _launch(scales, steps, x, offsets, gs, codes, sc, m, k)
    want_codes, want = fp4.quantize_nvfp4_segments(x, clamped, gs, rows)
    assert torch.equal(codes[:m], want_codes[:m]) and (codes[m:] == sentinel).all()
    if scales == "linear":
        per_row = torch.tensor([1.0] * 100 + [0.5] * 100, device="cuda")
        assert torch.equal(sc[:m], fp4.quantize_nvfp4(x, per_row)[1])
        assert (sc[m:] == sentinel).all()
    else:
        used = fp4.segment_scale_blocks(clamped)[-1] * fp4.scale_block_bytes(k, 16)
        assert torch.equal(sc[:used], want[:used]) and (sc[used:] == sentinel).all()


def test_quantize_nvfp4_with_zero_and_negative_global_scales(scales, steps):
    """Segments whose global scale is zero or negative get codes 0 and the reference's scale
    bytes (a negative scale's e4m3 code has its sign bit)."""
    from cute_ep.quant import quantize_nvfp4

    m, k = 4096, 2048
    x, offsets = _rows(m, k, 5), _offsets(m)
    gs = torch.tensor([-1.0, 0.5, 0.0, -3.0, 2.0], device="cuda")
    codes, sc = quantize_nvfp4(x, gs, torch.tensor(offsets, dtype=torch.int32, device="cuda"),
                               scales=scales)
    want_codes, want_scales = fp4.quantize_nvfp4_segments(x, offsets, gs, m + 5 * 128)
    if scales == "linear":
        counts = [offsets[g + 1] - offsets[g] for g in range(5)]
        per_row = torch.repeat_interleave(gs, torch.tensor(counts, device="cuda"))
        want_codes, want_scales = fp4.quantize_nvfp4(x[:m], per_row)
        assert torch.equal(sc[:m], want_scales)
    else:
        used = fp4.segment_scale_blocks(offsets)[-1] * fp4.scale_block_bytes(k, 16)
        assert torch.equal(sc[:used], want_scales[:used])
    assert torch.equal(codes[:m], want_codes)
    assert not codes[offsets[3]:offsets[4]].any() and (sc >= 0x80).any()


def test_e2m1_edge_values_through_the_kernel():
    """With gs = 1 and a block amax of 6 the scale is exactly 1, so each code is e2m1(x)."""
    from cute_ep.quant import quantize_nvfp4

    edges = [6.0, 0.25, 0.251953125, 0.5, 0.75, 1.25, 1.2578125, 1.75, 2.5, 2.515625, 3.5, 5.0,
             5.03125, -0.0, -0.75, 2 ** -130]
    x = torch.tensor([edges, [-v for v in edges]], device="cuda").to(torch.bfloat16)
    codes, sc = quantize_nvfp4(x, 1.0, scales="linear")
    assert sc[:, 0].tolist() == [0x38, 0x38]  # e4m3 1.0
    want_codes, _ = fp4.quantize_nvfp4(x, torch.ones(2, device="cuda"))
    assert torch.equal(codes, want_codes)
    got = fp4.unpack_nibbles(codes[0]).tolist()
    assert got == [7, 0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 8, 10, 0]


def test_saturation_nan_and_infinity():
    from cute_ep.quant import quantize_nvfp4

    x = torch.zeros(3, 32, device="cuda")
    x[0, :16] = torch.linspace(-3, 3, 16)  # gs huge: the scale saturates at 448, codes at 6
    x[1, 5] = float("nan")
    x[2, 16] = float("inf")
    x[2, 17] = 1.0
    x = x.to(torch.bfloat16)
    gs = torch.tensor([1e6], device="cuda")
    codes, sc = quantize_nvfp4(x, gs, scales="linear")
    want_codes, want_scales = fp4.quantize_nvfp4(x, gs.repeat(3))
    assert torch.equal(codes, want_codes) and torch.equal(sc, want_scales)
    assert sc[0, 0] == 0x7E and sc[1, 0] == 0x7F


def test_bad_arguments_are_refused():
    from cute_ep.quant import quantize_nvfp4

    x = torch.zeros(4, 24, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(x, 1.0)
    with pytest.raises(TypeError, match="bfloat16"):
        quantize_nvfp4(torch.zeros(4, 32, device="cuda"), 1.0)
    with pytest.raises(ValueError, match="segments"):
        quantize_nvfp4(torch.zeros(4, 32, dtype=torch.bfloat16, device="cuda"),
                       torch.ones(3, device="cuda"),
                       torch.tensor([0, 4], dtype=torch.int32, device="cuda"))


def test_every_bf16_value_up_to_6_encodes_as_the_reference(steps):
    """Exhaustive over bf16 magnitudes <= 6 (both signs, subnormals, zeros): each block holds
    6.0 first so its scale is exactly 1 and every code is e2m1 of the value itself."""
    from cute_ep.quant import quantize_nvfp4

    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[bits.float().abs() <= 6.0].float()  # 2 x 16,257 values, NaN/inf excluded
    values = torch.cat([values, torch.zeros(-values.numel() % 15)]).reshape(-1, 15)
    blocks = torch.cat([torch.full((values.shape[0], 1), 6.0), values], dim=1)
    blocks = torch.cat([blocks, torch.full((-blocks.shape[0] % 8, 16), 6.0)])
    x = blocks.reshape(-1, 128).to(torch.bfloat16).cuda()
    codes, sc = quantize_nvfp4(x, 1.0, scales="linear")
    assert (sc == 0x38).all()
    want = fp4.e2m1_encode(x.float())
    assert torch.equal(codes, fp4.pack_nibbles(want))


def test_blocks_on_either_side_of_the_fast_division_limit(steps):
    """A block divides by its scale with one reciprocal and fmas while gs * amax <= 2^100, with `/`
    above it (and for an infinite gs * amax): rows straddling the limit, every e4m3 scale
    significand (amax's significand varies per block), both signs, and tiny elements beside
    large ones, all byte for byte the reference."""
    from cute_ep.quant import quantize_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = []
    for log_amax in (-20, 0, 38, 39, 40, 41, 60, 127):
        x = torch.randn(8, 256, device="cuda", generator=gen)
        x *= 2.0 ** log_amax / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        x[:, 3::16] *= 2.0 ** -100  # a tiny element in every block
        rows.append(x)
    x = torch.cat(rows).to(torch.bfloat16)
    for gs in (2.0 ** 60, 1.0, 3e38):
        g = torch.full((x.shape[0],), gs, device="cuda")
        codes, sc = quantize_nvfp4(x, gs, scales="linear")
        want_codes, want_scales = fp4.quantize_nvfp4(x, g)
        assert torch.equal(sc, want_scales)
        assert torch.equal(codes, want_codes)


def test_streamed_plain_and_graph_launches_agree(scales, monkeypatch):
    """An input that fits in L2 is launched with L2's streaming window (`_stream_window`); the
    same bytes come out with the window, without it, and replayed from a CUDA graph, and the
    reference's bytes."""
    import cute_ep.quant
    from cute_ep.quant import _stream_window, quantize_nvfp4

    m, k = 4096, 2048
    x = _rows(m, k, 7)[:m]
    offsets = torch.tensor(_offsets(m), dtype=torch.int32, device="cuda")
    gs = torch.tensor([1.0, 0.5, 3.0, 2.0 ** 10, 1e-3], device="cuda")
    window = _stream_window(x, torch.cuda.current_device())
    assert window == (x.data_ptr(), x.numel() * 2)
    streamed = quantize_nvfp4(x, gs, offsets, scales=scales)
    graph = torch.cuda.CUDAGraph()
    quantize_nvfp4(x, gs, offsets, scales=scales)  # modules loaded outside the capture
    with torch.cuda.graph(graph):
        replayed = quantize_nvfp4(x, gs, offsets, scales=scales)
    graph.replay()
    monkeypatch.setattr(cute_ep.quant, "_stream_window", lambda *args: None)
    plain = quantize_nvfp4(x, gs, offsets, scales=scales)
    torch.cuda.synchronize()
    listed = _offsets(m)
    if scales == "linear":
        counts = [listed[g + 1] - listed[g] for g in range(5)]
        per_row = torch.repeat_interleave(gs, torch.tensor(counts, device="cuda"))
        want_codes, want_scales = fp4.quantize_nvfp4(x, per_row)
        used = want_scales.numel()
    else:
        want_codes, want_scales = fp4.quantize_nvfp4_segments(x, listed, gs, m + 5 * 128)
        used = fp4.segment_scale_blocks(listed)[-1] * fp4.scale_block_bytes(k, 16)
    for codes, sc in (streamed, replayed, plain):
        assert torch.equal(codes, want_codes)
        assert torch.equal(sc.reshape(-1)[:used], want_scales.reshape(-1)[:used])


def test_inputs_larger_than_l2_keep_the_normal_property():
    from cute_ep.quant import _l2_sizes, _stream_window

    l2, _ = _l2_sizes(torch.cuda.current_device())
    x = torch.empty(l2 // 2 + 8, dtype=torch.bfloat16, device="cuda").view(-1, 8)
    assert _stream_window(x, torch.cuda.current_device()) is None


def test_an_input_larger_than_l2_takes_quads_and_matches_the_reference():
    """The kernel `_order` picks by size: an input larger than L2 with 128x4 scales goes to the
    quads kernel (one CTA an SM), segments starting anywhere in a 128-row block; the same bytes
    as the reference."""
    from cute_ep.quant import _l2_sizes, _order, _quantizer, quantize_nvfp4
    from cute_ep.runtime.launch import runtime

    index = torch.cuda.current_device()
    l2, _ = _l2_sizes(index)
    k = 7168
    m = l2 // (2 * k) + 300  # rows whose bytes exceed L2
    assert _order(m * k * 2, index, "128x4") == "quads"
    assert _order(m * k * 2, index, "linear") == "rows"
    assert _order(l2, index, "128x4") == "rows"
    kernel, grid = _quantizer(runtime(), index, "128x4", 2, "quads")
    assert kernel.spec.config["order"] == "quads"
    assert grid == torch.cuda.get_device_properties(index).multi_processor_count
    x = _rows(m, k, 3)[:m]
    offsets = [0, 1000, 1000, 1001, m // 2 + 77, m]
    gs = torch.tensor([1.0, 0.5, 3.0, 2.0 ** 10, 1e-3], device="cuda")
    codes, sc = quantize_nvfp4(x, gs, torch.tensor(offsets, dtype=torch.int32, device="cuda"))
    want_codes, want_scales = fp4.quantize_nvfp4_segments(x, offsets, gs, m + 5 * 128)
    used = fp4.segment_scale_blocks(offsets)[-1] * fp4.scale_block_bytes(k, 16)
    assert torch.equal(codes, want_codes)
    assert torch.equal(sc[:used], want_scales[:used])
