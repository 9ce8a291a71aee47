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

For the FP4 outputs each segment starts on a fresh 128-row scale block and the grid walks *scale
rows* x padded scale columns, writing zero scale bytes for padding in the same pass. Codes are
0 for a block whose scale is not a positive number (all-zero, underflowed or NaN blocks).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, Uint8

from kernels.fp8 import scale_fp8_block
from kernels.nvfp4 import (bits_f32, cvt_e4m3_byte, e2m1_words, e4m3_byte_to_f32, f32_bits,
                           load_segment_blocks)
from kernels.memory import scale_offset
from kernels.scan import WARP
from layouts.abi import GridRule, KernelSpec, Param

FAMILIES = {"bf16": "fused_silu", "fp8": "fused_silu_fp8", "nvfp4": "fused_silu_nvfp4",
            "mxfp4": "fused_silu_mxfp4"}
# Output elements per thread, and elements per scale.
VECTOR = {"bf16": 8, "fp8": 16, "nvfp4": 16, "mxfp4": 32}
# FP4 with a warp per scale row (`rows_per_warp`): a lane pair per scale block.
PAIR_VECTOR = {"nvfp4": 8, "mxfp4": 16}
FP4_LANES = 2
BLOCK = {"bf16": 1, "fp8": 128, "nvfp4": 16, "mxfp4": 32}
ATOM_ROWS = 128
MAX_SEGMENTS = 272
SEARCH_STEPS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # covers MAX_SEGMENTS
SMEM_ENTRIES = 544  # a probe at pos + 256 stays inside


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


@cute.jit
def _segment_of(s_start: cute.Tensor, num_segments, block_row) -> Int32:
    """The segment owning a 128-row scale block: the last one whose first block is <= it (an
    empty segment shares its start with the next one), by binary search."""
    seg = Int32(0)
    for step in cutlass.range_constexpr(len(SEARCH_STEPS)):
        probe = seg + SEARCH_STEPS[step]
        if probe < num_segments:
            if s_start[probe] <= block_row:
                seg = probe
    return seg


