"""bulk_send (kernels/bulk_copy.py) on one GPU: R destination buffers stand in for R ranks' receive
buffers (the kernel only sees addresses), every emulated rank sends, every byte is compared."""

import numpy as np
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


@pytest.mark.parametrize("mode", ["bulk", "lanes"])
def test_store_rate_writes_every_piece_of_every_cta(mode):
    """`store_rate` (perf/bench_sm_stores.py's kernel): each CTA's share, piece by piece, the
    bulk mode from its warps' shared-memory pieces, the lanes mode each piece's index % 251."""
    kernel = runtime().select("store_rate", "cuda", mode=mode)
    piece, ctas, per_cta = 4096, 5, 4096 * 19
    dst = torch.zeros(ctas * per_cta + 4096, dtype=torch.uint8, device="cuda")
    kernel.launch(dst, per_cta, ctas)
    torch.cuda.synchronize()
    got = dst[:ctas * per_cta].view(ctas, -1, piece)
    p = torch.arange(per_cta // piece, device="cuda")
    if mode == "bulk":
        smem = (torch.arange(8 * piece, device="cuda") % 251).to(torch.uint8).view(8, piece)
        want = smem[p % 8].expand(ctas, -1, -1)
    else:
        want = (p % 251).to(torch.uint8)[None, :, None].expand(ctas, -1, piece)
    assert torch.equal(got, want)
    assert not dst[ctas * per_cta:].any()  # nothing past the CTAs' shares


def test_load_rate_reads_every_word_of_every_cta_once():
    """`load_rate` (perf/bench_sm_stores.py's read kernel): each thread's XOR of the words it
    read, XORed over a CTA, is the XOR of the CTA's share, whatever the pieces' split over its
    warps; a share that is not a whole number of pieces per warp included."""
    kernel = runtime().select("load_rate", "cuda")
    ctas, per_cta = 5, 4096 * 19
    g = torch.Generator(device="cuda").manual_seed(5)
    src = torch.randint(-2**31, 2**31 - 1, (ctas * per_cta // 4,), dtype=torch.int32,
                        device="cuda", generator=g)
    sums = torch.full((ctas, 256), -1, dtype=torch.int32, device="cuda")
    kernel.launch(src.view(torch.uint8), sums, per_cta, ctas)
    torch.cuda.synchronize()
    got = np.bitwise_xor.reduce(sums.cpu().numpy(), axis=1)
    want = np.bitwise_xor.reduce(src.view(ctas, -1).cpu().numpy(), axis=1)
    assert np.array_equal(got, want)
    # One word changed changes its CTA's XOR only.
    src[3 * per_cta // 4 + 100] ^= 1 << 7
    kernel.launch(src.view(torch.uint8), sums, per_cta, ctas)
    torch.cuda.synchronize()
    changed = np.bitwise_xor.reduce(sums.cpu().numpy(), axis=1) != got
    assert changed.tolist() == [False, False, False, True, False]
