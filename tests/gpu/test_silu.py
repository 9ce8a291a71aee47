"""The fused SwiGLU kernels on the GPU against `cute_ep.reference.silu`, bit for bit.

The reference runs on the same GPU (its `exp` is the CUDA math library's, as the kernels'), rows
are spread over five experts of which two are empty, and the input holds rows past
`row_offsets[-1]` that must not be read into the output.
"""

import pytest
import torch

from cute_ep.reference import fp4
from cute_ep.reference import silu as ref

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["thread", "warp", "table"])
def fp4_layout(request, monkeypatch):
    """Every FP4 kernel layout whatever the input size (`cute_ep.silu._layout` picks one by
    size in use): a thread per block, a warp per row, a warp per row with the gate table."""
    import cute_ep.silu

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: request.param)
    return request.param


@pytest.fixture(params=["thread", "table"])
def fp8_layout(request, monkeypatch):
    """FP8 with the activation by the formula and from the gate table."""
    import cute_ep.silu

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: request.param)
    return request.param

ROWS = [0, 1, 127, 128, 129, 4096]
INTERMEDIATE = [1536, 2048, 2880, 7168]
GS = [1.0, 0.5, 3.0, 2.0 ** 10, 1e-3]
SENTINEL = 0xA5


def _x(m, i, seed, interleaved=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m + 3, 2 * i, device="cuda", generator=gen)
    x *= torch.exp2(torch.randint(-6, 7, (m + 3, 1), device="cuda", generator=gen).float())
    if m > 2:
        x[1, :] = 0  # zero rows: zero scales and codes
        x[2, : 2 * i : 7] = -0.0
    return x.to(torch.bfloat16)


def _offsets(m):
    a, b = m // 3, (2 * m) // 3 + (m > 0)
    return [0, a, a, min(b, m), m, m]


def _device(offsets):
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def _used_scale_bytes(offsets, i, block):
    return fp4.segment_scale_blocks(offsets)[-1] * fp4.scale_block_bytes(i, block)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("i", INTERMEDIATE)
@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_bf16(m, i, interleaved):
    from cute_ep.silu import fused_silu

    x, offsets = _x(m, i, m + i), _offsets(m)
    out = fused_silu(x, _device(offsets), interleaved=interleaved)
    assert out.shape == (m + 3, i) and out.dtype == torch.bfloat16
    assert torch.equal(out[:m], ref.fused_silu(x, offsets, interleaved))


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("i", INTERMEDIATE)
@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_fp8(m, i, interleaved, fp8_layout):
    from cute_ep.silu import fused_silu_fp8

    if i % 128:
        pytest.skip("FP8 blockwise needs I to be a multiple of 128")
    x, offsets = _x(m, i, 2 * m + i), _offsets(m)
    q, scales = fused_silu_fp8(x, _device(offsets), interleaved=interleaved)
    assert scales.shape == (i // 128, m + 3)
    want_q, want_scales = ref.fused_silu_fp8(x, offsets, interleaved)
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales[:, :m], want_scales)


def test_fused_silu_fp8_either_side_of_the_fast_division_limit(fp8_layout):
    """FP8 blocks divide by their scale with one reciprocal and fmas while amax <= 2^100 and with
    `/` above it: rows whose activations straddle the limit (gate 2^60, up 2^37 ... 2^45), beside
    ordinary rows, byte for byte the reference."""
    from cute_ep.silu import fused_silu_fp8

    m, i = 12, 256
    x = _x(m, i, 11).float()
    for row, log_up in enumerate(range(37, 46)):
        x[row, :i] = 2.0 ** 60 * (1 + torch.rand(i, device="cuda"))
        x[row, i:] *= 2.0 ** log_up
    x = x.to(torch.bfloat16)
    offsets = [0, m]
    q, scales = fused_silu_fp8(x, _device(offsets))
    want_q, want_scales = ref.fused_silu_fp8(x, offsets)
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales[:, :m], want_scales)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("i", INTERMEDIATE)
@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_nvfp4(m, i, interleaved, fp4_layout):
    from cute_ep.silu import fused_silu_nvfp4

    x, offsets = _x(m, i, 3 * m + i), _offsets(m)
    gs = torch.tensor(GS, device="cuda")
    codes, scales = fused_silu_nvfp4(x, gs, _device(offsets), interleaved=interleaved)
    want_codes, want_scales = ref.fused_silu_nvfp4(x, offsets, gs, m + 3 + 5 * 128, interleaved)
    used = _used_scale_bytes(offsets, i, 16)
    assert torch.equal(codes[:m], want_codes)
    assert torch.equal(scales[:used], want_scales[:used])


