"""The whole layer (dispatch, then combine) with every rank emulated on one GPU
(`Buffer.emulated`: each rank's buffers local, a CUDA stream per rank so their kernels run side by
side), against `cute_ep.reference`: the ring transport's flow control, counts, row placement and
stream positions across many rounds, without NVLink."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.multigpu.test_ep import _expert_outputs, _global_scales, _inputs

pytestmark = pytest.mark.gpu

_STREAMS: dict[tuple, list] = {}


def _streams(bufs):
    """One CUDA stream per emulated rank, the same for every layer of these Buffers: the caching
    allocator then reuses each rank's output blocks instead of growing until it must free its
    cache, a device-wide synchronisation that would stall every rank's waiting kernel until the
    peer timeout."""
    key = (id(bufs[0]), len(bufs))
    if key not in _STREAMS:
        _STREAMS.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        _STREAMS[key] = [torch.cuda.Stream() for _ in bufs]
    return _STREAMS[key]


def _layer(bufs, seed, tokens, routing="uniform", weighted=True, skip_a2a=False,
           num_input_tokens=None, prequantized=False, at_home=False, empty_slots=0.0,
           direct=()):
    """One layer on every emulated rank against the reference; `prequantized` (fp8, nvfp4):
    each rank passes its tokens already quantized, (codes, scales), as the reference quantizes
    them (`"kernel"`: nvfp4 by `cute_ep.quantize_nvfp4`, linear scales);
    `at_home`: dispatch carries no weights and combine weighs at home with them (DeepEP's
    low-latency combine); `empty_slots`: that share of the (token, k) ids is -1 (nothing is
    reported for them); `direct`: the ranks whose x is their Buffer's direct input. Returns the
    reference's dispatch outputs."""
    from cute_ep.reference import ep as reference
    from cute_ep.reference.ep import dispatch_mismatch

    cfg = bufs[0].cfg
    xs, ids, ws = _inputs(cfg, seed, tokens, routing, same_everywhere=skip_a2a)
    if empty_slots:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        ids = [torch.where(torch.rand(i.shape, generator=gen, device="cuda") < empty_slots,
                           -1, i).to(i.dtype) for i in ids]
    gs = _global_scales(cfg, seed)
    streams = _streams(bufs)
    sources = xs
    if prequantized and cfg.format == "fp8":
        sources = [tuple(reference.quantize_fp8_blockwise(x)) for x in xs]
    elif prequantized == "kernel":
        from cute_ep.quant import quantize_nvfp4

        sources = [quantize_nvfp4(x, gs[r], scales="linear") for r, x in enumerate(xs)]
    elif prequantized:
        from cute_ep.reference.fp4 import quantize_nvfp4

        sources = [quantize_nvfp4(x, torch.full((x.shape[0],), gs[r], device="cuda"))
                   for r, x in enumerate(xs)]
    sources = list(sources)
    for r in direct:  # the layer before wrote x (or its codes and scales) there
        t = tokens[r]
        if cfg.format == "bf16":
            sources[r] = bufs[r].input_buffer()[:t]
            sources[r].copy_(xs[r])
        else:
            views = tuple(v[:t] for v in bufs[r].input_buffer())
            for view, part in zip(views, sources[r]):
                view.copy_(part)
            sources[r] = views
    torch.cuda.synchronize()  # the ranks' streams read what the default stream just wrote
    outs = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        quant = {} if gs is None or prequantized else {
            "global_scale": torch.tensor([gs[r]], dtype=torch.float32, device="cuda")}
        with torch.cuda.stream(stream):
            outs.append(buf.dispatch(sources[r], ids[r],
                                     ws[r] if weighted and not at_home else None,
                                     skip_a2a=skip_a2a, num_input_tokens=num_input_tokens,
                                     **quant))
    torch.cuda.synchronize()
    for buf in bufs:
        buf.check()
    refs = reference.dispatch(cfg, xs, ids, skip_a2a=skip_a2a, global_scales=gs)
    what = f"{cfg.format} R={cfg.ranks} T={tokens} {routing} seed={seed}"
    for r in range(cfg.ranks):
        problem = dispatch_mismatch(cfg, outs[r], refs[r])
        assert problem is None, f"{what}, rank {r}: {problem}"
    ys = [_expert_outputs(cfg, d, d.num_rows, gs) for d in refs]
    torch.cuda.synchronize()  # the ranks' streams read what the default stream just wrote
    combined = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        with torch.cuda.stream(stream):
            combined.append(buf.combine(ys[r].clone(), outs[r].handle,
                                        topk_weights=ws[r] if at_home else None))
    torch.cuda.synchronize()
    for buf in bufs:
        buf.check()
    want = reference.combine(cfg, ys, refs, tokens, ws if weighted else None)
    for r in range(cfg.ranks):
        if weighted:
            bound = reference.combine(cfg, [y.abs() for y in ys], refs, tokens,
                                      [w.abs() for w in ws])[r].float() * 2.0 ** -6
            err = (combined[r].float() - want[r].float()).abs()
            assert err.numel() == 0 or (err - bound).max().item() <= 0, \
                f"{what}, rank {r}: combine off by {err.max().item():g}"
        else:
            assert torch.equal(combined[r], want[r]), f"{what}, rank {r}: unreduced combine"
    return refs


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms,hidden", [(2, 8, 2048), (4, 24, 2048), (3, 5, 2048),
                                              (8, 16, 2048), (2, 24, 7168), (4, 16, 7168)])
