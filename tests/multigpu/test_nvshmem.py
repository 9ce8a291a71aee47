"""Bytes between GPUs through NVSHMEM (`kernels.net_put`, `cute_ep.runtime.nvshmem`): each GPU a
PE bootstrapped over torch.distributed, its cubin's module initialised for NVSHMEM at load. On
one host NVSHMEM rides NVLink; the same calls cross the network between hosts."""

import pytest
import torch

from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.multigpu
pytest.importorskip("nvshmem.core", reason="the multinode extra (nvshmem4py-cu13) is not "
                                           "installed")

TIMEOUT_NS = 10_000_000_000


def _join():
    """This rank as a PE. Every PE of these tests is on this host: no network transport (the
    default would look for InfiniBand devices)."""
    import os

    from cute_ep.runtime import nvshmem

    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    return nvshmem.init()


def _payload(source: int, round_: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(source * 1_000_003 + round_)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)


def _value(expected: int) -> torch.Tensor:
    """The signal value a put waits for, in device memory (as a CUDA graph replays it)."""
    return torch.tensor([expected], dtype=torch.int64, device="cuda")


def _ring(rank, world, nbytes, rounds, ctas):
    """Rank r puts its round's bytes into rank r + 1's buffer, `ctas` CTAs each signalling once,
    then waits for rank r - 1's signals of the round: the bytes that land are r - 1's, every
    round."""
    import torch.distributed as dist

    from cute_ep.runtime import nvshmem
    from cute_ep.runtime.launch import runtime

    assert _join() == {"pe": rank, "npes": world, "device": torch.cuda.current_device()}
    assert nvshmem.init() is nvshmem.state()  # joined once
    dst = nvshmem.symmetric_bytes(nbytes)
    signal = nvshmem.symmetric_bytes(8).view(torch.int64)
    signal.zero_()
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    kernel = runtime().select("net_put")
    for i in range(1, rounds + 1):
        src = _payload(rank, i, nbytes)
        kernel.launch(dst, src, signal, error, nbytes, 0, _value(i * ctas), TIMEOUT_NS,
                      (rank + 1) % world, ctas)
        torch.cuda.synchronize()
        assert error.tolist() == [0, 0, 0, 0], f"round {i}"
        assert torch.equal(dst, _payload((rank - 1) % world, i, nbytes)), f"round {i}"
        assert int(signal.item()) == i * ctas
        dist.barrier()  # every rank has read its bytes before the next round's puts land
    nvshmem.free(dst)
    return True


@pytest.mark.parametrize("nbytes,ctas", [(16, 1), (3 * 1024 * 1024 + 16, 1),
                                         (3 * 1024 * 1024 + 7, 5), (4096, 8)])
def test_puts_with_signals_move_exact_bytes_round_after_round(nbytes, ctas):
    assert all(run_ranks(_ring, nbytes=nbytes, rounds=20, ctas=ctas, limit_s=120))


def _absent_peer(rank, world):
    import torch.distributed as dist

    from cute_ep.runtime import nvshmem
    from cute_ep.runtime.launch import runtime

    _join()
    dst = nvshmem.symmetric_bytes(256)
    signal = nvshmem.symmetric_bytes(8).view(torch.int64)
    signal.zero_()
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:  # rank 1 never puts: rank 0's wait ends at the timeout, naming it
        runtime().select("net_put").launch(dst, _payload(0, 0, 256), signal, error, 256, 0,
                                           _value(1), 200_000_000, 1, 1)
        torch.cuda.synchronize()
    dist.barrier()
    return error.tolist()


def test_a_peer_that_never_puts_is_named_not_waited_for():
    got = run_ranks(_absent_peer, limit_s=120)
    assert got[0] == [2, 0, 0, 0]  # peer 1, plus one
    assert all(g == [0, 0, 0, 0] for g in got[1:])


def _counted(rank, world, row_bytes, rows_max, ctas):
    """A slot whose int32 header says how many rows follow it: the put moves the header and
    that many rows, read on the device, and nothing past them, round after round."""
    import torch.distributed as dist

    from cute_ep.runtime import nvshmem
    from cute_ep.runtime.launch import runtime

    _join()
    nbytes = 16 + rows_max * row_bytes
    dst = nvshmem.symmetric_bytes(nbytes)
    signal = nvshmem.symmetric_bytes(8).view(torch.int64)
    signal.zero_()
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    kernel = runtime().select("net_put")
    for i, rows in enumerate((rows_max, 0, 3, rows_max - 1, 1), start=1):
        dst.fill_(0xA5)
        src = _payload(rank, i, nbytes)
        src[:4].view(torch.int32).fill_(rows)
        torch.cuda.synchronize()
        dist.barrier()
        kernel.launch(dst, src, signal, error, 16, row_bytes, _value(i * ctas), TIMEOUT_NS,
                      (rank + 1) % world, ctas)
        torch.cuda.synchronize()
        assert error.tolist() == [0, 0, 0, 0], f"round {i}"
        sent = _payload((rank - 1) % world, i, nbytes)
        sent[:4].view(torch.int32).fill_(rows)
        end = 16 + rows * row_bytes
        assert torch.equal(dst[:end], sent[:end]), f"round {i}: {rows} rows"
        assert bool((dst[end:] == 0xA5).all()), f"round {i}: bytes past {rows} rows"
        dist.barrier()
    nvshmem.free(dst)
    return True


@pytest.mark.parametrize("row_bytes,rows_max,ctas", [(1072, 64, 3), (14352, 40, 24)])
def test_a_put_of_a_slot_moves_the_rows_its_header_counts(row_bytes, rows_max, ctas):
    assert all(run_ranks(_counted, row_bytes=row_bytes, rows_max=rows_max, ctas=ctas,
                         limit_s=120))
