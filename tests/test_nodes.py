"""The transport between nodes without a GPU: a token's row as it crosses the network, expert
ids made a node's, the node Buffer's config and what this version refuses."""

import pytest
import torch

from cute_ep.nodes import (check_node_config, localize_ids, node_config, pack_rows,
                           unpack_rows)
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


def test_a_node_buffer_is_the_node_s_ranks_and_experts_with_room_for_every_node_s_tokens():
    cfg = EPConfig(7168, 8, 256, 4, 4096, "fp8", gpus_per_node=1)
    inner = node_config(cfg)
    assert (inner.ranks, inner.experts, inner.max_tokens_per_rank, inner.gpus_per_node) == \
        (1, 64, 4 * 4096, None)
    assert inner.local_experts == cfg.local_experts and inner.format == "fp8"


def test_what_this_version_does_not_carry_is_refused_by_name():
    with pytest.raises(ValueError, match="several nodes"):
        check_node_config(EPConfig(512, 4, 16, 2, 64))
    with pytest.raises(NotImplementedError, match="one GPU a node so far"):
        check_node_config(EPConfig(512, 4, 16, 4, 64, gpus_per_node=2))
    with pytest.raises(NotImplementedError, match="fused shared expert"):
        check_node_config(EPConfig(512, 4, 16, 2, 64, fused_shared_expert=True,
                                   gpus_per_node=1))
    check_node_config(EPConfig(512, 4, 16, 2, 64, "nvfp4", gpus_per_node=1))
