"""The README's quickstart runs as written: extracted from the README, launched with torchrun on
two GPUs (the block asserts its own result)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cute_ep.tools.spawn import SAFE_ENV

pytestmark = [pytest.mark.multigpu, pytest.mark.source_tree]  # (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", text, re.S)
    assert match, "the README has no quickstart block"
    return match.group(1)


def test_the_readme_quickstart_runs_as_written(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart())
    env = {**os.environ, **SAFE_ENV,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: \d+ rows for \d+ experts, max error", run.stdout), \
            run.stdout[-2000:]
