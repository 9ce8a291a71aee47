"""dispatch + combine on 2 GPUs inside torch.compile(fullgraph=True): the same bytes as eager."""

import pytest

from cute_ep.tools.spawn import run_ranks
from tests.gpu.test_torch_ops import _layer_compiled

pytestmark = pytest.mark.multigpu


def test_two_ranks_compiled_layer_equals_eager():
    for rank, results in enumerate(run_ranks(_layer_compiled, world=2, limit_s=300)):
        for fmt, same in results.items():
            assert same, f"rank {rank} {fmt}: the compiled layer differs from eager"
