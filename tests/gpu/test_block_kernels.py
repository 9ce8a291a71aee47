"""block_memcpy and block_prefix_sum on the GPU, launched from the AOT library through the runtime."""

import pytest
import torch

import cute_ep
from cute_ep.runtime.launch import runtime

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 15, 16, 4095, 1 << 20]
GUARD = 64  # poisoned bytes past the end that no kernel may touch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _random_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("vectors", SIZES)
def test_block_memcpy_exact(vectors):
    nbytes = 16 * vectors
    src = _random_bytes(nbytes)
    dst_full = torch.full((nbytes + GUARD,), 0xA5, dtype=torch.uint8, device="cuda")
    dst = dst_full[:nbytes]
    cute_ep.block_memcpy(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    assert torch.all(dst_full[nbytes:] == 0xA5), "wrote past the end of dst"


def test_block_memcpy_reinterprets_dtypes():
    src = torch.randn(4096, 7, dtype=torch.bfloat16, device="cuda")  # 57344 bytes
    dst = torch.empty(4096 * 7 * 2 // 4, dtype=torch.float32, device="cuda")
    cute_ep.block_memcpy(dst, src)
    assert torch.equal(dst.view(torch.bfloat16).view(4096, 7), src)


@pytest.mark.parametrize("exclusive", [False, True], ids=["inclusive", "exclusive"])
@pytest.mark.parametrize("n", SIZES)
def test_block_prefix_sum_exact(n, exclusive):
    counts = torch.randint(0, 1000, (n,), dtype=torch.int32, device="cuda")
    out_full = torch.full((n + GUARD // 4,), -7, dtype=torch.int32, device="cuda")
    out = out_full[:n]
    cute_ep.block_prefix_sum(counts, exclusive=exclusive, out=out)
    want = torch.cumsum(counts.long(), 0)
    if exclusive:
        want = want - counts.long()
    torch.cuda.synchronize()
    assert torch.equal(out.long(), want)
    assert torch.all(out_full[n:] == -7), "wrote past the end of out"


def test_block_prefix_sum_wraps_like_int32():
    counts = torch.full((3000,), 1 << 30, dtype=torch.int32, device="cuda")
    out = cute_ep.block_prefix_sum(counts)
    want = torch.cumsum(counts.long(), 0)
    want = ((want + (1 << 31)) % (1 << 32) - (1 << 31)).int()
    assert torch.equal(out, want)


def test_bad_arguments_are_refused():
    x = torch.zeros(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="multiple of 16"):
        cute_ep.block_memcpy(x[:40], x[:40].clone())
    with pytest.raises(ValueError, match="16-byte aligned"):
        cute_ep.block_memcpy(x[8:40], torch.zeros(32, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="bytes"):
        cute_ep.block_memcpy(x[:32], x[:48].clone())
    with pytest.raises(TypeError, match="torch.int32"):
        cute_ep.block_prefix_sum(torch.zeros(8, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="aligned"):
        cute_ep.block_prefix_sum(torch.zeros(9, dtype=torch.int32, device="cuda")[1:])
    kernel = runtime().select("block_prefix_sum", exclusive=False)
    with pytest.raises(ValueError, match="needs 100"):
        kernel.launch(torch.zeros(8, dtype=torch.int32, device="cuda"),
                      torch.zeros(8, dtype=torch.int32, device="cuda"), 100)


def test_launches_on_the_current_stream_and_under_graph_capture():
    n = 100_003
    counts = torch.randint(0, 50, (n,), dtype=torch.int32, device="cuda")
    src = _random_bytes(16 * 5000)
    dst = torch.empty_like(src)
    out = torch.empty_like(counts)
    # Warm up outside the capture: modules load on first use.
    cute_ep.block_prefix_sum(counts, exclusive=True, out=out)
    cute_ep.block_memcpy(dst, src)

    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        cute_ep.block_memcpy(dst, src)
        cute_ep.block_prefix_sum(counts, exclusive=True, out=out)
    for _ in range(3):
        counts.copy_(torch.randint(0, 50, (n,), dtype=torch.int32, device="cuda"))
        src.copy_(_random_bytes(src.numel()))
        out.fill_(-1)
        dst.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
        assert torch.equal(out.long(), torch.cumsum(counts.long(), 0) - counts.long())

    # A non-default stream: the copy must be ordered after work queued on that stream.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = _random_bytes(16 << 20)
        copy = torch.empty_like(big)
        cute_ep.block_memcpy(copy, big)
    stream.synchronize()
    assert torch.equal(copy, big)


def test_modules_load_once_per_device():
    rt = runtime()
    a = rt.select("block_memcpy")
    b = rt.select("block_memcpy", torch.device("cuda", torch.cuda.current_device()))
    assert a is b
    assert rt.kernel(a.entry.key) is a
