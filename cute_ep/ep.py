"""Intranode expert parallelism over NVLink: one `Buffer` per EP group.

One process per GPU under `torch.distributed`. A `Buffer` allocates its peer-visible rings once
from torch symmetric memory (sized by `layouts.channels`, not by the token count), checks that
every rank asked for the same configuration, and launches one kernel per dispatch and one per
combine (`kernels/dispatch/`, `kernels/combine.py`; fp8 and nvfp4 given bf16 tokens are
quantized first, by `ep_encode` or inside the dispatch kernel, `kernels/encode.py`) on the
current stream:

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
experts, not one per expert: the source stages its tokens in batches of 16 (their messages and
one header of their ids, weights and indices) in its own peer-visible memory, and each
destination reads every batch's header and pulls the messages of the tokens that route to it;
the receiver expands each message into expert rows. Combine returns
one bf16 row per (token, destination rank): the rank's weighted partial sum over its local
experts.

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

import math
import os
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from cute_ep.runtime.comm import (DEFAULT_TIMEOUT_S, ConfigMismatch, PeerTimeout,
                                  agree_on_config)
from cute_ep.runtime.launch import check_tensor, device_arch, runtime
from cute_ep.torch_ops import DISPATCH_FIELDS, register_buffer
from layouts import EPConfig
from layouts.buffers import (AT_EXPERTS, AT_HOME, ERROR_CAPACITY, ERROR_CHANNELS,
                             ERROR_ID_RANGE, ERROR_ID_TWICE, UNREDUCED, buffer_sizes,
                             channel_messages, combine_routes, control_buffers,
                             dispatch_scale_rows, output_scales, total_bytes)
from layouts.channels import (DEFAULT_CHANNELS, DISPATCH_RECEIVE, DISPATCH_SEND,
                              STAGE_BATCH_TOKENS, ChannelGeometry, active_channels,
                              combine_vectors, prefixed_counts, read_count_flag)

# The SM budget engines give communication (DeepEP's tuned default is 20-24): the rest of the GPU
# stays free for the other micro-batch's GEMMs. Dispatch runs one persistent CTA per SM of it.
DEFAULT_SMS = DEFAULT_CHANNELS
# Limits of the compiled kernels (kernels/dispatch/: shared-memory tables, per-k scratch).
MAX_RANKS = 8
MAX_TOPK = 16
MAX_SEGMENTS = 271
FORMATS = ("bf16", "fp8", "nvfp4")
# The NVFP4 encoder's e2m1 conversion by architecture (the hardware one is sm_100a only).
E2M1_OF_ARCH = {"sm_90a": "software", "sm_100a": "hardware"}
PHASES = {1: "dispatch", 2: "combine"}
# The handle's tensors the combine kernel reads, in COMBINE_VARYING's order.
_COMBINE_READS = ("rows", "weights", "channels")
# The kernel arguments that change from call to call, in the order the Buffer passes them (the
# rest are fixed for a Buffer's life and written once: `Kernel.bind`).
# bf16 tokens of an FP8 or NVFP4 layer are quantized inside the dispatch kernel when a channel
# has at most this many of them (one staging batch: a decode step's), by `ep_encode` otherwise.
FUSED_ENCODE_TOKENS = STAGE_BATCH_TOKENS
DISPATCH_VARYING = ("source", "source_stride", "load_bytes", "scale_source", "scale_stride",
                    "topk_ids", "id_words",
                    "topk_weights", "tokens", "scales", "scales_offsets",
                    "row_offsets", "expert_ids", "seg_counts", "src_info", "comb_rows",
                    "comb_weights", "comb_tokens", "comb_counts", "chan_msgs", "recv_ids",
                    "recv_weights", "num_tokens",
                    "skip_a2a", "shared_begin", "shared_end", "has_weights", "active", "launched",
                    "trace",
                    "tracing", "phases", "x", "global_scale", "encode", "prefixed", "direct")
# What the one-pass path (`Buffer._common_dispatch`) passes per call: DISPATCH_VARYING but for
# what that path always passes the same (no sources-layout outputs, no skip_a2a, no trace, both
# phases, nothing quantized in the call), which its own bound block holds as constants.
COMMON_DISPATCH_VARYING = ("source", "source_stride", "load_bytes", "scale_source", "scale_stride",
                           "topk_ids", "id_words", "topk_weights", "tokens", "scales",
                           "scales_offsets", "row_offsets", "expert_ids", "seg_counts",
                           "src_info", "comb_rows", "comb_weights", "comb_tokens",
                           "comb_counts", "chan_msgs", "num_tokens", "shared_end",
                           "has_weights", "active", "launched", "prefixed", "direct")
COMBINE_VARYING = ("y", "comb_rows", "comb_weights", "chan_msgs", "topk_ids", "id_words",
                   "out", "home_weights", "num_tokens", "weighted", "skip_a2a", "shared_begin",
                   "shared_end", "active", "launched", "trace", "tracing")

# The expert ids' dtypes the kernels read as they are (`kernels.routing.load_id`: an int64 id
# that int32 cannot hold is out of range there; the host never narrows ids).
_ID_DTYPES = (torch.int32, torch.int64)


def _id_words(topk_ids: torch.Tensor) -> int:
    """The kernels' `id_words` of int32 (1) or int64 (2) ids: the 32-bit words an id takes."""
    return topk_ids.element_size() >> 2


def _contiguous_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """int32 or int64 ids as the kernels read them: contiguous, the dtype kept."""
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    return topk_ids.contiguous()


__all__ = ["Buffer", "DispatchOutput", "DispatchHandle", "Routing", "ConfigMismatch",
           "PeerTimeout", "stall_report"]

# Every Buffer alive in this process, for `stall_report`.
_LIVE: "weakref.WeakSet[Buffer]" = weakref.WeakSet()


def _empty(buffer, device) -> torch.Tensor:
    """A tensor holding `buffer` (a `layouts.buffers.Buffer`), shaped as its layout."""
    return torch.empty(buffer.torch_shape, dtype=getattr(torch, buffer.dtype), device=device)


def _zeros(buffer, device) -> torch.Tensor:
    return _empty(buffer, device).zero_()


