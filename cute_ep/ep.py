"""Intranode expert parallelism over NVLink: one `Buffer` per EP group.

One process per GPU under `torch.distributed`. A `Buffer` allocates the peer-visible buffers of
both buffer groups once from torch symmetric memory (sized by `layouts`), checks that every rank
asked for the same configuration, and launches the kernels of `kernels/ep.py` on the current
stream:

    buf = Buffer(EPConfig(hidden=7168, topk=8, experts=256, ranks=4, max_tokens_per_rank=4096))
    out = buf.dispatch(x, topk_ids, topk_weights)       # expert-grouped rows + handle
    y = experts(out.tokens[: ...], out.row_offsets)       # grouped GEMM, rows in dispatch order
    combined = buf.combine(y, out.handle)                # [T, H] bf16
    buf.check()                                          # raises a timeout or bad input

Nothing synchronises with the host, so a whole layer can be captured in a CUDA graph. Errors
found on the device (a rank that did not arrive within `timeout_s`, an expert id out of range)
are latched in a device flag and raised by `check()`; the outputs of such a call are empty or
partial, never out of bounds. A Buffer that timed out must be recreated.

What crosses NVLink per token: one message per destination rank that hosts at least one of its
experts (payload + 16-byte-aligned metadata: source index, K ids, K weights, K positions), not
one per expert; the receiver expands it into expert rows. Combine returns one bf16 row per
(token, destination rank): the rank's weighted partial sum over its local experts.

Formats (`EPConfig.format`): "bf16", "fp8" (DeepSeek blockwise) and "nvfp4". An NVFP4 dispatch
quantizes each token once on the sender under a global scale `gs` (fp32 tensor of one element,
read on the device, so a CUDA graph picks up a new value written into it):

    out = buf.dispatch(x, topk_ids, topk_weights, global_scale=gs)
    # out.tokens: uint8 [rows, H / 2] e2m1 codes; out.scales: e4m3 bytes in the 128x4 layout,
    # segment g's scale rows from 128-row block row_offsets[g] // 128 + out.scales_offsets[g]

A segment holds rows from every source rank, and its GEMM dequantizes with one alpha
(`1 / gs` times the weight's scale), so every rank should pass the same global scale (e.g. the
calibrated activation scale of the layer); rows quantized under different scales would need
per-row alphas. Expert outputs come back to combine in bf16 as for the other formats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cute_ep.runtime.comm import (DEFAULT_TIMEOUT_S, ConfigMismatch, PeerTimeout,
                                  agree_on_config)
from cute_ep.runtime.launch import check_tensor, device_arch, runtime
from cute_ep.torch_ops import DISPATCH_FIELDS, register_buffer
from layouts import EPConfig
from layouts.buffers import (BUFFER_GROUPS, ERROR_ID_RANGE, ERROR_ID_TWICE, buffer_sizes,
                             combine_routes, control_buffers, group_offsets, output_scales,
                             total_bytes)

CTAS_PER_SM = 8
# Limits of the compiled kernels (kernels/ep.py: shared-memory tables and per-k scratch).
MAX_RANKS = 8
MAX_TOPK = 16
MAX_SEGMENTS = 271
FORMATS = ("bf16", "fp8", "nvfp4")
# The NVFP4 encoder's e2m1 conversion by architecture (the hardware one is sm_100a only).
E2M1_OF_ARCH = {"sm_90a": "software", "sm_100a": "hardware"}
PHASES = {1: "dispatch", 2: "combine"}
DISPATCH, COMBINE = 0, 1

__all__ = ["Buffer", "DispatchOutput", "DispatchHandle", "Routing", "ConfigMismatch",
           "PeerTimeout"]


def _empty(buffer, device) -> torch.Tensor:
    """A tensor holding `buffer` (a `layouts.buffers.Buffer`), shaped as its layout."""
    return torch.empty(buffer.torch_shape, dtype=getattr(torch, buffer.dtype), device=device)


def _zeros(buffer, device) -> torch.Tensor:
    return _empty(buffer, device).zero_()


@dataclass
class Routing:
    """This rank's side of one dispatch, as combine needs it."""

    group: int  # buffer group the dispatch used (-1: rebuilt by the combine operator)
    num_tokens: int
    weighted: bool  # topk_weights given: combine reduces; otherwise [T, K, H]
    skip_a2a: bool
    shared_begin: int  # this rank's shared-expert tokens [begin, end)
    shared_end: int
    topk_ids: torch.Tensor  # int32 [T, K]


