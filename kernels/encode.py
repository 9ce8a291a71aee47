"""The message of a token in the quantized formats, built by the dispatch kernel itself.

`ep_dispatch` (`kernels.dispatch`), given bf16 tokens for an FP8 or NVFP4 layer, has each channel
quantize its own tokens into the local send buffer right after it has sent its counts (while the
counts of the other ranks travel), with every warp of its CTA, ENCODE_THREADS threads a token:
FP8 blockwise with an fp32 scale per 128 elements (exact, or rounded up to a power of two), or
NVFP4 with an e4m3 scale per 16 under the rank's global scale (read on the device). The senders
then stream those messages as they stream a caller's pre-quantized rows. The dispatch keeps its SM
budget: no kernel of its own quantizes. The NVFP4 encoder exists twice, like `quantize_nvfp4`:
software e2m1 for sm_90a, the hardware conversion for sm_100a.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int64

from kernels.copy import row_predicate
from kernels.fp8 import FP8_BLOCK, scale_fp8_block
from kernels.memory import gmem_ptr, store_u8
from kernels.nvfp4 import quantize_nvfp4_block

WARP = 32
E2M1_ARCHES = {"software": ("sm_90a",), "hardware": ("sm_100a",)}
BF16_PER_VECTOR = 8  # bf16 elements in one 128-bit access
NVFP4_BLOCK = 16  # elements per e4m3 scale
ENCODE_THREADS = 128  # threads that quantize one token together


@cute.jit
def encode_fp8_token(tidx, src_addr, dst_addr, scales_addr, hidden, pow2: cutlass.Constexpr,
                     bf16_copy: cute.TiledCopy, fp8_copy: cute.TiledCopy):
    """Thread `tidx` of ENCODE_THREADS: the token at `src_addr` (bf16) to e4m3 codes at
    `dst_addr` and fp32 scales at `scales_addr`. Rows of 8 elements, one per thread; a
    128-element block is 16 consecutive lanes. The math of `kernels.fp8.scale_fp8_block`."""
    rows = hidden // BF16_PER_VECTOR
    layout = cute.make_layout((rows, BF16_PER_VECTOR), stride=(BF16_PER_VECTOR, 1))
    tiler = (ENCODE_THREADS, BF16_PER_VECTOR)
    g_x = cute.zipped_divide(cute.make_tensor(gmem_ptr(BFloat16, src_addr, 16), layout), tiler)
    g_q = cute.zipped_divide(cute.make_tensor(gmem_ptr(Float8E4M3FN, dst_addr, 8), layout),
                             tiler)
    g_c = cute.zipped_divide(cute.make_identity_tensor(layout.shape), tiler)
    scales = cute.make_tensor(gmem_ptr(Float32, scales_addr, 16),
                              cute.make_layout(hidden // FP8_BLOCK))
    thr_in = bf16_copy.get_slice(tidx)
    thr_out = fp8_copy.get_slice(tidx)
    lane = tidx % WARP
    vectors_per_block = FP8_BLOCK // BF16_PER_VECTOR
    for tile in cutlass.range(cute.ceil_div(rows, ENCODE_THREADS)):
        t_x = thr_in.partition_S(g_x[((None, None), tile)])
        t_q = thr_out.partition_D(g_q[((None, None), tile)])
        pred = row_predicate(thr_in.partition_S(g_c[((None, None), tile)]), rows)
        regs = cute.make_fragment_like(t_x)
        regs.fill(0.0)
        cute.copy(bf16_copy, t_x, regs, pred=pred)
        vals = cute.make_fragment_like(regs, Float32)
        vals.store(regs.load().to(Float32))
        scale = scale_fp8_block(vals, BF16_PER_VECTOR, vectors_per_block, pow2)
        q = cute.make_fragment_like(t_q)
        q.store(vals.load().to(Float8E4M3FN))
        cute.copy(fp8_copy, q, t_q, pred=pred)
        vec = tile * ENCODE_THREADS + tidx
        if lane % vectors_per_block == 0 and vec < rows:
            scales[vec // vectors_per_block] = scale


@cute.jit
def encode_nvfp4_token(tidx, src_addr, codes_addr, scales_addr, hidden, gs,
                       e2m1: cutlass.Constexpr, table: cute.Tensor):
    """Thread `tidx` of ENCODE_THREADS: the token at `src_addr` (bf16) to e2m1 codes at
    `codes_addr` (8 bytes a 16-element block) and e4m3 scale bytes at `scales_addr`, a block at
    a time: the block quantizer `quantize_nvfp4` uses, under the global scale `gs`."""
    for kb in cutlass.range(tidx, hidden // NVFP4_BLOCK, ENCODE_THREADS):
        byte = quantize_nvfp4_block(src_addr + Int64(kb) * NVFP4_BLOCK * 2,
                                    codes_addr + Int64(kb) * 8, gs, e2m1, table)
        store_u8(scales_addr + Int64(kb), byte)
