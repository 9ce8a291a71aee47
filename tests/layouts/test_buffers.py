"""EP buffers and dispatch outputs against plain formulas, at model shapes and R = 2, 4, 8."""

import dataclasses

import pytest

from layouts.buffers import (NARROW_TILE_CHUNKS, NARROW_TILE_WORDS, WIDE_TILE_CHUNKS,
                             WIDE_TILE_ROWS, WIDE_TILE_WORDS, EPConfig, buffer_sizes,
                             dispatch_outputs, dispatch_rows, dispatch_scale_rows,
                             dispatch_send_buffer, narrow_tile_word, output_scales,
                             output_tokens, peer_visible_bytes, total_bytes, wide_tile_word)
from layouts.channels import ChannelGeometry

from .conftest import MODELS, RANKS

FORMATS = ["bf16", "fp8", "nvfp4", "mxfp4"]


def configs():
    for name, h, k, e in MODELS:
        for r in RANKS:
            for fmt in FORMATS:
                block = {"bf16": 1, "fp8": 128, "nvfp4": 16, "mxfp4": 32}[fmt]
                if h % block == 0 and e % r == 0:
                    yield pytest.param(EPConfig(h, k, e, r, 4096, fmt), id=f"{name}-R{r}-{fmt}")


@pytest.mark.parametrize("cfg", list(configs()))
def test_buffers_at_model_shapes(cfg, rng):
    msg, t, r, h, k = cfg.message.size, cfg.max_tokens_per_rank, cfg.ranks, cfg.hidden, cfg.topk
    assert cfg.max_recv == t * min(cfg.experts, r * k)
    send = dispatch_send_buffer(cfg).layout
    for _ in range(500):
        b, tok = rng.randrange(msg), rng.randrange(t)
        assert send((b, tok)) == tok * msg + b

    tokens = output_tokens(cfg)
    width = {"bf16": h, "fp8": h, "nvfp4": h // 2, "mxfp4": h // 2}[cfg.format]
    row = rng.randrange(cfg.row_capacity)
    assert tokens.layout((3, row)) == row * width + 3
    assert tokens.nbytes == -(-cfg.row_capacity * width * (2 if cfg.format == "bf16" else 1)
                               // 16) * 16
    scales = output_scales(cfg)
    if cfg.format == "fp8":
        assert cfg.row_capacity == cfg.max_recv + 3 * cfg.local_experts
        assert scales.layout((row, 5)) == 5 * cfg.row_capacity + row  # transposed [H/128, rows]
    elif cfg.format in ("nvfp4", "mxfp4"):
        vector = 16 if cfg.format == "nvfp4" else 32
        assert scales.layout.mode(0).size() >= cfg.max_recv + 128 * cfg.local_experts
        assert scales.nbytes == scales.layout.mode(0).size() * -(-h // (4 * vector)) * 4
    else:
        assert scales is None
    # The received rows' scales, row by row (a row's words contiguous), before the output layout.
    words = {"fp8": h // 128, "nvfp4": h // 64}.get(cfg.format, 0)
    staged = dispatch_scale_rows(cfg)
    assert (staged is None) == (words == 0)
    if staged is not None:
        word = rng.randrange(words)
        assert staged.layout((word, row)) == row * words + word
        assert staged.nbytes == -(-cfg.row_capacity * words * 4 // 16) * 16
    if cfg.format == "fp8":  # the slabs layout stores the output's layout directly
        assert dispatch_scale_rows(dataclasses.replace(cfg, layout="slabs")) is None
        # The sources layout's receivers store scales row by row as the packed one's do: one
        # row a received token.
        by_source = dataclasses.replace(cfg, layout="sources")
        staged = dispatch_scale_rows(by_source)
        assert staged is not None and staged.layout.cosize() == by_source.row_capacity * words
        staged = dispatch_scale_rows(cfg)

    for channels in (5, 24):
        sizes = buffer_sizes(cfg, channels)
        peer = sum(sizes["peer-visible"].values())
        assert peer == peer_visible_bytes(cfg, channels) == \
            ChannelGeometry(cfg, channels).peer_offsets()["total"]
        assert total_bytes(cfg, channels) == peer + sum(sizes["local"].values()) + \
            sum(sizes["dispatch outputs"].values())
        assert ("dispatch_send" in sizes["local"]) == (cfg.format != "bf16")
        assert ("dispatch_scale_rows" in sizes["local"]) == (staged is not None)
        assert sizes["dispatch outputs"]["route_channels"] == -(-4 * r * channels // 16) * 16


def test_small_buffers_at_every_coordinate():
    cfg = EPConfig(hidden=128, topk=2, experts=6, ranks=3, max_tokens_per_rank=5,
                   format="nvfp4", fused_shared_expert=True)
    assert cfg.segments == 3 and cfg.max_recv == 5 * 6 + 5
    names = [b.name for b in dispatch_outputs(cfg)]
    assert names == ["tokens", "scales", "row_offsets", "expert_ids", "src_info",
                     "recv_counts_per_expert", "scales_offsets", "route_rows", "route_weights",
                     "route_tokens", "route_messages", "route_channels"]
    src_info = dispatch_outputs(cfg)[4].layout
    assert [src_info((r, f)) for r in range(3) for f in range(2)] == list(range(6))


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("counts", [
    [[0, 0], [0, 0]],
    [[3, 0, 1], [0, 0, 0], [5, 2, 7]],
    [[4096, 4096, 4096, 4096]] + [[0] * 4] * 3,  # one hot expert
])
def test_expert_major_rows_are_a_bijection_onto_valid_rows(counts, align):
    row_offsets, rows = dispatch_rows(counts, align)
    assert row_offsets[0] == 0
    valid = set()
    for g, per_source in enumerate(counts):
        assert row_offsets[g] % align == 0
        start = row_offsets[g]
        for s, n in enumerate(per_source):
            for j in range(n):
                assert rows[(g, s, j)] == start + sum(per_source[:s]) + j
        valid |= set(range(start, start + sum(per_source)))
        assert row_offsets[g + 1] - start == -(-sum(per_source) // align) * align
    assert sorted(rows.values()) == sorted(valid)
    assert len(set(rows.values())) == len(rows)


@pytest.mark.parametrize("kwargs,constraint", [
    (dict(experts=10, ranks=4), "E must be divisible by R"),
    (dict(topk=9, experts=8, ranks=2), "K <= E"),
    (dict(hidden=2880, format="fp8"), "multiple of the 128-element scale block"),
    (dict(hidden=4100, format="nvfp4"), "multiple of the 16-element scale block"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be positive"),
    (dict(ranks=0), "ranks must be at least 1"),
    (dict(experts=12, ranks=6, gpus_per_node=4), "gpus_per_node .* positive divisor of ranks"),
    (dict(gpus_per_node=0), "gpus_per_node .* positive divisor of ranks"),
])
def test_bad_parameters_name_the_constraint(kwargs, constraint):
    base = dict(hidden=4096, topk=2, experts=8, ranks=2, max_tokens_per_rank=128, format="bf16")
    with pytest.raises(ValueError, match=constraint):
        EPConfig(**{**base, **kwargs})


@pytest.mark.parametrize("ranks,gpus_per_node", [(8, None), (8, 8), (8, 4), (16, 8), (4, 1),
                                                 (2, 1)])
def test_ranks_share_a_node_when_their_index_divided_by_its_gpus_agrees(ranks, gpus_per_node):
    """`gpus_per_node` G: ranks r and r' share a node iff r // G == r' // G; None puts every rank
    on one node. The nodes partition the ranks into equal runs."""
    cfg = EPConfig(4096, 2, 2 * ranks, ranks, 128, gpus_per_node=gpus_per_node)
    g = ranks if gpus_per_node is None else gpus_per_node
    assert cfg.node_ranks == g and cfg.nodes == ranks // g
    for r in range(ranks):
        for r2 in range(ranks):
            assert (cfg.node_of(r) == cfg.node_of(r2)) == (r // g == r2 // g)
    members = [[r for r in range(ranks) if cfg.node_of(r) == n] for n in range(cfg.nodes)]
    assert members == [list(range(n * g, (n + 1) * g)) for n in range(cfg.nodes)]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_a_receive_capacity_bounds_the_dispatch_outputs(fmt):
    """`recv_capacity` sizes every row buffer of the output (FP8's padding and NVFP4's 128-row
    scale blocks on top), is capped at the worst case, and is refused where it cannot hold."""
    worst = EPConfig(7168, 8, 256, 8, 4096, fmt)
    cfg = dataclasses.replace(worst, recv_capacity=65536)
    pad = 3 * cfg.segments if fmt == "fp8" else 0
    assert worst.recv_rows == worst.max_recv == 262144
    assert cfg.recv_rows == 65536 and cfg.row_capacity == 65536 + pad
    width = {"bf16": 2 * 7168, "fp8": 7168, "nvfp4": 3584}[fmt]
    assert output_tokens(cfg).nbytes == cfg.row_capacity * width
    if fmt == "nvfp4":
        assert output_scales(cfg).layout.mode(0).size() == 65536 + 128 * cfg.segments
    if fmt == "fp8":
        assert output_scales(cfg).layout((7, 2)) == 2 * cfg.row_capacity + 7
    assert dataclasses.replace(worst, recv_capacity=10 ** 9).row_capacity == worst.row_capacity
    with pytest.raises(ValueError, match="slabs are sized by max_tokens_per_rank"):
        EPConfig(7168, 8, 256, 8, 128, "bf16", layout="slabs", recv_capacity=512)
    with pytest.raises(ValueError, match="at least 1"):
        dataclasses.replace(worst, recv_capacity=0)
    with pytest.raises(ValueError, match="at least 4096 .*shared expert"):
        EPConfig(7168, 8, 256, 8, 4096, fmt, fused_shared_expert=True, recv_capacity=4095)


def test_the_sources_layout_holds_one_row_per_received_token():
    """DeepEP's normal-mode layout: at most every token of every rank, once; no alignment
    rows; each row's K local ids and weights beside it; bf16 and fp8 routed experts only."""
    cfg = EPConfig(7168, 8, 256, 8, 4096, "fp8", layout="sources")
    assert cfg.max_recv == cfg.recv_rows == cfg.row_capacity == 8 * 4096
    assert cfg.row_align == 1 and cfg.segment_rows == -1 and cfg.slab_rows == 0
    assert EPConfig(7168, 8, 256, 8, 4096, "fp8").segment_rows == 0
    assert EPConfig(7168, 8, 256, 8, 128, "bf16", layout="slabs").segment_rows == 8 * 128
    names = {b.name: b for b in dispatch_outputs(cfg)}
    for name, dtype in (("recv_topk_ids", "int32"), ("recv_topk_weights", "float32")):
        assert names[name].dtype == dtype
        assert names[name].layout((3, 5)) == 5 * 8 + 3  # [rows, K], row-major
        assert names[name].layout.size() == cfg.row_capacity * 8
    assert "recv_topk_ids" not in {b.name for b in dispatch_outputs(
        dataclasses.replace(cfg, layout="packed"))}
    assert dataclasses.replace(cfg, recv_capacity=1000).row_capacity == 1000
    for bad in (dict(format="nvfp4"), dict(fused_shared_expert=True)):
        with pytest.raises(ValueError, match="the sources layout is for bf16 and fp8 routed"):
            dataclasses.replace(cfg, **bad)


def test_wide_write_out_tiles_hold_every_chunk_once():
    """A write-out tile's 16-byte chunks (`wide_tile_word`) fill its WIDE_TILE_ROWS x
    WIDE_TILE_WORDS words exactly once, every chunk 16-byte aligned inside its own row."""
    words = [wide_tile_word(r, c) for r in range(WIDE_TILE_ROWS)
             for c in range(WIDE_TILE_CHUNKS)]
    assert sorted(words) == list(range(0, WIDE_TILE_ROWS * WIDE_TILE_WORDS, 4))
    for r in range(WIDE_TILE_ROWS):
        row = {wide_tile_word(r, c) // WIDE_TILE_WORDS for c in range(WIDE_TILE_CHUNKS)}
        assert row == {r}


def test_wide_tile_read_back_is_strided_and_conflict_free():
    """What FP8's `_write_wide` relies on: lane l's rows 4 l .. 4 l + 3 of chunk c lie at a
    fixed stride from row 4 l's (one 16-byte shared load per row through a strided layout), and
    the eight lanes of each quarter-warp read eight different 16-byte bank groups (no bank
    conflict)."""
    for c in range(WIDE_TILE_CHUNKS):
        for p in range(4):
            at = [wide_tile_word(4 * lane + p, c) for lane in range(32)]
            assert at == [wide_tile_word(4 * lane, c) + p * WIDE_TILE_WORDS
                          for lane in range(32)]
            for quarter in range(4):
                groups = {(w // 4) % 8 for w in at[8 * quarter:8 * quarter + 8]}
                assert len(groups) == 8, (c, p, quarter)


def test_wide_tile_loads_fill_whole_rows():
    """The tile's loads: load k of a warp puts lane l's chunk l % 8 of row l // 8 + 4 k, so
    each eight lanes write one row's eight positions (one whole 128-byte line of staged row)."""
    seen = set()
    for k in range(WIDE_TILE_ROWS * WIDE_TILE_CHUNKS // 32):
        for lane in range(32):
            r, c = lane // WIDE_TILE_CHUNKS + 4 * k, lane % WIDE_TILE_CHUNKS
            seen.add(wide_tile_word(r, c))
        for r in range(4 * k, 4 * k + 4):
            assert {w for w in seen if w // WIDE_TILE_WORDS == r} == \
                set(range(r * WIDE_TILE_WORDS, (r + 1) * WIDE_TILE_WORDS, 4))
    assert len(seen) == WIDE_TILE_ROWS * WIDE_TILE_CHUNKS


def test_narrow_write_out_tiles_hold_every_chunk_once():
    """NVFP4's write-out tile (`narrow_tile_word`) holds its WIDE_TILE_ROWS x NARROW_TILE_WORDS
    words exactly once, every chunk 16-byte aligned inside its own row."""
    words = [narrow_tile_word(r, c) for r in range(WIDE_TILE_ROWS)
             for c in range(NARROW_TILE_CHUNKS)]
    assert sorted(words) == list(range(0, WIDE_TILE_ROWS * NARROW_TILE_WORDS, 4))
    for r in range(WIDE_TILE_ROWS):
        assert {narrow_tile_word(r, c) // NARROW_TILE_WORDS
                for c in range(NARROW_TILE_CHUNKS)} == {r}


def test_narrow_tile_read_back_is_strided_and_conflict_free():
    """What `_write_narrow`'s stores rely on: lane l reads chunk c of rows l, l + 32, l + 64,
    l + 96 (the four rows of its 16 bytes of an atom) at a fixed stride from row l's, and each
    quarter-warp's eight lanes read eight different 16-byte bank groups."""
    for c in range(NARROW_TILE_CHUNKS):
        for p in range(4):
            at = [narrow_tile_word(lane + 32 * p, c) for lane in range(32)]
            assert at == [narrow_tile_word(lane, c) + p * 32 * NARROW_TILE_WORDS
                          for lane in range(32)]
            for quarter in range(4):
                assert len({(w // 4) % 8 for w in at[8 * quarter:8 * quarter + 8]}) == 8


def test_narrow_tile_loads_walk_whole_rows_a_constant_apart():
    """`_load_narrow`: lane l copies chunk l % 4 of rows l // 4 + 8 k, so its k-th chunk lies
    k rows-of-eight past its first (one address plus a constant), each quarter-warp writes two
    whole rows into eight different bank groups, and the 16 loads fill the tile."""
    chunks, step = NARROW_TILE_CHUNKS, 32 // NARROW_TILE_CHUNKS
    seen = set()
    for k in range(WIDE_TILE_ROWS // step):
        at = [narrow_tile_word(lane // chunks + step * k, lane % chunks) for lane in range(32)]
        assert at == [narrow_tile_word(lane // chunks, lane % chunks)
                      + k * step * NARROW_TILE_WORDS for lane in range(32)]
        for quarter in range(4):
            part = at[8 * quarter:8 * quarter + 8]
            assert len({(w // 4) % 8 for w in part}) == 8
            assert {w // NARROW_TILE_WORDS for w in part} == \
                {step * k + 2 * quarter, step * k + 2 * quarter + 1}
        seen.update(at)
    assert seen == set(range(0, WIDE_TILE_ROWS * NARROW_TILE_WORDS, 4))
