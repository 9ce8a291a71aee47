"""perf/ab_bench.py: a bench record's slowest-rank times per (operation, format, SMs) and
decode, gathered per side, and the summary's ranges and median changes."""

import sys

import pytest

sys.path.insert(0, "perf")
from ab_bench import bench_times, collect, trace_rows, trace_times  # noqa: E402
from ab_quant import summary_rows  # noqa: E402

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def _rank(dispatch, combine, decode):
    sweep = [{"sms": sms, "dispatch_us": d, "combine_us": c}
             for sms, d, c in zip((24, "all"), dispatch, combine)]
    return {"formats": {"fp8": {"throughput": {"sweep": sweep, "nccl_all_to_all_us": 1.0},
                                "decode": {"graph_dispatch_us": decode[0],
                                           "graph_combine_us": decode[1]}}}}


def _record(scale=1.0):
    return {"config": {"sms_per_gpu": 132}, "gpus": 2, "device": "NVIDIA H100",
            "ranks": [_rank((400 * scale, 200.0), (300.0, 150.0), (50.0, 30.0)),
                      _rank((420 * scale, 190.0), (310.0, 160.0), (48.0, 33.0))]}


def test_a_records_times_are_its_slowest_ranks():
    assert bench_times(_record()) == {
        ("dispatch", "fp8", "24"): 420.0, ("dispatch", "fp8", "132"): 200.0,
        ("combine", "fp8", "24"): 310.0, ("combine", "fp8", "132"): 160.0,
        ("dispatch", "fp8", "decode"): 50.0, ("combine", "fp8", "decode"): 33.0}


def _traced(send_done):
    record = _record()
    for r, rank in enumerate(record["ranks"]):
        for point in rank["formats"]["fp8"]["throughput"]["sweep"]:
            point["dispatch_trace_us"] = {"send_done": send_done + r, "fence_us": 10.0 * r}
            point["combine_trace_us"] = {"end": 7.0}
    return record


def test_the_traced_calls_are_read_per_field_as_the_slowest_ranks_and_medians_per_side():
    assert trace_times(_traced(100.0))[("dispatch", "fp8", "132", "send_done")] == 101.0
    assert trace_times(_traced(100.0))[("dispatch", "fp8", "24", "fence_us")] == 10.0
    assert trace_times(_record()) == {}  # a record without traces
    rows = trace_rows({"main": [_traced(100.0), _traced(300.0), _traced(200.0)],
                       "new": [_record()]}, ["main", "new"])
    assert ["dispatch", "fp8", "24", "send_done", "201.0", "-"] in rows
    assert ["combine", "fp8", "132", "end", "7.0", "-"] in rows


def test_sides_runs_become_ranges_and_the_median_change():
    table = collect({"main": [_record(), _record(1.5)], "new": [_record(0.5), _record(0.5)]})
    assert table[("dispatch", "fp8", "24")] == {"main": [420.0, 630.0], "new": [210.0, 210.0]}
    rows = summary_rows(table, ["main", "new"])
    assert rows[0] == ["dispatch", "fp8", "24", "420.0-630.0", "210.0-210.0", "-315.0"]


def _stand_in_sides(tmp_path, cli_source: str, names: str) -> list[str]:
    """A tree per side name under tmp_path whose `cute_ep.tools.cli` is `cli_source`; the
    script's --side arguments for them (library folder lib-<name>)."""
    for side in names:
        cli = tmp_path / f"tree-{side}" / "cute_ep" / "tools" / "cli.py"
        cli.parent.mkdir(parents=True)
        for pkg in (cli.parent, cli.parent.parent):
            (pkg / "__init__.py").write_text("")
        cli.write_text(cli_source)
    return [a for s in names
            for a in ("--side", f"{s}={tmp_path / f'tree-{s}'}:{tmp_path / f'lib-{s}'}")]


