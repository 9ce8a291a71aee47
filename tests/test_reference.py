"""The plain-torch reference of dispatch and combine, for emulated ranks, on the CPU."""

import pytest
import torch

from cute_ep.reference import ep as ref
from layouts import EPConfig

H = 256  # small hidden size: two FP8 blocks


def _inputs(cfg, tokens_per_rank, gen, hot_expert=None):
    x, ids, w = [], [], []
    for t in tokens_per_rank:
        x.append(torch.randn(t, cfg.hidden, generator=gen).to(torch.bfloat16))
        if hot_expert is not None:
            # every token routes to experts hot_expert .. hot_expert+K-1 (all on one rank)
            row = torch.arange(hot_expert, hot_expert + cfg.topk)
            ids.append(row.repeat(t, 1).int())
        else:
            ids.append(torch.stack([torch.randperm(cfg.experts, generator=gen)[:cfg.topk]
                                    for _ in range(t)]).int() if t else
                       torch.zeros(0, cfg.topk, dtype=torch.int32))
        w.append(torch.rand(t, cfg.topk, generator=gen))
    return x, ids, w


def _independent_order_check(cfg, out, ids, dest, skip_a2a=False):
    """Rows of each segment, read back, list the routed (source, token, k) in sorted order."""
    e_loc, shared = cfg.local_experts, int(cfg.fused_shared_expert)
    for g in range(cfg.segments):
        start, n = int(out.row_offsets[g]), int(out.counts[g])
        got = [(int(out.source_rank[r]), *map(int, out.src_info[r])) for r in range(start, start + n)]
        if shared and g == 0:
            assert all(k == ref.SHARED_K and s == dest for s, _, k in got)
            continue
        expert = dest * e_loc + g - shared
        sources = [dest] if skip_a2a else range(cfg.ranks)
        want = sorted((s, t, k) for s in sources
                      for t, k in zip(*torch.nonzero(ids[s] == expert, as_tuple=True)))
        assert got == [(s, int(t), int(k)) for s, t, k in want]
        assert int(out.row_offsets[g + 1]) - start == -(-n // (4 if cfg.format == "fp8" else 1)) * \
            (4 if cfg.format == "fp8" else 1)
    assert out.expert_ids.tolist() == [g - shared for g in range(cfg.segments)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("shape", [(8, 32), (2, 8)], ids=["K8-E32", "K2-E8"])
@pytest.mark.parametrize("case", ["uneven", "hot", "empty"])
def test_bf16_round_trip_gives_x_times_sum_of_weights(ranks, shape, case):
    topk, experts = shape
    cfg = EPConfig(H, topk, experts, ranks, max_tokens_per_rank=33)
    gen = torch.Generator().manual_seed(ranks * 100 + topk)
    tokens = {"uneven": [33, 0, 1, 17, 5, 33, 2, 9][:ranks], "hot": [20] * ranks,
              "empty": [0] * ranks}[case]
    x, ids, w = _inputs(cfg, tokens, gen, hot_expert=0 if case == "hot" else None)
    out = ref.dispatch(cfg, x, ids)
    for r in range(ranks):
        _independent_order_check(cfg, out[r], ids, r)
        assert torch.equal(out[r].tokens[out[r].num_rows:], torch.zeros_like(out[r].tokens[out[r].num_rows:]))
    if case == "hot":
        busy = -(-topk // cfg.local_experts)  # experts 0..K-1 live on the first ranks only
        assert all(int(o.counts.sum()) == 20 * ranks * cfg.local_experts for o in out[:busy - 1])
        assert all(int(o.counts.sum()) == 0 for o in out[busy:])
    y = [o.tokens for o in out]  # identity experts
    combined = ref.combine(cfg, y, out, tokens, w)
    for r in range(ranks):
        want = (x[r].float() * w[r].sum(dim=1, keepdim=True)).to(torch.bfloat16)
        torch.testing.assert_close(combined[r], want, rtol=2 ** -7, atol=1e-6)
    unreduced = ref.combine(cfg, y, out, tokens, None)
    for r in range(ranks):
        assert torch.equal(unreduced[r], x[r].unsqueeze(1).expand(-1, topk, -1))


def test_fused_shared_expert_adds_the_token_unweighted():
    cfg = EPConfig(H, 4, 16, 4, 12, fused_shared_expert=True)
    gen = torch.Generator().manual_seed(7)
    tokens = [12, 3, 0, 7]
    x, ids, w = _inputs(cfg, tokens, gen)
    out = ref.dispatch(cfg, x, ids)
    for r in range(4):
        _independent_order_check(cfg, out[r], ids, r)
        assert int(out[r].counts[0]) == tokens[r]
    combined = ref.combine(cfg, [o.tokens for o in out], out, tokens, w)
    for r in range(4):
        want = (x[r].float() * (1 + w[r].sum(dim=1, keepdim=True))).to(torch.bfloat16)
        torch.testing.assert_close(combined[r], want, rtol=2 ** -7, atol=1e-6)
    with pytest.raises(ValueError, match="shared expert"):
        ref.combine(cfg, [o.tokens for o in out], out, tokens, None)


@pytest.mark.parametrize("shared", [False, True])
def test_skip_a2a_local_slots_then_allreduce(shared):
    ranks = 4
    cfg = EPConfig(H, 4, 16, ranks, 10, fused_shared_expert=shared)
    gen = torch.Generator().manual_seed(3)
    x1, ids1, w1 = _inputs(cfg, [10], gen)
    x, ids, w = x1 * ranks, ids1 * ranks, w1 * ranks  # every rank holds all tokens
    out = ref.dispatch(cfg, x, ids, skip_a2a=True)
    for r in range(ranks):
        assert set(out[r].source_rank[: out[r].num_rows].tolist()) <= {r}
    partial = ref.combine(cfg, [o.tokens for o in out], out, [10] * ranks, w)
    total = sum(p.float() for p in partial)  # the caller's allreduce
    want = x1[0].float() * (int(shared) + w1[0].sum(dim=1, keepdim=True))
    torch.testing.assert_close(total, want, rtol=2 ** -6, atol=1e-5)


def test_fp8_quantization_matches_the_formula_element_by_element():
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 256, generator=gen) * torch.tensor([1e-6, 1.0, 300.0]).unsqueeze(1))
    x = x.to(torch.bfloat16)
    q, scale = ref.quantize_fp8_blockwise(x)
    for t in range(3):
        for b in range(2):
            block = [float(v) for v in x[t, b * 128:(b + 1) * 128].float()]
            s = torch.tensor(max(max(abs(v) for v in block), 1e-4), dtype=torch.float32) / 448.0
            assert scale[t, b] == s
            for i, v in enumerate(block):
                ratio = torch.tensor(v, dtype=torch.float32) / s  # a true fp32 division
                code = ratio.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                assert q[t, b * 128 + i].view(torch.uint8) == code.view(torch.uint8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_scale_is_the_correctly_rounded_quotient(device):
    # amax / 448 rounded once, as the kernels' div.rn.f32 does; the fp64 quotient of two fp32
    # numbers rounded to fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits).
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 1024, generator=gen) * torch.rand(64, 1, generator=gen) * 8
    x[0, 5] = 2.625  # 2.625 / 448 = 3 / 512 exactly
    x = x.to(torch.bfloat16).to(device)
    q, scale = ref.quantize_fp8_blockwise(x)
    amax = x.float().reshape(64, 8, 128).abs().amax(-1).clamp(min=1e-4)
    want = (amax.double() / 448.0).float()
    assert torch.equal(scale, want)
    assert scale[0, 0].item() == 3 / 512
    ratio = (x.float().reshape(64, 8, 128).double() / scale.double().unsqueeze(-1)).float()
    codes = ratio.clamp(-448, 448).to(torch.float8_e4m3fn).reshape(64, 1024)
    assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8))


