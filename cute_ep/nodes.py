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

No call waits on the host (the counts travel in the slots' headers, read by the kernels and by
fixed-shape torch ops), so CUDA graphs capture dispatch and combine; errors wait for `check`, as
`Buffer`'s do. BF16 / FP8 / NVFP4 (bf16 or pre-quantized input), weighted combine, the fused
shared expert (this rank's own tokens, a last block of its node input that its node's shared
expert takes). Holding sources in blocks makes a rank send to GPUs of other indices, which a
rail-aligned network prefers to avoid. Needs the `multinode` extra.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cute_ep.ep import DEFAULT_SMS, Buffer, _quantized_rows
from cute_ep.runtime import nvshmem
from cute_ep.runtime.comm import DEFAULT_TIMEOUT_S, PeerTimeout, agree_on_config
from layouts import EPConfig
from layouts.algebra import align_up
from layouts.formats import ALIGN
from layouts.nodes import HEADER_BYTES, LEGS, NodeSlots, node_config

__all__ = ["NodeBuffer", "NodeDispatchOutput", "NodeHandle", "check_node_inputs", "flag_bad_ids",
           "node_config"]

# CTAs of each put between nodes (`kernels.net_put`) where the layer names no SM budget (a
# Buffer's default): each moves its share of the bytes, all its threads together, and signals
# once.
NET_CTAS = DEFAULT_SMS
DISPATCH, COMBINE = 0, 1
KINDS = LEGS  # a leg's index: DISPATCH, COMBINE


