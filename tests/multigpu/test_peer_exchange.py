"""The signalled peer exchange between GPUs of one host (one process per GPU)."""

import time

import pytest
import torch

from cute_ep.tools.spawn import run_ranks

pytestmark = pytest.mark.multigpu


def _payload(source: int, round_: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(source * 1_000_003 + round_)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)


def _rounds(rank, world, slot_bytes, rounds):
    from cute_ep.runtime.comm import PeerExchange

    ex = PeerExchange(slot_bytes)
    for i in range(rounds):
        group = ex.exchange(_payload(rank, i, slot_bytes))
        got = ex.received(group)
        want = torch.stack([_payload(s, i, slot_bytes) for s in range(world)])
        # Compared on the stream before the next round is launched, as the protocol requires.
        if not torch.equal(got, want):
            bad = [s for s in range(world) if not torch.equal(got[s], want[s])]
            raise AssertionError(f"round {i}: slots from ranks {bad} differ")
    ex.check()
    return ex.epochs.tolist()


@pytest.mark.parametrize("slot_bytes", [16, 16 * 4097])
def test_back_to_back_rounds_are_exact(slot_bytes):
    world = torch.cuda.device_count()
    epochs = run_ranks(_rounds, slot_bytes=slot_bytes, rounds=200)
    assert epochs == [[[100] * world] * 2] * world  # every pair signalled every round


def _graph_rounds(rank, world, replays):
    import torch.distributed as dist

    from cute_ep.runtime.comm import PeerExchange

    ex = PeerExchange(4096)
    payloads = [torch.empty(4096, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for p in payloads:  # warm-up round pair: loads the module outside the capture
        p.copy_(_payload(rank, 0, 4096))
        ex.exchange(p)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        groups = [ex.exchange(p) for p in payloads]
    for k in range(1, replays + 1):
        for j, p in enumerate(payloads):
            p.copy_(_payload(rank, 2 * k + j, 4096))
        graph.replay()
        torch.cuda.synchronize()
        ex.check()
        for j, g in enumerate(groups):
            want = torch.stack([_payload(s, 2 * k + j, 4096) for s in range(world)])
            assert torch.equal(ex.received(g), want), f"replay {k} group {g}"
        dist.barrier()  # the test reads the mailboxes outside the protocol
    return True


def test_rounds_replay_under_cuda_graph():
    assert all(run_ranks(_graph_rounds, replays=50))


def _late_rank(rank, world, timeout_s):
    from cute_ep.runtime.comm import PeerExchange, PeerTimeout

    ex = PeerExchange(256, timeout_s=timeout_s)
    if rank == world - 1:
        return "absent"
    start = time.monotonic()
    ex.exchange(_payload(rank, 0, 256))
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    try:
        ex.check("dispatch")
    except PeerTimeout as exc:
        return elapsed, str(exc)
    return elapsed, "no error"


def test_a_rank_that_never_arrives_times_out_and_is_named():
    world = torch.cuda.device_count()
    results = run_ranks(_late_rank, timeout_s=1.0)
    assert results[-1] == "absent"
    for rank, (elapsed, message) in enumerate(results[:-1]):
        assert 0.9 < elapsed < 5.0, elapsed
        assert message == (f"dispatch: rank {rank} timed out after 1 s waiting for rank "
                           f"{world - 1}")


def _mismatched(rank, world):
    from cute_ep.runtime.comm import ConfigMismatch, PeerExchange

    try:
        PeerExchange(256 if rank else 512)
    except ConfigMismatch as exc:
        return str(exc)
    return "accepted"


def test_mismatched_configs_fail_on_every_rank():
    messages = run_ranks(_mismatched)
    for m in messages:
        assert m.startswith("EP group ranks disagree on the configuration")
        assert "'slot_bytes': 512" in m and "'slot_bytes': 256" in m
