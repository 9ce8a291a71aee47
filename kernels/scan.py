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


@cute.jit
def warp_exclusive_scan(values: cute.Tensor, out: cute.Tensor, n, lane):
    """One warp: `out[i] = values[0] + ... + values[i - 1]` for i < n and `out[n]` = the total.
    Shared-memory tensors; `out` may be `values` (each lane reads its entry before writing it)."""
    carry = cutlass.Int32(0)
    for base in cutlass.range(0, n, WARP):
        i = base + lane
        v = cutlass.Int32(0)
        if i < n:
            v = values[i]
        incl = warp_inclusive_sum(v, lane)
        if i < n:
            out[i] = carry + incl - v
        carry = carry + cute.arch.shuffle_sync(incl, WARP - 1)
    if lane == 0:
        out[n] = carry