def test_emulated_ranks_match_the_reference_round_after_round(fmt, ranks, sms, hidden):
    """Rings wrap many times per round (up to 1024 tokens a channel of 8-32 slots); 7168 moves
    a bf16 payload in two tiles per warp."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(hidden, 8, 16 * ranks, ranks, 1024, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    seed = 10 * ranks
    for tokens in ([1024] * ranks, [0] * ranks, [1] * ranks,
                   [(0, 1, 300, 1024)[r % 4] for r in range(ranks)]):
        seed += 1
        _layer(bufs, seed, tokens)
    for routing in ("hot", "sparse"):
        seed += 1
        _layer(bufs, seed, [700] * ranks, routing)
    _layer(bufs, seed + 1, [257] * ranks, weighted=False)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_emulated_shared_expert_and_skip_a2a(fmt):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 4, 32, 4, 512, fmt, fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=12)
    _layer(bufs, 1, [512, 3, 0, 200])
    _layer(bufs, 2, [500] * 4, skip_a2a=True)
    _layer(bufs, 3, [512] * 4, routing="hot")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_emulated_shared_expert_at_a_decode_bound_with_prefixed_counts(fmt):
    """The fused shared expert and skip_a2a with a bound of at most PREFIXED_TOKENS: each
    channel counts the shared segment's rows before its own and in all from every token of its
    rank, as it does the experts'."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 4, 32, 4, 512, fmt, fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=12)
    assert bufs[0]._prefixed_for(128) == 1 and bufs[0]._prefixed_for(None) == 0
    _layer(bufs, 11, [128, 3, 0, 77], num_input_tokens=128)
    _layer(bufs, 12, [100] * 4, skip_a2a=True, num_input_tokens=128)
    _layer(bufs, 13, [128] * 4, routing="hot", num_input_tokens=128)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms,hidden", [(2, 20, 1024), (4, 9, 1024), (2, 17, 1152)])
def test_emulated_block_prefixed_counts(fmt, ranks, sms, hidden, monkeypatch):
    """Block-prefixed counts (a prefill-sized dispatch over BLOCK_PREFIX_CHANNELS channels or
    more, the threshold lowered to these budgets): blocks of COUNT_BLOCK channels with a partial
    last one (20 = 8 + 8 + 4, 9 = 8 + 1, 17 = 8 + 8 + 1), with the fused shared expert, skip_a2a,
    hot routing, ranks of uneven token counts (channels with no tokens) and a bound past
    PREFIXED_TOKENS, across rounds; at H 1152 the FP8 and NVFP4 kernels' register receivers,
    which send their channels' own counts whatever the host asks."""
    import layouts.channels as channels
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    monkeypatch.setattr(channels, "BLOCK_PREFIX_CHANNELS", 2)
    cfg = EPConfig(hidden, 4, 8 * ranks, ranks, 512, fmt, fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    assert bufs[0]._prefixed_for(None) == channels.PREFIX_BLOCKS
    assert bufs[0]._prefixed_for(400) == channels.PREFIX_BLOCKS
    uneven = [(512, 3, 0, 200)[r % 4] for r in range(ranks)]
    _layer(bufs, 91, uneven)
    _layer(bufs, 92, [500] * ranks, skip_a2a=True)
    _layer(bufs, 93, [512] * ranks, routing="hot")
    _layer(bufs, 94, [400, 7, 300, 1][:ranks], num_input_tokens=400)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms", [(2, 24), (4, 12), (8, 6)])
def test_emulated_skip_a2a_without_weights_at_the_experts(fmt, ranks, sms):
    """skip_a2a (every rank holds every token and keeps its own experts) with a combine that
    brings each (token, k) row home: unreduced, and weighted at home. Each rank's rows come
    back from itself alone; no rank waits for another's (the soak's stall of 2026-11-26)."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 4, 8 * ranks, ranks, 256, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    seed = 700 + ranks
    for tokens in ([256] * ranks, [1] * ranks, [0] * ranks, [97] * ranks):
        seed += 1
        _layer(bufs, seed, tokens, skip_a2a=True, weighted=False)
        _layer(bufs, seed, tokens, skip_a2a=True, at_home=True)
        _layer(bufs, seed, tokens, skip_a2a=True, routing="hot", at_home=True)


def test_a_traced_dispatch_records_each_channels_timeline():
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from layouts.channels import RECV_TIMES, SEND_TIMES, TRACE_FIELDS

    cfg = EPConfig(2048, 8, 32, 2, 1024, "bf16")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=6)
    for buf in bufs:
        buf.trace_dispatch(True)
    _layer(bufs, 5, [1024, 700])
    field = {f: i for i, f in enumerate(TRACE_FIELDS)}
    for buf in bufs:
        t = buf.trace.cpu()
        assert t.shape == (6, len(TRACE_FIELDS))
        for a, b in [("start", "routed"), ("routed", "counts_sent"), ("counts_sent", "end"),
                     ("counts_arrived", "counts_summed"), ("counts_summed", "layout_ready"),
                     ("layout_ready", "recv_done"), ("recv_done", "rows_written"),
                     ("rows_written", "round_done"), ("round_done", "end"),
                     ("start", "send_done"), ("send_done", "end")]:
            assert (t[:, field[a]] <= t[:, field[b]]).all(), (a, b)
        # A channel's receivers saw their first batch after the layout and before they were
        # done (a channel that received nothing keeps 0).
        first = t[:, field["first_batch"]]
        assert ((first == 0) | ((t[:, field["layout_ready"]] <= first)
                                & (first <= t[:, field["recv_done"]]))).all()
        assert (first > 0).any()
        # The first chunk's header read, rows placed and row stores issued, in that order.
        read, placed, stored = (t[:, field[f]] for f in ("chunk_read", "chunk_placed",
                                                           "chunk_stored"))
        seen = first > 0
        assert ((first <= read) & (read <= placed) & (placed <= stored)
                & (stored <= t[:, field["recv_done"]]))[seen].all()
        assert (t[:, field["start"]] > 0).all()
        # Each sender time is one warp's total of a part of its run (the most any warp spent
        # there); every channel routed and copied tokens.
        sender = t[:, [field[f] for f in SEND_TIMES]]
        assert (sender >= 0).all()
        assert (sender[:, SEND_TIMES.index("batch_ns")] > 0).all()
        assert (sender[:, SEND_TIMES.index("copy_ns")] > 0).all()
        assert (sender <= (t[:, field["send_done"]] - t[:, field["start"]])[:, None]).all()
        # So is each receiver time, inside the receivers' run; every channel that received
        # read headers, placed messages, waited for its pieces to land (BF16: bulk copies) and
        # drained them.
        recv = t[:, [field[f] for f in RECV_TIMES]]
        assert (recv >= 0).all()
        assert (recv <= (t[:, field["rows_written"]] - t[:, field["layout_ready"]])[:, None]).all()
        for f in ("header_ns", "place_ns", "drain_ns", "land_ns"):
            assert (recv[:, RECV_TIMES.index(f)][seen] > 0).all(), f
        buf.trace_dispatch(False)
        assert buf.trace is None


def test_a_traced_combine_records_each_channels_timeline():
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from layouts.channels import COMBINE_TRACE_FIELDS

    cfg = EPConfig(2048, 8, 32, 2, 1024, "bf16")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=6)
    for buf in bufs:
        buf.trace_combine(True)
    _layer(bufs, 6, [1024, 700])
    field = {f: i for i, f in enumerate(COMBINE_TRACE_FIELDS)}
    for buf in bufs:
        t = buf.combine_trace.cpu()
        assert t.shape == (6, len(COMBINE_TRACE_FIELDS))
        assert (t[:, field["start"]] > 0).all()
        for a, b in [("start", "send_done"), ("start", "recv_done"), ("send_done", "end"),
                     ("recv_done", "end")]:
            assert (t[:, field[a]] <= t[:, field[b]]).all(), (a, b)
        span = t[:, field["end"]] - t[:, field["start"]]
        for f in ("credit_wait_ns", "tail_wait_ns", "route_ns"):
            assert ((t[:, field[f]] >= 0) & (t[:, field[f]] <= span)).all(), f
        assert (t[:, field["route_ns"]] > 0).any()
        buf.trace_combine(False)
        assert buf.combine_trace is None


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_decode_splits_tokens_over_fewer_channels(fmt):
    """num_input_tokens (the same on every rank) sizes the channels a dispatch and its combine
    use; layers of both sizes then alternate on the same rings."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from layouts.channels import TOKENS_PER_CHANNEL

    cfg = EPConfig(2048, 8, 64, 4, 512, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=24)
    assert bufs[0].active_channels(20) == -(-20 // TOKENS_PER_CHANNEL) < 24
    assert bufs[0].active_channels(None) == 24
    for i, (tokens, bound) in enumerate([([20, 7, 0, 13], 20), ([512, 300, 1, 0], None),
                                         ([16, 16, 16, 16], 16), ([1, 0, 0, 1], 1)]):
        _layer(bufs, 60 + i, tokens, num_input_tokens=bound)
    _layer(bufs, 70, [20, 20, 20, 20], weighted=False, num_input_tokens=20)


@pytest.mark.parametrize("bounds", [(8, 256), (256, 300)])
def test_ranks_that_disagree_on_num_input_tokens_get_an_error_not_a_hang(bounds):
    """Bounds that split the tokens over different numbers of channels (8 and 256 tokens at 16
    SMs: at most 8, and 16), or over the same 16 with counts of different kinds (256: prefixed,
    300: summed, `layouts.channels.PREFIXED_TOKENS`)."""
    import time

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 4, 16, 2, 512, "bf16")
    bufs = Buffer.emulated(cfg, timeout_s=30.0, sms=16)
    kinds = {bufs[0]._prefixed_for(b) for b in bounds}
    channels = {bufs[0].active_channels(b) for b in bounds}
    assert (len(channels), len(kinds)) == ((2, 1) if bounds == (8, 256) else (1, 2))
    x = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 16, (8, 1), device="cuda").repeat(1, 4)
    ids = (ids + torch.arange(4, device="cuda")) % 16
    w = torch.rand(8, 4, device="cuda")
    streams = [torch.cuda.Stream() for _ in bufs]
    start = time.monotonic()
    for buf, stream, bound in zip(bufs, streams, bounds):
        with torch.cuda.stream(stream):
            buf.dispatch(x, ids.int(), w, num_input_tokens=bound)
    torch.cuda.synchronize()
    assert time.monotonic() - start < 20, "the mismatch was waited out, not detected"
    for buf in bufs:
        with pytest.raises(ValueError, match="different num_input_tokens"):
            buf.check()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms,hidden,shared", [(2, 8, 2048, False), (4, 16, 7168, False),
                                                     (3, 5, 1152, True)])
