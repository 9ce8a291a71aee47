"""Token message layouts against a plain byte-count formula."""

import pytest

from layouts.formats import FORMATS, message_layout

from .conftest import MODELS

# Independent statement of the message: (payload bytes, scale bytes) per format.
WIRE = {
    "bf16": lambda h: (2 * h, 0),
    "fp8": lambda h: (h, 4 * (h // 128)),
    "nvfp4": lambda h: (h // 2, h // 16),
    "mxfp4": lambda h: (h // 2, h // 32),
}


def up16(n):
    return -(-n // 16) * 16


def expected_offsets(fmt, hidden, topk):
    payload, scales = WIRE[fmt](hidden)
    scales_at = up16(payload)
    meta_at = up16(scales_at + scales)
    return {"payload": 0, "scales": scales_at if scales else None, "src_token": meta_at,
            "expert_ids": meta_at + 4, "weights": meta_at + 4 + 4 * topk,
            "size": up16(meta_at + 4 + 8 * topk)}


def _valid(fmt, hidden):
    block = FORMATS[fmt].block
    return block == 1 or hidden % block == 0


CASES = [(f, h, k) for f in FORMATS for (_, h, k, _) in MODELS if _valid(f, h)]
CASES += [(f, h, k) for f in FORMATS for h in (128, 256, 384) for k in (1, 3)]


@pytest.mark.parametrize("fmt,hidden,topk", CASES)
def test_message_segments_match_the_formula(fmt, hidden, topk):
    msg = message_layout(fmt, hidden, topk)
    want = expected_offsets(fmt, hidden, topk)
    assert msg.size == want["size"]
    for seg in msg.segments:
        assert seg.offset == want[seg.name], seg.name
    assert ("scales" in {s.name for s in msg.segments}) == (want["scales"] is not None)
    payload, scales = WIRE[fmt](hidden)
    assert msg.segment("payload").nbytes == payload
    if scales:
        assert msg.segment("scales").nbytes == scales


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_byte_of_a_small_message_maps_once(fmt):
    msg = message_layout(fmt, 256, 3)
    seen = {}
    for seg in msg.segments:
        for byte, element in seg.layout.coordinates():
            offset = seg.byte_offset(element, byte)
            assert offset == seg.offset + element * seg.element_bytes + byte
            assert offset not in seen, f"{seg.name} overlaps {seen.get(offset)}"
            seen[offset] = seg.name
    cosize = max(seen) + 1
    assert msg.size % 16 == 0 and 0 <= msg.size - cosize < 16
    for seg in msg.segments:
        if seg.name in ("payload", "scales", "src_token"):
            assert seg.offset % 16 == 0, f"{seg.name} is not 16-byte aligned"


@pytest.mark.parametrize("fmt,hidden,constraint", [
    ("fp8", 2880, "multiple of the 128-element scale block"),
    ("nvfp4", 2888, "multiple of the 16-element scale block"),
    ("mxfp4", 2880 + 16, "multiple of the 32-element scale block"),
    ("bf16", 0, "must be positive"),
])
def test_bad_hidden_sizes_name_the_constraint(fmt, hidden, constraint):
    with pytest.raises(ValueError, match=constraint):
        message_layout(fmt, hidden, 2)


def test_unknown_format_and_bad_topk():
    with pytest.raises(ValueError, match="unknown token format"):
        message_layout("int4", 128, 2)
    with pytest.raises(ValueError, match="top-k"):
        message_layout("bf16", 128, 0)