def test_each_side_runs_its_own_tree_and_library_alternated(tmp_path):
    """The whole script against stand-in trees whose `cute-ep bench` writes a record of its side
    (the library it was given in CUTE_EP_LIBRARY) and logs the order of the runs; side c's
    bench fails and side d's stalls (with a process of its own) past --run-timeout: each is
    reported and not run again, d's processes are killed, and the other sides' table comes out."""
    import json
    import subprocess
    from pathlib import Path

    log = tmp_path / "order.log"
    fake = f'''
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
out = Path(argv[argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
library = os.environ["CUTE_EP_LIBRARY"]
with open({str(log)!r}, "a") as f:
    f.write(library + " " + " ".join(argv[argv.index("--out") + 2:]) + "\\n")
if library.endswith("lib-c"):
    raise SystemExit("side c breaks")
if library.endswith("lib-d"):
    import subprocess, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open({str(tmp_path / "child.pid")!r}, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
us = 100.0 if library.endswith("lib-a") else 80.0
rank = {{"formats": {{"bf16": {{"throughput": {{"nccl_all_to_all_us": 1.0, "sweep": [
    {{"sms": 24, "dispatch_us": us, "combine_us": us / 2}}]}}}}}}}}
(out / "bench-x.json").write_text(json.dumps({{"gpus": 2, "device": "GPU", "config": {{}},
                                              "ranks": [rank, rank]}}))
'''
    sides = _stand_in_sides(tmp_path, fake, "abcd")
    record = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, "perf/ab_bench.py", *sides, "--runs", "2", "--json",
                           str(record), "--run-timeout", "5", "--", "--sms", "24"],
                          capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split()[0].rsplit("-", 1)[1] for line in log.read_text().splitlines()]
    assert order == ["a", "b", "c", "d", "a", "b"]
    assert all(line.endswith(" --sms 24") for line in log.read_text().splitlines())
    kept = json.loads(record.read_text())
    runs = kept["runs"]
    assert set(runs) == {"a", "b"} and "side c breaks" in kept["failed"]["c"]
    assert "killed after 5 s" in kept["failed"]["d"]
    # The stalled side's own process is gone too (or a zombie awaiting its reaper).
    stat = Path(f"/proc/{int((tmp_path / 'child.pid').read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert "side c failed" in done.stderr
    assert [bench_times(r)[("dispatch", "bf16", "24")] for r in runs["b"]] == [80.0, 80.0]
    assert "-20.0" in done.stdout  # b's median change from a, dispatch at 24 SMs


def test_decode_kernel_times_are_rows_of_their_own_where_recorded():
    record = _record()
    for r, rank in enumerate(record["ranks"]):
        rank["formats"]["fp8"]["decode"].update(kernel_dispatch_us=30.0 + r,
                                                kernel_combine_us=20.0)
    times = bench_times(record)
    assert times[("dispatch", "fp8", "decode kernels")] == 31.0
    assert times[("combine", "fp8", "decode kernels")] == 20.0
    assert times[("dispatch", "fp8", "decode")] == 50.0  # the graph replay's, as before


def test_lockstep_times_are_rows_of_their_own_where_recorded():
    record = _record()
    for r, rank in enumerate(record["ranks"]):
        for i, point in enumerate(rank["formats"]["fp8"]["throughput"]["sweep"]):
            point.update(lockstep_dispatch_us=300.0 + 10 * r + i, lockstep_combine_us=250.0 - r)
    times = bench_times(record)
    assert times[("dispatch", "fp8", "24 lockstep")] == 310.0
    assert times[("dispatch", "fp8", "132 lockstep")] == 311.0
    assert times[("combine", "fp8", "24 lockstep")] == 250.0
    assert times[("dispatch", "fp8", "24")] == 420.0  # the barrier-timed median, as before
    assert ("dispatch", "fp8", "24 lockstep") not in bench_times(_record())


def test_a_sigterm_reports_the_runs_so_far_and_kills_the_running_side(tmp_path):
    """An outer time limit's SIGTERM while side b's bench runs: b's processes are killed, and
    the table and the record keep the runs that finished (side a's), marked stopped."""
    import json
    import signal
    import subprocess
    import time
    from pathlib import Path

    fake = f'''
import json, os, sys, time
from pathlib import Path
argv = sys.argv[1:]
out = Path(argv[argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
if os.environ["CUTE_EP_LIBRARY"].endswith("lib-b"):
    Path({str(tmp_path / "b.pid")!r}).write_text(str(os.getpid()))
    time.sleep(60)
rank = {{"formats": {{"bf16": {{"throughput": {{"nccl_all_to_all_us": 1.0, "sweep": [
    {{"sms": 24, "dispatch_us": 100.0, "combine_us": 50.0}}]}}}}}}}}
(out / "bench-x.json").write_text(json.dumps({{"gpus": 2, "device": "GPU", "config": {{}},
                                              "ranks": [rank, rank]}}))
'''
    sides = _stand_in_sides(tmp_path, fake, "ab")
    record = tmp_path / "ab.json"
    proc = subprocess.Popen([sys.executable, "perf/ab_bench.py", *sides, "--runs", "2",
                             "--json", str(record), "--", "--sms", "24"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    pid = tmp_path / "b.pid"
    for _ in range(600):
        if pid.exists() and pid.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "stopped by SIGTERM" in err and "a 1, b 0" in err
    kept = json.loads(record.read_text())
    assert kept["stopped"] is True and set(kept["runs"]) == {"a"} and len(kept["runs"]["a"]) == 1
    assert "100.0-100.0" in out  # side a's dispatch, its one run
    stat = Path(f"/proc/{int(pid.read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_side_args_reach_only_their_side_after_the_shared_arguments(tmp_path):
    """Two sides of one tree and library that differ in a bench argument (`--side-args`): each
    run of a side gets the shared arguments, then its own; the record keeps them; a --side-args
    for no --side, or twice for one, is refused before anything runs."""
    import json
    import subprocess
    from pathlib import Path

    log = tmp_path / "args.log"
    fake = f'''
import json, sys
from pathlib import Path
argv = sys.argv[1:]
out = Path(argv[argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
own = argv[argv.index("--out") + 2:]
with open({str(log)!r}, "a") as f:
    f.write(" ".join(own) + "\\n")
us = 90.0 if "--ring-chunks" in own else 100.0
rank = {{"formats": {{"bf16": {{"throughput": {{"nccl_all_to_all_us": 1.0, "sweep": [
    {{"sms": 24, "dispatch_us": us, "combine_us": us / 2}}]}}}}}}}}
(out / "bench-x.json").write_text(json.dumps({{"gpus": 2, "device": "GPU", "config": {{}},
                                              "ranks": [rank, rank]}}))
'''
    _stand_in_sides(tmp_path, fake, "a")
    tree, lib = tmp_path / "tree-a", tmp_path / "lib-a"
    sides = ["--side", f"base={tree}:{lib}", "--side", f"deep={tree}:{lib}"]
    record = tmp_path / "ab.json"
    repo = Path(__file__).resolve().parent.parent

    def run(*extra):
        return subprocess.run([sys.executable, "perf/ab_bench.py", *sides, *extra, "--runs", "1",
                               "--json", str(record), "--", "--sms", "24"],
                              capture_output=True, text=True, cwd=repo)

    done = run("--side-args", "deep=--ring-chunks 8 --stage-batches 16")
    assert done.returncode == 0, done.stdout + done.stderr
    assert log.read_text().splitlines() == ["--sms 24",
                                            "--sms 24 --ring-chunks 8 --stage-batches 16"]
    kept = json.loads(record.read_text())
    assert kept["side_args"] == {"deep": ["--ring-chunks", "8", "--stage-batches", "16"]}
    assert "-10.0" in done.stdout  # deep's median change from base
    log.unlink()
    for bad in (["--side-args", "other=--ring-chunks 8"],
                ["--side-args", "deep=--ring-chunks 8", "--side-args", "deep=--ring-chunks 4"],
                ["--side-args", "deep="]):
        done = run(*bad)
        assert done.returncode == 2 and "--side-args" in done.stderr, bad
        assert not log.exists()