def test_emulated_prequantized_input(fmt, ranks, sms, hidden, shared):
    """Tokens passed as (codes, scales) (DeepEP's FP8 input; NVFP4 codes and linear e4m3
    scales): the same rows and scales as quantizing the bf16 tokens in the layer (H = 1152:
    FP8 scale rows of 36 bytes, NVFP4 ones of 72, not 16-byte multiples)."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(hidden, 8, 16 * ranks, ranks, 1024, fmt, fused_shared_expert=shared)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    seed = 70 + ranks
    for tokens in ([1024] * ranks, [0] * ranks, [(0, 1, 300, 1024)[r % 4] for r in range(ranks)]):
        seed += 1
        _layer(bufs, seed, tokens, prequantized=True)
    if fmt == "nvfp4":  # quantized by the library's own kernel, as a caller would
        _layer(bufs, seed + 2, [700] * ranks, "hot", prequantized="kernel")
    _layer(bufs, seed + 1, [500] * ranks)  # bf16 tokens again on the same Buffers


def test_prequantized_fp8_input_is_checked():
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 4, 8, 1, 64, "fp8")
    (buf,) = Buffer.emulated(cfg, timeout_s=5.0, sms=2)
    ids = torch.zeros(4, 4, dtype=torch.int32, device="cuda")
    codes = torch.zeros(4, 1024, device="cuda").to(torch.float8_e4m3fn)
    scales = torch.ones(4, 8, device="cuda")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        buf.dispatch((codes.float(), scales), ids)
    with pytest.raises(ValueError, match=r"scales must be float32 \[T, H / 128\] = \[4, 8\]"):
        buf.dispatch((codes, scales[:, :4].contiguous()), ids)
    with pytest.raises(ValueError, match="codes must be"):
        buf.dispatch((codes[:, :512].contiguous(), scales), ids)
    with pytest.raises(ValueError, match="topk_ids"):
        buf.dispatch((codes, scales), ids[:3])
    bf16 = Buffer.emulated(EPConfig(1024, 4, 8, 1, 64, "bf16"), timeout_s=5.0, sms=2)[0]
    with pytest.raises(TypeError, match="only for an fp8 or nvfp4 Buffer"):
        bf16.dispatch((codes, scales), ids)


def test_prequantized_nvfp4_input_is_checked():
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    (buf,) = Buffer.emulated(EPConfig(1024, 4, 8, 1, 64, "nvfp4"), timeout_s=5.0, sms=2)
    ids = torch.zeros(4, 4, dtype=torch.int32, device="cuda")
    codes = torch.zeros(4, 512, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(4, 64, dtype=torch.uint8, device="cuda")
    gs = torch.ones(1, device="cuda")
    with pytest.raises(TypeError, match="uint8"):
        buf.dispatch((codes.view(torch.int8), scales), ids)
    with pytest.raises(ValueError, match=r"scales must be uint8 \[T, H / 16\].* = \[4, 64\]"):
        buf.dispatch((codes, scales[:, :32].contiguous()), ids)
    with pytest.raises(ValueError, match=r"codes must be uint8 \[T, H / 2\]"):
        buf.dispatch((codes[:, :256].contiguous(), scales), ids)
    with pytest.raises(ValueError, match="already scaled: pass global_scale=None"):
        buf.dispatch((codes, scales), ids, global_scale=gs)
    with pytest.raises(ValueError, match="needs global_scale"):
        buf.dispatch(torch.zeros(4, 1024, dtype=torch.bfloat16, device="cuda"), ids)
    (odd,) = Buffer.emulated(EPConfig(1040, 4, 8, 1, 64, "nvfp4"), timeout_s=5.0, sms=2)
    with pytest.raises(ValueError, match="multiple of 64"):
        odd.dispatch((torch.zeros(4, 520, dtype=torch.uint8, device="cuda"),
                      torch.zeros(4, 65, dtype=torch.uint8, device="cuda")), ids)
    buf.check()  # nothing reached the device


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms,hidden,stage_batches", [(2, 8, 2048, 8), (4, 24, 2048, 8),
                                                            (3, 5, 7168, 8), (2, 24, 7168, 8),
                                                            (4, 6, 1024, 1)])
def test_a_direct_input_is_pulled_in_place(fmt, ranks, sms, hidden, stage_batches):
    """Tokens in the Buffer's direct input (bf16 x, or pre-quantized codes and scales) stage no
    payload: the receivers pull them from each source's input part, round after round, beside
    ranks that pass x from elsewhere (each batch says which), with tiny staging too (a credit a
    batch)."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(hidden, 8, 16 * ranks, ranks, 512, fmt)
    quantized = fmt != "bf16"
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms, stage_batches=stage_batches,
                           input_rows=512)
    seed = 900 + ranks
    everyone = tuple(range(ranks))
    for tokens, direct in (([512] * ranks, everyone), ([0] * ranks, everyone),
                           ([(1, 300, 17, 512)[r % 4] for r in range(ranks)], everyone),
                           ([400] * ranks, everyone[::2]), ([512] * ranks, everyone)):
        seed += 1
        _layer(bufs, seed, tokens, direct=direct, prequantized=quantized)
    _layer(bufs, seed + 1, [300] * ranks, "hot", direct=everyone, prequantized=quantized)
    _layer(bufs, seed + 2, [257] * ranks, weighted=False, direct=everyone[1:],
           prequantized=quantized)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_contiguous_rows_over_the_direct_input_are_staged_not_pulled(fmt):
    """A (codes, scales) pair of contiguous tensors that only starts where the Buffer's direct
    input does (over its memory, but not laid out as its messages) is an ordinary input: the
    dispatch moves the bytes those tensors hold, exactly as it moves copies of them."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    hidden, experts, t = 1024, 32, 48
    cfg = EPConfig(hidden, 8, experts, 2, 64, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=4, input_rows=64)
    gen = torch.Generator(device="cuda").manual_seed(7)
    ids = [torch.stack([torch.randperm(experts, generator=gen, device="cuda")[:8]
                        for _ in range(t)]).int() for _ in bufs]
    ws = [torch.rand(t, 8, generator=gen, device="cuda") for _ in bufs]
    aliased = []
    for buf in bufs:
        views = buf.input_buffer()
        assert views[0].stride(0) != views[0].shape[1]  # message-strided: the cases differ
        pair = tuple(torch.as_strided(v, (t, v.shape[1]), (v.shape[1], 1)) for v in views)
        for part in pair:  # the scales' bytes overwrite some of the codes': both as they land
            raw = part.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, device="cuda",
                                    dtype=torch.uint8))
        aliased.append(pair)
    copies = [tuple(part.clone() for part in pair) for pair in aliased]
    assert bufs[0]._is_direct_input(tuple(v[:t] for v in bufs[0].input_buffer()))
    assert not bufs[0]._is_direct_input(aliased[0])
    streams = _streams(bufs)
    outs = {}
    for name, inputs in (("aliased", aliased), ("copies", copies)):
        torch.cuda.synchronize()
        outs[name] = []
        for r, (buf, stream) in enumerate(zip(bufs, streams)):
            with torch.cuda.stream(stream):
                outs[name].append(buf.dispatch(inputs[r], ids[r], ws[r]))
        torch.cuda.synchronize()
        for buf in bufs:
            buf.check()
    for r in range(len(bufs)):
        a, b = outs["aliased"][r], outs["copies"][r]
        assert torch.equal(a.row_offsets, b.row_offsets) and torch.equal(a.counts, b.counts)
        rows = int(a.row_offsets[-1])
        assert rows > 0
        assert torch.equal(a.tokens[:rows].view(torch.uint8), b.tokens[:rows].view(torch.uint8))
        assert torch.equal(a.src_info[:rows], b.src_info[:rows])
        if fmt == "fp8":  # [H / 128, row_capacity]
            assert torch.equal(a.scales[:, :rows].view(torch.int32),
                               b.scales[:, :rows].view(torch.int32))
        else:  # the 128-row blocks each segment uses, 128 x (H / 16) bytes apiece
            assert torch.equal(a.scales_offsets, b.scales_offsets)
            block = 128 * (hidden // 16)
            for g in range(a.counts.numel()):
                first = int(a.row_offsets[g]) // 128 + int(a.scales_offsets[g])
                used = -(-int(a.counts[g]) // 128)
                span = slice(first * block, (first + used) * block)
                assert torch.equal(a.scales.view(-1)[span], b.scales.view(-1)[span]), (r, g)


def test_a_direct_input_is_asked_for():
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    bufs = Buffer.emulated(EPConfig(1024, 8, 16, 2, 64, "bf16"), sms=4)
    with pytest.raises(RuntimeError, match="direct_input=True"):
        bufs[0].input_buffer()
    with pytest.raises(ValueError, match="packed or slabs layout"):
        Buffer.emulated(EPConfig(1024, 8, 16, 2, 64, "bf16", layout="sources"), sms=4,
                        input_rows=64)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms", [(2, 4), (4, 6)])
def test_tiny_staging_and_rings_wrap_on_every_batch(fmt, ranks, sms):
    """One staging batch a channel (16 message slots and one header) and combine rings of two
    chunks: a sender restages after every batch only once each destination is done with the last
    one, and each destination credits a batch before it waits for the next, so neither waits on
    the other."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 8, 8 * ranks, ranks, 512, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms, stage_batches=1, chunk_tokens=8,
                           ring_chunks=2)
    seed = 100 * ranks
    for tokens in ([512] * ranks, [(1, 17, 300, 512)[r % 4] for r in range(ranks)]):
        seed += 1
        _layer(bufs, seed, tokens)
    _layer(bufs, seed + 1, [400] * ranks, "hot")