@dataclass
class DispatchHandle:
    """What combine needs from a dispatch (device tensors, valid until two dispatches later)."""

    routing: Routing
    rows: torch.Tensor  # int32 [R, max_tokens, K]: row of (source, message, k) here, or -1
    weights: torch.Tensor  # float32 [R, max_tokens, K]
    tokens: torch.Tensor  # int32 [R, max_tokens]: source token index of each message
    messages: torch.Tensor  # int32 [R]: messages received from each source


@dataclass
class DispatchOutput:
    """One rank's dispatch result (SPEC section 3). Rows past `row_offsets[-1]` are undefined."""

    tokens: torch.Tensor  # [row_capacity, H] bf16 or float8_e4m3fn; nvfp4: uint8 [.., H / 2]
    # fp8: float32 [H / 128, row_capacity]; nvfp4: uint8 e4m3 bytes in the 128x4 layout for
    # max_recv + 128 * segments rows (layouts.buffers.output_scales), padding of used blocks 0
    scales: torch.Tensor | None
    row_offsets: torch.Tensor  # int32 [segments + 1]
    expert_ids: torch.Tensor  # int32 [segments]
    src_info: torch.Tensor  # int32 [row_capacity, 2]: (source token, k slot; -1 = shared)
    counts: torch.Tensor  # int32 [segments]: rows received per segment
    handle: DispatchHandle
    # nvfp4: int32 [segments], segment g's scales start at 128-row block
    # row_offsets[g] // 128 + scales_offsets[g]; None for the other formats
    scales_offsets: torch.Tensor | None = None


@dataclass
class _PendingDispatch:
    routing: Routing
    ctas_per_source: int


@dataclass
class _PendingCombine:
    group: int
    handle: DispatchHandle
    y: torch.Tensor


