"""Transport v2's ring geometry against plain formulas, and its memory bound."""

import random

import pytest

from layouts.buffers import EPConfig
from layouts.channels import (COMBINE_VECTORS, COUNTER_BYTES, TOKENS_PER_CHANNEL,
                              ChannelGeometry, active_channels, batch_header_layout,
                              channel_tokens, combine_vectors, header_token_word)

from .conftest import MODELS


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_rings_against_the_formula(fmt, ranks, rng):
    cfg = EPConfig(7168, 8, 256, ranks, 4096, fmt)
    geo = ChannelGeometry(cfg, channels=24)
    slots, row = geo.ring_slots, 2 * cfg.hidden
    # A batch header: 16 tokens' K ids, then their K weights, then their indices, 16-byte
    # aligned.
    header = -(-(4 * 16 * (2 * cfg.topk + 1)) // 16) * 16
    # A staged message: payload and scales (no metadata), 16-byte aligned.
    payload = {"bf16": 2 * cfg.hidden, "fp8": cfg.hidden, "nvfp4": cfg.hidden // 2}[fmt]
    scales = {"bf16": 0, "fp8": cfg.hidden // 128 * 4, "nvfp4": cfg.hidden // 16}[fmt]
    staged = -(-payload // 16) * 16 + -(-scales // 16) * 16
    assert geo.header_bytes == header and cfg.message.staged_bytes == staged
    headers, back, counters = geo.headers(), geo.combine_ring(), geo.counters()
    staging, words = geo.staging(), batch_header_layout(cfg.topk)
    assert geo.stage_slots == 16 * geo.stage_batches
    for _ in range(500):
        s, c, src = rng.randrange(slots), rng.randrange(24), rng.randrange(ranks)
        batch, b = rng.randrange(geo.stage_batches), rng.randrange(header)
        assert headers((b, batch, c)) == (c * geo.stage_batches + batch) * header + b
        k, field, t = rng.randrange(cfg.topk), rng.randrange(2), rng.randrange(16)
        assert words((k, field, t)) == field * 16 * cfg.topk + t * cfg.topk + k
        assert header_token_word(cfg.topk, t) == 32 * cfg.topk + t
        slot, b = rng.randrange(geo.stage_slots), rng.randrange(staged)
        assert staging((b, slot, c)) == (c * geo.stage_slots + slot) * staged + b
        b = rng.randrange(row)
        assert back((b, s, c, src)) == ((src * 24 + c) * slots + s) * row + b
        kind, phase = rng.randrange(2), rng.randrange(2)
        assert counters((c, src, kind, phase)) == ((phase * 2 + kind) * ranks + src) * 24 + c
    assert sorted(counters.offsets()) == list(range(24 * ranks * 4))
    # Every header word of a batch is one (k, field, token) or one token's index, once.
    assert sorted([*words.offsets(), *(header_token_word(cfg.topk, t) for t in range(16))]) \
        == list(range(16 * (2 * cfg.topk + 1)))
    assert geo.peer_bytes()["counters"] == 24 * ranks * 4 * COUNTER_BYTES
    assert geo.peer_bytes()["staging"] == 24 * geo.stage_slots * staged
    assert geo.peer_bytes()["batch_headers"] == 24 * geo.stage_batches * header


@pytest.mark.parametrize("name,hidden,topk,experts", MODELS)
def test_peer_memory_is_bounded_by_the_geometry_not_the_tokens(name, hidden, topk, experts):
    for tokens in (128, 4096, 65536):
        cfg = EPConfig(hidden, topk, experts, 8, tokens)
        total = sum(ChannelGeometry(cfg, channels=24).peer_bytes().values())
        assert total <= 256 << 20, f"{name}: {total / 2**20:.0f} MiB at 8 ranks"
    small = sum(ChannelGeometry(EPConfig(hidden, topk, experts, 8, 128), 24).peer_bytes().values())
    assert small == total  # the same at every token count


@pytest.mark.parametrize("tokens", [0, 1, 23, 24, 25, 4096])
@pytest.mark.parametrize("channels", [1, 7, 24])
def test_channels_split_the_tokens_into_contiguous_runs(tokens, channels):
    geo = ChannelGeometry(EPConfig(128, 2, 8, 2, 4096), channels)
    runs = [geo.token_range(c, tokens) for c in range(channels)]
    assert runs[0][0] == 0 and runs[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    sizes = [e - b for b, e in runs]
    assert max(sizes) - min(sizes) <= 1


def test_bad_geometry_names_the_parameter():
    with pytest.raises(ValueError, match="ring_chunks"):
        ChannelGeometry(EPConfig(128, 2, 8, 2, 64), 4, ring_chunks=0)


@pytest.mark.parametrize("channels", [1, 5, 24, 132])
def test_decode_uses_one_channel_per_few_tokens(channels):
    assert active_channels(channels, 4096, None) == min(channels, 4096 // TOKENS_PER_CHANNEL)
    for bound in (0, 1, TOKENS_PER_CHANNEL, TOKENS_PER_CHANNEL + 1, 128, 4096):
        active = active_channels(channels, 4096, bound)
        assert 1 <= active <= channels
        assert active == channels or active * TOKENS_PER_CHANNEL >= bound > \
            (active - 1) * TOKENS_PER_CHANNEL or (bound == 0 and active == 1)
        # every token below the bound has a channel, and the runs tile [0, T)
        runs = [channel_tokens(c, bound, active) for c in range(active)]
        assert runs[0][0] == 0 and runs[-1][1] == bound


def test_a_geometry_refuses_more_channels_than_a_count_flag_carries():
    from layouts.channels import MAX_CHANNELS

    cfg = EPConfig(hidden=256, topk=2, experts=8, ranks=2, max_tokens_per_rank=16)
    assert ChannelGeometry(cfg, MAX_CHANNELS).channels == MAX_CHANNELS
    with pytest.raises(ValueError, match=f"at most {MAX_CHANNELS} channels"):
        ChannelGeometry(cfg, MAX_CHANNELS + 1)


def test_a_count_flag_reads_back_as_its_round_channels_and_kind():
    from layouts.channels import MAX_CHANNELS, count_flag, read_count_flag

    assert read_count_flag(0) == "none"
    assert read_count_flag(count_flag(1, 24, True)) == "round 1, 24 channels, prefixed counts"
    assert read_count_flag(count_flag(7, MAX_CHANNELS, False)) == \
        f"round 7, {MAX_CHANNELS} channels"
    # Distinct (round, channels, kind) give distinct flags, and a later round's is larger: the
    # receivers wait for epoch * FLAG_ROUND or more.
    words = {count_flag(e, c, p) for e in (1, 2, 3) for c in (1, 24, MAX_CHANNELS)
             for p in (0, 1, 2)}
    assert len(words) == 3 * 3 * 3
    assert count_flag(2, 1, 0) > count_flag(1, MAX_CHANNELS, 2)
    assert read_count_flag(count_flag(3, 132, 2)) == \
        "round 3, 132 channels, block-prefixed counts"


@pytest.mark.parametrize("active", [1, 7, 8, 9, 48, 131, 132, 255])
def test_block_prefixed_counts_give_every_channel_its_prefix_and_the_total(active):
    """What a source sends with block-prefixed counts (each channel: its own count, the sum
    over its block's channels before it, its block's total) and what a receiving channel makes
    of them (its own COUNT_BEFORE plus one COUNT_ALL of every block before its own; every
    block's COUNT_ALL in all) equal the sums over every channel, for random counts."""
    from layouts.channels import COUNT_BLOCK, count_block

    gen = random.Random(active)
    own = [gen.randrange(0, 50) for _ in range(active)]
    blocks = range(0, active, COUNT_BLOCK)
    assert all(count_block(c) in blocks and count_block(c) <= c < count_block(c) + COUNT_BLOCK
               for c in range(active))
    # The source side: a channel counts the tokens of its block, [first, last) of channels.
    before = [sum(own[count_block(c):c]) for c in range(active)]
    block_all = [sum(own[count_block(c):min(count_block(c) + COUNT_BLOCK, active)])
                 for c in range(active)]
    for c in range(active):
        # The receiving side: one channel's COUNT_ALL a block (its own for its own block).
        reads = [c if b == count_block(c) else b for b in blocks]
        part = before[c] + sum(block_all[r] for r, b in zip(reads, blocks) if b < count_block(c))
        total = sum(block_all[r] for r in reads)
        assert (part, total) == (sum(own[:c]), sum(own))


@pytest.mark.parametrize("hidden, vectors", [(7168, 7), (1792, 7), (3584, 7), (4096, 4),
                                             (2048, 4), (8192, 4), (5120, 4), (1000, 4)])
def test_the_combine_takes_the_widest_step_that_covers_a_row_whole(hidden, vectors):
    """H 7168 (896 vectors) is four steps of 7 vectors a lane (224) and seven of 4 (128): the
    wider; 5120 (640) is whole only at 4; 1000 at neither, so the first."""
    assert combine_vectors(hidden) == vectors
    assert vectors in COMBINE_VECTORS
