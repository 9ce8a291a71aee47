"""`cute_ep.deepep` on one GPU (a group of one rank): DeepEP's normal-mode layout, cached
dispatch, FP8 tuples, `num_worst_tokens`, combine of rows and weights, the low-latency slabs and
their weighted combine, and a clear error for every DeepEP argument it cannot honour. The
expectations are written from DeepEP's documented semantics in plain torch; the multi-rank proof
is DeepEP's own test_intranode.py (`perf/deepep_test.sh`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

H, E, K, T = 1024, 16, 4, 300


def _face(rank, world):
    import cute_ep.deepep as deep_ep

    torch.manual_seed(5)
    buf = deep_ep.Buffer(None, int(1e9), int(1e9), low_latency_mode=True,
                         max_tokens_per_rank=512)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K]
    ids[::7, 1] = -1  # empty slots
    ids[5] = -1  # a token routed nowhere
    w = torch.rand(T, K, device="cuda")
    results = {}

    per_rank, none, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    routed = (ids >= 0).any(dim=1)
    results["layout"] = (none is None and per_rank.tolist() == [int(routed.sum())]
                         and per_expert.tolist() == [int((ids == e).sum()) for e in range(E)]
                         and torch.equal(in_rank[:, 0], routed))

    cfg = deep_ep.Config(24, 8, 256)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, config=cfg)
    recv, r_ids, r_w, counts, handle, ev = buf.dispatch(x, topk_idx=ids, topk_weights=w,
                                                        async_finish=True, **args)
    ev.current_stream_wait()
    results["rows"] = torch.equal(recv, x[routed])  # one row per token, in token order
    results["ids"] = torch.equal(r_ids, ids[routed])  # one rank: local id == global id
    results["weights"] = torch.equal(r_w, torch.where(ids >= 0, w, 0.0)[routed])
    results["counts"] = counts == per_expert.tolist()
    results["prefix"] = handle[0].tolist() == [[int(routed.sum())]]

    worst = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_worst_tokens=T, **args)
    n = recv.shape[0]
    results["worst"] = (worst[0].shape[0] == T and torch.equal(worst[0][:n], recv)
                        and bool((worst[1][n:] == -1).all()) and worst[3] == [])
    # num_worst_tokens also bounds the rows the core's output holds: fewer than arrive is an
    # error in DeepEP's terms, and nothing past the output is written.
    try:
        buf.dispatch(x, topk_idx=ids, topk_weights=w, num_worst_tokens=100, **args)
        results["worst too small"] = False
    except ValueError as exc:
        results["worst too small"] = "num_worst_tokens=100 is below" in str(exc)

    cached = buf.dispatch(x * 2, handle=handle, config=cfg)[0]
    results["cached"] = torch.equal(cached, (x * 2)[routed])

    y = recv * 3
    combined, c_w, _ = buf.combine(y, handle, topk_weights=r_w)
    want = torch.where(routed[:, None], (x * 3).float(), 0.0).to(torch.bfloat16)
    results["combine"] = torch.equal(combined, want)
    results["combine weights"] = torch.equal(c_w, torch.where(routed[:, None] & (ids >= 0),
                                                              w, 0.0))

    codes = x.view(T, H // 128, 128).float()
    amax = codes.abs().amax(-1).clamp(min=1e-4)
    q = (codes * (448.0 / amax).unsqueeze(-1)).to(torch.float8_e4m3fn).view(T, H)
    sc = (amax / 448.0).T.contiguous().T  # DeepEP's test passes column-major scales
    f_recv = buf.dispatch((q, sc), topk_idx=ids, topk_weights=w, **args)[0]
    results["fp8"] = (torch.equal(f_recv[0].view(torch.uint8), q[routed].view(torch.uint8))
                      and torch.equal(f_recv[1], sc[routed]))

    # Low-latency: slabs of every (token, k) pair of each expert, weighted combine at home.
    m = 64
    lx, lids, lw = x[:50], ids[:50].clone(), w[:50]
    packed, count, ll, _, hook = buf.low_latency_dispatch(lx, lids, m, E, use_fp8=False,
                                                          return_recv_hook=True)
    hook()
    ok = packed.shape == (E, m, H)
    for e in range(E):
        toks = (lids == e).any(dim=1).nonzero().flatten()
        ok = ok and int(count[e]) == len(toks) and torch.equal(packed[e, :len(toks)], lx[toks])
    results["ll rows"] = ok
    toks_of = [(lids == e).any(dim=1).nonzero().flatten() for e in range(E)]
    results["ll handle"] = all(
        torch.equal(ll[0][e, :len(toks_of[e])], toks_of[e].int())
        and ll[1][e].tolist() == [len(toks_of[e])] for e in range(E))
    ys = packed * 2
    out = torch.empty(50, H, dtype=torch.bfloat16, device="cuda")
    got = buf.low_latency_combine(ys, lids, lw, ll, out=out)[0]
    ref = ((lx.float() * 2).unsqueeze(1) * torch.where(lids >= 0, lw, 0.0).unsqueeze(2)).sum(1)
    err = (got.float() - ref).abs().max().item()
    results["ll combine"] = got.data_ptr() == out.data_ptr() and \
        err <= 2 ** -7 * ref.abs().max().item()
    # DeepEP's low-latency kernels take the SMs their experts need, whatever num_sms says: the
    # face's low-latency transports every SM, its normal-mode ones the config's num_sms.
    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sms = {(k[0], c.sms) for k, c in buf._cores.items()}
    results["ll sms"] = ({n for k, n in sms if k == "ll"} == {device_sms}
                         and {n for k, n in sms if k != "ll"} == {cfg.num_sms}) or sorted(sms)
    (fq, fs), _, _, _, _ = buf.low_latency_dispatch(lx, lids, m, E, use_fp8=True)
    e0 = int(lids[0, 0])
    toks = (lids == e0).any(dim=1).nonzero().flatten()
    deq = fq[e0, :len(toks)].float() * fs[e0, :len(toks)].repeat_interleave(128, dim=1)
    results["ll fp8"] = fs.shape == (E, m, H // 128) and fs.stride(1) == 1 and \
        (deq - lx[toks].float()).abs().max().item() <= 0.07 * lx[toks].float().abs().max().item()
    # round_scale: every block scale a power of two; use_ue8m0: their exponent bytes, four to an
    # int32, [E, m, H / 512] M-major, over the same codes.
    (rq, rs), _, _, _, _ = buf.low_latency_dispatch(lx, lids, m, E, use_fp8=True,
                                                    round_scale=True)
    n0 = len(toks)
    mant = torch.frexp(rs[e0, :n0])[0]
    rdeq = rq[e0, :n0].float() * rs[e0, :n0].repeat_interleave(128, dim=1)
    results["ll round_scale"] = bool((mant == 0.5).all()) and \
        (rdeq - lx[toks].float()).abs().max().item() <= 0.13 * lx[toks].float().abs().max().item()
    (uq, us), _, _, _, _ = buf.low_latency_dispatch(lx, lids, m, E, use_fp8=True,
                                                    round_scale=True, use_ue8m0=True)
    exps = ((rs.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    results["ll ue8m0"] = us.dtype == torch.int32 and us.shape == (E, m, H // 512) and \
        us.stride(1) == 1 and torch.equal(uq[e0, :n0].view(torch.uint8),
                                          rq[e0, :n0].view(torch.uint8)) and \
        torch.equal(us.contiguous().view(torch.uint8).view(E, m, H // 128)[e0, :n0],
                    exps[e0, :n0])
    # The same with a receive hook: the exponent bytes are packed when the hook has run (the
    # scales exist only then).
    (hq, hs), _, _, _, hook = buf.low_latency_dispatch(lx, lids, m, E, use_fp8=True,
                                                       round_scale=True, use_ue8m0=True,
                                                       return_recv_hook=True)
    hook()
    results["ll ue8m0 hook"] = torch.equal(hs[e0, :n0], us[e0, :n0]) and \
        torch.equal(hq[e0, :n0].view(torch.uint8), uq[e0, :n0].view(torch.uint8))
    # zero_copy: the experts' outputs written into the shape's combine buffer instead.
    zb = buf.get_next_low_latency_combine_buffer(ll)
    zb.copy_(ys)
    zc = buf.low_latency_combine(torch.zeros_like(ys), lids, lw, ll, zero_copy=True)[0]
    results["ll zero_copy"] = zb.shape == (E, m, H) and torch.equal(zc, got)

    wrong = in_rank.clone()
    wrong[0] = ~wrong[0]
    results["refused"] = _raising(NotImplementedError, (
        ("bias", lambda: buf.combine(y, handle, bias=y), "bias"),
        ("use_logfmt", lambda: buf.low_latency_combine(ys, lids, lw, ll, use_logfmt=True),
         "use_logfmt"),
        ("rdma", lambda: buf.dispatch(x, num_tokens_per_rdma_rank=per_rank, **args),
         "num_tokens_per_rdma_rank"),
        ("mnnvl", lambda: deep_ep.Buffer(None, 1, allow_mnnvl=True), "allow_mnnvl")))
    results["checked"] = _raising(ValueError, (
        ("layout", lambda: buf.dispatch(x, topk_idx=ids, topk_weights=w, **dict(
            args, is_token_in_rank=wrong)), "is_token_in_rank does not match topk_idx"),
        ("id", lambda: buf.dispatch(x, topk_idx=torch.where(ids == 3, E + 5, ids),
                                    topk_weights=w, **args), "expert id outside"),
        ("ue8m0", lambda: buf.low_latency_dispatch(lx, lids, m, E, use_ue8m0=True),
         "use_ue8m0 needs round_scale=True")))
    again = buf.dispatch(x, topk_idx=ids, topk_weights=w, **args)[0]  # still usable
    results["usable after"] = torch.equal(again, recv)
    small = deep_ep.Buffer(None, 1024)
    try:
        small.dispatch(x, topk_idx=ids, topk_weights=w, **args)
        results["budget"] = "accepted"
    except ValueError as exc:
        results["budget"] = "num_nvl_bytes=1024" in str(exc) or str(exc)
    return results


def _raising(kind, cases) -> list | bool:
    """True if every (name, call, text) case raises `kind` with `text` in its message, else
    what went otherwise."""
    wrong = []
    for name, call, text in cases:
        try:
            call()
            wrong.append(f"{name}: accepted")
        except kind as exc:
            if text not in str(exc):
                wrong.append(f"{name}: {exc}")
    return wrong or True


def test_deepep_face_on_one_rank():
    from cute_ep.tools.spawn import run_ranks

    results = run_ranks(_face, world=1, limit_s=300)[0]
    bad = {k: v for k, v in results.items() if v is not True}
    assert not bad, bad
