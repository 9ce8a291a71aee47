"""DeepEP v1.2.1's intranode API on cute-ep's kernels: `import cute_ep.deepep as deep_ep`.

Normal mode (`get_dispatch_layout`, `dispatch`, `combine`) gives DeepEP's layout: one received
row per (token, destination rank), rows from source 0 first, inside a source in token order
(`handle[0]`, the rank-prefix matrix, says where each source's rows end). Low-latency mode
(`low_latency_dispatch`, `low_latency_combine`) gives its per-expert slabs
`[E_loc, R * max_tokens, H]` with `recv_count`. Underneath, a `cute_ep.Buffer` per shape (made
on first use, a collective: every rank makes the same calls, as DeepEP requires) moves the bytes:

- dispatch runs cute-ep's one-kernel dispatch in the "sources" layout (ids padded with -1,
  DeepEP's empty slot): the kernel writes each received token's row in DeepEP's order with its
  top-k ids made local (-1 where the expert lives elsewhere) and weights (0 there), so nothing
  is reordered afterwards;
- combine sends each row home once with weight 1, so the home rank's fp32 sum over the ranks
  the token went to is DeepEP's unweighted reduction; `topk_weights` given to
  combine are summed over those ranks too (an all-to-all of the [N, K] weights in the group);
- low-latency dispatch runs cute-ep's dispatch in the "slabs" layout, and low-latency combine
  weighs each (token, k) row at home with the weights given to it.

What cannot be honoured raises `NotImplementedError` naming the argument (internode, MNNVL,
`bias`, LogFMT, wait-time statistics). Low-latency FP8 `round_scale` rounds each block scale
up to a power of two in the encoder (`EPConfig.fp8_scales="pow2"`); `use_ue8m0` hands out those
scales' exponent bytes packed four to an int32; `zero_copy` combines read the shape's combine
buffer (`get_next_low_latency_combine_buffer`). `Config`'s
chunk sizes describe DeepEP's own ring geometry; cute-ep's rings have theirs (`layouts.channels`),
so only `Config.num_sms` (the SMs the transport occupies) changes what runs; the low-latency
calls take every SM of the GPU, as DeepEP's low-latency kernels size their grids by the experts
and not by `num_sms` (`_low_latency_sms`). Everything runs on
the current stream: `async_finish` returns an event recorded there, `previous_event` is waited
for there. A low-latency dispatch's `return_recv_hook` sends now and receives when the hook is
called (`cute_ep.Buffer.dispatch_send`); a low-latency combine's hook has nothing left to do
(its one kernel also receives).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cute_ep.ep import Buffer as _Core
from cute_ep.ep import DispatchHandle
from cute_ep.quant import sm_count
from layouts import EPConfig
from layouts.buffers import ERROR_CAPACITY, peer_visible_bytes

__all__ = ["Buffer", "Config", "EventOverlap"]

# DeepEP's recommended chunk sizes (its get_dispatch_config / get_combine_config tables), kept so
# configs built from them print and compare as DeepEP's do.
_DISPATCH_CHUNKS = {1: (6, 256), 2: (24, 256), 4: (6, 256), 8: (6, 256)}
_COMBINE_CHUNKS = {1: (4, 256), 2: (10, 256), 4: (9, 256), 8: (4, 256)}


class Config:
    """DeepEP's `Config(num_sms, nvl_send_chunk, nvl_recv_chunk, rdma_send_chunk,
    rdma_recv_chunk)`. `num_sms` picks the SM budget of the transport (a cute-ep Buffer per
    budget); the chunk sizes are DeepEP's ring geometry and are recorded, not used."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        if not isinstance(num_sms, int) or num_sms < 1:
            raise ValueError(f"Config.num_sms must be a positive int, got {num_sms!r}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """The peer-visible bytes cute-ep's bf16 transport takes at this SM budget for a hidden
        size of `hidden_bytes / 2` (its rings do not grow with the token count)."""
        return _peer_bytes(hidden_bytes // 2, num_ranks, self.num_sms)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # intranode only

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_chunk=({self.num_max_nvl_chunked_send_tokens}"
                f", {self.num_max_nvl_chunked_recv_tokens}))")


def _peer_bytes(hidden: int, ranks: int, sms: int, fmt: str = "bf16", topk: int = 8,
                experts: int | None = None, max_tokens: int = 4096,
                layout: str = "packed") -> int:
    cfg = EPConfig(hidden, min(topk, experts or ranks * 32), experts or ranks * 32, ranks,
                   max_tokens, fmt, layout=layout)
    return peer_visible_bytes(cfg, sms)


class EventOverlap:
    """DeepEP's event wrapper: `current_stream_wait()`, and `with event:` waits on exit."""

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise ValueError("this EventOverlap holds no event (the call was not async_finish)")
        torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait()


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event()
    e.record(torch.cuda.current_stream())
    return e


@dataclass
class _Handle:
    """A normal-mode dispatch's handle. `handle[0]` is DeepEP's rank-prefix matrix [R, R]: this
    rank's column (rows from sources 0..i end at [i][rank]) is filled, the others are -1 (they
    are other ranks' receive counts, which this rank never learns)."""

    rank_prefix_matrix: torch.Tensor
    core: _Core
    combine: DispatchHandle  # every received row goes home once, weight 1
    received: list[int]  # rows received from each rank
    is_token_in_rank: torch.Tensor
    num_tokens: int

    def __getitem__(self, i):
        return (self.rank_prefix_matrix, None, None, None, self.is_token_in_rank, None)[i]

    def __len__(self) -> int:
        return 6


@dataclass
class _LowLatencyHandle:
    """A low-latency dispatch's handle, indexed as DeepEP's: [0] the source token of every slab
    row, int32 [E_loc, R * M] (a view); [1] per (expert, source) `begin << 32 | count` of its
    rows, int64 [E_loc, R] (computed on first access, on the device); then M, H and E."""

    core: _Core
    inner: DispatchHandle
    src_info: torch.Tensor  # int32 [E_loc * R * M, 2] (source token, k) of each row
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    _range: torch.Tensor | None = None

    def __getitem__(self, i):
        if i == 0:
            e_loc = self.num_experts // self.core.cfg.ranks
            return self.src_info[:, 0].view(e_loc, -1)
        if i == 1:
            if self._range is None:
                self._range = self._layout_range()
            return self._range
        return (None, None, self.num_max_dispatch_tokens_per_rank, self.hidden,
                self.num_experts)[i]

    def _layout_range(self) -> torch.Tensor:
        cfg, h = self.core.cfg, self.inner
        r, m = cfg.ranks, cfg.max_tokens_per_rank
        msg = torch.arange(m, device=h.rows.device)
        live = (msg.view(1, m, 1) < h.messages.view(r, 1, 1)) & (h.rows >= 0)
        seg = (h.rows // cfg.slab_rows).long()
        src = torch.arange(r, device=h.rows.device).view(r, 1, 1).expand_as(seg)
        counts = torch.zeros(cfg.local_experts * r, dtype=torch.int64, device=h.rows.device)
        counts.index_add_(0, (seg * r + src)[live], torch.ones_like(seg[live]))
        counts = counts.view(cfg.local_experts, r)
        begin = counts.cumsum(1) - counts
        return (begin << 32) | counts

    def __len__(self) -> int:
        return 5


class Buffer:
    """DeepEP's `Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)` for one
    NVLink domain. `num_nvl_bytes` is the budget of peer-visible bytes the transports made on
    first use may take (each is sized by its SM budget and hidden size, not by token counts);
    `max_tokens_per_rank` (not in DeepEP) bounds the tokens of a normal-mode dispatch."""

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, comm=None, *,
                 max_tokens_per_rank: int = 4096):
        if comm is not None:
            raise NotImplementedError("comm (an mpi4py communicator): pass a torch.distributed "
                                      "group")
        if allow_mnnvl:
            raise NotImplementedError("allow_mnnvl: cute-ep runs inside one NVLink domain of one "
                                      "host")
        if not allow_nvlink_for_low_latency_mode:
            raise NotImplementedError("allow_nvlink_for_low_latency_mode=False: intranode, "
                                      "cute-ep's only path is NVLink")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        if num_rdma_bytes and not low_latency_mode:
            raise NotImplementedError("num_rdma_bytes > 0 without low_latency_mode is DeepEP's "
                                      "internode mode: cute-ep.deepep is intranode only")
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self._cores: dict[tuple, _Core] = {}
        self._chunks_noted = False

    # DeepEP's static helpers ---------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms < 1:
            raise ValueError(f"num_sms must be positive, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(_event())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        if num_ranks not in _DISPATCH_CHUNKS:
            raise ValueError(f"intranode EP over {num_ranks} ranks: 1, 2, 4 or 8")
        return Config(Buffer.num_sms, *_DISPATCH_CHUNKS[num_ranks], 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        if num_ranks not in _COMBINE_CHUNKS:
            raise ValueError(f"intranode EP over {num_ranks} ranks: 1, 2, 4 or 8")
        return Config(Buffer.num_sms, *_COMBINE_CHUNKS[num_ranks], 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Peer-visible bytes of the low-latency transports (every SM of the current GPU,
        `_low_latency_sms`), for any top-k up to 16: one each for BF16, FP8 and FP8 with rounded
        scales (`round_scale`), the shapes a caller like DeepEP's test_low_latency.py makes side
        by side."""
        return sum(_peer_bytes(hidden, num_ranks, _low_latency_sms(), fmt, 16, num_experts,
                               num_max_dispatch_tokens_per_rank, "slabs")
                   for fmt in ("bf16", "fp8", "fp8"))

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() is for a Buffer made with explicitly_destroy=True")
        self._cores.clear()

    def get_comm_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    # Layout ---------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(tokens per rank [R] int32, None, tokens per expert [E] int32, is_token_in_rank
        [T, R] bool, event), from the [T, K] ids (-1: an empty slot)."""
        self._before(previous_event, allocate_on_comm_stream)
        r = self.group_size
        if num_experts % r:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the {r} ranks")
        ids = topk_idx.long()
        valid = ids >= 0
        if bool(((ids < -1) | (ids >= num_experts)).any()):
            raise ValueError(f"topk_idx must hold expert ids in [0, {num_experts}) or -1")
        per_expert = torch.bincount(ids[valid], minlength=num_experts).int()
        in_rank = _ranks_of(ids, num_experts, r)
        return (in_rank.sum(0).int(), None, per_expert, in_rank,
                EventOverlap(_event() if async_finish else None))

    # Normal mode ----------------------------------------------------------------------------

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's intranode dispatch: (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); recv_x is bf16 [N, H] or, for an FP8
        `(x, scales)` input, the (e4m3 [N, H], float32 [N, H / 128]) tuple."""
        self._before(previous_event, allocate_on_comm_stream)
        if num_tokens_per_rdma_rank is not None:
            raise NotImplementedError("num_tokens_per_rdma_rank: internode dispatch")
        if not self.num_nvl_bytes:
            raise ValueError("this Buffer has num_nvl_bytes=0: normal-mode dispatch needs an "
                             "NVLink buffer")
        config = config or self.get_dispatch_config(self.group_size)
        self._note_chunks(config)
        fp8 = isinstance(x, tuple)
        codes = x[0] if fp8 else x
        t, hidden = codes.shape
        r = self.group_size
        if handle is not None:  # cached: the same routing, no top-k
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx or "
                                 "topk_weights")
            if not isinstance(handle, _Handle):
                raise TypeError("handle must come from this module's dispatch")
            experts, in_rank = None, handle.is_token_in_rank
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or \
                    num_tokens_per_expert is None:
                raise ValueError("dispatch without a handle needs num_tokens_per_rank, "
                                 "is_token_in_rank and num_tokens_per_expert "
                                 "(get_dispatch_layout)")
            experts, in_rank = num_tokens_per_expert.numel(), is_token_in_rank
            if experts % r:
                raise ValueError(f"{experts} experts do not split over {r} ranks")
        if fp8:
            x = (x[0].contiguous(), x[1].contiguous())
        if topk_idx is None:
            recv_x, received, new = self._dispatch_rows(x, in_rank, t, hidden, fp8, config,
                                                        num_worst_tokens, cached=handle)
            if handle is not None:
                return recv_x, None, None, None, None, EventOverlap(
                    _event() if async_finish else None)
            # The experts' counts come from every rank's layout.
            per_expert_all = num_tokens_per_expert.int().clone()
            dist.all_reduce(per_expert_all, group=self.group)
            e_loc = experts // r
            per_expert = per_expert_all[self.rank * e_loc:(self.rank + 1) * e_loc].tolist()
            recv_idx = recv_w = None
        else:
            recv_x, recv_idx, recv_w, per_expert, new = self._dispatch_pairs(
                x, topk_idx, topk_weights, in_rank, experts, t, hidden, fp8, config,
                num_worst_tokens)
        align = max(1, int(expert_alignment))
        per_expert_list = [] if num_worst_tokens else \
            [-(-c // align) * align for c in per_expert]
        return (recv_x, recv_idx, recv_w, per_expert_list, new,
                EventOverlap(_event() if async_finish else None))

    def _normal_core(self, layout, hidden, fp8, width, experts, config,
                     num_worst_tokens) -> _Core:
        """The core layer of a normal-mode dispatch: "packed" with one expert a rank (no
        top-k), "sources" with top-k. Either gives a received token one row, so with
        `num_worst_tokens` its output holds that many rows instead of the worst case."""
        fmt = "fp8" if fp8 else "bf16"
        rows = num_worst_tokens or None
        return self._core(("normal" if layout == "packed" else layout, hidden, fmt, width,
                           experts, config.num_sms, rows),
                          EPConfig(hidden, width, experts, self.group_size,
                                   self.max_tokens_per_rank, fmt, layout=layout,
                                   recv_capacity=rows), config.num_sms)

    def _dispatch_rows(self, x, in_rank, t, hidden, fp8, config, num_worst_tokens,
                       cached=None):
        """Without top-k: a layer of one expert per rank and one pair per destination (weight
        1), so each message lands in exactly one row and the expert-grouped output already is
        DeepEP's order (by source, by token): recv_x is a view of it (R * max_tokens_per_rank
        rows at most), and the dispatch's own handle serves combine. A cached dispatch (the
        handle `cached` of the same routing) knows its rows from the handle and does not wait
        for the device: what the kernels report is raised by the core's next read-back (DeepEP's
        cached dispatch does not synchronise either)."""
        r = self.group_size
        dev = in_rank.device
        ranks = torch.arange(r, dtype=torch.int32, device=dev)
        ids = torch.where(in_rank, ranks, -1).to(torch.int32).contiguous()
        core = self._normal_core("packed", hidden, fp8, r, r, config, num_worst_tokens)
        out = core.dispatch(x, ids, in_rank.float())
        # Everything the caller gets is queued before the one read-back: after it only views
        # are taken, so the GPU does not idle while the host works.
        scales = out.scales.t().contiguous() if fp8 else None
        if cached is not None:
            received = cached.received
            new = None
        else:
            new = self._handle(core, out.handle, in_rank, t)
            received = new.received = _read_back(core, out.handle.messages,
                                                 worst=num_worst_tokens)
        n_out = self._rows_out(num_worst_tokens, sum(received))
        recv_x = out.tokens[:n_out]
        if fp8:
            recv_x = (recv_x, scales[:n_out])
        return recv_x, received, new

    def _dispatch_pairs(self, x, topk_idx, topk_weights, in_rank, experts, t, hidden, fp8,
                        config, num_worst_tokens):
        """With top-k: cute-ep's dispatch in the "sources" layout, DeepEP's own: one row per
        received token, sources in order, each in its token order, with its K ids made local
        (-1 elsewhere) and weights (0 elsewhere) written beside it by the kernel; its handle
        sends each row home once (weight 1), DeepEP's unweighted combine."""
        r = self.group_size
        dev = in_rank.device
        # int32 or int64 as DeepEP's callers pass it (the kernels read either), made contiguous
        # where it is a view.
        ids = topk_idx.contiguous()
        width = ids.shape[1]
        core = self._normal_core("sources", hidden, fp8, width, experts, config,
                                 num_worst_tokens)
        weights = topk_weights.float().contiguous() if topk_weights is not None else \
            torch.zeros(ids.shape, dtype=torch.float32, device=dev)
        out = core.dispatch(x, ids, weights)
        # Everything the caller gets is queued before the one read-back (messages per source,
        # rows per expert, what the device reported (a peer timeout, bad ids) and whether
        # is_token_in_rank (what combine's weights follow) is the routing of topk_idx (what the
        # rows follow)): after it only views are taken, so the GPU does not idle while the host
        # works.
        differs = (_ranks_of(topk_idx.long(), experts, r) != in_rank).any().int().view(1)
        scales = out.scales.t().contiguous() if fp8 else None
        all_idx = out.recv_topk_ids.to(topk_idx.dtype)
        new = self._handle(core, out.handle, in_rank, t)
        counts = _read_back(core, out.handle.messages, out.counts, differs,
                            worst=num_worst_tokens)
        received, per_expert = counts[:r], counts[r:-1]
        new.received = received
        if counts[-1]:
            raise ValueError("is_token_in_rank does not match topk_idx (pass "
                             "get_dispatch_layout's for these ids)")
        total = sum(received)
        n_out = self._rows_out(num_worst_tokens, total)
        recv_x = out.tokens[:n_out]
        if fp8:
            recv_x = (recv_x, scales[:n_out])
        recv_idx = all_idx[:n_out]
        recv_w = out.recv_topk_weights[:n_out]
        if n_out > total:  # DeepEP's rows past the received ones: ids -1, weights 0
            recv_idx[total:] = -1
            recv_w[total:] = 0.0
        return recv_x, recv_idx, recv_w, per_expert, new

    def _handle(self, core, comb, in_rank, t) -> _Handle:
        """The handle of a dispatch whose routes are `comb`, its prefix matrix computed on the
        device (queued before the read-back); `received` is filled in once read."""
        r = self.group_size
        prefix = torch.full((r, r), -1, dtype=torch.int32, device=in_rank.device)
        prefix[:, self.rank] = comb.messages.cumsum(0).int()
        return _Handle(prefix, core, comb, [], in_rank, t)

    @staticmethod
    def _rows_out(num_worst_tokens: int, total: int) -> int:
        if num_worst_tokens and num_worst_tokens < total:
            raise ValueError(f"num_worst_tokens={num_worst_tokens} is below the {total} rows "
                             f"received")
        return num_worst_tokens or total

    def combine(self, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None,
                bias=None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP's intranode combine: (combined_x [T, H] bf16, combined_topk_weights [T, K] or
        None, event); each token's rows from the ranks it went to, added in fp32 (no weights)."""
        self._before(previous_event, allocate_on_comm_stream)
        if bias is not None:
            raise NotImplementedError("bias: add it to combine's output (cute-ep's combine "
                                      "rounds its fp32 sum to bf16 before returning)")
        if not isinstance(handle, _Handle):
            raise TypeError("handle must come from this module's dispatch")
        if config is not None:
            self._note_chunks(config)
        core = handle.core
        n = sum(handle.received)
        if not (x.dtype is torch.bfloat16 and x.dim() == 2 and x.shape[0] >= n
                and x.shape[1] == core.cfg.hidden):
            raise ValueError(f"x must be bf16 [{n}, {core.cfg.hidden}] (the dispatch's rows), "
                             f"got {x.dtype} {tuple(x.shape)}")
        combined = core._combine_rows(x.contiguous(), handle.combine)
        combined_w = None
        if topk_weights is not None:
            combined_w = self._combine_weights(topk_weights, handle)
        return combined, combined_w, EventOverlap(_event() if async_finish else None)

    def _combine_weights(self, w: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """Sum over the ranks each token went to of the [N, K] rows given to combine: the rows
        go home by an all-to-all in the group, then add in fp32 in rank order."""
        n = sum(handle.received)
        if w.dtype is not torch.float32 or w.dim() != 2 or w.shape[0] < n:
            raise ValueError(f"topk_weights must be float32 [{n}, K], got {w.dtype} "
                             f"{tuple(w.shape)}")
        k = w.shape[1]
        sent = handle.is_token_in_rank.sum(0).tolist()  # tokens this rank sent to each rank
        back = torch.empty(sum(sent), k, dtype=torch.float32, device=w.device)
        dist.all_to_all_single(back, w[:n].contiguous(), sent, handle.received,
                               group=self.group)
        out = torch.zeros(handle.num_tokens, k, dtype=torch.float32, device=w.device)
        at = 0
        for d, cnt in enumerate(sent):
            tokens = handle.is_token_in_rank[:, d].nonzero().flatten()
            out.index_add_(0, tokens, back[at:at + cnt])
            at += cnt
        return out

    # Low-latency mode -----------------------------------------------------------------------

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """(recv_x, recv_count, handle, event, hook): recv_x bf16 [E_loc, R * M, H] or the
        (e4m3 [E_loc, R * M, H], float32 scales [E_loc, R * M, H / 128], M-major) tuple,
        rows of expert g from source 0 first, inside a source in token order; recv_count
        int32 [E_loc]. Rows past an expert's count are undefined. CUDA-graph capturable once
        the shape's transport exists (the first call makes it)."""
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("dispatch_wait_recv_cost_stats: not recorded by cute-ep")
        m, r = int(num_max_dispatch_tokens_per_rank), self.group_size
        hidden = x.shape[1]
        if use_fp8 and use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0 needs round_scale=True (UE8M0 holds powers of two)")
        if use_fp8 and use_ue8m0 and hidden % 512:
            raise ValueError(f"use_ue8m0 packs four 128-value blocks' scales in an int32: "
                             f"hidden must be a multiple of 512, got {hidden}")
        fmt = "fp8" if use_fp8 else "bf16"
        scales = "pow2" if use_fp8 and round_scale else "exact"
        core = self._core(("ll", hidden, fmt, topk_idx.shape[1], num_experts, m, scales),
                          EPConfig(hidden, topk_idx.shape[1], num_experts, r, m, fmt,
                                   layout="slabs", fp8_scales=scales), _low_latency_sms())
        ids = topk_idx.contiguous()  # int32 or int64: the kernels read either
        if return_recv_hook:  # the receive launch waits for the hook
            out, receive = core.dispatch_send(x, ids, None, num_input_tokens=m)
        else:
            out = core.dispatch(x, ids, None, num_input_tokens=m)
        e_loc, rows = num_experts // r, r * m
        recv_x = out.tokens.view(e_loc, rows, -1)
        pack = None
        if use_fp8 and use_ue8m0:
            # Each power-of-two scale's exponent byte (UE8M0), four blocks to an int32, in
            # DeepEP's [E_loc, R * M, H / 512] M-major layout; packed once the scales exist
            # (with a receive hook: when it has run).
            packed = torch.empty(e_loc, hidden // 512, rows, dtype=torch.int32,
                                 device=x.device).transpose(1, 2)

            def pack_exponents() -> None:
                exps = ((out.scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                packed.copy_(exps.view(hidden // 128, e_loc, rows).permute(1, 2, 0)
                             .contiguous().view(torch.int32))
            pack = pack_exponents
            recv_x = (recv_x, packed)
        elif use_fp8:
            recv_x = (recv_x, out.scales.view(hidden // 128, e_loc, rows).permute(1, 2, 0))
        stats = cumulative_local_expert_recv_stats
        if return_recv_hook:
            def hook() -> None:
                receive()
                # The counts and scales exist once the receive part has run.
                if pack is not None:
                    pack()
                if stats is not None:
                    stats.add_(out.counts)
        else:
            hook = None
            if pack is not None:
                pack()
            if stats is not None:
                stats.add_(out.counts)
        handle = _LowLatencyHandle(core, out.handle, out.src_info, m, hidden, num_experts)
        return (recv_x, out.counts, handle, EventOverlap(_event() if async_finish else None),
                hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """(combined_x [T, H] bf16, event, hook): out[t] = sum_k topk_weights[t, k] * the row of
        (t, k) in `x` ([E_loc, R * M, H] bf16, the slabs' order), in fp32."""
        if use_logfmt:
            raise NotImplementedError("use_logfmt: cute-ep's combine moves bf16 rows")
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("combine_wait_recv_cost_stats: not recorded by cute-ep")
        if not isinstance(handle, _LowLatencyHandle):
            raise TypeError("handle must come from this module's low_latency_dispatch")
        if tuple(topk_idx.shape) != tuple(handle.inner.routing.topk_ids.shape):
            raise ValueError("topk_idx must be the one given to low_latency_dispatch")
        core = handle.core
        # zero_copy: the experts wrote their outputs into the shape's combine buffer
        # (get_next_low_latency_combine_buffer), which combine then reads in place of x.
        y = _combine_buffer(core) if zero_copy else x.reshape(-1, x.shape[-1])
        combined = core.combine(y, handle.inner, topk_weights=topk_weights.float().contiguous())
        if out is not None:
            out.copy_(combined)
            combined = out
        return (combined, EventOverlap(_event() if async_finish else None),
                _nothing if return_recv_hook else None)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: cute-ep's counters only grow, so no buffer holds stale flags."""

    def get_next_low_latency_combine_buffer(self, handle):
        """The bf16 [E_loc, R * M, H] buffer that a `zero_copy=True` low_latency_combine of this
        shape reads: the experts write their outputs straight into it, in the slabs' order."""
        if not isinstance(handle, _LowLatencyHandle):
            raise TypeError("handle must come from this module's low_latency_dispatch")
        cfg = handle.core.cfg
        return _combine_buffer(handle.core).view(cfg.local_experts, cfg.slab_rows, cfg.hidden)

    # Internals ------------------------------------------------------------------------------

    def _before(self, previous_event, allocate_on_comm_stream: bool) -> None:
        if allocate_on_comm_stream and previous_event is None:
            raise ValueError("allocate_on_comm_stream needs previous_event (as in DeepEP)")
        if previous_event is not None and previous_event.event is not None:
            previous_event.current_stream_wait()

    def _note_chunks(self, config: Config) -> None:
        if not self._chunks_noted and self.rank == 0:
            warnings.warn("cute_ep.deepep: Config's NVLink chunk sizes are DeepEP's ring "
                          "geometry; cute-ep uses its own (only Config.num_sms applies)",
                          stacklevel=3)
        self._chunks_noted = True

    def _core(self, key: tuple, cfg: EPConfig, sms: int) -> _Core:
        core = self._cores.get(key)
        if core is None:
            normal = key[0] in ("normal", "sources")  # normal mode's transports
            if not normal and not self.low_latency_mode:
                raise ValueError("low-latency calls need a Buffer made with "
                                 "low_latency_mode=True")
            need = peer_visible_bytes(cfg, min(sms, sm_count(torch.device("cuda"))))
            used = sum(c.peer_visible_bytes for c in self._cores.values()
                       if (c.cfg.layout != "slabs") == normal)
            name, budget = ("num_nvl_bytes", self.num_nvl_bytes) if normal else \
                ("num_rdma_bytes", self.num_rdma_bytes)
            if used + need > budget:
                raise ValueError(f"this shape needs {need} peer-visible bytes ({used} already "
                                 f"taken by other shapes); the Buffer was given {name}={budget}")
            core = self._cores[key] = _Core(cfg, self.group, sms=sms)
        return core


def _low_latency_sms() -> int:
    """The SMs a low-latency transport occupies: every SM of the current GPU. DeepEP's
    low-latency kernels launch as many CTAs as their experts need (96 of an H200's 132 for 288
    experts), whatever `num_sms` says, and are timed so; the face's decode-sized transports
    keep that budget instead of normal mode's 20."""
    if not torch.cuda.is_available():
        raise RuntimeError("the low-latency transports take every SM of the GPU they run on; "
                           "ask where that GPU is visible")
    return sm_count(torch.device("cuda"))


def _combine_buffer(core: _Core) -> torch.Tensor:
    """The bf16 [row_capacity, H] input of zero-copy combines of `core`'s shape, made once."""
    buf = getattr(core, "_zero_copy_rows", None)
    if buf is None:
        buf = core._zero_copy_rows = torch.empty(core.cfg.row_capacity, core.cfg.hidden,
                                                 dtype=torch.bfloat16, device=core.device)
    return buf


def _nothing() -> None:
    """The receive hook: the dispatch's one kernel has already received."""


def _rows(table: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Rows `index` of `table`, then zero rows up to n."""
    out = table.new_zeros((n, table.shape[1])) if n > index.numel() else None
    if out is None:
        return table.index_select(0, index.long())
    out[:index.numel()] = table.index_select(0, index.long())
    return out


def _ranks_of(ids: torch.Tensor, experts: int, ranks: int) -> torch.Tensor:
    """is_token_in_rank of int64 [T, K] ids (-1: an empty slot): bool [T, R]."""
    dest = torch.where((ids >= 0) & (ids < experts), ids // (experts // ranks), ranks)
    in_rank = torch.zeros(ids.shape[0], ranks + 1, dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, dest, True)
    return in_rank[:, :ranks].contiguous()


def _read_back(core, *tensors, worst: int = 0) -> list:
    """The values of the int32 `tensors`, concatenated, in one read from the device together
    with `core`'s error words; raises what the kernel recorded (`core.check()`) if any is set,
    an overflow of the output sized by `num_worst_tokens` (`worst`) in DeepEP's terms."""
    got = torch.cat([*tensors, core.error]).tolist()
    words = core.error.numel()
    if any(got[-words:]):
        if worst and got[-1] & ERROR_CAPACITY and not any(got[-words:-1]):
            core.error[2:].zero_()  # reported here, once
            raise ValueError(f"num_worst_tokens={worst} is below the tokens this rank "
                             f"received (their rows did not fit the output it sizes)")
        core.check()
    return got[:-words]