def test_fused_silu_nvfp4_with_zero_and_negative_global_scales(fp4_layout):
    """A scale that is not a positive number quantizes to codes 0 under its (zero or negative)
    e4m3 scale byte, as in the reference, in every layout (the gate-table layout looks scales up
    in a table of the non-negative codes only)."""
    from cute_ep.silu import fused_silu_nvfp4

    m, i = 4096, 2048
    x, offsets = _x(m, i, 11), _offsets(m)
    gs = torch.tensor([-1.0, 0.5, 0.0, -3.0, 2.0], device="cuda")
    codes, scales = fused_silu_nvfp4(x, gs, _device(offsets))
    want_codes, want_scales = ref.fused_silu_nvfp4(x, offsets, gs, m + 3 + 5 * 128, False)
    used = _used_scale_bytes(offsets, i, 16)
    assert torch.equal(codes[:m], want_codes)
    assert torch.equal(scales[:used], want_scales[:used])
    negative_rows = codes[offsets[3]:offsets[4]]
    assert negative_rows.numel() and not negative_rows.any()


@pytest.mark.parametrize("limit", [None, 7.0], ids=["silu", "swiglu_oai"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("i", INTERMEDIATE)
@pytest.mark.parametrize("m", ROWS)
def test_fused_silu_mxfp4(m, i, interleaved, limit, fp4_layout):
    from cute_ep.silu import fused_silu_mxfp4

    x, offsets = _x(m, i, 4 * m + i), _offsets(m)
    codes, scales = fused_silu_mxfp4(x, _device(offsets), interleaved=interleaved,
                                     swiglu_limit=limit, swiglu_alpha=1.702)
    want_codes, want_scales = ref.fused_silu_mxfp4(x, offsets, m + 3 + 5 * 128, interleaved,
                                                   limit, 1.702)
    used = _used_scale_bytes(offsets, i, 32)
    assert torch.equal(codes[:m], want_codes)
    assert torch.equal(scales[:used], want_scales[:used])


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_fused_silu_mxfp4_swiglu_oai_special_values(interleaved, fp4_layout):
    """NaN and infinite gates and ups, ups past +-limit, gates at and past the table's bounds
    (zeros, subnormals, +-128 and beyond) scattered over the blocks: codes and scales equal the
    reference's, a NaN block included."""
    from cute_ep.silu import fused_silu_mxfp4

    m, i = 256, 2048
    x, offsets = _x(m, i, 21, interleaved), _offsets(m)
    gen = torch.Generator(device="cuda").manual_seed(22)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39,
                             128.0, -128.0, 300.0, -1e4, 7.0, -7.0, 7.5, -9.0, 2.0 ** -30],
                            device="cuda").to(torch.bfloat16)
    flat = x.view(-1)
    where = torch.randint(0, flat.numel(), (4000,), device="cuda", generator=gen)
    flat[where] = specials[torch.randint(0, len(specials), (4000,), device="cuda",
                                         generator=gen)]
    codes, scales = fused_silu_mxfp4(x, _device(offsets), interleaved=interleaved,
                                     swiglu_limit=7.0, swiglu_alpha=1.702)
    want_codes, want_scales = ref.fused_silu_mxfp4(x, offsets, m + 3 + 5 * 128, interleaved,
                                                   7.0, 1.702)
    used = _used_scale_bytes(offsets, i, 32)
    assert (want_scales[:used] == 0xFF).any()  # some blocks hold a NaN
    assert torch.equal(codes[:m], want_codes)
    assert torch.equal(scales[:used], want_scales[:used])


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_fused_silu_mxfp4_swiglu_oai_infinite_outputs_saturate(interleaved, fp4_layout):
    """SwiGLU-OAI's codes skip their saturation only for blocks whose amax is finite: with
    alpha 0 and a huge limit, large gates and ups overflow some outputs to +-inf, whose blocks
    take the largest scale (0xFE) and code 7 for the infinite elements, as the reference."""
    from cute_ep.silu import fused_silu_mxfp4

    m, i = 256, 2048
    x, offsets = _x(m, i, 23, interleaved), _offsets(m)
    gen = torch.Generator(device="cuda").manual_seed(24)
    big = torch.tensor([3e38, -3e38, 1e38, -2e37], device="cuda").to(torch.bfloat16)
    flat = x.view(-1)
    where = torch.randint(0, flat.numel(), (3000,), device="cuda", generator=gen)
    flat[where] = big[torch.randint(0, len(big), (3000,), device="cuda", generator=gen)]
    codes, scales = fused_silu_mxfp4(x, _device(offsets), interleaved=interleaved,
                                     swiglu_limit=1e30, swiglu_alpha=0.0)
    want_codes, want_scales = ref.fused_silu_mxfp4(x, offsets, m + 3 + 5 * 128, interleaved,
                                                   1e30, 0.0)
    used = _used_scale_bytes(offsets, i, 32)
    assert (want_scales[:used] == 0xFE).any()  # some blocks hold an infinite output
    assert torch.equal(codes[:m], want_codes)
    assert torch.equal(scales[:used], want_scales[:used])


