"""DeepEP v1.2.1's own tests/test_intranode.py against `cute_ep.deepep` on every visible GPU
(`perf/deepep_test.sh`: only its `import deep_ep` lines changed). Needs DeepEP's tests staged at
build/deepep (a DeepEP v1.2.1 source tree, of which only tests/ is used);
skipped without them."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multigpu

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "build" / "deepep" / "tests"


@pytest.mark.skipif(not (TESTS / "test_intranode.py").is_file(),
                    reason="DeepEP's tests are not staged at build/deepep/tests")
def test_deepeps_intranode_test_passes_against_cute_ep_deepep():
    gpus = torch.cuda.device_count()
    run = subprocess.run(["bash", "perf/deepep_test.sh", str(gpus), "build/deepep"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert out.count(" passed") == 24, out[-4000:]  # its 24 "[testing] ... passed" cases
    assert len(re.findall(r"\[tuning\] Best", out)) == 3, out[-4000:]
