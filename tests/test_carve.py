"""A dispatch's small outputs and its handle live in one allocation (`cute_ep.ep._Carve`), and a
field becomes a tensor view only when read: the views must be disjoint, aligned, shaped as the
unshared tensors would be, and the addresses the kernels get must be those of the views."""

import math

import pytest
import torch

from cute_ep.ep import DispatchHandle, DispatchOutput, Routing, _Carve

PARTS = [("row_offsets", (5,), torch.int32), ("src_info", (7, 2), torch.int32),
         ("weights", (3, 4, 2), torch.float32), ("flags", (3,), torch.uint8),
         ("stamps", (2,), torch.int64)]


def _block(nbytes: int) -> tuple[torch.UntypedStorage, torch.Tensor]:
    """A call's allocation, as a dispatch makes it, and a uint8 tensor over the same bytes (the
    reference's reading of them), zeroed."""
    storage = torch.UntypedStorage(nbytes)
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))
    as_bytes.zero_()
    return storage, as_bytes


def test_parts_are_aligned_disjoint_and_shaped():
    carve = _Carve(PARTS, start=512)
    flat, _ = _block(carve.end)
    spans = []
    for name, shape, dtype in PARTS:
        view = carve.view(flat, name)
        assert view.shape == shape and view.dtype == dtype and view.is_contiguous()
        begin = view.data_ptr() - flat.data_ptr()
        assert begin >= 512 and begin % _Carve.ALIGN == 0
        assert carve.address(flat.data_ptr(), name) == view.data_ptr()
        spans.append((begin, begin + view.numel() * view.element_size()))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= carve.end


def test_each_part_reads_its_own_bytes():
    """A part's view reads the bytes at its planned offset as its dtype and shape: the bytes are
    written through a plain uint8 view of the allocation (sliced and reinterpreted, independent
    of `_Carve.view`), and nothing before the carve's start is touched by writes to the parts."""
    carve = _Carve(PARTS, start=256)
    flat, as_bytes = _block(carve.end)
    for i, (name, shape, dtype) in enumerate(PARTS):
        at, _, _, nbytes = carve.parts[name]
        expect = torch.arange(math.prod(shape)).reshape(shape).to(dtype) + i
        as_bytes[at:at + nbytes] = expect.flatten().view(torch.uint8)
        assert torch.equal(carve.view(flat, name), expect)
    for i, (name, shape, dtype) in enumerate(PARTS):
        carve.view(flat, name).fill_(i + 1)
        at, _, _, nbytes = carve.parts[name]
        assert torch.equal(as_bytes[at:at + nbytes].view(dtype).view(shape),
                           torch.full(shape, i + 1, dtype=dtype))
    assert not as_bytes[:256].any()


def test_writes_through_one_view_touch_no_other():
    carve = _Carve(PARTS)
    flat, _ = _block(carve.end)
    for i, (name, _, _) in enumerate(PARTS):
        carve.view(flat, name).fill_(i + 1)
    for i, (name, _, _) in enumerate(PARTS):
        assert torch.equal(carve.view(flat, name), torch.full_like(carve.view(flat, name), i + 1))


def test_separate_gives_one_allocation_per_part():
    parts = _Carve(PARTS).separate("cpu")
    assert list(parts) == [name for name, _, _ in PARTS]
    storages = {t.untyped_storage().data_ptr() for t in parts.values()}
    assert len(storages) == len(PARTS)
    assert [tuple(t.shape) for t in parts.values()] == [shape for _, shape, _ in PARTS]


def test_carved_fields_are_views_made_on_first_read():
    out_carve = _Carve([("row_offsets", (3,), torch.int32), ("expert_ids", (2,), torch.int32),
                        ("counts", (2,), torch.int32), ("src_info", (4, 2), torch.int32)])
    handle_carve = _Carve([("rows", (2, 4, 1), torch.int32), ("weights", (2, 4, 1), torch.float32),
                           ("tokens", (2, 4), torch.int32), ("messages", (2,), torch.int32),
                           ("channels", (1, 2), torch.int32)], start=out_carve.end)
    flat, _ = _block(handle_carve.end)
    route = Routing(1, 4, True, False, 0, 4, torch.zeros(4, 1, dtype=torch.int32))
    handle = DispatchHandle._of({"routing": route, "_flat": flat, "_carve": handle_carve})
    tokens = torch.zeros(4, 8, dtype=torch.bfloat16)
    out = DispatchOutput._of({"tokens": tokens, "scales": None, "handle": handle,
                              "scales_offsets": None, "_flat": flat, "_carve": out_carve})
    assert "counts" not in out.__dict__ and "rows" not in handle.__dict__
    assert handle._address("rows") == flat.data_ptr() + handle_carve.parts["rows"][0]
    handle.rows.fill_(-1)
    assert "rows" in handle.__dict__ and handle.rows is handle.rows  # made once
    assert handle._address("rows") == handle.rows.data_ptr()
    assert torch.equal(out.counts, torch.zeros(2, dtype=torch.int32))  # untouched by rows
    assert out.tokens is tokens and out.scales is None and out.scales_offsets is None
    assert tuple(out.src_info.shape) == (4, 2) and handle.channels.shape == (1, 2)
    with pytest.raises(AttributeError, match="not_a_field"):
        out.not_a_field


def test_addresses_follow_a_replaced_field_and_an_uncarved_handle():
    """`_addresses` reads the allocation once and gives each field's address: carved, made
    into a view, or replaced in a copy (autograd's `_handle_with` swaps the weights)."""
    carve = _Carve([("rows", (2, 4), torch.int32), ("weights", (2, 4), torch.float32),
                    ("channels", (1, 2), torch.int32)])
    flat, _ = _block(carve.end)
    route = Routing(1, 4, True, False, 0, 4, torch.zeros(4, 1, dtype=torch.int32))
    handle = DispatchHandle._of({"routing": route, "_flat": flat, "_carve": carve})
    names = ("rows", "weights", "channels")
    assert handle._addresses(names) == [handle._address(n) for n in names]
    handle.rows  # a view made on first read: the same address
    assert handle._addresses(names) == [flat.data_ptr() + carve.parts[n][0] for n in names]
    ones = torch.ones(2, 4)
    copy = DispatchHandle.__new__(DispatchHandle)
    copy.__dict__.update(handle.__dict__, weights=ones)
    assert copy._addresses(names)[1] == ones.data_ptr()
    plain = DispatchHandle(route, *(torch.zeros(2, 4) for _ in range(4)), torch.zeros(1, 2))
    assert plain._addresses(names) == [plain.rows.data_ptr(), plain.weights.data_ptr(),
                                       plain.channels.data_ptr()]
