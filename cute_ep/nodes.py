"""Expert parallelism over several nodes: NVSHMEM between nodes, the intranode Buffer inside each.

`NodeBuffer(cfg)` with `cfg.gpus_per_node = G` puts the R ranks on N = R / G nodes (rank
r = n * G + l is GPU l of node n) and the E experts on them in order, E / N a node.

Dispatch: GPU j of every node holds the tokens of the N sources j * N .. j * N + N - 1. Rank r
sends each token, through NVSHMEM (`kernels.net_put`: a put with a signal, bounded waits), once
to the holder of r's tokens on every node that has one of the token's experts (its own node
included). A holder lays the tokens it received out as one input, source s's token t at row
s * T + t, and runs its node's intranode dispatch on it (the Buffer over the node's G ranks and
its experts, the ids made the node's, the other nodes' experts -1), which fans the tokens out
over NVLink to their experts' GPUs. That dispatch orders an expert's rows by GPU and then by
input row, which with the sources held in blocks is by source rank and token: the intranode
path's order. Combine runs the other way: each node's intranode combine reduces every token over
the node's experts, and the holder puts those partial sums back to each token's rank, which adds
the nodes' sums in fp32, in node order.

The outputs are the intranode path's for the same routing: rows grouped by local expert, inside
an expert by source rank and token, `src_info` the source token and k slot. No peer mapping of
cute-ep's is opened between nodes (a node's Buffer maps its own ranks only); NVSHMEM carries
everything that crosses.

This first version is eager (each network leg reads its counts on the host), BF16 / FP8 /
NVFP4 (bf16 or pre-quantized input) and weighted combine. Holding sources in blocks makes a rank
send to GPUs of other indices, which a rail-aligned network prefers to avoid. Needs the
`multinode` extra.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cute_ep.ep import DEFAULT_SMS, Buffer
from cute_ep.runtime import nvshmem
from cute_ep.runtime.comm import DEFAULT_TIMEOUT_S, PeerTimeout, agree_on_config
from layouts import EPConfig
from layouts.algebra import align_up
from layouts.formats import ALIGN
from layouts.nodes import HEADER_BYTES, NodeSlots, node_config

__all__ = ["NodeBuffer", "NodeDispatchOutput", "NodeHandle", "check_node_inputs", "node_config"]

# CTAs of each put between nodes (`kernels.net_put`) where the layer names no SM budget (a
# Buffer's default): each moves its share of the bytes, all its threads together, and signals
# once.
NET_CTAS = DEFAULT_SMS
DISPATCH, COMBINE = 0, 1
KINDS = ("dispatch", "combine")


@dataclasses.dataclass
class NodeHandle:
    """What a NodeBuffer's combine needs from its dispatch."""

    inner: object  # the node's DispatchHandle
    num_tokens: int  # this rank's own tokens
    sent: list  # node m -> int64 indices of this rank's tokens sent to node m's holder
    returns: list  # held source i -> the node input's rows of its tokens, as they came


@dataclasses.dataclass
class NodeDispatchOutput:
    """`DispatchOutput`'s fields for a dispatch over several nodes (SPEC section 3): the
    node's rows, `src_info` naming each row's token at its source rank."""

    tokens: torch.Tensor
    scales: torch.Tensor | None
    row_offsets: torch.Tensor
    expert_ids: torch.Tensor
    src_info: torch.Tensor
    counts: torch.Tensor
    scales_offsets: torch.Tensor | None
    handle: NodeHandle


def check_node_config(cfg: EPConfig) -> None:
    """What this version carries between nodes; raises NotImplementedError naming the rest."""
    if cfg.gpus_per_node is None or cfg.nodes < 2:
        raise ValueError("NodeBuffer is for ranks on several nodes: set gpus_per_node to the GPUs "
                         "of one node (Buffer serves one node)")
    if cfg.fused_shared_expert or cfg.layout != "packed" or cfg.recv_capacity is not None:
        raise NotImplementedError("between nodes: the packed layout, without a fused shared "
                                  "expert or a recv_capacity, so far")


