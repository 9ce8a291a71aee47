"""Which SMs a layer's channels run on.

A channel's CTA stores as fast as its SM's path to memory allows, and SMs in one part of the
chip share that path: with the 24 CTAs of a default launch on an H100, five of them (the
scheduler puts both SMs of four TPCs, 124-131, among them) store at 0.85 of the others' rate,
and a kernel whose channels have equal shares ends when those five do
(`perf/bench_sm_stores.py --place`, perf/results/sm-place-2026-11-26-H100.json). The SMs of a
TPC alone do not slow each other; one channel per TPC (SM index // 2) spreads the channels over
twice as many TPCs, and in that record every SM of such a placement stores at the same rate.

A launch with spare CTAs (grid `launched` > `active`) places its channels so: each CTA claims its
TPC's bit; the first CTA on a TPC takes the next channel index while fewer than `active` are
taken; the others leave unless too few CTAs have yet to arrive to fill the channels, or the
channels are still short SPARE_WAIT_NS after they arrived (a GPU whose free SMs share TPCs), when
they take one too. So exactly `active` CTAs run channels 0 .. active - 1, whatever the GPU is
doing, and none waits on a CTA that may not be scheduled. The last CTA to arrive clears the
words for the next launch.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels.memory import gmem_ptr, nanosleep, store_i32
from layouts.buffers import LAUNCH_FIELDS, TPC_WORDS

SPARE_WAIT_NS = 2000
TAKEN, ARRIVED, TPCS = (LAUNCH_FIELDS.index(f) for f in ("taken", "arrived", "tpcs0"))


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    """The index of the SM this thread runs on (PTX `%smid`)."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


def _word(words: cute.Pointer, field):
    return gmem_ptr(Int32, words.toint() + Int64(field) * 4, 4)


@cute.jit
def claim_channel(words: cute.Pointer, active, launched) -> Int32:
    """This CTA's channel (-1: none), for one thread of it. `words`: the launch's LAUNCH_FIELDS
    (zero before the launch, zero again after it)."""
    channel = Int32(-1)
    tpc = sm_id() // 2
    won = Int32(0)
    if tpc < TPC_WORDS * 32:
        bit = Int32(1) << (tpc % 32)
        old = cute.arch.atomic_or(_word(words, TPCS + tpc // 32), bit, sem="relaxed",
                                  scope="gpu")
        won = Int32((old & bit) == 0)
    # CTAs that arrived before this one; a CTA counts itself once it has decided.
    if won != 0:
        ticket = cute.arch.atomic_add(_word(words, TAKEN), Int32(1), sem="relaxed", scope="gpu")
        if ticket < active:
            channel = ticket
    else:
        start = cute.arch.globaltimer()
        waiting = Int32(1)
        while waiting != 0:
            taken = cute.arch.load(_word(words, TAKEN), Int32, sem="relaxed", scope="gpu")
            arrived = cute.arch.load(_word(words, ARRIVED), Int32, sem="relaxed", scope="gpu")
            if taken >= active:
                waiting = Int32(0)
            elif active - taken >= launched - arrived or \
                    cute.arch.globaltimer() - start > SPARE_WAIT_NS:
                # The CTAs yet to decide could not fill the channels without this one, or the
                # winners are late: take one.
                ticket = cute.arch.atomic_add(_word(words, TAKEN), Int32(1), sem="relaxed",
                                              scope="gpu")
                if ticket < active:
                    channel = ticket
                waiting = Int32(0)
            else:
                nanosleep(100)
    done = cute.arch.atomic_add(_word(words, ARRIVED), Int32(1), sem="acq_rel", scope="gpu")
    if done == launched - 1:
        # Every CTA's claims are in (each arrived after them): clear for the next launch.
        store_i32(_word(words, TAKEN).toint(), 0)
        store_i32(_word(words, ARRIVED).toint(), 0)
        for i in cutlass.range_constexpr(TPC_WORDS):
            store_i32(_word(words, TPCS + i).toint(), 0)
    return channel


@cute.jit
def placed_channel(words: cute.Pointer, channel, active, launched, s_channel: cute.Tensor,
                   tidx) -> Int32:
    """This CTA's channel, for every thread of it (a CTA-wide barrier): `channel` (the CTA's
    index) when the launch has no spare CTAs (`launched` == `active`), else `claim_channel`'s
    (-1: this CTA leaves). `s_channel`: one Int32 of shared memory. Every thread reads the
    channel back from it after the barrier, spare CTAs or not: a claim and a barrier inside
    `if launched > active` made the combine's registers spill."""
    if tidx == 0:
        s_channel[0] = channel
        if launched > active:
            s_channel[0] = claim_channel(words, active, launched)
    cute.arch.sync_threads()
    return s_channel[0]
