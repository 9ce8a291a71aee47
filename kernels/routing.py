"""Which channel owns a token and which ranks and experts it goes to: the rules dispatch and
combine both apply."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.memory import load_i32
from layouts.buffers import ERROR_ID_RANGE, ERROR_ID_TWICE, ID_TOO_WIDE


@cute.jit
def load_id(topk_ids, i, id_words):
    """Id i (flat index into [T, K]) of the ids at address `topk_ids`: int32 words (id_words
    1), or int64 (2) read as their low word when the high word is its sign, else ID_TOO_WIDE
    (out of range, reported), so that no id past int32 aliases a valid one."""
    e = Int32(0)
    if id_words == 1:
        e = load_i32(topk_ids + Int64(i) * 4)
    else:
        low = load_i32(topk_ids + Int64(i) * 8)
        high = load_i32(topk_ids + Int64(i) * 8 + 4)
        e = low
        if high != (low >> 31):
            e = Int32(ID_TOO_WIDE)
    return e


@cute.jit
def token_ids(topk_ids, t, topk, id_words, max_topk: cutlass.Constexpr):
    """Token t's K ids (`load_id`) in registers, -1 (an empty slot) past K <= max_topk: every
    load issued before the first is used."""
    regs = cute.make_rmem_tensor(cute.make_layout(max_topk), Int32)
    for k in cutlass.range_constexpr(max_topk):
        regs[k] = Int32(-1)
        if k < topk:
            regs[k] = load_id(topk_ids, Int64(t) * Int64(topk) + Int64(k), id_words)
    return regs


@cute.jit
def channel_tokens(channel, num_tokens, channels):
    """[t0, t1): the contiguous run of tokens channel `channel` owns, the first
    num_tokens % channels channels one token more (`layouts.channels.channel_tokens`)."""
    per = num_tokens // channels
    extra = num_tokens - per * channels
    t0 = channel * per + extra
    t1 = t0 + per
    if channel < extra:
        t0 = channel * per + channel
        t1 = t0 + per + 1
    return t0, t1


@cute.jit
def valid_expert(ids: cute.Tensor, row, k, stride, experts):
    """1 if (row, slot k) of `ids` (flat, rows `stride` apart: the [T, K] ids in global memory,
    or a copy of some in shared memory) is a valid pair: its id is in [0, experts) and no earlier
    k names the same expert."""
    e = ids[row * stride + k]
    ok = Int32(1)
    if e < 0 or e >= experts:
        ok = Int32(0)
    else:
        for k2 in cutlass.range(k):
            if ids[row * stride + k2] == e:
                ok = Int32(0)
    return ok


@cute.jit
def route_ids(ids: cute.Tensor, row, stride, t, topk, experts, local_experts, my_rank,
              skip_a2a, shared, shared_begin, shared_end, s_cnt: cute.Tensor,
              count: cutlass.Constexpr):
    """(destination-rank bit mask of token t, bad-id bits), its K ids at row `row` of `ids`
    (rows `stride` apart). A (token, k) pair is valid when its id is in [0, experts) and no
    earlier k names the same expert; with skip_a2a only this rank's experts count. A fused
    shared expert adds this rank for its tokens [shared_begin, shared_end). With `count`, each
    valid pair adds one to s_cnt[expert]. An id of -1 is an empty slot: skipped, not reported."""
    mask = Int32(0)
    bad = Int32(0)
    for k in cutlass.range(topk):
        e = ids[row * stride + k]
        if e == -1:
            pass  # an empty slot (DeepEP's convention for a masked pair): nothing to route
        elif e < 0 or e >= experts:
            bad = bad | ERROR_ID_RANGE
        else:
            if valid_expert(ids, row, k, stride, experts) == 0:
                bad = bad | ERROR_ID_TWICE
            else:
                mask = _route_pair(mask, e, local_experts, my_rank, skip_a2a, s_cnt, count)
    return _with_shared(mask, t, my_rank, shared, shared_begin, shared_end), bad


@cute.jit
def _route_pair(mask, e, local_experts, my_rank, skip_a2a, s_cnt: cute.Tensor,
                count: cutlass.Constexpr):
    """`mask` with the rank of valid pair (token, expert e) (with skip_a2a, only if it is this
    rank), and with `count` one more in s_cnt[e] for it (`route_ids`, `route_token`)."""
    d = e // local_experts
    if skip_a2a == 0 or d == my_rank:
        mask = mask | (Int32(1) << d)
        if cutlass.const_expr(count):
            cute.arch.atomic_add(s_cnt.iterator + e, Int32(1))
    return mask


@cute.jit
def _with_shared(mask, t, my_rank, shared, shared_begin, shared_end):
    """`mask` with this rank for token t when a fused shared expert takes it."""
    if shared != 0 and t >= shared_begin and t < shared_end:
        mask = mask | (Int32(1) << my_rank)
    return mask


@cute.jit
def route_token(topk_ids: cute.Pointer, id_words, t, topk, experts, local_experts, my_rank,
                skip_a2a, shared, shared_begin, shared_end, s_cnt: cute.Tensor,
                count: cutlass.Constexpr, max_topk: cutlass.Constexpr):
    """`route_ids` of token t, its ids read from the [T, K] `topk_ids` (int32 or int64 words,
    `load_id`; K <= max_topk): all K loaded into registers first (one round trip), then checked
    there, where reading them from global memory in the checks' loops waited a round trip for
    the first and an L1 hit for each of the K^2 / 2 others."""
    regs = token_ids(topk_ids.toint(), t, topk, id_words, max_topk)
    mask = Int32(0)
    bad = Int32(0)
    for k in cutlass.range_constexpr(max_topk):
        e = regs[k]
        if k < topk and e != -1:  # -1: an empty slot, routed nowhere, not reported
            if e < 0 or e >= experts:
                bad = bad | ERROR_ID_RANGE
            else:
                twice = Int32(0)
                for k2 in cutlass.range_constexpr(k):
                    if regs[k2] == e:
                        twice = Int32(1)
                if twice != 0:
                    bad = bad | ERROR_ID_TWICE
                else:
                    mask = _route_pair(mask, e, local_experts, my_rank, skip_a2a, s_cnt, count)
    return _with_shared(mask, t, my_rank, shared, shared_begin, shared_end), bad
