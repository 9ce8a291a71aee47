"""Peer-mapped buffers for one EP group, and the signalled exchange between its ranks.

One process per GPU under `torch.distributed`. `PeerExchange` allocates its mailbox from torch
symmetric memory (every rank maps every other rank's copy), checks that all ranks asked for the
same configuration, and launches the `peer_exchange` kernel, which writes this rank's payload into
every rank's mailbox and waits, bounded in time, for every rank's payload to arrive here.
"""

from __future__ import annotations

import os
import torch
import torch.distributed as dist

from cute_ep.runtime.launch import check_tensor, runtime
from layouts.transport import Mailbox

# How long a kernel waits for a peer before it records a timeout. A live rank may be slow for
# seconds between dispatch and combine (host work, a recompilation, a long GEMM), so the default
# must outlast any such pause and fire only for a rank that is gone: 300 s, beyond DeepEP's ~100 s
# trap and inside NCCL's 10-minute watchdog, so the error naming the missing rank and phase comes
# first. Tests that want a fast failure pass their own timeout_s; CUTE_EP_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = float(os.environ.get("CUTE_EP_TIMEOUT_S", "300"))


class ConfigMismatch(RuntimeError):
    """Ranks of one EP group asked for different configurations."""


class PeerTimeout(RuntimeError):
    """A rank did not arrive within the timeout."""


def agree_on_config(config: dict, group=None) -> None:
    """Raise ConfigMismatch on every rank unless all ranks of `group` pass the same config."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, config, group=group)
    differing = [r for r, c in enumerate(gathered) if c != gathered[0]]
    if differing:
        lines = "; ".join(f"rank {r}: {c}" for r, c in enumerate(gathered))
        raise ConfigMismatch(f"EP group ranks disagree on the configuration ({lines})")


class PeerExchange:
    """All ranks exchange a `slot_bytes` payload each round, every pair signalled every round.

    Two mailbox groups alternate round by round: a rank can run at most one round ahead of the
    slowest (it waits for everyone's arrival each round), so it never overwrites a slot that is
    still being read, provided the reader finishes with round i before starting round i + 1.
    """

    GROUPS = 2

    def __init__(self, slot_bytes: int, group=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group or dist.group.WORLD
        self.ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        agree_on_config({"kind": "peer_exchange", "slot_bytes": slot_bytes, "ranks": self.ranks,
                         "timeout_s": timeout_s}, self.group)
        self.mailbox = Mailbox(self.ranks, slot_bytes)
        self.kernel = runtime().select("peer_exchange", self.device, ranks=self.ranks)

        self.buffer = symm_mem.empty(self.GROUPS * self.mailbox.nbytes, dtype=torch.uint8,
                                     device=self.device)
        self.buffer.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)
        handle = symm_mem.rendezvous(self.buffer, self.group.group_name)
        bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64)
        self.peer_tables = torch.stack([bases + g * self.mailbox.nbytes
                                        for g in range(self.GROUPS)]).to(self.device)
        self.epochs = torch.zeros(self.GROUPS, self.ranks, dtype=torch.int64, device=self.device)
        self.error = torch.zeros(4, dtype=torch.int32, device=self.device)
        self.round = 0

    @property
    def slot_bytes(self) -> int:
        return self.mailbox.slot_bytes

    def exchange(self, payload: torch.Tensor) -> int:
        """Send `payload` (uint8 [slot_bytes]) to every rank and wait for theirs, asynchronously
        on the current stream. Returns the mailbox group this round used (see `received`)."""
        check_tensor(payload, name="payload", dtype="uint8", align=16, device_index=self.device.index)
        if payload.numel() != self.slot_bytes:
            raise ValueError(f"payload has {payload.numel()} bytes, the mailbox slot {self.slot_bytes}")
        group = self.round % self.GROUPS
        self.round += 1
        self.kernel.launch(self.peer_tables[group], self._group(group), payload,
                           self.slot_bytes // 16, self.ranks, self.rank, self.epochs[group],
                           int(self.timeout_s * 1e9), self.error)
        return group

    def _group(self, group: int) -> torch.Tensor:
        return self.buffer[group * self.mailbox.nbytes:(group + 1) * self.mailbox.nbytes]

    def received(self, group: int) -> torch.Tensor:
        """[ranks, slot_bytes]: the payload each source rank sent into `group` (valid once the
        round is complete on the stream)."""
        return self._group(group)[self.mailbox.slots_offset:].view(self.ranks, -1)

    def check(self, phase: str = "peer_exchange") -> None:
        """Synchronise and raise PeerTimeout if a rank did not arrive."""
        missing = int(self.error[0])
        if missing:
            raise PeerTimeout(f"{phase}: rank {self.rank} timed out after {self.timeout_s:g} s "
                              f"waiting for rank {missing - 1}")
