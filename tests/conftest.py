import importlib.util
import re
from pathlib import Path

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
# The source tree around the tests (the README, docs/, perf/, the kernels' sources). A test file
# that reads it says so with a module-level `pytestmark` naming `pytest.mark.source_tree` on one
# line; where the tests run away from the tree (the installed wheel's test run) such a file is
# not collected at all, since it may import from perf/ as it is loaded.
ROOT = Path(__file__).resolve().parent.parent
SOURCE_TREE = all((ROOT / part).exists() for part in ("README.md", "docs", "perf", "kernels"))
_SOURCE_TREE_MARK = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.source_tree\b", re.M)
_LEFT_OUT: list[str] = []


def reads_source_tree(path: Path) -> bool:
    """Whether the test file at `path` is marked as reading the source tree."""
    return path.suffix == ".py" and path.name.startswith("test_") and \
        _SOURCE_TREE_MARK.search(path.read_text()) is not None


def pytest_ignore_collect(collection_path, config):
    if not SOURCE_TREE and reads_source_tree(Path(collection_path)):
        _LEFT_OUT.append(Path(collection_path).relative_to(ROOT).as_posix())
        return True
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _LEFT_OUT:
        terminalreporter.write_line(
            f"no source tree beside the tests: {len(_LEFT_OUT)} files marked source_tree not "
            f"collected ({', '.join(sorted(_LEFT_OUT))})")


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
