"""Dispatch and combine in plain torch, for R ranks emulated in one process.

The specification the kernels are tested against, written independently of them: no kernel,
no peer memory, just the definitions. Rank r holds `x[r]: [T_r, H]` bf16 and
`topk_ids[r]: [T_r, K]`; `EPConfig` (from `layouts`) gives E, R, the token format and the
output buffer sizes.

Dispatch output on each rank (SPEC section 3):
- rows grouped by segment (local expert, or the shared expert first when fused), inside a segment
  by source rank, inside (segment, source) by source token index;
- `row_offsets[g]` the first row of segment g (FP8 aligns segments to 4 rows; the "slabs"
  layout puts segment g at g * R * max_tokens_per_rank), `expert_ids`,
  `src_info[row] = (source token, k slot)` (k = -1 for shared-expert rows, -1/-1 for padding),
  `counts[g]` the rows of segment g;
- FP8 blockwise: per token and 128-element block, `s = max(amax, 1e-4) / 448` and
  `q = e4m3(clamp(x / s, -448, 448))` in fp32 (a true division, so kernels can match bit for bit),
  scales transposed to `[H / 128, rows]`. Padding rows are zero in tokens and scales.
- NVFP4: each source rank's tokens quantized by `reference.fp4.quantize_nvfp4` under that rank's
  global scale; rows as for bf16 (no padding), codes `[rows, H / 2]`; each row's H / 16 scale
  bytes in the 128x4 layout (`layouts.scales`) where segment g starts on a fresh 128-row block,
  `first_block[g]`, and `scales_offsets[g] = first_block[g] - row_offsets[g] // 128`; every other
  byte of the scale buffer zero.

Combine on each rank: `out[t] = sum_k w[t, k] * y[t, k]` in fp32, then bf16 (plus the shared
expert's row, unweighted), or the unreduced `[T, K, H]` when no weights are given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cute_ep.reference.fp4 import NVFP4_BLOCK, _scale_offsets, quantize_nvfp4, scale_block_bytes
from layouts import EPConfig
from layouts.buffers import output_scales
from layouts.scales import ATOM_ROWS, expert_scale_blocks

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
FP8_BLOCK = 128
SHARED_K = -1  # k slot recorded for shared-expert rows
PAD = -1  # src_info of padding rows


@dataclass
class DispatchResult:
    """One rank's dispatch output."""

    tokens: torch.Tensor  # [row_capacity, H] bf16, float8_e4m3fn for fp8, uint8 [.., H/2] nvfp4
    # fp8: [H / 128, row_capacity] float32; nvfp4: uint8 e4m3 bytes, the 128x4 buffer of
    # `layouts.buffers.output_scales`
    scales: torch.Tensor | None
    row_offsets: torch.Tensor  # int64 [segments + 1]
    expert_ids: torch.Tensor  # int32 [segments]
    src_info: torch.Tensor  # int32 [row_capacity, 2]
    counts: torch.Tensor  # int32 [segments]
    source_rank: torch.Tensor  # int32 [row_capacity]: which rank each row came from (PAD: none)
    scales_offsets: torch.Tensor | None = None  # nvfp4: int32 [segments]

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets[-1])


