"""row_expand (kernels/row_expand.py), every mode: every message lands, byte for byte, in each of
its rows, and nothing past the rows is written."""

import pytest
import torch

from cute_ep.runtime.launch import runtime

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["warps", "bulk", "mixed", "bulk2"])
@pytest.mark.parametrize("msgs,msg_bytes,copies,ctas", [(1, 16, 1, 1), (37, 14352, 3, 5),
                                                        (200, 3632, 4, 24), (64, 7184, 2, 132),
                                                        (9, 1024, 8, 2)])
def test_each_message_lands_in_each_of_its_rows(mode, msgs, msg_bytes, copies, ctas):
    torch.manual_seed(msgs + copies)
    kernel = runtime().select("row_expand", "cuda", mode=mode)
    src = torch.randint(0, 256, (msgs, msg_bytes), dtype=torch.uint8, device="cuda")
    guard = 4096
    dst = torch.full((msgs * copies * msg_bytes + guard,), 0x5A, dtype=torch.uint8,
                     device="cuda")
    kernel.launch(src, dst, msgs, msg_bytes, copies, ctas)
    torch.cuda.synchronize()
    rows = dst[:msgs * copies * msg_bytes].view(msgs, copies, msg_bytes)
    assert torch.equal(rows, src[:, None, :].expand(msgs, copies, msg_bytes))
    assert torch.all(dst[msgs * copies * msg_bytes:] == 0x5A)
