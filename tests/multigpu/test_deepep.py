"""DeepEP v1.2.1's own tests/test_intranode.py and tests/test_low_latency.py against
`cute_ep.deepep` on every visible GPU (`perf/deepep_test.sh`: only their `import deep_ep` lines
changed). Needs DeepEP's tests staged at build/deepep (a DeepEP v1.2.1 source tree, of which only
tests/ is used); skipped without them."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.source_tree]  # (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "build" / "deepep" / "tests"


@pytest.mark.skipif(not (TESTS / "test_intranode.py").is_file(),
                    reason="DeepEP's tests are not staged at build/deepep/tests")
def test_deepeps_intranode_test_passes_against_cute_ep_deepep():
    gpus = torch.cuda.device_count()
    run = subprocess.run(["bash", "perf/deepep_test.sh", str(gpus), "build/deepep", "intranode"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert out.count(" passed") == 24, out[-4000:]  # its 24 "[testing] ... passed" cases
    assert len(re.findall(r"\[tuning\] Best", out)) == 3, out[-4000:]


@pytest.mark.skipif(not (TESTS / "test_low_latency.py").is_file(),
                    reason="DeepEP's tests are not staged at build/deepep/tests")
def test_deepeps_low_latency_test_passes_against_cute_ep_deepep():
    """Its checks of every (BF16, FP8, rounded and UE8M0 scales) x (hook or not) dispatch and
    (zero-copy or not) combine, then its timings: each rank prints its three lines."""
    gpus = torch.cuda.device_count()
    if 288 % gpus:
        pytest.skip(f"test_low_latency.py's 288 experts do not split over {gpus} GPUs")
    run = subprocess.run(["bash", "perf/deepep_test.sh", str(gpus), "build/deepep",
                          "low_latency"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for line in ("Dispatch + combine bandwidth", "Dispatch bandwidth", "Dispatch send/recv time"):
        assert out.count(line) == gpus, (line, out[-4000:])
