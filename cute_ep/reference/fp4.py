"""NVFP4 and MXFP4 quantization in plain torch: the definitions the kernels are tested against.

Written from SPEC section 4, independently of the kernels (which encode e2m1 with threshold
comparisons; this module searches the nearest representable value and breaks ties to even):

- e2m1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, round to nearest, ties to the even code,
  saturating at 6 (`satfinite`); the sign bit is the input's (so -0.0 encodes as 0x8).
  NaN encodes as a signed zero magnitude.
- A block holding a NaN gets the NaN scale 0x7F and zero codes (it reads back as NaN); an
  infinity saturates its scale to 448 and its own code to +-6.
- Per 16 elements: `sf = e4m3_rne_satfinite(gs * amax / 6)`, `q = e2m1(x * gs / f32(sf))`,
  codes 0 where sf is 0. Element 2i goes to the low nibble of byte i.
- Scales either linear `[M, K / 16]` or in the 128x4 layout of `layouts.scales`, each segment
  (expert) starting on a fresh 128-row block; padding bytes zero.

MXFP4: per 32 elements an e8m0 scale `2^e`, e the smallest integer with `2^e >= fp32(amax / 6)`
(round-up), clamped to [-127, 127] (codes 0..254; an infinite amax gives 254, a NaN block 255);
`q = e2m1(x / 2^e)`, codes 0 where amax is 0 or NaN.

Every fp32 operation is the one the kernels perform, in the same order, with divisions by tensors
(torch on CUDA turns a division by a Python number into a multiplication by its reciprocal).
"""

from __future__ import annotations

import torch