@dataclasses.dataclass
class NodeHandle:
    """What a NodeBuffer's combine needs from its dispatch."""

    inner: object  # the node's DispatchHandle
    num_tokens: int  # this rank's own tokens
    orders: list  # node m -> this rank's tokens, those sent to node m's holder first, in order
    counts_sent: list  # node m -> how many were sent (a device int)
    returns: torch.Tensor  # [held sources, T]: the node input's rows of their tokens, as sent
    received: torch.Tensor  # [held sources]: how many each sent (int32, on the device)
    own_rows: int  # the node input's row of this rank's own token 0 (fused shared expert)


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
    if cfg.layout != "packed" or cfg.recv_capacity is not None:
        raise NotImplementedError("between nodes: the packed layout, without a recv_capacity, "
                                  "so far")


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
    device, contiguity, the token bound; the ids' values: `flag_bad_ids`); returns the token
    count."""
    h = cfg.hidden

    def placed(t, name):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the layer's GPU is {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

    if type(x) is tuple:
        rows = _quantized_rows(cfg)  # the (codes, scales) rows Buffer.dispatch takes
        if rows is None or len(x) != 2:
            raise TypeError(f"x may be a (codes, scales) tuple only for an fp8 or nvfp4 layer "
                            f"(this one is {cfg.format})")
        tokens = None
        for t, name, (dtype, cols, _) in zip(x, ("x codes", "x scales"), rows):
            dtype = getattr(torch, dtype)
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
    return tokens


def flag_bad_ids(topk_ids: torch.Tensor, experts: int, flag: torch.Tensor) -> None:
    """Set `flag` (an int32 element, on the device) where `topk_ids` holds an id outside
    [-1, E), without waiting for the device: such a pair reaches no node (it is dropped), and
    `NodeBuffer.check` reports it, as `Buffer.check` reports the ids its kernels drop."""
    if topk_ids.numel():
        bad = ((topk_ids < -1) | (topk_ids >= experts)).any().view(1).int()
        flag.copy_(torch.maximum(flag, bad))


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
        for leg in LEGS:
            b = slots.slot_bytes(leg)
            self._send.append(part(f"{leg}_send")[:self.nodes * b].view(self.nodes, b))
            self._recv.append(part(f"{leg}_recv")[:self.nodes * b].view(self.nodes, b))
        self._signals = part("signals")[:4 * 8].view(torch.int64).view(2, 2)  # [data / credit, leg]
        self._boxes = part("boxes").view(2, HEADER_BYTES)
        self._heap.zero_()
        self._error = torch.zeros(4, dtype=torch.int32, device=self.device)
        # On the device, so that a CUDA graph replay advances them: each leg's round, the
        # signal values each leg waits for (data, credit), and what `check` reports (rows of
        # another kind, expert ids out of range while capturing).
        self._round = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._expect = torch.zeros(2, 2, dtype=torch.int64, device=self.device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._flags = torch.zeros(2, dtype=torch.int32, device=self.device)
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

    def _net_put(self, dst, src, signal, row_bytes, value, peer, ctas):
        self._put.launch(dst, src, signal, self._error, HEADER_BYTES, row_bytes, value,
                         int(self.timeout_s * 1e9), peer, ctas)

    def _exchange(self, kind: int, sends: list, sources: list[int]):
        """One network leg: each (rank, slot, rows [n, B] uint8, count) of `sends` (count: a
        device int, the rows that count) into that slot of that rank's receive buffer. Returns
        this rank's slots once all have landed, as rows [slots, max_tokens_per_rank, B] (past
        each slot's count undefined) and the counts [slots] (int32, on the device): slot i
        from rank `sources[i]`. Nothing waits on the host, so a CUDA graph captures it; call
        `_hand_back` once the rows are read. Every put adds its CTAs to one signal word of its
        destination, and only the last launch waits, for every source's."""
        ctas, width = self.net_ctas, sends[0][2].shape[1]
        send, recv = self._send[kind], self._recv[kind]
        self._round[kind:kind + 1].add_(1)
        self._expect[0, kind:kind + 1].add_(len(sources) * ctas)
        for i, (peer, slot, rows, count) in enumerate(sends):
            header = send[i, :HEADER_BYTES].view(torch.int32)
            header[0:1].copy_(count.view(1))
            header[1:2].copy_(self._round[kind:kind + 1])
            header[2:3].fill_(width)
            if rows.numel():
                send[i, HEADER_BYTES:HEADER_BYTES + rows.numel()].copy_(rows.reshape(-1))
            last = i == len(sends) - 1
            self._net_put(recv[slot], send[i], self._signals[0, kind:kind + 1], width,
                          self._expect[0, kind:kind + 1] if last else self._zero, peer, ctas)
        headers = recv[:len(sources), :HEADER_BYTES].view(torch.int32)
        # A source that sent another round or another width (its inputs of another kind):
        # recorded for `check`, its rows dropped.
        wrong = (headers[:, 1] != self._round[kind]) | (headers[:, 2] != width)
        self._flags[0:1].copy_(torch.maximum(self._flags[0:1], wrong.any().view(1).int()))
        counts = torch.where(wrong, 0, headers[:, 0])
        t_max = self.cfg.max_tokens_per_rank
        rows = recv[:len(sources), HEADER_BYTES:HEADER_BYTES + t_max * width].view(
            len(sources), t_max, width)
        return rows, counts

    def _hand_back(self, kind: int, sends: list, sources: list[int]) -> None:
        """This rank has read its slots: each source's next put into them waits for it."""
        self._expect[1, kind:kind + 1].add_(len(sends))
        for i, source in enumerate(sources):
            last = i == len(sources) - 1
            self._net_put(self._boxes[1], self._boxes[0], self._signals[1, kind:kind + 1], 0,
                          self._expect[1, kind:kind + 1] if last else self._zero, source, 1)

    # Dispatch and combine -----------------------------------------------------------------

    def dispatch(self, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
                 global_scale: torch.Tensor | None = None, *, skip_a2a: bool = False,
                 num_input_tokens: int | None = None) -> NodeDispatchOutput:
        """`Buffer.dispatch` over several nodes: x bf16 [T, H] or pre-quantized (codes,
        scales); topk_ids [T, K] global expert ids or -1; topk_weights float32 [T, K]
        (required: the partial sums of combine are weighted); global_scale as `Buffer`'s
        (nvfp4 bf16 x only: the tokens are quantized here, before they leave);
        num_input_tokens: an upper bound on T, checked (Buffer's decode hint). Nothing waits
        on the host (errors wait for `check`)."""
        if skip_a2a:
            raise NotImplementedError("skip_a2a (allreduce mode) is for one node: between nodes "
                                      "every token travels")
        num_tokens = check_node_inputs(self.cfg, self.device, x, topk_ids, topk_weights)
        if num_input_tokens is not None and num_tokens > int(num_input_tokens):
            raise ValueError(f"num_input_tokens={num_input_tokens} is below this rank's "
                             f"{num_tokens} tokens")
        flag_bad_ids(topk_ids, self.cfg.experts, self._flags[1:2])
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
        # experts (this node's included, which may be this GPU or another of the node): the
        # rows of node m's tokens first, in token order, and their count.
        index = torch.arange(num_tokens, device=self.device)
        sends, orders, counts_sent = [], [], []
        for m in range(self.nodes):
            chosen = (node_of == m).any(dim=1)
            order = torch.sort(torch.where(chosen, index, index + num_tokens)).indices
            count = chosen.sum()
            sends.append((self._holder(m, self.rank), self.rank % self.nodes, rows[order], count))
            orders.append(order)
            counts_sent.append(count)
        held = self._held()
        got, counts = self._exchange(DISPATCH, sends, held)
        # The node's input: held source s's token t at row s * T + t (T = max_tokens_per_rank),
        # the rows of tokens not sent here routed nowhere (ids -1; a last, spare row takes the
        # slots' rows past their counts). The node's dispatch orders an expert's rows by its
        # GPU and then by input row: by source rank and token; and a row's input index names
        # its token (index % T).
        # With a fused shared expert this rank's own tokens follow, routed nowhere, as the
        # node's shared expert's rows [size, size + T): segment 0, in token order, as the
        # intranode path's.
        t_max, k, slots = self.cfg.max_tokens_per_rank, self.cfg.topk, len(held)
        size = slots * t_max
        total = size + num_tokens if self.cfg.fused_shared_expert else size
        shapes = [(tuple(p.shape[1:]), p.dtype) for p in parts]
        got_parts, got_ids, got_w, got_t = unpack_rows(got.reshape(size, -1), shapes, k)
        arrived = (torch.arange(t_max, device=self.device)[None, :] < counts[:, None]).view(-1)
        slot_first = torch.arange(slots, device=self.device).repeat_interleave(t_max) * t_max
        at = torch.where(arrived, slot_first + got_t, total)
        ext_parts = []
        for part, own, (shape, dtype) in zip(got_parts, parts, shapes):
            full = torch.zeros(total + 1, *shape, dtype=dtype, device=self.device)
            full[at] = part
            if total > size:
                full[size:total] = own
            ext_parts.append(full[:total])
        ids = torch.full((total + 1, k), -1, dtype=torch.int32, device=self.device)
        ids[at] = localize_ids(got_ids, self.node, self.node_experts)
        weights = torch.zeros(total + 1, k, dtype=torch.float32, device=self.device)
        weights[at] = got_w
        self._hand_back(DISPATCH, sends, held)
        x_ext = tuple(ext_parts) if quantized else ext_parts[0]
        shared = (size, total) if self.cfg.fused_shared_expert else None
        out = self.inner._checked_dispatch(x_ext, ids[:total], weights[:total], False, None,
                                           None, shared_rows=shared)
        src = out.src_info
        row = src[:, 0]
        written = torch.arange(src.shape[0], device=self.device) < out.row_offsets[-1]
        src[:, 0] = torch.where(written & (row >= 0), row % t_max, row)
        return NodeDispatchOutput(
            tokens=out.tokens, scales=out.scales, row_offsets=out.row_offsets,
            expert_ids=out.expert_ids, src_info=src, counts=out.counts,
            scales_offsets=out.scales_offsets,
            handle=NodeHandle(out.handle, num_tokens, orders, counts_sent,
                              at.view(slots, t_max).clamp(max=size - 1), counts, size))

    def combine(self, y: torch.Tensor, handle: NodeHandle) -> torch.Tensor:
        """`Buffer.combine` over several nodes: y [rows, H] bf16, the expert outputs of the
        dispatch's rows; returns this rank's [T, H] bf16 weighted sums."""
        part = self.inner.combine(y, handle.inner)  # [node input rows, H]: this node's experts
        # Each held source's partial sums go home, into its slot of this node, in the order
        # its tokens came.
        held = self._held()
        sends = [(source, self.node, part[handle.returns[s]].view(torch.uint8),
                  handle.received[s]) for s, source in enumerate(held)]
        homes = [self._holder(m, self.rank) for m in range(self.nodes)]
        got, _ = self._exchange(COMBINE, sends, homes)
        t = handle.num_tokens
        out = torch.zeros(t + 1, self.cfg.hidden, dtype=torch.float32, device=self.device)
        index = torch.arange(t, device=self.device)
        for m in range(self.nodes):  # every node's sums, in node order
            into = torch.where(index < handle.counts_sent[m], handle.orders[m], t)
            out.index_add_(0, into, got[m, :t].view(torch.bfloat16).float())
        if self.cfg.fused_shared_expert:  # the shared expert's outputs, from this rank's node
            out[:t] += part[handle.own_rows:handle.own_rows + t].float()
        self._hand_back(COMBINE, sends, homes)
        return out[:t].to(torch.bfloat16)

    def check(self) -> None:
        """Synchronise and raise what the device recorded, as `Buffer.check` does: the node
        Buffer's errors; a rank between nodes that did not arrive (PeerTimeout naming it and
        its node, from the rounds its slot holds; the NodeBuffer must then be recreated); rows
        of another round or width (ranks that called with inputs of different kinds); expert
        ids outside [-1, E) (those pairs were dropped; reported once)."""
        self.inner.check()
        torch.cuda.current_stream(self.device).synchronize()
        if int(self._error[0].item()):
            sources = {DISPATCH: self._held(),
                       COMBINE: [self._holder(m, self.rank) for m in range(self.nodes)]}
            missing, leg = [], "a hand-back"
            for kind in (DISPATCH, COMBINE):
                rounds = self._recv[kind][:self.nodes, 4:8].view(torch.int32)[:, 0].tolist()
                now = int(self._round[kind].item())
                late = [p for p, r in zip(sources[kind], rounds) if r != now and p != self.rank]
                if late and not missing:
                    missing, leg = late, KINDS[kind]
            if not missing:  # a hand-back: the ranks this one sent to
                missing = sorted({*sources[DISPATCH], *sources[COMBINE]} - {self.rank})
            names = ", ".join(f"rank {p} (node {p // self.gpus})" for p in missing)
            raise PeerTimeout(f"{leg} between nodes: rank {self.rank} (node {self.node}) timed "
                              f"out after {self.timeout_s:g} s waiting for {names}")
        if int(self._flags[0].item()):
            raise RuntimeError(f"between nodes: rank {self.rank} received rows of another round "
                               f"or width: every rank must call with inputs of the same kind")
        if int(self._flags[1].item()):
            self._flags[1].zero_()
            raise ValueError(f"topk_ids held expert ids outside [0, {self.cfg.experts}) that "
                             f"are not -1: those (token, k) pairs were dropped")
