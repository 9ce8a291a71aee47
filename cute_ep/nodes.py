"""Expert parallelism over several nodes: NVSHMEM between nodes, the intranode Buffer inside each.

`NodeBuffer(cfg)` with `cfg.gpus_per_node = G` puts the R ranks on N = R / G nodes (rank
r = n * G + l is GPU l of node n) and the E experts on them in order, E / N a node. A dispatch
moves each token over the network at most once per node that holds one of its experts: rank
(n, l) sends it to rank (m, l), GPU l of node m, through NVSHMEM (`kernels.net_put`, a put with a
signal, bounded waits). There the token joins the rank's own as one more input of node m's
intranode dispatch (the Buffer over node m's G ranks and its experts, its ids made local, the
other nodes' experts as -1), which fans it out over NVLink to the expert's rank. Combine runs the
other way: node m's intranode combine reduces each token over node m's experts, and one NVSHMEM
put a node returns those partial sums to the token's home rank, which adds them (fp32, in node
order) to its own node's.

The outputs are the intranode path's for the same routing: rows grouped by local expert, inside
an expert by source rank and token, `src_info` the source token and k slot. The ranks of a node
need not see the other nodes' GPUs: no peer mapping is opened between nodes (a node's Buffer
maps its own ranks only).

This first version is eager (each network leg reads its counts on the host), BF16 / FP8 /
NVFP4 (bf16 or pre-quantized input), weighted combine, one GPU a node (G = 1: every rank of a
node is its own source, so the node's row order is the global one). Several GPUs a node need the
rows of each expert reordered from (local source, node) to (node, local source) order after the
node's dispatch, which is not built yet: G > 1 is refused by name. Needs the `multinode` extra.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cute_ep.ep import Buffer
from cute_ep.runtime import nvshmem
from cute_ep.runtime.comm import DEFAULT_TIMEOUT_S, PeerTimeout, agree_on_config
from layouts import EPConfig
from layouts.algebra import align_up
from layouts.formats import ALIGN

__all__ = ["NodeBuffer", "NodeDispatchOutput", "NodeHandle", "check_node_inputs"]

# CTAs of each put between nodes (`kernels.net_put`): each moves its share of the bytes, all
# its threads together, and signals once. The default SM budget of a Buffer.
NET_CTAS = 24
HEADER_BYTES = 16  # a slot's header: (rows, round, bytes a row, 0) as int32
DISPATCH, COMBINE = 0, 1
KINDS = ("dispatch", "combine")


@dataclasses.dataclass
class NodeHandle:
    """What a NodeBuffer's combine needs from its dispatch."""

    inner: object  # the node's DispatchHandle
    num_tokens: int  # this rank's own tokens
    sent: dict  # distance d -> int64 indices of this rank's tokens sent to node n + d
    received: dict  # distance d -> (first ext row, rows) of the tokens from node n - d
    own_first: int  # where this rank's own tokens begin in the node dispatch's input


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


def node_config(cfg: EPConfig) -> EPConfig:
    """The config of one node's intranode Buffer: its G ranks and E / N experts, and room for
    the tokens of every node's GPU of the same index (N x max_tokens_per_rank inputs)."""
    nodes = cfg.nodes
    return dataclasses.replace(cfg, experts=cfg.experts // nodes, ranks=cfg.node_ranks,
                               max_tokens_per_rank=nodes * cfg.max_tokens_per_rank,
                               gpus_per_node=None, recv_capacity=None)