from layouts.scales import ATOM_ROWS, scale_layout

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
E4M3_MAX = 448.0


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit codes (uint8 0..15): nearest magnitude, ties to even, saturating."""
    v = v.float()
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    a = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=6.0)
    dist = (a.unsqueeze(-1) - mags).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best  # one or two (a tie) codes
    codes = torch.arange(8, device=v.device)
    # Among the nearest, prefer an even code, then the smaller one.
    rank = torch.where(candidates, (codes % 2) * 8 + codes, torch.full_like(codes, 99))
    code = rank.argmin(dim=-1).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    value = mags[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def quantize_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, taken as fp32), gs fp32 [M] per-row global scale ->
    (codes uint8 [M, K / 2], scales as e4m3 bytes uint8 [M, K / 16], linear)."""
    m, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"K={k} must be a multiple of {NVFP4_BLOCK}")
    blocks = x.float().reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    g = gs.float().reshape(m, 1)
    amax = blocks.abs().amax(dim=-1)
    sf = (g * amax) / torch.full_like(amax, 6.0)
    sf8 = sf.clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)  # satfinite, either sign
    sf32 = sf8.float().unsqueeze(-1)
    scaled = (blocks * g.unsqueeze(-1)) / torch.where(sf32 > 0, sf32, torch.ones_like(sf32))
    codes = torch.where(sf32 > 0, e2m1_encode(scaled), torch.zeros_like(scaled, dtype=torch.uint8))
    return pack_nibbles(codes.reshape(m, k)), sf8.view(torch.uint8)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_nvfp4` (linear scales) up to the rounding: fp32 [M, K]."""
    m, k = codes.shape[0], codes.shape[1] * 2
    values = e2m1_decode(unpack_nibbles(codes)).reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sf = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    return (values * sf / gs.float().reshape(m, 1, 1)).reshape(m, k)


MXFP4_BLOCK = 32


def e8m0_round_up(q: torch.Tensor) -> torch.Tensor:
    """e8m0 code (uint8) of the smallest power of two >= q (q >= 0 fp32), clamped to
    [2^-127, 2^127]; NaN -> 255. From `frexp` (q = m 2^e, m in [0.5, 1)), not from q's bits."""
    m, e = torch.frexp(q.float())
    up = torch.where(m == 0.5, e - 1, e)  # q = 2^(e-1) exactly, else 2^e is the next power
    code = torch.clamp(up.to(torch.int32) + 127, 0, 254)
    code = torch.where(q == 0, torch.zeros_like(code), code)
    code = torch.where(torch.isinf(q), torch.full_like(code, 254), code)
    code = torch.where(torch.isnan(q), torch.full_like(code, 255), code)
    return code.to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.float64)
    value = torch.exp2(c - 127).float()
    return torch.where(codes == 255, torch.full_like(value, float("nan")), value)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (taken as fp32) -> (codes uint8 [M, K / 2], e8m0 scales uint8 [M, K / 32])."""
    m, k = x.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"K={k} must be a multiple of {MXFP4_BLOCK}")
    blocks = x.float().reshape(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN if the block holds one
    scale_codes = e8m0_round_up(amax / torch.full_like(amax, 6.0))
    scale = e8m0_decode(scale_codes).unsqueeze(-1)
    usable = ((amax > 0) & (scale_codes != 255)).unsqueeze(-1)
    scaled = blocks / torch.where(usable, scale, torch.ones_like(scale))
    codes = torch.where(usable, e2m1_encode(scaled), torch.zeros_like(scaled, dtype=torch.uint8))
    return pack_nibbles(codes.reshape(m, k)), scale_codes


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    m, k = codes.shape[0], codes.shape[1] * 2
    values = e2m1_decode(unpack_nibbles(codes)).reshape(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    return (values * e8m0_decode(scales).unsqueeze(-1)).reshape(m, k)


def scale_block_bytes(k: int, block: int) -> int:
    """Bytes of one 128-row block of a 128x4 scale buffer for rows of K elements, one scale per
    `block` elements: every 4 scale columns fill a 512-byte atom."""
    return 512 * -(-(k // block) // 4)


def segment_scale_blocks(row_offsets: list[int]) -> list[int]:
    """First 128-row scale block of each segment: every segment starts a fresh block."""
    first, block = [], 0
    for g in range(len(row_offsets) - 1):
        first.append(block)
        block += -(-(row_offsets[g + 1] - row_offsets[g]) // ATOM_ROWS)
    return first + [block]


def quantize_nvfp4_segments(x: torch.Tensor, row_offsets: list[int], gs: torch.Tensor,
                            scale_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped in segments (experts) with one global scale each (`gs[g]`): codes
    [M, K / 2] for the valid rows and the 128x4 scale buffer for `scale_rows` rows (each
    segment on a fresh 128-row block, padding zero)."""
    nseg = len(row_offsets) - 1
    counts = torch.tensor([row_offsets[g + 1] - row_offsets[g] for g in range(nseg)])
    per_row = torch.repeat_interleave(gs.float().cpu(), counts).to(x.device)
    codes, linear = quantize_nvfp4(x[:row_offsets[-1]], per_row)
    return codes, place_segment_scales(linear, row_offsets, scale_rows, x.shape[1], NVFP4_BLOCK)


def quantize_mxfp4_segments(x: torch.Tensor, row_offsets: list[int],
                            scale_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes of the valid rows and their e8m0 scales in the 128x4 layout, each segment on
    a fresh 128-row block, padding zero."""
    codes, linear = quantize_mxfp4(x[:row_offsets[-1]])
    return codes, place_segment_scales(linear, row_offsets, scale_rows, x.shape[1], MXFP4_BLOCK)


def place_segment_scales(linear: torch.Tensor, row_offsets: list[int], scale_rows: int, k: int,
                         block: int) -> torch.Tensor:
    """Linear per-row scale bytes [rows, K / block] -> the zero-padded 128x4 buffer for
    `scale_rows` rows in which segment g's rows start at scale row `first_block[g] * 128`."""
    out = torch.zeros(scale_layout(scale_rows, k, block).cosize(), dtype=torch.uint8,
                      device=linear.device)
    nseg = len(row_offsets) - 1
    first = segment_scale_blocks(row_offsets)
    if row_offsets[-1]:
        rows = torch.cat([first[g] * ATOM_ROWS + torch.arange(row_offsets[g + 1] - row_offsets[g])
                          for g in range(nseg)]).long()
        index = _scale_offsets(rows, torch.arange(k // block), k, block)
        out[index.to(linear.device).flatten()] = linear.flatten()
    return out


def _scale_offsets(rows: torch.Tensor, kb: torch.Tensor, k: int,
                   block: int = NVFP4_BLOCK) -> torch.Tensor:
    """SPEC section 4's closed form of the 128x4 layout: [rows, K/block] byte offsets."""
    rk = -(-(k // block) // 4)
    r = rows.unsqueeze(1)
    c = kb.unsqueeze(0)
    return ((r // 128) * rk * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4
            + (c % 4))
