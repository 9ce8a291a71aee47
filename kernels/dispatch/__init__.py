"""`ep_dispatch`: one persistent launch per dispatch, a CTA per channel (transport v2).

Channel c of every rank owns a contiguous run of that rank's tokens (`layouts.channels`). Its CTA
has SEND_WARPS sender warps and RECV_WARPS_BULK (or, for a format moved through registers,
RECV_WARPS_REGISTERS) receiver warps, and runs these parts:

1. Counts (all warps): the channel's tokens are routed (each valid (token, k) pair, a later k
   naming the same expert dropped, ids outside [0, E) dropped and reported) and counted per
   expert and per destination rank; the counts go to every destination's `counts` table under
   the round's parity, and the channel's count flag there is raised to the round's epoch. A
   dispatch of a decode step's size (PREFIXED_TOKENS) has every channel route all of its rank's
   tokens and send prefixed counts: its own, the sum over the channels before it and the total;
   a larger one over BLOCK_PREFIX_CHANNELS channels or more has every channel route its block's
   tokens (COUNT_BLOCK channels) and send the same sums over its block (block-prefixed).
1b. Encode (FP8 and NVFP4 given bf16 tokens, when the host asks for it: a few tokens a channel,
   a decode step's; all warps): the channel's own tokens are quantized into their messages in the
   local send buffer (`kernels.encode`) while the counts travel. More tokens are quantized by
   `ep_encode` on the same SM budget before the dispatch.
2. Send (SEND_WARPS sender warps): the channel's tokens go in batches of BATCH, each into the
   next batch slot of this rank's own staging (peer-visible memory, `layouts.channels`): the
   batch header (every token's K ids and weights, as the caller gave them, and its index) and
   each token's message (the bf16 row of `x`; FP8 codes and their scales from their own rows,
   the caller's, `ep_encode`'s or those phase 1b wrote; NVFP4 codes and scales from the caller's
   rows, or the whole message `ep_encode` or phase 1b wrote into `send_buf`), token b by warp
   b % SEND_WARPS, tiles of SEND_VECTORS[format] 16-byte vectors per lane with every load in
   flight (each warp prefetches its tokens of the batch into L2 before it waits for credit, so
   those loads hit L2). A sender does nothing per destination per token: it waits, once per
   batch, until every destination has
   returned credit for the batch the slot held, and the warp that
   finishes a batch last (one shared-memory atomic a warp) fences once at system scope and
   publishes the batch in every destination's `tails`.
3. Receive (the receiver warps): they wait for every (channel, source)'s counts (prefixed: their
   own channel's of each source; block-prefixed: those and one channel's of every other block;
   a count flag's system-scope acquire, then the counts themselves by plain loads, ordered
   after the acquires by the receivers' barrier), from which each CTA
   derives the whole row layout (segments padded to the format's row alignment, NVFP4 segments
   on fresh 128-row scale blocks) and the first row of every (segment, source) that its channel
   fills. FP8's alignment rows are zeroed by the sender warps once they have sent (the receivers
   tell them the layout is ready at a named barrier and go on to their first batch). The warps
   of source s then take s's batches of this channel in order as its tail advances: they read
   the batch's header from the source (over NVLink), keep the tokens with an expert here (or
   this rank's shared-expert tokens), the whole batch at once, and place each such message in
   the next free row of each of its local experts, so rows follow source-token order without
   any plan on the sender. The payload is loaded once
   from the source's staging (over NVLink) and stored to every row: BF16 by bulk copies
   (`cp.async.bulk`) through PIECES pieces of shared memory per warp, each piece bulk-stored to
   every row as it lands; FP8 and NVFP4 through registers, a row's scales contiguously into
   `scale_rows` (row-major, `layouts.buffers.scale_rows_layout`); the rows, weights and source
   token are recorded for combine. Credit returns to the source after every batch (BF16's a batch
   late: a batch's bulk loads land while the next batch is placed, and the ring never empties
   between batches), and for all the rest of the round's batches once the last message from the
   source has landed (their slots are not read).

4. FP8 and NVFP4 (packed rows): once every CTA has finished (the round's advance below, which
   each CTA waits for), all warps write `scale_rows` into the output's scale layout, a tile of
   whole lines at a time (a scale word stored straight into FP8's transposed or NVFP4's 128x4
   layout is a 32-byte sector of its own: what FP8 and NVFP4 receivers spent most on); NVFP4 by
   a 16-byte store per lane and atom, and a 128-row block of at most 32 rows (a decode's
   experts) straight from its staged rows, the rest of the block zero. NVFP4 at prefill size on
   at most two ranks stages a message's scales once, not once a row (`_message_scales`), and
   the write-out gathers each row's from its message's.

The kernel body below says the protocol in order; each phase is a class of its own module that
`EpDispatch` is composed of: `counts.py` (phase 1, and the receivers' reading of the counts),
`send.py` (2), `receive.py` (3), `scales.py` (4); `common.py` holds the limits, the shared-memory
scratch layout and the bounded wait that every phase (and `ep_combine`) uses.

Every wait is bounded by `timeout_ns` of `%globaltimer`: the missing rank and the phase go to the
error record and the CTA stops waiting (its outputs are then partial, never out of bounds). The
round counter advances when the last CTA finishes, so a CUDA graph replays the layer.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from kernels.copy import row_tiled_copy
from kernels.encode import (E2M1_ARCHES, ENCODE_THREADS, NVFP4_AHEAD, encode_fp8_rows,
                            encode_nvfp4_token, prefetch_rows)
from kernels.memory import load_f32
from kernels.placement import placed_channel
from kernels.nvfp4 import SCALE_TABLE_BYTES, fill_scale_table, scale_table_layout
from kernels.dispatch.common import (BATCH, BULK_FORMATS, COUNT_WORDS, FORMATS, FP8_BLOCK,
                                     LIMITS, MAX_RANKS, MAX_SEGMENTS, MAX_STAGE_BATCHES, MAX_TOPK,
                                     PAD_BARRIER, PHASE_DISPATCH, PIECE, PIECES, PLAN_SLOTS,
                                     PLAN_SOURCES, PLAN_WORDS, RECV_TIME_WORDS,
                                     RECV_WARPS_BULK, RECV_WARPS_REGISTERS, SCRATCH, SEND_VECTORS,
                                     SEND_WARPS, SRC_WORDS, TILE_ROWS, TILE_STRIDE, TILE_VECTORS,
                                     WARP, _stamp, _wait_at_least)
from kernels.dispatch.counts import CountsPhase
from kernels.dispatch.receive import ReceivePhase
from kernels.dispatch.scales import ScalesPhase
from kernels.dispatch.send import SendPhase
from kernels.routing import channel_tokens
from layouts.abi import ARCHES, GridRule, KernelSpec, Param
from layouts.channels import (COUNT_KINDS, COUNT_SEGMENTS, DISPATCH_RECEIVE, DISPATCH_SEND,
                              RECV_TIMES, SEND_TIMES, count_flags_layout, counters_layout,
                              counts_layout)
from layouts.config import FP8_ROW_ALIGN, FP8_SCALES


class EpDispatch(CountsPhase, SendPhase, ReceivePhase, ScalesPhase):
    def __init__(self, fmt: str, bulk: bool | None = None, scales: str | None = None,
                 e2m1: str | None = None):
        """`bulk`: receivers pull messages by bulk copies (the default of BULK_FORMATS) or
        through registers; NVFP4 rows of H / 2 bytes that are not 16-byte multiples (H not a
        multiple of 32) cannot be bulk-stored and take the register path. Given bf16 tokens,
        FP8 and NVFP4 layers quantize them in the kernel (`kernels.encode`): FP8 `scales`
        (FP8_SCALES, default "exact"); NVFP4 `e2m1` ("software" for sm_90a, "hardware" for
        sm_100a)."""
        if fmt not in FORMATS:
            raise ValueError(f"ep_dispatch formats: {FORMATS}, not {fmt!r}")
        if scales is not None and (fmt != "fp8" or scales not in FP8_SCALES):
            raise ValueError(f"ep_dispatch scales {FP8_SCALES} are for fp8, got {fmt}, {scales}")
        if (fmt == "nvfp4") != (e2m1 is not None) or (e2m1 and e2m1 not in E2M1_ARCHES):
            raise ValueError(f"ep_dispatch: nvfp4 needs e2m1 software|hardware, other formats "
                             f"none; got {fmt}, {e2m1}")
        self.scales = (scales or "exact") if fmt == "fp8" else None
        self.e2m1 = e2m1
        self.arches = E2M1_ARCHES[e2m1] if e2m1 else ARCHES
        if bulk is None:
            bulk = fmt in BULK_FORMATS
        if not bulk and fmt == "bf16":
            raise ValueError("bf16 dispatch receivers always pull by bulk copies")
        self.fmt = fmt
        self._bulk = bool(bulk)
        self.recv_warps = RECV_WARPS_BULK if self._bulk else RECV_WARPS_REGISTERS
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
        words = ((0 if self.bulk else COUNT_WORDS)  # the routing counts (bulk: in the ring)
                 + self.recv_warps * MAX_SEGMENTS  # s_next
                 + MAX_RANKS * MAX_SEGMENTS  # s_totals
                 + 4 * (MAX_SEGMENTS + 4)  # s_off, s_tot, s_raw, s_first
                 + SRC_WORDS * MAX_RANKS  # s_src
                 + self.recv_warps * (SCRATCH + BATCH * MAX_TOPK)  # s_scratch, s_wts
                 + MAX_STAGE_BATCHES  # s_arrive
                 + (PLAN_SOURCES * PLAN_WORDS if self.bulk else 4))  # s_planw
        # s_head, s_time, s_plan
        dwords = SEND_WARPS * MAX_RANKS + self.time_words + PLAN_SOURCES * 2 * PLAN_SLOTS
        tiles = 0 if self.tiles_in_ring else 4 * self.tile_words
        table = SCALE_TABLE_BYTES + 16 if self.fmt == "nvfp4" else 0  # the NVFP4 encoder's
        return 4 * words + 8 * dwords + 14 * 16 + 128 + self.ring_bytes + tiles + table

    @property
    def time_words(self) -> int:
        """The int64 words of s_time: each sender warp's SEND_TIMES, then each receiver warp's
        RECV_TIME_WORDS (`common._lap`)."""
        return SEND_WARPS * len(SEND_TIMES) + self.recv_warps * RECV_TIME_WORDS

    @property
    def tile_words(self) -> int:
        """Shared-memory words of the warps' scale tiles (`_write_scales`); 4 for bf16."""
        return 4 if self.fmt == "bf16" else (SEND_WARPS + self.recv_warps) * TILE_ROWS * TILE_STRIDE

    @property
    def tiles_in_ring(self) -> bool:
        """Whether the scale tiles reuse the receivers' pieces (bulk FP8 / NVFP4): the scales are
        written out only after every piece has been stored."""
        return self.bulk and self.fmt != "bf16"

    @property
    def bulk(self) -> bool:
        """Whether receivers pull messages by bulk copies or through registers."""
        return self._bulk

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
        return pieces * (piece + 8 + 8) + 3 * 128

    def spec(self) -> KernelSpec:
        return KernelSpec(
            family="ep_dispatch",
            config={"format": self.fmt, "bulk": int(self.bulk),
                    **({"scales": self.scales} if self.scales else {}),
                    **({"e2m1": self.e2m1} if self.e2m1 else {})},
            params=(
                Param("peer_bases", "ptr", "int64", align=8, min_elements=("ranks", 1)),
                Param("source", "ptr", "uint8", align=16),
                Param("scale_source", "ptr", "uint8", align=4),
                Param("scale_stride", "i32"),
                # int32 ids, or int64 read as word pairs (id_words 2: `kernels.routing.load_id`).
                Param("topk_ids", "ptr", "int32", align=4),
                Param("id_words", "i32"),
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
                # Rows by source (layout "sources"): each row's K local ids and weights.
                Param("recv_ids", "ptr", "int32", align=4, writes=True),
                Param("recv_weights", "ptr", "float32", align=4, writes=True),
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
                Param("launched", "i32"),
                Param("headers_offset", "i64"),
                Param("staging_offset", "i64"),
                Param("counts_offset", "i64"),
                Param("flags_offset", "i64"),
                Param("counters_offset", "i64"),
                Param("timeout_ns", "i64"),
                Param("trace", "ptr", "int64", align=8, writes=True),
                Param("tracing", "i32"),
                Param("phases", "i32"),
                # FP8 / NVFP4 given bf16 tokens (`encode` 1): the kernel quantizes x into
                # `source` (the send buffer, a message a token) first; NVFP4 under global_scale.
                Param("x", "ptr", "bfloat16", align=16),
                Param("global_scale", "ptr", "float32", align=4),
                Param("encode", "i32"),
                # The kind of counts (`layouts.channels.prefixed_counts`), the same on every
                # rank: prefixed for a dispatch of at most PREFIXED_TOKENS tokens a rank,
                # block-prefixed over BLOCK_PREFIX_CHANNELS channels or more (register
                # receivers: never prefixed).
                Param("prefixed", "i32"),
                # The Buffer's direct input (`direct` 1): the tokens are rows of this rank's
                # input part (at `input_offset` of every rank's peer-visible memory, laid out
                # as staged messages), which the receivers pull in place; the senders stage
                # batch headers only.
                Param("direct", "i32"),
                Param("input_offset", "i64"),
            ),
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("launched", 1)), GridRule(constant=1),
                  GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes=dict(LIMITS, row_align=self.row_align, vector_bytes=self.vector_bytes,
                       recv_warps=self.recv_warps),
        )

    @cute.jit
    def __call__(self, peer_bases: cute.Pointer, source: cute.Pointer,
                 scale_source: cute.Pointer, scale_stride: Int32, topk_ids: cute.Pointer,
                 id_words: Int32, topk_weights: cute.Pointer, streams: cute.Pointer,
                 rounds: cute.Pointer,
                 done: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
                 scales: cute.Pointer, scale_rows: cute.Pointer,
                 scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
                 expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
                 comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
                 comb_counts: cute.Pointer, chan_msgs: cute.Pointer, recv_ids: cute.Pointer,
               recv_weights: cute.Pointer, num_tokens: Int32,
                 max_tokens: Int32, topk: Int32,
                 local_experts: Int32, ranks: Int32, my_rank: Int32, shared: Int32,
                 skip_a2a: Int32, shared_begin: Int32, shared_end: Int32, has_weights: Int32,
                 header_bytes: Int32, source_stride: Int32, load_bytes: Int32,
                 stage_bytes: Int32, stage_batches: Int32,
                 payload_vectors: Int32, scales_offset: Int32, row_capacity: Int32,
                 segment_rows: Int32,
                 channels: Int32, active: Int32, launched: Int32,
                 headers_offset: Int64, staging_offset: Int64, counts_offset: Int64,
                 flags_offset: Int64,
                 counters_offset: Int64, timeout_ns: Int64, trace: cute.Pointer,
                 tracing: Int32, phases: Int32, x: cute.Pointer, global_scale: cute.Pointer,
                 encode: Int32, prefixed: Int32, direct: Int32, input_offset: Int64, stream):
        self.kernel(peer_bases, source, scale_source, scale_stride, topk_ids, id_words,
                    topk_weights,
                    streams, rounds, done, error,
                    tokens, scales, scale_rows, scales_offsets, row_offsets, expert_ids, seg_counts,
                    src_info, comb_rows, comb_weights, comb_tokens, comb_counts, chan_msgs,
                    recv_ids, recv_weights,
                    num_tokens,
                    max_tokens, topk, local_experts, ranks, my_rank, shared, skip_a2a,
                    shared_begin, shared_end, has_weights, header_bytes, source_stride,
                    load_bytes, stage_bytes, stage_batches, payload_vectors, scales_offset,
                    row_capacity, segment_rows, channels, active, launched,
                    headers_offset, staging_offset, counts_offset, flags_offset,
                    counters_offset, timeout_ns, trace, tracing, phases, x, global_scale, encode,
                    prefixed, direct, input_offset, row_tiled_copy(WARP, Uint8, self.vector_bytes),
                    row_tiled_copy(WARP, Uint8, 16)).launch(
            grid=(launched, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, peer_bases: cute.Pointer, source: cute.Pointer,
               scale_source: cute.Pointer, scale_stride: Int32, topk_ids: cute.Pointer,
               id_words: Int32, topk_weights: cute.Pointer, streams: cute.Pointer,
               rounds: cute.Pointer,
               done: cute.Pointer, error: cute.Pointer, tokens: cute.Pointer,
               scales: cute.Pointer, scale_rows: cute.Pointer,
               scales_offsets: cute.Pointer, row_offsets: cute.Pointer,
               expert_ids: cute.Pointer, seg_counts: cute.Pointer, src_info: cute.Pointer,
               comb_rows: cute.Pointer, comb_weights: cute.Pointer, comb_tokens: cute.Pointer,
               comb_counts: cute.Pointer, chan_msgs: cute.Pointer, recv_ids: cute.Pointer,
               recv_weights: cute.Pointer, num_tokens: Int32,
               max_tokens: Int32, topk: Int32, local_experts: Int32, ranks: Int32,
               my_rank: Int32, shared: Int32,
               skip_a2a: Int32, shared_begin: Int32, shared_end: Int32, has_weights: Int32,
               header_bytes: Int32, source_stride: Int32, load_bytes: Int32,
               stage_bytes: Int32, stage_batches: Int32,
               payload_vectors: Int32, scales_offset: Int32, row_capacity: Int32,
               segment_rows: Int32,
               channels: Int32, active: Int32, launched: Int32,
               headers_offset: Int64, staging_offset: Int64, counts_offset: Int64,
               flags_offset: Int64,
               counters_offset: Int64, timeout_ns: Int64, trace: cute.Pointer, tracing: Int32,
               phases: Int32, x: cute.Pointer, global_scale: cute.Pointer, encode: Int32,
               prefixed: Int32, direct: Int32, input_offset: Int64, warp_copy: cute.TiledCopy,
               send_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        channel, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        experts = local_experts * ranks
        segments = local_experts + shared
        entries = COUNT_SEGMENTS + segments

        smem = cutlass.memory.SmemAllocator()
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
            Float32, cute.make_layout(self.recv_warps * BATCH * MAX_TOPK), byte_alignment=16)
        # Per sender warp: the staging credit it has seen per destination, its times (then the
        # receiver warps' times); per batch slot, the sender warps done with the batch it holds
        # (`_send`).
        s_arrive = smem.allocate_tensor(Int32, cute.make_layout(MAX_STAGE_BATCHES),
                                        byte_alignment=16)
        s_head = smem.allocate_tensor(Int64, cute.make_layout(SEND_WARPS * MAX_RANKS),
                                      byte_alignment=16)
        s_time = smem.allocate_tensor(Int64, cute.make_layout(self.time_words),
                                      byte_alignment=16)
        # Per receiver warp: PIECES pieces of messages, their mbarriers and what each holds.
        pieces, piece = self.ring_shape
        s_ring = smem.allocate_tensor(Uint8, cute.make_layout(pieces * piece), byte_alignment=128)
        if cutlass.const_expr(self.tiles_in_ring):
            assert self.tile_words * 4 <= pieces * piece
            s_tile = cute.make_tensor(cute.recast_ptr(s_ring.iterator, dtype=Int32),
                                      cute.make_layout(self.tile_words))
        else:
            s_tile = smem.allocate_tensor(Int32, cute.make_layout(self.tile_words),
                                          byte_alignment=16)
        s_full = smem.allocate_array(Int64, pieces, byte_alignment=8)
        # Per source with plans (`_expand_split`), PLAN_SLOTS "plan ready" then PLAN_SLOTS
        # "plan free" mbarriers.
        s_plan = smem.allocate_array(Int64, PLAN_SOURCES * 2 * PLAN_SLOTS, byte_alignment=8)
        s_planw = smem.allocate_tensor(
            Int32, cute.make_layout(PLAN_SOURCES * PLAN_WORDS if self.bulk else 4),
            byte_alignment=16)
        # What each piece holds (its rows and part), then (NVFP4) the staged row of its
        # message's scales (SCALES_MESSAGES, the only format that stages them a message).
        s_piece = smem.allocate_tensor(
            Int32, cute.make_layout((2 if self.fmt == "nvfp4" else 1) * pieces),
            byte_alignment=16)
        s_table = s_piece  # the NVFP4 encoder's e4m3 scale table (other formats: unused)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            s_table = smem.allocate_tensor(Float32, scale_table_layout(), byte_alignment=16)

        # The routing counts (`_publish_counts`): bulk receivers' kernels count in their ring, free
        # until the counts are out (three regions: prefixed counts); the others in a region of
        # their own, and never prefixed.
        if cutlass.const_expr(self.bulk):
            assert COUNT_KINDS * COUNT_WORDS * 4 <= pieces * piece
            counted = cute.make_tensor(cute.recast_ptr(s_ring.iterator, dtype=Int32),
                                       cute.make_layout(COUNT_KINDS * COUNT_WORDS))
        else:
            counted = smem.allocate_tensor(Int32, cute.make_layout(COUNT_WORDS),
                                           byte_alignment=16)
            prefixed = Int32(0)
        s_channel = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        # Spare CTAs: one channel per TPC (kernels/placement.py); the others leave.
        channel = placed_channel(done, channel, active, launched, s_channel, tidx)
        if channel >= 0:
            if tidx == 0:
                _stamp(trace, tracing, channel, "start", cute.arch.globaltimer())
                # Maxima over warps, zeroed before any warp adds to them.
                _stamp(trace, tracing, channel, "send_done", 0)
                _stamp(trace, tracing, channel, "first_batch", 0)
                _stamp(trace, tracing, channel, "chunk_read", 0)
                _stamp(trace, tracing, channel, "chunk_placed", 0)
                _stamp(trace, tracing, channel, "chunk_stored", 0)
                _stamp(trace, tracing, channel, "recv_done", 0)
                _stamp(trace, tracing, channel, "rows_written", 0)
                for f in cutlass.range_constexpr(len(SEND_TIMES)):
                    _stamp(trace, tracing, channel, SEND_TIMES[f], 0)
                for f in cutlass.range_constexpr(len(RECV_TIMES)):
                    _stamp(trace, tracing, channel, RECV_TIMES[f], 0)
            if tidx < MAX_STAGE_BATCHES:
                s_arrive[tidx] = Int32(0)
            if cutlass.const_expr(self.bulk):
                if tidx == 0:
                    for i in cutlass.range(self.recv_warps * PIECES):
                        cute.arch.mbarrier_init(s_full + i, 1)
                    # A plan is ready once its placer says so, free once every mover is done
                    # with it.
                    movers = cutlass.min(self.recv_warps // ranks, BATCH) - 1
                    for i in cutlass.range(PLAN_SOURCES):
                        for j in cutlass.range(PLAN_SLOTS):
                            cute.arch.mbarrier_init(s_plan + i * 2 * PLAN_SLOTS + j, 1)
                            cute.arch.mbarrier_init(s_plan + i * 2 * PLAN_SLOTS + PLAN_SLOTS + j,
                                                    cutlass.max(movers, 1))
                    cute.arch.mbarrier_init_fence()
                # Every warp sees them initialised (a receive-only launch's receivers meet no
                # other CTA-wide barrier before using them).
                cute.arch.sync_threads()
            if cutlass.const_expr(self.fmt == "nvfp4"):
                if encode != 0:  # read after the counts phase's barriers
                    fill_scale_table(s_table, tidx, self.threads)
            peers = cute.make_tensor(peer_bases, cute.make_layout(ranks))
            here = peers[my_rank]
            epoch = cute.arch.load(rounds, Int64, sem="relaxed", scope="gpu") + 1
            parity = Int32((epoch - 1) % 2)
            counts_at = counts_layout(entries, channels, ranks)
            flags_at = count_flags_layout(channels, ranks)
            counters = counters_layout(channels, ranks)

            t0, t1 = channel_tokens(channel, num_tokens, active)

            # A launch runs the phases `phases` names (DISPATCH_SEND, DISPATCH_RECEIVE, or both):
            # a dispatch whose receive part runs later (`Buffer.dispatch_send` and its hook) sends
            # in one launch and receives in the next; its sends fit the staging (checked on the
            # host), so they complete without any receiver.
            if phases & DISPATCH_SEND != 0:
                if cutlass.const_expr(self.fmt != "bf16"):
                    # Bf16 tokens this channel quantizes in phase 1b: into L2 while counts go out.
                    if encode != 0 and tidx < t1 - t0:
                        prefetch_rows(x, t0 + tidx, payload_vectors * self.vector_bytes
                                      * (2 if self.fmt == "nvfp4" else 1))
                # 1. Counts ----------------------------------------------------------------------
                self._publish_counts(tidx, channel, t0, t1, num_tokens, topk_ids, id_words, topk,
                                     experts,
                                     local_experts, my_rank, skip_a2a, shared, shared_begin,
                                     shared_end, ranks, entries, peers, counts_offset, counts_at,
                                     flags_offset, flags_at, parity, epoch, active, prefixed,
                                     error, counted, trace, tracing)

                # 1b. Encode (FP8 / NVFP4 given bf16 tokens) -------------------------------------
                # Every warp quantizes the channel's own tokens into the send buffer while the
                # other ranks' counts travel; the senders read them after the barrier.
                if cutlass.const_expr(self.fmt != "bf16"):
                    if encode != 0:
                        self._encode_tokens(tidx, t0, t1, x, global_scale, source, source_stride,
                                            scales_offset, payload_vectors, s_table)
                        cute.arch.sync_threads()

                # 2. Send ------------------------------------------------------------------------
                if warp < SEND_WARPS:
                    self._send(warp, lane, channel, t0, t1, peers, here, source, scale_source,
                               scale_stride, topk_ids, id_words, topk_weights, streams, error, topk,
                               ranks,
                               my_rank, has_weights, header_bytes, source_stride, load_bytes,
                               stage_bytes, stage_batches, channels, headers_offset,
                               staging_offset, counters_offset, counters, timeout_ns,
                               payload_vectors, scales_offset, send_copy, s_arrive, s_head,
                               s_time, trace, tracing, direct)
                    if cutlass.const_expr(self.row_align > 1):
                        if phases & DISPATCH_RECEIVE != 0:
                            self._pad_after_send(warp, lane, channel, active, tokens, scales,
                                                 scale_rows, src_info, s_off, s_raw,
                                                 local_experts + shared, segment_rows,
                                                 payload_vectors, row_capacity)

            if phases & DISPATCH_RECEIVE != 0:
                # 3. Receive ---------------------------------------------------------------------
                if warp >= SEND_WARPS:
                    self._receive(tidx - SEND_WARPS * WARP, channel, peers, here, streams, error,
                                  tokens, scales, scale_rows, scales_offsets, row_offsets,
                                  expert_ids, seg_counts, src_info, comb_rows, comb_weights,
                                  comb_tokens, comb_counts, chan_msgs, recv_ids, recv_weights,
                                  max_tokens, topk,
                                  local_experts, ranks, my_rank, shared, skip_a2a, shared_begin,
                                  shared_end, header_bytes, stage_bytes, stage_batches,
                                  payload_vectors, scales_offset, row_capacity, segment_rows,
                                  channels, active, headers_offset, staging_offset, counts_offset,
                                  flags_offset, counters_offset, counters, counts_at, flags_at,
                                  parity, epoch, timeout_ns, s_next, s_totals, s_off, s_tot, s_raw,
                                  s_first, s_src, s_rows, s_wts, s_ring, s_full, s_piece, s_time,
                                  warp_copy, trace, tracing, phases & DISPATCH_SEND, prefixed,
                                  input_offset, s_plan, s_planw)

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
                    # (Not after an overflow of the output's rows: the layout runs past the
                    # buffers.)
                    if segment_rows <= 0 and s_off[local_experts + shared] <= row_capacity \
                            and not self._direct_scales(s_off, local_experts + shared):
                        # Every CTA's received scales are in scale_rows once the round has advanced:
                        # then all of them write the output's layout, a share each.
                        if tidx == 0:
                            _wait_at_least(rounds.toint(), epoch, timeout_ns, error, my_rank,
                                           Int32(PHASE_DISPATCH))
                        if cutlass.const_expr(self.tiles_in_ring):
                            # The pieces' last bulk accesses are done (waited for) before the tiles
                            # write the same shared memory.
                            cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.sync_threads()
                        messages = self._message_scales(
                            segment_rows, s_off, local_experts + shared, scales, scale_rows,
                            payload_vectors, ranks, max_tokens, row_capacity)
                        self._write_scales(warp, lane, channel, active, scales, scale_rows, s_off,
                                           s_raw, s_first, s_tile, local_experts + shared,
                                           row_capacity, payload_vectors, messages, src_info,
                                           s_totals, ranks, max_tokens)
            if tracing != 0:
                cute.arch.sync_threads()  # "end" after every warp's share of the write-out
            if tidx == 0:
                _stamp(trace, tracing, channel, "end", cute.arch.globaltimer())


    @cute.jit
    def _pad_after_send(self, warp, lane, channel, active, tokens: cute.Pointer,
                        scales: cute.Pointer, scale_rows: cute.Pointer, src_info: cute.Pointer,
                        s_off: cute.Tensor, s_raw: cute.Tensor, segments, segment_rows,
                        payload_vectors, row_capacity):
        """Sender warp `warp`, its batches sent: once the receivers have the row layout
        (PAD_BARRIER), zero its share of FP8's alignment rows (every channel's sender warps take
        a segment each in turn), off the receivers' way to their first batch."""
        cute.arch.barrier(barrier_id=PAD_BARRIER, number_of_threads=self.threads)
        if segment_rows == 0 and s_off[segments] <= row_capacity:
            self._zero_row_padding(channel * SEND_WARPS + warp, active * SEND_WARPS, lane, tokens,
                                   scales, scale_rows, src_info, s_off, s_raw, segments,
                                   Int64(payload_vectors) * self.vector_bytes,
                                   payload_vectors * self.vector_bytes // FP8_BLOCK, row_capacity)

    @cute.jit
    def _encode_tokens(self, tidx, t0, t1, x: cute.Pointer, global_scale: cute.Pointer,
                       send_buf: cute.Pointer, msg_bytes, scales_offset, payload_vectors,
                       table: cute.Tensor):
        """Tokens t0 .. t1 - 1 of `x` (bf16 rows) into their messages in `send_buf` (a token's
        payload, then its scales at `scales_offset`): FP8 by every thread of the CTA, the
        tokens' vectors spread over all of them (`encode_fp8_rows`); NVFP4 by ENCODE_THREADS
        threads a token, the CTA's whole groups of them taking every groups-th token (the
        threads past the last whole group, where the CTA's are not a multiple of
        ENCODE_THREADS, take none)."""
        hidden = payload_vectors * self.vector_bytes * (2 if self.fmt == "nvfp4" else 1)
        if cutlass.const_expr(self.fmt == "fp8"):
            encode_fp8_rows(tidx, self.threads, x.toint() + Int64(t0) * Int64(hidden) * 2,
                            send_buf.toint() + Int64(t0) * Int64(msg_bytes), msg_bytes,
                            scales_offset, hidden, t1 - t0, self.scales == "pow2")
        else:
            groups = self.threads // ENCODE_THREADS
            group = tidx // ENCODE_THREADS
            gtid = tidx - group * ENCODE_THREADS
            gs = load_f32(global_scale.toint())
            if group < groups:
                for t in cutlass.range(t0 + group, t1, groups):
                    msg = send_buf.toint() + Int64(t) * Int64(msg_bytes)
                    row = x.toint() + Int64(t) * Int64(hidden) * 2
                    # (The register receivers' kernel, at 96 registers, loads a block at a time.)
                    encode_nvfp4_token(gtid, row, msg, msg + Int64(scales_offset), hidden, gs,
                                       self.e2m1, table, NVFP4_AHEAD if self.bulk else 1)


def dispatch_kernels() -> list:
    """Every format's kernel: FP8 with exact and power-of-two scales, NVFP4 with each arch's
    e2m1 encoder, bulk and (for rows that are not 16-byte multiples) register receivers."""
    return [EpDispatch("bf16"), *(EpDispatch("fp8", scales=s) for s in FP8_SCALES),
            *(EpDispatch("nvfp4", bulk=b, e2m1=e) for b in (True, False) for e in E2M1_ARCHES)]

