"""bulk_send (kernels/bulk_copy.py) on one GPU: R destination buffers stand in for R ranks' receive
buffers (the kernel only sees addresses), every emulated rank sends, every byte is compared."""

import pytest
import torch

from cute_ep.runtime.launch import runtime
from layouts.transport import bulk_chunks

pytestmark = pytest.mark.gpu

CONFIGS = [(16384, 8), (8192, 12), (32768, 6)]


def _assert_all_to_all(recv, sources, per_rank, nbytes):
    """Destination d's slot s holds source s's bytes for d (`per_rank` a slot), and nothing past
    each receive buffer's `nbytes` changed from 0xA5."""
    torch.cuda.synchronize()
    ranks = sources.shape[0]
    for d in range(ranks):
        for s in range(ranks):
            got = recv[d, s * per_rank:(s + 1) * per_rank]
            assert torch.equal(got, sources[s, d * per_rank:(d + 1) * per_rank]), (d, s)
    assert torch.all(recv[:, nbytes:] == 0xA5), "wrote past the receive buffer"


@pytest.mark.parametrize("chunk_bytes,stages", CONFIGS)
@pytest.mark.parametrize("ranks,chunks,ctas", [(1, 1, 1), (1, 9, 2), (4, 5, 3), (4, 3, 24),
                                               (8, 2, 7), (8, 17, 132)])
def test_every_rank_lands_in_its_slot_of_every_destination(chunk_bytes, stages, ranks, chunks,
                                                           ctas):
    torch.manual_seed(ranks * 100 + chunks)
    kernel = runtime().select("bulk_send", "cuda", chunk_bytes=chunk_bytes, stages=stages,
                              pull=0)
    layout = bulk_chunks(chunk_bytes, chunks, ranks)
    nbytes = layout.cosize()
    guard = 4096
    recv = torch.full((ranks, nbytes + guard), 0xA5, dtype=torch.uint8, device="cuda")
    bases = torch.tensor([recv[d].data_ptr() for d in range(ranks)], dtype=torch.int64,
                         device="cuda")
    sources = torch.randint(0, 256, (ranks, nbytes), dtype=torch.uint8, device="cuda")
    for me in range(ranks):
        kernel.launch(bases, sources[me], chunks, ranks, me, ctas)
    _assert_all_to_all(recv, sources, chunk_bytes * chunks, nbytes)


@pytest.mark.parametrize("chunk_bytes,stages", [(16384, 8), (32768, 6)])
@pytest.mark.parametrize("ranks,chunks,ctas", [(1, 1, 1), (4, 5, 3), (4, 3, 24), (8, 17, 132)])
def test_pulled_chunks_land_where_pushed_ones_do(chunk_bytes, stages, ranks, chunks, ctas):
    """`pull`: every emulated rank loads its chunks from every source's buffer (laid out by
    destination) into its own (laid out by source): the same bytes as the push above."""
    torch.manual_seed(ranks * 101 + chunks)
    kernel = runtime().select("bulk_send", "cuda", chunk_bytes=chunk_bytes, stages=stages,
                              pull=1)
    nbytes = bulk_chunks(chunk_bytes, chunks, ranks).cosize()
    guard = 4096
    sources = torch.randint(0, 256, (ranks, nbytes), dtype=torch.uint8, device="cuda")
    bases = torch.tensor([sources[s].data_ptr() for s in range(ranks)], dtype=torch.int64,
                         device="cuda")
    recv = torch.full((ranks, nbytes + guard), 0xA5, dtype=torch.uint8, device="cuda")
    for me in range(ranks):
        kernel.launch(bases, recv[me], chunks, ranks, me, ctas)
    _assert_all_to_all(recv, sources, chunk_bytes * chunks, nbytes)
