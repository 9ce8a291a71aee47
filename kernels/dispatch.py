"""`ep_dispatch`: one persistent launch per dispatch, a CTA per channel (transport v2).

Channel c of every rank owns a contiguous run of that rank's tokens (`layouts.channels`). Its CTA
has SEND_WARPS sender warps and RECV_WARPS[format] receiver warps, and runs three parts:

1. Counts (all warps): the channel's tokens are routed (each valid (token, k) pair, a later k
   naming the same expert dropped, ids outside [0, E) dropped and reported) and counted per
   expert and per destination rank; the counts go to every destination's `counts` table under
   the round's parity, and the channel's count flag there is raised to the round's epoch.
2. Send (SEND_WARPS sender warps): the channel's tokens go in batches of BATCH, each into the
   next batch slot of this rank's own staging (peer-visible memory, `layouts.channels`): the
   batch header (every token's K ids and weights, as the caller gave them, and its index) and
   each token's message (the bf16 row of `x`; FP8 codes and their scales from their own rows,
   the caller's or `ep_encode`'s; NVFP4 codes and scales from the caller's rows, or the whole
   message `ep_encode` wrote into `send_buf`), token b by warp b % SEND_WARPS, tiles of
   SEND_VECTORS[format] 16-byte vectors per lane with every load in flight. A sender does
   nothing per destination per token: it waits, once per batch, until every destination has
   returned credit for the batch the slot held, and the warp that
   finishes a batch last (one shared-memory atomic a warp) fences once at system scope and
   publishes the batch in every destination's `tails`.
3. Receive (the receiver warps): they wait for every (channel, source)'s counts (a count flag's
   system-scope acquire, then the counts themselves by plain loads, ordered after the acquires by
   the receivers' barrier), from which each CTA derives the whole row layout (segments padded to
   the format's row alignment, NVFP4 segments on fresh 128-row scale blocks) and the first row of
   every (segment, source) that its channel fills. The warps of source s then take s's batches of
   this channel in order as its tail advances: they read the batch's header from the source (over
   NVLink), keep the tokens with an expert here (or this rank's shared-expert tokens), MAX_CHUNK at
   a time, and place each such message in the next free row of each of its local experts, so rows
   follow source-token order without any plan on the sender. The payload is loaded once from the
   source's staging (over NVLink) and stored to every row: BF16 by bulk copies (`cp.async.bulk`)
   through PIECES pieces of shared memory per warp, each piece bulk-stored to every row as it
   lands; FP8 and NVFP4 through registers, a row's scales contiguously into `scale_rows`
   (row-major, `layouts.buffers.scale_rows_layout`); the rows, weights and source token are
   recorded for combine. Credit returns to the source after every batch, and for all the rest of
   the round's batches once the last message from the source has landed (their slots are not read).

4. FP8 and NVFP4 (packed rows): once every CTA has finished (the round's advance below, which
   each CTA waits for), all warps write `scale_rows` into the output's scale layout, a tile of
   whole lines at a time (a scale word stored straight into FP8's transposed or NVFP4's 128x4
   layout is a 32-byte sector of its own: what FP8 and NVFP4 receivers spent most on); NVFP4 by
   a 16-byte store per lane and atom, and a 128-row block of at most 32 rows (a decode's
   experts) straight from its staged rows, the rest of the block zero.

Every wait is bounded by `timeout_ns` of `%globaltimer`: the missing rank and the phase go to the
error record and the CTA stops waiting (its outputs are then partial, never out of bounds). The
round counter advances when the last CTA finishes, so a CUDA graph replays the layer.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from kernels.bulk_copy import bulk_load, bulk_store
from kernels.copy import row_predicate, row_tiled_copy
from kernels.memory import (error_field, gmem_ptr, load_f32, load_i32, scale_offset, store_f32,
                            store_i32, trace_word)
from kernels.nvfp4 import segment_of
from kernels.routing import channel_tokens, route_token
from kernels.scan import warp_exclusive_scan
from layouts.abi import GridRule, KernelSpec, Param
from layouts.buffers import ERROR_CHANNELS, ERROR_COUNTS, scale_rows_layout
from layouts.channels import (COUNT_MESSAGES, COUNT_SEGMENTS, COUNT_TOKENS, DISPATCH, HEADS,
                              SEND_TIMES, STAGE_BATCH_TOKENS, TAILS, TRACE_FIELDS,
                              batch_header_layout, channel_messages_layout, count_flags_layout,
                              counters_layout, counts_layout, header_token_word, headers_layout,
                              staging_layout)
from layouts.config import FP8_ROW_ALIGN
from layouts.formats import METADATA_FIELDS
from layouts.scales import ATOM_BYTES, ATOM_ROWS

WARP = 32
MAX_RANKS = 8
MAX_TOPK = 16
MAX_SEGMENTS = 272  # local experts + a shared expert, with slack
MAX_EXPERTS = 2176  # MAX_RANKS x 272
SEND_WARPS = 4
# Receiver warps per CTA, by format. BF16 receivers move messages by bulk copies through shared
# memory (218 KB of it); FP8 and NVFP4 ones through registers, so more warps keep more messages
# in flight: 20 warps of a CTA fit 96 registers a thread (the block size caps them).
RECV_WARPS = {"bf16": 8, "fp8": 16, "nvfp4": 16}
BATCH = STAGE_BATCH_TOKENS  # tokens staged together: a header, tails and credit per batch
MAX_STAGE_BATCHES = 16  # a channel's staging ring, in batches
# 16-byte vectors per lane a sender warp loads before storing them (FP8 and NVFP4 messages of
# H <= 8192 fit one tile of 16), and the vectors a receiver lane holds of a message (NVFP4's
# 8-byte ones: a whole message up to H = 8192; FP8's 16-byte ones in tiles of 8, which keep 16
# warps within 96 registers without spilling).
SEND_VECTORS = {"bf16": 32, "fp8": 16, "nvfp4": 16}
TILE_VECTORS = {"bf16": 16, "fp8": 8, "nvfp4": 16}
MAX_CHUNK = 8  # tokens of a batch a receiver warp takes at once (BATCH in two chunks)
COUNT_UNROLL = 8  # channels' count words a receiver thread loads at once (`_sum_counts`)
SCALE_REGS = 4  # FP8 / NVFP4 scale words per lane a receiver loads with a message's payload
# FP8 / NVFP4 scales go out through a tile per warp: up to TILE_ROWS rows of TILE_COLS words, a
# row TILE_STRIDE words apart (one more than its words: no bank conflicts reading a column).
TILE_ROWS, TILE_COLS = 128, 8
TILE_STRIDE = TILE_COLS + 1
SEND_BARRIER = 15  # the named barrier of the sender warps (receivers use 1 and 2 + source)
# BF16: a receiver warp pulls messages through its own ring of PIECES shared-memory pieces of
# PIECE bytes (bulk loads from the source's staging, bulk stores to the rows), LAG pieces in
# flight ahead of the stores. (FP8 and NVFP4 messages, a half and a quarter as large with
# scales that go to scattered words, move through registers: their bulk pulls measured slower.)
PIECE = 4096
PIECES = 5
LAG = PIECES - 2
ROWS = MAX_TOPK + 1  # rows a message can land in: its K experts and the shared expert
FP8_BLOCK = 128
NVFP4_BLOCK = 16
FORMATS = ("bf16", "fp8", "nvfp4")
PHASE_DISPATCH = 1  # the error record's phase (layouts.buffers.PHASES order, 1-based)
FLAG_ROUND = 256  # a count flag holds epoch * FLAG_ROUND + the channels its source used
IDS, WEIGHTS = METADATA_FIELDS.index("expert_ids"), METADATA_FIELDS.index("weights")
LIMITS = {"max_ranks": MAX_RANKS, "max_topk": MAX_TOPK, "max_segments": MAX_SEGMENTS - 1,
          "max_experts": MAX_EXPERTS, "max_stage_batches": MAX_STAGE_BATCHES,
          "stage_batch": BATCH}
# Per receiver warp, a chunk of a batch: its tokens' raw ids and local segment ids (by token of
# the chunk); then by message (the tokens that come here, in order): the token of the chunk,
# the source token, the staging slot, the rows and the scale rows.
IDS_AT, SEGS_AT = 0, MAX_CHUNK * MAX_TOPK
MAP_AT = 2 * MAX_CHUNK * MAX_TOPK
TOKS_AT = MAP_AT + MAX_CHUNK
STAGE_AT = TOKS_AT + MAX_CHUNK
ROWS_AT = STAGE_AT + MAX_CHUNK
SROWS_AT = ROWS_AT + MAX_CHUNK * ROWS
SCRATCH = SROWS_AT + MAX_CHUNK * ROWS
# s_src words per source: messages, messages of the channels before, messages in all, the
# chunk decision of its first warp, tokens of its channel.
SRC_WORDS = 5


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


class EpDispatch:
    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"ep_dispatch formats: {FORMATS}, not {fmt!r}")
        self.fmt = fmt
        self.recv_warps = RECV_WARPS[fmt]
        self.send_vectors = SEND_VECTORS[fmt]
        # Per lane: a receiver warp loads this many vectors of a message before storing them.
        self.tile_vectors = TILE_VECTORS[fmt]
        self.threads = WARP * (SEND_WARPS + self.recv_warps)
        self.recv_threads = WARP * self.recv_warps
        self.row_align = FP8_ROW_ALIGN if fmt == "fp8" else 1
        # Payload rows move in 16-byte vectors, NVFP4 rows (H / 2 bytes) in 8-byte ones.
        self.vector_bytes = 8 if fmt == "nvfp4" else 16

    @property
    def smem_bytes(self) -> int:
        words = (MAX_EXPERTS + 2 * MAX_RANKS + 8  # s_cnt
                 + self.recv_warps * MAX_SEGMENTS  # s_next
                 + MAX_RANKS * MAX_SEGMENTS  # s_totals
                 + 4 * (MAX_SEGMENTS + 4)  # s_off, s_tot, s_raw, s_first
                 + SRC_WORDS * MAX_RANKS  # s_src
                 + self.recv_warps * (SCRATCH + MAX_CHUNK * MAX_TOPK)  # s_scratch, s_wts
                 + MAX_STAGE_BATCHES)  # s_arrive
        dwords = SEND_WARPS * MAX_RANKS + SEND_WARPS * len(SEND_TIMES)  # s_head, s_time
        return 4 * words + 8 * dwords + 14 * 16 + 128 + self.ring_bytes + 4 * self.tile_words

    @property
    def tile_words(self) -> int:
        """Shared-memory words of the warps' scale tiles (`_write_scales`); 4 for bf16."""
        return 4 if self.fmt == "bf16" else (SEND_WARPS + self.recv_warps) * TILE_ROWS * TILE_STRIDE

    @property
    def bulk(self) -> bool:
        """Whether receivers pull payloads by bulk copies (BF16) or through registers."""
        return self.fmt == "bf16"

    @property
    def ring_shape(self) -> tuple[int, int]:
        """(pieces, bytes of a piece) of the receiver warps' rings: PIECES of PIECE bytes per
        warp with bulk pulls, else one 16-byte placeholder."""
        return (self.recv_warps * PIECES, PIECE) if self.bulk else (1, 16)

    @property
    def ring_bytes(self) -> int:
        """Shared memory of the receiver warps' pieces, their mbarriers and what each holds,
        with the alignment of the three allocations."""
        pieces, piece = self.ring_shape
        return pieces * (piece + 8 + 4) + 3 * 128

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_dispatch",
            config={"format": self.fmt},
            params=(
                Param("peer_bases", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("source", "ptr", "uint8", align=16),
                Param("scale_source", "ptr", "uint8", align=4),
                Param("scale_stride", "i32"),
                Param("topk_ids", "ptr", "int32", align=4),
                Param("topk_weights", "ptr", "float32", align=4),
                Param("streams", "ptr", "int64", align=8, writes=True),
                Param("rounds", "ptr", "int64", align=8, writes=True),
                Param("done", "ptr", "int32", align=4, writes=True),
                Param("error", "ptr", "int32", align=4, writes=True),
                Param("tokens", "ptr", "uint8", align=16, writes=True),
                # NVFP4: 16-byte stores of a lane's four rows of a 128x4 atom.
                Param("scales", "ptr", "uint8" if self.fmt == "nvfp4" else "float32",
                      align=16 if self.fmt == "nvfp4" else 4,
                      writes=True),
                Param("scale_rows", "ptr", "int32", align=4, writes=True),
                Param("scales_offsets", "ptr", "int32", align=4, writes=True),
                Param("row_offsets", "ptr", "int32", align=4, writes=True),
                Param("expert_ids", "ptr", "int32", align=4, writes=True),
                Param("seg_counts", "ptr", "int32", align=4, writes=True),
                Param("src_info", "ptr", "int32", align=4, writes=True),
                Param("comb_rows", "ptr", "int32", align=4, writes=True),
                Param("comb_weights", "ptr", "float32", align=4, writes=True),
                Param("comb_tokens", "ptr", "int32", align=4, writes=True),
                Param("comb_counts", "ptr", "int32", align=4, writes=True,
                      min_elements=("ranks", 1)),
                Param("chan_msgs", "ptr", "int32", align=4, writes=True,
                      min_elements=("ranks", 1)),
                Param("num_tokens", "i32"),
                Param("max_tokens", "i32"),
                Param("topk", "i32"),
                Param("local_experts", "i32"),
                Param("ranks", "i32"),
                Param("my_rank", "i32"),
                Param("shared", "i32"),
                Param("skip_a2a", "i32"),
                Param("shared_begin", "i32"),
                Param("shared_end", "i32"),
                Param("has_weights", "i32"),
                Param("header_bytes", "i32"),
                Param("source_stride", "i32"),
                Param("load_bytes", "i32"),
                Param("stage_bytes", "i32"),
                Param("stage_batches", "i32"),
                Param("payload_vectors", "i32"),
                Param("scales_offset", "i32"),
                Param("row_capacity", "i32"),
                Param("segment_rows", "i32"),
                Param("channels", "i32"),
                Param("active", "i32"),
                Param("headers_offset", "i64"),
                Param("staging_offset", "i64"),
                Param("counts_offset", "i64"),
                Param("flags_offset", "i64"),
                Param("counters_offset", "i64"),
                Param("timeout_ns", "i64"),
                Param("trace", "ptr", "int64", align=8, writes=True),
                Param("tracing", "i32"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("active", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes=dict(LIMITS, row_align=self.row_align, vector_bytes=self.vector_bytes,
                       recv_warps=self.recv_warps),
        )

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, source: cute.Pointer,
                 scale_source: cute.Pointer, scale_stride: Int32, topk_ids: cute.Pointer,
                 topk_weights: cute.Pointer, streams: cute.Pointer, rounds: cute.Pointer,
                 done: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
                 scales: cute.Pointer, scale_rows: cute.Pointer,
                 scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
                 expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
                 comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                 comb_counts: cute.Pointer, chan_msgs: cute.Pointer, num_tokens: Int32,
                 max_tokens: Int32, topk: Int32,
                 local_experts: Int32, ranks: Int32, my_rank: Int32, shared: Int32,
                 skip_a2a: Int32, shared_begin: Int32, shared_end: Int32, has_weights: Int32,
                 header_bytes: Int32, source_stride: Int32, load_bytes: Int32,
                 stage_bytes: Int32, stage_batches: Int32,
                 payload_vectors: Int32, scales_offset: Int32, row_capacity: Int32,
                 segment_rows: Int32,
                 channels: Int32, active: Int32,
                 headers_offset: Int64, staging_offset: Int64, counts_offset: Int64,
                 flags_offset: Int64,
                 counters_offset: Int64, timeout_ns: Int64, trace: cute.Pointer,
                 tracing: Int32, stream):
        self.kernel(peer_bases, source, scale_source, scale_stride, topk_ids, topk_weights,
                    streams, rounds, done, error,
                    tokens, scales, scale_rows, scales_offsets, row_offsets, expert_ids, seg_counts,
                    src_info, comb_rows, comb_weights, comb_tokens, comb_counts, chan_msgs,
                    num_tokens,
                    max_tokens, topk, local_experts, ranks, my_rank, shared, skip_a2a,
                    shared_begin, shared_end, has_weights, header_bytes, source_stride,
                    load_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                    row_capacity, segment_rows, channels, active,
                    headers_offset, staging_offset, counts_offset, flags_offset,
                    counters_offset, timeout_ns, trace, tracing,
                    row_tiled_copy(WARP, Uint8, self.vector_bytes),
                    row_tiled_copy(WARP, Uint8, 16)).launch(
            grid=(active, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, peer_bases: cute.Pointer, source: cute.Pointer,
               scale_source: cute.Pointer, scale_stride: Int32, topk_ids: cute.Pointer,
               topk_weights: cute.Pointer, streams: cute.Pointer, rounds: cute.Pointer,
               done: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
               scales: cute.Pointer, scale_rows: cute.Pointer,
               scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
               expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
               comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
               comb_counts: cute.Pointer, chan_msgs: cute.Pointer, num_tokens: Int32,
               max_tokens: Int32, topk: Int32, local_experts: Int32, ranks: Int32,
               my_rank: Int32, shared: Int32,
               skip_a2a: Int32, shared_begin: Int32, shared_end: Int32, has_weights: Int32,
               header_bytes: Int32, source_stride: Int32, load_bytes: Int32,
               stage_bytes: Int32, stage_batches: Int32,
               payload_vectors: Int32, scales_offset: Int32, row_capacity: Int32,
               segment_rows: Int32,
               channels: Int32, active: Int32,
               headers_offset: Int64, staging_offset: Int64, counts_offset: Int64,
               flags_offset: Int64,
               counters_offset: Int64, timeout_ns: Int64, trace: cute.Pointer, tracing: Int32,
               warp_copy: cute.TiledCopy, send_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        channel, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        experts = local_experts * ranks
        segments = local_experts + shared
        entries = COUNT_SEGMENTS + segments

        smem = cutlass.memory.SmemAllocator()
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS + 2 * MAX_RANKS + 8),
                                     byte_alignment=16)
        s_next = smem.allocate_tensor(Int32, cute.make_layout(self.recv_warps * MAX_SEGMENTS),
                                      byte_alignment=16)
        s_totals = smem.allocate_tensor(Int32, cute.make_layout(MAX_RANKS * MAX_SEGMENTS),
                                        byte_alignment=16)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_tot = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_raw = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4), byte_alignment=16)
        s_first = smem.allocate_tensor(Int32, cute.make_layout(MAX_SEGMENTS + 4),
                                       byte_alignment=16)
        s_src = smem.allocate_tensor(Int32, cute.make_layout(SRC_WORDS * MAX_RANKS),
                                     byte_alignment=16)
        s_rows = smem.allocate_tensor(Int32, cute.make_layout(self.recv_warps * SCRATCH),
                                      byte_alignment=16)
        s_wts = smem.allocate_tensor(
            Float32, cute.make_layout(self.recv_warps * MAX_CHUNK * MAX_TOPK), byte_alignment=16)
        # Per sender warp: the staging credit it has seen per destination, its times; per batch
        # slot, the sender warps done with the batch it holds (`_send`).
        s_arrive = smem.allocate_tensor(Int32, cute.make_layout(MAX_STAGE_BATCHES),
                                        byte_alignment=16)
        s_head = smem.allocate_tensor(Int64, cute.make_layout(SEND_WARPS * MAX_RANKS),
                                      byte_alignment=16)
        s_time = smem.allocate_tensor(Int64, cute.make_layout(SEND_WARPS * len(SEND_TIMES)),
                                      byte_alignment=16)
        s_tile = smem.allocate_tensor(Int32, cute.make_layout(self.tile_words), byte_alignment=16)
        # Per receiver warp: PIECES pieces of messages, their mbarriers and what each holds.
        pieces, piece = self.ring_shape
        s_ring = smem.allocate_tensor(Uint8, cute.make_layout(pieces * piece), byte_alignment=128)
        s_full = smem.allocate_array(Int64, pieces, byte_alignment=8)
        s_piece = smem.allocate_tensor(Int32, cute.make_layout(pieces), byte_alignment=16)

        if tidx == 0:
            _stamp(trace, tracing, channel, "start", cute.arch.globaltimer())
            # Maxima over warps, zeroed before any warp adds to them.
            _stamp(trace, tracing, channel, "send_done", 0)
            _stamp(trace, tracing, channel, "recv_wait_ns", 0)
            _stamp(trace, tracing, channel, "first_batch", 0)
            _stamp(trace, tracing, channel, "chunk_read", 0)
            _stamp(trace, tracing, channel, "chunk_placed", 0)
            _stamp(trace, tracing, channel, "chunk_stored", 0)
            _stamp(trace, tracing, channel, "recv_done", 0)
            _stamp(trace, tracing, channel, "rows_written", 0)
            for f in cutlass.range_constexpr(len(SEND_TIMES)):
                _stamp(trace, tracing, channel, SEND_TIMES[f], 0)
        if tidx < MAX_STAGE_BATCHES:
            s_arrive[tidx] = Int32(0)
        if cutlass.const_expr(self.bulk):
            if tidx == 0:
                for i in cutlass.range(self.recv_warps * PIECES):
                    cute.arch.mbarrier_init(s_full + i, 1)
                cute.arch.mbarrier_init_fence()
        peers = cute.make_tensor(peer_bases, cute.make_layout(ranks))
        here = peers[my_rank]
        epoch = cute.arch.load(rounds, Int64, sem="relaxed", scope="gpu") + 1
        parity = Int32((epoch - 1) % 2)
        counts_at = counts_layout(entries, channels, ranks)
        flags_at = count_flags_layout(channels, ranks)
        counters = counters_layout(channels, ranks)

        t0, t1 = channel_tokens(channel, num_tokens, active)

        # 1. Counts --------------------------------------------------------------------------
        msgs_at = MAX_EXPERTS  # s_cnt[msgs_at + d]: messages to d; [shared_at]: shared tokens
        shared_at = MAX_EXPERTS + MAX_RANKS
        for i in cutlass.range(tidx, MAX_EXPERTS + 2 * MAX_RANKS + 8, self.threads):
            s_cnt[i] = Int32(0)
        cute.arch.sync_threads()
        for t in cutlass.range(t0 + tidx, t1, self.threads):
            mask, bad = route_token(topk_ids, t, topk, experts, local_experts, my_rank,
                                    skip_a2a, shared, shared_begin, shared_end, s_cnt, True,
                                    MAX_TOPK)
            if bad != 0:
                cute.arch.atomic_or(error_field(error, "bad_ids"), bad, sem="relaxed",
                                    scope="gpu")
            for d in cutlass.range(ranks):
                if (mask >> d) & 1 != 0:
                    cute.arch.atomic_add(s_cnt.iterator + msgs_at + d, Int32(1))
            if shared != 0 and t >= shared_begin and t < shared_end:
                cute.arch.atomic_add(s_cnt.iterator + shared_at, Int32(1))
        cute.arch.sync_threads()
        if tidx == 0:
            _stamp(trace, tracing, channel, "routed", cute.arch.globaltimer())
        for i in cutlass.range(tidx, ranks * entries, self.threads):
            d = i // entries
            entry = i - d * entries
            value = Int32(0)
            if entry == COUNT_MESSAGES:
                value = s_cnt[msgs_at + d]
            elif entry == COUNT_TOKENS:
                value = t1 - t0
            elif shared != 0 and entry == COUNT_SEGMENTS:
                if d == my_rank:
                    value = s_cnt[shared_at]
            else:
                value = s_cnt[d * local_experts + entry - COUNT_SEGMENTS - shared]
            store_i32(peers[d] + counts_offset
                       + Int64(counts_at((entry, channel, my_rank, parity))) * 4, value)
        cute.arch.sync_threads()
        if tidx < ranks:
            cute.arch.fence_acq_rel_sys()
            flag = peers[tidx] + flags_offset + Int64(flags_at((channel, my_rank, parity))) * 8
            cute.arch.store(gmem_ptr(Int64, flag, 8), epoch * FLAG_ROUND + Int64(active),
                            sem="release", scope="sys")
        if tidx == 0:
            _stamp(trace, tracing, channel, "counts_sent", cute.arch.globaltimer())

        # 2. Send ----------------------------------------------------------------------------
        if warp < SEND_WARPS:
            self._send(warp, lane, channel, t0, t1, peers, here, source, scale_source,
                       scale_stride, topk_ids, topk_weights, streams, error, topk, ranks,
                       my_rank, has_weights, header_bytes, source_stride, load_bytes,
                       stage_bytes, stage_batches, channels, headers_offset, staging_offset,
                       counters_offset, counters, timeout_ns, payload_vectors, scales_offset,
                       send_copy, s_arrive, s_head, s_time, trace, tracing)

        # 3. Receive -------------------------------------------------------------------------
        if warp >= SEND_WARPS:
            self._receive(tidx - SEND_WARPS * WARP, channel, peers, here, streams, error, tokens,
                          scales, scale_rows, scales_offsets, row_offsets, expert_ids, seg_counts,
                          src_info, comb_rows, comb_weights, comb_tokens, comb_counts, chan_msgs,
                          max_tokens, topk, local_experts, ranks, my_rank, shared, skip_a2a,
                          shared_begin, shared_end, header_bytes, stage_bytes, stage_batches,
                          payload_vectors, scales_offset, row_capacity, segment_rows, channels,
                          active, headers_offset, staging_offset, counts_offset, flags_offset,
                          counters_offset, counters, counts_at, flags_at, parity, epoch,
                          timeout_ns, s_next, s_totals, s_off, s_tot, s_raw, s_first, s_src,
                          s_rows, s_wts, s_ring, s_full, s_piece, warp_copy, trace, tracing)

        # The last CTA to finish advances the round.
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()  # this CTA's rows before its arrival
            old = cute.arch.atomic_add(done, Int32(1), sem="acq_rel", scope="gpu")
            if old == active - 1:
                cute.arch.store(done, Int32(0))
                cute.arch.store(rounds, epoch, sem="release", scope="gpu")
            _stamp(trace, tracing, channel, "round_done", cute.arch.globaltimer())
        if cutlass.const_expr(self.fmt != "bf16"):
            if segment_rows == 0:
                # Every CTA's received scales are in scale_rows once the round has advanced:
                # then all of them write the output's layout, a share each.
                if tidx == 0:
                    _wait_at_least(rounds.toint(), epoch, timeout_ns, error, my_rank,
                                   Int32(PHASE_DISPATCH))
                cute.arch.sync_threads()
                self._write_scales(warp, lane, channel, active, scales, scale_rows, s_off, s_raw,
                                   s_first, s_tile, local_experts + shared, row_capacity,
                                   payload_vectors)
        if tidx == 0:
            _stamp(trace, tracing, channel, "end", cute.arch.globaltimer())

    @cute.jit
    def _send(self, sw, lane, channel, t0, t1, peers: cute.Tensor, here, source: cute.Pointer,
              scale_source: cute.Pointer, scale_stride, topk_ids: cute.Pointer,
              topk_weights: cute.Pointer, streams: cute.Pointer, error: cute.Pointer, topk,
              ranks, my_rank, has_weights, header_bytes, source_stride, load_bytes, stage_bytes,
              stage_batches, channels, headers_offset, staging_offset, counters_offset,
              counters, timeout_ns, payload_vectors, scales_offset, send_copy: cute.TiledCopy,
              s_arrive: cute.Tensor, s_head: cute.Tensor, s_time: cute.Tensor,
              trace: cute.Pointer, tracing):
        """Sender warp `sw`: every batch of the channel's tokens into the next batch slot of this
        rank's staging, this warp's share of its header words and its tokens b = sw,
        sw + SEND_WARPS, ...; the last warp done with a batch publishes it."""
        stage = staging_layout(stage_bytes, stage_batches * BATCH, channels)
        headers = headers_layout(header_bytes, stage_batches, channels)
        hdr = batch_header_layout(topk)
        credit_at = here + counters_offset  # destinations' credit lands in these counters
        mine = sw * MAX_RANKS  # this warp's words of the per-destination arrays
        times = sw * len(SEND_TIMES)
        # Batches this channel staged in earlier rounds (the same count for every destination).
        position = cute.arch.load(gmem_ptr(
            Int64, streams.toint() + Int64(counters((channel, 0, TAILS, DISPATCH))) * 8, 8), Int64)
        if lane < ranks:
            s_head[mine + lane] = Int64(-1)  # nothing seen yet: the first wait reads it
        if lane < len(SEND_TIMES):
            s_time[times + lane] = Int64(0)
        alive = Int32(1)
        cute.arch.sync_warp()
        # The message bytes a sender moves (payload and scales) as rows of 16-byte vectors, in
        # tiles of SEND_VECTORS[format] vectors per lane.
        load_vectors = load_bytes // 16
        layout = cute.make_layout((load_vectors, 16), stride=(16, 1))
        tiler = (WARP * self.send_vectors, 16)
        g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = send_copy.get_slice(lane)
        tiles = cute.ceil_div(load_vectors, WARP * self.send_vectors)
        batches = (t1 - t0 + BATCH - 1) // BATCH
        for i in cutlass.range(batches):
            at = position + Int64(i)  # the batch's place in the channel's stream
            slot = Int32(at % Int64(stage_batches))
            batch = t0 + i * BATCH
            n = cutlass.min(Int32(BATCH), t1 - batch)
            start = Int64(0)
            if tracing != 0:
                start = cute.arch.globaltimer()
            # The slot is free once every destination is done with the batch it held.
            ok = Int32(1)
            if lane < ranks and alive != 0:
                ok = _await_credit(credit_at, counters, channel, lane,
                                   at - Int64(stage_batches) + 1, s_head, mine + lane, timeout_ns,
                                   error)
            if cute.arch.vote_ballot_sync(ok == 0) != 0:
                alive = Int32(0)
            if tracing != 0 and lane == 0:
                s_time[times] += cute.arch.globaltimer() - start
                start = cute.arch.globaltimer()
            if alive != 0:
                # The header: ids and weights as [n, K] words, as in topk_ids (this warp's
                # share), then the tokens' indices.
                head = cute.make_tensor(gmem_ptr(Int32, here + headers_offset + Int64(
                    headers((0, slot, channel))), 16), cute.make_layout(
                    header_token_word(topk, BATCH)))
                head_f = cute.make_tensor(gmem_ptr(Float32, head.iterator.toint(), 16),
                                          cute.make_layout(header_token_word(topk, BATCH)))
                for w in cutlass.range(sw * WARP + lane, n * topk, SEND_WARPS * WARP):
                    b = w // topk
                    k = w - b * topk
                    from_at = Int64(batch) * Int64(topk) + Int64(w)
                    head[hdr((k, IDS, b))] = load_i32(topk_ids.toint() + from_at * 4)
                    weight = Float32(0.0)
                    if has_weights != 0:
                        weight = load_f32(topk_weights.toint() + from_at * 4)
                    head_f[hdr((k, WEIGHTS, b))] = weight
                if sw == SEND_WARPS - 1 and lane < n:
                    head[header_token_word(topk, lane)] = batch + lane
                if tracing != 0 and lane == 0:
                    s_time[times + 1] += cute.arch.globaltimer() - start
                    start = cute.arch.globaltimer()
                for b in cutlass.range(sw, n, SEND_WARPS):
                    tok = batch + b
                    staged_at = here + staging_offset + Int64(stage((0, slot * BATCH + b,
                                                                     channel)))
                    g_src = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                        Uint8, source.toint() + Int64(tok) * Int64(source_stride), 16),
                        layout), tiler)
                    g_dst = cute.zipped_divide(cute.make_tensor(
                        gmem_ptr(Uint8, staged_at, 16), layout), tiler)
                    for tile in cutlass.range(tiles):
                        pred = row_predicate(thr.partition_S(g_crd[((None, None), tile)]),
                                             load_vectors)
                        t_src = thr.partition_S(g_src[((None, None), tile)])
                        regs = cute.make_fragment_like(t_src)
                        cute.copy(send_copy, t_src, regs, pred=pred)
                        cute.copy(send_copy, regs, thr.partition_D(g_dst[((None, None), tile)]),
                                  pred=pred)
                    # The scales from their own rows (the payload above is the codes alone):
                    # always for FP8, for NVFP4 when the caller quantized (scale_stride != 0).
                    if cutlass.const_expr(self.fmt == "fp8"):
                        self._copy_scale_row(lane, scale_source, tok, scale_stride, staged_at,
                                             scales_offset, payload_vectors)
                    if cutlass.const_expr(self.fmt == "nvfp4"):
                        if scale_stride != 0:
                            self._copy_scale_row(lane, scale_source, tok, scale_stride,
                                                 staged_at, scales_offset, payload_vectors)
                if tracing != 0 and lane == 0:
                    s_time[times + 2] += cute.arch.globaltimer() - start
            # This warp's share of the batch is written. The warp that completes the batch
            # (the last of SEND_WARPS to arrive at its slot's counter) fences once at system
            # scope, covering every warp's stores (each arrived after its own), and publishes
            # the batch to every destination. It does so before it arrives at any later batch,
            # so a later batch is published after this one: tails only grow.
            cute.arch.sync_warp()
            if alive != 0 and lane == 0:
                start = Int64(0)
                if tracing != 0:
                    start = cute.arch.globaltimer()
                old = cute.arch.atomic_add(s_arrive.iterator + slot, Int32(1), sem="acq_rel",
                                           scope="cta")
                if old == SEND_WARPS - 1:
                    # The slot's next batch starts only after every destination returned credit
                    # for this one, so the counter is reset before anyone arrives there again.
                    s_arrive[slot] = Int32(0)
                    cute.arch.fence_acq_rel_sys()
                    for d in cutlass.range(ranks):
                        tail = peers[d] + counters_offset + Int64(
                            counters((channel, my_rank, TAILS, DISPATCH))) * 8
                        cute.arch.store(gmem_ptr(Int64, tail, 8), at + 1, sem="release",
                                        scope="sys")
                if tracing != 0:
                    s_time[times + 3] += cute.arch.globaltimer() - start
            cute.arch.sync_warp()
        if sw == 0 and lane == 0:
            cute.arch.store(gmem_ptr(Int64, streams.toint()
                                 + Int64(counters((channel, 0, TAILS, DISPATCH))) * 8, 8),
                            position + Int64(batches))
        if lane == 0:
            _stamp_max(trace, tracing, channel, "send_done", cute.arch.globaltimer())
            for f in cutlass.range_constexpr(len(SEND_TIMES)):
                _stamp_max(trace, tracing, channel, SEND_TIMES[f], s_time[times + f])

    @cute.jit
    def _copy_scale_row(self, lane, scale_source: cute.Pointer, tok, scale_stride, staged_at,
                        scales_offset, payload_vectors):
        """Token `tok`'s scale row into its staged message, a 32-bit word a lane: FP8's fp32
        words (H / 128), NVFP4's e4m3 bytes four to a word (H / 64 words)."""
        payload_bytes = payload_vectors * self.vector_bytes
        words = payload_bytes // FP8_BLOCK
        if cutlass.const_expr(self.fmt == "nvfp4"):
            words = payload_bytes * 2 // NVFP4_BLOCK // 4
        src = scale_source.toint() + Int64(tok) * Int64(scale_stride)
        for w0 in cutlass.range(0, words, WARP):
            w = w0 + lane
            if w < words:
                store_i32(staged_at + Int64(scales_offset) + Int64(w) * 4,
                          load_i32(src + Int64(w) * 4))

    @cute.jit
    def _receive(self, rt, channel, peers: cute.Tensor, here, streams: cute.Pointer,
                 error: cute.Pointer, tokens: cute.Pointer, scales: cute.Pointer,
                 scale_rows: cute.Pointer,
                 scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
                 expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
                 comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                 comb_counts: cute.Pointer, chan_msgs: cute.Pointer, max_tokens, topk,
                 local_experts, ranks, my_rank, shared, skip_a2a, shared_begin, shared_end,
                 header_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                 row_capacity, segment_rows, channels, active, headers_offset, staging_offset,
                 counts_offset, flags_offset, counters_offset, counters, counts_at, flags_at,
                 parity, epoch, timeout_ns, s_next: cute.Tensor, s_totals: cute.Tensor,
                 s_off: cute.Tensor, s_tot: cute.Tensor, s_raw: cute.Tensor, s_first: cute.Tensor,
                 s_src: cute.Tensor, s_rows: cute.Tensor, s_wts: cute.Tensor,
                 s_ring: cute.Tensor, s_full: cute.Pointer, s_piece: cute.Tensor,
                 warp_copy: cute.TiledCopy, trace: cute.Pointer, tracing):
        """The receiver warps (thread rt of recv_warps * 32)."""
        threads = self.recv_threads
        rwarp = rt // WARP
        lane = rt % WARP
        segments = local_experts + shared
        # 3a. Every (channel, source)'s counts of this round. A source that split its tokens
        # over another number of channels (another num_input_tokens) is reported, not waited
        # for past its channels.
        for i in cutlass.range(rt, ranks * active, threads):
            s = i // active
            c = i - s * active
            flag, ok = _wait_at_least(here + flags_offset + Int64(flags_at((c, s, parity))) * 8,
                                      epoch * FLAG_ROUND, timeout_ns, error, s,
                                      Int32(PHASE_DISPATCH))
            if ok != 0 and flag % FLAG_ROUND != Int64(active):
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_CHANNELS),
                                    sem="relaxed", scope="gpu")
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rt == 0:
            _stamp(trace, tracing, channel, "counts_arrived", cute.arch.globaltimer())
        failed = cute.arch.load(error, Int32, sem="relaxed", scope="gpu") != 0 or \
            (cute.arch.load(error_field(error, "bad_counts"), Int32, sem="relaxed",
                            scope="gpu") & ERROR_CHANNELS) != 0
        # Per source: messages of this channel, messages of the channels before it, in total;
        # the tokens of its channel (so its batches).
        if rt < ranks:
            # Loaded whether or not the layer failed (they are this rank's own words), so the
            # loads need not wait for the error words; a failed layer discards them unreported.
            n = self._count(here, counts_offset, counts_at, COUNT_MESSAGES, channel, rt, parity)
            ntok = self._count(here, counts_offset, counts_at, COUNT_TOKENS, channel, rt, parity)
            before, total = self._sum_counts(here, counts_offset, counts_at, COUNT_MESSAGES, rt,
                                             parity, channel, active, max_tokens, error, failed)
            if failed:
                n = Int32(0)
                ntok = Int32(0)
                before = Int32(0)
                total = Int32(0)
            else:
                if n < 0 or n > max_tokens or ntok < n or ntok > max_tokens:
                    cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                        sem="relaxed", scope="gpu")
                    n = Int32(0)
                    ntok = Int32(0)
            if total > max_tokens:
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                    sem="relaxed", scope="gpu")
                n = Int32(0)
                ntok = Int32(0)
                total = Int32(0)
            s_src[rt] = n
            s_src[3 * MAX_RANKS + rt] = Int32(0)  # set once a warp of source rt gives up
            s_src[4 * MAX_RANKS + rt] = ntok
            cute.make_tensor(chan_msgs, channel_messages_layout(ranks, channels).to_cute())[
                (rt, channel)] = n
            s_src[MAX_RANKS + rt] = before
            s_src[2 * MAX_RANKS + rt] = total
        # Per (source, segment): rows before this channel's and in all, a thread each (the
        # channels' counts loaded together); then per segment, the sources in order.
        for i in cutlass.range(rt, ranks * segments, threads):
            s = i // segments
            g = i - s * segments
            part, total = self._sum_counts(here, counts_offset, counts_at, COUNT_SEGMENTS + g,
                                           s, parity, channel, active, max_tokens, error, failed)
            if failed:
                part = Int32(0)
                total = Int32(0)
            s_next[s * MAX_SEGMENTS + g] = part
            s_totals[s * MAX_SEGMENTS + g] = total
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rt == 0:
            _stamp(trace, tracing, channel, "counts_summed", cute.arch.globaltimer())
        for g in cutlass.range(rt, segments, threads):
            run = Int32(0)
            for s in cutlass.range(ranks):
                s_next[s * MAX_SEGMENTS + g] = s_next[s * MAX_SEGMENTS + g] + run
                run = run + s_totals[s * MAX_SEGMENTS + g]
            s_raw[g] = run
            if segment_rows > 0:
                s_tot[g] = segment_rows  # slabs: every segment the worst case long
            else:
                s_tot[g] = (run + self.row_align - 1) // self.row_align * self.row_align
            if cutlass.const_expr(self.fmt == "nvfp4"):
                s_first[g] = (run + ATOM_ROWS - 1) // ATOM_ROWS
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rwarp == 0:
            warp_exclusive_scan(s_tot, s_off, segments, lane)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                warp_exclusive_scan(s_first, s_first, segments, lane)
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        # The segment offsets (and nvfp4 scale blocks), once per rank; padding, shared out.
        if channel == 0:
            offsets = cute.make_tensor(row_offsets, cute.make_layout(segments + 1))
            for g in cutlass.range(rt, segments + 1, threads):
                offsets[g] = s_off[g]
            for g in cutlass.range(rt, segments, threads):
                cute.make_tensor(expert_ids, cute.make_layout(segments))[g] = g - shared
                cute.make_tensor(seg_counts, cute.make_layout(segments))[g] = s_raw[g]
                if cutlass.const_expr(self.fmt == "nvfp4"):
                    cute.make_tensor(scales_offsets, cute.make_layout(segments))[g] = \
                        s_first[g] - s_off[g] // ATOM_ROWS
            for s in cutlass.range(rt, ranks, threads):
                cute.make_tensor(comb_counts, cute.make_layout(ranks))[s] = \
                    s_src[2 * MAX_RANKS + s]
        payload_bytes = Int64(payload_vectors) * self.vector_bytes
        blocks = payload_vectors * self.vector_bytes // FP8_BLOCK
        scale_cols = payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK
        rk = (scale_cols + 3) // 4
        # Padding: the receiver warps of every channel take a segment each in turn.
        if cutlass.const_expr(self.row_align > 1):
            if segment_rows == 0:  # slabs leave the rows past a segment's count undefined
                self._zero_row_padding(channel * self.recv_warps + rwarp,
                                       active * self.recv_warps, lane, tokens, scale_rows,
                                       src_info, s_off, s_raw, segments, payload_bytes, blocks,
                                       row_capacity)

        # 3b. The messages of source s (warps rwarp = s, s + ranks, ... share them: each copies
        # its share of every payload, the first of them does the rest).
        # Warps per source: a chunk's messages go one per warp, so more warps than a chunk's
        # messages would idle (the rest of the warps then have no source).
        per_source = cutlass.min(self.recv_warps // ranks, MAX_CHUNK)
        s = rwarp % ranks
        sub = rwarp // ranks
        for i in cutlass.range(rt, ranks * segments, threads):
            s_next[(i // segments) * MAX_SEGMENTS + i % segments] += s_off[i % segments]
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if sub > 0 and sub < per_source:
            # This warp's own copy of the next free row of each segment for source s (warp s
            # keeps source s's in place).
            for g in cutlass.range(lane, segments, WARP):
                s_next[rwarp * MAX_SEGMENTS + g] = s_next[s * MAX_SEGMENTS + g]
        cute.arch.barrier(barrier_id=1, number_of_threads=threads)
        if rt == 0:
            _stamp(trace, tracing, channel, "layout_ready", cute.arch.globaltimer())
        if sub < per_source:
            self._expand(lane, sub, per_source, s, channel, peers, here, streams, error, tokens,
                         scales, scale_rows, segment_rows, src_info, comb_rows, comb_weights,
                         comb_tokens, max_tokens, topk, local_experts, ranks, my_rank, shared,
                         skip_a2a, shared_begin, shared_end, header_bytes, stage_bytes,
                         stage_batches, payload_vectors,
                         scales_offset, row_capacity, channels, headers_offset, staging_offset,
                         counters_offset, counters, timeout_ns, s_next, s_off, s_first, s_src,
                         s_rows, s_wts, s_ring, s_full, s_piece, rwarp, warp_copy,
                         payload_bytes, blocks, scale_cols, rk, trace, tracing)

    @cute.jit
    def _count(self, here, counts_offset, counts_at, entry, c, s, parity):
        """Entry `entry` of (channel c, source s)'s counts. A plain load: the receivers read the
        counts only after their flags' system-scope acquires (which also invalidate the SM's L1)
        and a barrier of the receiver threads, so the peers' words are visible to them."""
        return load_i32(here + counts_offset + Int64(counts_at((entry, c, s, parity))) * 4)

    @cute.jit
    def _sum_counts(self, here, counts_offset, counts_at, entry, s, parity, channel, active,
                    max_tokens, error: cute.Pointer, failed):
        """(sum over the channels before `channel`, sum over the `active` channels) of entry
        `entry` of source s's counts. A value outside [0, max_tokens] is counted 0 and reported
        unless the layer already `failed`. Unrolled by COUNT_UNROLL (32 measured slower)."""
        part = Int32(0)
        total = Int32(0)
        bad = Int32(0)
        for c in cutlass.range(active, unroll=COUNT_UNROLL):
            v = self._count(here, counts_offset, counts_at, entry, c, s, parity)
            if v < 0 or v > max_tokens:
                bad = Int32(1)
                v = Int32(0)
            if c < channel:
                part = part + v
            total = total + v
        if bad != 0 and not failed:
            cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                sem="relaxed", scope="gpu")
        return part, total

    @cute.jit
    def _expand(self, lane, sub, per_source, s, channel, peers: cute.Tensor, here,
                streams: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
                scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows,
                src_info: cute.Pointer, comb_rows: cute.Pointer,
                comb_weights: cute.Pointer, comb_tokens: cute.Pointer, max_tokens, topk,
                local_experts, ranks, my_rank, shared, skip_a2a, shared_begin, shared_end,
                header_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                row_capacity, channels, headers_offset, staging_offset, counters_offset,
                counters, timeout_ns, s_next: cute.Tensor, s_off: cute.Tensor,
                s_first: cute.Tensor, s_src: cute.Tensor, s_scratch: cute.Tensor,
                s_wts: cute.Tensor, s_ring: cute.Tensor, s_full: cute.Pointer,
                s_piece: cute.Tensor, rwarp, warp_copy: cute.TiledCopy, payload_bytes, blocks,
                scale_cols, rk, trace: cute.Pointer, tracing):
        """One warp of source s: s's batches of this channel in order, once each is published,
        until the last message from s has landed. Every warp of s reads the batch's header and
        places the rows of its messages (so each keeps the same next-row counters), MAX_CHUNK
        tokens at a time; message m of a chunk is then pulled from the source's staging by warp
        m % per_source and stored to its rows. The warps of s meet at a named barrier after
        each batch, which then goes back to s."""
        stage = staging_layout(stage_bytes, stage_batches * BATCH, channels)
        headers = headers_layout(header_bytes, stage_batches, channels)
        hdr = batch_header_layout(topk)
        n = s_src[s]
        first_msg = s_src[MAX_RANKS + s]
        ntok = s_src[4 * MAX_RANKS + s]
        batches = (ntok + BATCH - 1) // BATCH
        consumed = cute.arch.load(gmem_ptr(Int64, streams.toint() + Int64(
            counters((channel, s, HEADS, DISPATCH))) * 8, 8), Int64)
        tail_word = here + counters_offset + Int64(counters((channel, s, TAILS, DISPATCH))) * 8
        head_word = peers[s] + counters_offset + Int64(
            counters((channel, my_rank, HEADS, DISPATCH))) * 8
        staging = peers[s] + staging_offset
        scratch = rwarp * SCRATCH
        wts = rwarp * MAX_CHUNK * MAX_TOPK
        next_at = rwarp * MAX_SEGMENTS
        lo = my_rank * local_experts
        vec = self.vector_bytes
        layout = cute.make_layout((payload_vectors, vec), stride=(vec, 1))
        tiler = (WARP * self.tile_vectors, vec)
        g_crd = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
        thr = warp_copy.get_slice(lane)
        tiles = cute.ceil_div(payload_vectors, WARP * self.tile_vectors)
        # BF16 rows (16-byte multiples: H is a multiple of 8) move by bulk copies through the
        # warp's pieces.
        pieces = Int32((payload_bytes + PIECE - 1) // PIECE)
        pieces_at = s_ring.iterator + rwarp * PIECES * PIECE
        full = s_full + rwarp * PIECES
        held = rwarp * PIECES  # s_piece words: what each piece of the ring holds
        issued = Int32(0)  # pieces loaded and stored by this warp, over the whole stream
        drained = Int32(0)
        tail = consumed
        alive = Int32(1)
        waited = Int64(0)
        placed = Int32(0)  # messages of s this warp has seen
        i = Int32(0)
        while i < batches and placed < n:
            at = consumed + Int64(i)
            # Every warp of s waits for the batch itself (one lane polls).
            if lane == 0:
                if tail <= at and alive != 0:
                    start = Int64(0)
                    if tracing != 0:
                        start = cute.arch.globaltimer()
                    tail, alive = _wait_at_least(tail_word, at + 1, timeout_ns, error, s,
                                                 Int32(PHASE_DISPATCH))
                    if tracing != 0:
                        waited = waited + cute.arch.globaltimer() - start
            alive = cute.arch.shuffle_sync(alive, 0)
            if lane == 0 and i == 0:
                _stamp_max(trace, tracing, channel, "first_batch", cute.arch.globaltimer())
            if alive != 0:
                slot = Int32(at % Int64(stage_batches))
                head = cute.make_tensor(gmem_ptr(Int32, peers[s] + headers_offset + Int64(
                    headers((0, slot, channel))), 16), cute.make_layout(
                    header_token_word(topk, BATCH)))
                head_f = cute.make_tensor(gmem_ptr(Float32, head.iterator.toint(), 16),
                                          cute.make_layout(header_token_word(topk, BATCH)))
                if cutlass.const_expr(self.bulk):
                    if lane == 0:
                        cute.arch.fence_proxy("async.global")  # the tail's acquire, then bulk
                in_batch = cutlass.min(Int32(BATCH), ntok - i * BATCH)
                for h in cutlass.range(0, in_batch, MAX_CHUNK):
                    hn = cutlass.min(Int32(MAX_CHUNK), in_batch - h)
                    # The chunk's ids and weights (loads into shared memory, all in flight
                    # together) and source tokens.
                    for w in cutlass.range(lane, hn * topk, WARP, unroll=4):
                        c = w // topk
                        k = w - c * topk
                        s_scratch[scratch + IDS_AT + w] = head[hdr((k, IDS, h + c))]
                        s_wts[wts + w] = head_f[hdr((k, WEIGHTS, h + c))]
                    tok = Int32(-1)
                    if lane < hn:
                        tok = head[header_token_word(topk, h + lane)]
                    cute.arch.sync_warp()
                    # Each (token, k)'s local segment: -1 for another rank's expert, an id
                    # outside the experts, or a later k naming an expert an earlier k named
                    # (the sender counted the same pairs).
                    for w in cutlass.range(lane, hn * topk, WARP):
                        c = w // topk
                        k = w - c * topk
                        e = s_scratch[scratch + IDS_AT + w]
                        g = Int32(-1)
                        if e >= lo and e < lo + local_experts:
                            g = e - lo + shared
                            for k2 in cutlass.range(k):
                                if s_scratch[scratch + IDS_AT + c * topk + k2] == e:
                                    g = Int32(-1)
                        if skip_a2a != 0 and s != my_rank:
                            g = Int32(-1)
                        s_scratch[scratch + SEGS_AT + w] = g
                    cute.arch.sync_warp()
                    # The chunk's messages: its tokens with a segment here, or this rank's
                    # own shared-expert tokens, in order.
                    comes = Int32(0)
                    if lane < hn:
                        for k in cutlass.range(topk):
                            if s_scratch[scratch + SEGS_AT + lane * topk + k] >= 0:
                                comes = Int32(1)
                        if shared != 0 and s == my_rank and tok >= shared_begin and \
                                tok < shared_end:
                            comes = Int32(1)
                    ballot = cute.arch.vote_ballot_sync(comes != 0)
                    cnt = cute.arch.popc(ballot)
                    if placed + cnt > n:  # more than the counts said: never past them
                        cute.arch.atomic_or(error_field(error, "bad_counts"),
                                            Int32(ERROR_COUNTS), sem="relaxed", scope="gpu")
                        cnt = n - placed
                    m_of = cute.arch.popc(ballot & ((Int32(1) << lane) - 1))
                    if comes != 0 and m_of < cnt:
                        if tok < 0 or tok >= max_tokens:
                            cute.arch.atomic_or(error_field(error, "bad_counts"),
                                                Int32(ERROR_COUNTS), sem="relaxed", scope="gpu")
                            tok = Int32(0)
                        s_scratch[scratch + MAP_AT + m_of] = lane
                        s_scratch[scratch + TOKS_AT + m_of] = tok
                        s_scratch[scratch + STAGE_AT + m_of] = slot * BATCH + h + lane
                    cute.arch.sync_warp()
                    if lane == 0 and i == 0 and h == 0:
                        _stamp_max(trace, tracing, channel, "chunk_read",
                                   cute.arch.globaltimer())
                    issued, drained = self._place(
                        lane, sub, per_source, s, cnt, first_msg + placed, topk, max_tokens,
                        my_rank, shared, shared_begin, shared_end, staging, stage, channel,
                        tokens, scales, scale_rows, segment_rows, src_info, comb_rows,
                        comb_weights, comb_tokens, scales_offset, row_capacity, s_next, s_off,
                        s_first, s_scratch, s_wts, scratch, wts,
                        next_at, pieces_at, full, s_piece, held, pieces, payload_bytes, blocks,
                        scale_cols, rk, layout, tiler, g_crd, thr, tiles, warp_copy,
                        payload_vectors, issued, drained, trace, tracing,
                        Int32(i == 0 and h == 0))
                    if cutlass.const_expr(self.bulk):
                        # All of the chunk's pieces have landed (and their row stores are
                        # issued) before the batch is credited.
                        while drained < issued:
                            drained = self._store_piece(lane, drained, payload_bytes, pieces_at,
                                                        full, s_piece, held, tokens, topk,
                                                        s_scratch, scratch)
                    if lane == 0 and i == 0 and h == 0:
                        _stamp_max(trace, tracing, channel, "chunk_stored",
                                   cute.arch.globaltimer())
                    placed = placed + cnt
            if per_source > 1:
                # The warps of s agree on going on: a warp whose wait failed says so before the
                # barrier (the word is only ever set in this kernel).
                if alive == 0 and lane == 0:
                    s_src[3 * MAX_RANKS + s] = Int32(1)
                cute.arch.barrier(barrier_id=2 + s, number_of_threads=WARP * per_source)
                if s_src[3 * MAX_RANKS + s] != 0:
                    alive = Int32(0)
            if alive == 0:
                placed = n  # a rank timed out: the rest of this stream is given up
            elif sub == 0 and lane == 0:
                # Every warp of s is done with the batch: its slot goes back to s. Relaxed: its
                # header and payloads are loaded (their values in shared memory or stored to
                # rows), which is all the source needs; a release would also wait until the
                # row stores are acknowledged.
                cute.arch.store(gmem_ptr(Int64, head_word, 8), at + 1, sem="relaxed",
                                scope="sys")
            i = i + 1
        # The batches past s's last message here are not read at all: they all go back to s.
        if placed < n and alive != 0:  # the batches held fewer messages than the counts said
            if lane == 0:
                cute.arch.atomic_or(error_field(error, "bad_counts"), Int32(ERROR_COUNTS),
                                    sem="relaxed", scope="gpu")
        if sub == 0 and lane == 0 and alive != 0:
            cute.arch.store(gmem_ptr(Int64, head_word, 8), consumed + Int64(batches),
                            sem="relaxed", scope="sys")
            cute.arch.store(gmem_ptr(Int64, streams.toint() + Int64(
                counters((channel, s, HEADS, DISPATCH))) * 8, 8), consumed + Int64(batches))
        if lane == 0:
            _stamp_max(trace, tracing, channel, "recv_done", cute.arch.globaltimer())
        if cutlass.const_expr(self.bulk):
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0)  # the rows are written before the CTA ends
        if lane == 0:
            _stamp_max(trace, tracing, channel, "rows_written", cute.arch.globaltimer())
        if sub == 0 and lane == 0:
            _stamp_max(trace, tracing, channel, "recv_wait_ns", waited)

    @cute.jit
    def _place(self, lane, sub, per_source, s, cnt, first, topk, max_tokens, my_rank, shared,
               shared_begin, shared_end, staging, stage, channel, tokens: cute.Pointer,
               scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows,
               src_info: cute.Pointer, comb_rows: cute.Pointer, comb_weights: cute.Pointer,
               comb_tokens: cute.Pointer, scales_offset, row_capacity, s_next: cute.Tensor,
               s_off: cute.Tensor, s_first: cute.Tensor, s_scratch: cute.Tensor,
               s_wts: cute.Tensor, scratch, wts, next_at, pieces_at: cute.Pointer,
               full: cute.Pointer, s_piece: cute.Tensor, held, pieces, payload_bytes, blocks,
               scale_cols, rk, layout, tiler, g_crd, thr, tiles, warp_copy: cute.TiledCopy,
               payload_vectors, issued, drained, trace: cute.Pointer, tracing, first_chunk):
        """A chunk's `cnt` messages (messages first .. first + cnt - 1 of source s here): their
        rows, message by message (the experts of one message differ, so its lanes never share a
        counter; a warp barrier between messages); what combine needs of them (the first warp of
        s); then this warp's messages m = sub, sub + per_source, ... pulled from the source's
        staging into their rows.
        Returns the warp's (issued, drained) pieces of the bulk path."""
        vec = self.vector_bytes
        for m in cutlass.range(cnt):
            c = s_scratch[scratch + MAP_AT + m]
            row = Int32(-1)
            if lane < topk:
                g = s_scratch[scratch + SEGS_AT + c * topk + lane]
                if g >= 0:
                    row = s_next[next_at + g]
                    s_next[next_at + g] = row + 1
                    if cutlass.const_expr(self.fmt == "nvfp4"):
                        s_scratch[scratch + SROWS_AT + m * ROWS + lane] = \
                            row - s_off[g] + s_first[g] * ATOM_ROWS
            if lane == topk:
                tok = s_scratch[scratch + TOKS_AT + m]
                if shared != 0 and s == my_rank and tok >= shared_begin and tok < shared_end:
                    row = tok - shared_begin  # segment 0: this rank's tokens in order
                if cutlass.const_expr(self.fmt == "nvfp4"):
                    s_scratch[scratch + SROWS_AT + m * ROWS + lane] = row
            if lane <= topk:
                s_scratch[scratch + ROWS_AT + m * ROWS + lane] = row
            # The next message's lanes read counters this one's lanes just wrote (the same
            # expert under another k): ordered by the warp barrier, not by lockstep.
            cute.arch.sync_warp()
        if sub == 0:
            self._record(lane, s, first, cnt, topk, max_tokens, src_info, comb_rows,
                         comb_weights, comb_tokens, s_scratch, s_wts, scratch, wts)
        if lane == 0 and first_chunk != 0:
            _stamp_max(trace, tracing, channel, "chunk_placed", cute.arch.globaltimer())
        if cutlass.const_expr(self.bulk):
            # Every piece of this warp's messages of the chunk through the warp's ring.
            for m in cutlass.range(sub, cnt, per_source):
                msg = staging + Int64(stage((0, s_scratch[scratch + STAGE_AT + m], channel)))
                for p in cutlass.range(pieces):
                    issued, drained = self._pull_piece(
                        lane, msg, m, p, issued, drained, payload_bytes, pieces_at, full,
                        s_piece, held, tokens, topk, s_scratch, scratch)
        else:
            for m in cutlass.range(sub, cnt, per_source):
                msg = staging + Int64(stage((0, s_scratch[scratch + STAGE_AT + m], channel)))
                rows_at = scratch + ROWS_AT + m * ROWS
                scale_words = blocks if self.fmt == "fp8" else rk
                sregs = self._load_scales(lane, msg, scales_offset, scale_words, scale_cols)
                g_src = cute.zipped_divide(cute.make_tensor(gmem_ptr(Uint8, msg, 16), layout),
                                           tiler)
                for tile in cutlass.range(tiles):
                    pred = row_predicate(thr.partition_S(g_crd[((None, None), tile)]),
                                         payload_vectors)
                    t_src = thr.partition_S(g_src[((None, None), tile)])
                    regs = cute.make_fragment_like(t_src)
                    cute.copy(warp_copy, t_src, regs, pred=pred)
                    for k in cutlass.range(topk + 1):
                        r = s_scratch[rows_at + k]
                        if r >= 0:
                            g_dst = cute.zipped_divide(cute.make_tensor(gmem_ptr(
                                Uint8, tokens.toint() + Int64(r) * payload_bytes, vec),
                                layout), tiler)
                            cute.copy(warp_copy, regs,
                                      thr.partition_D(g_dst[((None, None), tile)]),
                                      pred=row_predicate(
                                          thr.partition_S(g_crd[((None, None), tile)]),
                                          payload_vectors))
                self._store_scales(lane, msg, sregs, scales, scale_rows, segment_rows,
                                   scales_offset, row_capacity, topk, scale_words, scale_cols,
                                   rk, s_scratch, rows_at, scratch + SROWS_AT + m * ROWS)
        return issued, drained

    @cute.jit
    def _pull_piece(self, lane, msg, m, p, issued, drained, payload_bytes, ring: cute.Pointer,
                    full: cute.Pointer, s_piece: cute.Tensor, held, tokens: cute.Pointer, topk,
                    s_scratch: cute.Tensor, scratch):
        """Bulk-load piece p of message m of the chunk (staged at `msg`) into the warp's next
        piece of shared memory once the stores that read it last are done reading it; then
        store the oldest piece if LAG pieces are in flight. Returns (issued, drained)."""
        at = issued % PIECES
        offset = Int64(p) * PIECE
        nbytes = cutlass.min(Int32(PIECE), Int32(Int64(payload_bytes) - offset))
        if lane == 0:
            # Piece `issued - PIECES` last held this one; of the store groups committed since
            # (one per piece drained), at most PIECES - 1 - LAG are newer than its own.
            cute.arch.cp_async_bulk_wait_group(PIECES - 1 - LAG, read=True)
            cute.arch.mbarrier_arrive_and_expect_tx(full + at, nbytes)
            bulk_load(ring + at * PIECE, msg + offset, nbytes, full + at)
        s_piece[held + at] = m * 64 + p  # (message of the chunk, piece): every lane writes it
        cute.arch.sync_warp()  # ... before any lane reads it back in `_store_piece`
        issued = issued + 1
        if issued - drained > LAG:
            drained = self._store_piece(lane, drained, payload_bytes, ring, full, s_piece, held,
                                        tokens, topk, s_scratch, scratch)
        return issued, drained

    @cute.jit
    def _store_piece(self, lane, drained, payload_bytes, ring: cute.Pointer, full: cute.Pointer,
                     s_piece: cute.Tensor, held, tokens: cute.Pointer, topk,
                     s_scratch: cute.Tensor, scratch):
        """Wait for the warp's oldest piece in flight to land and bulk-store it to every row of
        its message (one async group a piece). Returns drained + 1."""
        at = drained % PIECES
        cute.arch.mbarrier_wait(full + at, (drained // PIECES) % 2)
        what = s_piece[held + at]
        m = what // 64
        rows_at = scratch + ROWS_AT + m * ROWS
        if lane == 0:
            offset = Int64(what - m * 64) * PIECE
            nbytes = cutlass.min(Int32(PIECE), Int32(Int64(payload_bytes) - offset))
            for k in cutlass.range(topk + 1):
                r = s_scratch[rows_at + k]
                if r >= 0:
                    bulk_store(tokens.toint() + Int64(r) * payload_bytes + offset,
                               ring + at * PIECE, nbytes)
            cute.arch.cp_async_bulk_commit_group()
        return drained + 1

    @cute.jit
    def _record(self, lane, s, first, cnt, topk, max_tokens, src_info: cute.Pointer,
                comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                s_scratch: cute.Tensor, s_wts: cute.Tensor, scratch, wts):
        """What combine needs of the chunk's messages first .. first + cnt - 1 of source s (row
        and weight per k, source token), and src_info of every row they filled (a message's
        weights are those of its token of the chunk, `MAP_AT`)."""
        for i in cutlass.range(lane, cnt * topk, WARP):
            m = i // topk
            k = i - m * topk
            at = (Int64(s) * Int64(max_tokens) + Int64(first + m)) * Int64(topk) + Int64(k)
            store_i32(comb_rows.toint() + at * 4, s_scratch[scratch + ROWS_AT + m * ROWS + k])
            store_f32(comb_weights.toint() + at * 4,
                      s_wts[wts + s_scratch[scratch + MAP_AT + m] * topk + k])
        if lane < cnt:
            store_i32(comb_tokens.toint()
                      + (Int64(s) * Int64(max_tokens) + Int64(first + lane)) * 4,
                      s_scratch[scratch + TOKS_AT + lane])
        for i in cutlass.range(lane, cnt * (topk + 1), WARP):
            m = i // (topk + 1)
            k = i - m * (topk + 1)
            r = s_scratch[scratch + ROWS_AT + m * ROWS + k]
            if r >= 0:
                slot = Int32(-1)
                if k < topk:
                    slot = k
                store_i32(src_info.toint() + Int64(r) * 8, s_scratch[scratch + TOKS_AT + m])
                store_i32(src_info.toint() + Int64(r) * 8 + 4, slot)

    @cute.jit
    def _load_scales(self, lane, msg, scales_offset, words, scale_cols):
        """A message's scale words lane, lane + 32, ... (the first SCALE_REGS of each lane) into
        registers, loaded before any of the message's stores so that they travel with its
        payload's loads (NVFP4: a last partial word's padding bytes cleared)."""
        sregs = cute.make_rmem_tensor(cute.make_layout(SCALE_REGS), Int32)
        src = cute.make_tensor(gmem_ptr(Int32, msg + Int64(scales_offset), 16),
                               cute.make_layout(words))
        for q in cutlass.range_constexpr(SCALE_REGS):
            c = lane + q * WARP
            word = Int32(0)
            if c < words:
                word = self._scale_word(src[c], c, scale_cols)
            sregs[q] = word
        return sregs

    @cute.jit
    def _scale_word(self, word, c, scale_cols):
        """Scale word c as stored: NVFP4's last word keeps only its valid columns."""
        if cutlass.const_expr(self.fmt == "nvfp4"):
            valid = scale_cols - c * 4
            if valid < 4:
                word = word & ((Int32(1) << (valid * 8)) - 1)
        return word

    @cute.jit
    def _store_scales(self, lane, msg, sregs: cute.Tensor, scales: cute.Pointer,
                      scale_rows: cute.Pointer, segment_rows, scales_offset, row_capacity, topk,
                      words, scale_cols, rk, s_scratch: cute.Tensor, rows_at, srows_at):
        """A message's scales into every row it filled: the words `_load_scales` holds, then any
        beyond them, loaded here. Packed rows: into `scale_rows` (row r's words contiguous),
        from which the dispatch's end writes the output's layout; slabs: straight into the
        output (fp8: transposed [H / 128, rows])."""
        src = cute.make_tensor(gmem_ptr(Int32, msg + Int64(scales_offset), 16),
                               cute.make_layout(words))
        for k in cutlass.range(topk + 1):
            r = s_scratch[rows_at + k]
            if r >= 0:
                for q in cutlass.range_constexpr(SCALE_REGS):
                    c = lane + q * WARP
                    if c < words:
                        self._store_scale(scales, scale_rows, segment_rows, c, sregs[q], r,
                                          s_scratch[srows_at + k], row_capacity, rk, words)
                for c in cutlass.range(lane + SCALE_REGS * WARP, words, WARP):
                    self._store_scale(scales, scale_rows, segment_rows, c,
                                      self._scale_word(src[c], c, scale_cols), r,
                                      s_scratch[srows_at + k], row_capacity, rk, words)

    @cute.jit
    def _store_scale(self, scales: cute.Pointer, scale_rows: cute.Pointer, segment_rows, c, word,
                     row, scale_row, row_capacity, rk, words):
        """Scale word c of a row: packed, word c of row `row` of `scale_rows`; slabs (FP8 only),
        block c's fp32 scale of row `row` in the transposed output."""
        if segment_rows == 0:
            store_i32(scale_rows.toint() + Int64(scale_rows_layout(words, row_capacity)(
                (Int64(c), Int64(row)))) * 4, word)
        else:
            if cutlass.const_expr(self.fmt == "fp8"):
                store_i32(scales.toint() + (Int64(c) * Int64(row_capacity) + Int64(row)) * 4,
                          word)

    @cute.jit
    def _zero_row_padding(self, warp_id, warps, lane, tokens: cute.Pointer,
                          scale_rows: cute.Pointer, src_info: cute.Pointer, s_off: cute.Tensor,
                          s_raw: cute.Tensor, segments, payload_bytes, blocks, row_capacity):
        """FP8: zero the alignment rows after each segment's rows (payload words, their scales in
        `scale_rows`, src_info -1): warp `warp_id` of `warps` (every channel's receivers) takes
        segments warp_id, warp_id + warps, ..., its lanes the segment's padding words."""
        words = Int32(payload_bytes // 4)
        for g in cutlass.range(warp_id, segments, warps):
            pad_begin = s_off[g] + s_raw[g]
            pad_rows = s_off[g + 1] - pad_begin
            for i in cutlass.range(lane, pad_rows * words, WARP):
                store_i32(tokens.toint() + Int64(pad_begin) * payload_bytes + Int64(i) * 4,
                          Int32(0))
            for i in cutlass.range(lane, pad_rows * blocks, WARP):
                store_i32(scale_rows.toint() + Int64(scale_rows_layout(blocks, row_capacity)(
                    (Int64(i % blocks), Int64(pad_begin + i // blocks)))) * 4, Int32(0))
            for i in cutlass.range(lane, pad_rows * 2, WARP):
                store_i32(src_info.toint() + Int64(pad_begin) * 8 + Int64(i) * 4, Int32(-1))

    @cute.jit
    def _write_scales(self, warp, lane, channel, active, scales: cute.Pointer,
                      scale_rows: cute.Pointer, s_off: cute.Tensor, s_raw: cute.Tensor,
                      s_first: cute.Tensor, s_tile: cute.Tensor, segments, row_capacity,
                      payload_vectors):
        """Once every CTA's receivers are done: the received rows' scales from `scale_rows` into
        the output's layout, whole tiles at a time through the warp's TILE_ROWS x 9 words of
        shared memory (loads of 8 contiguous words a row, stores of whole lines), the tiles
        shared out over every warp of every CTA. FP8: 32 rows x 8 blocks of the transposed
        [H / 128, rows] (alignment rows included: their words were zeroed). NVFP4: 8 atoms of
        a 128-row block of the 128x4 layout, rows past the segment's count zero."""
        gw = channel * (SEND_WARPS + self.recv_warps) + warp
        nw = active * (SEND_WARPS + self.recv_warps)
        base = warp * TILE_ROWS * TILE_STRIDE
        col = lane % TILE_COLS
        if cutlass.const_expr(self.fmt == "fp8"):
            words = payload_vectors * self.vector_bytes // FP8_BLOCK
            rows = s_off[segments]
            tiles_b = (words + TILE_COLS - 1) // TILE_COLS
            for u in cutlass.range(gw, (rows + WARP - 1) // WARP * tiles_b, nw):
                r0 = u // tiles_b * WARP
                b = u % tiles_b * TILE_COLS + col
                # Every load of the tile in flight before the first shared-memory store.
                vals = cute.make_rmem_tensor(cute.make_layout(TILE_COLS), Int32)
                for i in cutlass.range_constexpr(TILE_COLS):
                    rr = lane // TILE_COLS + i * (WARP // TILE_COLS)
                    v = Int32(0)
                    if r0 + rr < rows and b < words:
                        v = load_i32(scale_rows.toint() + Int64(scale_rows_layout(
                            words, row_capacity)((Int64(b), Int64(r0 + rr)))) * 4)
                    vals[i] = v
                for i in cutlass.range_constexpr(TILE_COLS):
                    s_tile[base + (lane // TILE_COLS + i * (WARP // TILE_COLS)) * TILE_STRIDE
                           + col] = vals[i]
                cute.arch.sync_warp()
                for j in cutlass.range_constexpr(TILE_COLS):
                    b = u % tiles_b * TILE_COLS + j
                    if b < words and r0 + lane < rows:
                        store_i32(scales.toint() + (Int64(b) * Int64(row_capacity)
                                                    + Int64(r0 + lane)) * 4,
                                  s_tile[base + lane * TILE_STRIDE + j])
                cute.arch.sync_warp()
        if cutlass.const_expr(self.fmt == "nvfp4"):
            rk = (payload_vectors * self.vector_bytes * 2 // NVFP4_BLOCK + 3) // 4
            tiles_c = (rk + TILE_COLS - 1) // TILE_COLS
            staged = scale_rows_layout(rk, row_capacity)
            four = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS // WARP), Int32)
            vals = cute.make_rmem_tensor(cute.make_layout(ATOM_ROWS * TILE_COLS // WARP), Int32)
            words = cute.make_rmem_tensor(cute.make_layout(TILE_COLS), Int32)
            for u in cutlass.range(gw, s_first[segments] * tiles_c, nw):
                q = u // tiles_c  # the 128-row scale block
                c0 = u % tiles_c * TILE_COLS
                g = segment_of(s_first, segments, q)
                first = (q - s_first[g]) * ATOM_ROWS  # its first row within segment g
                valid = s_raw[g] - first
                # Lane l writes the 16 bytes of rows l, l + 32, l + 64, l + 96 of each atom.
                out_at = scales.toint() + scale_offset(q * ATOM_ROWS + lane, 0, rk)
                if valid > WARP:
                    # Every load of the tile in flight before the first shared-memory store.
                    c = c0 + col
                    for i in cutlass.range_constexpr(ATOM_ROWS * TILE_COLS // WARP):
                        rr = lane // TILE_COLS + i * (WARP // TILE_COLS)
                        v = Int32(0)
                        if rr < valid and c < rk:
                            v = load_i32(scale_rows.toint() + Int64(staged(
                                (Int64(c), Int64(s_off[g] + first + rr)))) * 4)
                        vals[i] = v
                    for i in cutlass.range_constexpr(ATOM_ROWS * TILE_COLS // WARP):
                        s_tile[base + (lane // TILE_COLS + i * (WARP // TILE_COLS)) * TILE_STRIDE
                               + col] = vals[i]
                    cute.arch.sync_warp()
                    for j in cutlass.range_constexpr(TILE_COLS):
                        if c0 + j < rk:
                            for part in cutlass.range_constexpr(ATOM_ROWS // WARP):
                                four[part] = s_tile[base + (lane + part * WARP) * TILE_STRIDE + j]
                            self._store_atom_rows(out_at, c0 + j, four)
                    cute.arch.sync_warp()
                else:
                    # A block of at most 32 rows (a decode's experts): lane l's row, if any, read
                    # straight from its staged row, and the three rows past it zero.
                    for part in cutlass.range_constexpr(ATOM_ROWS // WARP):
                        four[part] = Int32(0)
                    for j in cutlass.range_constexpr(TILE_COLS):
                        words[j] = Int32(0)
                        if lane < valid and c0 + j < rk:
                            words[j] = load_i32(scale_rows.toint() + Int64(staged(
                                (Int64(c0 + j), Int64(s_off[g] + first + lane)))) * 4)
                    for j in cutlass.range_constexpr(TILE_COLS):
                        if c0 + j < rk:
                            four[0] = words[j]
                            self._store_atom_rows(out_at, c0 + j, four)

    @cute.jit
    def _store_atom_rows(self, row_at, atom, four: cute.Tensor):
        """The 16 bytes at `row_at` (a lane's row of a 128-row block, column 0, in the 128x4
        layout) plus atom `atom`'s 512: that row and the rows 32, 64 and 96 past it, their four
        scale bytes each (`four`)."""
        cute.autovec_copy(four, cute.make_tensor(
            gmem_ptr(Int32, row_at + Int64(atom) * ATOM_BYTES, 16),
            cute.make_layout(ATOM_ROWS // WARP)))


def dispatch_kernels() -> list:
    return [EpDispatch(f) for f in FORMATS]