def check_node_config(cfg: EPConfig) -> None:
    """What this version carries between nodes; raises NotImplementedError naming the rest."""
    if cfg.gpus_per_node is None or cfg.nodes < 2:
        raise ValueError("NodeBuffer is for ranks on several nodes: set gpus_per_node to the GPUs "
                         "of one node (Buffer serves one node)")
    if cfg.node_ranks > 1:
        raise NotImplementedError(
            f"gpus_per_node={cfg.gpus_per_node}: the transport between nodes runs one GPU a node "
            f"so far (the reorder of a node's rows from (local source, node) to source-rank order "
            f"is not built)")
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
                 sms: int | None = None, net_ctas: int = NET_CTAS):
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
        self.net_ctas = int(net_ctas)
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
        fmt = cfg.format
        h, k = cfg.hidden, cfg.topk
        # The widest token row of any input this layer takes (bf16 x, or pre-quantized codes
        # and scales), its metadata and padding.
        payload = max(2 * h, {"bf16": 0, "fp8": h + 4 * (h // 128), "nvfp4": h // 2 + h // 16}[fmt])
        self.row_bytes = align_up(payload + 4 * (2 * k + 1), ALIGN)
        self.slot_bytes = (HEADER_BYTES + cfg.max_tokens_per_rank * self.row_bytes,
                           HEADER_BYTES + cfg.max_tokens_per_rank * 2 * h)
        # Symmetric (every PE allocates the same, in the same order): per kind a send and a
        # receive slot for each distance d = 1 .. N - 1 (slot 0 unused), its signal words, and
        # the credit words and boxes of the handshake that frees a slot for the next round.
        self._send = [nvshmem.symmetric_bytes(self.nodes * b).view(self.nodes, b)
                      for b in self.slot_bytes]
        self._recv = [nvshmem.symmetric_bytes(self.nodes * b).view(self.nodes, b)
                      for b in self.slot_bytes]
        self._signals = nvshmem.symmetric_bytes(2 * 2 * self.nodes * 8).view(torch.int64).view(
            2, 2, self.nodes)  # [data / credit, kind, distance]
        self._boxes = nvshmem.symmetric_bytes(2 * HEADER_BYTES).view(2, HEADER_BYTES)
        self._signals.zero_()
        self._error = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._rounds = [0, 0]
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)

    def _pe(self, node: int) -> int:
        return node * self.gpus + self.local

    # The network legs ---------------------------------------------------------------------

    def _net_put(self, dst, src, signal, nbytes, value, peer_node, ctas):
        self._put.launch(dst, src, signal, self._error, nbytes, value,
                         int(self.timeout_s * 1e9), self._pe(peer_node), ctas)

    def _exchange(self, kind: int, sends: dict, to_node) -> dict:
        """One network leg: for each distance d, rows [c, B] (uint8) into slot d of
        `to_node(d)`'s receive buffer; returns what landed in this rank's slot d (from the node
        that sends to this one at distance d) as rows, once every slot's signal has arrived,
        then hands the slots back (each node waits until the rows it sent were read)."""
        self._rounds[kind] += 1
        rnd = self._rounds[kind]
        send, recv = self._send[kind], self._recv[kind]
        for d, rows in sends.items():
            count, width = rows.shape
            send[d, :HEADER_BYTES].view(torch.int32).copy_(
                torch.tensor([count, rnd, width, 0], dtype=torch.int32))
            if count:
                send[d, HEADER_BYTES:HEADER_BYTES + rows.numel()].copy_(rows.reshape(-1))
            self._net_put(recv[d], send[d], self._signals[0, kind, d:d + 1],
                          HEADER_BYTES + rows.numel(), rnd * self.net_ctas, to_node(d),
                          self.net_ctas)
        self._raise_timeout(KINDS[kind])
        headers = recv[1:, :HEADER_BYTES].view(torch.int32).tolist()
        got = {}
        for d, rows in sends.items():
            count, sent_round, width, _ = headers[d - 1]
            if (sent_round, width) != (rnd, rows.shape[1]):
                source = self._pe(self._source_node(kind, d))
                raise RuntimeError(
                    f"{KINDS[kind]} between nodes: rank {self.rank} received round {sent_round} "
                    f"of {width}-byte rows from rank {source}, expected round {rnd} of "
                    f"{rows.shape[1]}: every rank must call with inputs of the same kind")
            got[d] = recv[d, HEADER_BYTES:HEADER_BYTES + count * width].view(count, width).clone()
        # The credit handshake: this rank has read its slots; the next round's puts into the
        # peers' slots wait until they have read theirs.
        for d in sends:
            self._net_put(self._boxes[1], self._boxes[0], self._signals[1, kind, d:d + 1],
                          HEADER_BYTES, rnd, self._source_node(kind, d), 1)
        self._raise_timeout(KINDS[kind] + " (slot hand-back)")
        return got

    def _source_node(self, kind: int, d: int) -> int:
        """The node whose rows land in slot d: dispatch sends to n + d, so its slot d is filled
        by n - d; combine the other way round."""
        return (self.node - d) % self.nodes if kind == DISPATCH else (self.node + d) % self.nodes

    def _raise_timeout(self, what: str) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        missing = int(self._error[0].item())
        if missing:
            peer = missing - 1
            raise PeerTimeout(f"{what} between nodes: rank {self.rank} (node {self.node}) timed "
                              f"out after {self.timeout_s:g} s waiting for rank {peer} (node "
                              f"{peer // self.gpus})")

    # Dispatch and combine -----------------------------------------------------------------

    def dispatch(self, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
                 global_scale: torch.Tensor | None = None) -> NodeDispatchOutput:
        """`Buffer.dispatch` over several nodes (eager): x bf16 [T, H] or pre-quantized
        (codes, scales); topk_ids [T, K] global expert ids or -1; topk_weights float32 [T, K]
        (required: the partial sums of combine are weighted); global_scale as `Buffer`'s
        (nvfp4 bf16 x only: the tokens are quantized here, before they leave)."""
        if torch.cuda.is_current_stream_capturing():
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
        sends, sent = {}, {}
        for d in range(1, self.nodes):
            m = (self.node + d) % self.nodes
            sent[d] = (node_of == m).any(dim=1).nonzero()[:, 0]
            sends[d] = rows[sent[d]]
        got = self._exchange(DISPATCH, sends, lambda d: (self.node + d) % self.nodes)
        # The node's input in source-rank order: node s's tokens at (s, this GPU) in node order.
        shapes = [(tuple(p.shape[1:]), p.dtype) for p in parts]
        pieces, received, at, own_first = [], {}, 0, 0
        for s in range(self.nodes):
            if s == self.node:
                piece, own_first = rows, at
            else:
                d = (self.node - s) % self.nodes
                piece = got[d]
                received[d] = (at, piece.shape[0])
            pieces.append(piece)
            at += piece.shape[0]
        ext = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        ext_parts, ext_ids, ext_w, ext_t = unpack_rows(ext, shapes, self.cfg.topk)
        ids = localize_ids(ext_ids, self.node, self.node_experts)
        ext_w = ext_w.contiguous()
        x_ext = tuple(ext_parts) if quantized else ext_parts[0]
        out = self.inner.dispatch(x_ext, ids, ext_w)
        # src_info: the node's input index -> the token's index at its source rank.
        src = out.src_info
        total = int(out.row_offsets[-1].item())
        if total:
            first = src[:total, 0].long()
            shared = first < 0
            src[:total, 0] = torch.where(shared, first, ext_t[first.clamp(min=0)]).to(
                torch.int32)
        return NodeDispatchOutput(
            tokens=out.tokens, scales=out.scales, row_offsets=out.row_offsets,
            expert_ids=out.expert_ids, src_info=src, counts=out.counts,
            scales_offsets=out.scales_offsets,
            handle=NodeHandle(out.handle, num_tokens, sent, received, own_first))

    def combine(self, y: torch.Tensor, handle: NodeHandle) -> torch.Tensor:
        """`Buffer.combine` over several nodes: y [rows, H] bf16, the expert outputs of the
        dispatch's rows; returns this rank's [T, H] bf16 weighted sums."""
        if torch.cuda.is_current_stream_capturing():
            raise NotImplementedError("a combine between nodes is eager only so far")
        part = self.inner.combine(y, handle.inner)  # [ext tokens, H]: this node's experts
        sends = {d: part[first:first + count].contiguous().view(torch.uint8)
                 for d, (first, count) in handle.received.items()}
        # Partial sums go home: the rows from node n - d back to it.
        got = self._exchange(COMBINE, sends, lambda d: (self.node - d) % self.nodes)
        out = part[handle.own_first:handle.own_first + handle.num_tokens].float()
        for d in sorted(got):  # the other nodes' sums, in a fixed order
            rows = got[d].view(torch.bfloat16).view(-1, self.cfg.hidden)
            out.index_add_(0, handle.sent[d], rows.float())
        return out.to(torch.bfloat16)

    def check(self) -> None:
        """The node Buffer's `check` (errors recorded on the device)."""
        self.inner.check()
