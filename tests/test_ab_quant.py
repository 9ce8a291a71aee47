"""perf/ab_quant.py: sides parse, runs become percent of copy per side, and the summary's
ranges and median changes are the runs'."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, "perf")
from ab_quant import (bench_arguments, parse_side, percent_of_copy, recorded_argv,  # noqa: E402
                      summary_rows)

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def _record(kernel, us, copy_us, i=2048, l2="zero"):
    return {"kernel": kernel, "intermediate": i, "l2": l2, "us": us, "copy_us": copy_us}


def test_a_side_is_name_tree_and_library():
    assert parse_side("main=build/tree-main:build/lib-main") == (
        "main", Path("build/tree-main"), Path("build/lib-main"))
    for bad in ("main", "main=tree", "=tree:lib", "main=:lib", "main=tree:"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_side(bad)


def test_runs_become_percent_of_copy_and_the_median_change():
    runs = {
        "main": [[_record("fused_silu_nvfp4", 40.0, 32.0), _record("quantize_nvfp4", 25.0, 20.0)],
                 [_record("fused_silu_nvfp4", 32.0, 32.0), _record("quantize_nvfp4", 20.0, 20.0)]],
        "new": [[_record("fused_silu_nvfp4", 40.0, 36.0)],
                [_record("fused_silu_nvfp4", 32.0, 32.0)]],
    }
    table = percent_of_copy(runs)
    assert table[("fused_silu_nvfp4", 2048, "zero")] == {"main": [80.0, 100.0],
                                                          "new": [90.0, 100.0]}
    assert table[("quantize_nvfp4", 2048, "zero")] == {"main": [80.0, 100.0]}
    rows = summary_rows(table, ["main", "new"])
    assert rows == [["fused_silu_nvfp4", "2048", "zero", "80.0-100.0", "90.0-100.0", "+5.0"],
                    ["quantize_nvfp4", "2048", "zero", "80.0-100.0", "-", "-"]]


FAKE_BENCH = '''
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--json") + 1]
states = [args[i + 1] for i, a in enumerate(args) if a == "--l2"]
lib = os.path.basename(os.environ["CUTE_EP_LIBRARY"])
us = {"lib-a": 40.0, "lib-b": 36.0}[lib]
records = [{"kernel": "fused_silu_nvfp4", "intermediate": 2048, "l2": s, "us": us,
            "copy_us": 32.0} for s in states]
json.dump({"device": "fake GPU", "records": records}, open(out, "w"))
'''


def test_every_side_runs_its_own_bench_with_its_library(tmp_path):
    """The orchestration end to end, with a stand-in bench that reports its library's time."""
    import json
    import subprocess

    tree = tmp_path / "tree"
    (tree / "perf").mkdir(parents=True)
    (tree / "perf" / "bench_quant.py").write_text(FAKE_BENCH)
    for lib in ("lib-a", "lib-b"):
        (tmp_path / lib).mkdir()
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [sys.executable, "perf/ab_quant.py", "--side", f"a={tree}:{tmp_path / 'lib-a'}",
         "--side", f"b={tree}:{tmp_path / 'lib-b'}", "--runs", "2", "--l2", "zero",
         "--l2", "read", "--json", str(out)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(out.read_text())
    assert got["device"] == "fake GPU"
    assert [len(got["runs"][s]) for s in ("a", "b")] == [2, 2]
    assert {r["us"] for run in got["runs"]["b"] for r in run} == {36.0}
    assert [r["l2"] for r in got["runs"]["a"][0]] == ["zero", "read"]
    assert "+8.9" in done.stdout  # 88.9% against 80.0%


def test_every_side_gets_the_same_bench_arguments():
    assert bench_arguments(None, None) == ["--l2", "zero"]
    assert bench_arguments(["zero", "read"], [2048, 7168], 512) == [
        "--l2", "zero", "--l2", "read", "--intermediate", "2048", "--intermediate", "7168",
        "--valid-rows", "512"]


def test_a_record_keeps_absolute_paths_of_the_command_line_by_their_file_names():
    argv = ["--side", "a=build/ab/tree-a:build/ab/lib-a", "--json", "/somewhere/out/ab.json",
            "--json=/elsewhere/ab2.json", "--runs", "2", "--", "--formats", "bf16"]
    assert recorded_argv(argv) == ["--side", "a=build/ab/tree-a:build/ab/lib-a", "--json",
                                   "ab.json", "--json=ab2.json", "--runs", "2", "--",
                                   "--formats", "bf16"]