def test_fp8_pow2_scales_are_the_least_power_of_two_at_or_above_the_rounded_quotient():
    """`fp8_scales="pow2"` (DeepEP's round_scale): 2^ceil(log2(max(amax, 1e-4) * RN(1/448))),
    written out with math.frexp from each block's amax; codes x / s (exact: s is a power of
    two); a NaN block keeps NaN."""
    import math

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 512, generator=gen) * torch.tensor([1e-6, 1.0, 300.0, 3e4]).unsqueeze(1)
    x[1, 0] = 448.0 * 2 ** -3  # amax * RN(1/448) lands on (or next to) a power of two
    x[2, 128:256] = float("nan")
    x = x.to(torch.bfloat16)
    q, scale = ref.quantize_fp8_blockwise(x, pow2=True)
    inv448 = float(torch.tensor(1 / 448.0, dtype=torch.float32))
    for t in range(4):
        for b in range(4):
            block = x[t, b * 128:(b + 1) * 128].float()
            if torch.isnan(block).any():
                assert math.isnan(scale[t, b]) and torch.isnan(q[t, b * 128:(b + 1) * 128]
                                                                .float()).all()
                continue
            raw = float(torch.tensor(max(block.abs().max().item(), 1e-4), dtype=torch.float32)
                        * torch.tensor(inv448, dtype=torch.float32))
            mant, exp = math.frexp(raw)  # raw = mant * 2^exp, mant in [0.5, 1)
            want = 2.0 ** (exp - 1) if mant == 0.5 else 2.0 ** exp
            assert scale[t, b].item() == want, (t, b)
            codes = (block / want).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            assert torch.equal(q[t, b * 128:(b + 1) * 128].view(torch.uint8),
                               codes.view(torch.uint8))
    exact = ref.quantize_fp8_blockwise(x)[1]
    finite = ~torch.isnan(exact)
    assert (scale[finite] >= exact[finite] * (1 - 2 ** -23)).all()
    assert (scale[finite] < 2 * exact[finite]).all()
    with pytest.raises(ValueError, match="fp8_scales='pow2' is for the fp8 format"):
        EPConfig(H, 2, 8, 2, 9, format="bf16", fp8_scales="pow2")
    with pytest.raises(ValueError, match="fp8_scales must be one of"):
        EPConfig(H, 2, 8, 2, 9, format="fp8", fp8_scales="ue8m0")