class FusedSilu:
    def __init__(self, out: str, interleaved: bool, activation: str = "silu",
                 e2m1: str | None = None, threads: int = 256, rows_per_warp: bool = False):
        """`rows_per_warp` (FP4 only): a warp per scale row and a lane pair per scale block,
        for inputs of at least as many scale rows as the grid has warps; otherwise a thread per
        scale block."""
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
        self.rows_per_warp = bool(rows_per_warp)
        self.vector = PAIR_VECTOR[out] if rows_per_warp else VECTOR[out]
        self.fp4 = fp4
        if fp4:
            self.arches = ("sm_100a",) if e2m1 == "hardware" else ("sm_90a",)

    def spec(self) -> KernelSpec:
        config = {"interleaved": self.interleaved, "activation": self.activation,
                  "threads": self.threads}
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
            Param("out", "ptr", "uint8", align=16, writes=True),
            Param("scales", "ptr", "uint8", align=4, writes=True),
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
                   "max_segments": MAX_SEGMENTS - 1})

    @property
    def smem_bytes(self) -> int:
        return 2 * SMEM_ENTRIES * 4 + 64 if self.fp4 else 0

    @cute.jit
    def __call__(self, x: cute.Pointer, row_offsets: cute.Pointer, input_scales: cute.Pointer,
                 activation_params: cute.Pointer, out: cute.Pointer, scales: cute.Pointer,
                 num_segments: Int32, intermediate: Int32, scale_stride: Int32, grid_ctas: Int32,
                 stream):
        self.kernel(x, row_offsets, input_scales, activation_params, out, scales, num_segments,
                    intermediate, scale_stride, grid_ctas).launch(
            grid=(grid_ctas, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, row_offsets: cute.Pointer, input_scales: cute.Pointer,
               activation_params: cute.Pointer, out: cute.Pointer, scales: cute.Pointer,
               num_segments: Int32, intermediate: Int32, scale_stride: Int32, grid_ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        limit = Float32(0.0)
        alpha = Float32(0.0)
        if cutlass.const_expr(self.activation == "swiglu_oai"):
            act = cute.make_tensor(activation_params, cute.make_layout(2))
            limit = act[0]
            alpha = act[1]
        vecs = intermediate // self.vector
        stride = grid_ctas * self.threads
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
                                     alpha, Float32(1.0), Boolean(True))
                elif cutlass.const_expr(self.out == "fp8"):
                    self._row_vector(x, out, scales, Int32(0), Int32(0), intermediate,
                                     scale_stride, limit, alpha, Float32(1.0), Boolean(False))
        else:
            self._fp4(x, row_offsets, input_scales, out, scales, num_segments, intermediate,
                      limit, alpha, tidx, bidx, stride)

    @cute.jit
    def _fp4(self, x, row_offsets, input_scales, out, scales, num_segments, intermediate, limit,
             alpha, tidx, bidx, stride):
        """The grid walks scale rows (units) x padded scale columns: a thread per scale block
        (item), or with `rows_per_warp` a warp per scale row (its segment found once) and a
        lane pair per block (the pair's amax by one shuffle); the block's first lane writes its
        scale byte, zero for padding rows and columns."""
        smem = cutlass.memory.SmemAllocator()
        s_off = smem.allocate_tensor(Int32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        s_start = smem.allocate_tensor(Int32, cute.make_layout(SMEM_ENTRIES), byte_alignment=16)
        load_segment_blocks(row_offsets, num_segments, s_off, s_start, tidx, self.threads)

        blocks = intermediate // BLOCK[self.out]
        cols = (blocks + 3) // 4 * 4
        rk = cols // 4
        if cutlass.const_expr(self.rows_per_warp):
            units = s_start[num_segments] * ATOM_ROWS
            warps = self.threads // WARP
            lane = tidx % WARP
            # Lanes of a row, rounded up to whole warps so every lane reaches each shuffle.
            span = (cols * FP4_LANES + WARP - 1) // WARP * WARP
            for unit in cutlass.range(bidx * warps + tidx // WARP, units, stride // WARP):
                block_row = unit // ATOM_ROWS
                seg = _segment_of(s_start, num_segments, block_row)
                local = unit - s_start[seg] * ATOM_ROWS
                live = local < s_off[seg + 1] - s_off[seg]
                gs = Float32(1.0)
                if cutlass.const_expr(self.out == "nvfp4"):
                    gs = cute.make_tensor(input_scales, cute.make_layout(num_segments))[seg]
                row = s_off[seg] + local
                for h in cutlass.range(lane, span, WARP):
                    kb = h // FP4_LANES
                    valid = live and kb < blocks
                    byte = self._row_vector(x, out, scales, row, h, intermediate, Int32(0),
                                            limit, alpha, gs, valid)
                    if not valid:
                        byte = Int32(0)  # padding rows and columns
                    if h % FP4_LANES == 0 and kb < cols:
                        at = scale_offset(unit, kb, rk)
                        cute.make_tensor(_ptr(Uint8, scales.toint() + at, 1),
                                         cute.make_layout(1))[0] = Uint8(byte)
        else:
            total = s_start[num_segments] * ATOM_ROWS * cols
            for item in cutlass.range(bidx * self.threads + tidx, total, stride):
                unit = item // cols
                kb = item - unit * cols
                block_row = unit // ATOM_ROWS
                seg = _segment_of(s_start, num_segments, block_row)
                local = unit - s_start[seg] * ATOM_ROWS
                byte = Int32(0)
                if local < s_off[seg + 1] - s_off[seg] and kb < blocks:
                    gs = Float32(1.0)
                    if cutlass.const_expr(self.out == "nvfp4"):
                        gs = cute.make_tensor(input_scales,
                                              cute.make_layout(num_segments))[seg]
                    byte = self._row_vector(x, out, scales, s_off[seg] + local, kb,
                                            intermediate, Int32(0), limit, alpha, gs,
                                            Boolean(True))
                at = scale_offset(unit, kb, rk)
                cute.make_tensor(_ptr(Uint8, scales.toint() + at, 1),
                                 cute.make_layout(1))[0] = Uint8(byte)

    @cute.jit
    def _activation(self, x: cute.Pointer, row, v, intermediate, limit, alpha, z: cute.Tensor):
        """z[i] = activation of output element v * VECTOR + i of `row`."""
        n = self.vector
        width = Int64(2 * intermediate)
        g = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        u = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        if cutlass.const_expr(self.interleaved):
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
        for i in cutlass.range_constexpr(n):
            if cutlass.const_expr(self.activation == "silu"):
                z[i] = (g[i] / (Float32(1.0) + cute.math.exp(-g[i]))) * u[i]
            else:
                gi = g[i]
                if gi > limit:
                    gi = limit
                ui = u[i]
                if ui > limit:
                    ui = limit
                if ui < -limit:
                    ui = -limit
                sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-(alpha * gi)))
                z[i] = (ui + Float32(1.0)) * (gi * sig)

    @cute.jit
    def _row_vector(self, x, out, scales, row, v, intermediate, scale_stride, limit, alpha, gs,
                    valid):
        """Activate and store output vector v of `row`; FP4: return its scale byte."""
        n = self.vector
        z = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        z.fill(0.0)
        if valid:
            self._activation(x, row, v, intermediate, limit, alpha, z)
        byte = Int32(0)
        if cutlass.const_expr(self.out == "bf16"):
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
            if cutlass.const_expr(self.rows_per_warp):
                # This lane holds half of a scale block; the pair's amax is the block's (an
                # invalid lane holds zeros, and its pair lane is invalid too).
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1),
                                      nan=True)
            sf = Float32(0.0)
            usable = Boolean(False)
            if cutlass.const_expr(self.out == "nvfp4"):
                byte = cvt_e4m3_byte((gs * amax) / Float32(6.0))
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
            words = cute.make_rmem_tensor(cute.make_layout(n // 8), Int32)
            e2m1_words(z, gs, sf, amax, usable, words, self.e2m1,
                       divide=self.out == "nvfp4")
            if valid:
                dst = cute.make_tensor(
                    _ptr(Int32, out.toint() + Int64(row) * Int64(intermediate // 2)
                         + Int64(v) * (n // 2), 4 * (n // 8)), cute.make_layout(n // 8))
                cute.autovec_copy(words, dst)
        return byte


def silu_kernels() -> list:
    """Every configuration the library ships: both input layouts of each output; FP4 outputs
    once per e2m1 encoder (software on sm_90a, hardware on sm_100a); the clamped SwiGLU-OAI
    activation for MXFP4."""
    kernels = []
    for interleaved in (False, True):
        kernels += [FusedSilu("bf16", interleaved), FusedSilu("fp8", interleaved)]
        for e2m1 in ("software", "hardware"):
            for rows_per_warp in (False, True):
                kernels.append(FusedSilu("nvfp4", interleaved, e2m1=e2m1,
                                         rows_per_warp=rows_per_warp))
                for activation in ("silu", "swiglu_oai"):
                    kernels.append(FusedSilu("mxfp4", interleaved, activation, e2m1=e2m1,
                                             rows_per_warp=rows_per_warp))
    return kernels