def quantize_fp8_blockwise(x: torch.Tensor,
                           pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (e4m3 [T, H], fp32 scales [T, H / 128]) per SPEC section 4. `pow2`
    (`EPConfig.fp8_scales="pow2"`): each scale is 2^ceil(log2(max(amax, 1e-4) * RN(1/448))),
    the codes x times its exact reciprocal."""
    t, h = x.shape
    blocks = x.float().reshape(t, h // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    if pow2:
        raw = torch.clamp(amax, min=FP8_MIN_AMAX) * torch.full_like(amax, 1.0 / FP8_MAX)
        bits = raw.view(torch.int32)
        up = (bits & 0x7F800000) + torch.where((bits & 0x007FFFFF) != 0, 0x00800000, 0)
        scale = torch.where(torch.isnan(raw), raw, up.int().view(torch.float32))
        q = torch.clamp(blocks * (1.0 / scale).unsqueeze(-1), -FP8_MAX, FP8_MAX)
        return q.to(torch.float8_e4m3fn).reshape(t, h), scale
    # Divide by a tensor, not a Python number: for a scalar divisor torch on CUDA multiplies by
    # the rounded reciprocal, which is not the correctly rounded quotient the kernels compute.
    scale = torch.clamp(amax, min=FP8_MIN_AMAX) / torch.full_like(amax, FP8_MAX)
    q = torch.clamp(blocks / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, h), scale


def dequantize_fp8_blockwise(q: torch.Tensor, scales_t: torch.Tensor) -> torch.Tensor:
    """Rows of fp8 tokens and their transposed scales back to fp32 [rows, H]."""
    rows, h = q.shape
    scale = scales_t[:, :rows].t().repeat_interleave(FP8_BLOCK, dim=1)
    return q.float() * scale


def dispatch_mismatch(cfg: EPConfig, got, want: DispatchResult) -> str | None:
    """The first way a dispatch output (kernel's or reference's) differs from `want` in a byte
    it defines, or None: offsets, expert ids, counts, src_info and token rows below
    `want.num_rows`; FP8 scales of those rows; the NVFP4 scale buffer's size, scales_offsets and
    every 128-row scale block a segment uses, its padding included."""
    n = want.num_rows
    for name in ("row_offsets", "expert_ids", "counts"):
        if getattr(got, name).tolist() != getattr(want, name).tolist():
            return name
    # Slabs define only the rows each segment holds (the rest of a slab is undefined).
    rows = (want.source_rank != PAD).nonzero().flatten() if cfg.layout == "slabs" \
        else slice(0, n)
    if not torch.equal(got.src_info[rows], want.src_info[rows]):
        return "src_info"
    gt, wt = got.tokens[rows].view(torch.uint8), want.tokens[rows].view(torch.uint8)
    if not torch.equal(gt, wt):
        bad = (gt != wt).any(dim=1).nonzero().flatten()
        return f"{len(bad)} of {n} rows differ, first {bad[:8].tolist()}"
    if cfg.format == "fp8" and not torch.equal(got.scales[:, rows], want.scales[:, rows]):
        return "fp8 scales"
    if cfg.format == "nvfp4":
        if got.scales.numel() != want.scales.numel():
            return "nvfp4 scale buffer size"
        if got.scales_offsets.tolist() != want.scales_offsets.tolist():
            return "scales_offsets"
        blocks = sum(-(-c // ATOM_ROWS) for c in want.counts.tolist())
        used = blocks * scale_block_bytes(cfg.hidden, NVFP4_BLOCK)
        got_sc, want_sc = got.scales[:used], want.scales[:used]
        if not torch.equal(got_sc, want_sc):
            bad = (got_sc != want_sc).nonzero().flatten()
            return f"{len(bad)} of {used} used scale bytes differ, first at {bad[:8].tolist()}"
    return None


def nvfp4_row_scales(out, hidden: int, rows: int) -> torch.Tensor:
    """The linear e4m3 scale bytes [rows, H / 16] of the first `rows` rows of an NVFP4 dispatch
    output (kernel's or reference's), gathered from its 128x4 buffer: row row_offsets[g] + j
    reads scale row (row_offsets[g] // 128 + scales_offsets[g]) * 128 + j. Device ops only
    (graph-capturable); rows past the last segment read inside the buffer, at undefined
    values."""
    offsets = out.row_offsets.long()
    row = torch.arange(rows, device=out.tokens.device)
    seg = torch.bucketize(row, offsets[1:], right=True).clamp(max=offsets.numel() - 2)
    start = offsets[seg]
    scale_row = (start // ATOM_ROWS + out.scales_offsets.long()[seg]) * ATOM_ROWS + row - start
    kb = torch.arange(hidden // NVFP4_BLOCK, device=row.device)
    return out.scales[_scale_offsets(scale_row, kb, hidden)]


def staged_segments(fmt: str, counts: list[int]) -> tuple[list[int], list[int]]:
    """The segment layout a dispatch's receivers derive from the rows each segment received
    (what its scale write-out is given): row offsets [S + 1] (FP8 segments padded to
    FP8_ROW_ALIGN rows) and first 128-row scale blocks [S + 1] (`expert_scale_blocks`, then
    the blocks in all)."""
    from layouts.config import FP8_ROW_ALIGN

    align = FP8_ROW_ALIGN if fmt == "fp8" else 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // align) * align)
    first, _ = expert_scale_blocks(counts)
    blocks = first[-1] + -(-counts[-1] // ATOM_ROWS) if counts else 0
    return offsets, first + [blocks]


def scale_layout_of_rows(fmt: str, scale_rows: torch.Tensor, hidden: int, counts: list[int],
                         row_capacity: int) -> torch.Tensor:
    """What a dispatch's scale output holds once its staged scale rows (`scale_rows` [rows,
    words] int32, a row's scales as they came: FP8 one fp32 a 128-element block, NVFP4 its
    H / 16 e4m3 bytes four to a word) are written out, for segments of `counts` rows: FP8
    transposed [H / 128, row_capacity] fp32 (segments padded to FP8_ROW_ALIGN rows, whose
    staged rows are copied as they are; columns past the rows zero); NVFP4 the 128x4 layout,
    segment g from its fresh 128-row block (`layouts.scales.expert_scale_blocks`), every other
    byte of the used blocks zero."""
    from layouts.config import FP8_ROW_ALIGN

    offsets, first = staged_segments(fmt, counts)
    if fmt == "fp8":
        rows = offsets[-1]
        if scale_rows.shape[0] < rows:
            raise ValueError(f"{rows} staged rows (segments padded to {FP8_ROW_ALIGN}), "
                             f"got {scale_rows.shape[0]}")
        out = torch.zeros(hidden // 128, row_capacity, dtype=torch.float32,
                          device=scale_rows.device)
        out[:, :rows] = scale_rows[:rows, :hidden // 128].view(torch.float32).t()
        return out
    out = torch.zeros(first[-1] * scale_block_bytes(hidden, NVFP4_BLOCK), dtype=torch.uint8,
                      device=scale_rows.device)
    staged = scale_rows.contiguous().view(torch.uint8)[:, :hidden // NVFP4_BLOCK]
    kb = torch.arange(hidden // NVFP4_BLOCK, device=scale_rows.device)
    row = 0
    for g, count in enumerate(counts):
        j = torch.arange(count, device=scale_rows.device)
        out[_scale_offsets(first[g] * ATOM_ROWS + j, kb, hidden)] = staged[row:row + count]
        row += count
    return out


def check_inputs(cfg: EPConfig, x: list[torch.Tensor], topk_ids: list[torch.Tensor],
                 topk_weights: list[torch.Tensor] | None = None) -> None:
    """The checks every dispatch makes, with errors that say what was expected."""
    if len(x) != cfg.ranks or len(topk_ids) != cfg.ranks:
        raise ValueError(f"expected inputs for {cfg.ranks} ranks, got {len(x)} x and "
                         f"{len(topk_ids)} topk_ids")
    for r, (xr, ids) in enumerate(zip(x, topk_ids)):
        if xr.dtype != torch.bfloat16 or xr.dim() != 2 or xr.shape[1] != cfg.hidden:
            raise ValueError(f"rank {r}: x must be bf16 [T, {cfg.hidden}], got {xr.dtype} "
                             f"{tuple(xr.shape)}")
        if xr.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(f"rank {r}: {xr.shape[0]} tokens exceeds max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}")
        if ids.dtype not in (torch.int32, torch.int64) or tuple(ids.shape) != (xr.shape[0], cfg.topk):
            raise ValueError(f"rank {r}: topk_ids must be int32/int64 [{xr.shape[0]}, {cfg.topk}], "
                             f"got {ids.dtype} {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= cfg.experts):
            raise ValueError(f"rank {r}: expert ids must be in [0, {cfg.experts}) or -1 (an "
                             f"empty slot), got [{int(ids.min())}, {int(ids.max())}]")
        if ids.numel() and cfg.topk > 1:
            s = ids.sort(dim=1).values
            if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
                raise ValueError(f"rank {r}: a token lists the same expert twice")
        if topk_weights is not None:
            w = topk_weights[r]
            if w.dtype != torch.float32 or tuple(w.shape) != tuple(ids.shape):
                raise ValueError(f"rank {r}: topk_weights must be float32 {tuple(ids.shape)}, "
                                 f"got {w.dtype} {tuple(w.shape)}")


def dispatch(cfg: EPConfig, x: list[torch.Tensor], topk_ids: list[torch.Tensor],
             skip_a2a: bool = False,
             global_scales: list[float] | None = None,
             shared_tokens: list[range] | None = None) -> list[DispatchResult]:
    """Every rank's dispatch output.

    With `skip_a2a` (allreduce mode) every rank holds all tokens (x[r] equal on all ranks) and
    keeps only the pairs routed to its own experts; a fused shared expert's tokens are split in
    contiguous chunks of ceil(T / R) across ranks, so the caller's allreduce adds it once.
    `global_scales[r]` (nvfp4 only, required there) is rank r's global scale, taken as fp32.
    `shared_tokens[r]` (fused shared expert, without skip_a2a): the tokens of rank r that its
    shared expert takes, a range (default: all of them).
    """
    if cfg.format not in ("bf16", "fp8", "nvfp4"):
        raise NotImplementedError(f"the reference dispatches bf16, fp8 and nvfp4, not "
                                  f"{cfg.format}")
    check_inputs(cfg, x, topk_ids)
    if (cfg.format == "nvfp4") != (global_scales is not None):
        raise ValueError("global_scales (one per rank) are required for nvfp4 and only there")
    quantized = None
    if global_scales is not None:
        if len(global_scales) != cfg.ranks:
            raise ValueError(f"expected {cfg.ranks} global scales, got {len(global_scales)}")
        # Each token is quantized once, on its own rank, under that rank's scale.
        quantized = [quantize_nvfp4(xr, torch.full((xr.shape[0],), float(gs),
                                                   dtype=torch.float32, device=xr.device))
                     for xr, gs in zip(x, global_scales)]
    if skip_a2a and shared_tokens is not None:
        raise ValueError("shared_tokens is for a dispatch without skip_a2a (which splits the "
                         "shared tokens itself)")
    e_loc, shared = cfg.local_experts, int(cfg.fused_shared_expert)
    results = []
    for r in range(cfg.ranks):
        tokens = x[r].shape[0]
        if skip_a2a:
            chunk = -(-tokens // cfg.ranks)
            mine = range(r * chunk, min(tokens, (r + 1) * chunk))
        elif shared_tokens is not None:
            mine = shared_tokens[r]
            if not 0 <= mine.start <= mine.stop <= tokens or mine.step != 1:
                raise ValueError(f"rank {r}: shared tokens {mine} are not a range of its "
                                 f"{tokens} tokens")
        else:
            mine = range(tokens)
        sources = [r] if skip_a2a else range(cfg.ranks)
        results.append(_dispatch_to(cfg, x, topk_ids, r, sources, e_loc, shared,
                                    mine if shared else (), quantized))
    return results


def _dispatch_to(cfg, x, topk_ids, dest, sources, e_loc, shared, shared_tokens,
                 quantized) -> DispatchResult:
    # Every (segment, source, token, k) that lands on `dest`, as columns.
    device = x[dest].device
    seg, src, tok, slot = [], [], [], []
    if len(shared_tokens):
        tokens = torch.tensor(list(shared_tokens), dtype=torch.int64, device=device)
        seg.append(torch.zeros_like(tokens))
        src.append(torch.full_like(tokens, dest))
        tok.append(tokens)
        slot.append(torch.full_like(tokens, SHARED_K))
    for s in sources:
        ids = topk_ids[s].to(device).long()
        t_idx, k_idx = torch.nonzero((ids // e_loc) == dest, as_tuple=True)
        seg.append(ids[t_idx, k_idx] - dest * e_loc + shared)
        src.append(torch.full_like(t_idx, s))
        tok.append(t_idx)
        slot.append(k_idx)
    seg, src, tok, slot = (torch.cat(c) if c else torch.zeros(0, dtype=torch.int64, device=device)
                           for c in (seg, src, tok, slot))
    # The output order: segment, then source rank, then source token.
    order = torch.argsort((seg * cfg.ranks + src) * cfg.max_tokens_per_rank + tok, stable=True)
    seg, src, tok, slot = seg[order], src[order], tok[order], slot[order]

    segments = cfg.segments
    align = cfg.row_align
    counts = torch.bincount(seg, minlength=segments)
    padded = (counts + align - 1) // align * align
    if cfg.layout == "slabs":  # every segment a whole slab, whatever it holds
        padded = torch.full_like(counts, cfg.slab_rows)
    row_offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device),
                             torch.cumsum(padded, 0)])
    first_of_segment = torch.cumsum(counts, 0) - counts
    rows = row_offsets[seg] + torch.arange(len(seg), device=device) - first_of_segment[seg]

    h, cap = cfg.hidden, cfg.row_capacity
    starts = torch.tensor([0] + [xr.shape[0] for xr in x], device=device).cumsum(0)
    token_at = starts[src] + tok  # each row's token in the concatenation of all ranks' tokens
    src_info = torch.full((cap, 2), PAD, dtype=torch.int32, device=device)
    src_info[rows] = torch.stack([tok, slot], dim=1).int()
    source_rank = torch.full((cap,), PAD, dtype=torch.int32, device=device)
    source_rank[rows] = src.int()

    scales_offsets = None
    if cfg.format == "nvfp4":
        codes = torch.cat([q.to(device) for q, _ in quantized])[token_at]
        linear = torch.cat([sf.to(device) for _, sf in quantized])[token_at]
        tokens = torch.zeros(cap, h // 2, dtype=torch.uint8, device=device)
        tokens[rows] = codes
        first, offsets = expert_scale_blocks(counts.tolist())
        first = torch.tensor(first, dtype=torch.int64, device=device)
        scale_rows = first[seg] * ATOM_ROWS + rows - row_offsets[seg]
        scales = torch.zeros(output_scales(cfg).layout.cosize(), dtype=torch.uint8,
                             device=device)
        kb = torch.arange(h // NVFP4_BLOCK, device=device)
        scales[_scale_offsets(scale_rows, kb, h).flatten()] = linear.flatten()
        scales_offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    else:
        rows_bf16 = torch.zeros(cap, h, dtype=torch.bfloat16, device=device)
        rows_bf16[rows] = torch.cat([xr.to(device) for xr in x])[token_at]
        valid = source_rank != PAD
        if cfg.format == "fp8":
            q, scale = quantize_fp8_blockwise(rows_bf16, cfg.fp8_scales == "pow2")
            q.view(torch.uint8)[~valid] = 0
            scale[~valid] = 0
            tokens, scales = q, scale.t().contiguous()
        else:
            tokens, scales = rows_bf16, None
    return DispatchResult(
        tokens=tokens, scales=scales, row_offsets=row_offsets,
        expert_ids=torch.arange(segments, dtype=torch.int32, device=device) - shared,
        src_info=src_info, counts=counts.int(), source_rank=source_rank,
        scales_offsets=scales_offsets)


def combine(cfg: EPConfig, y: list[torch.Tensor], dispatched: list[DispatchResult],
            num_tokens: list[int], topk_weights: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Every rank's combine output from the expert outputs `y[r]` ([rows, H] bf16 in rank r's
    dispatch row order). With weights: `[T, H]` bf16; without: the unreduced `[T, K, H]`."""
    h, k = cfg.hidden, cfg.topk
    device = y[0].device if y else torch.device("cpu")
    shape = (lambda t: (t, k, h)) if topk_weights is None else (lambda t: (t, h))
    acc = [torch.zeros(shape(t), dtype=torch.float32, device=device) for t in num_tokens]
    for r, (yr, d) in enumerate(zip(y, dispatched)):
        if yr.dtype != torch.bfloat16 or yr.shape[1] != h or yr.shape[0] < d.num_rows:
            raise ValueError(f"rank {r}: expert outputs must be bf16 [>= {d.num_rows}, {h}], got "
                             f"{yr.dtype} {tuple(yr.shape)}")
        rows = torch.nonzero(d.source_rank != PAD).flatten()
        sources, tokens, slots = (d.source_rank[rows].long(), d.src_info[rows, 0].long(),
                                  d.src_info[rows, 1].long())
        values = yr[rows].float()
        shared = slots == SHARED_K
        if topk_weights is None and bool(shared.any()):
            raise ValueError("the unreduced [T, K, H] output has no place for the shared expert: "
                             "pass topk_weights with fused_shared_expert")
        for s in range(cfg.ranks):
            mine = sources == s
            t, k, v = tokens[mine], slots[mine], values[mine]
            if topk_weights is None:
                acc[s][t, k] = v
            else:
                w = torch.where(k == SHARED_K, 1.0, topk_weights[s].to(device)[t, k.clamp(min=0)])
                acc[s].index_add_(0, t, w.unsqueeze(1) * v)
    return [a.to(torch.bfloat16) for a in acc]
