"""Standalone quantization kernels on torch tensors (no process group needed)."""

from __future__ import annotations

import functools

import torch

from cute_ep.runtime.launch import check_tensor, device_arch, runtime
from layouts.algebra import ceil_div
from layouts.scales import ATOM_ROWS, scale_layout, scale_rows_capacity

NVFP4_BLOCK = 16
E2M1_OF_ARCH = {"sm_90a": "software", "sm_100a": "hardware"}  # the e2m1 encoder per arch

__all__ = ["quantize_nvfp4"]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def segment_offsets(row_offsets: torch.Tensor | None, rows: int,
                    device: torch.device) -> tuple[torch.Tensor, int]:
    """(checked int32 row_offsets on `device`, number of segments); None: one segment of all
    `rows` rows."""
    if row_offsets is None:
        # [0, rows] made on the device (no host-to-device copy: graph capture allows it).
        row_offsets = torch.arange(2, dtype=torch.int32, device=device) * rows
    check_tensor(row_offsets, name="row_offsets", dtype="int32", align=4,
                 device_index=device.index)
    if row_offsets.dim() != 1 or row_offsets.numel() < 2:
        raise ValueError(f"row_offsets must be 1-D with at least 2 entries, got "
                         f"{tuple(row_offsets.shape)}")
    return row_offsets, row_offsets.numel() - 1


def check_work_items(rows: int, per_row: int, what: str, margin: int = 0) -> None:
    """Refuse an input whose `rows * per_row` work items (blocks or lane vectors, which the
    kernels count in 32 bits) reach 2^31, or 2^31 - `margin` for a kernel that counts up to
    `margin` items past the last."""
    limit = "2^31" if not margin else f"2^31 - {margin}"
    if rows * per_row >= 2 ** 31 - margin:
        raise ValueError(f"{what}: {rows} rows of {per_row} items each is {limit} or more; "
                         f"split the rows over several calls")


def segment_count(row_offsets: torch.Tensor | None) -> int:
    """Segments `row_offsets` delimits (None: one segment of all rows)."""
    return 1 if row_offsets is None else row_offsets.shape[0] - 1


def per_segment_scales(scales: torch.Tensor | float, row_offsets: torch.Tensor | None,
                       device: torch.device) -> torch.Tensor:
    """Per-segment fp32 scales: the tensor as given, or one number for every segment."""
    if isinstance(scales, torch.Tensor):
        return scales
    return torch.full((segment_count(row_offsets),), float(scales), dtype=torch.float32,
                      device=device)


def fp4_scale_rows(rows: int, segments: int, scale_rows: int | None) -> int:
    """Scale rows of an FP4 128x4 scale buffer: `scale_rows`, or by default room for every
    segment to start on a fresh 128-row block."""
    return scale_rows if scale_rows is not None else scale_rows_capacity(rows, segments)


def check_scale_rows(scale_rows: int | None, rows: int, row_offsets: torch.Tensor) -> None:
    """Refuse a caller's `scale_rows` too small for `row_offsets` (int32 [S + 1]): each segment
    starts a fresh 128-row block, so the kernels write up to sum(ceil(n_g / 128)) * 128 scale
    rows, which only the device's offsets say. Below the worst case (`rows + 128 S`) the offsets
    are read (the host waits for the device), and refused under CUDA graph capture, where they
    cannot be: a buffer too small for them would be written past its end."""
    worst = scale_rows_capacity(rows, row_offsets.numel() - 1)
    if scale_rows is None or scale_rows >= worst:
        return
    if row_offsets.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"scale_rows={scale_rows} is below {worst} (M + 128 S), which cannot be "
                         f"checked against row_offsets while a CUDA graph is captured: pass at "
                         f"least that, or None")
    offsets = row_offsets.tolist()
    need = sum(ceil_div(b - a, ATOM_ROWS) for a, b in zip(offsets, offsets[1:])) * ATOM_ROWS
    if scale_rows < need:
        raise ValueError(f"scale_rows={scale_rows} is below the {need} scale rows these "
                         f"row_offsets need (each segment starts a fresh {ATOM_ROWS}-row block)")


