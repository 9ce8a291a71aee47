"""NodeBuffer's plan for several nodes of several GPUs, on the CPU: every rank a thread, the
network legs an in-memory mailbox, each node's intranode dispatch and combine the reference of
that node. What is checked is what NodeBuffer itself decides (which holder each token goes to,
the slots, the node's input order, `src_info`, where each partial sum goes and how they add up)
against the intranode reference of the whole layer; the transport and the kernels are the GPU
tests' (tests/multigpu/test_nodes.py)."""

import dataclasses
import threading

import pytest
import torch

from cute_ep.nodes import NodeBuffer, node_config
from cute_ep.reference import ep as reference
from layouts import EPConfig


class _World:
    """What the ranks share: the mailboxes of the network legs and each node's reference."""

    def __init__(self, cfg):
        self.barrier = threading.Barrier(cfg.ranks)
        self.mail = [{}, {}]
        self.nodes = [_Node(cfg) for _ in range(cfg.nodes)]


class _Node:
    """One node's intranode layer, by the reference, for its G ranks together."""

    def __init__(self, cfg):
        self.cfg = node_config(cfg)
        self.barrier = threading.Barrier(cfg.node_ranks)
        self.inputs = [None] * cfg.node_ranks
        self.shared = [None] * cfg.node_ranks
        self.ys = [None] * cfg.node_ranks

    def dispatch(self, j, x, ids, w, shared_rows):
        self.inputs[j] = (x, ids, w)
        self.shared[j] = range(*shared_rows) if shared_rows else range(x.shape[0])
        if self.barrier.wait() == 0:
            xs, idss, _ = zip(*self.inputs)
            self.refs = reference.dispatch(self.cfg, list(xs), list(idss),
                                           shared_tokens=self.shared)
        self.barrier.wait()
        out = dataclasses.replace(self.refs[j], src_info=self.refs[j].src_info.clone())
        out.handle = j
        return out

    def combine(self, j, y):
        self.ys[j] = y
        if self.barrier.wait() == 0:
            tokens = [x.shape[0] for x, _, _ in self.inputs]
            self.sums = reference.combine(self.cfg, self.ys, self.refs, tokens,
                                          [w for _, _, w in self.inputs])
        self.barrier.wait()
        return self.sums[j]


class _Inner:
    def __init__(self, node, j):
        self.node, self.j = node, j

    def _checked_dispatch(self, x, ids, w, skip_a2a, num_input_tokens, global_scale,
                          shared_rows=None):
        assert not skip_a2a and num_input_tokens is None and global_scale is None
        return self.node.dispatch(self.j, x, ids, w, shared_rows)

    def combine(self, y, handle):
        return self.node.combine(handle, y)


class _Simulated(NodeBuffer):
    """A NodeBuffer whose network legs go through `world`'s mailboxes."""

    def __init__(self, cfg, rank, world):  # noqa: super().__init__ needs GPUs and NVSHMEM
        self.cfg, self.rank, self.world = cfg, rank, world
        self.nodes, self.gpus = cfg.nodes, cfg.node_ranks
        self.node, self.local = divmod(rank, self.gpus)
        self.node_experts = cfg.experts // self.nodes
        self.device = torch.device("cpu")
        self.inner = _Inner(world.nodes[self.node], self.local)
        self._flags = torch.zeros(2, dtype=torch.int32)

    def _exchange(self, kind, sends, sources):
        mail = self.world.mail[kind]
        for peer, slot, rows, count in sends:
            assert (peer, slot) not in mail, f"two sources put into rank {peer}'s slot {slot}"
            mail[(peer, slot)] = (self.rank, rows[:int(count)].clone())
        self.world.barrier.wait()
        width = sends[0][2].shape[1]
        # Past each slot's count: bytes nobody may read.
        got = torch.randint(0, 256, (len(sources), self.cfg.max_tokens_per_rank, width),
                            dtype=torch.uint8)
        counts = []
        for slot, source in enumerate(sources):
            sender, rows = mail[(self.rank, slot)]
            assert sender == source, f"rank {self.rank}'s slot {slot}: from {sender}, not {source}"
            got[slot, :rows.shape[0]] = rows
            counts.append(rows.shape[0])
        assert sum(key[0] == self.rank for key in mail) == len(sources)
        if self.world.barrier.wait() == 0:
            mail.clear()
        self.world.barrier.wait()
        return got, torch.tensor(counts, dtype=torch.int32)

    def _hand_back(self, kind, sends, sources):
        pass


def _expert_outputs(cfg, out):
    """A stand-in for the experts: each row times (1 + its segment / 8), bf16."""
    n = int(out.row_offsets[-1])
    rows = out.tokens[:n].float() if cfg.format == "bf16" else \
        reference.dequantize_fp8_blockwise(out.tokens[:n], out.scales)
    seg = torch.bucketize(torch.arange(n), out.row_offsets[1:].long(), right=True)
    y = torch.zeros(max(n, 1), cfg.hidden, dtype=torch.bfloat16)
    y[:n] = (rows * (1 + seg.float() / 8)[:, None]).to(torch.bfloat16)
    return y


@pytest.mark.parametrize("nodes,gpus,fmt,shared", [
    (2, 1, "bf16", False), (3, 1, "fp8", False), (2, 2, "bf16", False), (3, 2, "fp8", False),
    (2, 4, "bf16", False), (2, 1, "fp8", True), (2, 2, "bf16", True), (3, 2, "bf16", True)])
def test_several_nodes_of_several_gpus_match_the_intranode_reference(nodes, gpus, fmt, shared):
    ranks = nodes * gpus
    cfg = EPConfig(256, 2, 4 * ranks, ranks, 16, fmt, gpus_per_node=gpus,
                   fused_shared_expert=shared)
    gen = torch.Generator().manual_seed(nodes * 10 + gpus)
    tokens = [int(t) for t in torch.randint(0, 17, (ranks,), generator=gen)]
    tokens[0] = 0  # a rank without tokens
    xs = [torch.randn(t, cfg.hidden, generator=gen).to(torch.bfloat16) for t in tokens]
    ids = []
    for t in tokens:
        pick = torch.rand(t, cfg.experts, generator=gen).argsort(dim=1)[:, :cfg.topk]
        pick[::5, 1] = -1  # empty slots
        ids.append(pick.to(torch.int32))
    ws = [torch.rand(t, cfg.topk, generator=gen) for t in tokens]
    want = reference.dispatch(cfg, xs, ids)
    ys = [_expert_outputs(cfg, d) for d in want]
    sums = reference.combine(cfg, ys, want, tokens, ws)
    bounds = reference.combine(cfg, [y.abs() for y in ys], want, tokens,
                               [w.abs() for w in ws])
    world = _World(cfg)
    results, errors = [None] * ranks, []

    def rank(r):
        try:
            buf = _Simulated(cfg, r, world)
            out = buf.dispatch(xs[r], ids[r], ws[r])
            problem = reference.dispatch_mismatch(cfg, out, want[r])
            combined = buf.combine(_expert_outputs(cfg, out), out.handle)
            results[r] = (problem, combined)
        except BaseException as e:  # report, and let the others past their barriers
            errors.append((r, repr(e)))
            world.barrier.abort()
            for node in world.nodes:
                node.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r, (problem, combined) in enumerate(results):
        assert problem is None, f"rank {r}: {problem}"
        err = (combined.float() - sums[r].float()).abs()
        assert (err <= bounds[r].float() * 2.0 ** -6).all(), f"rank {r}: combine off by " \
                                                               f"{err.max().item():g}"
