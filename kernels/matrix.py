"""The declared matrix of kernel configurations the library is built from.

Every entry is a kernel object with static configuration; the build compiles each for every
target architecture. `ci_matrix()` is one configuration of every kernel family, small enough
for a CPU-only CI run.
"""

from kernels.block_memcpy import BlockMemcpy
from kernels.block_prefix_sum import BlockPrefixSum
from kernels.bulk_copy import BulkSend
from kernels.dispatch import dispatch_kernels
from kernels.combine import combine_kernels
from kernels.encode import encode_kernels
from kernels.gate_table import GateTable
from kernels.net_put import NetPut
from kernels.nvfp4 import QuantizeNvfp4
from kernels.peer_exchange import PeerExchange
from kernels.quantize_quads import QuantizeNvfp4Quads
from kernels.row_expand import row_expand_kernels
from kernels.scale_write_out import scale_write_out_kernels
from kernels.silu import silu_kernels
from kernels.store_rate import store_place_kernels, store_rate_kernels

RANK_COUNTS = (2, 4, 8)


def full_matrix() -> list:
    return [
        BlockMemcpy(),
        BlockPrefixSum(exclusive=False),
        BlockPrefixSum(exclusive=True),
        *(BulkSend(chunk, stages) for chunk, stages in ((16384, 8), (8192, 12), (32768, 6))),
        *(BulkSend(chunk, stages, pull=True) for chunk, stages in ((16384, 8), (32768, 6))),
        *(PeerExchange(ranks) for ranks in RANK_COUNTS),
        NetPut(),
        *row_expand_kernels(),
        *encode_kernels(),
        *dispatch_kernels(),
        *combine_kernels(),
        *(QuantizeNvfp4(scales, e2m1, steps=steps) for scales in ("linear", "128x4")
          for e2m1 in ("software", "hardware") for steps in (2, 1)),
        *(QuantizeNvfp4Quads(e2m1, steps=steps) for e2m1 in ("software", "hardware")
          for steps in (2, 1)),
        *(GateTable(activation) for activation in ("silu", "swiglu_oai")),
        *silu_kernels(),
        *store_rate_kernels(),
        *store_place_kernels(),
        *scale_write_out_kernels(),
    ]


def ci_matrix() -> list:
    """The first configuration of every family for each architecture it is built for."""
    from layouts.abi import ARCHES

    seen, subset = set(), []
    for kernel in full_matrix():
        family = kernel.spec().family
        new = {(family, a) for a in getattr(kernel, "arches", ARCHES)} - seen
        if new:
            seen |= new
            subset.append(kernel)
    return subset