def test_fp8_dispatch_transposes_scales_and_zeroes_padding():
    cfg = EPConfig(H, 2, 8, 2, 9, format="fp8")
    gen = torch.Generator().manual_seed(5)
    tokens = [9, 4]
    x, ids, w = _inputs(cfg, tokens, gen)
    out = ref.dispatch(cfg, x, ids)
    for r in range(2):
        o = out[r]
        _independent_order_check(cfg, o, ids, r)
        assert o.scales.shape == (H // 128, cfg.row_capacity)
        valid = o.source_rank != ref.PAD
        assert torch.all(o.scales[:, ~valid] == 0)
        assert torch.all(o.tokens[~valid].view(torch.uint8) == 0)
        for row in torch.nonzero(valid).flatten().tolist():
            s, (t, _) = int(o.source_rank[row]), o.src_info[row].tolist()
            q, scale = ref.quantize_fp8_blockwise(x[s][t:t + 1])
            assert torch.equal(o.tokens[row].view(torch.uint8), q[0].view(torch.uint8))
            assert torch.equal(o.scales[:, row], scale[0])
        deq = ref.dequantize_fp8_blockwise(o.tokens[: o.num_rows], o.scales)
        rows_x = torch.stack([x[int(o.source_rank[i])][int(o.src_info[i, 0])].float()
                              if valid[i] else torch.zeros(H) for i in range(o.num_rows)]) \
            if o.num_rows else torch.zeros(0, H)
        torch.testing.assert_close(deq, rows_x, rtol=2 ** -3, atol=1e-3)


@pytest.mark.parametrize("bad,match", [
    ("id_range", r"expert ids must be in \[0, 8\)"),
    ("negative", r"expert ids must be in \[0, 8\)"),
    ("duplicate", "same expert twice"),
    ("too_many", "exceeds max_tokens_per_rank=4"),
    ("dtype", "x must be bf16"),
    ("ranks", "expected inputs for 2 ranks"),
])
def test_bad_inputs_name_what_is_wrong(bad, match):
    cfg = EPConfig(H, 2, 8, 2, 4)
    x = [torch.zeros(3, H, dtype=torch.bfloat16)] * 2
    ids = [torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)] * 2
    if bad == "id_range":
        ids = [ids[0], torch.tensor([[0, 8], [2, 3], [4, 5]], dtype=torch.int32)]
    elif bad == "negative":
        ids = [torch.tensor([[0, -2], [2, 3], [4, 5]], dtype=torch.int32), ids[1]]
    elif bad == "duplicate":
        ids = [torch.tensor([[0, 0], [2, 3], [4, 5]], dtype=torch.int32), ids[1]]
    elif bad == "too_many":
        x = [torch.zeros(5, H, dtype=torch.bfloat16)] * 2
        ids = [torch.zeros(5, 2, dtype=torch.int32)] * 2
    elif bad == "dtype":
        x = [torch.zeros(3, H)] * 2
    elif bad == "ranks":
        x, ids = x[:1], ids[:1]
    with pytest.raises(ValueError, match=match):
        ref.dispatch(cfg, x, ids)


