"""The transport's small buffers (message metadata, counts, flags, counters, the error record,
the dispatch handle) against the byte arithmetic a kernel would otherwise write by hand.

Each expected offset below is the plain formula, in bytes, that the first-generation kernels
used (e.g. `meta + 4 + (topk + k) * 4` for a weight); each layout must give the same address at
every coordinate."""

import itertools

import pytest

from layouts.buffers import (ELEMENT_BYTES, ERROR_FIELDS, LAUNCH_FIELDS, EPConfig,
                             channel_messages, combine_routes, control_buffers, error_words)
from layouts.channels import counters_layout
from layouts.formats import FORMATS, METADATA_FIELDS, message_layout

from .conftest import MODELS

SMALL = [EPConfig(128, k, e, r, t, fmt, shared)
         for (k, e, r, t) in [(1, 2, 2, 3), (3, 6, 3, 5), (8, 32, 8, 7)]
         for fmt in ("bf16", "fp8", "nvfp4") for shared in (False, True)]


def byte_of(buffer, coord):
    return buffer.layout(coord) * ELEMENT_BYTES[buffer.dtype]


def coordinates(buffer):
    return buffer.layout.coordinates()


@pytest.mark.parametrize("fmt,hidden,topk",
                         [(f, h, k) for f in FORMATS for (_, h, k, _) in MODELS
                          if h % FORMATS[f].block == 0] + [("bf16", 128, 1), ("fp8", 256, 3)])
def test_message_metadata_words(fmt, hidden, topk):
    msg = message_layout(fmt, hidden, topk)
    meta = msg.segment("src_token").offset
    # The source token, then K words per field in METADATA_FIELDS order.
    assert (msg.metadata_base - 1) * 4 == meta
    for k, f in itertools.product(range(topk), range(len(METADATA_FIELDS))):
        assert (msg.metadata_base + msg.metadata((k, f))) * 4 == meta + 4 + (f * topk + k) * 4
    for f, name in enumerate(METADATA_FIELDS):
        seg = msg.segment(name)
        for k in range(topk):
            assert (seg.element_offset + seg.element_layout(k)) * 4 == \
                meta + 4 + (f * topk + k) * 4
    for seg in msg.segments:
        assert seg.element_offset * seg.element_bytes == seg.offset
        assert [seg.element_layout(i) for i in range(seg.elements)] == list(range(seg.elements))


@pytest.mark.parametrize("cfg", SMALL, ids=repr)
@pytest.mark.parametrize("channels", [1, 5])
def test_control_state(cfg, channels):
    r = cfg.ranks
    control = {b.name: b for b in control_buffers(cfg, channels)}
    assert list(control) == ["dispatch_round", "dispatch_done", "combine_place",
                             "stream_positions", "error"]
    for name in ("dispatch_done", "combine_place"):
        assert control[name].dtype == "int32" and \
            control[name].layout.cosize() == len(LAUNCH_FIELDS)
    assert control["stream_positions"].layout == counters_layout(channels, r)
    for c, rank, kind, phase in coordinates(control["stream_positions"]):
        assert byte_of(control["stream_positions"], (c, rank, kind, phase)) == \
            (((phase * 2 + kind) * r + rank) * channels + c) * 8
    per_channel = channel_messages(cfg, channels)
    for s, c in coordinates(per_channel):
        assert byte_of(per_channel, (s, c)) == (c * r + s) * 4


def test_error_record_fields():
    err = error_words()
    # missing rank + 1 at byte 0, its phase at 4, bad-id bits at 8, inconsistent counts at 12
    assert ERROR_FIELDS == ("missing_rank", "phase", "bad_ids", "bad_counts")
    assert [byte_of(err, i) for i in range(len(ERROR_FIELDS))] == [0, 4, 8, 12]


@pytest.mark.parametrize("cfg", SMALL, ids=repr)
def test_dispatch_handle(cfg):
    t, r, k = cfg.max_tokens_per_rank, cfg.ranks, cfg.topk
    rows, weights, tokens, messages = combine_routes(cfg)
    for kk, j, s in coordinates(rows):
        at = s * t + j
        assert byte_of(rows, (kk, j, s)) == byte_of(weights, (kk, j, s)) == (at * k + kk) * 4
        assert byte_of(tokens, (j, s)) == at * 4
    assert [messages.layout(s) for s in range(r)] == list(range(r))


@pytest.mark.parametrize("cfg", SMALL, ids=repr)
def test_every_buffer_is_a_compact_torch_tensor(cfg):
    for b in [*control_buffers(cfg), *combine_routes(cfg), channel_messages(cfg, 3)]:
        shape = b.torch_shape
        numel = 1
        for n in shape:
            numel *= n
        assert numel == b.layout.size() == b.layout.cosize(), b.name
        # Row-major over the reversed modes: torch's index (i_n, ..., i_0) is coordinate (i_0..).
        strides = [1]
        for n in reversed(shape[1:]):
            strides.insert(0, strides[0] * n)
        for coord in itertools.islice(b.layout.coordinates(), 200):
            assert b.layout(coord) == sum(c * st for c, st in zip(reversed(coord), strides))