class _Carve:
    """Small tensors of one call laid out in one allocation, planned once per Buffer: a call
    allocates once, its kernels take addresses inside it, and a view is made only of what the
    caller reads (each view costs Python time; most are never read outside combine)."""

    ALIGN = 256

    def __init__(self, parts: list[tuple[str, tuple[int, ...], torch.dtype]], start: int = 0):
        self.parts: dict[str, tuple[int, tuple[int, ...], torch.dtype, int]] = {}
        at = start
        for name, shape, dtype in parts:
            nbytes = math.prod(shape) * dtype.itemsize
            self.parts[name] = (at, shape, dtype, nbytes)
            at = -(-(at + nbytes) // self.ALIGN) * self.ALIGN
        self.end = at

    def view(self, flat: torch.UntypedStorage, name: str) -> torch.Tensor:
        """Part `name` of a call's allocation `flat` as a tensor of its dtype and shape on that
        storage: an empty tensor set to it, two cheap calls where slicing a uint8 tensor then
        viewing it as the dtype and the shape took three, about twice the host time."""
        at, shape, dtype, _ = self.parts[name]
        return torch.empty(0, dtype=dtype, device=flat.device).set_(flat, at // dtype.itemsize,
                                                                    shape)

    def address(self, base: int, name: str) -> int:
        return base + self.parts[name][0]

    def separate(self, device) -> dict[str, torch.Tensor]:
        """Each part in its own allocation (outputs of a custom operator may not alias)."""
        return {name: torch.empty(shape, dtype=dtype, device=device)
                for name, (_, shape, dtype, _) in self.parts.items()}


class _Carved:
    """A dataclass whose tensor fields may live in one carved allocation (`_flat`, laid out by
    `_carve`): such a field becomes a tensor view on its first read."""

    def __getattr__(self, name):
        fields = self.__dict__
        carve = fields.get("_carve")
        if carve is None or name not in carve.parts:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        view = fields[name] = carve.view(fields["_flat"], name)
        return view

    def _address(self, name: str) -> int:
        """The device address of field `name`, without making its view."""
        fields = self.__dict__
        if name in fields:
            return fields[name].data_ptr()
        return fields["_carve"].address(fields["_flat"].data_ptr(), name)

    def _addresses(self, names: tuple[str, ...]) -> list[int]:
        """`_address` of each of `names`, the allocation's address read once."""
        fields = self.__dict__
        carve = fields.get("_carve")
        if carve is None:
            return [fields[name].data_ptr() for name in names]
        base, parts = fields["_flat"].data_ptr(), carve.parts
        return [fields[name].data_ptr() if name in fields else base + parts[name][0]
                for name in names]

    @classmethod
    def _of(cls, fields: dict):
        """An instance whose attributes are `fields`, the dict itself (a call builds it fresh):
        the fields given, and `_flat` and `_carve` (None for an instance with every field
        given), which carve the rest."""
        obj = cls.__new__(cls)
        obj.__dict__ = fields
        return obj


@dataclass
class Routing:
    """This rank's side of one dispatch, as combine needs it."""

    channels: int  # channels the dispatch split its tokens over (its combine uses the same)
    num_tokens: int
    weighted: bool  # topk_weights given: combine reduces; otherwise [T, K, H]
    skip_a2a: bool
    shared_begin: int  # this rank's shared-expert tokens [begin, end)
    shared_end: int
    topk_ids: torch.Tensor  # int32 or int64 [T, K], contiguous, as the caller gave them


@dataclass
class DispatchHandle(_Carved):
    """What combine needs from a dispatch (device tensors)."""

    routing: Routing
    rows: torch.Tensor  # int32 [R, max_tokens, K]: row of (source, message, k) here, or -1
    weights: torch.Tensor  # float32 [R, max_tokens, K]
    tokens: torch.Tensor  # int32 [R, max_tokens]: source token index of each message
    messages: torch.Tensor  # int32 [R]: messages received from each source
    channels: torch.Tensor  # int32 [channels, R]: messages received per (channel, source)


@dataclass
class DispatchOutput(_Carved):
    """One rank's dispatch result (SPEC section 3). Rows past `row_offsets[-1]` are undefined."""

    tokens: torch.Tensor  # [row_capacity, H] bf16 or float8_e4m3fn; nvfp4: uint8 [.., H / 2]
    # fp8: float32 [H / 128, row_capacity]; nvfp4: uint8 e4m3 bytes in the 128x4 layout for
    # recv_rows + 128 * segments rows (layouts.buffers.output_scales), padding of used blocks 0
    scales: torch.Tensor | None
    row_offsets: torch.Tensor  # int32 [segments + 1]
    expert_ids: torch.Tensor  # int32 [segments]
    src_info: torch.Tensor  # int32 [row_capacity, 2]: (source token, k slot; -1 = shared)
    counts: torch.Tensor  # int32 [segments]: rows received per segment
    handle: DispatchHandle
    # nvfp4: int32 [segments], segment g's scales start at 128-row block
    # row_offsets[g] // 128 + scales_offsets[g]; None for the other formats (no default: a
    # class attribute would hide the carved field from `_Carved.__getattr__`)
    scales_offsets: torch.Tensor | None
    # layout "sources" (one row per received token): int32 / float32 [row_capacity, K], each
    # row's K expert ids made local (-1 where the expert lives on another rank) and weights (0
    # there); None in the other layouts
    recv_topk_ids: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None


class _DirectInput(NamedTuple):
    """A pre-quantized direct input's views (codes, scales) as `_is_direct_input` compares a
    dispatch's with them, read once: addresses, dtypes, columns, rows, strides, and the row
    bytes (a message's) the dispatch passes its kernel."""

    codes_at: int
    scales_at: int
    codes_dtype: torch.dtype
    scales_dtype: torch.dtype
    codes_cols: int
    scales_cols: int
    rows: int
    codes_strides: tuple
    scales_strides: tuple
    codes_row_bytes: int
    scales_row_bytes: int


@dataclass
class _PendingDispatch:
    output: DispatchOutput


@dataclass
class _PendingCombine:
    out: torch.Tensor


def ring_geometry(cfg: EPConfig | None, direct_input: bool = False,
                  stage_batches: int | None = None, ring_chunks: int | None = None) -> dict | None:
    """`ChannelGeometry` fields a Buffer asks for beside the channels (None: all defaults):
    the direct input's rows (from `cfg`, needed only with `direct_input`) and the rings' depths
    given, each a positive int."""
    geometry = {"input_rows": cfg.max_tokens_per_rank} if direct_input else {}
    for name, value in (("stage_batches", stage_batches), ("ring_chunks", ring_chunks)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
            geometry[name] = value
    return geometry or None


class Buffer:
    """Peer-mapped buffers and kernels for one EP group (every rank of `group`)."""

    def __init__(self, cfg: EPConfig, group=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 sms: int | None = DEFAULT_SMS, direct_input: bool = False, *,
                 stage_batches: int | None = None, ring_chunks: int | None = None):
        """`sms`: the SMs the layer's communication occupies (dispatch runs one persistent CTA,
        a channel, on each; combine launches at most that many CTAs); None: every SM of the
        GPU. The same on every rank, fixed for the Buffer's life (it shapes the rings).
        `direct_input`: `input_buffer()` gives max_tokens_per_rank rows of peer-visible memory
        (bf16 x, or pre-quantized codes and scales); a dispatch of x there is pulled by its
        receivers in place, with no staging.
        The rings' depths, for tuning (None: the defaults of `layouts.channels.ChannelGeometry`;
        deeper rings let a sender run further ahead of its receivers and take more
        peer-visible memory, `peer_visible_bytes`): `stage_batches`, the batches of 16 tokens a
        dispatch channel's staging holds (1 to 16); `ring_chunks`, the chunks of rows a combine
        ring holds per channel and source. Both the same on every rank."""
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group or dist.group.WORLD
        rank = dist.get_rank(self.group)
        _check_config(cfg, dist.get_world_size(self.group))
        self._setup(cfg, rank, torch.device("cuda", torch.cuda.current_device()), timeout_s,
                    sms, ring_geometry(cfg, direct_input, stage_batches, ring_chunks))
        agree_on_config({"kind": "ep", "config": repr(cfg), "timeout_s": self.timeout_s,
                         "sms": self._sms, "input_rows": self.geo.input_rows,
                         "stage_batches": self.geo.stage_batches,
                         "ring_chunks": self.geo.ring_chunks}, self.group)
        sym = symm_mem.empty(self.peer_visible_bytes, dtype=torch.uint8, device=self.device)
        sym.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)
        handle = symm_mem.rendezvous(sym, self.group.group_name)
        self._attach(sym, handle.buffer_ptrs)
        self.op_id = register_buffer(self)  # how torch.ops.cute_ep.dispatch / combine name it
        dist.barrier(self.group)

    @classmethod
    def emulated(cls, cfg: EPConfig, timeout_s: float = DEFAULT_TIMEOUT_S,
                 sms: int | None = DEFAULT_SMS, **geometry) -> list["Buffer"]:
        """All `cfg.ranks` ranks of a layer in this process on the current GPU, each with its
        own buffers, peer-mapped to each other by plain device addresses: the transport with
        every link local (no NVLink), for single-GPU tests and profiling. Rank r's calls must
        run concurrently with the others' (a stream per rank) and the GPU must hold every
        rank's CTAs at once (ranks x sms <= its SMs). `geometry`: `ChannelGeometry` fields other
        than the channels (e.g. tiny rings that wrap on every batch, for tests)."""
        _check_config(cfg, cfg.ranks)
        dev = torch.device("cuda", torch.cuda.current_device())
        ranks = [cls.__new__(cls) for _ in range(cfg.ranks)]
        device_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        for r, buf in enumerate(ranks):
            buf.group = None
            buf._setup(cfg, r, dev, timeout_s, sms, geometry)
            buf.spare_ctas = 0  # the ranks share the GPU's SMs
            if cfg.ranks * buf.sms > device_sms:  # known from the first rank, before the rest
                # Each rank's kernels wait for the others': with fewer SMs than CTAs some would
                # never start and the rest would wait for them until the timeout.
                raise ValueError(f"{cfg.ranks} emulated ranks x {buf.sms} SMs need "
                                 f"{cfg.ranks * buf.sms} SMs at once, this GPU has "
                                 f"{device_sms}: pass sms <= {device_sms // cfg.ranks}")
        syms = [torch.zeros(buf.peer_visible_bytes, dtype=torch.uint8, device=dev)
                for buf in ranks]
        for buf, sym in zip(ranks, syms):
            buf._attach(sym, [t.data_ptr() for t in syms])
        return ranks

    def _setup(self, cfg: EPConfig, rank: int, dev: torch.device, timeout_s: float,
               sms: int | None, geometry: dict | None = None) -> None:
        """Everything of this rank's side that needs no peer: kernels, sizes, local state."""
        self.rank = rank
        self.cfg = cfg
        self.device = dev
        self._receive_pending = None  # a dispatch_send whose hook has not run: its launch
        self.calls = [0, 0]  # dispatches and combines launched (what `stall_report` compares)
        _LIVE.add(self)
        self._device_index = dev.index  # what the input checks compare get_device() with
        self._takes_global_scale = cfg.format == "nvfp4"  # from a bf16 input, then required
        self.timeout_s = float(timeout_s)
        self._timeout_ns = int(self.timeout_s * 1e9)
        device_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
            raise ValueError(f"sms must be None or a positive int, got {sms!r}")
        self._sms = device_sms if sms is None else min(sms, device_sms)
        # CTAs launched beyond the budget so that a prefill-sized dispatch or combine runs its
        # channels one per TPC (kernels/placement.py); the others leave at once.
        # CUTE_EP_SPARE_CTAS overrides it.
        self.spare_ctas = min(self._sms // 2, device_sms - self._sms)
        if os.environ.get("CUTE_EP_SPARE_CTAS"):
            self.spare_ctas = max(0, min(int(os.environ["CUTE_EP_SPARE_CTAS"]),
                                         device_sms - self._sms))
        t = cfg.max_tokens_per_rank
        self.msg = cfg.message
        # Byte offset of the scales inside one token message (layouts.formats).
        self.scales_at = self.msg.segment("scales").offset if cfg.format != "bf16" else 0
        self._quantized_rows = _quantized_rows(cfg)
        # The same as torch dtypes for the checks' fast path (codes dtype, columns, scales
        # dtype, columns); None where a pre-quantized input always takes the detailed checks.
        self._quantized_fast = self._quantized_strides = None
        if self._quantized_rows is not None:
            (code_dtype, code_cols, _), (scale_dtype, scale_cols, _) = self._quantized_rows
            code_dtype, scale_dtype = getattr(torch, code_dtype), getattr(torch, scale_dtype)
            if not (cfg.format == "nvfp4" and cfg.hidden % 64):
                self._quantized_fast = (code_dtype, code_cols, scale_dtype, scale_cols)
            # The bytes of a checked input's code row and scale row (what its shapes give).
            self._quantized_strides = (code_cols * code_dtype.itemsize,
                                       scale_cols * scale_dtype.itemsize)
        self.geo = ChannelGeometry(cfg, channels=self._sms, **(geometry or {}))
        self.channel_offsets = self.geo.peer_offsets()
        self.peer_visible_bytes = self.channel_offsets["total"]
        # Bytes of the NVFP4 128x4 scale output, from its layout once (not on every dispatch).
        self.nvfp4_scale_bytes = output_scales(cfg).layout.cosize() \
            if cfg.format == "nvfp4" else 0

        rt = runtime()
        # bf16 tokens of an FP8 or NVFP4 layer are quantized with the config's FP8 scales or the
        # arch's e2m1 encoder, by `ep_encode` or, for a few tokens a channel, by the dispatch
        # kernel itself (`_fused_encode`). Bulk copies move 16-byte multiples: NVFP4 rows (H / 2
        # bytes) of an H that is not a multiple of 32 go through the receivers' registers.
        encode = {"e2m1": E2M1_OF_ARCH[device_arch(dev)]} if cfg.format == "nvfp4" else \
            {"scales": cfg.fp8_scales} if cfg.format == "fp8" else {}
        self.k_encode = rt.select("ep_encode", dev, format=cfg.format, **encode) \
            if cfg.format != "bf16" else None
        self.k_dispatch = rt.select("ep_dispatch", dev, format=cfg.format,
                                    bulk=int(cfg.format != "nvfp4" or cfg.hidden % 32 == 0),
                                    **encode)
        self.k_combine = rt.select("ep_combine", dev, vectors=combine_vectors(cfg.hidden))
        sizes = self.k_dispatch.spec.sizes
        if self.geo.ring_slots < max(self.geo.chunk_tokens, cfg.topk):
            raise ValueError(f"a ring of {self.geo.ring_slots} slots cannot hold a chunk of "
                             f"{self.geo.chunk_tokens} messages or one token's {cfg.topk} rows")
        if self.geo.chunk_tokens > self.k_combine.spec.sizes["max_chunk"]:
            raise ValueError(f"chunk_tokens {self.geo.chunk_tokens} exceeds the kernel's "
                             f"{self.k_combine.spec.sizes['max_chunk']}")
        if self.geo.stage_batches > sizes["max_stage_batches"]:
            raise ValueError(f"stage_batches {self.geo.stage_batches} exceeds the kernel's "
                             f"{sizes['max_stage_batches']}")
        self.payload_vectors = self.msg.segment("payload").nbytes // sizes["vector_bytes"]

        self.send_buf = torch.empty(t * self.msg.size, dtype=torch.uint8, device=dev) \
            if cfg.format != "bf16" else None
        scale_rows = dispatch_scale_rows(cfg)  # the received rows' scales, row by row
        self.scale_rows = torch.empty(scale_rows.layout.cosize(), dtype=torch.int32,
                                      device=dev) if scale_rows is not None else None
        control = {b.name: _zeros(b, dev) for b in control_buffers(cfg, self._sms)}
        self.dispatch_epoch = control["dispatch_round"]  # dispatches completed
        self.dispatch_done = control["dispatch_done"]
        self.combine_place = control["combine_place"]
        self.streams = control["stream_positions"]  # (channel, rank, kind, phase)
        self.error = control["error"]  # ERROR_FIELDS
        # A dispatch's handle, allocated per dispatch.
        self._routes = [*combine_routes(cfg), channel_messages(cfg, self._sms)]
        self._plan_outputs()
        # (active channels, prefixed counts) of a dispatch by its num_input_tokens (`_bound_for`)
        self._bounds: dict[int | None, tuple[int, int]] = {}
        # Placeholders for the pointer arguments a call leaves unused, and their addresses.
        self._no_f32 = torch.zeros(4, dtype=torch.float32, device=dev)
        self._no_i32 = torch.zeros(4, dtype=torch.int32, device=dev)
        self._no_i64 = torch.zeros(4, dtype=torch.int64, device=dev)
        self._no_bf16 = torch.zeros(8, dtype=torch.bfloat16, device=dev)  # 16-byte aligned
        self._no_f32_at = self._no_f32.data_ptr()
        self._no_bf16_at = self._no_bf16.data_ptr()
        self._no_i32_at = self._no_i32.data_ptr()
        self._no_i64_at = self._no_i64.data_ptr()
        # Where the dispatch kernel's senders read a bf16 input it quantized into send_buf:
        # (source, its row stride, the scales' source, their stride, bytes loaded a token).
        if cfg.format == "fp8":  # the codes, then the scales from the message's own rows
            send = self.send_buf.data_ptr()
            self._encoded = (send, self.msg.size, send + self.scales_at, self.msg.size,
                             cfg.hidden)
        elif cfg.format == "nvfp4":  # the whole message
            self._encoded = (self.send_buf.data_ptr(), self.msg.size, self._no_f32_at, 0,
                             self.msg.staged_bytes)
        # Set by `trace_dispatch(True)`: each dispatch then records its channels' timeline.
        self.trace: torch.Tensor | None = None
        self.combine_trace: torch.Tensor | None = None  # the same for combine

    def _attach(self, sym: torch.Tensor, peer_addresses: list[int]) -> None:
        """Take `sym` (this rank's peer-visible bytes) and every rank's address of its own, and
        write every kernel argument fixed for the Buffer's life once (`Kernel.bind`)."""
        self.sym = sym
        self.channel_bases = torch.tensor(peer_addresses, dtype=torch.int64).to(self.device)
        cfg, geo, off = self.cfg, self.geo, self.channel_offsets
        common = dict(peer_bases=self.channel_bases, streams=self.streams, error=self.error,
                      max_tokens=cfg.max_tokens_per_rank, topk=cfg.topk,
                      local_experts=cfg.local_experts, ranks=cfg.ranks, my_rank=self.rank,
                      shared=int(cfg.fused_shared_expert), channels=geo.channels,
                      counters_offset=off["counters"], timeout_ns=self._timeout_ns)
        fixed = dict(
            **common, rounds=self.dispatch_epoch, done=self.dispatch_done,
            header_bytes=geo.header_bytes, stage_bytes=self.msg.staged_bytes,
            stage_batches=geo.stage_batches,
            payload_vectors=self.payload_vectors, scales_offset=self.scales_at,
            row_capacity=cfg.row_capacity, segment_rows=cfg.segment_rows,
            scale_rows=self.scale_rows if self.scale_rows is not None else self._no_i32,
            headers_offset=off["batch_headers"],
            staging_offset=off["staging"], counts_offset=off["counts"],
            flags_offset=off["count_flags"], input_offset=off.get("input", 0))
        self._dispatch_launch = self.k_dispatch.bind(DISPATCH_VARYING, **fixed)
        # The one-pass path's own argument block: a launch packs 27 values instead of 37.
        self._common_launch = self.k_dispatch.bind(
            COMMON_DISPATCH_VARYING, **fixed, recv_ids=self._no_i32, recv_weights=self._no_f32,
            skip_a2a=0, shared_begin=0, trace=self._no_i64, tracing=0,
            phases=DISPATCH_SEND | DISPATCH_RECEIVE, x=self._no_bf16, global_scale=self._no_f32,
            encode=0)
        self._input = None
        self._direct = None
        if "input" in off:
            self._input = self._input_views(sym, off["input"], self.geo.input_rows)
            if type(self._input) is tuple:
                # What `_is_direct_input` compares a dispatch's (codes, scales) with, read once.
                c0, s0 = self._input
                self._direct = _DirectInput(
                    c0.data_ptr(), s0.data_ptr(), c0.dtype, s0.dtype, c0.shape[1], s0.shape[1],
                    c0.shape[0], c0.stride(), s0.stride(), c0.stride(0) * c0.element_size(),
                    s0.stride(0) * s0.element_size())
        self._combine_launch = self.k_combine.bind(
            COMBINE_VARYING, **common, hidden=cfg.hidden, row_capacity=cfg.row_capacity,
            ring_slots=geo.ring_slots, place=self.combine_place,
            chunk_tokens=geo.chunk_tokens, ring_offset=off["combine_rings"])
        self._encode_launch = self.k_encode.bind(
            ("x", "global_scale", "num_tokens", "ctas"), send_buf=self.send_buf,
            hidden=cfg.hidden, msg_bytes=self.msg.size, scales_offset=self.scales_at) \
            if self.k_encode is not None else None
        # The encoder keeps the SM budget: a CTA a budgeted SM, each `groups` tokens at once.
        self._encode_groups = self.k_encode.spec.config["groups"] \
            if self.k_encode is not None else 1

    def input_buffer(self):
        """The direct input (a Buffer made with `direct_input=True`): max_tokens_per_rank rows
        of this rank's peer-visible memory, laid out as the transport's staged messages. BF16:
        x, bf16 [rows, H]; FP8 and NVFP4: a pre-quantized input's (codes, scales), the same
        dtypes and shapes as `dispatch` takes, each row of both inside one message (so both
        have a row stride of the message's bytes). A dispatch of the first T rows (`x[:T]`, or
        `(codes[:T], scales[:T])`, written by the layer before) stages no payload: the receivers
        pull each token from there. Write it again only once the dispatch that read it has
        completed on this rank's stream (its launch ends after every rank has pulled).
        `dispatch_send` stages it as any other input."""
        if self._input is None:
            raise RuntimeError("this Buffer has no direct input: make it with direct_input=True")
        return self._input

    def _input_views(self, sym: torch.Tensor, at: int, rows: int):
        """The direct input's views of `sym` at byte `at`: x, or (codes, scales)."""
        cfg, msg = self.cfg, self.msg.staged_bytes
        part = sym[at:at + rows * msg].view(rows, msg)
        if cfg.format == "bf16":
            return part.view(torch.bfloat16)
        (code_dtype, code_cols, _), (scale_dtype, scale_cols, _) = self._quantized_rows
        code_dtype, scale_dtype = getattr(torch, code_dtype), getattr(torch, scale_dtype)
        code_bytes = code_cols * code_dtype.itemsize
        codes = part[:, :code_bytes].view(code_dtype)
        scales = part[:, self.scales_at:self.scales_at + scale_cols * scale_dtype.itemsize].view(
            scale_dtype)
        return codes, scales

    # Sizes -------------------------------------------------------------------------------

    def buffer_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes of every buffer of this config, by where it lives."""
        return buffer_sizes(self.cfg, self.sms)

    @property
    def nbytes(self) -> int:
        """GPU memory this rank needs for the layer, outputs of one dispatch included."""
        return total_bytes(self.cfg, self.sms)

    # Dispatch -----------------------------------------------------------------------------

    def dispatch_async(self, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor | None = None, *, skip_a2a: bool = False,
                       num_input_tokens: int | None = None,
                       global_scale: torch.Tensor | None = None) -> _PendingDispatch:
        """Launch the whole dispatch (one kernel; fp8 and nvfp4 given bf16 tokens quantize them
        first, in a second); returns what `dispatch_wait` hands back. Work queued on the stream
        between the two runs after the dispatch.

        x: bf16 [T, H], T <= max_tokens_per_rank; or the tokens already quantized, a tuple
        (codes, scales): for an fp8 Buffer (codes float8_e4m3fn [T, H], scales float32
        [T, H / 128]) of DeepSeek blockwise FP8 (as DeepEP takes it), for an nvfp4 Buffer
        (codes uint8 [T, H / 2], scales uint8 [T, H / 16], linear: `cute_ep.quantize_nvfp4(x,
        gs, scales="linear")`'s, H a multiple of 64): then nothing is quantized here and the
        one kernel only moves bytes.
        topk_ids: int32/int64 [T, K], expert ids in [0, E) or -1 for an empty slot (the pair
        goes nowhere, DeepEP's convention);
        topk_weights: float32 [T, K] or None (combine then returns the unreduced [T, K, H]).
        skip_a2a: every rank holds all tokens and keeps only its own experts (allreduce mode).
        num_input_tokens: an upper bound on T over all ranks (decode), the same on every rank;
        it splits the tokens over fewer channels (`active_channels`). Must be >= T.
        global_scale: nvfp4 bf16 x only (and required there): fp32 CUDA tensor of one
        element, the `gs` of `sf = e4m3(gs * amax / 6)`, `q = e2m1(x * gs / sf)`; the same on
        every rank.
        """
        return _PendingDispatch(self._eager_dispatch(x, topk_ids, topk_weights, skip_a2a,
                                                     num_input_tokens, global_scale))

    def _eager_dispatch(self, x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                        global_scale) -> DispatchOutput:
        """An eager dispatch's launch: the one-pass path (`_common_dispatch`) where it takes
        the call, else the checked one."""
        if not skip_a2a and global_scale is None:
            out = self._common_dispatch(x, topk_ids, topk_weights, num_input_tokens)
            if out is not None:
                return out
        return self._checked_dispatch(x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                                      global_scale)

    def _checked_dispatch(self, x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                          global_scale, separate=False, shared_rows=None) -> DispatchOutput:
        """`shared_rows`: with a fused shared expert, the rows of x [begin, end) it takes
        (default: `_shared_tokens`'); a NodeBuffer's node input holds its own tokens in one
        block after the held sources'."""
        num_tokens, direct = self._checked_inputs(x, topk_ids, topk_weights, num_input_tokens,
                                                  global_scale)
        if shared_rows is not None:
            begin, end = shared_rows
            if not (self.cfg.fused_shared_expert and not skip_a2a and
                    0 <= begin <= end <= num_tokens):
                raise ValueError(f"shared_rows={shared_rows}: a range of the {num_tokens} rows "
                                 f"of x, for a fused shared expert without skip_a2a")
        return self._launch_dispatch(x, topk_ids, topk_weights, num_tokens, skip_a2a,
                                     num_input_tokens, global_scale, separate,
                                     shared_rows=shared_rows, direct_tuple=direct)

    def _checked_inputs(self, x, topk_ids, topk_weights, num_input_tokens,
                        global_scale) -> tuple[int, bool]:
        """A dispatch's checks (inputs, global scale, no receive hook pending, the token bound);
        returns the token count and whether x is this Buffer's direct (codes, scales) input."""
        num_tokens, direct = self._check_dispatch_inputs(x, topk_ids, topk_weights)
        quantized = type(x) is tuple
        # Else nothing to check: no scale given, and none needed (bf16 x of an nvfp4 layer).
        if global_scale is not None or (self._takes_global_scale and not quantized):
            self._check_global_scale(global_scale, quantized)
        if self._receive_pending is not None:
            self._no_receive_pending()
        if num_input_tokens is not None and not 0 <= num_tokens <= int(num_input_tokens):
            raise ValueError(f"num_input_tokens={num_input_tokens} is below this rank's "
                             f"{num_tokens} tokens")
        return num_tokens, direct

    def _bound_for(self, num_input_tokens) -> tuple[int, int]:
        """(`active_channels`, `_prefixed_for`) of a dispatch bounded by `num_input_tokens`,
        computed once per bound."""
        bound = self._bounds.get(num_input_tokens)
        if bound is None:
            active = self.active_channels(num_input_tokens)
            bound = self._bounds[num_input_tokens] = (
                active, prefixed_counts(self.cfg.max_tokens_per_rank, num_input_tokens, active))
        return bound

    def _launched(self, num_tokens: int, active: int) -> int:
        """The CTAs a dispatch or a combine of `num_tokens` tokens over `active` channels
        launches: past FUSED_ENCODE_TOKENS tokens a channel (prefill) the spare CTAs too, which
        place the channels one per TPC (`kernels/placement.py`); else one a channel."""
        return active + self.spare_ctas if num_tokens > FUSED_ENCODE_TOKENS * active else active

    def _active_for(self, num_input_tokens) -> int:
        """`active_channels(num_input_tokens)`, computed once per bound."""
        return self._bound_for(num_input_tokens)[0]

    def dispatch_for_operator(self, x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                              global_scale) -> DispatchOutput:
        """`dispatch` with every output tensor in its own allocation, as the `cute_ep::dispatch`
        operator must return them (a custom operator's outputs may not alias each other)."""
        return self._checked_dispatch(x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                                      global_scale, separate=True)

    def dispatch_send(self, x, topk_ids, topk_weights=None, *, skip_a2a=False,
                      num_input_tokens=None, global_scale=None):
        """The send part of `dispatch` now and its receive part when the returned hook is called
        (DeepEP's `return_recv_hook`): `(output, hook)`. The send launch returns once this
        rank's tokens are staged and announced, so compute queued between it and `hook()`
        overlaps the peers' transfers; the output is valid on the stream after `hook()`, which
        must run (on every rank) before this Buffer's next dispatch or combine. The tokens must
        fit the staging (at most channels x stage_batches x 16 a rank): the send then waits for
        no receiver."""
        num_tokens, _ = self._checked_inputs(x, topk_ids, topk_weights, num_input_tokens,
                                             global_scale)
        active = self._active_for(num_input_tokens)
        per_channel = -(-num_tokens // active)
        if -(-per_channel // STAGE_BATCH_TOKENS) > self.geo.stage_batches:
            raise ValueError(f"dispatch_send stages every token before any is received: "
                             f"{num_tokens} tokens over {active} channels need "
                             f"{-(-per_channel // STAGE_BATCH_TOKENS)} batches a channel, the "
                             f"staging holds {self.geo.stage_batches} (use dispatch, fewer "
                             f"tokens or more SMs)")
        out = self._launch_dispatch(x, topk_ids, topk_weights, num_tokens, skip_a2a,
                                    num_input_tokens, global_scale, phases=DISPATCH_SEND)
        pending = self._receive_pending

        def hook() -> None:
            if self._receive_pending is not pending:
                raise RuntimeError("this dispatch_send's hook already ran")
            self._receive_pending = None
            # The receive part quantizes nothing (the send part did).
            self._dispatch_launch(*pending[0], DISPATCH_RECEIVE, self._no_bf16_at,
                                  self._no_f32_at, 0, pending[2], pending[3])
        return out, hook

    def _no_receive_pending(self) -> None:
        if self._receive_pending is not None:
            raise RuntimeError("a dispatch_send's receive hook has not run: call it (on every "
                               "rank) before this Buffer's next dispatch or combine")

    def dispatch_wait(self, pending: _PendingDispatch) -> DispatchOutput:
        """The expert-grouped rows of the dispatch `pending` came from (stream-ordered: kernels
        queued after this see them)."""
        return pending.output

    def _launch_dispatch(self, x, topk_ids, topk_weights, num_tokens, skip_a2a,
                         num_input_tokens, global_scale, separate=False,
                         phases: int = DISPATCH_SEND | DISPATCH_RECEIVE,
                         shared_rows=None, direct_tuple=False) -> DispatchOutput:
        """Allocate the outputs and launch (inputs checked). The outputs' small tensors share
        one allocation unless `separate` (the custom operator's outputs may not alias). With
        `phases` DISPATCH_SEND alone, the arguments of the receive launch are kept for the
        hook (`dispatch_send`). `direct_tuple`: the checks found x to be this Buffer's direct
        (codes, scales) input (`_is_direct_input`)."""
        cfg = self.cfg
        weighted = topk_weights is not None
        if cfg.fused_shared_expert and not weighted:
            raise ValueError("fused_shared_expert needs topk_weights: the unreduced [T, K, H] "
                             "combine output has no slot for the shared expert")
        if shared_rows is not None:
            shared_begin, shared_end = shared_rows
        elif skip_a2a:
            shared_begin, shared_end = self._shared_tokens(num_tokens, skip_a2a)
        else:
            shared_begin, shared_end = 0, num_tokens
        by_source = cfg.layout == "sources"
        active, prefixed = self._bound_for(num_input_tokens)

        # The rows the senders read (bytes a token, loaded by 16-byte vectors), and the rows of
        # the scales where those come from rows of their own (scale_stride 0: none).
        scale_source, scale_stride = self._no_f32_at, 0
        encode, x_at, gs_at = 0, self._no_bf16_at, self._no_f32_at
        if cfg.format == "bf16":
            source, source_stride = x.data_ptr(), 2 * cfg.hidden
            load_bytes = source_stride
        elif type(x) is tuple:  # pre-quantized: (codes, scales), a row of each per token
            load_bytes = self._quantized_strides[0]
            source, source_stride, scale_source, scale_stride = self._pair_source(x, direct_tuple)
        else:  # bf16 tokens, quantized into the send buffer before the senders stream them
            gs_at = global_scale.data_ptr() if global_scale is not None else self._no_f32_at
            if num_tokens <= FUSED_ENCODE_TOKENS * active:
                # A few tokens a channel (a decode step): the dispatch kernel quantizes its
                # channels' own tokens while their counts travel, one launch instead of two.
                encode, x_at = 1, x.data_ptr()
            else:
                self._encode_launch(x.data_ptr(), gs_at, num_tokens,
                                    min(self._sms, -(-num_tokens // self._encode_groups)))
            source, source_stride, scale_source, scale_stride, load_bytes = self._encoded

        out = self._dispatch_outputs(Routing(active, num_tokens, weighted, skip_a2a,
                                             shared_begin, shared_end, topk_ids), separate)
        flat = out.__dict__["_flat"]
        scales_at, offsets_at = self._no_f32_at, self._no_i32_at
        if flat is not None:  # the carved outputs, at fixed offsets in one allocation
            base = flat.data_ptr()
            carved = map(base.__add__, self._carved_at)
            if self._scales_at is not None:
                scales_at = base + self._scales_at
            if self._scales_offsets_at is not None:
                offsets_at = base + self._scales_offsets_at
        else:
            h = out.handle
            carved = [out._address(name) for name in self._carved_names[:4]] + \
                [h._address(name) for name in self._carved_names[4:]]
            if cfg.format != "bf16":
                scales_at = out._address("scales")
            if cfg.format == "nvfp4":
                offsets_at = out._address("scales_offsets")
        trace = self.trace
        self.calls[0] += 1
        args = (
            source, source_stride, load_bytes, scale_source, scale_stride,
            topk_ids.data_ptr(), _id_words(topk_ids),
            topk_weights.data_ptr() if weighted else self._no_f32_at,
            out.tokens.data_ptr(), scales_at, offsets_at, *carved,
            out._address("recv_topk_ids") if by_source else self._no_i32_at,
            out._address("recv_topk_weights") if by_source else self._no_f32_at,
            num_tokens, int(skip_a2a), shared_begin, shared_end, int(weighted), active,
            self._launched(num_tokens, active),
            self._no_i64_at if trace is None else trace.data_ptr(), int(trace is not None))
        # The direct input: the senders stage no payload and wait, before the launch ends, for
        # every rank to have pulled theirs (so not for a send part alone, whose receivers run
        # later: `dispatch_send` stages x).
        direct = 0
        if self._input is not None and phases == DISPATCH_SEND | DISPATCH_RECEIVE:
            if cfg.format == "bf16":
                direct = int(source == self._input.data_ptr())
            elif direct_tuple:
                # As the checks found it: a contiguous (codes, scales) pair over the same memory
                # is not the direct input (its rows are not messages apart) and is staged.
                direct = 1
        self._dispatch_launch(*args, phases, x_at, gs_at, encode, prefixed, direct)
        if phases == DISPATCH_SEND:
            # The receive launch reads what these arguments point at: keep the tensors alive.
            self._receive_pending = (args, (x, topk_ids, topk_weights, out), prefixed, direct)
        return out

    def _plan_outputs(self) -> None:
        """The layout of a dispatch's small outputs and its handle in one allocation (their
        shapes depend on the config only)."""
        cfg = self.cfg
        cap, segs, h = cfg.row_capacity, cfg.segments, cfg.hidden
        self._tokens_shape, self._tokens_dtype = {
            "bf16": ((cap, h), torch.bfloat16), "fp8": ((cap, h), torch.float8_e4m3fn),
            "nvfp4": ((cap, h // 2), torch.uint8)}[cfg.format]
        # Zero-element tensors whose new_empty allocates a call's outputs: dtype and device come
        # with them (torch.empty's keywords cost a few tenths of a microsecond to parse).
        self._tokens_like = torch.empty(0, dtype=self._tokens_dtype, device=self.device)
        self._bf16_like = torch.empty(0, dtype=torch.bfloat16, device=self.device)
        # The DispatchOutput fields this format leaves None.
        self._absent = {"bf16": {"scales": None, "scales_offsets": None},
                        "fp8": {"scales_offsets": None}, "nvfp4": {}}[cfg.format]
        if cfg.layout != "sources":
            self._absent = {**self._absent, "recv_topk_ids": None, "recv_topk_weights": None}
        # The input `_common_dispatch` takes: bf16 x, or (codes, scales); None for the sources
        # layout (whose outputs it does not carve).
        self._common_kind = None if cfg.layout == "sources" else \
            "bf16" if cfg.format == "bf16" else "quantized"
        outputs = [("row_offsets", (segs + 1,), torch.int32), ("expert_ids", (segs,), torch.int32),
                   ("counts", (segs,), torch.int32), ("src_info", (cap, 2), torch.int32)]
        if cfg.format == "fp8":
            outputs.append(("scales", (h // 128, cap), torch.float32))
        if cfg.format == "nvfp4":
            outputs += [("scales", (self.nvfp4_scale_bytes,), torch.uint8),
                        ("scales_offsets", (segs,), torch.int32)]
        if cfg.layout == "sources":
            outputs += [("recv_topk_ids", (cap, cfg.topk), torch.int32),
                        ("recv_topk_weights", (cap, cfg.topk), torch.float32)]
        self._output_carve = _Carve(outputs)
        # A carved DispatchOutput's attributes before the call's own (tokens, handle, _flat).
        self._output_fields = {**self._absent, "_carve": self._output_carve}
        names = ("rows", "weights", "tokens", "messages", "channels")  # self._routes' order
        self._handle_carve = _Carve([(name, b.torch_shape, getattr(torch, b.dtype))
                                     for name, b in zip(names, self._routes)],
                                    start=self._output_carve.end)
        # The carved tensors the dispatch kernel takes, in DISPATCH_VARYING's order.
        self._carved_names = ("row_offsets", "expert_ids", "counts", "src_info", "rows",
                              "weights", "tokens", "messages", "channels")
        self._carved_at = [self._output_carve.parts[n][0] for n in self._carved_names[:4]] + \
            [self._handle_carve.parts[n][0] for n in self._carved_names[4:]]
        self._combine_reads_at = [self._handle_carve.parts[n][0] for n in _COMBINE_READS]
        # The scales' offsets in the same allocation, where the format has them.
        parts = self._output_carve.parts
        self._scales_at = parts["scales"][0] if "scales" in parts else None
        self._scales_offsets_at = parts["scales_offsets"][0] if "scales_offsets" in parts else None

    def _dispatch_outputs(self, route: Routing, separate: bool = False) -> DispatchOutput:
        dev = self.device
        tokens = self._tokens_like.new_empty(*self._tokens_shape)
        if separate:
            handle = DispatchHandle._of({"routing": route, **self._handle_carve.separate(dev),
                                         "_flat": None, "_carve": None})
            return DispatchOutput._of({**self._absent, **self._output_carve.separate(dev),
                                       "tokens": tokens, "handle": handle, "_flat": None,
                                       "_carve": None})
        # The rows on their own (a caller may free them after its GEMM while it keeps the
        # handle for combine); scales, metadata and handle in one allocation.
        flat = torch.UntypedStorage(self._handle_carve.end, device=self.device)
        handle = DispatchHandle._of({"routing": route, "_flat": flat,
                                     "_carve": self._handle_carve})
        fields = self._output_fields.copy()  # the absent fields and the carve
        fields["tokens"], fields["handle"], fields["_flat"] = tokens, handle, flat
        return DispatchOutput._of(fields)

    def dispatch(self, x, topk_ids, topk_weights=None, *, skip_a2a=False,
                 num_input_tokens=None, global_scale=None) -> DispatchOutput:
        """`dispatch_async` then `dispatch_wait` (see both). Under `torch.compile` this is the
        `cute_ep::dispatch` operator (`cute_ep.torch_ops`)."""
        if torch.compiler.is_compiling():
            if self.cfg.layout == "sources":
                raise NotImplementedError("the sources layout is eager only")
            if type(x) is tuple:
                raise NotImplementedError("a pre-quantized (codes, scales) input is eager "
                                          "only; under torch.compile pass bf16 x")
            return self._dispatch_via_op(x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                                         global_scale)
        # dispatch_wait(dispatch_async(...)) without the pending object between them.
        return self._eager_dispatch(x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                                    global_scale)

    def _common_dispatch(self, x, topk_ids, topk_weights, num_input_tokens):
        """The eager call a model's layer makes, in one pass: a bf16 layer given bf16 x, an FP8
        or NVFP4 layer given its (codes, scales), each as the kernels take them (the direct
        input's rows too), ids and weights the same, without skip_a2a or a global scale, no
        trace on and no receive hook pending. It launches exactly what `_checked_dispatch`
        launches for the same call (tests/test_host_path.py compares them), by its own bound
        argument block (`COMMON_DISPATCH_VARYING`: what such a call always passes the same is
        written once), through the same quick checks, sources and outputs, with fewer steps
        between (4-9% less host time a decode call on an H200 host,
        perf/results/host-2026-11-29-H200-paths.json; a tenth to a sixth on a steady CPU); any
        other call, good or bad, returns None before anything is allocated, and the general
        path takes it."""
        if self._common_kind is None or self.trace is not None or \
                self._receive_pending is not None:
            return None
        weighted = topk_weights is not None
        direct = 0
        if self._common_kind == "bf16":
            num_tokens = self._quick_bf16(x)
            if num_tokens is None:
                return None
            source = x.data_ptr()
            source_stride = load_bytes = 2 * self.cfg.hidden
            scale_source, scale_stride = self._no_f32_at, 0
            if self._input is not None:
                direct = int(source == self._input.data_ptr())
        else:
            if type(x) is not tuple:
                return None
            if self._input is not None and self._is_direct_input(x):
                num_tokens, direct = x[0].shape[0], 1
            else:
                num_tokens = self._quick_pair(x)
                if num_tokens is None:
                    return None
            load_bytes = self._quantized_strides[0]
            source, source_stride, scale_source, scale_stride = self._pair_source(x, direct)
        if not self._routing_ok(topk_ids, topk_weights, num_tokens) or \
                (self.cfg.fused_shared_expert and not weighted):
            return None
        if num_input_tokens is not None and not num_tokens <= int(num_input_tokens):
            return None
        active, prefixed = self._bound_for(num_input_tokens)

        out = self._dispatch_outputs(Routing(active, num_tokens, weighted, False, 0, num_tokens,
                                             topk_ids))
        base = out.__dict__["_flat"].data_ptr()
        c = self._carved_at
        self.calls[0] += 1
        no_f32 = self._no_f32_at
        self._common_launch(
            source, source_stride, load_bytes, scale_source, scale_stride,
            topk_ids.data_ptr(), _id_words(topk_ids),
            topk_weights.data_ptr() if weighted else no_f32, out.tokens.data_ptr(),
            base + self._scales_at if self._scales_at is not None else no_f32,
            base + self._scales_offsets_at if self._scales_offsets_at is not None else
            self._no_i32_at,
            base + c[0], base + c[1], base + c[2], base + c[3], base + c[4], base + c[5],
            base + c[6], base + c[7], base + c[8],
            num_tokens, num_tokens, int(weighted), active, self._launched(num_tokens, active),
            prefixed, direct)
        return out

    # Combine ------------------------------------------------------------------------------

    def combine_async(self, y: torch.Tensor, handle: DispatchHandle,
                      topk_weights: torch.Tensor | None = None) -> _PendingCombine:
        """Launch the whole combine (one kernel): each token's partial sum over this rank's
        experts goes home, and this rank's tokens are reduced (bf16 `y` [rows, H] in dispatch's
        row order). `combine_wait` returns the output.

        topk_weights: float32 [T, K], only for a dispatch without weights: each (token, k) row
        then comes home as it is and is weighed here, out[t] = sum_k w[t, k] * y[t, k] in fp32
        (DeepEP's low-latency combine, whose weights are the home side's)."""
        return _PendingCombine(self._checked_combine(y, handle, topk_weights))

    def _checked_combine(self, y, handle: DispatchHandle, topk_weights) -> torch.Tensor:
        """`combine_async`'s checks and launch; returns the output."""
        fields = getattr(handle, "__dict__", None)
        if fields is None or fields.get("_carve") is not self._handle_carve:
            self._check_foreign_handle(handle)
        cfg, r = self.cfg, handle.routing
        if self._receive_pending is not None:
            self._no_receive_pending()
        if not (type(y) is torch.Tensor and y.dtype is torch.bfloat16
                and len(shape := y.shape) == 2 and shape[1] == cfg.hidden
                and shape[0] >= cfg.row_capacity and y.get_device() == self._device_index
                and y.is_contiguous() and not y.data_ptr() % 16):  # else say what is wrong
            check_tensor(y, name="y", dtype="bfloat16", align=16,
                         device_index=self._device_index)
            if y.dim() != 2 or y.shape[1] != cfg.hidden:
                raise ValueError(f"y must be bf16 [rows, {cfg.hidden}], got {tuple(y.shape)}")
            if y.shape[0] < cfg.row_capacity:
                raise ValueError(f"y has {y.shape[0]} rows; dispatch's outputs have "
                                 f"row_capacity={cfg.row_capacity} rows (pass the full expert "
                                 f"output buffer)")
        if cfg.layout == "sources":
            # One row per received token, weight 1 (the kernel recorded it so): each token's
            # rows from the ranks it went to, added (DeepEP's combine), weighted or not.
            if topk_weights is not None:
                raise ValueError("the sources layout's combine adds each received row once; "
                                 "weigh the rows before combine")
            return self._launch_combine(y, handle, AT_EXPERTS, self._no_f32_at)
        if topk_weights is None:
            return self._launch_combine(y, handle, AT_EXPERTS if r.weighted else UNREDUCED,
                                        self._no_f32_at)
        if r.weighted:
            raise ValueError("this dispatch carried topk_weights, so its combine is already "
                             "weighted: pass topk_weights to dispatch or to combine, not both")
        t, k = r.num_tokens, cfg.topk
        check_tensor(topk_weights, name="topk_weights", dtype="float32", align=4,
                     device_index=self._device_index)
        if tuple(topk_weights.shape) != (t, k):
            raise ValueError(f"topk_weights must be float32 [{t}, {k}] (the dispatch's "
                             f"tokens), got {tuple(topk_weights.shape)}")
        return self._launch_combine(y, handle, AT_HOME, topk_weights.data_ptr())

    def _check_foreign_handle(self, handle) -> None:
        """A handle this Buffer's dispatch did not carve (the `cute_ep::dispatch` operator's,
        `handle_of`'s, or another Buffer's): combine reads its tensors at this Buffer's sizes, so
        a handle of another configuration is refused here, not read out of bounds."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"combine takes the DispatchHandle of a dispatch (out.handle), got "
                            f"{type(handle).__name__}")
        r, cfg = handle.routing, self.cfg
        want = {name: self._handle_carve.parts[name][1] for name in _COMBINE_READS}
        got = {name: tuple(getattr(handle, name).shape) for name in want}
        ids = tuple(r.topk_ids.shape)
        if got != want or ids != (r.num_tokens, cfg.topk) or r.channels > self.geo.channels:
            raise ValueError(f"this handle is not of a dispatch with this Buffer's configuration "
                             f"({cfg}): its rows, weights and channels are {got} (here "
                             f"{want}), its ids {ids}, its channels {r.channels} (here at most "
                             f"{self.geo.channels})")

    def _combine_rows(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Combine, weighted at the experts, of a handle whose rows all lie below y's row count
        (`cute_ep.deepep`'s one-row messages into its own [N, H] rows): y bf16, contiguous."""
        check_tensor(y, name="x", dtype="bfloat16", align=16, device_index=self._device_index)
        return self._launch_combine(y, handle, AT_EXPERTS, self._no_f32_at)

    def _launch_combine(self, y, handle, mode: int, home: int) -> torch.Tensor:
        """`home`: the address of the home side's weights (a placeholder's where none)."""
        r, k, hidden = handle.routing, self.cfg.topk, self.cfg.hidden
        t = r.num_tokens
        out = self._bf16_like.new_empty(t, k, hidden) if mode == UNREDUCED else \
            self._bf16_like.new_empty(t, hidden)
        fields = handle.__dict__
        # This Buffer's carved handle, none of the three read through a field of its own (a
        # view already made, or a tensor put in its place, as autograd's unit weights are).
        if fields.get("_carve") is self._handle_carve and "rows" not in fields and \
                "weights" not in fields and "channels" not in fields:
            base = fields["_flat"].data_ptr()
            rows, weights, channels = map(base.__add__, self._combine_reads_at)
        else:
            rows, weights, channels = handle._addresses(_COMBINE_READS)
        trace = self.combine_trace
        ids = r.topk_ids
        self.calls[1] += 1
        self._combine_launch(
            y.data_ptr(), rows, weights, channels, ids.data_ptr(), _id_words(ids),
            out.data_ptr(),
            home, t, mode, int(r.skip_a2a), r.shared_begin, r.shared_end, r.channels,
            self._launched(t, r.channels),
            self._no_i64_at if trace is None else trace.data_ptr(),
            int(trace is not None))
        return out

    def combine_wait(self, pending: _PendingCombine) -> torch.Tensor:
        """The combined tokens: bf16 [T, H], or the unreduced [T, K, H] when dispatch had no
        weights (stream-ordered: kernels queued after this see them)."""
        return pending.out

    def combine(self, y: torch.Tensor, handle: DispatchHandle,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """`combine_async` then `combine_wait` (see both). Under `torch.compile` this is the
        `cute_ep::combine` operator."""
        if torch.compiler.is_compiling():
            if topk_weights is not None:
                raise NotImplementedError("combine's topk_weights (weights at home) are eager "
                                          "only; under torch.compile pass them to dispatch")
            r = handle.routing
            return torch.ops.cute_ep.combine(self.op_id, y, r.topk_ids, handle.rows,
                                             handle.weights, handle.channels, r.weighted,
                                             r.skip_a2a, r.channels)
        # combine_wait(combine_async(...)) without the pending object between them.
        return self._checked_combine(y, handle, topk_weights)

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
                what.append(f"an expert id outside [0, {self.cfg.experts}) (and not -1, "
                            f"an empty slot)")
            if bad_id & ERROR_ID_TWICE:
                what.append("a token listing the same expert twice (the later k was dropped)")
            raise ValueError(f"topk_ids held {' and '.join(what)}; those (token, k) pairs were "
                             f"dropped from this dispatch and its combine")
        if bad_counts & ERROR_CHANNELS:
            raise ValueError("ranks dispatched with different num_input_tokens (so over different "
                             "numbers of channels, or with counts of different kinds); pass the "
                             "same value on every rank. This Buffer's streams are now out of "
                             "step: recreate it")
        if bad_counts & ERROR_CAPACITY:
            raise ValueError(f"a dispatch received more rows than its output holds "
                             f"(EPConfig.recv_capacity={self.cfg.recv_capacity}, "
                             f"row_capacity={self.cfg.row_capacity} with padding): the rows "
                             f"past it, their padding and scales were not written (its "
                             f"row_offsets[-1] is the rows it needed) and its combine adds "
                             f"zeros for them. Raise recv_capacity (None: the worst case, "
                             f"{self.cfg.max_recv} rows)")
        if bad_counts:
            raise RuntimeError("received counts were inconsistent; the affected rows were "
                               "dropped")

    def device_state(self) -> dict:
        """What this rank's kernels of the layer have done, read while they may still be running
        (a side stream, nothing synchronised with the current one): for a layer that stalls.
        Stream positions and peer-visible counters are [phase, kind, rank, channel] (phase:
        dispatch, combine; kind: made ready, done with; `layouts.channels.counters_layout`);
        count flags [parity, source, channel] (`layouts.channels.count_flag`: the round, the
        channels the source used, the kind of its counts)."""
        geo, off, r = self.geo, self.channel_offsets, self.cfg.ranks
        side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(side):
            def read(part: str, nbytes: int, dtype) -> torch.Tensor:
                at = off[part]
                return self.sym[at:at + nbytes].view(dtype).cpu()

            counters = geo.counters().cosize()
            flags = geo.count_flags().cosize()
            state = {
                "rank": self.rank, "ranks": r, "channels": geo.channels,
                "format": self.cfg.format, "shared": self.cfg.fused_shared_expert,
                "group": getattr(self.group, "group_name", None),
                "dispatches": self.calls[0], "combines": self.calls[1],
                "round": int(self.dispatch_epoch.cpu()), "done": int(self.dispatch_done[0].cpu()),
                "error": self.error.cpu().tolist(),
                "positions": self.streams.cpu().view(2, 2, r, geo.channels).tolist(),
                "counters": read("counters", counters * 8, torch.int64)
                .view(2, 2, r, geo.channels).tolist(),
                "count_flags": read("count_flags", flags * 8, torch.int64)
                .view(2, r, geo.channels).tolist(),
            }
            if self.trace is not None:
                state["trace"] = self.trace.cpu().tolist()
            if self.combine_trace is not None:
                state["combine_trace"] = self.combine_trace.cpu().tolist()
        return state

    # For the custom operators (cute_ep.torch_ops) --------------------------------------------

    def _dispatch_via_op(self, x, topk_ids, topk_weights, skip_a2a, num_input_tokens,
                         global_scale) -> DispatchOutput:
        """`dispatch` as the `cute_ep::dispatch` operator, reassembled into a DispatchOutput."""
        t = torch.ops.cute_ep.dispatch(self.op_id, x, topk_ids, topk_weights, skip_a2a,
                                       num_input_tokens, global_scale)
        fields = dict(zip(DISPATCH_FIELDS, t))
        handle = self.handle_of(topk_ids, fields["rows"], fields["weights"], fields["channels"],
                                topk_weights is not None, skip_a2a,
                                self.active_channels(num_input_tokens), fields["source_tokens"],
                                fields["messages"])
        fmt = self.cfg.format
        return DispatchOutput(fields["tokens"], fields["scales"] if fmt != "bf16" else None,
                              fields["row_offsets"], fields["expert_ids"], fields["src_info"],
                              fields["counts"], handle,
                              fields["scales_offsets"] if fmt == "nvfp4" else None, None, None)

    def output_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every tensor `torch.ops.cute_ep.dispatch` returns, in its order:
        the DispatchOutput's (tokens, scales, row_offsets, expert_ids, src_info, counts,
        scales_offsets; absent ones empty) then the handle's (rows, weights, source tokens,
        messages). They depend on the config only, never on the routing."""
        cfg = self.cfg
        cap, h, segs = cfg.row_capacity, cfg.hidden, cfg.segments
        tokens = (self._tokens_shape, self._tokens_dtype)
        scales = {"bf16": ((0,), torch.float32), "fp8": ((h // 128, cap), torch.float32),
                  "nvfp4": ((self.nvfp4_scale_bytes,), torch.uint8)}[cfg.format]
        scales_offsets = ((segs,) if cfg.format == "nvfp4" else (0,), torch.int32)
        routes = [(b.torch_shape, getattr(torch, b.dtype)) for b in self._routes]
        return [tokens, scales, ((segs + 1,), torch.int32), ((segs,), torch.int32),
                ((cap, 2), torch.int32), ((segs,), torch.int32), scales_offsets, *routes]

    def handle_of(self, topk_ids, rows, weights, channels, weighted: bool, skip_a2a: bool,
                  active: int, source_tokens=None, messages=None) -> DispatchHandle:
        """A DispatchHandle from the tensors combine reads (what the dispatch operator
        returned) and the dispatch's arguments (`active`: its `active_channels`)."""
        num_tokens = topk_ids.shape[0]
        begin, end = self._shared_tokens(num_tokens, skip_a2a)
        none = rows.new_empty(0)
        return DispatchHandle(Routing(int(active), num_tokens, bool(weighted), bool(skip_a2a),
                                      begin, end, _contiguous_ids(topk_ids)),
                              rows, weights, none if source_tokens is None else source_tokens,
                              none if messages is None else messages, channels)

    def _prefixed_for(self, num_input_tokens) -> int:
        """The kind of counts a dispatch bounded by `num_input_tokens` (else
        max_tokens_per_rank) sends (`layouts.channels.prefixed_counts`: 0 its channels' own, 1
        prefixed, 2 block-prefixed): the same on every rank, like `active_channels`; computed
        once per bound (`_bound_for`)."""
        return self._bound_for(num_input_tokens)[1]

    def active_channels(self, num_input_tokens: int | None) -> int:
        """The channels a dispatch splits each rank's tokens over: every channel of the budget,
        or for a small `num_input_tokens` (decode) one per TOKENS_PER_CHANNEL tokens, so fewer
        CTAs run, wait and count. Every rank must pass the same `num_input_tokens`."""
        return active_channels(self.geo.channels, self.cfg.max_tokens_per_rank, num_input_tokens)

    def trace_dispatch(self, on: bool = True) -> None:
        """Record, on every later dispatch, each channel's timeline (`layouts.channels.
        TRACE_FIELDS`: %globaltimer stamps, then the senders' and the receivers' times by part)
        into `self.trace`, an int64 [channels, fields] tensor; off: record nothing (the default,
        no cost)."""
        from layouts.channels import TRACE_FIELDS, trace_layout

        if not on:
            self.trace = None
            return
        layout = trace_layout(self.geo.channels)
        self.trace = torch.zeros(layout.cosize(), dtype=torch.int64, device=self.device).view(
            self.geo.channels, len(TRACE_FIELDS))

    def trace_combine(self, on: bool = True) -> None:
        """Record, on every later combine, each channel's timeline (`layouts.channels.
        COMBINE_TRACE_FIELDS`: when its senders and receivers finished, their longest waits)
        into `self.combine_trace`, an int64 [channels, fields] tensor; off: record nothing."""
        from layouts.channels import COMBINE_TRACE_FIELDS, trace_layout

        if not on:
            self.combine_trace = None
            return
        layout = trace_layout(self.geo.channels, COMBINE_TRACE_FIELDS)
        self.combine_trace = torch.zeros(layout.cosize(), dtype=torch.int64,
                                         device=self.device).view(self.geo.channels,
                                                                  len(COMBINE_TRACE_FIELDS))

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
    def sms(self) -> int:
        """The SMs this layer's communication occupies (fixed at construction)."""
        return self._sms

    def _check_dispatch_inputs(self, x, topk_ids, topk_weights) -> tuple[int, bool]:
        """The token count, and whether x is this Buffer's direct (codes, scales) input."""
        cfg, dev = self.cfg, self._device_index
        # The common cases by cheap reads (`_quick_bf16`, `_quick_pair`, `_routing_ok`: a
        # microsecond or two); anything else, good or bad, takes the detailed checks below,
        # which say what is wrong.
        if type(x) is tuple:
            if self._input is not None and self._is_direct_input(x):
                t = x[0].shape[0]
                if not self._routing_ok(topk_ids, topk_weights, t):
                    self._check_routing(topk_ids, topk_weights, t)
                return t, True
            t = self._quick_pair(x)
            if t is not None and self._routing_ok(topk_ids, topk_weights, t):
                return t, False
            num_tokens = self._check_quantized_input(x)
            self._check_routing(topk_ids, topk_weights, num_tokens)
            return num_tokens, False
        t = self._quick_bf16(x)
        if t is not None and self._routing_ok(topk_ids, topk_weights, t):
            return t, False
        check_tensor(x, name="x", dtype="bfloat16", align=16, device_index=dev)
        if x.dim() != 2 or x.shape[1] != cfg.hidden:
            raise ValueError(f"x must be bf16 [T, {cfg.hidden}], got {tuple(x.shape)}")
        num_tokens = x.shape[0]
        self._check_routing(topk_ids, topk_weights, num_tokens)
        return num_tokens, False

    def _quick_bf16(self, x) -> int | None:
        """The token count of a bf16 x [T, H] the kernels read as it is (this device,
        contiguous, 16-byte aligned), by cheap reads; None for anything else, good or bad."""
        if type(x) is torch.Tensor and len(shape := x.shape) == 2 and \
                x.dtype is torch.bfloat16 and shape[1] == self.cfg.hidden and \
                x.get_device() == self._device_index and x.is_contiguous() and \
                not x.data_ptr() % 16:
            return shape[0]
        return None

    def _quick_pair(self, x: tuple) -> int | None:
        """The token count of a pre-quantized (codes, scales) the kernels read as they are
        (`_quantized_fast`'s dtypes and columns, this device, contiguous, aligned), by cheap
        reads; None for anything else, good or bad."""
        fast, dev, tensor = self._quantized_fast, self._device_index, torch.Tensor
        if fast is None or len(x) != 2:
            return None
        codes, scales = x
        if type(codes) is tensor and type(scales) is tensor and len(shape := codes.shape) == 2:
            t = shape[0]
            if (codes.dtype is fast[0] and shape[1] == fast[1]
                    and scales.dtype is fast[2] and scales.shape == (t, fast[3])
                    and codes.get_device() == dev and scales.get_device() == dev
                    and codes.is_contiguous() and scales.is_contiguous()
                    and not codes.data_ptr() % 16 and not scales.data_ptr() % 4):
                return t
        return None

    def _pair_source(self, x: tuple, direct: bool) -> tuple[int, int, int, int]:
        """Where the senders read a checked pre-quantized input: (codes address, their row
        bytes, scales address, their row bytes). `direct`: the direct input's rows, messages
        apart; else the tensors' own rows, as their strides space them where the Buffer has a
        direct input (a view of it may be given), else as their shapes give."""
        if direct:
            d = self._direct
            return d.codes_at, d.codes_row_bytes, d.scales_at, d.scales_row_bytes
        codes, scales = x
        if self._input is not None:
            return (codes.data_ptr(), codes.stride(0) * codes.element_size(),
                    scales.data_ptr(), scales.stride(0) * scales.element_size())
        code_bytes, scale_bytes = self._quantized_strides
        return codes.data_ptr(), code_bytes, scales.data_ptr(), scale_bytes

    def _routing_ok(self, topk_ids, topk_weights, t: int) -> bool:
        """Whether `t` tokens fit and their ids and weights are what the kernels take as they
        are (cheap reads only: False sends the caller to the detailed checks)."""
        cfg, dev, tensor = self.cfg, self._device_index, torch.Tensor
        return (t <= cfg.max_tokens_per_rank and type(topk_ids) is tensor
                and topk_ids.dtype in _ID_DTYPES and topk_ids.shape == (t, cfg.topk)
                and topk_ids.get_device() == dev and topk_ids.is_contiguous()
                and (topk_weights is None or (
                    type(topk_weights) is tensor and topk_weights.dtype is torch.float32
                    and topk_weights.shape == (t, cfg.topk)
                    and topk_weights.get_device() == dev and topk_weights.is_contiguous()
                    and not topk_weights.data_ptr() % 4)))

    def _check_routing(self, topk_ids, topk_weights, num_tokens: int) -> None:
        """The token count against the capacity, then the ids and weights of that many."""
        cfg, dev = self.cfg, self._device_index
        if num_tokens > cfg.max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceeds max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}")
        check_tensor(topk_ids, name="topk_ids", dtype=None, device_index=dev)
        if topk_ids.dtype not in _ID_DTYPES or \
                tuple(topk_ids.shape) != (num_tokens, cfg.topk):
            raise ValueError(f"topk_ids must be int32/int64 [{num_tokens}, {cfg.topk}], got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
        if topk_weights is not None:
            check_tensor(topk_weights, name="topk_weights", dtype="float32", align=4,
                         device_index=dev)
            if tuple(topk_weights.shape) != (num_tokens, cfg.topk):
                raise ValueError(f"topk_weights must be float32 [{num_tokens}, {cfg.topk}], got "
                                 f"{tuple(topk_weights.shape)}")

    def _is_direct_input(self, x: tuple) -> bool:
        """x is the first T rows of this Buffer's direct input (codes, scales), as its views
        give them (compared with the views' addresses, dtypes, shapes and strides, read once
        in `_attach`: each read of a tensor's attribute costs a few tenths of a microsecond)."""
        if self._direct is None:  # a bf16 layer's direct input: x, not a pair
            return False
        codes, scales = x
        if type(codes) is not torch.Tensor or type(scales) is not torch.Tensor:
            return False
        # Unpacked at once: cheaper than a named read of each field.
        c_at, s_at, c_dtype, s_dtype, c_cols, s_cols, rows, c_strides, s_strides, _, _ = \
            self._direct
        if codes.data_ptr() != c_at or scales.data_ptr() != s_at:
            return False
        c_shape, s_shape = codes.shape, scales.shape
        return (codes.dtype is c_dtype and scales.dtype is s_dtype
                and len(c_shape) == 2 and len(s_shape) == 2
                and c_shape[1] == c_cols and s_shape[1] == s_cols
                and c_shape[0] == s_shape[0] <= rows
                and codes.stride() == c_strides and scales.stride() == s_strides)

    def _check_quantized_input(self, x: tuple) -> int:
        """An FP8 or NVFP4 layer's pre-quantized input (codes, scales), checked; returns T."""
        cfg = self.cfg
        h = cfg.hidden
        if self._quantized_rows is None or len(x) != 2:
            raise TypeError(f"x may be a (codes, scales) tuple only for an fp8 or nvfp4 Buffer "
                            f"(this one is {cfg.format}): fp8 codes float8_e4m3fn [T, H] and "
                            f"scales float32 [T, H / 128]; nvfp4 codes uint8 [T, H / 2] and "
                            f"scales uint8 [T, H / 16]")
        if cfg.format == "nvfp4" and h % 64:
            raise ValueError(f"a pre-quantized nvfp4 input needs a hidden size that is a multiple "
                             f"of 64 (16-byte code rows, 4-byte scale rows), got {h}; pass the "
                             f"bf16 tokens instead")
        (code_dtype, code_cols, code_what), (scale_dtype, scale_cols, scale_what) = \
            self._quantized_rows
        codes, scales = x
        dev = self._device_index
        check_tensor(codes, name="x codes", dtype=code_dtype, align=16, device_index=dev)
        check_tensor(scales, name="x scales", dtype=scale_dtype, align=4, device_index=dev)
        if codes.dim() != 2 or codes.shape[1] != code_cols:
            raise ValueError(f"x codes must be {code_what} = [T, {code_cols}], got "
                             f"{tuple(codes.shape)}")
        t = codes.shape[0]
        if tuple(scales.shape) != (t, scale_cols):
            raise ValueError(f"x scales must be {scale_what} = [{t}, {scale_cols}], got "
                             f"{tuple(scales.shape)}")
        return t

    def _check_global_scale(self, global_scale, quantized: bool) -> None:
        """`quantized`: x is a (codes, scales) tuple, already scaled."""
        if self.cfg.format != "nvfp4" or quantized:
            if global_scale is not None:
                raise ValueError(
                    "global_scale quantizes bf16 tokens; a pre-quantized (codes, scales) input "
                    "is already scaled: pass global_scale=None" if quantized else
                    f"global_scale is for nvfp4 dispatch only; this Buffer dispatches "
                    f"{self.cfg.format}")
            return
        if global_scale is None:
            raise ValueError("nvfp4 dispatch needs global_scale: an fp32 CUDA tensor of one "
                             "element (the same on every rank)")
        # The common case in cheap reads; anything else takes the checks that say what is wrong.
        if (type(global_scale) is torch.Tensor and global_scale.dtype is torch.float32
                and global_scale.numel() == 1 and global_scale.get_device() == self._device_index
                and not global_scale.data_ptr() % 4):
            return
        check_tensor(global_scale, name="global_scale", dtype="float32", align=4,
                     device_index=self._device_index)
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must hold one element, got shape "
                             f"{tuple(global_scale.shape)}")


def _quantized_rows(cfg: EPConfig):
    """A pre-quantized input's code and scale rows, each (dtype, columns, how the error names
    it); None for a format that takes none (planned once per Buffer, not on every dispatch)."""
    h = cfg.hidden
    return {"fp8": (("float8_e4m3fn", h, "float8_e4m3fn [T, H]"),
                    ("float32", h // 128, "float32 [T, H / 128]")),
            "nvfp4": (("uint8", h // 2, "uint8 [T, H / 2] (two e2m1 codes a byte)"),
                      ("uint8", h // 16, "uint8 [T, H / 16] (e4m3 bytes, linear)"))
            }.get(cfg.format)


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
    if cfg.nodes > 1:
        raise NotImplementedError(
            f"gpus_per_node={cfg.gpus_per_node} puts the {cfg.ranks} ranks on {cfg.nodes} nodes; "
            f"a Buffer serves the ranks of one host: use cute_ep.NodeBuffer (NVSHMEM between "
            f"nodes), or leave gpus_per_node unset")
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


def stall_report() -> str:
    """Every live Buffer of this process, as `Buffer.device_state` reads it, in lines a person
    can compare across ranks: host calls against the device's round counter, the error record,
    and per (phase, kind, peer) each stream's position by channel (a channel that lags shows as
    its own run). For a layer that does not finish: which wait never ends."""
    lines = []
    for buf in sorted(_LIVE, key=lambda b: (str(b.group), b.rank, id(b))):
        try:
            st = buf.device_state()
        except Exception as exc:  # a report must not fail on one Buffer
            lines.append(f"Buffer {buf.cfg.format}: state unreadable ({exc})")
            continue
        lines.append(
            f"Buffer {st['format']}{' +shared' if st['shared'] else ''} group {st['group']} "
            f"rank {st['rank']}/{st['ranks']} ({st['channels']} channels): host launched "
            f"{st['dispatches']} dispatches, {st['combines']} combines; device round "
            f"{st['round']}, CTAs done {st['done']}, error {st['error']}")
        for name, table in (("positions", st["positions"]), ("counters", st["counters"])):
            for phase, by_kind in zip(("dispatch", "combine"), table):
                for kind, by_peer in zip(("ready", "done"), by_kind):
                    runs = "; ".join(f"rank {p}: {_channel_runs(v)}"
                                     for p, v in enumerate(by_peer))
                    lines.append(f"  {name} {phase} {kind}: {runs}")
        for parity, by_source in enumerate(st["count_flags"]):
            runs = "; ".join(f"rank {p}: {_channel_runs([read_count_flag(w) for w in v])}"
                             for p, v in enumerate(by_source))
            lines.append(f"  count flags parity {parity}: {runs}")
        for name, fields in (("trace", "TRACE_FIELDS"), ("combine_trace",
                                                          "COMBINE_TRACE_FIELDS")):
            if name in st:
                lines.append(f"  {name}, each channel's stamps in us after its start "
                             f"(durations in ns as recorded):")
                lines += [f"    {field}: {_channel_runs(values)}"
                          for field, values in _trace_columns(st[name], fields)]
    return "\n".join(lines) if lines else "no live Buffer"


def _trace_columns(rows: list[list[int]], fields_name: str):
    """(field, per-channel values) of a trace: %globaltimer stamps as microseconds after the
    channel's start (0 where unset), the rest (durations) as recorded."""
    import layouts.channels as channels

    fields = getattr(channels, fields_name)
    for f, field in enumerate(fields):
        values = [row[f] for row in rows]
        if field != "start" and not field.endswith("_ns"):
            values = [(v - row[0]) // 1000 if v and row[0] else 0 for v, row in zip(values, rows)]
        yield field, values


def _channel_runs(values: list[int]) -> str:
    """Per-channel values as runs: "5 (ch 0-11) 4 (ch 12-23)", or one value for all."""
    if len(set(values)) == 1:
        return str(values[0])
    runs, start = [], 0
    for c in range(1, len(values) + 1):
        if c == len(values) or values[c] != values[start]:
            chans = f"{start}" if c - 1 == start else f"{start}-{c - 1}"
            runs.append(f"{values[start]} (ch {chans})")
            start = c
    return " ".join(runs)