def test_minus_one_is_an_empty_slot_and_slabs_hold_each_expert_at_a_fixed_row():
    """-1 (DeepEP's empty slot) routes nowhere; the slabs layout starts segment g at
    g * R * max_tokens_per_rank with the same rows, in the same order, as the packed layout."""
    x = [torch.randn(3, H).to(torch.bfloat16) for _ in range(2)]
    ids = [torch.tensor([[0, -1], [-1, -1], [4, 5]], dtype=torch.int32),
           torch.tensor([[1, 7], [2, -1], [-1, 6]], dtype=torch.int32)]
    packed = ref.dispatch(EPConfig(H, 2, 8, 2, 4), x, ids)
    slabs = ref.dispatch(EPConfig(H, 2, 8, 2, 4, layout="slabs"), x, ids)
    assert [p.counts.tolist() for p in packed] == [[1, 1, 1, 0], [1, 1, 1, 1]]
    for p, s in zip(packed, slabs):
        assert s.row_offsets.tolist() == [0, 8, 16, 24, 32]
        for g, c in enumerate(p.counts.tolist()):
            a, b = int(p.row_offsets[g]), int(s.row_offsets[g])
            assert torch.equal(p.tokens[a:a + c], s.tokens[b:b + c])
            assert torch.equal(p.src_info[a:a + c], s.src_info[b:b + c])


