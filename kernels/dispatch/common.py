"""Constants, limits and the bounded wait shared by the phases of `ep_dispatch` (and by
`ep_combine`, whose waits are the same)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernels.memory import error_field, gmem_ptr, trace_word
from layouts.buffers import ERROR_CHANNELS, WIDE_TILE_ROWS, WIDE_TILE_WORDS
from layouts.channels import DISPATCH, HEADS, RECV_TIMES, STAGE_BATCH_TOKENS, TRACE_FIELDS
from layouts.formats import METADATA_FIELDS

WARP = 32
MAX_RANKS = 8
MAX_TOPK = 16
MAX_SEGMENTS = 272  # local experts + a shared expert, with slack
MAX_EXPERTS = 2176  # MAX_RANKS x 272
SEND_WARPS = 4
# The named barrier at which a dispatch's receiver warps tell its sender warps that the row layout
# is ready (the senders then zero FP8's alignment rows); barrier 1 is the receivers', 2 + s the
# warps of source s.
PAD_BARRIER = 2 + MAX_RANKS
# A receiver warp's int64 words of s_time, after the sender warps' SEND_TIMES: its RECV_TIMES,
# then the %globaltimer reading at which its current part began (`_lap`).
RECV_TIME_WORDS = len(RECV_TIMES) + 1
# The formats whose receivers move messages by bulk copies through shared memory, RECV_WARPS_BULK
# warps a CTA (their pieces take most of the shared memory); the others move them through
# registers, RECV_WARPS_REGISTERS warps (the batch scratch of 16 would not fit beside their scale
# tiles; 19 warps of a CTA, like 20, put 5 on an SM sub-partition: 96 registers a thread).
BULK_FORMATS = ("bf16", "fp8", "nvfp4")
RECV_WARPS_BULK = 8
RECV_WARPS_REGISTERS = 15
BATCH = STAGE_BATCH_TOKENS  # tokens staged together: a header, tails and credit per batch
MAX_STAGE_BATCHES = 16  # a channel's staging ring, in batches
# 16-byte vectors per lane a sender warp loads before storing them (FP8 and NVFP4 messages of
# H <= 8192 fit one tile of 16), and the vectors a receiver lane holds of a message (NVFP4's
# 8-byte ones: a whole message up to H = 8192; FP8's 16-byte ones in tiles of 8, which keep the
# register path's warps within their registers without spilling).
SEND_VECTORS = {"bf16": 32, "fp8": 16, "nvfp4": 16}
TILE_VECTORS = {"bf16": 16, "fp8": 8, "nvfp4": 16}
MAX_CHUNK = 8  # tokens a combine sender or receiver takes at once (`kernels.combine`)
# A dispatch receiver warp takes a whole batch at once: one header read and one placement pass
# for all of its messages, and a warp's pulls of the batch in flight together.
HEADER_REGS = BATCH * MAX_TOPK // 32  # a batch's header words (ids, weights) per lane
COUNT_UNROLL = 8  # channels' count words a receiver thread loads at once (`_sum_counts`)
SCALE_REGS = 4  # FP8 / NVFP4 scale words per lane a receiver loads with a message's payload
# FP8 / NVFP4 scales go out through a tile per warp: up to TILE_ROWS rows of TILE_COLS words, a
# row TILE_STRIDE words apart (one more than its words: no bank conflicts reading a column).
TILE_ROWS, TILE_COLS = 128, 8
TILE_STRIDE = TILE_COLS + 1
# With bulk receivers the scales go out in wide tiles instead (`layouts.buffers.wide_tile_word`:
# WIDE_TILE_ROWS staged rows of WIDE_TILE_WORDS words, whole 128-byte lines, loaded by 16-byte
# cp.async), one per receiver warp in its pieces.
# Output rows from which the write-out takes wide tiles. Fewer (a decode step's) fill few rows of
# each tile: there the narrow tiles, spread over every warp, end sooner (emulated 2 ranks on an
# H100 at 128 tokens a rank, 24 SMs: the wide tiles took the dispatch 2-5 us longer; at 4096
# tokens 4-20 us shorter).
WIDE_MIN_ROWS = 4096
SEND_BARRIER = 15  # the named barrier of the sender warps (receivers use 1 and 2 + source)
# A receiver warp of a bulk format pulls messages through its own ring of PIECES shared-memory
# pieces of PIECE bytes (bulk loads from the source's staging, bulk stores to the rows), LAG
# pieces in flight ahead of the stores.
PIECE = 8192  # a whole FP8 message (H 7168: 7392 bytes) in one piece
PIECES = 2
LAG = PIECES - 1  # one piece loading while the other is stored
assert WIDE_TILE_ROWS * WIDE_TILE_WORDS * 4 <= PIECES * PIECE  # a warp's wide tile: in its pieces
# How a bulk-moved FP8 / NVFP4 message's scale bytes reach each row (`_store_piece`): bulk
# stores into `scale_rows` (rows of 16-byte multiples), the lanes' word stores there (NVFP4's
# padding bytes cleared), the lanes' stores into FP8's transposed slabs output, or the lanes'
# 16-byte stores into `scale_rows` (rows of 16-byte multiples; the placer/mover split), or
# those stores once a message, into its own row of `scale_rows` (NVFP4's message scales,
# `ScalesPhase._message_scales`).
SCALES_BULK, SCALES_LANES, SCALES_SLABS, SCALES_VECTORS, SCALES_MESSAGES = 0, 1, 2, 3, 4
ROWS = MAX_TOPK + 1  # rows a message can land in: its K experts and the shared expert
FP8_BLOCK = 128
NVFP4_BLOCK = 16
FORMATS = ("bf16", "fp8", "nvfp4")
PHASE_DISPATCH = 1  # the error record's phase (layouts.buffers.PHASES order, 1-based)
# A region of a channel's routing counts in shared memory (`CountsPhase._publish_counts`): a word
# per expert, from MSGS_AT one per destination rank (its messages), at SHARED_AT the tokens a
# fused shared expert takes; COUNT_WORDS in all.
MSGS_AT = MAX_EXPERTS
SHARED_AT = MSGS_AT + MAX_RANKS
COUNT_WORDS = SHARED_AT + MAX_RANKS + 8
IDS, WEIGHTS = METADATA_FIELDS.index("expert_ids"), METADATA_FIELDS.index("weights")
LIMITS = {"max_ranks": MAX_RANKS, "max_topk": MAX_TOPK, "max_segments": MAX_SEGMENTS - 1,
          "max_experts": MAX_EXPERTS, "max_stage_batches": MAX_STAGE_BATCHES,
          "stage_batch": BATCH}
# Per receiver warp, a batch: its tokens' raw ids and local segment ids (by token of the batch);
# then by message (the tokens that come here, in order): the token of the batch, the source
# token, the staging slot, the rows and the scale rows.
IDS_AT, SEGS_AT = 0, BATCH * MAX_TOPK
MAP_AT = 2 * BATCH * MAX_TOPK
TOKS_AT = MAP_AT + BATCH
STAGE_AT = TOKS_AT + BATCH
ROWS_AT = STAGE_AT + BATCH
# The rows of two batches (halves, by batch parity): pieces of a batch still in flight read
# their rows while the next batch is placed.
SROWS_AT = ROWS_AT + 2 * BATCH * ROWS
# Where a source's receivers split into a placer warp and mover warps
# (`_expand_split`, at least SPLIT_MIN_WARPS warps a source), the plans of PLAN_SLOTS batches
# hold their messages' rows in the scratch of the source's first warps, PLAN_SLOTS_A_WARP plans
# a warp at ROWS_AT (over the rows' halves and the scale rows, which that path does not use);
# per source, PLAN_WORDS words of their own (bulk kernels only) hold each plan's messages'
# staging slots, its message count (-1: the stream is over), its batch and its messages' source
# tokens.
PLAN_SLOTS = 6
PLAN_SLOTS_A_WARP = 3
assert PLAN_SLOTS_A_WARP * BATCH * ROWS <= SROWS_AT + BATCH * ROWS - ROWS_AT
PLAN_STAGE_AT = 0
PLAN_CNT_AT = PLAN_STAGE_AT + PLAN_SLOTS * BATCH
PLAN_BATCH_AT = PLAN_CNT_AT + PLAN_SLOTS
PLAN_TOK_AT = PLAN_BATCH_AT + PLAN_SLOTS
PLAN_WORDS = (PLAN_TOK_AT + PLAN_SLOTS * BATCH + 3) // 4 * 4
SCRATCH = SROWS_AT + BATCH * ROWS
SPLIT_MIN_WARPS = 3  # a placer and at least two movers
assert -(-PLAN_SLOTS // PLAN_SLOTS_A_WARP) <= SPLIT_MIN_WARPS  # the plans' rows in s's warps
PLAN_SOURCES = 2  # sources with plans: per_source >= 3 of 8 receiver warps means ranks <= 2
assert RECV_WARPS_BULK // SPLIT_MIN_WARPS <= PLAN_SOURCES
# s_src words per source: messages, messages of the channels before, messages in all, whether a
# warp of it gave up (timed out), tokens of its channel, its first row (rows by source); then,
# per staging slot, how many of the source's warps have finished the batches it held
# (DONE_AT + slot).
DONE_AT = 6
SRC_WORDS = DONE_AT + MAX_STAGE_BATCHES



@cute.jit
def _wait_at_least(addr, target, timeout_ns, error: cute.Pointer, missing, phase):
    """Poll the 64-bit word at `addr` (system scope) until it reaches `target`, then read it once
    more with acquire semantics. Returns (value, 1), or (value, 0) when `timeout_ns` passed
    (recording `missing` and `phase` in the error record) or another wait of the layer already
    failed (a missing rank, or ranks that split their tokens over different channels).

    The first read is an acquire, so a word already there costs one load. The polls after it are
    relaxed: an acquire load also invalidates the SM's L1 cache, which, once per poll of several
    spinning warps, starves the SM's other warps; one acquire follows the last poll."""
    word = gmem_ptr(Int64, addr, 8)
    value = cute.arch.load(word, Int64, sem="acquire", scope="sys")
    ok = Int32(1)
    waited = Int32(0)
    if value < target:
        waited = Int32(1)
        start = cute.arch.globaltimer()
        while value < target and ok != 0:
            value = cute.arch.load(word, Int64, sem="relaxed", scope="sys")
            if value < target:
                if cute.arch.load(error, Int32, sem="relaxed", scope="gpu") != 0 or \
                        (cute.arch.load(error_field(error, "bad_counts"), Int32, sem="relaxed",
                                        scope="gpu") & ERROR_CHANNELS) != 0:
                    ok = Int32(0)
                elif cute.arch.globaltimer() - start > timeout_ns:
                    ok = Int32(0)
                    old = cute.arch.atomic_cas(error, cmp=Int32(0), val=Int32(missing + 1),
                                               sem="relaxed", scope="gpu")
                    if old == 0:
                        cute.arch.store(error_field(error, "phase"), Int32(phase))
    if ok != 0 and waited != 0:
        value = cute.arch.load(word, Int64, sem="acquire", scope="sys")
    return value, ok


