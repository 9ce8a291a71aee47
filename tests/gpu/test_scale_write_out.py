"""`scale_write_out` (the dispatch's phase 4 alone) against the reference layout of staged rows:
NVFP4's 128x4 blocks (segments on fresh blocks, padding zero) and FP8's transposed columns, by
the wide tiles (from the kernel's `wide_min_rows` rows on) and by the narrow ones, at several
CTA counts."""

import pytest
import torch

from cute_ep.reference.ep import scale_layout_of_rows, staged_segments

pytestmark = pytest.mark.gpu

H = 7168


def _launch(fmt, counts, ctas, seed, hidden=H):
    from cute_ep.runtime.launch import runtime

    kernel = runtime().select("scale_write_out", "cuda", format=fmt)
    offsets, firsts = staged_segments(fmt, counts)
    off, raw, first = (torch.tensor(v, dtype=torch.int32, device="cuda")
                       for v in (offsets, counts, firsts))
    rows = offsets[-1]
    words = hidden // 128 if fmt == "fp8" else hidden // 64
    capacity = rows + 8
    gen = torch.Generator(device="cuda").manual_seed(seed)
    staged = torch.rand(capacity, words, device="cuda", generator=gen).view(torch.int32)
    if fmt == "nvfp4":
        staged = torch.randint(-2 ** 31, 2 ** 31 - 1, (capacity, words), dtype=torch.int32,
                               device="cuda", generator=gen)
    want = scale_layout_of_rows(fmt, staged[:rows], hidden, counts, capacity)
    out = torch.full_like(want, 7) if fmt == "nvfp4" else torch.full_like(want, float("nan"))
    vector_bytes = kernel.spec.sizes["vector_bytes"]
    payload_vectors = (hidden // 2 if fmt == "nvfp4" else hidden) // vector_bytes
    kernel.launch(staged, out, off, raw, first, len(counts),
                  payload_vectors, capacity, ctas)
    torch.cuda.synchronize()
    if fmt == "fp8":
        return out[:, :rows], want[:, :rows]
    return out, want


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("ctas", [24, 7])
@pytest.mark.parametrize("size", ["wide", "narrow"])
# H 7168: NVFP4's 112 scale words a row are seven whole 16-word tiles; 7424: 116, the last tile
# a quarter full (FP8's 58 words are not 16-byte rows: the small tiles); 8192: NVFP4's 128 words
# in eight tiles, FP8's 64 in two wide ones; 18432: NVFP4's 288 in 18, FP8's 144 in four and a
# half.
@pytest.mark.parametrize("hidden", [H, 7424, 8192, 18432])
def test_the_write_out_gives_the_reference_layout(fmt, ctas, size, hidden):
    from cute_ep.runtime.launch import runtime

    wide_min_rows = runtime().select("scale_write_out", "cuda",
                                     format=fmt).spec.sizes["wide_min_rows"]
    gen = torch.Generator().manual_seed(ctas)
    n = 128 if size == "wide" else 16
    counts = torch.randint(0, 2 * wide_min_rows // n if size == "wide" else 40, (n,),
                           generator=gen).tolist()
    counts[1] = 0  # an empty segment
    counts[2] = 128  # one whole block
    counts[3] = 129  # a block and one row
    if size == "wide":  # at least wide_min_rows in all, the rest in segment 4
        counts[4] += max(0, wide_min_rows - sum(counts))
    if size == "wide":
        assert sum(counts) >= wide_min_rows
    else:
        assert sum(counts) < wide_min_rows
    got, want = _launch(fmt, counts, ctas, seed=ctas, hidden=hidden)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