class Buffer:
    """Peer-mapped buffers and kernels for one EP group (every rank of `group`)."""

    def __init__(self, cfg: EPConfig, group=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 sms: int | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        self.cfg = cfg
        self.timeout_s = float(timeout_s)
        _check_config(cfg, world)
        agree_on_config({"kind": "ep", "config": repr(cfg), "timeout_s": self.timeout_s},
                        self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        dev = self.device
        t = cfg.max_tokens_per_rank
        self.msg = cfg.message
        self.entries = 1 + cfg.segments
        # Byte offsets inside one token message (layouts.formats).
        self.scales_at = self.msg.segment("scales").offset if cfg.format != "bf16" else 0
        self.meta_at = self.msg.segment("src_token").offset
        self.offsets = group_offsets(cfg)
        self.group_bytes = self.offsets["group_bytes"]
        # Bytes of the NVFP4 128x4 scale output, from its layout once (not on every dispatch).
        self.nvfp4_scale_bytes = output_scales(cfg).layout.cosize() \
            if cfg.format == "nvfp4" else 0

        rt = runtime()
        self.k_plan = rt.select("ep_plan", dev)
        encode = {"e2m1": E2M1_OF_ARCH[device_arch(dev)]} if cfg.format == "nvfp4" else {}
        self.k_encode = rt.select("ep_encode", dev, format=cfg.format, **encode)
        self.k_send = rt.select("ep_send", dev)
        self.k_recv = rt.select("ep_recv", dev, format=cfg.format)
        self.k_combine_send = rt.select("ep_combine_send", dev)
        self.k_combine_recv = rt.select("ep_combine_recv", dev)
        self.send_tokens_per_cta = self.k_send.spec.sizes["tokens_per_cta"]
        self.combine_tokens_per_cta = self.k_combine_recv.spec.sizes["tokens_per_cta"]
        # Receive and combine-send CTAs are latency-bound (a message at a time): up to 8 per SM
        # keep enough bytes in flight (Nsight Compute: 2 per SM left the receive at 0.25 waves).
        self.max_ctas = CTAS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count
        self.sms = sms

        self.sym = symm_mem.empty(BUFFER_GROUPS * self.group_bytes, dtype=torch.uint8, device=dev)
        self.sym.zero_()
        torch.cuda.synchronize(dev)
        dist.barrier(self.group)
        handle = symm_mem.rendezvous(self.sym, self.group.group_name)
        bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64)
        self.peer_bases = torch.stack([bases + g * self.group_bytes
                                       for g in range(BUFFER_GROUPS)]).to(dev)

        self.send_buf = torch.empty(t * self.msg.size, dtype=torch.uint8, device=dev)
        control = {b.name: _zeros(b, dev) for b in control_buffers(cfg)}
        self.dest_slot = control["destination_slots"]
        self.positions = control["expert_positions"]
        self.send_counts = control["send_counts"]
        self.rounds = control["round_counters"]  # [phase, group]
        self.done = control["completion_counters"]  # [phase, destination or all]
        self.error = control["error"]  # ERROR_FIELDS
        self._routes = combine_routes(cfg)  # a dispatch's handle, allocated per dispatch
        self._no_f32 = torch.zeros(4, dtype=torch.float32, device=dev)
        self._no_i32 = torch.zeros(4, dtype=torch.int32, device=dev)
        self.dispatch_round = 0
        self.combine_round = 0
        self._prepare_views()
        self.op_id = register_buffer(self)  # how torch.ops.cute_ep.dispatch / combine name it
        dist.barrier(self.group)

    # Sizes -------------------------------------------------------------------------------

    def buffer_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes of every buffer of this config (peer-visible ones per buffer group)."""
        return buffer_sizes(self.cfg)

    @property
    def nbytes(self) -> int:
        """GPU memory this rank needs for the layer, outputs of one dispatch included."""
        return total_bytes(self.cfg)

    # Views of the symmetric allocation ----------------------------------------------------

    def _view(self, group: int, name: str, dtype: torch.dtype, count: int,
              skip: int = 0) -> torch.Tensor:
        size = torch.tensor([], dtype=dtype).element_size()
        start = group * self.group_bytes + self.offsets[name] + skip * size
        return self.sym[start:start + count * size].view(dtype)

    def _prepare_views(self) -> None:
        """The per-buffer-group views every launch passes, made once here rather than on every
        call (each costs microseconds of host time, and a decode layer's kernels take tens)."""
        cfg = self.cfg
        r, t = cfg.ranks, cfg.max_tokens_per_rank
        self._groups = [{
            "peer_bases": self.peer_bases[g],
            "dispatch_recv": self._view(g, "dispatch_recv", torch.uint8, r * t * self.msg.size),
            "recv_counts": self._view(g, "recv_counts", torch.int32, r * self.entries),
            "dispatch_flags": self._view(g, "arrival_flags", torch.int64, r),
            "combine_recv": self._view(g, "combine_recv", torch.bfloat16,
                                       t * cfg.topk * cfg.hidden),
            "combine_flags": self._view(g, "arrival_flags", torch.int64, r, skip=r),
            "dispatch_round": self.rounds[DISPATCH, g:g + 1],
            "combine_round": self.rounds[COMBINE, g:g + 1],
        } for g in range(BUFFER_GROUPS)]
        self._done = (self.done[DISPATCH], self.done[COMBINE])

    # Dispatch -----------------------------------------------------------------------------

    def dispatch_async(self, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor | None = None, *, skip_a2a: bool = False,
                       num_input_tokens: int | None = None,
                       global_scale: torch.Tensor | None = None) -> _PendingDispatch:
        """Plan, encode and send this rank's tokens; returns what `dispatch_wait` needs.

        x: bf16 [T, H], T <= max_tokens_per_rank; topk_ids: int32/int64 [T, K];
        topk_weights: float32 [T, K] or None (combine then returns the unreduced [T, K, H]).
        skip_a2a: every rank holds all tokens and keeps only its own experts (allreduce mode).
        num_input_tokens: an upper bound on T over all ranks, sizing the receive grid (decode).
        global_scale: nvfp4 only (and required there): fp32 CUDA tensor of one element, the
        `gs` of `sf = e4m3(gs * amax / 6)`, `q = e2m1(x * gs / sf)`; the same on every rank.
        """
        cfg = self.cfg
        num_tokens = self._check_dispatch_inputs(x, topk_ids, topk_weights)
        self._check_global_scale(global_scale)
        hint = cfg.max_tokens_per_rank if num_input_tokens is None else int(num_input_tokens)
        if not 0 <= hint:
            raise ValueError(f"num_input_tokens must be non-negative, got {num_input_tokens}")
        ids = topk_ids.to(torch.int32).contiguous()
        weighted = topk_weights is not None
        if cfg.fused_shared_expert and not weighted:
            raise ValueError("fused_shared_expert needs topk_weights: the unreduced [T, K, H] "
                             "combine output has no slot for the shared expert")
        shared_begin, shared_end = self._shared_tokens(num_tokens, skip_a2a)
        group = self.dispatch_round % BUFFER_GROUPS
        self.dispatch_round += 1

        self.k_plan.launch_unchecked(ids, self.dest_slot, self.positions, self.send_counts, self.error,
                           num_tokens, cfg.max_tokens_per_rank, cfg.topk, cfg.local_experts,
                           cfg.ranks, self.rank, int(cfg.fused_shared_expert), int(skip_a2a),
                           shared_begin, shared_end, cfg.ranks + cfg.experts)
        self.k_encode.launch_unchecked(self.send_buf, x, ids, topk_weights if weighted else self._no_f32,
                             self.positions,
                             global_scale if global_scale is not None else self._no_f32,
                             num_tokens, cfg.hidden, cfg.topk, self.msg.size, self.scales_at,
                             self.meta_at, int(weighted))
        chunks = self._cap(max(1, -(-num_tokens // self.send_tokens_per_cta)), cfg.ranks)
        views = self._groups[group]
        self.k_send.launch_unchecked(views["peer_bases"], self.send_buf, self.dest_slot,
                           self.send_counts, self._done[DISPATCH], views["dispatch_round"],
                           num_tokens, cfg.max_tokens_per_rank, cfg.ranks, self.rank,
                           self.msg.size // 16, self.entries, self.offsets["dispatch_recv"],
                           self.offsets["recv_counts"], self.offsets["arrival_flags"], chunks)
        ctas = self._ctas_per_rank(hint)
        return _PendingDispatch(Routing(group, num_tokens, weighted, skip_a2a, shared_begin,
                                        shared_end, ids), ctas)

    def dispatch_wait(self, pending: _PendingDispatch) -> DispatchOutput:
        """Wait for every rank's tokens (bounded) and expand them into expert-grouped rows."""
        cfg, dev, route = self.cfg, self.device, pending.routing
        g = route.group
        r, t, k, cap, h = cfg.ranks, cfg.max_tokens_per_rank, cfg.topk, cfg.row_capacity, cfg.hidden
        segs = cfg.segments
        scales_offsets = None
        if cfg.format == "fp8":
            tokens = torch.empty(cap, h, dtype=torch.float8_e4m3fn, device=dev)
            scales = torch.empty(h // 128, cap, dtype=torch.float32, device=dev)
        elif cfg.format == "nvfp4":
            tokens = torch.empty(cap, h // 2, dtype=torch.uint8, device=dev)
            scales = torch.empty(self.nvfp4_scale_bytes, dtype=torch.uint8, device=dev)
            scales_offsets = torch.empty(segs, dtype=torch.int32, device=dev)
        else:
            tokens = torch.empty(cap, h, dtype=torch.bfloat16, device=dev)
            scales = None
        row_offsets = torch.empty(segs + 1, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(segs, dtype=torch.int32, device=dev)
        counts = torch.empty(segs, dtype=torch.int32, device=dev)
        src_info = torch.empty(cap, 2, dtype=torch.int32, device=dev)
        rows, weights, sources, messages = (_empty(b, dev) for b in self._routes)
        handle = DispatchHandle(routing=route, rows=rows, weights=weights, tokens=sources,
                                messages=messages)
        payload = self.msg.segment("payload").nbytes
        views = self._groups[g]
        self.k_recv.launch_unchecked(
            views["dispatch_recv"], views["recv_counts"], views["dispatch_flags"],
            views["dispatch_round"], self.error, tokens.view(torch.uint8),
            scales if scales is not None else self._no_f32,
            scales_offsets if scales_offsets is not None else self._no_i32, row_offsets,
            expert_ids, counts, src_info, handle.rows, handle.weights, handle.tokens,
            handle.messages, r, self.rank, t, k, cfg.local_experts, int(cfg.fused_shared_expert),
            route.shared_begin, route.shared_end, self.msg.size,
            payload // self.k_recv.spec.sizes["vector_bytes"], self.scales_at, self.meta_at, cap,
            int(self.timeout_s * 1e9), pending.ctas_per_source)
        return DispatchOutput(tokens, scales, row_offsets, expert_ids, src_info, counts, handle,
                              scales_offsets)

    def dispatch(self, x, topk_ids, topk_weights=None, *, skip_a2a=False,
                 num_input_tokens=None, global_scale=None) -> DispatchOutput:
        """`dispatch_async` then `dispatch_wait` (see both). Under `torch.compile` this is the
        `cute_ep::dispatch` operator (`cute_ep.torch_ops`)."""
        if torch.compiler.is_compiling():
            return self._dispatch_via_op(x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                                         global_scale)
        return self.dispatch_wait(self.dispatch_async(
            x, topk_ids, topk_weights, skip_a2a=skip_a2a, num_input_tokens=num_input_tokens,
            global_scale=global_scale))

    # Combine ------------------------------------------------------------------------------

    def combine_async(self, y: torch.Tensor, handle: DispatchHandle) -> _PendingCombine:
        """Send each token's partial sum over this rank's experts home (bf16 `y` [rows, H] in
        dispatch's row order)."""
        cfg = self.cfg
        check_tensor(y, name="y", dtype="bfloat16", align=16, device_index=self.device.index)
        if y.dim() != 2 or y.shape[1] != cfg.hidden:
            raise ValueError(f"y must be bf16 [rows, {cfg.hidden}], got {tuple(y.shape)}")
        if y.shape[0] < cfg.row_capacity:
            raise ValueError(f"y has {y.shape[0]} rows; dispatch's outputs have row_capacity="
                             f"{cfg.row_capacity} rows (pass the full expert output buffer)")
        group = self.combine_round % BUFFER_GROUPS
        self.combine_round += 1
        ctas = self._ctas_per_rank(cfg.max_tokens_per_rank)
        views = self._groups[group]
        self.k_combine_send.launch_unchecked(
            views["peer_bases"], y, handle.rows, handle.weights, handle.tokens,
            handle.messages, self._done[COMBINE], views["combine_round"],
            cfg.max_tokens_per_rank, cfg.ranks, self.rank, cfg.topk, cfg.hidden,
            int(handle.routing.weighted), self.offsets["combine_recv"],
            self.offsets["arrival_flags"] + 8 * cfg.ranks, ctas)
        return _PendingCombine(group, handle, y)

    def combine_wait(self, pending: _PendingCombine) -> torch.Tensor:
        """Wait for every rank's partial sums (bounded) and reduce: bf16 [T, H], or the
        unreduced [T, K, H] when dispatch had no weights."""
        cfg, h, g = self.cfg, pending.handle.routing, pending.group
        t, k, hidden = h.num_tokens, cfg.topk, cfg.hidden
        shape = (t, hidden) if h.weighted else (t, k, hidden)
        out = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        chunks = self._cap(max(1, -(-t // self.combine_tokens_per_cta)), 1)
        views = self._groups[g]
        self.k_combine_recv.launch_unchecked(
            views["combine_recv"], views["combine_flags"], views["combine_round"], self.error,
            out, pending.y, h.topk_ids, t, cfg.ranks, self.rank, k, hidden,
            cfg.local_experts, int(h.weighted), int(h.skip_a2a), int(cfg.fused_shared_expert),
            h.shared_begin, h.shared_end, int(self.timeout_s * 1e9), chunks)
        return out

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """`combine_async` then `combine_wait` (see both). Under `torch.compile` this is the
        `cute_ep::combine` operator."""
        if torch.compiler.is_compiling():
            r = handle.routing
            return torch.ops.cute_ep.combine(self.op_id, y, r.topk_ids, handle.rows,
                                             handle.weights, handle.tokens, handle.messages,
                                             r.weighted, r.skip_a2a)
        return self.combine_wait(self.combine_async(y, handle))

    # Errors -------------------------------------------------------------------------------

    def check(self) -> None:
        """Synchronise the current stream and raise what the kernels recorded: a rank that did
        not arrive (PeerTimeout, naming phase and rank; the Buffer must then be recreated), or
        bad input seen on the device (ValueError, reported once: those (token, k) pairs were
        dropped, every other token is exact, and later calls are unaffected)."""
        _wait_interruptibly(torch.cuda.current_stream(self.device))
        missing, phase, bad_id, bad_counts = self.error.tolist()
        if missing:
            raise PeerTimeout(f"{PHASES.get(phase, 'unknown phase')}: rank {self.rank} timed out "
                              f"after {self.timeout_s:g} s waiting for rank {missing - 1}")
        if bad_id or bad_counts:
            self.error[2:].zero_()  # reported once; the Buffer stays usable (a timeout does not)
        if bad_id:
            what = []
            if bad_id & ERROR_ID_RANGE:
                what.append(f"an expert id outside [0, {self.cfg.experts})")
            if bad_id & ERROR_ID_TWICE:
                what.append("a token listing the same expert twice (the later k was dropped)")
            raise ValueError(f"topk_ids held {' and '.join(what)}; those (token, k) pairs were "
                             f"dropped from this dispatch and its combine")
        if bad_counts:
            raise RuntimeError("received counts or positions were inconsistent; the affected "
                               "rows were dropped")

    # For the custom operators (cute_ep.torch_ops) --------------------------------------------

    def _dispatch_via_op(self, x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                         global_scale) -> DispatchOutput:
        """`dispatch` as the `cute_ep::dispatch` operator, reassembled into a DispatchOutput."""
        t = torch.ops.cute_ep.dispatch(self.op_id, x, topk_ids, topk_weights, skip_a2a,
                                       num_input_tokens, global_scale)
        fields = dict(zip(DISPATCH_FIELDS, t))
        handle = self.handle_of(topk_ids, fields["rows"], fields["weights"],
                                fields["source_tokens"], fields["messages"],
                                topk_weights is not None, skip_a2a)
        fmt = self.cfg.format
        return DispatchOutput(fields["tokens"], fields["scales"] if fmt != "bf16" else None,
                              fields["row_offsets"], fields["expert_ids"], fields["src_info"],
                              fields["counts"], handle,
                              fields["scales_offsets"] if fmt == "nvfp4" else None)

    def output_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every tensor `torch.ops.cute_ep.dispatch` returns, in its order:
        the DispatchOutput's (tokens, scales, row_offsets, expert_ids, src_info, counts,
        scales_offsets; absent ones empty) then the handle's (rows, weights, source tokens,
        messages). They depend on the config only, never on the routing."""
        cfg = self.cfg
        cap, h, segs = cfg.row_capacity, cfg.hidden, cfg.segments
        tokens = {"bf16": ((cap, h), torch.bfloat16), "fp8": ((cap, h), torch.float8_e4m3fn),
                  "nvfp4": ((cap, h // 2), torch.uint8)}[cfg.format]
        scales = {"bf16": ((0,), torch.float32), "fp8": ((h // 128, cap), torch.float32),
                  "nvfp4": ((self.nvfp4_scale_bytes,), torch.uint8)}[cfg.format]
        scales_offsets = ((segs,) if cfg.format == "nvfp4" else (0,), torch.int32)
        routes = [(b.torch_shape, getattr(torch, b.dtype)) for b in self._routes]
        return [tokens, scales, ((segs + 1,), torch.int32), ((segs,), torch.int32),
                ((cap, 2), torch.int32), ((segs,), torch.int32), scales_offsets, *routes]

    def handle_of(self, topk_ids, rows, weights, source_tokens, messages, weighted: bool,
                  skip_a2a: bool) -> DispatchHandle:
        """A DispatchHandle from its tensors (what the dispatch operator returned) and the
        dispatch's arguments."""
        num_tokens = topk_ids.shape[0]
        begin, end = self._shared_tokens(num_tokens, skip_a2a)
        return DispatchHandle(Routing(-1, num_tokens, bool(weighted), bool(skip_a2a), begin, end,
                                      topk_ids.to(torch.int32).contiguous()),
                              rows, weights, source_tokens, messages)

    # Internals ----------------------------------------------------------------------------

    def _shared_tokens(self, num_tokens: int, skip_a2a: bool) -> tuple[int, int]:
        """This rank's shared-expert tokens [begin, end): all of them, or with skip_a2a a
        contiguous ceil(T / R) chunk per rank (so the caller's allreduce adds each once)."""
        if not skip_a2a:
            return 0, num_tokens
        chunk = -(-num_tokens // self.cfg.ranks)
        begin = min(num_tokens, self.rank * chunk)
        return begin, min(num_tokens, begin + chunk)

    @property
    def sms(self) -> int | None:
        """The most CTAs each communicating kernel (send, receive, combine send and receive)
        launches, so at most that many SMs are busy moving data; None: as many as the work
        fills (the default, fastest when nothing else runs). Settable between calls."""
        return self._sms

    @sms.setter
    def sms(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < self.cfg.ranks):
            raise ValueError(f"sms must be None or an int >= ranks ({self.cfg.ranks}), got "
                             f"{value!r}")
        self._sms = value

    def _cap(self, ctas: int, per: int) -> int:
        """`ctas` CTAs for each of `per` grid rows, within the `sms` budget."""
        return ctas if self._sms is None else max(1, min(ctas, self._sms // per))

    def _ctas_per_rank(self, tokens: int) -> int:
        """CTAs per peer rank for a kernel that walks up to `tokens` messages from each rank."""
        return self._cap(max(1, min(self.max_ctas // self.cfg.ranks, -(-tokens // 4))),
                         self.cfg.ranks)


    def _check_dispatch_inputs(self, x, topk_ids, topk_weights) -> int:
        cfg, dev = self.cfg, self.device.index
        check_tensor(x, name="x", dtype="bfloat16", align=16, device_index=dev)
        if x.dim() != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"x must be bf16 [T, {cfg.hidden}], got {tuple(x.shape)}")
        num_tokens = x.shape[0]
        if num_tokens > cfg.max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceeds max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}")
        check_tensor(topk_ids, name="topk_ids", dtype=None, device_index=dev)
        if topk_ids.dtype not in (torch.int32, torch.int64) or \
                tuple(topk_ids.shape) != (num_tokens, cfg.topk):
            raise ValueError(f"topk_ids must be int32/int64 [{num_tokens}, {cfg.topk}], got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
        if topk_weights is not None:
            check_tensor(topk_weights, name="topk_weights", dtype="float32", align=4,
                         device_index=dev)
            if tuple(topk_weights.shape) != (num_tokens, cfg.topk):
                raise ValueError(f"topk_weights must be float32 [{num_tokens}, {cfg.topk}], got "
                                 f"{tuple(topk_weights.shape)}")
        return num_tokens

    def _check_global_scale(self, global_scale) -> None:
        if self.cfg.format != "nvfp4":
            if global_scale is not None:
                raise ValueError(f"global_scale is for nvfp4 dispatch only; this Buffer "
                                 f"dispatches {self.cfg.format}")
            return
        if global_scale is None:
            raise ValueError("nvfp4 dispatch needs global_scale: an fp32 CUDA tensor of one "
                             "element (the same on every rank)")
        check_tensor(global_scale, name="global_scale", dtype="float32", align=4,
                     device_index=self.device.index)
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must hold one element, got shape "
                             f"{tuple(global_scale.shape)}")


def _wait_interruptibly(stream) -> None:
    """Wait for `stream` by polling an event rather than a blocking synchronize, so Ctrl-C
    (KeyboardInterrupt) returns control at once even while a kernel still spins on a peer (the
    kernel itself gives up after the Buffer's timeout)."""
    done = torch.cuda.Event()
    done.record(stream)
    polls = 0
    while not done.query():
        polls += 1
        time.sleep(0 if polls < 2000 else 0.0002)


def _check_config(cfg: EPConfig, world: int) -> None:
    if cfg.ranks != world:
        raise ValueError(f"the config has ranks={cfg.ranks}, the process group has {world}")
    if cfg.format not in FORMATS:
        raise NotImplementedError(f"dispatch formats: {FORMATS}, not {cfg.format!r}")
    if cfg.ranks > MAX_RANKS:
        raise ValueError(f"at most {MAX_RANKS} ranks per host, got {cfg.ranks}")
    if cfg.topk > MAX_TOPK:
        raise ValueError(f"top-k at most {MAX_TOPK}, got {cfg.topk}")
    if cfg.segments > MAX_SEGMENTS:
        raise ValueError(f"at most {MAX_SEGMENTS} segments (local experts + shared) per rank, "
                         f"got {cfg.segments}")
    if cfg.hidden % 8:
        raise ValueError(f"hidden size must be a multiple of 8 (16-byte bf16 rows), got "
                         f"{cfg.hidden}")
