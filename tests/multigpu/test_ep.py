"""Dispatch and combine between GPUs of one host, against `cute_ep.reference`.

Every rank generates every rank's inputs from the same seeds, runs the kernels on its own share,
and checks its outputs against the reference computed for all ranks: dispatch exactly (rows,
offsets, ids, src_info, counts, FP8 bytes and scales, NVFP4 codes, the used 128x4 scale blocks
with their zero padding, and scales_offsets), combine within bf16 rounding (each rank's partial
sum is rounded to bf16 once before the home rank adds them in fp32).

NVFP4 runs on 2 GPUs and on all visible ones. Its layers give every rank a different global
scale, so that a rank quantizing under another rank's scale cannot pass (a real model passes
the same scale everywhere, see `cute_ep.ep`).
"""

from __future__ import annotations

import pytest
import torch

from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.multigpu

# (hidden, topk, experts): DeepSeek-V3, Qwen3-style, gpt-oss-style, Mixtral-style.
SHAPES = [(7168, 8, 256), (4096, 8, 128), (2880, 4, 128), (4096, 2, 8)]
MAX_TOKENS = 4096
ALL_GPUS = max(2, torch.cuda.device_count())
NVFP4_WORLDS = sorted({2, ALL_GPUS})
# (format, world): every format on all visible GPUs, NVFP4 on 2 of them too.
FORMAT_WORLDS = [pytest.param(f, w, id=f"{f}-world{w}")
                 for f, w in [("bf16", ALL_GPUS), ("fp8", ALL_GPUS),
                              *(("nvfp4", w) for w in NVFP4_WORLDS)]]


def _global_scales(cfg, seed):
    """NVFP4: a different global scale per rank (None for the other formats), identical on every
    process; scales up to ~430 keep randn blocks (amax < 6) mostly below e4m3 saturation."""
    if cfg.format != "nvfp4":
        return None
    return [40.0 * (1 + 0.37 * r) * (1 + seed % 3) for r in range(cfg.ranks)]


def _inputs(cfg, seed, tokens, routing="uniform", same_everywhere=False):
    """Every rank's (x, topk_ids, topk_weights), identical on every process."""
    xs, ids, ws = [], [], []
    for r in range(cfg.ranks):
        gen = torch.Generator(device="cuda").manual_seed(
            seed * 7919 + (0 if same_everywhere else r))
        t = tokens[r]
        xs.append(torch.randn(t, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16))
        if routing == "hot":  # every token to experts of rank ranks - 1
            pool = torch.arange(cfg.local_experts, device="cuda") + (cfg.ranks - 1) * cfg.local_experts
        elif routing == "sparse":  # half the experts receive nothing
            pool = torch.arange(0, cfg.experts, 2, device="cuda")
        else:
            pool = torch.arange(cfg.experts, device="cuda")
        if cfg.topk > len(pool):
            pool = torch.arange(cfg.experts, device="cuda")
        pick = torch.rand(t, len(pool), device="cuda", generator=gen).argsort(dim=1)[:, :cfg.topk]
        chosen = pool[pick]
        if routing == "front":  # rank 0's experts for tokens t % 64 < 4 only, the rest elsewhere
            first = torch.arange(cfg.local_experts, device="cuda")
            rest = torch.arange(cfg.local_experts, cfg.experts, device="cuda")
            a = first[torch.rand(t, len(first), device="cuda", generator=gen)
                      .argsort(dim=1)[:, :cfg.topk]]
            b = rest[torch.rand(t, len(rest), device="cuda", generator=gen)
                     .argsort(dim=1)[:, :cfg.topk]]
            chosen = torch.where((torch.arange(t, device="cuda") % 64 < 4)[:, None], a, b)
        ids.append(chosen.to(torch.int64 if seed % 2 else torch.int32))
        ws.append(torch.rand(t, cfg.topk, device="cuda", generator=gen))
    return xs, ids, ws


def _nvfp4_scales(cfg, out, rows):
    from cute_ep.reference.ep import nvfp4_row_scales

    return nvfp4_row_scales(out, cfg.hidden, rows)


