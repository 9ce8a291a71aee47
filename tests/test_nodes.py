"""The transport between nodes without a GPU: a token's row as it crosses the network, expert
ids made a node's, the inputs' checks and what this version refuses."""

import pytest
import torch

from cute_ep.nodes import check_node_config, localize_ids, pack_rows, unpack_rows
from layouts import EPConfig


@pytest.mark.parametrize("parts", [
    [((512,), torch.bfloat16)],                                 # bf16 x
    [((512,), torch.float8_e4m3fn), ((4,), torch.float32)],     # fp8 codes, scales
    [((256,), torch.uint8), ((32,), torch.uint8)],              # nvfp4 codes, scales
])
def test_a_token_row_crosses_whole_and_comes_back_byte_for_byte(parts):
    gen = torch.Generator().manual_seed(1)
    tokens, topk = 13, 4
    tensors = [torch.randint(0, 256, (tokens, torch.Size(s).numel()
                                      * torch.empty(0, dtype=d).element_size()),
                             dtype=torch.uint8, generator=gen).view(d).reshape(tokens, *s)
               for s, d in parts]
    ids = torch.randint(-1, 64, (tokens, topk), generator=gen)
    weights = torch.rand(tokens, topk, generator=gen)
    rows = pack_rows(tensors, ids, weights)
    assert rows.dtype == torch.uint8 and rows.shape[1] % 16 == 0
    assert rows.shape[1] - 16 < sum(t[0].numel() * t.element_size() for t in tensors) \
        + 4 * (2 * topk + 1) <= rows.shape[1]
    back, got_ids, got_w, index = unpack_rows(rows[[4, 0, 12]], parts, topk)
    for t, b in zip(tensors, back):
        assert b.dtype == t.dtype and torch.equal(b.view(torch.uint8), t[[4, 0, 12]].view(
            torch.uint8))
    assert torch.equal(got_ids, ids[[4, 0, 12]].to(torch.int32))
    assert torch.equal(got_w, weights[[4, 0, 12]])
    assert index.tolist() == [4, 0, 12]
    empty = pack_rows([t[:0] for t in tensors], ids[:0], weights[:0])  # a rank without tokens
    assert empty.shape == (0, rows.shape[1])
    assert [b.shape[1:] for b in unpack_rows(empty, parts, topk)[0]] == \
        [t.shape[1:] for t in tensors]


def test_ids_of_other_nodes_become_empty_slots():
    ids = torch.tensor([[0, 7, 8, 15], [16, 23, -1, 9]], dtype=torch.int64)
    assert localize_ids(ids, 1, 8).tolist() == [[-1, -1, 0, 7], [-1, -1, -1, 1]]
    assert localize_ids(ids, 0, 8).tolist() == [[0, 7, -1, -1], [-1, -1, -1, -1]]
    assert localize_ids(ids, 2, 8).tolist() == [[-1, -1, -1, -1], [0, 7, -1, -1]]


def test_what_this_version_does_not_carry_is_refused_by_name():
    with pytest.raises(ValueError, match="several nodes"):
        check_node_config(EPConfig(512, 4, 16, 2, 64))
    with pytest.raises(NotImplementedError, match="packed layout"):
        check_node_config(EPConfig(512, 4, 16, 2, 64, layout="sources", gpus_per_node=1))
    check_node_config(EPConfig(512, 4, 16, 2, 64, fused_shared_expert=True, gpus_per_node=1))
    check_node_config(EPConfig(512, 4, 16, 2, 64, "nvfp4", gpus_per_node=1))
    check_node_config(EPConfig(512, 4, 16, 4, 64, gpus_per_node=2))


def _valid(fmt="bf16", tokens=5):
    cfg = EPConfig(256, 2, 8, 2, 8, fmt, gpus_per_node=1)
    ids = torch.tensor([[0, 7], [3, -1], [-1, -1], [4, 5], [6, 1]][:tokens], dtype=torch.int32)
    return cfg, torch.zeros(tokens, 256, dtype=torch.bfloat16), ids, torch.rand(tokens, 2)


def test_ids_outside_the_experts_raise_a_flag_on_the_device():
    from cute_ep.nodes import flag_bad_ids

    _, _, ids, _ = _valid()
    flag = torch.zeros(1, dtype=torch.int32)
    flag_bad_ids(ids, 8, flag)
    flag_bad_ids(ids[:0], 8, flag)
    assert flag.item() == 0
    for bad in (torch.where(ids == 7, 8, ids), torch.where(ids == -1, -2, ids)):
        flag.zero_()
        flag_bad_ids(bad, 8, flag)
        flag_bad_ids(ids, 8, flag)  # a later good call keeps it
        assert flag.item() == 1


def test_node_inputs_are_checked_like_a_buffer_s():
    from cute_ep.nodes import check_node_inputs

    cpu = torch.device("cpu")
    cfg, x, ids, w = _valid()
    assert check_node_inputs(cfg, cpu, x, ids, w) == 5
    assert check_node_inputs(cfg, cpu, x, ids.long(), w) == 5
    assert check_node_inputs(cfg, cpu, x[:0], ids[:0], w[:0]) == 0
    fp8 = EPConfig(256, 2, 8, 2, 8, "fp8", gpus_per_node=1)
    codes = torch.zeros(5, 256, dtype=torch.float8_e4m3fn)
    assert check_node_inputs(fp8, cpu, (codes, torch.ones(5, 2)), ids, w) == 5
    nvfp4 = EPConfig(256, 2, 8, 2, 8, "nvfp4", gpus_per_node=1)
    quads = (torch.zeros(5, 128, dtype=torch.uint8), torch.zeros(5, 16, dtype=torch.uint8))
    assert check_node_inputs(nvfp4, cpu, quads, ids, w) == 5
    bad = [
        ("x must be bf16", lambda: check_node_inputs(cfg, cpu, x.float(), ids, w)),
        ("x must be bf16", lambda: check_node_inputs(cfg, cpu, x[:, :128].contiguous(), ids, w)),
        ("contiguous", lambda: check_node_inputs(cfg, cpu, x.t().contiguous().t(), ids, w)),
        ("the layer's GPU", lambda: check_node_inputs(cfg, torch.device("cuda", 0), x, ids, w)),
        ("more than max_tokens_per_rank", lambda: check_node_inputs(
            cfg, cpu, torch.zeros(9, 256, dtype=torch.bfloat16), ids, w)),
        ("topk_ids must be int32 or int64", lambda: check_node_inputs(cfg, cpu, x, ids.float(),
                                                                      w)),
        ("topk_ids must be", lambda: check_node_inputs(cfg, cpu, x, ids[:, :1].contiguous(), w)),
        ("topk_weights must be float32", lambda: check_node_inputs(cfg, cpu, x, ids, w.double())),
        ("x codes must be", lambda: check_node_inputs(fp8, cpu, (codes.view(torch.uint8),
                                                                 torch.ones(5, 2)), ids, w)),
        ("x scales must be", lambda: check_node_inputs(fp8, cpu, (codes, torch.ones(4, 2)),
                                                       ids, w)),
        ("only for an fp8 or nvfp4 layer", lambda: check_node_inputs(
            cfg, cpu, (codes, torch.ones(5, 2)), ids, w)),
    ]
    for message, call in bad:
        with pytest.raises((TypeError, ValueError), match=message):
            call()
    with pytest.raises(NotImplementedError, match="pass topk_weights"):
        check_node_inputs(cfg, cpu, x, ids, None)