@pytest.mark.parametrize("ring_chunks", [1, 2, 3])
@pytest.mark.parametrize("ranks,sms", [(2, 6), (4, 4)])
def test_home_chunks_take_what_half_a_ring_holds(ranks, sms, ring_chunks):
    """Combines that bring each (token, k) row home (weighted at home, unreduced) take as many
    tokens a chunk as bring at most half a ring from every rank: rings of 8, 16 and 24 slots
    with K = 8 (one token a chunk where K rows fill more than half the ring; else cut where a
    rank's rows, added, pass half of it), uniform and one-rank ("hot") routing, empty slots,
    round after round: every output as the reference's."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 8, 8 * ranks, ranks, 128, "bf16", layout="slabs")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms, chunk_tokens=8, ring_chunks=ring_chunks)
    seed = 900 + 10 * ranks + ring_chunks
    for tokens, routing, slots in (([128] * ranks, "uniform", 0.0), ([128] * ranks, "hot", 0.0),
                                   ([(5, 128, 0, 77)[r % 4] for r in range(ranks)], "uniform",
                                    0.3)):
        seed += 1
        _layer(bufs, seed, tokens, routing, at_home=True, empty_slots=slots,
               num_input_tokens=128)
        _layer(bufs, seed, tokens, routing, weighted=False, empty_slots=slots,
               num_input_tokens=128)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_a_destination_done_early_credits_the_rest_unread(fmt):
    """Rank 0 hosts experts of only a few early tokens of each channel (t % 64 < 4): once its
    last message from a source has landed it credits the source's remaining batches unread, and
    with one staging batch a channel the sources restage every batch on that credit, round after
    round, while the other ranks read every batch."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 8, 8 * 4, 4, 512, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=6, stage_batches=1)
    for seed, tokens in enumerate(([512] * 4, [100, 7, 512, 64], [0, 512, 3, 512], [512] * 4)):
        _layer(bufs, 700 + seed, tokens, "front")


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("ranks,sms", [(4, 12), (2, 8), (8, 6)])
def test_emulated_slabs_and_weights_at_home(fmt, ranks, sms):
    """DeepEP's low-latency shape: expert g's rows from row g * R * max_tokens on (the slabs
    layout), combine weighing each (token, k) row at home with the weights it is given, ids
    with empty (-1) slots; decode-sized and full batches, round after round."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(2048, 8, 8 * ranks, ranks, 128, fmt, layout="slabs")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    seed = 300 + ranks
    for tokens, slots in (([128] * ranks, 0.0), ([3] * ranks, 0.25), ([0] * ranks, 0.0),
                          ([(128, 7, 0, 64)[r % 4] for r in range(ranks)], 0.5)):
        seed += 1
        _layer(bufs, seed, tokens, at_home=True, empty_slots=slots, num_input_tokens=128)
    _layer(bufs, seed + 1, [100] * ranks, routing="hot", empty_slots=0.1)  # weighted at experts
    _layer(bufs, seed + 2, [50] * ranks, weighted=False, empty_slots=0.1)  # unreduced


def test_empty_slots_in_the_packed_layout_are_dropped_without_a_report():
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(2048, 8, 32, 4, 256, "bf16")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=8)
    _layer(bufs, 7, [256] * 4, empty_slots=0.3)
    _layer(bufs, 8, [256] * 4, at_home=True, empty_slots=0.3)


def test_low_latency_handle_names_each_rows_source_and_range():
    """cute_ep.deepep's low-latency handle on 4 emulated ranks: [0] the source token of every
    slab row, [1] each (expert, source)'s `begin << 32 | count`, both from the ids alone."""
    from cute_ep.deepep import _LowLatencyHandle
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    ranks, m, e = 4, 64, 16
    cfg = EPConfig(1024, 4, e, ranks, m, "bf16", layout="slabs")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=4)
    xs, ids, _ = _inputs(cfg, 11, [64, 0, 17, 40])
    ids = [torch.where(torch.arange(i.numel(), device="cuda").view(i.shape) % 5 == 0, -1, i)
           for i in ids]
    streams = _streams(bufs)
    torch.cuda.synchronize()
    outs = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        with torch.cuda.stream(stream):
            outs.append(buf.dispatch(xs[r], ids[r], None, num_input_tokens=m))
    torch.cuda.synchronize()
    e_loc = e // ranks
    for d, (buf, out) in enumerate(zip(bufs, outs)):
        handle = _LowLatencyHandle(buf, out.handle, out.src_info, m, 1024, e)
        for g in range(e_loc):
            expert = d * e_loc + g
            begin, rows = 0, []
            for s in range(ranks):
                toks = (ids[s] == expert).any(dim=1).nonzero().flatten()
                assert int(handle[1][g, s]) == (begin << 32) | len(toks), (d, g, s)
                begin += len(toks)
                rows.append(toks)
            want = torch.cat(rows).int()
            assert torch.equal(handle[0][g, :len(want)], want), (d, g)