@functools.lru_cache(maxsize=256)
def fp4_scale_bytes(scale_rows: int, k: int, block: int) -> int:
    """Bytes of the 128x4 scale buffer for `scale_rows` rows of K elements, a scale per block."""
    return scale_layout(scale_rows, k, block).cosize()


def quantize_nvfp4(x: torch.Tensor, global_scales: torch.Tensor | float,
                   row_offsets: torch.Tensor | None = None, *, scales: str = "128x4",
                   scale_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows -> (NVFP4 codes uint8 [M, K / 2], e4m3 scales uint8).

    x: bf16 [M, K], K a multiple of 16. row_offsets: int32 [S + 1] on the device grouping the
    rows into S segments (experts); only rows below `row_offsets[S]` are read and written, so M
    may be a capacity. None means one segment of all M rows. global_scales: fp32 [S] (or one
    number), the `gs` of `sf = e4m3(gs * amax / 6)`, `q = e2m1(x * gs / sf)`.
    scales: "linear" -> [M, K / 16]; "128x4" -> the block-scaled MMA layout of
    `layouts.scales` for `scale_rows` rows (default M + 128 * S; fewer are checked against
    row_offsets, which makes the host wait for the device), each segment on a fresh 128-row
    block, padding zero. sm_90a encodes e2m1 in software, sm_100a with the hardware conversion;
    both give the same bytes.
    """
    if torch.compiler.is_compiling():
        return torch.ops.cute_ep.quantize_nvfp4(
            x, per_segment_scales(global_scales, row_offsets, x.device), row_offsets, scales,
            scale_rows)
    device = x.device
    check_tensor(x, name="x", dtype="bfloat16", align=16)
    if x.dim() != 2 or x.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"x must be bf16 [M, K] with K a multiple of {NVFP4_BLOCK}, got "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    check_work_items(m, k // NVFP4_BLOCK, "quantize_nvfp4", margin=64)  # a chunk's lanes
    row_offsets, segments = segment_offsets(row_offsets, m, device)
    global_scales = per_segment_scales(global_scales, row_offsets, device)
    check_tensor(global_scales, name="global_scales", dtype="float32", align=4,
                 device_index=device.index)
    if global_scales.numel() != segments:
        raise ValueError(f"global_scales has {global_scales.numel()} entries for {segments} "
                         f"segments")
    if scales not in ("linear", "128x4"):
        raise ValueError(f"scales must be 'linear' or '128x4', got {scales!r}")
    order = _order(x.numel() * x.element_size(), device.index, scales)
    kernel, grid = _quantizer(runtime(), device.index, scales,
                              _steps(m, k, device.index, scales, order), order)
    if segments > kernel.spec.sizes["max_segments"]:
        raise ValueError(f"at most {kernel.spec.sizes['max_segments']} segments, got {segments}")
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=device)
    if scales == "linear":
        out_scales = torch.empty(m, k // NVFP4_BLOCK, dtype=torch.uint8, device=device)
    else:
        rows = fp4_scale_rows(m, segments, scale_rows)
        check_scale_rows(scale_rows, m, row_offsets)
        out_scales = torch.empty(fp4_scale_bytes(rows, k, NVFP4_BLOCK), dtype=torch.uint8,
                                 device=device)
    # Every tensor is checked above or allocated here.
    kernel.launch_checked_by_caller(x, row_offsets, global_scales, codes, out_scales, segments,
                                    m, k, grid, stream_window=_stream_window(x, device.index))
    return codes, out_scales


def _stream_window(x: torch.Tensor, index: int) -> tuple[int, int] | None:
    """(address, bytes) of `x` for L2's streaming property when it fits in L2, else None.

    The input is read once; streamed, its lines are the first to leave L2 instead of what L2
    held. One H200, beside copy_ (`perf/results/quant-2026-11-26-H200-quantize-window.json`):
    at I = 2048 (32 MiB of input, L2 50 MB) +3.4..+4.2 points of copy with L2 full of dirty
    lines (the bench's default state), within half a point with clean ones or with the input
    just written; at 7168 (112 MiB, more than L2) 6.8 points slower in the default state, so
    inputs larger than L2 keep the normal property."""
    nbytes = x.numel() * x.element_size()
    l2, most = _l2_sizes(index)
    if nbytes == 0 or nbytes > l2 or most == 0:
        return None
    return x.data_ptr(), min(nbytes, most)


@functools.lru_cache(maxsize=16)
def _l2_sizes(index: int) -> tuple[int, int]:
    """(L2 bytes, the largest access policy window) of device `index`."""
    from cute_ep.runtime.launch import check, driver

    most = check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE, index))
    return torch.cuda.get_device_properties(index).L2_cache_size, int(most)


def _order(nbytes: int, index: int, scales: str) -> str:
    """The quantize_nvfp4 kernel for an input of `nbytes`: "quads" (`kernels.quantize_quads`,
    rows taken four at a time so that the 128x4 scales go out in whole 16-byte pieces) for 128x4
    scales of an input larger than L2, else "rows" (`kernels.nvfp4.QuantizeNvfp4`, a row at a
    time; an input that fits in L2 is streamed through it by the access policy window,
    `_stream_window`).

    One H200, M = 8192 over 8 experts, beside copy_ in one run
    (`perf/results/quant-2026-11-26-H200-quads.json`): at I = 7168 (112 MiB) quads at one CTA
    an SM reach 82.5-83.8% of copy with L2 full of dirty lines against 78.6-80.7% for rows,
    +3.1 to +3.8 points with the input just written and -1.5 to -2.0 with L2 holding clean
    lines; at I = 2048 (32 MiB) quads lose 5 to 11 points to rows with its window."""
    if scales == "128x4" and nbytes > _l2_sizes(index)[0]:
        return "quads"
    return "rows"


# Chunks per warp from which the longer chunks pay (`_steps`).
_LONG_CHUNKS_FROM = 8


def _steps(rows: int, k: int, index: int, scales: str, order: str = "rows") -> int:
    """Blocks per lane per chunk of quantize_nvfp4 (chunks of 32 * steps blocks of the rows'
    stream): 2 once every warp of the grid has at least _LONG_CHUNKS_FROM of them, else 1, whose
    pipeline fills sooner and whose last chunks are shorter (one H200, M = 8192, 8 segments,
    both beside copy_ in one run: K = 2048, 3.9 long chunks a warp, 80% of copy at steps 1
    against 76% at 2; K = 7168, 13.6 a warp, 77.5% against 79%)."""
    kernel, grid = _quantizer(runtime(), index, scales, 2, order)
    chunks = ceil_div(rows * (k // NVFP4_BLOCK), 2 * 32)
    return 2 if chunks >= _LONG_CHUNKS_FROM * grid * kernel.spec.sizes["warps"] else 1


@functools.lru_cache(maxsize=64)
def _quantizer(rt, index: int, scales: str, steps: int = 2, order: str = "rows"):
    """The quantize_nvfp4 kernel of this device (`order`: `_order`'s) and its grid: persistent,
    its warps taking runs of the stream's chunks; `steps` blocks per lane per chunk. Rows fill
    every SM with CTAs; quads take one CTA an SM (16 warps), though two fit: 82.5-83.8% of copy
    against 80.7-81.1% at two on one H200 (I = 7168, L2 full of dirty lines,
    `perf/results/quant-2026-11-26-H200-quads.json`)."""
    device = torch.device("cuda", index)
    kernel = rt.select("quantize_nvfp4", device, scales=scales, steps=steps,
                       e2m1=E2M1_OF_ARCH[device_arch(device)], order=order)
    ctas = 1 if order == "quads" else kernel.resident_ctas()
    return kernel, ctas * sm_count(device)
