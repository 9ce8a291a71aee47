"""The declared matrix of kernel configurations the library is built from.

Every entry is a kernel object with static configuration; the build compiles each for every
target architecture. `ci_matrix()` is one configuration of every kernel family, small enough
for a CPU-only CI run.
"""

from kernels.block_memcpy import BlockMemcpy
from kernels.block_prefix_sum import BlockPrefixSum
from kernels.ep import ep_kernels
from kernels.peer_exchange import PeerExchange

RANK_COUNTS = (2, 4, 8)


def full_matrix() -> list:
    return [
        BlockMemcpy(),
        BlockPrefixSum(exclusive=False),
        BlockPrefixSum(exclusive=True),
        *(PeerExchange(ranks) for ranks in RANK_COUNTS),
        *ep_kernels(),
    ]


def ci_matrix() -> list:
    seen, subset = set(), []
    for kernel in full_matrix():
        family = kernel.spec().family
        if family not in seen:
            seen.add(family)
            subset.append(kernel)
    return subset
