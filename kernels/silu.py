"""The fused SwiGLU kernels: `[M, 2I]` bf16 expert activations -> `silu(gate) * up`, quantized.

After dispatch only the device knows how many rows arrived, so every kernel reads `row_offsets`
(`S + 1` entries) on the device and touches only rows below `row_offsets[S]`, plus the scale
padding it must zero. The input is `[gate | up]` halves or interleaved (`gate_i, up_i`
alternating); `layouts.swiglu` has both views.

The activation, in fp32 with true (round-to-nearest) divisions, in this order:
- silu: `z = (g / (1 + exp(-g))) * u`;
- swiglu_oai (clamped, limit L, alpha a from a 2-float tensor): `g' = g > L ? L : g`,
  `u' = u > L ? L : (u < -L ? -L : u)`, `z = (u' + 1) * (g' * (1 / (1 + exp(-(a * g')))))`;
  `exp` is the correctly rounded-range-reduced expf of the CUDA math library (the DSL's
  non-fast `exp`, the same routine torch's CUDA kernels call).

Outputs (one kernel family each, config `interleaved`, plus the e2m1 encoder for FP4):
- `fused_silu`: bf16 `[M, I]`, 8 elements per thread.
- `fused_silu_fp8`: e4m3 `[M, I]` and fp32 scales transposed `[I / 128, scale_stride]`; per 128
  elements `s = max(amax, 1e-4) / 448`, `q = e4m3(clamp(z / s, +-448))` (8 threads x 16);
  a NaN makes its block's scale and codes NaN (NaN-propagating max and clamp).
- `fused_silu_nvfp4`: codes `[M, I / 2]` and e4m3 scales per 16 in the 128x4 layout, segment g
  quantized with `input_scales[g]` (SPEC section 4 math, as `quantize_nvfp4`).
- `fused_silu_mxfp4`: codes `[M, I / 2]` and e8m0 scales per 32 in the 128x4 layout. The scale
  is the smallest power of two >= fp32(amax / 6) (round-up, "RCEIL": no element saturates past
  6 because of the scale), clamped to [2^-127, 2^127]; a NaN block gets 0xFF. `q = e2m1(z / 2^e)`.

- `fused_silu_fp32`: the fp32 `z` itself, 8 elements per thread (what the tests check the gate
  table with).

Quantized outputs and fp32 come with `table`: the gate's activation from a shared-memory table
of every bf16 gate (`kernels.gate_table`), built once per device by the `gate_table` kernel and
bulk-copied in by each CTA (`gate_table`, unread otherwise), one CTA of `TABLE_THREADS` per SM:
its pair form for FP4 (SwiGLU-OAI's FP4: the value form split by sign, looked up a bf16
pair at a time), its value form (`values`) for FP8 (both for fp32).

For the FP4 outputs each segment starts on a fresh 128-row scale block. The thread and warp
layouts walk *scale rows* x padded scale columns, writing zero scale bytes for padding in the
same pass; the table kernels stream the live rows in chunks through shared memory, a run of
chunks a warp and then a pool the SMs share through the `counters` parameter
(`FusedSilu._fp4_stream`; the input read once, so its loads mark their L2 lines first to evict),
and zero the padding in a pass of their own. Codes are 0 for a block
whose scale is not a positive number (all-zero, underflowed or NaN blocks).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, Uint32, Uint64

from kernels.fp8 import scale_fp8_block
from kernels.gate_table import (ENTRIES, SPLIT_HALF_BYTES, SPLIT_SIGN_BYTES, TABLE_BYTES,
                                VALUE_TABLE_BYTES, activation_constants, gate_pair_key,
                                init_gate_load, lookup_gate, lookup_split, lookup_value,
                                low_halves, oai_gate, silu_gate, split_base, start_gate_load,
                                start_split_gate_load, table_base)
from kernels.bulk_copy import bulk_load, evict_first_policy, init_stage_barriers
from kernels.nvfp4 import (SCALE_TABLE_BYTES, bits_f32, e2m1_words, e4m3_byte_to_f32,
                           f32_bits, fill_scale_table, high_bf16, load_segment_blocks, low_bf16,
                           next_row_segment, nvfp4_scale_byte, read_segment_inputs, rotate_left64,
                           scale_table_layout, segment_of, warp_run, zero_padding)
from kernels.memory import scale_offset, store_u8, take_ticket
from kernels.scan import WARP
from layouts.abi import GridRule, KernelSpec, Param

FAMILIES = {"bf16": "fused_silu", "fp8": "fused_silu_fp8", "nvfp4": "fused_silu_nvfp4",
            "mxfp4": "fused_silu_mxfp4", "fp32": "fused_silu_fp32"}
# Output elements per thread, and elements per scale.
VECTOR = {"bf16": 8, "fp8": 16, "nvfp4": 16, "mxfp4": 32, "fp32": 8}
# FP4 with a warp per scale row (`rows_per_warp`): elements a lane takes, a whole NVFP4 block
# or half an MXFP4 one (a lane pair, the amax by one shuffle).
ROW_VECTOR = {"nvfp4": 16, "mxfp4": 16}
BLOCK = {"bf16": 1, "fp8": 128, "nvfp4": 16, "mxfp4": 32, "fp32": 1}
ATOM_ROWS = 128
MAX_SEGMENTS = 272
SMEM_ENTRIES = 544  # a probe at pos + 256 stays inside
# The FP4 table kernels' stream (`FusedSilu._fp4_stream`): a chunk is a warp's 32 lane vectors of
# one row (16 outputs a lane: 32 gate and 32 up bytes), each warp a ring of STREAM_STAGES.
STREAM_STAGES = 2
STREAM_CHUNK_WORDS = WARP * 16  # bf16 pairs: gate then up halves, or the interleaved pairs
TABLE_THREADS = 1024  # the gate-table kernels' CTA: one per SM loads the table once
# The FP4 stream's pool (`FusedSilu._fp4_stream`): 1 / POOL_SHARE of the chunks, taken one at a
# time, in POOLS parts whose counters lie POOL_STRIDE int32 apart (other L2 lines), then the
# count of CTAs done: the `counters` parameter's int32 elements, COUNTER_INTS.
POOL_SHARE = 4
# swiglu_oai's pool (its runs in a loop of their own, `FusedSilu.run_loop`): a pool chunk costs
# it some 34 warp instructions more than a run chunk (a row of its own, the stage's bookkeeping),
# and an eighth of the chunks ran 0.8-1.1 points of copy faster than a quarter on an H200.
POOL_SHARE_RUN_LOOP = 8
POOLS = 16
POOL_STRIDE = 64
COUNTER_INTS = POOLS * POOL_STRIDE + 1
RING_WARP_BYTES = STREAM_STAGES * STREAM_CHUNK_WORDS * 4  # a warp's stages


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def split_arena(warps: int) -> tuple[int, int, int, int]:
    """Where the split gate table and the stream's rings share one shared-memory arena
    (swiglu_oai's FP4 stream, `FusedSilu.split_gates`): the positive gates' half at byte 0, the
    negative half SPLIT_SIGN_BYTES on, the rings of the first warps in the gap between and the
    others' past the negative half. Returns (first ring's offset, warps in the gap, the later
    rings' offset, arena bytes)."""
    first = _align(SPLIT_HALF_BYTES, 128)
    gap = min(warps, (SPLIT_SIGN_BYTES - first) // RING_WARP_BYTES)
    later = _align(SPLIT_SIGN_BYTES + SPLIT_HALF_BYTES, 128)
    return first, gap, later, later + (warps - gap) * RING_WARP_BYTES


def _ptr(dtype, addr, align):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def e8m0_round_up(q: Float32) -> Int32:
    """e8m0 code of the smallest power of two >= q (q >= 0), clamped to [2^-127, 2^127];
    NaN -> 0xFF. Exact integer work on q's bits."""
    bits = f32_bits(q)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    code = exponent
    if exponent == 0xFF:
        code = Int32(0xFE)
        if mantissa != 0:
            code = Int32(0xFF)
    elif exponent == 0:
        code = Int32(0)
        if mantissa > 0x400000:  # above 2^-127: rounds up to 2^-126
            code = Int32(1)
    else:
        if mantissa != 0:
            code = exponent + 1
        if code > 0xFE:
            code = Int32(0xFE)
    return code


@cute.jit
def e8m0_value(code: Int32) -> Float32:
    """2^(code - 127) for codes 0..254 (code 0 is the subnormal 2^-127)."""
    bits = code << 23
    if code == 0:
        bits = Int32(0x400000)
    return bits_f32(bits)


class FusedSilu:
    def __init__(self, out: str, interleaved: bool, activation: str = "silu",
                 e2m1: str | None = None, threads: int = 256, rows_per_warp: bool = False,
                 table: bool = False, values: bool = False):
        """`rows_per_warp` (FP4 only): a warp per scale row, a lane per NVFP4 block and a lane
        pair per MXFP4 block (`ROW_VECTOR`), for inputs of at least as many scale rows as the
        grid has warps; otherwise a thread per scale block. `table` (quantized outputs): the
        gate's activation from a shared-memory table each CTA copies in once
        (`kernels.gate_table`), for inputs large enough to repay it; `values` (FP8 and fp32,
        which check every element): its value form, a 4-byte load an element and the formula
        for the gates it leaves out, in place of the pairs' 8-byte load and fma."""
        if out not in FAMILIES:
            raise ValueError(f"out must be one of {sorted(FAMILIES)}, got {out!r}")
        if activation not in ("silu", "swiglu_oai"):
            raise ValueError(f"activation silu|swiglu_oai, got {activation!r}")
        fp4 = out in ("nvfp4", "mxfp4")
        if fp4 != (e2m1 in ("software", "hardware")):
            raise ValueError(f"{out}: e2m1 must be {'software|hardware' if fp4 else 'None'}, "
                             f"got {e2m1!r}")
        self.out = out
        self.interleaved = bool(interleaved)
        self.activation = activation
        self.e2m1 = e2m1
        self.threads = threads
        if rows_per_warp and not fp4:
            raise ValueError(f"{out}: rows_per_warp is for the FP4 outputs")
        if table and out == "bf16":
            raise ValueError("table is for the quantized outputs")
        self.rows_per_warp = bool(rows_per_warp)
        self.table = bool(table)
        if values and not (table and out in ("fp8", "fp32")):
            raise ValueError("values is for the FP8 and fp32 table kernels")
        self.values = bool(values)
        # A warp per row loads an item ahead for MXFP4's silu, where the loads' latency showed
        # (measured on an H200: 8% faster at I = 7168); NVFP4, a whole block a lane, and
        # swiglu_oai (its formula for gates outside the table) have no registers left for
        # inputs in flight.
        self.prefetch = self.rows_per_warp and out == "mxfp4" and activation == "silu"
        # The FP4 stream computes its runs in a loop of their own, rows and vectors counted in
        # registers (`_fp4_stream`), for swiglu_oai: on an H200, 2.5-3.2 points of copy faster
        # than one loop for runs and pool; the silu kernels ran within a point of it, and the
        # interleaved NVFP4 one 4 points slower at I = 7168 (64 registers, 52 with one loop).
        self.run_loop = activation == "swiglu_oai"
        # Carried code and scale addresses in the FP4 stream (`_fp4_stream` says why).
        self.carry = activation == "swiglu_oai"
        self.pool_share = POOL_SHARE_RUN_LOOP if self.run_loop else POOL_SHARE
        self.vector = ROW_VECTOR[out] if rows_per_warp else VECTOR[out]
        self.lanes = BLOCK[out] // self.vector  # lanes per scale block (rows_per_warp)
        self.fp4 = fp4
        # swiglu_oai's FP4 stream looks its gates up two at a time, on the bf16 pairs, in the
        # value table split by sign (`kernels.gate_table.lookup_split`: two packed clamps, then a
        # shift and a mask a gate; the pair table's lookup is a multiply, a max, two shifts, an
        # or and an fma a gate). Its gates outside the table come out NaN, as the pairs' do, and
        # take the formula (`_row_vector`).
        self.split_gates = fp4 and self.table and activation == "swiglu_oai"
        if fp4:
            self.arches = ("sm_100a",) if e2m1 == "hardware" else ("sm_90a",)

    def spec(self) -> KernelSpec:
        config = {"interleaved": self.interleaved, "activation": self.activation,
                  "threads": self.threads}
        if self.out != "bf16":
            config["table"] = self.table
        if self.table and not self.fp4:
            config["values"] = self.values
        if self.fp4:
            config["e2m1"] = self.e2m1
            config["rows_per_warp"] = self.rows_per_warp
        # One ABI for every output (unused pointers get a placeholder tensor): the outputs as
        # bytes, the FP8 scales as the bytes of their fp32 values.
        params = (
            Param("x", "ptr", "bfloat16", align=16),
            Param("row_offsets", "ptr", "int32", align=4, min_elements=("num_segments", 1)),
            Param("input_scales", "ptr", "float32", align=4),
            Param("activation_params", "ptr", "float32", align=4),
            Param("gate_table", "ptr", "float32", align=16),
            Param("out", "ptr", "uint8", align=16, writes=True),
            Param("scales", "ptr", "uint8", align=4, writes=True),
            # int32 [COUNTER_INTS], zero at launch and again after it (the FP4 table kernels'
            # pool; the others never read it).
            Param("counters", "ptr", "int32", align=4, writes=True),
            Param("num_segments", "i32"),
            Param("intermediate", "i32"),
            Param("scale_stride", "i32"),
            Param("grid_ctas", "i32"),
        )
        return KernelSpec(
            family=FAMILIES[self.out], config=config, params=params,
            block=(self.threads, 1, 1),
            grid=(GridRule(ceil_div=("grid_ctas", 1)), GridRule(constant=1), GridRule(constant=1)),
            smem_bytes=self.smem_bytes,
            sizes={"vector": self.vector, "block": BLOCK[self.out],
                   "max_segments": MAX_SEGMENTS - 1, "counter_ints": COUNTER_INTS})

    @property
    def smem_bytes(self) -> int:
        if self.fp4 and self.table:
            warps = self.threads // WARP
            stages = warps * STREAM_STAGES * 16  # a stage's barrier and chunk
            rings = (split_arena(warps)[3] + 128 if self.split_gates
                     else warps * RING_WARP_BYTES + TABLE_BYTES)
            return (rings + stages + (SCALE_TABLE_BYTES if self.out == "nvfp4" else 0)
                    + 3 * SMEM_ENTRIES * 4 + 528)
        size = 2 * SMEM_ENTRIES * 4 + 64 if self.fp4 else 0
        if self.table:
            size += ((VALUE_TABLE_BYTES if self.values else TABLE_BYTES)
                     + (SCALE_TABLE_BYTES if self.out == "nvfp4" else 0) + 32)
        return size

    @cute.jit
    def __call__(self, x: cute.Pointer, row_offsets: cute.Pointer, input_scales: cute.Pointer,
                 activation_params: cute.Pointer, gate_table: cute.Pointer, out: cute.Pointer,
                 scales: cute.Pointer, counters: cute.Pointer, num_segments: Int32,
                 intermediate: Int32, scale_stride: Int32, grid_ctas: Int32, stream):
        self.kernel(x, row_offsets, input_scales, activation_params, gate_table, out, scales,
                    counters, num_segments, intermediate, scale_stride, grid_ctas).launch(
            grid=(grid_ctas, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, row_offsets: cute.Pointer, input_scales: cute.Pointer,
               activation_params: cute.Pointer, gate_table: cute.Pointer, out: cute.Pointer,
               scales: cute.Pointer, counters: cute.Pointer, num_segments: Int32,
               intermediate: Int32, scale_stride: Int32, grid_ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        limit, alpha = activation_constants(self.activation, activation_params)
        vecs = intermediate // self.vector
        stride = grid_ctas * self.threads
        smem = cutlass.memory.SmemAllocator()
        gates = Int32(0)
        recips = None
        if cutlass.const_expr(self.fp4 and self.table):
            self._fp4_stream(smem, x, row_offsets, input_scales, gate_table, out, scales,
                             counters, num_segments, intermediate, limit, alpha, tidx, bidx,
                             grid_ctas)
        elif cutlass.const_expr(self.table):  # FP8
            table = smem.allocate_tensor(
                Float32, cute.make_layout(ENTRIES if self.values else 2 * ENTRIES),
                byte_alignment=16)
            loaded = smem.allocate_array(Int64, 1)
            init_gate_load(loaded, tidx == 0)
            # Every thread past the initialisation before the copy's arrival: the compiler
            # issues the leader's operations as warp-wide uniform ones, which the race checker
            # would otherwise pair across the warp.
            cute.arch.sync_threads()
            start_gate_load(table, gate_table, loaded, tidx == 0, self.values)
            cute.arch.mbarrier_wait(loaded, 0)
            gates = table_base(table, self.values)
        if cutlass.const_expr(not self.fp4):
            rows = cute.make_tensor(row_offsets, cute.make_layout(num_segments + 1))[num_segments]
            total = rows * vecs
            # Warp-uniform trip counts: FP8's 8-lane amax shuffles need every lane present.
            padded = (total + WARP - 1) // WARP * WARP
            for item in cutlass.range(bidx * self.threads + tidx, padded, stride):
                if item < total:
                    row = item // vecs
                    v = item - row * vecs
                    self._row_vector(x, out, scales, row, v, intermediate, scale_stride, limit,
                                     alpha, Float32(1.0), Boolean(True), gates, recips)
                elif cutlass.const_expr(self.out == "fp8"):
                    self._row_vector(x, out, scales, Int32(0), Int32(0), intermediate,
                                     scale_stride, limit, alpha, Float32(1.0), Boolean(False),
                                     gates, recips)
        elif cutlass.const_expr(not self.table):
            self._fp4(smem, x, row_offsets, input_scales, out, scales, num_segments,
                      intermediate, limit, alpha, tidx, bidx, stride, gates, recips)

    @cute.jit
    def _fp4_stream(self, smem, x, row_offsets, input_scales, gate_table, out, scales,
                    counters, num_segments, intermediate, limit, alpha, tidx, bidx, grid_ctas):
        """The FP4 table kernels: the live rows cut into chunks of 32 lane vectors (the last
        of a row shorter), streamed through a ring of shared-memory stages per warp that its
        lane 0 fills with bulk copies, `stages - 1` chunks ahead of the one its lanes compute
        (a stage is refilled once every lane has used its words).

        Who takes which chunk: the last chunks, all but a pool of the first 1 / pool_share,
        are split into equal runs of consecutive chunks, one a warp, which every warp streams
        first; then each warp takes pool chunks one at a time from a counter in global memory,
        so that the SMs which stream faster take more of them. The SMs of one grid run at
        different speeds (on an H100, I = 2048, equal static shares: the SMs' last warps end
        between 26 and 37 us), and a static split waits for the slowest. The pool comes in
        POOLS parts, CTA b drawing on part b % POOLS, each part's counter on an L2 line of its
        own: one counter for all ran 4-13 points slower than the static split (atomics on one
        address), sixteen faster. The pool is the first rows because the rows a producer wrote
        last are the likeliest to be in L2, and the runs reach them at once. A warp asks for
        its first pool chunk when it loads its run's last chunk and for each next one when it
        loads the one before, so the atomic's latency hides under a chunk's work. A stage
        carries its chunk's (row, first lane vector) beside its bytes, row -1 once the warp's
        part of the pool is empty: every stage in the one loop of the silu kernels, the pool's
        only where the runs have a loop of their own (`run_loop`, swiglu_oai), its rows and
        vectors counted in registers. The last CTA to finish (the count after the parts'
        counters) sets every counter back to zero for the next launch: launches that share
        `counters` must not overlap (the host keeps one set per stream).

        The first loads are issued before the scale and segment tables are built (every small
        read first, in one round trip), so their latency hides under that work; the gate
        table's bulk copy goes first of all. At start-up all 32 warps of an SM run the same
        code, so every instruction before a warp's first load delays it (per-warp stamps on an
        H100: loads issued about 2.1 us after the start); a warp whose run is longer than its
        ring fills the ring straight from the run, the pool's part worked out afterwards, and
        the split's divisions are unsigned 32-bit ones. Padding scale rows and columns are
        zeroed by a pass of their own (`zero_padding`: the padding rows only where I / block is
        a multiple of 4, as in every stream size measured; every scale row otherwise)."""
        # The warp index, and so every count and stage derived from it, marked warp-uniform: the
        # compiler keeps them in the uniform datapath instead of the ALU pipe the compute loads.
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = tidx % WARP
        per_cta = self.threads // WARP
        stages = STREAM_STAGES
        # ring[(i, lane, half), stage, warp] (halves: word i of the lane's gate or up vector) or
        # ring[(i, lane), stage, warp] (interleaved: its i-th (gate, up) pair).
        vector = ((self.vector, WARP) if self.interleaved else (self.vector // 2, WARP, 2))
        table = None
        positive = None
        if cutlass.const_expr(self.split_gates):
            # One arena (`split_arena`): this warp's stages in the gap between the split table's
            # halves or past them, `ring[..., warp]` every warp's own (a warp stride of 0).
            first, gap, later, size = split_arena(per_cta)
            arena = smem.allocate_tensor(Int32, cute.make_layout(size // 4), byte_alignment=128)
            positive = arena.iterator
            mine_at = Int32((later - gap * RING_WARP_BYTES) // 4) + warp * (RING_WARP_BYTES // 4)
            if warp < gap:
                mine_at = Int32(first // 4) + warp * (RING_WARP_BYTES // 4)
            chunk = STREAM_CHUNK_WORDS
            strides = (1, self.vector) if self.interleaved else (1, self.vector // 2, chunk // 2)
            ring = cute.make_tensor(positive + mine_at, cute.make_layout(
                (vector, stages, per_cta), stride=(strides, chunk, 0)))
        else:
            ring = smem.allocate_tensor(Int32, cute.make_layout((vector, stages, per_cta)),
                                        byte_alignment=128)
        full = smem.allocate_array(Int64, stages * per_cta)
        # (row, first lane vector) of the chunk each stage holds.
        held = smem.allocate_tensor(Int32, cute.make_layout((2, stages, per_cta)),
                                    byte_alignment=8)
        if cutlass.const_expr(not self.split_gates):
            table = smem.allocate_tensor(Float32, cute.make_layout(2 * ENTRIES),
                                         byte_alignment=16)
        loaded = smem.allocate_array(Int64, 1)
        recips = (smem.allocate_tensor(Float32, scale_table_layout(), byte_alignment=16)
                  if self.out == "nvfp4" else None)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        s_start = smem.allocate_tensor(Int32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        s_gs = smem.allocate_tensor(Float32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        mine = full + warp * stages

        # The leader starts the table's copy right after initialising its barrier (program
        # order); the other threads wait only after load_segment_blocks' barriers.
        init_gate_load(loaded, tidx == 0)
        if cutlass.const_expr(self.split_gates):
            start_split_gate_load(positive, positive + SPLIT_SIGN_BYTES // 4, gate_table, loaded,
                                  tidx == 0)
        else:
            start_gate_load(table, gate_table, loaded, tidx == 0)
        # The stage barriers too: they do not depend on the row count.
        init_stage_barriers(mine, stages, lane == 0)
        offset, gs_mine, total_rows = read_segment_inputs(
            row_offsets, input_scales if self.out == "nvfp4" else None, num_segments, tidx)
        # Unsigned: the quotients of these non-negative counts need no sign corrections.
        vecs = Int32(Uint32(intermediate) // self.vector)  # lane vectors a row
        pieces = Int32((Uint32(vecs) + WARP - 1) // WARP)  # chunks a row
        me = bidx * per_cta + warp
        warps = grid_ctas * per_cta
        total = total_rows * pieces
        # The pool is the first chunks, the runs the rest: the rows a producer wrote last are
        # the likeliest in L2, and the runs start at once.
        pool = Int32(Uint32(total) // self.pool_share)
        begin, left = warp_run(me, warps, total - pool)
        # Lane 0's cursor: the next chunk of its run to load (while `left` > 0), then `pending`,
        # its last ticket of its part's counter (the pool chunk pool_base + it; the part is
        # empty from pool_end - pool_base on).
        load_row, load_kv = self._chunk_at(begin + pool, pieces)
        runs = cute.arch.make_warp_uniform(left)  # its run's chunks, from (run_row, run_kv)
        run_row = load_row
        run_kv = load_kv
        cute.arch.sync_warp()  # the barriers are initialised before any lane uses them
        # A run longer than the ring fills it before the pool's part is worked out: every
        # instruction here waits behind the other warps' on the SM's schedulers.
        lean = left > stages
        if lane == 0:
            if lean:
                for s in cutlass.range_constexpr(stages):
                    load_row, load_kv, left = self._run_fill(ring, held, mine, warp, s, x,
                                                             load_row, load_kv, left, vecs,
                                                             intermediate)
        # A pool chunk's row by a multiply-high (`_pool_chunk_at`), not a division.
        inverse = Int32(Uint32(0xFFFFFFFF) // Uint32(pieces))
        parts = cutlass.min(grid_ctas, POOLS)  # every part has CTAs
        part = bidx % parts
        share = pool // parts
        pool_base = part * share
        pool_end = pool_base + share
        if part == parts - 1:
            pool_end = pool
        counter = counters + part * POOL_STRIDE
        pending = pool_end - pool_base
        if lane == 0:
            if not lean:
                if left == 0:
                    pending = self._pool_claim(counter)
                for s in cutlass.range_constexpr(stages):
                    load_row, load_kv, left, pending = self._stream_fill(
                        ring, held, mine, warp, s, x, counter, load_row, load_kv, left,
                        pending, vecs, pieces, inverse, pool_base, pool_end, intermediate)

        if cutlass.const_expr(self.out == "nvfp4"):
            fill_scale_table(recips, tidx, self.threads)
        gates = split_base(positive) if self.split_gates else table_base(table)
        if tidx < num_segments:
            s_gs[tidx] = gs_mine
        load_segment_blocks(row_offsets, num_segments, s_off, s_start, tidx, self.threads,
                            offset)
        blocks = intermediate // BLOCK[self.out]
        cols = (blocks + 3) // 4 * 4
        rk = cols // 4
        zero_padding(scales, s_off, s_start, num_segments, blocks, me, warps, lane)
        cute.arch.mbarrier_wait(loaded, 0)

        gs = Float32(1.0)
        unit = Int32(0)
        # This lane's code and scale byte addresses (swiglu_oai's loop only), set at each row's
        # first chunk and at each pool chunk and moved a chunk on after each (the 128x4 offset
        # of a column WARP / lanes on is a constant): one H200, beside copy_, 2-3.5 points
        # faster in every L2 state; the silu kernels compute them per chunk, where carrying them
        # cost up to 6 points (interleaved NVFP4 at I = 7168, compiled at 64 registers) and
        # gained 2.5 at most.
        carry = self.carry
        code_at = Int64(0)
        scale_at = Int64(0)
        words = cute.make_rmem_tensor(cute.make_layout(self.vector), Int32)  # bf16 pairs
        # The run: every lane counts its chunks' rows and vectors as lane 0 loads them, so a
        # chunk costs no more than the stream's own work (the stage's (row, vector) is read
        # for pool chunks only: on an issue-bound H200 that bookkeeping on every chunk cost
        # SwiGLU-OAI 5-9 points).
        seg = Int32(0)
        if cutlass.const_expr(not self.run_loop):
            runs = Int32(0)  # every chunk through the pool's loop
        row = run_row
        kv = run_kv
        if cutlass.const_expr(self.run_loop):
            seg = segment_of(s_off, num_segments, row)
        row_of_unit = Int32(-1)
        for i in cutlass.range(runs):
            s = self._wait_stage(mine, i)
            if row != row_of_unit:
                seg, gs, unit = next_row_segment(s_off, s_start, s_gs, seg, row)
                row_of_unit = row
                if cutlass.const_expr(carry):
                    code_at, scale_at = self._lane_addresses(out, scales, unit, row, kv + lane,
                                                             rk, intermediate)
            # Lane 0 loads chunk i + stages: a run chunk by a bare load unless it is the run's
            # last (whose fill takes the first pool ticket).
            load_row, load_kv, left, pending = self._stream_chunk(
                ring, held, mine, warp, lane, s, x, out, scales, counter, unit, row, kv, blocks,
                cols, rk, intermediate, limit, alpha, gs, gates, recips, words, code_at,
                scale_at, load_row, load_kv, left, pending, vecs, pieces, inverse, pool_base,
                pool_end, plain=i + STREAM_STAGES + 1 < runs)
            if cutlass.const_expr(carry):
                code_at = code_at + WARP * (self.vector // 2)
                scale_at = scale_at + scale_offset(0, WARP // self.lanes, 0)
            row, kv = self._stream_next(row, kv, vecs)
        # The pool: each stage says which chunk it holds, row -1 once the warp's part is empty.
        # The first pool chunk lies in a row before the run's (the pool is the first rows).
        row_of_unit = Int32(0x7FFFFFFF)
        i = runs
        going = Boolean(True)
        while going:
            s = self._wait_stage(mine, i)
            row = held[0, s, warp]
            kv = held[1, s, warp]
            if row < 0:
                going = Boolean(False)
            else:
                if row != row_of_unit:
                    if row < row_of_unit:
                        seg = segment_of(s_off, num_segments, row)
                    seg, gs, unit = next_row_segment(s_off, s_start, s_gs, seg, row)
                    row_of_unit = row
                # A pool chunk's addresses are its own (the carried ones are the run's).
                addresses = (self._lane_addresses(out, scales, unit, row, kv + lane, rk,
                                                  intermediate) if carry else (code_at, scale_at))
                load_row, load_kv, left, pending = self._stream_chunk(
                    ring, held, mine, warp, lane, s, x, out, scales, counter, unit, row, kv,
                    blocks, cols, rk, intermediate, limit, alpha, gs, gates, recips, words,
                    *addresses, load_row, load_kv, left, pending, vecs, pieces, inverse,
                    pool_base, pool_end)
                i = i + 1

        # The last CTA to finish sets the pool's counters back to zero. Every pool chunk a
        # warp was given has been read by then (a warp stops at the stage that says the pool
        # is empty, after the fill that read its last claim).
        cute.arch.sync_threads()
        if tidx == 0:
            done = cute.arch.atomic_add(counters + POOLS * POOL_STRIDE, Int32(1), sem="acq_rel",
                                        scope="gpu")
            if done == grid_ctas - 1:
                for j in cutlass.range_constexpr(POOLS):
                    cute.arch.store(counters + j * POOL_STRIDE, Int32(0))
                cute.arch.store(counters + POOLS * POOL_STRIDE, Int32(0))

    @cute.jit
    def _wait_stage(self, mine: cute.Pointer, i):
        """Wait for stage i % STREAM_STAGES to hold chunk i of the warp's stream; returns the
        stage (unsigned: a mask and a shift, where a signed remainder takes a dozen
        instructions)."""
        s = Int32(Uint32(i) % STREAM_STAGES)
        cute.arch.mbarrier_wait(mine + s, Int32(Uint32(i) // STREAM_STAGES % 2))
        return s

    @cute.jit
    def _stream_chunk(self, ring: cute.Tensor, held: cute.Tensor, mine: cute.Pointer, warp, lane,
                      s, x: cute.Pointer, out: cute.Pointer, scales: cute.Pointer,
                      counter: cute.Pointer, unit, row, kv, blocks, cols, rk, intermediate, limit,
                      alpha, gs, gates, recips, words: cute.Tensor, code_at, scale_at, load_row,
                      load_kv, left, pending, vecs, pieces, inverse, pool_base, pool_end,
                      plain=False):
        """Compute the chunk at (row, kv) from stage s, then lane 0 refills the stage with the
        warp's next chunk: with `plain` (a run chunk follows that is not the run's last) by a
        bare load of it, else by `_stream_fill`. Returns lane 0's cursor moved on."""
        rotation = self._stream_words(ring, s, warp, lane, words)
        carried = (code_at, scale_at) if self.carry else (None, None)
        self._lane_item(x, out, scales, unit, row, kv + lane, Boolean(True), blocks, cols, rk,
                        intermediate, limit, alpha, gs, gates, recips, words, rotation, *carried)
        # Every lane has used (so read) its words and its stage's chunk before the stage is
        # refilled: a load still in flight at the barrier could otherwise read the bulk copy's
        # bytes.
        cute.arch.sync_warp()
        if lane == 0:
            if plain:
                load_row, load_kv, left = self._run_fill(ring, held, mine, warp, s, x, load_row,
                                                         load_kv, left, vecs, intermediate)
            else:
                load_row, load_kv, left, pending = self._stream_fill(
                    ring, held, mine, warp, s, x, counter, load_row, load_kv, left, pending,
                    vecs, pieces, inverse, pool_base, pool_end, intermediate)
        return load_row, load_kv, left, pending

    @cute.jit
    def _run_fill(self, ring: cute.Tensor, held: cute.Tensor, mine: cute.Pointer, warp, s,
                  x: cute.Pointer, load_row, load_kv, left, vecs, intermediate):
        """Lane 0: load the run chunk at its cursor into stage s (its row and vector beside it
        where one loop reads every stage), one that is not the run's last (no ticket to take).
        Returns the cursor moved on."""
        if cutlass.const_expr(not self.run_loop):
            held[0, s, warp] = load_row
            held[1, s, warp] = load_kv
        self._stream_load(ring, mine, warp, s, x, load_row, load_kv, vecs, intermediate)
        load_row, load_kv = self._stream_next(load_row, load_kv, vecs)
        return load_row, load_kv, left - 1

    def _lane_addresses(self, out: cute.Pointer, scales: cute.Pointer, unit, row, h, rk,
                        intermediate):
        """This lane's code and scale byte addresses for lane vector h of `row`."""
        return (self._code_address(out, row, h, intermediate),
                scales.toint() + scale_offset(unit, h // self.lanes, rk))

    def _code_address(self, out: cute.Pointer, row, v, intermediate):
        """Global address of the FP4 codes of output vector v of `row` (I / 2 bytes a row)."""
        return out.toint() + Int64(row) * Int64(intermediate // 2) + Int64(v) * (self.vector // 2)

    @cute.jit
    def _chunk_at(self, chunk, pieces):
        """(row, first lane vector) of chunk `chunk`, `pieces` chunks a row."""
        row = Int32(Uint32(chunk) // Uint32(pieces))
        return row, (chunk - row * pieces) * WARP

    @cute.jit
    def _pool_chunk_at(self, chunk, pieces, inverse):
        """`_chunk_at` for lane 0's pool chunks, with `inverse` = floor((2^32 - 1) / pieces): for
        chunk < 2^31 the high word of chunk * inverse is the quotient or one less (it exceeds
        chunk / pieces - chunk / 2^31), so one correction makes it exact."""
        c = Uint32(chunk)
        p = Uint32(pieces)
        q = Uint32((Uint64(c) * Uint64(Uint32(inverse))) >> 32)
        r = c - q * p
        if r >= p:
            q = q + Uint32(1)
            r = r - p
        return Int32(q), Int32(r) * WARP

    @cute.jit
    def _stream_next(self, row, kv, vecs):
        """The chunk after the one at (row, first lane vector kv)."""
        kv = kv + WARP
        if kv >= vecs:
            kv = 0
            row = row + 1
        return row, kv

    @cute.jit
    def _stream_fill(self, ring: cute.Tensor, held: cute.Tensor, mine: cute.Pointer, warp, s,
                     x: cute.Pointer, counter: cute.Pointer, load_row, load_kv, left, pending,
                     vecs, pieces, inverse, pool_base, pool_end, intermediate):
        """Lane 0: fill stage s with the warp's next chunk, the next of its run while `left`
        chunks of it remain, else the pool chunk of its ticket `pending` (asking for the next
        ticket as it takes it; the first at its run's last chunk); with none left, row -1 and a
        bare arrival.
        Returns the cursor (load_row, load_kv, left, pending) moved on."""
        row = Int32(-1)
        kv = Int32(0)
        if left > 0:
            row = load_row
            kv = load_kv
            load_row, load_kv = self._stream_next(load_row, load_kv, vecs)
            left = left - 1
            if left == 0:
                pending = self._pool_claim(counter)
            if cutlass.const_expr(not self.run_loop):
                held[0, s, warp] = row
                held[1, s, warp] = kv
        else:
            if pending < pool_end - pool_base:
                row, kv = self._pool_chunk_at(pool_base + pending, pieces, inverse)
                pending = self._pool_claim(counter)
            held[0, s, warp] = row
            held[1, s, warp] = kv
        if row < 0:
            cute.arch.mbarrier_arrive(mine + s)
        else:
            self._stream_load(ring, mine, warp, s, x, row, kv, vecs, intermediate)
        return load_row, load_kv, left, pending

    def _pool_claim(self, counter: cute.Pointer):
        """A ticket of a pool part's counter: its old value (the part's chunk of that place,
        past the part's end once it is empty), first used a chunk later, so the atomic's
        round trip passes under that chunk's work."""
        return take_ticket(counter.toint())

    @cute.jit
    def _stream_load(self, ring: cute.Tensor, mine: cute.Pointer, warp, s, x: cute.Pointer, row,
                     kv, vecs, intermediate):
        """Lane 0: bulk-copy the inputs of the chunk at (row, kv) into stage s: the gate
        vectors into the stage's first half and the up vectors into its second, or the
        interleaved pairs in order."""
        lanes = cutlass.min(vecs - kv, WARP)
        half = lanes * (2 * self.vector)  # bytes of one half's vectors
        src = x.toint() + Int64(row) * Int64(4 * intermediate)
        cute.arch.mbarrier_arrive_and_expect_tx(mine + s, 2 * half)
        # The input is read once: its lines go first when L2 needs room, not what L2 held
        # (one H200, default L2 state: every FP4 stream 2-3.5 points of copy faster at I = 2048,
        # -2..+1.7 at 7168).
        policy = evict_first_policy()
        if cutlass.const_expr(self.interleaved):
            bulk_load(ring[None, s, warp].iterator, src + Int64(kv) * (4 * self.vector),
                      2 * half, mine + s, policy)
        else:
            gate = src + Int64(kv) * (2 * self.vector)
            bulk_load(ring[(None, None, 0), s, warp].iterator, gate, half, mine + s, policy)
            bulk_load(ring[(None, None, 1), s, warp].iterator, gate + Int64(2 * intermediate),
                      half, mine + s, policy)

    @cute.jit
    def _stream_words(self, ring: cute.Tensor, s, warp, lane, words: cute.Tensor):
        """`words` = this lane's inputs in stage s, in `_load_inputs`' order but rotated: a
        lane reads its 16-byte pieces starting at piece r (interleaved: r = lane / 2 mod 4 of
        4 pieces; halves: r = lane / 4 mod 2 of 2 per half), so the 8 lanes of each 128-bit
        shared load hit 8 different bank groups (in order, lanes 64 or 32 bytes apart would
        share them 4 or 2 ways). Returns the code rotation for `_row_vector`: the elements sit
        4r places (interleaved) or 8r (halves) on, their codes 16r or 32r bits."""
        rotation = Int32(0)
        if cutlass.const_expr(self.interleaved):
            r = (lane >> 1) & 3
            pieces = cute.make_tensor(ring[(None, lane), s, warp].iterator,
                                      cute.make_layout((4, 4)))
            for j in cutlass.range_constexpr(4):
                cute.autovec_copy(pieces[None, (j + r) & 3], cute.make_tensor(
                    words.iterator + 4 * j, cute.make_layout(4)))
            rotation = r * 16
        else:
            half = self.vector // 2
            r = (lane >> 2) & 1
            for h in cutlass.range_constexpr(2):
                pieces = cute.make_tensor(ring[(None, lane, h), s, warp].iterator,
                                          cute.make_layout((4, 2)))
                for j in cutlass.range_constexpr(2):
                    cute.autovec_copy(pieces[None, (j + r) & 1], cute.make_tensor(
                        words.iterator + h * half + 4 * j, cute.make_layout(4)))
            rotation = r * 32
        return rotation

    @cute.jit
    def _fp4(self, smem, x, row_offsets, input_scales, out, scales, num_segments, intermediate,
             limit, alpha, tidx, bidx, stride, gates, recips):
        """The grid walks scale rows (units) x padded scale columns: a thread per scale block
        (item), or with `rows_per_warp` a warp per scale row (its segment found once) and
        `lanes` lanes per block (a pair: its amax by one shuffle); the block's first lane writes
        its scale byte, zero for padding rows and columns."""
        s_off = smem.allocate_tensor(Int32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        s_start = smem.allocate_tensor(Int32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        load_segment_blocks(row_offsets, num_segments, s_off, s_start, tidx, self.threads)

        blocks = intermediate // BLOCK[self.out]
        cols = (blocks + 3) // 4 * 4
        rk = cols // 4
        if cutlass.const_expr(self.prefetch):
            self._fp4_prefetching(x, input_scales, out, scales, num_segments, intermediate, limit,
                                  alpha, tidx, bidx, stride, gates, recips, s_off, s_start,
                                  blocks, cols, rk)
        elif cutlass.const_expr(self.rows_per_warp):
            units = s_start[num_segments] * ATOM_ROWS
            warps = self.threads // WARP
            lane = tidx % WARP
            # Lanes of a row, rounded up to whole warps so every lane reaches each shuffle.
            span = (cols * self.lanes + WARP - 1) // WARP * WARP
            for unit in cutlass.range(bidx * warps + tidx // WARP, units, stride // WARP):
                row, live, seg = self._unit(s_off, s_start, num_segments, unit, units)
                gs = Float32(1.0)
                if cutlass.const_expr(self.out == "nvfp4"):
                    gs = cute.make_tensor(input_scales, cute.make_layout(num_segments))[seg]
                for h in cutlass.range(lane, span, WARP):
                    self._lane_item(x, out, scales, unit, row, h, live, blocks, cols, rk,
                                    intermediate, limit, alpha, gs, gates, recips)
        else:
            total = s_start[num_segments] * ATOM_ROWS * cols
            for item in cutlass.range(bidx * self.threads + tidx, total, stride):
                unit = item // cols
                kb = item - unit * cols
                block_row = unit // ATOM_ROWS
                seg = segment_of(s_start, num_segments, block_row)
                local = unit - s_start[seg] * ATOM_ROWS
                byte = Int32(0)
                if local < s_off[seg + 1] - s_off[seg] and kb < blocks:
                    gs = Float32(1.0)
                    if cutlass.const_expr(self.out == "nvfp4"):
                        gs = cute.make_tensor(input_scales,
                                              cute.make_layout(num_segments))[seg]
                    byte = self._row_vector(x, out, scales, s_off[seg] + local, kb,
                                            intermediate, Int32(0), limit, alpha, gs,
                                            Boolean(True), gates, recips)
                store_u8(scales.toint() + scale_offset(unit, kb, rk), byte)

    @cute.jit
    def _fp4_prefetching(self, x, input_scales, out, scales, num_segments, intermediate, limit,
                         alpha, tidx, bidx, stride, gates, recips, s_off, s_start, blocks, cols,
                         rk):
        """`rows_per_warp` with `prefetch`: the same walk (a warp per scale row, `lanes` lanes
        per block), each lane loading its next item's inputs (the next lane vector of the row, or
        the first one of the warp's next row) before it computes the current one, so every
        warp keeps a load in flight while it computes."""
        units = s_start[num_segments] * ATOM_ROWS
        warps = self.threads // WARP
        lane = tidx % WARP
        span = (cols * self.lanes + WARP - 1) // WARP * WARP
        wstride = stride // WARP
        unit = bidx * warps + tidx // WARP
        inputs = cute.make_rmem_tensor(cute.make_layout(self.vector), Int32)
        ahead = cute.make_rmem_tensor(cute.make_layout(self.vector), Int32)
        row, live, seg = self._unit(s_off, s_start, num_segments, unit, units)
        self._load_inputs(x, row, lane, live, blocks, intermediate, inputs)
        while unit < units:
            next_row, next_live, next_seg = self._unit(s_off, s_start, num_segments,
                                                       unit + wstride, units)
            gs = Float32(1.0)
            if cutlass.const_expr(self.out == "nvfp4"):
                gs = cute.make_tensor(input_scales, cute.make_layout(num_segments))[seg]
            for h in cutlass.range(lane, span, WARP):
                load_row = row
                load_h = h + WARP
                load_live = live
                if load_h >= span:
                    load_row = next_row
                    load_h = lane
                    load_live = next_live
                self._load_inputs(x, load_row, load_h, load_live, blocks, intermediate, ahead)
                self._lane_item(x, out, scales, unit, row, h, live, blocks, cols, rk,
                                intermediate, limit, alpha, gs, gates, recips, inputs)
                inputs.store(ahead.load())
            unit = unit + wstride
            row = next_row
            live = next_live
            seg = next_seg

    @cute.jit
    def _lane_item(self, x, out, scales, unit, row, h, live, blocks, cols, rk, intermediate,
                   limit, alpha, gs, gates, recips, words=None, rotation=None, code_at=None,
                   scale_at=None):
        """Lane vector h of scale row `unit` (row `row` of x; `live`: not padding): its codes,
        and its block's scale byte from the block's first lane (zero for padding rows and
        columns). `words`: its inputs already loaded (`rotation`: `_row_vector`'s); `code_at`,
        `scale_at`: where its codes and scale byte go, already known."""
        kb = h // self.lanes
        first = h % self.lanes == 0  # the block's first lane
        if cutlass.const_expr(self.fp4 and self.table):
            # The stream's h >= 0: a shift and a mask, not a signed division (its ALU pipe is the
            # one the compute saturates).
            kb = Int32(Uint32(h) // self.lanes)
            first = Uint32(h) % self.lanes == 0
        valid = live and kb < blocks
        byte = self._row_vector(x, out, scales, row, h, intermediate, Int32(0), limit, alpha, gs,
                                valid, gates, recips, words, rotation, code_at)
        if not valid:
            byte = Int32(0)
        if first and kb < cols:
            if cutlass.const_expr(scale_at is None):
                store_u8(scales.toint() + scale_offset(unit, kb, rk), byte)
            else:
                store_u8(scale_at, byte)

    @cute.jit
    def _unit(self, s_off, s_start, num_segments, unit, units):
        """(row of x, live, segment) of scale row `unit`: live unless it pads its segment's
        last 128-row block or lies past the last unit."""
        seg = segment_of(s_start, num_segments, unit // ATOM_ROWS)
        local = unit - s_start[seg] * ATOM_ROWS
        live = (local < s_off[seg + 1] - s_off[seg]) & (unit < units)
        return s_off[seg] + local, live, seg

    @cute.jit
    def _load_inputs(self, x: cute.Pointer, row, v, live, blocks, intermediate,
                     words: cute.Tensor):
        """`words` = the inputs of output vector v of `row` as bf16 pairs (gate pairs then up
        pairs; interleaved: the (gate, up) pairs in order), unless it is padding (not `live`,
        or past the last block), which loads nothing (`_row_vector` drops what it computes)."""
        n = self.vector
        if live and v // self.lanes < blocks:
            base = x.toint() + Int64(row) * Int64(4 * intermediate)
            if cutlass.const_expr(self.interleaved):
                cute.autovec_copy(cute.make_tensor(_ptr(Int32, base + Int64(v) * (4 * n), 16),
                                                   cute.make_layout(n)), words)
            else:
                half = n // 2
                gate = base + Int64(v) * (2 * n)
                cute.autovec_copy(cute.make_tensor(_ptr(Int32, gate, 16),
                                                   cute.make_layout(half)),
                                  cute.make_tensor(words.iterator, cute.make_layout(half)))
                cute.autovec_copy(cute.make_tensor(_ptr(Int32, gate + Int64(2 * intermediate),
                                                        16), cute.make_layout(half)),
                                  cute.make_tensor(words.iterator + half,
                                                   cute.make_layout(half)))

    @cute.jit
    def _activation(self, x: cute.Pointer, row, v, intermediate, limit, alpha, z: cute.Tensor,
                    gates, words=None, formula: cutlass.Constexpr = False):
        """z[i] = activation of output element v * VECTOR + i of `row`; `gates`: the gate
        table's lookup base (`table` kernels, unless `formula`); `words`: those inputs already
        loaded (`_load_inputs`)."""
        n = self.vector
        width = Int64(2 * intermediate)
        g = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        u = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        if cutlass.const_expr(words is not None):
            for k in cutlass.range_constexpr(n // 2):
                if cutlass.const_expr(self.interleaved):
                    g[2 * k] = low_bf16(words[2 * k])
                    u[2 * k] = high_bf16(words[2 * k])
                    g[2 * k + 1] = low_bf16(words[2 * k + 1])
                    u[2 * k + 1] = high_bf16(words[2 * k + 1])
                else:
                    g[2 * k] = low_bf16(words[k])
                    g[2 * k + 1] = high_bf16(words[k])
                    u[2 * k] = low_bf16(words[n // 2 + k])
                    u[2 * k + 1] = high_bf16(words[n // 2 + k])
        elif cutlass.const_expr(self.interleaved):
            src = cute.make_tensor(
                _ptr(BFloat16, x.toint() + (Int64(row) * width + Int64(v) * 2 * n) * 2, 16),
                cute.make_layout(2 * n))
            regs = cute.make_rmem_tensor(cute.make_layout(2 * n), BFloat16)
            cute.autovec_copy(src, regs)
            for i in cutlass.range_constexpr(n):
                g[i] = Float32(regs[2 * i])
                u[i] = Float32(regs[2 * i + 1])
        else:
            gate = cute.make_tensor(
                _ptr(BFloat16, x.toint() + (Int64(row) * width + Int64(v) * n) * 2, 16),
                cute.make_layout(n))
            up = cute.make_tensor(
                _ptr(BFloat16, x.toint() + (Int64(row) * width + Int64(intermediate)
                                            + Int64(v) * n) * 2, 16),
                cute.make_layout(n))
            g_regs = cute.make_rmem_tensor(cute.make_layout(n), BFloat16)
            u_regs = cute.make_rmem_tensor(cute.make_layout(n), BFloat16)
            cute.autovec_copy(gate, g_regs)
            cute.autovec_copy(up, u_regs)
            g.store(g_regs.load().to(Float32))
            u.store(u_regs.load().to(Float32))
        if cutlass.const_expr(self.split_gates and words is not None and not formula):
            s = cute.make_rmem_tensor(cute.make_layout(n), Float32)
            for k in cutlass.range_constexpr(n // 2):
                pair = words[k]  # gates 2k, 2k + 1
                if cutlass.const_expr(self.interleaved):
                    pair = low_halves(words[2 * k], words[2 * k + 1])
                key = gate_pair_key(pair)
                s[2 * k] = lookup_split(key, gates, False)
                s[2 * k + 1] = lookup_split(key, gates, True)
            for i in cutlass.range_constexpr(n):
                z[i] = self._combine(s[i], u[i], limit)
        elif cutlass.const_expr(self.table and not formula):
            s = cute.make_rmem_tensor(cute.make_layout(n), Float32)
            for i in cutlass.range_constexpr(n):
                if cutlass.const_expr(self.values):
                    s[i] = lookup_value(g[i], gates)
                else:
                    s[i] = lookup_gate(g[i], gates)
            if cutlass.const_expr(self.values or
                                  (self.activation == "swiglu_oai" and not self.fp4)):
                # Gates the table leaves to the formula come out NaN (so does a NaN gate). FP4
                # outputs check once per vector instead: such a z is NaN, and so is the amax
                # (`_row_vector`).
                missing = Boolean(False)
                for i in cutlass.range_constexpr(n):
                    missing = missing or s[i] != s[i]
                if missing:
                    self._untabled_gates(s, g, limit, alpha)
            for i in cutlass.range_constexpr(n):
                z[i] = self._combine(s[i], u[i], limit)
        else:
            for i in cutlass.range_constexpr(n):
                if cutlass.const_expr(self.activation == "silu"):
                    z[i] = self._combine(silu_gate(g[i]), u[i], limit)
                else:
                    z[i] = self._combine(oai_gate(g[i], limit, alpha), u[i], limit)

    @cute.jit
    def _untabled_gates(self, s: cute.Tensor, g: cute.Tensor, limit: Float32, alpha: Float32):
        """s[i] for the gates a table leaves to the formula (s[i] NaN). Zero gates
        first: each is its own activation (both formulas give it, sign included: g / 2 and
        g' * (1 / 2)), a select each; then the formula, a branch each that only the gates
        really outside the table take (in one pass the compiler computes the formula for every
        NaN entry and selects, which ran inputs of zero gates twice as slow)."""
        for i in cutlass.range_constexpr(cute.size(s)):
            if (s[i] != s[i]) & (g[i] == Float32(0.0)):
                s[i] = g[i]
        for i in cutlass.range_constexpr(cute.size(s)):
            if s[i] != s[i]:
                if cutlass.const_expr(self.activation == "silu"):
                    s[i] = silu_gate(g[i])
                else:
                    s[i] = oai_gate(g[i], limit, alpha)

    @cute.jit
    def _combine(self, s: Float32, u: Float32, limit: Float32) -> Float32:
        """z from the gate's activation `s` and the up value: `s * u` (silu),
        `(u' + 1) * s` with `u' = clamp(u, -limit, limit)` (swiglu_oai)."""
        z = Float32(0.0)
        if cutlass.const_expr(self.activation == "silu"):
            z = s * u
        else:
            # u > L ? L : (u < -L ? -L : u) for L > 0 (the caller checks): a NaN u stays NaN in
            # both NaN-propagating clamps, and a zero's sign is lost only in u' + 1.
            ui = cute.arch.fmax(cute.arch.fmin(u, limit, nan=True), -limit, nan=True)
            z = (ui + Float32(1.0)) * s
        return z

    @cute.jit
    def _row_vector(self, x, out, scales, row, v, intermediate, scale_stride, limit, alpha, gs,
                    valid, gates, recips, words=None, rotation=None, code_at=None):
        """Activate and store output vector v of `row`; FP4: return its scale byte. `recips`:
        NVFP4's scale table (`fill_scale_table`: r_hi, r_lo, sf per e4m3 code; `table`
        kernels). `rotation` (FP4, 16 elements): `words` hold the elements rotated by
        `rotation / 4` places (`_stream_words`), so the 64 code bits are rotated left by
        `rotation` bits before they are stored. `code_at` (FP4): the codes' address, if known."""
        n = self.vector
        z = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        if cutlass.const_expr(words is not None and self.activation == "silu"):
            # Inputs in registers (a stream's shared-memory stage, or loaded ahead): an invalid
            # lane (padding, or past its row's last vector) activates stale words, and its codes
            # and scale byte are dropped. Zeros for it would cost a move per element on every
            # vector (the compiler sets them before the branch). swiglu_oai keeps them: without,
            # its formula fallback runs out of registers.
            self._activation(x, row, v, intermediate, limit, alpha, z, gates, words)
        else:
            z.fill(0.0)
            if valid:
                self._activation(x, row, v, intermediate, limit, alpha, z, gates, words)
        byte = Int32(0)
        if cutlass.const_expr(self.out == "fp32"):
            cute.autovec_copy(z, cute.make_tensor(
                _ptr(Float32, out.toint() + (Int64(row) * Int64(intermediate) + Int64(v) * n) * 4,
                     16), cute.make_layout(n)))
        elif cutlass.const_expr(self.out == "bf16"):
            dst = cute.make_tensor(
                _ptr(BFloat16, out.toint() + (Int64(row) * Int64(intermediate) + Int64(v) * n) * 2,
                     16), cute.make_layout(n))
            vals = cute.make_rmem_tensor(cute.make_layout(n), BFloat16)
            vals.store(z.load().to(BFloat16))
            cute.autovec_copy(vals, dst)
        elif cutlass.const_expr(self.out == "fp8"):
            scale = scale_fp8_block(z, n, BLOCK["fp8"] // n)  # 8 lanes share a block
            if valid:
                q = cute.make_rmem_tensor(cute.make_layout(n), Float8E4M3FN)
                q.store(z.load().to(Float8E4M3FN))
                dst = cute.make_tensor(
                    _ptr(Float8E4M3FN, out.toint() + Int64(row) * Int64(intermediate)
                         + Int64(v) * n, 16), cute.make_layout(n))
                cute.autovec_copy(q, dst)
                if v % 8 == 0:
                    at = Int64(v // 8) * Int64(scale_stride) + Int64(row)
                    cute.make_tensor(_ptr(Float32, scales.toint() + at * 4, 4),
                                     cute.make_layout(1))[0] = scale
        else:
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(n):
                amax = cute.arch.fmax(amax, cute.arch.fmax(z[i], -z[i], nan=True), nan=True)
            if cutlass.const_expr(self.table and self.activation == "swiglu_oai"):
                # A NaN z comes from a NaN input or from a gate the table leaves to the formula
                # (`kernels.gate_table`): then this vector again by the formula, whose values
                # are the table's bit for bit wherever the table has them.
                if amax != amax and valid:
                    self._activation(x, row, v, intermediate, limit, alpha, z, gates, words,
                                     formula=True)
                    amax = Float32(0.0)
                    for i in cutlass.range_constexpr(n):
                        amax = cute.arch.fmax(amax, cute.arch.fmax(z[i], -z[i], nan=True),
                                              nan=True)
            if cutlass.const_expr(self.rows_per_warp and self.lanes == 2):
                # This lane holds half of a scale block; the pair's amax is the block's (an
                # invalid lane's pair lane is invalid too).
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1),
                                      nan=True)
            sf = Float32(0.0)
            usable = Boolean(False)
            r = Float32(0.0)
            r_lo = Float32(0.0)
            bounded = None  # a runtime flag where the codes may skip their saturation
            if cutlass.const_expr(self.out == "nvfp4"):
                byte, _, _ = nvfp4_scale_byte(gs, amax)
                if cutlass.const_expr(self.table):
                    # Codes 1..126 are the positive finite scales; the table holds codes 0..127
                    # (a negative global scale gives codes from 0x80 up: no table entry).
                    if (byte > 0) & (byte < 0x7F):
                        r = recips[0, byte]
                        r_lo = recips[1, byte]
                        sf = recips[2, byte]
                else:
                    sf = e4m3_byte_to_f32(byte)
                usable = sf > 0.0
            else:
                # z / 2^e == z * 2^-e bit for bit (both round the exact product once, and 2^-e
                # is representable for every e in [-127, 127]): multiply only.
                byte = e8m0_round_up(amax / Float32(6.0))
                usable = byte != 0xFF and amax > 0.0
                sf = Float32(1.0)
                if usable:
                    gs = e8m0_value(254 - byte)
                if cutlass.const_expr(self.activation == "swiglu_oai"):
                    # 2^e >= RN(amax / 6), so every |z| * 2^-e <= 6 (1 + 2^-24) < 7 when amax
                    # is finite (an infinite one gets the largest scale and saturates): one min
                    # less per element. SwiGLU-OAI's elements cost three operations more than
                    # silu's, and there it pays (2% at I = 2048 and 7168 on an H200); in the
                    # other FP4 kernels the second copy of the encoder cost as much as it saved.
                    bounded = amax < Float32(float("inf"))
            words = cute.make_rmem_tensor(cute.make_layout(n // 8), Int32)
            e2m1_words(z, gs, sf, amax, usable, words, self.e2m1,
                       divide=self.out == "nvfp4", r=r, given_r=self.table, r_lo=r_lo,
                       bounded=bounded)
            if cutlass.const_expr(rotation is not None):
                words[0], words[1] = rotate_left64(words[0], words[1], rotation)
            if valid:
                at = code_at
                if cutlass.const_expr(code_at is None):
                    at = self._code_address(out, row, v, intermediate)
                cute.autovec_copy(words, cute.make_tensor(_ptr(Int32, at, 4 * (n // 8)),
                                                          cute.make_layout(n // 8)))
        return byte


def silu_kernels() -> list:
    """Every configuration the library ships: both input layouts of each output; FP4 outputs
    once per e2m1 encoder (software on sm_90a, hardware on sm_100a); the clamped SwiGLU-OAI
    activation for MXFP4; the quantized outputs also with the gate table (`TABLE_THREADS`
    threads, a CTA per SM; FP4 with a warp per scale row), for large inputs; the fp32
    activation itself (`z` unrounded, either activation, by the formula, the pair table or the
    value table), which the tests use to check both tables against the formula for every bf16
    gate. FP8 uses the value table (`kernels.gate_table`), FP4 the pairs (SwiGLU-OAI the split
    values)."""
    kernels = [FusedSilu("fp32", False, activation, threads=TABLE_THREADS if table else 256,
                         table=table, values=values)
               for activation in ("silu", "swiglu_oai")
               for table, values in ((False, False), (True, False), (True, True))]
    for interleaved in (False, True):
        kernels += [FusedSilu("bf16", interleaved), FusedSilu("fp8", interleaved),
                    FusedSilu("fp8", interleaved, table=True, threads=TABLE_THREADS,
                              values=True)]
        for e2m1 in ("software", "hardware"):
            for rows_per_warp, table in ((False, False), (True, False), (True, True)):
                threads = TABLE_THREADS if table else 256
                kernels.append(FusedSilu("nvfp4", interleaved, e2m1=e2m1, threads=threads,
                                         rows_per_warp=rows_per_warp, table=table))
                for activation in ("silu", "swiglu_oai"):
                    kernels.append(FusedSilu("mxfp4", interleaved, activation, e2m1=e2m1,
                                             threads=threads, rows_per_warp=rows_per_warp,
                                             table=table))
    return kernels
