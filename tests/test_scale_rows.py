"""A caller's `scale_rows` for the FP4 128x4 scales (`quantize_nvfp4`, `fused_silu_nvfp4`,
`fused_silu_mxfp4`) is checked against the 128-row blocks its `row_offsets` need, on the host,
before any launch: a buffer too small would be written past its end."""

from __future__ import annotations

import pytest
import torch

from cute_ep.quant import check_scale_rows


class _Unreadable:
    """Offsets of S segments whose values must not be read."""

    is_cuda = False

    def __init__(self, segments: int):
        self.segments = segments

    def numel(self) -> int:
        return self.segments + 1

    def tolist(self):
        raise AssertionError("row_offsets were read")


OFFSETS = [0, 130, 130, 300, 301]  # 130, 0, 170 and 1 rows: 2 + 0 + 2 + 1 = 5 blocks


def test_the_default_and_the_worst_case_need_no_read():
    check_scale_rows(None, 301, _Unreadable(4))
    check_scale_rows(301 + 4 * 128, 301, _Unreadable(4))
    check_scale_rows(10_000, 301, _Unreadable(4))


def test_exactly_the_blocks_the_offsets_need_is_accepted():
    check_scale_rows(5 * 128, 301, torch.tensor(OFFSETS, dtype=torch.int32))


@pytest.mark.parametrize("scale_rows", [5 * 128 - 1, 4 * 128, 301, 1])
def test_fewer_rows_than_the_offsets_need_are_refused(scale_rows):
    with pytest.raises(ValueError, match=rf"scale_rows={scale_rows} is below the 640 scale rows"):
        check_scale_rows(scale_rows, 301, torch.tensor(OFFSETS, dtype=torch.int32))


def test_one_segment_of_every_row():
    offsets = torch.tensor([0, 256], dtype=torch.int32)
    check_scale_rows(256, 256, offsets)
    with pytest.raises(ValueError, match="below the 256"):
        check_scale_rows(255, 256, offsets)


def test_inputs_of_2_to_the_31_work_items_are_refused():
    from cute_ep.quant import check_work_items

    check_work_items(2 ** 21, 2 ** 10 - 1, "quantize_nvfp4")
    with pytest.raises(ValueError, match="quantize_nvfp4: 2097152 rows .* 2\\^31"):
        check_work_items(2 ** 21, 2 ** 10, "quantize_nvfp4")
    # A margin for a kernel that counts a chunk past the last item.
    check_work_items(2 ** 21 - 2, 2 ** 10, "quantize_nvfp4", margin=2 ** 10)
    with pytest.raises(ValueError, match="2\\^31 - 1024 or more"):
        check_work_items(2 ** 21 - 1, 2 ** 10, "quantize_nvfp4", margin=2 ** 10)


def _padding_rows(offsets: list[int]) -> list[int]:
    """The scale rows of the kernels' padding-row pass (`kernels.nvfp4.zero_scale_padding`):
    padding row j of all segments, in order, is in segment g for P[g] <= j < P[g + 1],
    P[g] = 128 first[g] - offsets[g], and sits at scale row offsets[g + 1] + j."""
    from cute_ep.reference.fp4 import segment_scale_blocks

    first = segment_scale_blocks(offsets)
    pads = [128 * f - o for f, o in zip(first, offsets)]
    rows = []
    for j in range(pads[-1]):
        g = max(g for g in range(len(offsets) - 1) if pads[g] <= j)
        rows.append(offsets[g + 1] + j)
    return rows


@pytest.mark.parametrize("offsets", [OFFSETS, [0, 0, 0, 128, 128, 129, 400], [0, 256], [0]])
def test_the_padding_row_pass_covers_exactly_the_rows_past_each_segment(offsets):
    from cute_ep.reference.fp4 import segment_scale_blocks

    first = segment_scale_blocks(offsets)
    want = [128 * first[g] + r for g in range(len(offsets) - 1)
            for r in range(offsets[g + 1] - offsets[g], 128 * (first[g + 1] - first[g]))]
    assert _padding_rows(offsets) == want