@pytest.mark.parametrize("i", [256, 288])  # 288: NVFP4 and MXFP4 rows with padding columns
@pytest.mark.parametrize("out_format", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_rows_past_row_offsets_are_not_written(out_format, i, fp4_layout):
    """Outputs pre-filled with a sentinel keep it past the valid rows (and FP4 scale padding
    past the used blocks); the rows in range are all written."""
    from cute_ep.silu import _launch, _prepare

    if out_format == "fp8" and i % 128:
        pytest.skip("FP8 needs I a multiple of 128")
    m = 200
    x, offsets = _x(m, i, 9), [0, 70, 70, 150]
    width = {"bf16": 2 * i, "fp8": i, "nvfp4": i // 2, "mxfp4": i // 2}[out_format]
    out = torch.full((m, width), SENTINEL, dtype=torch.uint8, device="cuda")
    scales = None
    extra = {}
    if out_format == "fp8":
        scales = torch.full((i // 128 * m * 4,), SENTINEL, dtype=torch.uint8, device="cuda")
        extra["scale_stride"] = m
    elif out_format in ("nvfp4", "mxfp4"):
        scales = torch.full((1 << 16,), SENTINEL, dtype=torch.uint8, device="cuda")
        extra["work_rows"] = m
        if out_format == "nvfp4":
            extra["input_scales"] = torch.ones(3, device="cuda")
    row_offsets, _ = _prepare(out_format, x, _device(offsets))
    _launch(out_format, x, row_offsets, False, out, scales, **extra)
    assert (out[150:] == SENTINEL).all()
    assert (out[:150] != SENTINEL).any(dim=1).all()
    if out_format == "fp8":
        per_block = scales.view(torch.float32).view(i // 128, m)
        assert (per_block[:, 150:].view(torch.uint8) == SENTINEL).all()
    elif out_format in ("nvfp4", "mxfp4"):
        used = _used_scale_bytes(offsets, i, 16 if out_format == "nvfp4" else 32)
        assert (scales[used:] == SENTINEL).all() and (scales[:used] != SENTINEL).all()


def test_bad_arguments_are_refused():
    from cute_ep.silu import fused_silu, fused_silu_fp8, fused_silu_mxfp4, fused_silu_nvfp4

    x = torch.zeros(4, 2 * 2880, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 128"):
        fused_silu_fp8(x)
    with pytest.raises(TypeError, match="bfloat16"):
        fused_silu(x.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        fused_silu_mxfp4(torch.zeros(4, 2 * 48, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="segments"):
        fused_silu_nvfp4(x, torch.ones(3, device="cuda"), _device([0, 4]))
    with pytest.raises(ValueError, match="swiglu_limit"):
        fused_silu_mxfp4(x, swiglu_limit=-1.0)
    with pytest.raises(TypeError, match="int32"):
        fused_silu(x, torch.tensor([0, 4], device="cuda"))


@pytest.mark.parametrize("out_format", ["nvfp4", "mxfp4"])
def test_fp4_stream_pool_counters_return_to_zero_on_every_stream(out_format):
    """The FP4 stream kernels take their last chunks from a pool counter in global memory that
    each launch's last CTA sets back to zero: back-to-back launches on one stream, a launch on a
    second stream and a CUDA graph replay all give the reference's bytes, and every counter set
    is zero after them. 8192 rows of I = 2048 leave a pool of thousands of chunks, more than the
    grid has warps."""
    import cute_ep.silu
    from cute_ep.silu import fused_silu_mxfp4, fused_silu_nvfp4

    m, i = 8192, 2048
    x, offsets = _x(m, i, 11), _offsets(m)
    gs = torch.tensor(GS, device="cuda")
    row_offsets = _device(offsets)  # made before the capture: no copy from the host inside it
    if out_format == "nvfp4":
        def run():
            return fused_silu_nvfp4(x, gs, row_offsets)
        want_codes, want_scales = ref.fused_silu_nvfp4(x, offsets, gs, m + 3 + 5 * 128, False)
        block = 16
    else:
        def run():
            return fused_silu_mxfp4(x, row_offsets)
        want_codes, want_scales = ref.fused_silu_mxfp4(x, offsets, m + 3 + 5 * 128, False)
        block = 32
    used = _used_scale_bytes(offsets, i, block)

    def check(got):
        codes, scales = got
        assert torch.equal(codes[:m], want_codes)
        assert torch.equal(scales[:used], want_scales[:used])

    results = [run() for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        results.append(run())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for got in results + [captured]:
        check(got)
    sets = list(cute_ep.silu._COUNTERS.values())
    assert len(sets) >= 2  # this stream's and the side stream's
    for counters in sets:
        assert not counters.any()


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("out_format", ["nvfp4", "mxfp4", "swiglu_oai"])
@pytest.mark.parametrize("rows,valid", [(8192, 8192), (8192, 300), (2048, 0)])
def test_fp4_stream_valid_rows_at_and_below_capacity(rows, valid, out_format, interleaved,
                                                     monkeypatch):
    """The FP4 stream kernels on inputs whose valid rows are all of x's, far fewer (a capacity
    buffer: a split of a few chunks a warp and a small pool) and none: the valid rows' codes and
    scales are the reference's, and no code or scale byte past them is written."""
    import cute_ep.silu
    from cute_ep.silu import _launch, _prepare

    monkeypatch.setattr(cute_ep.silu, "_layout", lambda rows, sms: "table")
    i = 2048
    x = _x(rows - 3, i, rows + valid)  # rows - 3 + 3 rows
    offsets = [0, valid // 4, valid // 4, valid]
    fmt = "mxfp4" if out_format == "swiglu_oai" else out_format
    block = 16 if fmt == "nvfp4" else 32
    codes = torch.full((rows, i // 2), SENTINEL, dtype=torch.uint8, device="cuda")
    scale_rows = rows + 128 * 3
    scales = torch.full((fp4.scale_block_bytes(i, block) * (scale_rows // 128 + 1),), SENTINEL,
                        dtype=torch.uint8, device="cuda")
    extra = {"work_rows": scale_rows}
    if fmt == "nvfp4":
        gs = torch.tensor([0.5, 2.0, 3.0], device="cuda")
        extra["input_scales"] = gs
    if out_format == "swiglu_oai":
        extra["swiglu_oai"] = (7.0, 1.702)
    row_offsets, _ = _prepare(fmt, x, _device(offsets))
    _launch(fmt, x, row_offsets, interleaved, codes, scales, **extra)
    if fmt == "nvfp4":
        want_codes, want_scales = ref.fused_silu_nvfp4(x, offsets, gs, scale_rows, interleaved)
    else:
        limit = 7.0 if out_format == "swiglu_oai" else None
        want_codes, want_scales = ref.fused_silu_mxfp4(x, offsets, scale_rows, interleaved,
                                                       swiglu_limit=limit)
    used = _used_scale_bytes(offsets, i, block)
    assert torch.equal(codes[:valid], want_codes[:valid])
    assert (codes[valid:] == SENTINEL).all()
    assert torch.equal(scales[:used], want_scales[:used])
    assert (scales[used:] == SENTINEL).all()
