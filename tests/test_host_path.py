"""The Buffer's host path without a GPU: a Buffer of CPU tensors whose launches are recorded, not
run, so what dispatch and combine pass to their kernels, and what they refuse, is checked on the
CPU (tests/gpu run the same calls on the real kernels). Inputs wrapped as `_OnDevice` pass for
the Buffer's device in the detailed checks, so a bad one gets the message a GPU run gives."""

from types import SimpleNamespace

import pytest
import torch

import cute_ep.ep as ep
from layouts import EPConfig

H, K, E, R, T = 256, 2, 8, 2, 16


class _OnDevice(torch.Tensor):
    """A CPU tensor the checks take for one on the Buffer's device (`_device_index` -1)."""

    is_cuda = True
    __torch_function__ = torch._C._disabled_torch_function_impl


class _Recorder:
    """A bound launch that records its varying arguments by name."""

    def __init__(self, varying, constants):
        self.varying, self.constants, self.calls = varying, constants, []
        self.merged = {}  # constants each record also names (`_one_record`)

    def __call__(self, *values):
        assert len(values) == len(self.varying)
        self.calls.append({**self.merged, **dict(zip(self.varying, values))})


def _one_record(buf) -> None:
    """The one-pass path's launches recorded in the general launch's list, each naming the
    arguments it binds as constants too (pointers by address): a test reads a dispatch's
    launch by the same names whichever path made it."""
    common, general = buf._common_launch, buf._dispatch_launch
    common.calls = general.calls
    common.merged = {name: value.data_ptr() if isinstance(value, torch.Tensor) else value
                     for name, value in common.constants.items() if name in general.varying}


class _Kernel:
    def __init__(self, family, fields):
        vector_bytes = 8 if fields.get("format") == "nvfp4" else 16
        self.spec = SimpleNamespace(sizes={"max_stage_batches": 1 << 20, "max_chunk": 1 << 20,
                                           "vector_bytes": vector_bytes},
                                    config={"groups": 4} if family == "ep_encode" else {})

    def bind(self, varying, **constants):
        return _Recorder(varying, constants)


@pytest.fixture
def cpu_buffer(monkeypatch):
    def make(fmt="bf16", tokens=T, geometry=None, direct_input=False, **cfg):
        monkeypatch.setattr(ep, "runtime", lambda: SimpleNamespace(
            select=lambda family, dev, **fields: _Kernel(family, fields)))
        monkeypatch.setattr(ep, "device_arch", lambda dev: "sm_90a")
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda dev: SimpleNamespace(multi_processor_count=132))
        buf = ep.Buffer.__new__(ep.Buffer)
        buf.group = None
        config = EPConfig(H, K, E, R, tokens, fmt, **cfg)
        if direct_input:
            geometry = ep.ring_geometry(config, True)
        buf._setup(config, 0, torch.device("cpu"), 60.0, 4, geometry)
        # The direct input's views need the peer-visible bytes; otherwise nothing reads them.
        sym_bytes = buf.peer_visible_bytes if direct_input else 16
        buf._attach(torch.zeros(sym_bytes, dtype=torch.uint8), [0] * R)
        buf._device_index = -1  # what get_device() says of a CPU tensor
        _one_record(buf)
        return buf
    return make


def _inputs(t=T):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, E, generator=gen).argsort(1)[:, :K].int()
    return x, ids, torch.rand(t, K, generator=gen)