def _expert_outputs(cfg, result, num_rows, global_scales=None):
    """A stand-in for the experts: row -> dequantized row * (1 + segment / 8), bf16, with the
    buffer's full row capacity. Applied identically to the kernel's and the reference's rows
    (NVFP4: `result` is the reference's, whose `source_rank` picks each row's global scale)."""
    if cfg.format == "fp8":
        from cute_ep.reference.ep import dequantize_fp8_blockwise

        rows = dequantize_fp8_blockwise(result.tokens[:num_rows], result.scales)
    elif cfg.format == "nvfp4":
        from cute_ep.reference.fp4 import dequantize_nvfp4

        gs = torch.tensor(global_scales, dtype=torch.float32, device=result.tokens.device)
        rows = dequantize_nvfp4(result.tokens[:num_rows], _nvfp4_scales(cfg, result, num_rows),
                                gs[result.source_rank[:num_rows].long()])
    else:
        rows = result.tokens[:num_rows].float()
    offsets = result.row_offsets.long().cpu()
    seg = torch.bucketize(torch.arange(num_rows), offsets[1:], right=True).to(rows.device)
    y = torch.zeros(cfg.row_capacity, cfg.hidden, dtype=torch.bfloat16, device=rows.device)
    y[:num_rows] = (rows * (1 + seg.float() / 8).unsqueeze(1)).to(torch.bfloat16)
    return y


def _check_dispatch(cfg, got, want, what):
    from cute_ep.reference.ep import dispatch_mismatch

    problem = dispatch_mismatch(cfg, got, want)
    assert problem is None, f"{what}: {problem}"


def _check_combine(got, want, bound, what):
    err = (got.float() - want.float()).abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{what}: combine off by {err.max().item():g} beyond the bf16 bound"


def _one_layer(buf, cfg, rank, seed, tokens, routing="uniform", weighted=True, skip_a2a=False,
               num_input_tokens=None, direct=False):
    """`direct`: x from the Buffer's direct input."""
    from cute_ep.reference import ep as reference

    xs, ids, ws = _inputs(cfg, seed, tokens, routing, same_everywhere=skip_a2a)
    gs = _global_scales(cfg, seed)
    quant = {} if gs is None else {
        "global_scale": torch.tensor([gs[rank]], dtype=torch.float32, device="cuda")}
    x = xs[rank]
    if direct:
        x = buf.input_buffer()[:tokens[rank]]
        x.copy_(xs[rank])
    out = buf.dispatch(x, ids[rank], ws[rank] if weighted else None, skip_a2a=skip_a2a,
                       num_input_tokens=num_input_tokens, **quant)
    refs = reference.dispatch(cfg, xs, ids, skip_a2a=skip_a2a, global_scales=gs)
    what = f"{cfg.format} R={cfg.ranks} H={cfg.hidden} K={cfg.topk} E={cfg.experts} T={tokens} " \
           f"{routing}{' skip_a2a' if skip_a2a else ''}{'' if weighted else ' unweighted'} " \
           f"seed={seed}"
    _check_dispatch(cfg, out, refs[rank], what)
    ys = [_expert_outputs(cfg, d, d.num_rows, gs) for d in refs]
    y = ys[rank].clone()
    combined = buf.combine(y, out.handle)
    buf.check()
    w = ws if weighted else None
    want = reference.combine(cfg, ys, refs, tokens, w)[rank]
    if weighted:
        abs_ys = [t.abs() for t in ys]
        scale = reference.combine(cfg, abs_ys, refs, tokens, [t.abs() for t in ws])[rank]
        _check_combine(combined, want, scale.float() * 2.0 ** -6, what)
    else:
        assert torch.equal(combined, want), f"{what}: unreduced combine differs"
    return refs[rank].num_rows


