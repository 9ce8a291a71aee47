"""Warp-level scan shared by the kernels that turn counts into offsets."""

import cutlass
import cutlass.cute as cute

WARP = 32


@cute.jit
def warp_inclusive_sum(value, lane):
    """Inclusive prefix sum of `value` across the 32 lanes of a warp (5 shuffle steps)."""
    incl = value
    for shift in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << shift)
        if lane >= (1 << shift):
            incl = incl + up
    return incl