def _spec_scale_offset(r, kb, hidden):
    """SPEC section 4's byte offset of scale (row r, column kb) in the 128x4 layout."""
    rk = -(-(hidden // 16) // 4)
    return (r // 128) * rk * 512 + (kb // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + kb % 4


def _nvfp4_tokens(count, hidden, gs):
    """Token t, block b: element 0 = 6 (1 + m/8) 2^-b / gs with m = t % 8, so its scale is
    exactly (1 + m/8) 2^-b (e4m3 byte (7 - b) << 3 | m) and its code 6 (0x7); element 1 = 1.5
    scale units (code 0x3); the rest 0."""
    x = torch.zeros(count, hidden)
    for t in range(count):
        for b in range(hidden // 16):
            sf = (1 + (t % 8) / 8) * 2.0 ** -b
            x[t, 16 * b] = 6 * sf / gs
            x[t, 16 * b + 1] = 1.5 * sf / gs
    return x.to(torch.bfloat16)


def test_nvfp4_dispatch_puts_each_segment_on_fresh_scale_blocks_padding_zero():
    # H = 80: five scale columns, so RK = 2 and every row has three padding columns.
    cfg = EPConfig(80, 1, 4, 2, 140, format="nvfp4")
    gs = [1.0, 2.0]
    x = [_nvfp4_tokens(130, 80, gs[0]), _nvfp4_tokens(5, 80, gs[1])]
    ids = [torch.zeros(130, 1, dtype=torch.int32),  # rank 0: all to expert 0
           torch.tensor([[1], [1], [1], [0], [0]], dtype=torch.int32)]
    out = ref.dispatch(cfg, x, ids, global_scales=gs)
    o = out[0]
    # Expert 0: rank 0's 130 tokens then rank 1's tokens 3, 4 (rows 0..131, scale blocks 0, 1);
    # expert 1: rank 1's tokens 0..2 at rows 132..134, scale rows 256..258 (block 2).
    assert o.row_offsets.tolist() == [0, 132, 135] and o.counts.tolist() == [132, 3]
    assert o.scales_offsets.tolist() == [0, 1]  # 2 - 132 // 128
    assert o.tokens.shape == (cfg.row_capacity, 40)
    assert o.scales.numel() == 5 * 2 * 512  # (280 + 2 * 128 rows -> 5 blocks) x RK x 512
    assert [_spec_scale_offset(131, kb, 80) for kb in range(5)] == [1072, 1073, 1074, 1075, 1584]
    assert [_spec_scale_offset(258, kb, 80) for kb in range(5)] == [2080, 2081, 2082, 2083, 2592]
    # Row 131 is rank 1's token 4 (m = 4), row 134 its token 2 (m = 2), both under gs = 2.
    assert o.scales[[1072, 1073, 1074, 1075, 1584]].tolist() == [0x3C, 0x34, 0x2C, 0x24, 0x1C]
    assert o.scales[[2080, 2081, 2082, 2083, 2592]].tolist() == [0x3A, 0x32, 0x2A, 0x22, 0x1A]
    assert o.tokens[134].tolist() == [0x37, 0, 0, 0, 0, 0, 0, 0] * 5
    scale_row = {**{r: r for r in range(132)}, **{132 + j: 256 + j for j in range(3)}}
    used = set()
    for row, srow in scale_row.items():
        s, t = int(o.source_rank[row]), int(o.src_info[row, 0])
        assert (s, t) == ((0, row) if row < 130 else (1, [3, 4, 0, 1, 2][row - 130]))
        assert o.tokens[row].tolist() == [0x37, 0, 0, 0, 0, 0, 0, 0] * 5
        want = [(7 - b) << 3 | (t % 8) for b in range(5)]
        assert [int(o.scales[_spec_scale_offset(srow, kb, 80)]) for kb in range(5)] == want
        used |= {_spec_scale_offset(srow, kb, 80) for kb in range(5)}
    assert all(o.scales[i] == 0 for i in range(o.scales.numel()) if i not in used)
    # Rank 1 hosts experts 2, 3: nothing arrives, every scale byte stays zero.
    assert out[1].row_offsets.tolist() == [0, 0, 0] and out[1].scales_offsets.tolist() == [0, 0]
    assert not out[1].scales.any()


@pytest.mark.parametrize("skip_a2a", [False, True])
def test_nvfp4_dispatch_rows_dequantize_to_their_tokens(skip_a2a):
    from cute_ep.reference.fp4 import dequantize_nvfp4

    ranks, h = 4, 96
    cfg = EPConfig(h, 4, 16, ranks, 200, format="nvfp4", fused_shared_expert=True)
    gen = torch.Generator().manual_seed(9)
    tokens = [200] * ranks if skip_a2a else [200, 0, 3, 131]
    x, ids, _ = _inputs(cfg, tokens, gen)
    if skip_a2a:
        x, ids = [x[0]] * ranks, [ids[0]] * ranks
    gs = [448 * 6 / 4.0, 100.0, 3.0, 0.5]
    out = ref.dispatch(cfg, x, ids, skip_a2a=skip_a2a, global_scales=gs)
    for r in range(ranks):
        o = out[r]
        _independent_order_check(cfg, o, ids, r, skip_a2a)
        counts = o.counts.tolist()
        first = [sum(-(-c // 128) for c in counts[:g]) for g in range(cfg.segments)]
        assert o.scales_offsets.tolist() == [first[g] - int(o.row_offsets[g]) // 128
                                             for g in range(cfg.segments)]
        for g in range(cfg.segments):
            for j in range(counts[g]):
                row = int(o.row_offsets[g]) + j
                s, t = int(o.source_rank[row]), int(o.src_info[row, 0])
                sf = o.scales[[_spec_scale_offset(first[g] * 128 + j, kb, h)
                               for kb in range(h // 16)]]
                back = dequantize_nvfp4(o.tokens[row:row + 1], sf.unsqueeze(0),
                                        torch.tensor([gs[s]]))
                step = sf.view(torch.float8_e4m3fn).float().repeat_interleave(16) / gs[s]
                assert ((back[0] - x[s][t].float()).abs() <= step * 1.0 + 1e-6).all()
        assert not o.tokens[o.num_rows:].any()


@pytest.mark.parametrize("fmt,scales,match", [
    ("nvfp4", None, "global_scales"),
    ("bf16", [1.0, 1.0], "global_scales"),
    ("nvfp4", [1.0], "expected 2 global scales"),
])
def test_global_scales_are_for_nvfp4_and_one_per_rank(fmt, scales, match):
    cfg = EPConfig(H, 2, 8, 2, 4, format=fmt)
    x = [torch.zeros(3, H, dtype=torch.bfloat16)] * 2
    ids = [torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)] * 2
    with pytest.raises(ValueError, match=match):
        ref.dispatch(cfg, x, ids, global_scales=scales)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_dispatch_mismatch_names_the_first_defined_byte_that_differs(fmt):
    """The comparison the multi-GPU tests and the demo make: nothing for an identical output,
    nothing for bytes dispatch leaves undefined, and a named difference for each defined one."""
    import dataclasses

    cfg = EPConfig(256, 2, 8, 2, 40, fmt)
    gen = torch.Generator().manual_seed(3)
    xs, ids = _inputs(cfg, [40, 33], gen)[:2]
    gs = [40.0, 60.0] if fmt == "nvfp4" else None
    want = ref.dispatch(cfg, xs, ids, global_scales=gs)[0]
    n = want.num_rows

    def changed(name, edit):
        copy = dataclasses.replace(want, **{name: getattr(want, name).clone()})
        edit(getattr(copy, name).view(torch.uint8) if name in ("tokens", "scales")
             else getattr(copy, name))
        return ref.dispatch_mismatch(cfg, copy, want)

    assert ref.dispatch_mismatch(cfg, want, want) is None
    assert changed("tokens", lambda t: t[n:].fill_(7)) is None  # rows past num_rows
    last_row = changed("tokens", lambda t: t[n - 1, 0].add_(1))
    assert last_row == f"1 of {n} rows differ, first [{n - 1}]"
    assert changed("src_info", lambda t: t[0, 0].add_(1)) == "src_info"
    assert changed("counts", lambda t: t[0].add_(1)) == "counts"
    assert changed("row_offsets", lambda t: t[1].add_(1)) == "row_offsets"
    if fmt == "fp8":
        assert changed("scales", lambda t: t[:, 0].add_(1)) == "fp8 scales"
    if fmt == "nvfp4":
        assert changed("scales", lambda t: t[-1].add_(1)) is None  # past the used blocks
        assert changed("scales", lambda t: t[0].add_(1)).startswith("1 of ")
        assert changed("scales_offsets", lambda t: t[0].add_(1)) == "scales_offsets"
