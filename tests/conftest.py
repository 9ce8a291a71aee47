import importlib.util

import pytest
import torch

from cute_ep.runtime.launch import ARCH_OF_CAPABILITY


def _supported_gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    return sum(torch.cuda.get_device_capability(i) in ARCH_OF_CAPABILITY
               for i in range(torch.cuda.device_count()))


GPUS = _supported_gpus()
HAS_DSL = importlib.util.find_spec("cutlass") is not None


def pytest_collection_modifyitems(config, items):
    skips = {
        "gpu": (GPUS < 1, "needs a Hopper (sm_90) or Blackwell (sm_100) GPU; none visible"),
        "multigpu": (GPUS < 2, f"needs 2+ supported GPUs; {GPUS} visible"),
        "build": (not HAS_DSL, "needs the CuTe DSL: pip install 'cute-ep[build]'"),
    }
    soak_asked = "soak" in (config.getoption("-m") or "")
    for item in items:
        if "soak" in item.keywords and not soak_asked:
            item.add_marker(pytest.mark.skip(reason="a soak test: run it with -m soak"))
        for marker, (skip, reason) in skips.items():
            if skip and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