def _shape_cases(rank, world, hidden, topk, experts, fmt):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(hidden, topk, experts, world, MAX_TOKENS, fmt)
    buf = Buffer(cfg)
    rows = []
    seed = 0
    for t in (0, 1, 127, MAX_TOKENS):
        seed += 1
        rows.append(_one_layer(buf, cfg, rank, seed, [t] * world))
    uneven = [(0, 1, 127, MAX_TOKENS)[r % 4] for r in range(world)]
    for routing in ("uniform", "hot", "sparse"):
        seed += 1
        rows.append(_one_layer(buf, cfg, rank, seed, uneven, routing))
    seed += 1
    rows.append(_one_layer(buf, cfg, rank, seed, [300] * world, weighted=False))
    for bound in (1, 128):  # decode: fewer channels, then the whole budget again above
        seed += 1
        rows.append(_one_layer(buf, cfg, rank, seed, [(bound, bound // 2)[r % 2]
                                                      for r in range(world)],
                               num_input_tokens=bound))
    return rows


@pytest.mark.parametrize("fmt,world", FORMAT_WORLDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-K{}-E{}".format(*s))
def test_dispatch_and_combine_match_the_reference(shape, fmt, world):
    hidden, topk, experts = shape
    if fmt == "fp8" and hidden % 128:
        pytest.skip("FP8 blockwise needs H to be a multiple of 128")
    if fmt == "nvfp4" and hidden % 16:
        pytest.skip("NVFP4 needs H to be a multiple of 16")
    rows = run_ranks(_shape_cases, world=world, hidden=hidden, topk=topk, experts=experts,
                     fmt=fmt, limit_s=300)
    assert all(len(r) == 10 for r in rows)


@pytest.mark.parametrize("world", NVFP4_WORLDS, ids=lambda w: f"world{w}")
def test_nvfp4_rows_that_are_not_a_multiple_of_16_bytes(world):
    """H = 1040: 520-byte rows of codes (8-byte aligned only), 65 scale columns (the last 4-column
    group holds one)."""
    rows = run_ranks(_shape_cases, world=world, hidden=1040, topk=4, experts=32, fmt="nvfp4",
                     limit_s=300)
    assert all(len(r) == 10 for r in rows)


def _options(rank, world, fmt):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(2048, 4, 16 * world, world, 512, fmt, fused_shared_expert=True)
    buf = Buffer(cfg)
    for seed, tokens in enumerate(([512] * world, [0] * world, [(37 * r) % 512 for r in range(world)])):
        _one_layer(buf, cfg, rank, seed + 1, tokens)
    plain = Buffer(EPConfig(2048, 4, 16 * world, world, 512, fmt))
    for seed, t in enumerate((512, 5, 0)):
        _one_layer(plain, plain.cfg, rank, 10 + seed, [t] * world, skip_a2a=True)
        _one_layer(buf, cfg, rank, 20 + seed, [t] * world, skip_a2a=True)
        # Unreduced: each (token, k) row comes home, from this rank's own experts alone.
        _one_layer(plain, plain.cfg, rank, 30 + seed, [t] * world, skip_a2a=True,
                   weighted=False)
    return True


@pytest.mark.parametrize("fmt,world", FORMAT_WORLDS)
def test_fused_shared_expert_and_skip_a2a(fmt, world):
    assert all(run_ranks(_options, world=world, fmt=fmt, limit_s=300))


def _sm_budgets(rank, world):
    """The same layers on a few SMs (each channel then walks many tokens through its rings,
    each combine CTA many messages), a default budget and every SM."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(4096, 8, 64, world, 1024, "fp8")
    seed = 40
    for sms in (world, 5, None):
        buf = Buffer(cfg, sms=sms)
        for tokens in ([1024] * world, [(301 * r) % 1024 for r in range(world)]):
            seed += 1
            _one_layer(buf, cfg, rank, seed, tokens)
        del buf
    with pytest.raises(ValueError, match="sms"):
        Buffer(cfg, sms=0)
    return True


def test_an_sm_budget_changes_nothing_but_speed():
    assert all(run_ranks(_sm_budgets, limit_s=300))


def _many_rounds(rank, world, rounds):
    """Back-to-back layers with changing inputs and token counts, two configs alternating."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    bufs = [Buffer(EPConfig(4096, 8, 128, world, 256, "bf16")),
            Buffer(EPConfig(4096, 8, 128, world, 256, "fp8"))]
    for i in range(rounds):
        buf = bufs[i % 2]
        tokens = [(i * 53 + 17 * r) % 257 for r in range(world)]
        _one_layer(buf, buf.cfg, rank, 1000 + i, tokens, ("uniform", "hot", "sparse")[i % 3])
    return [int(b.dispatch_epoch) for b in bufs]


def test_200_back_to_back_rounds_stay_exact():
    world = torch.cuda.device_count()
    rounds = run_ranks(_many_rounds, rounds=200, limit_s=600)
    assert rounds == [[100, 100]] * world  # 100 layers per buffer


def _graph(rank, world, fmt, replays):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(4096, 8, 128, world, 256, fmt)
    buf = Buffer(cfg)
    # NVFP4: one global scale on every rank, changed between replays (read on the device).
    nvfp4 = fmt == "nvfp4"
    graph_replays(buf, cfg, rank, [256 - 3 * r for r in range(world)], replays,
                  torch.full((1,), 50.0, device="cuda") if nvfp4 else None,
                  _e2m1_pairs() if nvfp4 else None,
                  (lambda k: 30.0 + 20 * k) if nvfp4 else None)
    buf.check()
    return True


def graph_replays(buf, cfg, rank, tokens, replays, gs=None, decode=None, scales_of=None):
    """Dispatch, `_stand_in` experts and combine on `buf` captured in one CUDA graph, then
    replayed on `replays` new inputs, each against the reference (`check_replay`).
    NVFP4: the global scale `gs`, `scales_of(k)` before replay k."""
    import torch.distributed as dist

    xs, ids, ws = _inputs(cfg, 1, tokens)
    x, i_, w = xs[rank].clone(), ids[rank].clone(), ws[rank].clone()
    y = torch.zeros(cfg.row_capacity, cfg.hidden, dtype=torch.bfloat16, device="cuda")
    quant = {} if gs is None else {"global_scale": gs}

    def layer():
        out = buf.dispatch(x, i_, w, **quant)
        y.copy_(_stand_in(cfg, out, gs, decode))
        return out, buf.combine(y, out.handle)

    layer()  # warm-up: modules load outside the capture
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, combined = layer()
    for k in range(replays):
        xs, ids, ws = _inputs(cfg, 100 + k, tokens)
        x.copy_(xs[rank])
        i_.copy_(ids[rank])
        w.copy_(ws[rank])
        if scales_of is not None:
            gs.fill_(scales_of(k))
        graph.replay()
        torch.cuda.synchronize()
        check_replay(cfg, rank, out, combined, tokens, xs, ids, ws, f"graph replay {k}",
                     None if scales_of is None else [scales_of(k)] * cfg.ranks, gs, decode)


def check_replay(cfg, rank, out, combined, tokens, xs, ids, ws, what, global_scales=None,
                 gs=None, decode=None):
    """A replayed layer's dispatch `out` and combine `combined` (expert outputs `_stand_in`)
    against the reference of every rank's inputs."""
    from cute_ep.reference import ep as reference

    refs = reference.dispatch(cfg, xs, ids, global_scales=global_scales)
    _check_dispatch(cfg, out, refs[rank], what)
    ys = [_stand_in(cfg, d, gs, decode) for d in refs]
    want = reference.combine(cfg, ys, refs, tokens, ws)[rank]
    scale = reference.combine(cfg, [t.abs() for t in ys], refs, tokens, ws)[rank]
    _check_combine(combined, want, scale.float() * 2.0 ** -6, what)


def _e2m1_pairs():
    """Byte -> its two e2m1 values (low nibble first), [256, 2] fp32 from `cute_ep.reference.fp4`, built
    before a graph capture: `e2m1_decode` uploads a table, which a capture does not allow."""
    from cute_ep.reference.fp4 import e2m1_decode, unpack_nibbles

    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    return e2m1_decode(unpack_nibbles(codes)).reshape(256, 2)


def _stand_in(cfg, out, gs, decode):
    """Expert outputs that need no row count: every row (padding and beyond included), from
    the dequantized rows (NVFP4: `decode` from `_e2m1_pairs`, one global scale `gs`)."""
    if cfg.format == "fp8":
        from cute_ep.reference.ep import dequantize_fp8_blockwise

        rows = dequantize_fp8_blockwise(out.tokens.view(torch.uint8).view(torch.float8_e4m3fn),
                                        out.scales)
    elif cfg.format == "nvfp4":
        cap = cfg.row_capacity
        values = decode[out.tokens.long()].reshape(cap, cfg.hidden // 16, 16)
        sf = _nvfp4_scales(cfg, out, cap).view(torch.float8_e4m3fn).float().unsqueeze(-1)
        rows = (values * sf / gs).reshape(cap, cfg.hidden)
    else:
        rows = out.tokens.float()
    return (rows * 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("fmt,world", FORMAT_WORLDS)
def test_cuda_graph_replays_stay_exact(fmt, world):
    assert all(run_ranks(_graph, world=world, fmt=fmt, replays=20, limit_s=300))


def _absent_rank(rank, world, phase):
    import time

    from cute_ep.ep import Buffer
    from cute_ep.runtime.comm import PeerTimeout
    from layouts import EPConfig

    cfg = EPConfig(1024, 2, 4 * world, world, 64)
    buf = Buffer(cfg, timeout_s=1.0)
    xs, ids, ws = _inputs(cfg, 1, [64] * world)
    if rank == world - 1 and phase == "dispatch":
        return "absent"
    start = time.monotonic()
    out = buf.dispatch(xs[rank], ids[rank], ws[rank])
    if phase == "combine":
        buf.check()
        if rank == world - 1:
            return "absent"
        buf.combine(torch.zeros(cfg.row_capacity, cfg.hidden, dtype=torch.bfloat16,
                                device="cuda"), out.handle)
    try:
        buf.check()
    except PeerTimeout as e:
        return (str(e), time.monotonic() - start)
    return "no error"


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_a_rank_that_never_arrives_raises_a_named_timeout(phase):
    world = torch.cuda.device_count()
    results = run_ranks(_absent_rank, phase=phase, limit_s=120)
    for rank, res in enumerate(results[:-1]):
        msg, seconds = res
        assert msg.startswith(f"{phase}: rank {rank} timed out after 1 s waiting for rank "
                              f"{world - 1}"), msg
        assert seconds < 10
    assert results[-1] == "absent"


def _slow_rank(rank, world, pause_s):
    """The last rank spends `pause_s` on the host between dispatch and combine (as a hot rank
    checking its rows did); the others go straight on, and those whose tokens went to its
    experts wait for it in combine. Returns (seconds, whether this rank needed it)."""
    import time

    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(1024, 2, 4 * world, world, 256)
    buf = Buffer(cfg)  # the production default timeout
    real_combine = buf.combine

    def combine_after_a_pause(y, handle):
        if rank == world - 1:
            torch.cuda.synchronize()
            time.sleep(pause_s)
        return real_combine(y, handle)

    buf.combine = combine_after_a_pause
    tokens = [256, 1, 77, 256][:world] + [256] * (world - 4)
    # Whether this rank's tokens have experts on the slow rank: then their rows come back from
    # it, and combine must wait for it (the others' combines need nothing from it).
    _, ids, _ = _inputs(cfg, 5, tokens)
    needs_slow = bool((ids[rank].long() // cfg.local_experts == world - 1).any())
    start = time.monotonic()
    _one_layer(buf, cfg, rank, 5, tokens)
    return time.monotonic() - start, needs_slow


def test_a_rank_slow_between_dispatch_and_combine_is_waited_for():
    """The last rank pauses 10 s on the host before its combine; every rank whose tokens went to
    its experts waits for their rows (and `_one_layer` checks every rank's outputs exactly), at
    any world size. A rank that needs nothing from it may finish first."""
    pause_s = 10.0
    results = run_ranks(_slow_rank, pause_s=pause_s, limit_s=180)
    world = len(results)
    waiting = [r for r, (_, needs) in enumerate(results) if needs and r != world - 1]
    assert waiting, results  # the layer routes some rank's tokens to the slow rank
    for rank in [*waiting, world - 1]:
        assert results[rank][0] >= pause_s, (rank, results)  # really waited, exactly


def _mismatch(rank, world, what):
    from cute_ep.ep import Buffer
    from cute_ep.runtime.comm import ConfigMismatch
    from layouts import EPConfig

    try:
        if what == "hidden":
            Buffer(EPConfig(1024 if rank else 2048, 2, 4 * world, world, 64))
        else:  # a ring's depth
            Buffer(EPConfig(1024, 2, 4 * world, world, 64), **{what: 4 if rank else 8})
    except ConfigMismatch as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["hidden", "stage_batches", "ring_chunks"])
def test_mismatched_config_fails_on_every_rank(what):
    for msg in run_ranks(_mismatch, limit_s=120, what=what):
        assert "disagree" in msg


def _direct(rank, world, rounds):
    """Layers whose x is the Buffer's direct input (each rank's receivers pull it over NVLink
    from the source's input part), some ranks passing x from elsewhere, back to back."""
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    cfg = EPConfig(7168, 8, 32 * world, world, MAX_TOKENS, "bf16")
    buf = Buffer(cfg, direct_input=True)
    rows = 0
    for i in range(rounds):
        tokens = [(MAX_TOKENS, 1, 300, 0)[(i + r) % 4] for r in range(world)]
        rows += _one_layer(buf, cfg, rank, 3000 + i, tokens, ("uniform", "hot")[i % 2],
                           direct=(i + rank) % 3 != 0)
    return rows


def test_a_direct_input_between_gpus_stays_exact():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert all(r > 0 for r in run_ranks(_direct, rounds=12))