def _quantized(fmt):
    """A pre-quantized input of T tokens for an fp8 or nvfp4 Buffer: (codes, scales)."""
    if fmt == "fp8":
        return torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.ones(T, H // 128)
    return torch.zeros(T, H // 2, dtype=torch.uint8), torch.zeros(T, H // 16, dtype=torch.uint8)


def test_dispatch_and_combine_pass_their_tensors_addresses(cpu_buffer):
    buf = cpu_buffer()
    for t in (T, 5, 0, T):  # a new token count: new outputs, new arguments
        x, ids, w = _inputs(t)
        out = buf.dispatch(x, ids, w)
        d = buf._dispatch_launch.calls[-1]
        h = out.handle
        assert (d["source"], d["topk_ids"], d["topk_weights"]) == (
            x.data_ptr(), ids.data_ptr(), w.data_ptr())
        assert (d["num_tokens"], d["has_weights"], d["source_stride"]) == (t, 1, 2 * H)
        assert d["id_words"] == 1  # int32 ids
        for name, tensor in [("tokens", out.tokens), ("row_offsets", out.row_offsets),
                             ("expert_ids", out.expert_ids), ("seg_counts", out.counts),
                             ("src_info", out.src_info), ("comb_rows", h.rows),
                             ("comb_weights", h.weights), ("comb_tokens", h.tokens),
                             ("comb_counts", h.messages), ("chan_msgs", h.channels),
                             ("scales", buf._no_f32), ("scales_offsets", buf._no_i32),
                             ("trace", buf._no_i64)]:
            assert d[name] == tensor.data_ptr(), name
        assert out.scales is None and out.scales_offsets is None
        y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
        combined = buf.combine(y, h)
        c = buf._combine_launch.calls[-1]
        assert combined.shape == (t, H) and combined.dtype == torch.bfloat16
        assert (c["y"], c["out"], c["comb_rows"], c["comb_weights"], c["chan_msgs"]) == (
            y.data_ptr(), combined.data_ptr(), h.rows.data_ptr(), h.weights.data_ptr(),
            h.channels.data_ptr())
        assert (c["num_tokens"], c["weighted"], c["active"]) == (t, ep.AT_EXPERTS, d["active"])
        assert (c["topk_ids"], c["id_words"]) == (ids.data_ptr(), 1)


def test_combine_reads_a_handle_field_put_in_place_of_its_carved_one(cpu_buffer):
    """A handle whose rows, weights or channels were replaced by another tensor (autograd's
    dispatch backward combines with unit weights through a copy of the forward handle)
    passes that tensor to the combine, the other two still from the carved allocation."""
    from cute_ep.autograd import _handle_with

    buf = cpu_buffer()
    x, ids, w = _inputs()
    h = buf.dispatch(x, ids, w).handle
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    carved = {"comb_rows": h.rows.data_ptr(), "comb_weights": h.weights.data_ptr(),
              "chan_msgs": h.channels.data_ptr()}
    for name, arg in [("rows", "comb_rows"), ("weights", "comb_weights"),
                      ("channels", "chan_msgs")]:
        fresh = h.__dict__[name].clone()
        buf.combine(y, _handle_with(h, **{name: fresh}))
        got = {k: buf._combine_launch.calls[-1][k] for k in carved}
        assert got == {**carved, arg: fresh.data_ptr()}, name
        assert fresh.data_ptr() != carved[arg]
    # A handle none of whose three fields was read takes the carve's offsets: the same.
    h2 = buf.dispatch(x, ids, w).handle
    buf.combine(y, h2)
    got = [buf._combine_launch.calls[-1][k] for k in carved]
    assert got == [h2.rows.data_ptr(), h2.weights.data_ptr(), h2.channels.data_ptr()]


def test_an_unweighted_dispatch_combines_unreduced_or_weighted_at_home(cpu_buffer):
    buf = cpu_buffer()
    x, ids, w = _inputs()
    ids = ids.long().as_subclass(_OnDevice)  # the detailed checks
    out = buf.dispatch(x.as_subclass(_OnDevice), ids)
    d = buf._dispatch_launch.calls[-1]
    assert d["topk_weights"] == buf._no_f32.data_ptr() and d["has_weights"] == 0
    # int64 ids go to the kernels as they are, read as word pairs: no conversion launched.
    assert d["topk_ids"] == out.handle.routing.topk_ids.data_ptr() == ids.data_ptr()
    assert d["id_words"] == 2
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    assert buf.combine(y, out.handle).shape == (T, K, H)
    assert buf._combine_launch.calls[-1]["weighted"] == ep.UNREDUCED
    home = buf.combine(y, out.handle, topk_weights=w.as_subclass(_OnDevice))
    c = buf._combine_launch.calls[-1]
    assert (c["topk_ids"], c["id_words"]) == (ids.data_ptr(), 2)
    assert home.shape == (T, H) and (c["weighted"], c["home_weights"]) == (ep.AT_HOME,
                                                                           w.data_ptr())


def test_handle_of_keeps_int64_ids_and_refuses_other_dtypes(cpu_buffer):
    """The kernels read int32 or int64 ids: handle_of (the combine operator's handle) keeps
    int64 ids as they are, never narrowed to int32 (which would wrap an id past its range onto
    a valid one), and refuses any other dtype."""
    buf = cpu_buffer()
    x, ids, w = _inputs()
    wide = ids.long()
    out = buf.dispatch(x, wide, w)
    h = out.handle
    rebuilt = buf.handle_of(wide, h.rows, h.weights, h.channels, True, False, h.routing.channels)
    assert rebuilt.routing.topk_ids is wide
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    buf.combine(y, rebuilt)
    c = buf._combine_launch.calls[-1]
    assert (c["topk_ids"], c["id_words"]) == (wide.data_ptr(), 2)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64, got torch.float32"):
        buf.handle_of(wide.float(), h.rows, h.weights, h.channels, True, False,
                      h.routing.channels)


def test_bad_input_is_refused_after_good_input(cpu_buffer):
    """The same errors as on a GPU (tests/gpu/test_ep_inputs.py), before and after good calls:
    nothing of a good call lets a bad one through, and a refused call launches nothing."""
    buf = cpu_buffer()
    x, ids, w = _inputs()
    on = lambda t: t.as_subclass(_OnDevice)  # noqa: E731
    bad = {
        "must be torch.bfloat16": lambda: buf.dispatch(on(x.float()), ids, w),
        f"must be bf16 [T, {H}]": lambda: buf.dispatch(on(x[:, :H // 2].contiguous()), ids, w),
        f"exceeds max_tokens_per_rank={T}": lambda: buf.dispatch(
            on(torch.cat([x, x])), torch.cat([ids, ids]), w),
        f"topk_ids must be int32/int64 [{T}, {K}]": lambda: buf.dispatch(
            on(x), on(ids[:, :1].contiguous()), w),
        "topk_ids must be int32/int64": lambda: buf.dispatch(on(x), on(ids.float()), w),
        "must be torch.float32": lambda: buf.dispatch(on(x), on(ids), on(w.half())),
        "must be a CUDA tensor": lambda: buf.dispatch(x.float(), ids, w),
        "must be contiguous": lambda: buf.dispatch(on(x.t().contiguous().t()), ids, w),
        "16-byte aligned": lambda: buf.dispatch(
            on(x.flatten()[1:1 + (T - 1) * H].view(T - 1, H)), ids[1:].contiguous(), w[1:]),
        "global_scale is for nvfp4": lambda: buf.dispatch(x, ids, w,
                                                          global_scale=torch.ones(1)),
        "is below this rank's": lambda: buf.dispatch(x, ids, w, num_input_tokens=T - 1),
    }
    for _ in range(2):
        out = buf.dispatch(x, ids, w)
        launched = len(buf._dispatch_launch.calls)
        for words, call in bad.items():
            with pytest.raises((TypeError, ValueError), match=words.replace("[", r"\[")):
                call()
        assert len(buf._dispatch_launch.calls) == launched
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="row_capacity"):
        buf.combine(on(y[:4]), out.handle)
    with pytest.raises(ValueError, match="already weighted"):
        buf.combine(y, out.handle, topk_weights=w)
    assert buf.combine(y, out.handle).shape == (T, H)
    with pytest.raises(ValueError, match="row_capacity"):
        buf.combine(on(y[:4]), out.handle)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_quantized_layer_encodes_bf16_input_in_the_dispatch_or_first(cpu_buffer, fmt):
    """Given bf16 tokens, a few a channel (at most FUSED_ENCODE_TOKENS) are quantized by the one
    dispatch launch itself (`encode` 1, x and the global scale passed); more are quantized by
    `ep_encode` first, on the SM budget, and the dispatch launch quantizes nothing. Either way
    the senders stream the messages from the send buffer."""
    buf = cpu_buffer(fmt, tokens=512)  # 4 channels (sms 4): fused up to 64 tokens
    active = buf._active_for(None)
    assert active == 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, H, generator=gen).to(torch.bfloat16)
    ids = torch.rand(512, E, generator=gen).argsort(1)[:, :K].int()
    w = torch.rand(512, K, generator=gen)
    gs = torch.full((1,), 100.0) if fmt == "nvfp4" else None
    gs_at = (gs if gs is not None else buf._no_f32).data_ptr()
    if fmt == "nvfp4":
        with pytest.raises(ValueError, match="needs global_scale"):
            buf.dispatch(x[:T], ids[:T], w[:T])
    send, msg = buf.send_buf.data_ptr(), buf.msg
    fused = ep.FUSED_ENCODE_TOKENS * active
    for t, encoder in ((T, False), (fused, False), (fused + 1, True), (512, True), (5, False)):
        encodes, launches = len(buf._encode_launch.calls), len(buf._dispatch_launch.calls)
        out = buf.dispatch(x[:t], ids[:t], w[:t], global_scale=gs)
        assert len(buf._dispatch_launch.calls) == launches + 1
        assert len(buf._encode_launch.calls) == encodes + encoder, t
        d = buf._dispatch_launch.calls[-1]
        if encoder:
            e = buf._encode_launch.calls[-1]
            assert (e["x"], e["num_tokens"], e["global_scale"]) == (x.data_ptr(), t, gs_at)
            # The encoder keeps the SM budget (4 here): a CTA an SM, 4 tokens a CTA at once.
            assert e["ctas"] == min(buf.sms, -(-t // 4))
            assert (d["encode"], d["x"]) == (0, buf._no_bf16.data_ptr())
        else:
            assert (d["encode"], d["x"], d["global_scale"]) == (1, x.data_ptr(), gs_at)
        assert d["num_tokens"] == t
        assert (d["source"], d["source_stride"]) == (send, msg.size)
        assert d["scales"] == out.scales.data_ptr()
        if fmt == "fp8":
            assert (d["scale_source"], d["load_bytes"]) == (send + buf.scales_at, H)
            assert d["scales_offsets"] == buf._no_i32.data_ptr() and out.scales_offsets is None
        else:
            assert (d["scale_source"], d["scale_stride"]) == (buf._no_f32.data_ptr(), 0)
            assert d["load_bytes"] == msg.staged_bytes
            assert d["scales_offsets"] == out.scales_offsets.data_ptr()


def test_a_receive_capacity_sizes_the_outputs_bounds_both_kernels_and_names_an_overflow(
        cpu_buffer, monkeypatch):
    worst = cpu_buffer().cfg.row_capacity
    buf = cpu_buffer(recv_capacity=7)
    assert buf.cfg.row_capacity == 7 < worst
    x, ids, w = _inputs()
    out = buf.dispatch(x, ids, w)
    assert out.tokens.shape == (7, H) and out.src_info.shape == (7, 2)
    # Both kernels know where the output ends: dispatch writes no row past it, combine reads
    # none (zeros instead).
    assert buf._dispatch_launch.constants["row_capacity"] == 7
    assert buf._combine_launch.constants["row_capacity"] == 7
    # An overflow the kernel recorded is raised by check(), once, naming the option.
    monkeypatch.setattr(ep, "_wait_interruptibly", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    buf.error = torch.tensor([0, 0, 0, ep.ERROR_CAPACITY], dtype=torch.int32)
    with pytest.raises(ValueError, match="recv_capacity=7, row_capacity=7 .* Raise "
                                         "recv_capacity"):
        buf.check()
    buf.check()  # reported once


def test_dispatch_send_launches_the_send_part_and_its_hook_the_receive_part(cpu_buffer):
    from layouts.channels import DISPATCH_RECEIVE, DISPATCH_SEND

    buf = cpu_buffer()
    x, ids, w = _inputs()
    buf.dispatch(x, ids, w)
    assert buf._dispatch_launch.calls[-1]["phases"] == DISPATCH_SEND | DISPATCH_RECEIVE
    out, hook = buf.dispatch_send(x, ids, w)
    send = buf._dispatch_launch.calls[-1]
    assert send["phases"] == DISPATCH_SEND and send["tokens"] == out.tokens.data_ptr()
    # Until the hook runs, the Buffer refuses the next dispatch and combine (they would wait for
    # a receive that never comes).
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    for call in (lambda: buf.dispatch(x, ids, w), lambda: buf.dispatch_send(x, ids, w),
                 lambda: buf.combine(y, out.handle)):
        with pytest.raises(RuntimeError, match="receive hook has not run"):
            call()
    launched = len(buf._dispatch_launch.calls)
    hook()
    receive = buf._dispatch_launch.calls[-1]
    assert len(buf._dispatch_launch.calls) == launched + 1
    assert receive == dict(send, phases=DISPATCH_RECEIVE)  # the same arguments otherwise
    with pytest.raises(RuntimeError, match="already ran"):
        hook()
    assert buf.combine(y, out.handle).shape == (T, H)


def test_a_dispatch_of_a_decode_steps_size_sends_prefixed_counts(cpu_buffer):
    """A dispatch bounded by at most PREFIXED_TOKENS tokens a rank (num_input_tokens, else
    max_tokens_per_rank) sends prefixed counts, whatever its own token count (every rank passes
    the same bound); a larger bound, summed counts. A dispatch_send's two launches agree."""
    from layouts.channels import PREFIXED_TOKENS

    x, ids, w = _inputs()
    small = cpu_buffer()
    for t in (T, 5):
        small.dispatch(x[:t], ids[:t], w[:t])
        assert small._dispatch_launch.calls[-1]["prefixed"] == 1
    big = cpu_buffer(tokens=PREFIXED_TOKENS + 1)
    for bound, prefixed in ((None, 0), (PREFIXED_TOKENS, 1), (PREFIXED_TOKENS + 1, 0), (T, 1)):
        big.dispatch(x, ids, w, num_input_tokens=bound)
        assert big._dispatch_launch.calls[-1]["prefixed"] == prefixed, bound
    for bound, prefixed in ((T, 1), (None, 0)):
        out, hook = big.dispatch_send(x, ids, w, num_input_tokens=bound)
        hook()
        send, receive = big._dispatch_launch.calls[-2:]
        assert send["prefixed"] == receive["prefixed"] == prefixed, bound


def test_a_larger_dispatch_over_many_channels_sends_block_prefixed_counts(cpu_buffer,
                                                                          monkeypatch):
    """Past PREFIXED_TOKENS tokens a rank, a dispatch over at least BLOCK_PREFIX_CHANNELS
    channels sends block-prefixed counts (2), over fewer its channels' own (0); a decode step's
    bound, prefixed ones (1), whatever the channels. The threshold is read at the dispatch's
    first call with a bound, so lowering it to this Buffer's 4 channels shows the kind."""
    import layouts.channels as channels

    x, ids, w = _inputs()
    assert channels.BLOCK_PREFIX_CHANNELS > 4
    buf = cpu_buffer(tokens=channels.PREFIXED_TOKENS + 1)
    buf.dispatch(x, ids, w)
    assert buf._dispatch_launch.calls[-1]["prefixed"] == channels.PREFIX_NONE
    monkeypatch.setattr(channels, "BLOCK_PREFIX_CHANNELS", 4)
    low = cpu_buffer(tokens=channels.PREFIXED_TOKENS + 1)
    for bound, kind in ((None, channels.PREFIX_BLOCKS), (T, channels.PREFIX_ALL)):
        low.dispatch(x, ids, w, num_input_tokens=bound)
        assert low._dispatch_launch.calls[-1]["prefixed"] == kind, bound
    assert channels.prefixed_counts(4096, None, 3) == channels.PREFIX_NONE


def test_dispatch_send_refuses_more_tokens_than_the_staging_holds(cpu_buffer):
    """4 channels of one staged batch (16 tokens) hold 64 tokens: 65 would make a sender wait
    for credit that only the receive launch gives."""
    buf = cpu_buffer(tokens=80, geometry={"stage_batches": 1})
    x, ids, w = _inputs(64)
    out, hook = buf.dispatch_send(x, ids, w)
    hook()
    x, ids, w = _inputs(65)
    launched = len(buf._dispatch_launch.calls)
    with pytest.raises(ValueError, match="65 tokens over 4 channels need 2 batches a channel, "
                                         "the staging holds 1"):
        buf.dispatch_send(x, ids, w)
    assert len(buf._dispatch_launch.calls) == launched
    buf.dispatch(x, ids, w)  # one launch: receivers free the staging as it fills


def test_a_sources_layout_dispatch_passes_its_rows_ids_and_weights(cpu_buffer):
    buf = cpu_buffer(layout="sources")
    assert buf._dispatch_launch.constants["segment_rows"] == -1
    x, ids, w = _inputs()
    out = buf.dispatch(x, ids, w)
    d = buf._dispatch_launch.calls[-1]
    assert out.recv_topk_ids.shape == (R * T, K) and out.recv_topk_ids.dtype == torch.int32
    assert out.recv_topk_weights.shape == (R * T, K)
    assert (d["recv_ids"], d["recv_weights"]) == (out.recv_topk_ids.data_ptr(),
                                                  out.recv_topk_weights.data_ptr())
    # Its combine adds each row once, whether the dispatch carried weights or not.
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    for weights in (w, None):
        buf.combine(y, buf.dispatch(x, ids, weights).handle)
        assert buf._combine_launch.calls[-1]["weighted"] == ep.AT_EXPERTS
    with pytest.raises(ValueError, match="adds each received row once"):
        buf.combine(y, buf.dispatch(x, ids).handle, topk_weights=w)
    packed = cpu_buffer()
    out = packed.dispatch(x, ids, w)
    assert out.recv_topk_ids is None and out.recv_topk_weights is None
    assert packed._dispatch_launch.constants["segment_rows"] == 0
    d = packed._dispatch_launch.calls[-1]
    assert (d["recv_ids"], d["recv_weights"]) == (packed._no_i32.data_ptr(),
                                                  packed._no_f32.data_ptr())


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_pre_quantized_input_takes_the_quick_checks_and_a_bad_one_the_detailed(
        cpu_buffer, monkeypatch, fmt):
    """Good (codes, scales) with int32 ids pass the one-expression checks (no check_tensor call,
    as for bf16 x); anything else takes the detailed checks and is refused with their message,
    launching nothing, before and after good calls."""
    buf = cpu_buffer(fmt)
    _, ids, w = _inputs()
    codes, scales = _quantized(fmt)
    detailed = []
    check = ep.check_tensor

    def counted(t, **kw):
        detailed.append(kw["name"])
        return check(t, **kw)

    monkeypatch.setattr(ep, "check_tensor", counted)
    on = lambda t: t.as_subclass(_OnDevice)  # noqa: E731
    bad = {
        "x scales must be": lambda: buf.dispatch((on(codes), on(scales[:, :-1].contiguous())),
                                                 on(ids), on(w)),
        "x codes must be": lambda: buf.dispatch((on(codes[:, :-16].contiguous()), on(scales)),
                                                on(ids), on(w)),
        "x codes must be torch": lambda: buf.dispatch((on(codes.view(torch.int8)), on(scales)),
                                                      on(ids), on(w)),
        f"exceeds max_tokens_per_rank={T}": lambda: buf.dispatch(
            (on(torch.cat([codes, codes])), on(torch.cat([scales, scales]))),
            on(torch.cat([ids, ids])), on(torch.cat([w, w]))),
        "topk_ids must be int32/int64": lambda: buf.dispatch((on(codes), on(scales)),
                                                             on(ids.float()), on(w)),
        "must be torch.float32": lambda: buf.dispatch((on(codes), on(scales)), on(ids),
                                                      on(w.half())),
        "must be a CUDA tensor": lambda: buf.dispatch((codes.t().contiguous().t(), scales),
                                                      ids, w),
    }
    for _ in range(2):
        detailed.clear()
        buf.dispatch((codes, scales), ids, w)
        assert detailed == []
        d = buf._dispatch_launch.calls[-1]
        assert (d["source"], d["scale_source"]) == (codes.data_ptr(), scales.data_ptr())
        assert (d["source_stride"], d["scale_stride"]) == (
            codes.shape[1] * codes.element_size(), scales.shape[1] * scales.element_size())
        launched = len(buf._dispatch_launch.calls)
        for words, call in bad.items():
            with pytest.raises((TypeError, ValueError), match=words.replace("[", r"\[")):
                call()
        assert detailed and len(buf._dispatch_launch.calls) == launched
    # int64 ids are good input too: the detailed checks pass them, the launch narrows them.
    buf.dispatch((on(codes), on(scales)), on(ids.long()), on(w))
    assert len(buf._dispatch_launch.calls) == launched + 1


@pytest.mark.parametrize("fmt,layout", [("bf16", "packed"), ("fp8", "packed"),
                                        ("nvfp4", "packed"), ("fp8", "sources")])
def test_the_kernels_pointers_name_each_output_part_carved_or_separate(cpu_buffer, fmt, layout):
    """Both output forms, one allocation carved (`dispatch`) and a part an allocation
    (`dispatch_for_operator`, the custom operator's): the dispatch kernel's pointer arguments
    are each part's address, a placeholder's where the config has no such part."""
    buf = cpu_buffer(fmt, **({"layout": "sources"} if layout == "sources" else {}))
    x, ids, w = _inputs()
    gs = {"global_scale": torch.full((1,), 100.0)} if fmt == "nvfp4" else {}
    holder = {"recv_ids": "recv_topk_ids", "recv_weights": "recv_topk_weights",
              "seg_counts": "counts", "comb_rows": "rows", "comb_weights": "weights",
              "comb_tokens": "tokens", "comb_counts": "messages", "chan_msgs": "channels"}
    placeholder = {"scales": buf._no_f32, "scales_offsets": buf._no_i32,
                   "recv_ids": buf._no_i32, "recv_weights": buf._no_f32}
    for call in (lambda: buf.dispatch(x, ids, w, **gs),
                 lambda: buf.dispatch_for_operator(x, ids, w, False, None,
                                                   gs.get("global_scale"))):
        out = call()
        d = buf._dispatch_launch.calls[-1]
        for arg in ("scales", "scales_offsets", "row_offsets", "expert_ids", "seg_counts",
                    "src_info", "comb_rows", "comb_weights", "comb_tokens", "comb_counts",
                    "chan_msgs", "recv_ids", "recv_weights"):
            name = holder.get(arg, arg)
            on_handle = name in ("rows", "weights", "tokens", "messages", "channels")
            part = getattr(out.handle if on_handle else out, name)
            want = part.data_ptr() if part is not None else placeholder[arg].data_ptr()
            assert d[arg] == want, (arg, fmt, layout)
        assert d["tokens"] == out.tokens.data_ptr()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_each_dispatch_output_owns_its_fields(cpu_buffer, fmt):
    """A carved output starts from the Buffer's planned fields (the format's absent ones None)
    but in a dict of its own: a view made on one output's first read is that output's, never
    the next dispatch's nor the plan's."""
    buf = cpu_buffer(fmt)
    x, ids, w = _inputs()
    gs = {"global_scale": torch.ones(1)} if fmt == "nvfp4" else {}
    planned = dict(buf._output_fields)
    first = buf.dispatch(x, ids, w, **gs)
    info, offsets = first.src_info, first.row_offsets  # views made now, kept in first's dict
    second = buf.dispatch(x, ids, w, **gs)
    assert buf._output_fields == planned and "src_info" not in second.__dict__
    assert second.src_info.data_ptr() != info.data_ptr()
    assert second.row_offsets.data_ptr() != offsets.data_ptr()
    assert second.handle is not first.handle and second.handle.routing.num_tokens == T
    assert (first.scales is None) == (second.scales is None) == (fmt == "bf16")
    assert (first.scales_offsets is None) == (fmt != "nvfp4")
    assert first.recv_topk_ids is None and second.recv_topk_weights is None
    separate = buf.dispatch_for_operator(x, ids, w, False, None, gs.get("global_scale"))
    assert separate.__dict__["_flat"] is None and separate.handle.__dict__["_carve"] is None


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_pre_quantized_input_passes_its_row_bytes_by_either_check(cpu_buffer, fmt):
    """The row bytes of codes and scales, planned once per Buffer, are those of the input's
    own shapes, whether the quick checks passed it or the detailed ones (int64 ids)."""
    buf = cpu_buffer(fmt)
    _, ids, w = _inputs()
    codes, scales = _quantized(fmt)
    on = lambda t: t.as_subclass(_OnDevice)  # noqa: E731
    for call in (lambda: buf.dispatch((codes, scales), ids, w),
                 lambda: buf.dispatch((on(codes), on(scales)), on(ids.long()), on(w))):
        call()
        d = buf._dispatch_launch.calls[-1]
        assert (d["source"], d["scale_source"]) == (codes.data_ptr(), scales.data_ptr())
        assert (d["source_stride"], d["load_bytes"], d["scale_stride"]) == (
            codes.stride(0) * codes.element_size(), codes.stride(0) * codes.element_size(),
            scales.stride(0) * scales.element_size())


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_direct_input_is_pulled_in_place_and_anything_else_staged(cpu_buffer, fmt):
    """A dispatch of the direct input's first rows passes its views' addresses and message
    strides with `direct` set; the same rows copied elsewhere are staged from their own
    addresses and strides; the input's rows from the second on (another address, message
    strides) are no direct input and, not contiguous, are refused."""
    buf = cpu_buffer(fmt, direct_input=True)
    _, ids, w = _inputs()
    codes, scales = buf.input_buffer()
    msg = buf.msg.staged_bytes
    assert codes.stride(0) * codes.element_size() == msg
    for (c, s), direct in [((codes[:T], scales[:T]), 1),
                           ((codes[:T].clone(), scales[:T].clone()), 0)]:
        buf.dispatch((c, s), ids, w)
        d = buf._dispatch_launch.calls[-1]
        assert (d["source"], d["scale_source"], d["direct"]) == (
            c.data_ptr(), s.data_ptr(), direct)
        assert (d["source_stride"], d["scale_stride"]) == (
            c.stride(0) * c.element_size(), s.stride(0) * s.element_size())
    assert buf._dispatch_launch.calls[0]["source_stride"] == msg
    on = lambda t: t.as_subclass(_OnDevice)  # noqa: E731
    with pytest.raises(ValueError, match="contiguous"):
        buf.dispatch((on(codes[1:T + 1]), on(scales[1:T + 1])), ids, w)
    assert len(buf._dispatch_launch.calls) == 2


def test_a_bf16_layers_direct_input_refuses_a_pair_by_name(cpu_buffer):
    """A (codes, scales) pair given to a bf16 layer with a direct input gets the detailed
    check's words, not an unpacking error of the direct input's comparison."""
    buf = cpu_buffer("bf16", direct_input=True)
    x, ids, w = _inputs()
    assert buf.input_buffer().shape == (T, H)
    with pytest.raises(TypeError, match="only for an fp8 or nvfp4 Buffer"):
        buf.dispatch((x, x[:, :2]), ids, w)
    buf.dispatch(buf.input_buffer()[:T], ids, w)
    assert buf._dispatch_launch.calls[-1]["direct"] == 1


def test_combine_refuses_a_handle_of_another_configuration(cpu_buffer):
    """Combine reads a handle's tensors at its Buffer's sizes: a handle of a Buffer with another
    configuration (here twice the tokens) is refused by name, not read out of bounds; one of
    another Buffer with the same configuration, or rebuilt by `handle_of`, is taken."""
    buf, same, wider = cpu_buffer(), cpu_buffer(), cpu_buffer(tokens=2 * T)
    x, ids, w = _inputs()
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    theirs = wider.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="not of a dispatch with this Buffer's configuration"):
        buf.combine(y, theirs.handle)
    with pytest.raises(TypeError, match="DispatchHandle"):
        buf.combine(y, theirs)
    assert buf.combine(y, same.dispatch(x, ids, w).handle).shape == (T, H)
    h = buf.dispatch(x, ids, w).handle
    rebuilt = buf.handle_of(ids, h.rows, h.weights, h.channels, True, False, h.routing.channels)
    assert buf.combine(y, rebuilt).shape == (T, H)


def test_a_buffer_over_several_nodes_points_to_the_node_buffer():
    """A config whose ranks span nodes (`gpus_per_node` below `ranks`) is refused by Buffer
    before any memory is mapped, naming NodeBuffer; one node (or no `gpus_per_node`) passes."""
    from cute_ep.ep import _check_config
    from layouts import EPConfig

    with pytest.raises(NotImplementedError, match="2 nodes; a Buffer serves the ranks of one "
                                                  "host: use cute_ep.NodeBuffer"):
        _check_config(EPConfig(4096, 2, 8, 2, 64, gpus_per_node=1), 2)
    for g in (None, 2):
        _check_config(EPConfig(4096, 2, 8, 2, 64, gpus_per_node=g), 2)


def test_the_rings_depths_a_buffer_asks_for_reach_its_kernels_and_bad_ones_are_refused(
        cpu_buffer):
    """`Buffer(stage_batches=, ring_chunks=)` (`ep.ring_geometry`): given depths shape the
    peer-visible rings and are bound into the dispatch and combine kernels; None keeps the
    defaults; anything but a positive int is refused, naming the setting."""
    cfg = EPConfig(H, K, E, R, T, "bf16")
    assert ep.ring_geometry(cfg) is None
    assert ep.ring_geometry(cfg, True) == {"input_rows": T}
    assert ep.ring_geometry(cfg, False, 16, 8) == {"stage_batches": 16, "ring_chunks": 8}
    for bad in (0, -1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="stage_batches must be None or a positive int"):
            ep.ring_geometry(cfg, stage_batches=bad)
        with pytest.raises(ValueError, match="ring_chunks must be None or a positive int"):
            ep.ring_geometry(cfg, ring_chunks=bad)
    default = cpu_buffer()
    deep = cpu_buffer(geometry=ep.ring_geometry(cfg, False, 16, 8))
    assert (deep.geo.stage_batches, deep.geo.ring_chunks) == (16, 8)
    assert deep._dispatch_launch.constants["stage_batches"] == 16
    assert deep._combine_launch.constants["ring_slots"] == 8 * deep.geo.chunk_tokens
    assert default._dispatch_launch.constants["stage_batches"] == default.geo.stage_batches < 16
    assert default._combine_launch.constants["ring_slots"] < 8 * default.geo.chunk_tokens
    assert deep.peer_visible_bytes > default.peer_visible_bytes


def test_prefill_sized_dispatch_and_combine_launch_the_spare_ctas_decode_sized_do_not(cpu_buffer):
    """Past FUSED_ENCODE_TOKENS tokens a channel, a dispatch and its combine both launch the
    Buffer's spare CTAs beside their channels (which place the channels one per TPC:
    `kernels/placement.py`); at or below it, one CTA a channel."""
    buf = cpu_buffer(tokens=512)  # 4 channels (sms 4), 2 spare CTAs
    active = buf._active_for(None)
    assert (active, buf.spare_ctas) == (4, 2)
    x, ids, w = _inputs(512)
    y = torch.zeros(buf.cfg.row_capacity, H, dtype=torch.bfloat16)
    fused = ep.FUSED_ENCODE_TOKENS * active
    for t, launched in ((5, active), (fused, active), (fused + 1, active + 2), (512, active + 2)):
        out = buf.dispatch(x[:t], ids[:t], w[:t])
        buf.combine(y, out.handle)
        d, c = buf._dispatch_launch.calls[-1], buf._combine_launch.calls[-1]
        assert (d["active"], d["launched"]) == (active, launched), t
        assert (c["active"], c["launched"]) == (active, launched), t


def _normalized(call: dict, out) -> dict:
    """A recorded dispatch launch with the addresses inside this call's fresh outputs as
    (part, offset): two calls' launches compare equal where they differ only in allocations."""
    tokens, flat = out.tokens, out.__dict__["_flat"]
    spans = [("tokens", tokens.data_ptr(), tokens.numel() * tokens.element_size()),
             ("flat", flat.data_ptr(), flat.nbytes())]
    fixed = {}
    for name, value in call.items():
        for part, at, size in spans:
            if at <= value < at + size:
                value = (part, value - at)
                break
        fixed[name] = value
    return fixed


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("direct_input", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_the_common_dispatch_launches_what_the_checked_path_launches(cpu_buffer, fmt,
                                                                     direct_input, shared):
    """`dispatch`'s one-pass path for a layer's common call takes every input it is meant for
    (plain tensors, the direct input's rows, copies of them; int32 and int64 ids; weighted or
    not; bounded or not; decode- and prefill-sized) and launches the same arguments with the
    same outputs as the checked path given the same call."""
    buf = cpu_buffer(fmt, direct_input=direct_input, fused_shared_expert=shared)
    for t in (T, 5, 1, 0):
        x, ids, w = _inputs(t)
        if fmt != "bf16":
            codes, scales = _quantized(fmt)
            x = (codes[:t], scales[:t])
        inputs = [x]
        if direct_input:
            view = buf.input_buffer()
            view = view[:t] if fmt == "bf16" else (view[0][:t], view[1][:t])
            inputs.append(view)
        for x, ids, w, bound in [(x, i, wt, b) for x in inputs for i in (ids, ids.long())
                                 for wt in ((w, None) if not shared else (w,))
                                 for b in (None, t, 2 * T)]:
            common = buf._common_dispatch(x, ids, w, bound)
            assert common is not None, (t, bound, w is None)
            first = _normalized(buf._dispatch_launch.calls[-1], common)
            checked = buf._checked_dispatch(x, ids, w, False, bound, None)
            second = _normalized(buf._dispatch_launch.calls[-1], checked)
            assert first == second, {k: (first[k], second[k]) for k in first
                                     if first[k] != second[k]}
            assert common.handle.routing == checked.handle.routing
            assert common.__dict__.keys() == checked.__dict__.keys()
            assert (common.tokens.shape, common.tokens.dtype) == (checked.tokens.shape,
                                                                  checked.tokens.dtype)
    assert buf.calls[0] == len(buf._dispatch_launch.calls)


def test_the_common_dispatch_leaves_other_calls_to_the_checked_path(cpu_buffer):
    """Calls the one-pass path is not for return None from it, launching nothing: a bf16 x of
    an FP8 layer (quantized first), a sources layout, a trace on, a receive hook pending, a
    token count over the bound, and bad input (the checked path says what is wrong)."""
    buf = cpu_buffer("fp8")
    x, ids, w = _inputs()
    codes, scales = _quantized("fp8")
    before = len(buf._dispatch_launch.calls)
    assert buf._common_dispatch(x, ids, w, None) is None
    assert buf._common_dispatch((codes, scales), ids, w, T - 1) is None
    assert buf._common_dispatch((codes, scales.half()), ids, w, None) is None
    assert buf._common_dispatch((codes, scales), ids[:, :1].contiguous(), w, None) is None
    assert buf._common_dispatch((codes, scales), ids, w.double(), None) is None
    buf.trace = torch.zeros(4, dtype=torch.int64)
    assert buf._common_dispatch((codes, scales), ids, w, None) is None
    buf.trace = None
    buf._receive_pending = ((), (), 0, 0)
    assert buf._common_dispatch((codes, scales), ids, w, None) is None
    buf._receive_pending = None
    assert len(buf._dispatch_launch.calls) == before
    assert buf._common_dispatch((codes, scales), ids, w, None) is not None
    sources = cpu_buffer("bf16", layout="sources")
    assert sources._common_dispatch(x, ids, w, None) is None