@cute.jit
def _await_credit(counters_at, counters, channel, d, need, s_head: cute.Tensor, at, timeout_ns,
                  error: cute.Pointer):
    """Wait until destination d's credit to `channel` (the messages it consumed: a word of this
    rank's counters, which start at address `counters_at`; s_head[at] holds the last value
    seen) reaches `need`. Returns 0 when the wait failed."""
    ok = Int32(1)
    if need > s_head[at]:
        head, ok = _wait_at_least(
            counters_at + Int64(counters((channel, d, HEADS, DISPATCH))) * 8, need, timeout_ns,
            error, d, Int32(PHASE_DISPATCH))
        s_head[at] = head
    return ok


@cute.jit
def _stamp(trace: cute.Pointer, tracing, channel, field: cutlass.Constexpr, value):
    """With tracing on, word `field` (TRACE_FIELDS) of this channel's trace = value."""
    if tracing != 0:
        cute.arch.store(trace_word(trace, channel, TRACE_FIELDS, field), Int64(value))


@cute.jit
def _stamp_max(trace: cute.Pointer, tracing, channel, field: cutlass.Constexpr, value):
    """With tracing on, word `field` of this channel's trace = max(itself, value): the longest of
    several warps (each field was zeroed at the kernel's start)."""
    if tracing != 0:
        cute.arch.atomic_max(trace_word(trace, channel, TRACE_FIELDS, field), Int64(value))


@cute.jit
def _lap(s_time: cute.Tensor, times, part: cutlass.Constexpr, tracing, lane):
    """With tracing on, lane 0 of a receiver warp whose s_time words begin at `times`: the time
    since the warp's last lap added to its RECV_TIMES part `part` (None: a stretch not counted,
    the start of a counted one), and a new lap begun now. The clock is kept in shared memory,
    not in registers, so a dispatch traced off keeps none live across the receive loop."""
    if tracing != 0:
        if lane == 0:
            now = cute.arch.globaltimer()
            if cutlass.const_expr(part is not None):
                s_time[times + RECV_TIMES.index(part)] += now - s_time[times + len(RECV_TIMES)]
            s_time[times + len(RECV_TIMES)] = now