def pack_rows(parts: list[torch.Tensor], topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token as one uint8 row that crosses the network whole: its payload `parts` (each
    [T, ...], as bytes), then its K expert ids (int32), K weights (float32) and its index,
    padded to 16 bytes."""
    tokens = topk_ids.shape[0]
    index = torch.arange(tokens, dtype=torch.int32, device=topk_ids.device)[:, None]
    meta = torch.cat([topk_ids.to(torch.int32), topk_weights.view(torch.int32), index], dim=1)
    cols = [p.reshape(tokens, p.shape[1:].numel()).view(torch.uint8) for p in parts] + \
        [meta.view(torch.uint8)]
    width = sum(c.shape[1] for c in cols)
    pad = align_up(width, ALIGN) - width
    if pad:
        cols.append(torch.zeros(tokens, pad, dtype=torch.uint8, device=topk_ids.device))
    return torch.cat(cols, dim=1)


def unpack_rows(rows: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]],
                topk: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_rows` undone for rows [T, B]: the payload parts (each `shapes[i]` = (its shape
    past T, dtype)), the ids (int32 [T, K]), weights (float32 [T, K]) and token indices (int64)."""
    tokens, at, parts = rows.shape[0], 0, []
    for shape, dtype in shapes:
        width = torch.Size(shape).numel() * dtype.itemsize
        parts.append(rows[:, at:at + width].contiguous().view(dtype).reshape(tokens, *shape))
        at += width
    meta = rows[:, at:at + 4 * (2 * topk + 1)].contiguous().view(torch.int32)
    return parts, meta[:, :topk], meta[:, topk:2 * topk].view(torch.float32), \
        meta[:, 2 * topk].long()


def check_node_inputs(cfg: EPConfig, device: torch.device, x, topk_ids, topk_weights) -> int:
    """A NodeBuffer dispatch's inputs checked as `Buffer.dispatch` checks its own (dtype, shape,
    device, contiguity, the token bound, and every expert id in [-1, E), read on the device:
    an id past the last node would otherwise go nowhere, silently); returns the token count."""
    h = cfg.hidden

    def placed(t, name):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the layer's GPU is {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

    if type(x) is tuple:
        wanted = {"fp8": (("x codes", torch.float8_e4m3fn, h),
                          ("x scales", torch.float32, h // 128)),
                  "nvfp4": (("x codes", torch.uint8, h // 2), ("x scales", torch.uint8, h // 16))}
        if cfg.format not in wanted or len(x) != 2:
            raise TypeError(f"x may be a (codes, scales) tuple only for an fp8 or nvfp4 layer "
                            f"(this one is {cfg.format})")
        tokens = None
        for t, (name, dtype, cols) in zip(x, wanted[cfg.format]):
            placed(t, name)
            if t.dtype != dtype or t.dim() != 2 or t.shape[1] != cols or \
                    tokens not in (None, t.shape[0]):
                raise ValueError(f"{name} must be {dtype} [T, {cols}] (T the same for codes and "
                                 f"scales), got {t.dtype} {tuple(t.shape)}")
            tokens = t.shape[0]
    else:
        placed(x, "x")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != h:
            raise ValueError(f"x must be bf16 [T, {h}], got {x.dtype} {tuple(x.shape)}")
        tokens = x.shape[0]
    if tokens > cfg.max_tokens_per_rank:
        raise ValueError(f"{tokens} tokens, more than max_tokens_per_rank="
                         f"{cfg.max_tokens_per_rank}")
    placed(topk_ids, "topk_ids")
    if topk_ids.dtype not in (torch.int32, torch.int64) or \
            tuple(topk_ids.shape) != (tokens, cfg.topk):
        raise ValueError(f"topk_ids must be int32 or int64 [{tokens}, {cfg.topk}], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights is None:
        raise NotImplementedError("between nodes combine returns weighted sums: pass "
                                  "topk_weights")
    placed(topk_weights, "topk_weights")
    if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (tokens, cfg.topk):
        raise ValueError(f"topk_weights must be float32 [{tokens}, {cfg.topk}], got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if tokens and bool(((topk_ids < -1) | (topk_ids >= cfg.experts)).any()):
        raise ValueError(f"topk_ids holds expert ids outside [0, {cfg.experts}) that are not -1")
    return tokens


def localize_ids(topk_ids: torch.Tensor, node: int, node_experts: int) -> torch.Tensor:
    """Global expert ids as node `node`'s (int32): e - node * node_experts for its experts, -1
    for every other node's (and for -1)."""
    ids = topk_ids.to(torch.int32)
    first = node * node_experts
    mine = (ids >= first) & (ids < first + node_experts)
    return torch.where(mine, ids - first, torch.full_like(ids, -1))


class NodeBuffer:
    """A layer's expert parallelism over several nodes (module docstring)."""

    def __init__(self, cfg: EPConfig, group=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 sms: int | None = None, net_ctas: int | None = None):
        """`sms`: the intranode Buffer's SM budget (its default where None); `net_ctas`: the
        CTAs of each put between nodes, by default the same budget."""
        check_node_config(cfg)
        self.group = group or dist.group.WORLD
        world = dist.get_world_size(self.group)
        if cfg.ranks != world:
            raise ValueError(f"the config has ranks={cfg.ranks}, the process group has {world}")
        if world != dist.get_world_size():
            raise NotImplementedError("NodeBuffer spans the whole torch.distributed world (its "
                                      "NVSHMEM PEs are the world's ranks)")
        self.cfg = cfg
        self.rank = dist.get_rank(self.group)
        self.nodes, self.gpus = cfg.nodes, cfg.node_ranks
        self.node, self.local = divmod(self.rank, self.gpus)
        self.node_experts = cfg.experts // self.nodes
        self.timeout_s = float(timeout_s)
        self.net_ctas = int(net_ctas if net_ctas is not None else sms or NET_CTAS)
        self.device = torch.device("cuda", torch.cuda.current_device())
        agree_on_config({"kind": "nodes", "config": repr(cfg), "timeout_s": self.timeout_s,
                         "net_ctas": self.net_ctas}, self.group)
        # Every rank makes every node's group, in node order (torch.distributed requires it).
        groups = [dist.new_group(list(range(m * self.gpus, (m + 1) * self.gpus)))
                  for m in range(self.nodes)]
        self.node_group = groups[self.node]
        kwargs = {} if sms is None else {"sms": sms}
        self.inner = Buffer(node_config(cfg), self.node_group, timeout_s=timeout_s, **kwargs)
        nvshmem.init(self.group)
        from cute_ep.runtime.launch import runtime

        self._put = runtime().select("net_put")
        # The parts of `layouts.nodes.NodeSlots`, carved from one symmetric allocation (every
        # PE allocates the same, in the same order, so each part is at the same offset on all).
        slots = NodeSlots(cfg)
        at = slots.symmetric_offsets()
        self._heap = nvshmem.symmetric_bytes(at["total"])
        sizes = slots.symmetric_bytes()

        def part(name):
            return self._heap[at[name]:at[name] + sizes[name]]

        self._send, self._recv = [], []
        for leg in ("dispatch", "combine"):
            b = slots.slot_bytes(leg)
            self._send.append(part(f"{leg}_send")[:self.nodes * b].view(self.nodes, b))
            self._recv.append(part(f"{leg}_recv")[:self.nodes * b].view(self.nodes, b))
        self._signals = part("signals")[:4 * 8].view(torch.int64).view(2, 2)  # [data / credit, leg]
        self._boxes = part("boxes").view(2, HEADER_BYTES)
        self._heap.zero_()
        self._error = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._rounds = [0, 0]
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)

    # Who sends to whom. GPU j of every node holds the tokens of the N sources r = j * N ..
    # j * N + N - 1: it receives them and dispatches them inside its node. A node's dispatch
    # orders an expert's rows by the node's GPU and then by input row, so with the sources held
    # in blocks, in order, it orders them by source rank and token, as the intranode path does.

    def _holder(self, node: int, source: int) -> int:
        """The rank of `node` that holds `source`'s tokens."""
        return node * self.gpus + source // self.nodes

    def _held(self) -> list[int]:
        """The sources this rank holds, in order (its receive slots')."""
        return [self.local * self.nodes + s for s in range(self.nodes)]

    # The network legs ---------------------------------------------------------------------

    def _net_put(self, dst, src, signal, nbytes, value, peer, ctas):
        self._put.launch(dst, src, signal, self._error, nbytes, value,
                         int(self.timeout_s * 1e9), peer, ctas)

    def _exchange(self, kind: int, sends: list, sources: list[int]) -> list[torch.Tensor]:
        """One network leg: each (rank, slot, rows [c, B] uint8) of `sends` into that slot of
        that rank's receive buffer; returns the rows in this rank's slots (slot i from rank
        `sources[i]`) once all have landed, then hands the slots back (each rank waits until
        the rows it sent were read). Every put adds its CTAs to one signal word of its
        destination; only the last launch waits, for every source's."""
        self._rounds[kind] += 1
        rnd, ctas = self._rounds[kind], self.net_ctas
        send, recv = self._send[kind], self._recv[kind]
        width = sends[0][2].shape[1]
        for i, (peer, slot, rows) in enumerate(sends):
            count = rows.shape[0]
            send[i, :HEADER_BYTES].view(torch.int32).copy_(
                torch.tensor([count, rnd, width, 0], dtype=torch.int32))
            if count:
                send[i, HEADER_BYTES:HEADER_BYTES + rows.numel()].copy_(rows.reshape(-1))
            last = i == len(sends) - 1
            self._net_put(recv[slot], send[i], self._signals[0, kind:kind + 1],
                          HEADER_BYTES + rows.numel(), rnd * len(sources) * ctas if last else 0,
                          peer, ctas)
        headers = recv[:len(sources), :HEADER_BYTES].view(torch.int32)
        self._raise_timeout(KINDS[kind], lambda: [
            src for src, (_, got_round, _, _) in zip(sources, headers.tolist())
            if got_round != rnd])
        got = []
        for slot, (count, got_round, got_width, _) in enumerate(headers.tolist()):
            if (got_round, got_width) != (rnd, width):
                raise RuntimeError(
                    f"{KINDS[kind]} between nodes: rank {self.rank} received round {got_round} "
                    f"of {got_width}-byte rows from rank {sources[slot]}, expected round {rnd} "
                    f"of {width}: every rank must call with inputs of the same kind")
            got.append(recv[slot, HEADER_BYTES:HEADER_BYTES + count * width]
                       .view(count, width).clone())
        # The hand-back: this rank has read its slots; each source's next put waits for it.
        for i, source in enumerate(sources):
            last = i == len(sources) - 1
            self._net_put(self._boxes[1], self._boxes[0], self._signals[1, kind:kind + 1],
                          HEADER_BYTES, rnd * len(sends) if last else 0, source, 1)
        self._raise_timeout(KINDS[kind] + " (slot hand-back)",
                            lambda: sorted({peer for peer, _, _ in sends}))
        return got

    def _raise_timeout(self, what: str, missing) -> None:
        """After a leg's waits: raise PeerTimeout naming the ranks (`missing()`, read only
        then) whose puts did not arrive in time."""
        torch.cuda.current_stream(self.device).synchronize()
        if int(self._error[0].item()):
            names = ", ".join(f"rank {p} (node {p // self.gpus})" for p in missing())
            raise PeerTimeout(f"{what} between nodes: rank {self.rank} (node {self.node}) timed "
                              f"out after {self.timeout_s:g} s waiting for {names}")

    # Dispatch and combine -----------------------------------------------------------------

    def dispatch(self, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
                 global_scale: torch.Tensor | None = None) -> NodeDispatchOutput:
        """`Buffer.dispatch` over several nodes (eager): x bf16 [T, H] or pre-quantized
        (codes, scales); topk_ids [T, K] global expert ids or -1; topk_weights float32 [T, K]
        (required: the partial sums of combine are weighted); global_scale as `Buffer`'s
        (nvfp4 bf16 x only: the tokens are quantized here, before they leave)."""
        if self._capturing():
            raise NotImplementedError("a dispatch between nodes reads its counts on the host: "
                                      "eager only so far (no CUDA graph capture)")
        num_tokens = check_node_inputs(self.cfg, self.device, x, topk_ids, topk_weights)
        quantized = type(x) is tuple
        if self.cfg.format == "nvfp4" and not quantized:
            # Each source quantizes its own tokens under its own global scale (as the
            # intranode path does), so the rows cross the network as codes and scales.
            if global_scale is None:
                raise ValueError("an nvfp4 dispatch of bf16 x needs global_scale")
            from cute_ep.quant import quantize_nvfp4

            x, quantized = quantize_nvfp4(x, global_scale, scales="linear"), True
        parts = list(x) if quantized else [x]
        rows = pack_rows(parts, topk_ids, topk_weights)
        node_of = torch.where(topk_ids >= 0, topk_ids.div(self.node_experts,
                                                          rounding_mode="floor"), -1)
        # A token once to the holder of this rank's tokens on every node with one of its
        # experts (this node's included, which may be this GPU or another of the node).
        sends, sent = [], []
        for m in range(self.nodes):
            sent.append((node_of == m).any(dim=1).nonzero()[:, 0])
            sends.append((self._holder(m, self.rank), self.rank % self.nodes, rows[sent[m]]))
        got = self._exchange(DISPATCH, sends, self._held())
        # The node's input: held source s's token t at row s * T + t (T = max_tokens_per_rank),
        # the rows of tokens not sent here routed nowhere (ids -1). The node's dispatch orders
        # an expert's rows by its GPU and then by input row: by source rank and token; and a
        # row's input index names its token (index % T).
        t_max, k = self.cfg.max_tokens_per_rank, self.cfg.topk
        shapes = [(tuple(p.shape[1:]), p.dtype) for p in parts]
        counts = [piece.shape[0] for piece in got]
        arrived = torch.cat(got) if len(got) > 1 else got[0]
        got_parts, got_ids, got_w, got_t = unpack_rows(arrived, shapes, k)
        held = torch.repeat_interleave(torch.arange(len(got), device=self.device),
                                       torch.tensor(counts, device=self.device))
        at = held * t_max + got_t
        size = len(got) * t_max
        ext_parts = []
        for part, (shape, dtype) in zip(got_parts, shapes):
            full = torch.zeros(size, *shape, dtype=dtype, device=self.device)
            full[at] = part
            ext_parts.append(full)
        ids = torch.full((size, k), -1, dtype=torch.int32, device=self.device)
        ids[at] = localize_ids(got_ids, self.node, self.node_experts)
        weights = torch.zeros(size, k, dtype=torch.float32, device=self.device)
        weights[at] = got_w
        x_ext = tuple(ext_parts) if quantized else ext_parts[0]
        out = self.inner.dispatch(x_ext, ids, weights)
        src = out.src_info
        total = int(out.row_offsets[-1].item())
        if total:
            row = src[:total, 0]
            src[:total, 0] = torch.where(row < 0, row, row % t_max)
        returns = list(torch.split(at, counts))
        return NodeDispatchOutput(
            tokens=out.tokens, scales=out.scales, row_offsets=out.row_offsets,
            expert_ids=out.expert_ids, src_info=src, counts=out.counts,
            scales_offsets=out.scales_offsets,
            handle=NodeHandle(out.handle, num_tokens, sent, returns))

    def combine(self, y: torch.Tensor, handle: NodeHandle) -> torch.Tensor:
        """`Buffer.combine` over several nodes: y [rows, H] bf16, the expert outputs of the
        dispatch's rows; returns this rank's [T, H] bf16 weighted sums."""
        if self._capturing():
            raise NotImplementedError("a combine between nodes is eager only so far")
        part = self.inner.combine(y, handle.inner)  # [ext tokens, H]: this node's experts
        # Each held source's partial sums go home, into its slot of this node, in the order
        # its tokens came.
        sends = [(source, self.node, part[rows].view(torch.uint8))
                 for source, rows in zip(self._held(), handle.returns)]
        got = self._exchange(COMBINE, sends,
                             [self._holder(m, self.rank) for m in range(self.nodes)])
        out = torch.zeros(handle.num_tokens, self.cfg.hidden, dtype=torch.float32,
                          device=self.device)
        for m, rows in enumerate(got):  # every node's sums, in node order
            out.index_add_(0, handle.sent[m], rows.view(torch.bfloat16).float())
        return out.to(torch.bfloat16)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def check(self) -> None:
        """The node Buffer's `check` (errors recorded on the device)."""
        self.inner.check()