def test_emulated_ranks_that_cannot_all_be_resident_are_refused():
    """Every emulated rank's CTAs must run at once (each waits for the others): asking for more
    SMs than the GPU has is an error at construction, not a layer that waits until the
    timeout."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = EPConfig(1024, 4, 8, 2, 64)
    with pytest.raises(ValueError, match=f"need {2 * (sms // 2 + 1)} SMs at once"):
        Buffer.emulated(cfg, sms=sms // 2 + 1)
    assert len(Buffer.emulated(cfg, sms=sms // 2)) == 2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_a_dispatch_past_its_receive_capacity_says_so_and_its_combine_still_runs(fmt):
    """A receive capacity far below what a layer needs: every rank's check() names the
    overflow; the rows below the capacity are the reference's (BF16); combine runs to the end
    on every rank (no peer waits for rows that were dropped) and adds zeros for the rows past
    the capacity; the next layer that fits is exact. (Under `tests/sanitize.sh` memcheck also
    sees that no row past the capacity is written.)"""
    from cute_ep.ep import Buffer
    from cute_ep.reference import ep as reference
    from layouts import EPConfig

    cap = 300
    cfg = EPConfig(2048, 8, 32, 2, 256, fmt, recv_capacity=cap)
    full = dataclasses.replace(cfg, recv_capacity=None)  # the reference's room for every row
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=8)
    _layer(bufs, 1, [16, 16])  # fits: exact, as without a capacity
    tokens = [256, 256]
    xs, ids, ws = _inputs(cfg, 2, tokens, "uniform")
    gs = _global_scales(cfg, 2)
    streams = _streams(bufs)
    torch.cuda.synchronize()
    outs = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        quant = {} if gs is None else {
            "global_scale": torch.tensor([gs[r]], dtype=torch.float32, device="cuda")}
        with torch.cuda.stream(stream):
            outs.append(buf.dispatch(xs[r], ids[r], ws[r], **quant))
    torch.cuda.synchronize()
    refs = reference.dispatch(full, xs, ids, global_scales=gs)
    for r, buf in enumerate(bufs):
        assert refs[r].num_rows > cap
        with pytest.raises(ValueError, match=f"recv_capacity={cap}"):
            buf.check()
        assert outs[r].row_offsets[-1].item() >= refs[r].num_rows  # the rows it needed
        if fmt == "bf16":
            assert torch.equal(outs[r].tokens[:cap], refs[r].tokens[:cap]), f"rank {r}"
            assert torch.equal(outs[r].src_info[:cap], refs[r].src_info[:cap]), f"rank {r}"
    # The experts' outputs of the rows past the capacity are zeros as far as combine goes.
    ys = [_expert_outputs(full, d, d.num_rows, gs) for d in refs]
    for y in ys:
        y[cfg.row_capacity:] = 0
    torch.cuda.synchronize()
    combined = []
    for r, (buf, stream) in enumerate(zip(bufs, streams)):
        with torch.cuda.stream(stream):
            combined.append(buf.combine(ys[r][:cfg.row_capacity].clone(), outs[r].handle))
    torch.cuda.synchronize()
    for buf in bufs:
        buf.check()  # nothing new: the combine completed
    if fmt == "bf16":  # quantized rows past the capacity were never written: nothing to compare
        want = reference.combine(full, ys, refs, tokens, ws)
        for r in range(cfg.ranks):
            bound = reference.combine(full, [y.abs() for y in ys], refs, tokens,
                                      [w.abs() for w in ws])[r].float() * 2.0 ** -6
            err = (combined[r].float() - want[r].float()).abs()
            assert (err - bound).max().item() <= 0, f"rank {r}: combine off by {err.max():g}"
    _layer(bufs, 3, [16, 16])  # the Buffer is still usable


@pytest.mark.parametrize("layout", ["packed", "slabs"])
def test_fp8_rounded_scales_match_the_reference(layout):
    """`fp8_scales="pow2"` (DeepEP's round_scale): the encoder's power-of-two scales and codes
    are the reference's, byte for byte, in both layouts; combine as usual."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(2048, 8, 32, 2, 256, "fp8", layout=layout, fp8_scales="pow2")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=8)
    for seed, tokens in ((11, [200, 100]), (12, [0, 37]), (13, [256, 256])):
        _layer(bufs, seed, tokens)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_a_dispatch_sent_now_and_received_by_its_hook_matches_the_reference(fmt):
    """`dispatch_send` on every rank (each send launch completes with no receiver running),
    then every rank's hook (the receive launches): the outputs are the reference's; combine and
    the next layers run as usual."""
    from cute_ep.ep import Buffer
    from cute_ep.reference import ep as reference
    from cute_ep.reference.ep import dispatch_mismatch
    from layouts import EPConfig

    cfg = EPConfig(2048, 8, 32, 2, 128, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=8)
    streams = _streams(bufs)
    for seed, tokens in ((21, [128, 40]), (22, [0, 7])):
        xs, ids, ws = _inputs(cfg, seed, tokens, "uniform")
        torch.cuda.synchronize()
        sent = []
        for buf, stream, x, i, w in zip(bufs, streams, xs, ids, ws):
            with torch.cuda.stream(stream):
                sent.append(buf.dispatch_send(x, i, w))
        torch.cuda.synchronize()  # every send finished before any receive started
        for (_, hook), stream in zip(sent, streams):
            with torch.cuda.stream(stream):
                hook()
        torch.cuda.synchronize()
        for buf in bufs:
            buf.check()
        refs = reference.dispatch(cfg, xs, ids)
        for r, (out, _) in enumerate(sent):
            problem = dispatch_mismatch(cfg, out, refs[r])
            assert problem is None, f"seed {seed}, rank {r}: {problem}"
        _layer(bufs, seed + 10, tokens)  # a whole layer after it, with its combine


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_the_sources_layout_gives_deepeps_rows_ids_and_weights(fmt):
    """`EPConfig(layout="sources")`, against plain torch: one row per received token, sources
    in order and each in its token order, its K ids made local (-1 elsewhere) and weights (0
    there), src_info (token, first local k); combine adds each row once (weight 1)."""
    from cute_ep.ep import Buffer
    from cute_ep.reference.ep import quantize_fp8_blockwise
    from layouts import EPConfig

    cfg = EPConfig(2048, 8, 32, 2, 256, fmt, layout="sources")
    loc = cfg.local_experts
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=8)
    streams = _streams(bufs)
    for seed, tokens in ((31, [256, 100]), (32, [0, 9]), (33, [77, 256])):
        xs, ids, ws = _inputs(cfg, seed, tokens, "uniform" if seed != 32 else "hot")
        torch.cuda.synchronize()
        outs = []
        for buf, stream, x, i, w in zip(bufs, streams, xs, ids, ws):
            with torch.cuda.stream(stream):
                outs.append(buf.dispatch(x, i, w))
        torch.cuda.synchronize()
        for buf in bufs:
            buf.check()
        for d, out in enumerate(outs):
            here = [(i.long() // loc) == d for i in ids]  # [T_s, K] per source
            sel = [h.any(1).nonzero().flatten() for h in here]
            want_x = torch.cat([x[s_] for x, s_ in zip(xs, sel)])
            want_ids = torch.cat([torch.where(h[s_], i.long()[s_] - d * loc, -1)
                                  for h, i, s_ in zip(here, ids, sel)]).int()
            want_w = torch.cat([torch.where(h[s_], w[s_], 0.0) for h, w, s_ in zip(here, ws, sel)])
            want_k0 = torch.cat([h[s_].int().argmax(1) for h, s_ in zip(here, sel)]).int()
            n = want_x.shape[0]
            what = f"{fmt} seed {seed} rank {d}"
            assert int(out.counts.sum()) == int(torch.cat(here).sum()), what
            if fmt == "bf16":
                assert torch.equal(out.tokens[:n], want_x), what
            else:
                q, sc = quantize_fp8_blockwise(want_x)
                assert torch.equal(out.tokens[:n].view(torch.uint8), q.view(torch.uint8)), what
                assert torch.equal(out.scales[:, :n].t(), sc), what
            assert torch.equal(out.recv_topk_ids[:n], want_ids), what
            assert torch.equal(out.recv_topk_weights[:n], want_w), what
            assert torch.equal(out.src_info[:n, 0], torch.cat(sel).int()), what
            assert torch.equal(out.src_info[:n, 1], want_k0), what
        if fmt == "bf16":
            ys = []
            for out in outs:
                y = torch.zeros(cfg.row_capacity, cfg.hidden, dtype=torch.bfloat16,
                                device="cuda")
                y[:] = out.tokens * 2
                ys.append(y)
            torch.cuda.synchronize()
            combined = []
            for buf, stream, out, y in zip(bufs, streams, outs, ys):
                with torch.cuda.stream(stream):
                    combined.append(buf.combine(y, out.handle))
            torch.cuda.synchronize()
            for s_, (x, i) in enumerate(zip(xs, ids)):
                dests = torch.stack([((i.long() // loc) == d).any(1)
                                     for d in range(cfg.ranks)]).sum(0)
                want = (x.float() * 2 * dests[:, None]).to(torch.bfloat16)
                assert torch.equal(combined[s_], want), f"seed {seed}, rank {s_}: combine"


@pytest.mark.parametrize("prequantized", [False, True])
def test_fp8_scales_straight_to_the_output_or_by_the_write_out_alternate_exactly(prequantized):
    """FP8 packed rows: at most DIRECT_SCALE_ROWS rows in all take their scales straight into the
    output's transposed layout (and the dispatch skips its write-out), more take the write-out
    of `scale_rows`; layers of each kind alternate on the same Buffers, every scale word (the
    alignment rows' zeros included) as the reference's."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig
    from layouts.buffers import DIRECT_SCALE_ROWS

    cfg = EPConfig(2048, 8, 16, 2, 1024, "fp8")
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=6)
    # About 8 rows a token here (top-8 of 16 experts, 8 of them local, over 2 ranks).
    small, large = DIRECT_SCALE_ROWS // 32, DIRECT_SCALE_ROWS // 4
    for seed, tokens in enumerate(([small, small], [large, large], [small, 0], [large, small],
                                   [3, 5])):
        _layer(bufs, 900 + seed, tokens, prequantized=prequantized)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("hidden,prequantized", [(7168, False), (7168, True), (10240, False)])
def test_prefill_sized_scales_go_out_through_the_receivers_pieces_exactly(fmt, hidden,
                                                                          prequantized):
    """From the write-out's row threshold on every rank (`wide_min_rows`), the scales go out
    through tiles in the receivers' pieces (FP8's wide ones, NVFP4's narrow ones; H 10240:
    NVFP4's 160 words a row in ten tiles, FP8's 80 in two and a half): every scale word as the
    reference's, on rounds that alternate with a small one on the same Buffers."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    min_rows = _wide_min_rows(fmt)
    cfg = EPConfig(hidden, 8, 32, 2, 1024, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=24)
    for seed, tokens in enumerate(([1024, 1024], [5, 9], [1024, 800])):
        refs = _layer(bufs, 950 + seed, tokens, prequantized=prequantized)
        if tokens[0] > 100:
            assert min(d.num_rows for d in refs) >= min_rows, [d.num_rows for d in refs]
            if fmt == "nvfp4":
                assert _assert_message_scales(cfg, bufs, refs, min_rows) == cfg.ranks


@pytest.mark.parametrize("ranks", [1, 2])
def test_nvfp4_message_scales_with_a_shared_expert_skip_a2a_and_a_direct_input(ranks):
    """NVFP4 scales staged a message at a time (prefill-sized rows on at most two ranks) under
    what changes a row's message: the fused shared expert's rows, skip_a2a (every rank the same
    tokens), hot routing, one rank's tokens in its direct input, pre-quantized or not, and a
    round of too few rows between (a row at a time): every scale byte the reference's."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 8, 32, ranks, 2048, "nvfp4", fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=16, input_rows=2048)
    big = [2048] * ranks
    for seed, kw in enumerate(({}, {"skip_a2a": True}, {"routing": "hot"},
                               {"direct": (0,), "prequantized": True}, {"prequantized": True})):
        refs = _layer(bufs, 1300 + seed, big, **kw)
        # (Hot routing leaves rank 0 of two only its shared expert's rows: a row at a time.)
        assert _assert_message_scales(cfg, bufs, refs, _wide_min_rows("nvfp4")) >= 1
        _layer(bufs, 1350 + seed, [7] * ranks, **kw)


def test_nvfp4_message_scales_under_block_prefixed_and_prefixed_counts():
    """Message scales where the counts come block-prefixed (a prefill over every one of 60
    channels a rank) and prefixed (a bound of PREFIXED_TOKENS tokens whose rows, at top-16 of
    32 experts, still pass the write-out's threshold: every row slot of a message taken)."""
    import layouts.channels as channels
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    min_rows = _wide_min_rows("nvfp4")
    cfg = EPConfig(1024, 8, 32, 2, 2048, "nvfp4", fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=60)
    assert bufs[0]._prefixed_for(None) == channels.PREFIX_BLOCKS
    for seed, tokens in enumerate(([2048, 2048], [2048, 1500], [900, 2048])):
        refs = _layer(bufs, 1400 + seed, tokens)
        assert _assert_message_scales(cfg, bufs, refs, min_rows) == 2
    bound = channels.PREFIXED_TOKENS
    cfg = EPConfig(1024, 16, 32, 2, 2048, "nvfp4", fused_shared_expert=True)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=16)
    assert bufs[0]._prefixed_for(bound) == channels.PREFIX_ALL
    for seed in range(2):
        refs = _layer(bufs, 1450 + seed, [bound] * 2, num_input_tokens=bound)
        assert min(d.num_rows for d in refs) >= min_rows, [d.num_rows for d in refs]
        assert _assert_message_scales(cfg, bufs, refs, min_rows) == 2


def _wide_min_rows(fmt):
    """The dispatch's row threshold of the wide and narrow write-outs, as the write-out kernel
    built from the same code states it."""
    from cute_ep.runtime.launch import runtime

    return runtime().select("scale_write_out", "cuda", format=fmt).spec.sizes["wide_min_rows"]


def _assert_message_scales(cfg, bufs, refs, min_rows):
    """NVFP4 at prefill size on at most two ranks stages each message's scales once, at row
    source * max_tokens + source token of the Buffer's `scale_rows`: on every rank with at
    least `min_rows` rows, those rows, taken in the output's row order (each row's source and
    token as the reference routed it) and written out by the reference, are the reference's
    scale output byte for byte (rows staged a row at a time would sit at the rows' own indices
    instead). Returns the ranks checked."""
    from cute_ep.reference.ep import scale_layout_of_rows

    checked = 0
    for buf, want in zip(bufs, refs):
        n = want.num_rows
        if n < min_rows:
            continue
        checked += 1
        words = buf.scale_rows.numel() // cfg.row_capacity
        staged = buf.scale_rows.view(cfg.row_capacity, words)
        tokens = want.src_info[:n, 0].long()
        at = want.source_rank[:n].long() * cfg.max_tokens_per_rank + tokens
        rows = staged[at]
        got = scale_layout_of_rows("nvfp4", rows, cfg.hidden, want.counts.tolist(),
                                   cfg.row_capacity)
        used = got.numel()
        assert torch.equal(got.view(torch.uint8).flatten(),
                           want.scales.view(torch.uint8).flatten()[:used]), \
            "NVFP4 scales were not staged a message at a time"
    return checked


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("hidden", [1152, 2048, 10240])
def test_bf16_tokens_quantized_in_the_dispatch_or_by_ep_encode_give_the_reference(fmt, hidden,
                                                                                 monkeypatch):
    """bf16 tokens of an FP8 or NVFP4 layer are quantized inside the dispatch kernel for a few a
    channel and by `ep_encode` for more (`FUSED_ENCODE_TOKENS`): forced each way, every size
    (empty ranks, a few tokens, more than a batch a channel) gives the reference's bytes.
    H = 10240 takes a thread's loads of a token in two rounds (`kernels.encode`'s FP8_AHEAD
    tiles, NVFP4_AHEAD blocks); H = 1152 (144 FP8 vectors a token) has a warp of the dispatch's
    FP8 encode end one token's vectors and begin the next's, or end the channel's tokens, halfway
    (`encode_fp8_rows`)."""
    import cute_ep.ep as ep
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(hidden, 8, 32, 2, 256, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=4)
    for limit in (0, 1 << 20):  # ep_encode for any number of tokens; the dispatch for any
        monkeypatch.setattr(ep, "FUSED_ENCODE_TOKENS", limit)
        for seed, tokens in ((1, [256, 100]), (2, [5, 0]), (3, [64, 65])):
            _layer(bufs, seed + limit % 7, tokens)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("ranks,sms,spare", [(2, 8, 8), (4, 6, 20), (2, 24, 12), (2, 56, 8)])
def test_spare_ctas_run_every_channel_once_and_match_the_reference(fmt, ranks, sms, spare):
    """A dispatch and a combine launched with spare CTAs (`kernels/placement.py`: one channel
    per TPC, the rest leave; a CTA takes a channel anyway when too few are left to fill them):
    exact rows and combine round after round, and both launches' words cleared after each. At
    2 x (56 + 8) CTAs the ranks' CTAs fill the GPU, so some channels share TPCs."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(2048, 8, 16 * ranks, ranks, 1024, fmt)
    bufs = Buffer.emulated(cfg, timeout_s=20.0, sms=sms)
    for buf in bufs:
        buf.spare_ctas = spare
    seed = 700 + ranks
    for tokens in ([1024] * ranks, [300] * ranks, [(1024, 0)[r % 2] for r in range(ranks)]):
        seed += 1
        _layer(bufs, seed, tokens)
        for r, buf in enumerate(bufs):
            for words in (buf.dispatch_done.tolist(), buf.combine_place.tolist()):
                assert words == [0] * len(words), f"rank {r}: launch words left {words}"
