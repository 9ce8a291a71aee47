"""`EPConfig`: the parameters of one expert-parallel layer, checked once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from layouts.formats import MessageLayout, message_layout, token_format

FP8_ROW_ALIGN = 4  # FP8 output pads every expert segment to 4 rows
# Where a dispatch puts an expert's rows: "packed" segments back to back (row_offsets, the
# grouped GEMM's input), or "slabs": segment g at row g * slab_rows, every segment the worst
# case long ([E_loc, R * max_tokens_per_rank, H], the masked grouped GEMM's input and DeepEP's
# low-latency layout; rows past a segment's count are undefined); or "sources": one row per
# received token, sources in order and each in its token order, with the token's K ids made
# local and their weights beside it (DeepEP's normal-mode layout; `cute_ep.deepep` uses it).
LAYOUTS = ("packed", "slabs", "sources")
SOURCE_ROWS = -1  # the dispatch kernel's segment_rows for the "sources" layout
# FP8 block scales: "exact" max(amax, 1e-4) / 448, or "pow2" that rounded up to a power of two
# (DeepEP's round_scale; the exponent byte is a UE8M0 scale).
FP8_SCALES = ("exact", "pow2")


@dataclass(frozen=True)
class EPConfig:
    hidden: int
    topk: int
    experts: int
    ranks: int
    max_tokens_per_rank: int
    format: str = "bf16"
    fused_shared_expert: bool = False
    layout: str = "packed"
    # Rows a rank's dispatch output holds (received (token, expert) rows, the FP8 alignment
    # padding added on top); None: the worst case, `max_recv`. A dispatch that receives more
    # writes none past it and reports the overflow (`Buffer.check`).
    recv_capacity: int | None = None
    fp8_scales: str = "exact"
    # GPUs of one host (NVLink peers): ranks r and r' share a node iff r // G == r' // G; between
    # nodes the transport is NVSHMEM's. None: every rank on one node.
    gpus_per_node: int | None = None

    def __post_init__(self):
        fmt = token_format(self.format)
        if self.ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {self.ranks}")
        if self.experts < 1 or self.experts % self.ranks:
            raise ValueError(f"experts ({self.experts}) must be a positive multiple of ranks "
                             f"({self.ranks}): E must be divisible by R")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"top-k ({self.topk}) must be between 1 and the number of experts "
                             f"({self.experts}): K <= E")
        if self.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        fmt.validate_hidden(self.hidden)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout != "packed" and (self.format == "nvfp4" or self.fused_shared_expert):
            raise ValueError(f"the {self.layout} layout is for bf16 and fp8 routed experts only "
                             f"(no nvfp4 128x4 scale blocks, no fused shared expert)")
        if self.fp8_scales not in FP8_SCALES:
            raise ValueError(f"fp8_scales must be one of {FP8_SCALES}, got {self.fp8_scales!r}")
        if self.fp8_scales != "exact" and self.format != "fp8":
            raise ValueError(f"fp8_scales={self.fp8_scales!r} is for the fp8 format")
        if self.gpus_per_node is not None and not (
                1 <= self.gpus_per_node and self.ranks % self.gpus_per_node == 0):
            raise ValueError(f"gpus_per_node ({self.gpus_per_node}) must be a positive divisor of "
                             f"ranks ({self.ranks}): every node holds the same number of GPUs")
        if self.recv_capacity is not None:
            if self.layout == "slabs":
                raise ValueError("recv_capacity bounds the packed and sources layouts; slabs are "
                                 "sized by max_tokens_per_rank")
            least = self.max_tokens_per_rank if self.fused_shared_expert else 1
            if self.recv_capacity < least:
                raise ValueError(f"recv_capacity must be at least {least} (rows"
                                 + (": the fused shared expert's segment holds every token "
                                    "of the rank)" if self.fused_shared_expert else ")")
                                 + f", got {self.recv_capacity}")

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    @property
    def node_ranks(self) -> int:
        """Ranks on one node (`gpus_per_node`, every rank where None)."""
        return self.ranks if self.gpus_per_node is None else self.gpus_per_node

    @property
    def nodes(self) -> int:
        return self.ranks // self.node_ranks

    def node_of(self, rank: int) -> int:
        """The node of `rank`: ranks node * node_ranks .. (node + 1) * node_ranks - 1."""
        return rank // self.node_ranks

    @property
    def segments(self) -> int:
        """Grouped-GEMM segments on a rank: the local experts, plus the shared expert if fused."""
        return self.local_experts + int(self.fused_shared_expert)

    @property
    def message(self) -> MessageLayout:
        return message_layout(self.format, self.hidden, self.topk)

    @property
    def max_recv(self) -> int:
        """Rows a rank can receive: every token of every rank, once per expert it routes here
        (by source: once)."""
        if self.layout == "sources":
            return self.ranks * self.max_tokens_per_rank
        rows = self.max_tokens_per_rank * min(self.experts, self.ranks * self.topk)
        return rows + self.max_tokens_per_rank * int(self.fused_shared_expert)

    @property
    def recv_rows(self) -> int:
        """Received rows the dispatch output holds: `recv_capacity`, at most the worst case."""
        if self.recv_capacity is None:
            return self.max_recv
        return min(self.recv_capacity, self.max_recv)

    @property
    def row_align(self) -> int:
        return FP8_ROW_ALIGN if self.format == "fp8" and self.layout == "packed" else 1

    @property
    def segment_rows(self) -> int:
        """The dispatch kernel's segment_rows: 0 packed, a slab's rows, or SOURCE_ROWS."""
        return SOURCE_ROWS if self.layout == "sources" else self.slab_rows

    @property
    def slab_rows(self) -> int:
        """Rows of one expert's slab in the "slabs" layout (every source's every token); 0 when
        packed."""
        return self.ranks * self.max_tokens_per_rank if self.layout == "slabs" else 0

    @cached_property  # read on every dispatch and combine call; the config is frozen
    def row_capacity(self) -> int:
        """Output rows including each segment's alignment padding (or its whole slab)."""
        if self.layout == "slabs":
            return self.segments * self.slab_rows
        return self.recv_rows + (self.row_align - 1) * self.segments
