"""The command line, in-process."""

import pytest

from cute_ep.tools.cli import main

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def test_layouts_prints_the_byte_map_and_sizes(capsys):
    assert main(["layouts", "--format", "nvfp4", "--hidden", "7168", "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "4112 bytes" in out  # 3584 payload + 448 scales + 68 metadata, 16-byte aligned
    for name in ("payload", "scales", "expert_ids", "batch_headers", "combine_rings",
                 "row_offsets", "scales_offsets", "GPU memory per rank"):
        assert name in out


def test_layouts_prints_the_parts_between_nodes_when_ranks_span_nodes(capsys, monkeypatch):
    """`--gpus-per-node` below the ranks adds NodeBuffer's parts in the symmetric heap with
    their total, and the size of the node's intranode Buffer; on one node there are none."""
    from layouts import EPConfig
    from layouts.buffers import total_bytes
    from layouts.nodes import NodeSlots, node_config

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["layouts", "--ranks", "16", "--gpus-per-node", "8", "--sms", "24"]) == 0
    out = capsys.readouterr().out
    cfg = EPConfig(7168, 8, 256, 16, 4096, gpus_per_node=8)
    slots = NodeSlots(cfg)
    assert "2 nodes of 8 GPUs" in out
    for name, nbytes in slots.symmetric_bytes().items():
        assert f"{name}" in out and f"{nbytes:,}" in out
    assert f"{slots.symmetric_offsets()['total'] / 2**20:.1f} MiB" in out
    assert f"{total_bytes(node_config(cfg), 24) / 2**20:.1f} MiB per rank" in out
    assert main(["layouts", "--ranks", "8", "--gpus-per-node", "8"]) == 0
    assert "between nodes" not in capsys.readouterr().out


def test_layouts_refuses_a_bad_config(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # keep rich from wrapping the message
    assert main(["layouts", "--format", "fp8", "--hidden", "2880"]) == 2
    assert "multiple of the 128-element scale block" in capsys.readouterr().out


def test_unknown_command_prints_usage(capsys):
    assert main(["frobnicate"]) == 2
    assert "usage: cute-ep" in capsys.readouterr().err


def test_bench_refuses_too_few_iterations_and_gpus():
    import pytest
    import torch

    with pytest.raises(SystemExit, match="at least 50"):
        main(["bench", "--iters", "10"])
    with pytest.raises(SystemExit, match="unknown format"):
        main(["bench", "--formats", "bf16,int4"])
    for bad in ("0", "-3", "most"):
        with pytest.raises(SystemExit, match="--decode-sms takes"):
            main(["bench", "--decode-sms", bad])
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit, match="2\\+ GPUs"):
            main(["bench"])


def test_bench_never_overwrites_a_record(tmp_path):
    from cute_ep.tools.bench import record_path

    names = []
    for _ in range(3):
        path = record_path(tmp_path, "2026-11-21", "4xH200")
        path.write_text("{}")
        names.append(path.name)
    assert names == ["bench-2026-11-21-4xH200.json", "bench-2026-11-21-4xH200-2.json",
                     "bench-2026-11-21-4xH200-3.json"]


def test_a_record_is_named_by_the_cards_model():
    from cute_ep.tools.bench import card_name

    assert card_name("NVIDIA H100 80GB HBM3") == "H100"  # not its memory ("HBM3")
    assert card_name("NVIDIA H200") == "H200"
    assert card_name("NVIDIA B200") == "B200"
    assert card_name("Some GPU") == "GPU"


def test_bench_runs_its_worker_on_every_rank_and_records_what_they_return(tmp_path, monkeypatch):
    """The harness around the GPU work: the worker is called as `run_ranks` calls it, every
    rank's numbers (here a committed 4 x H200 record's) land in the new record in rank order,
    and a failing rank ends the run with its error."""
    import inspect
    import json
    import types
    from pathlib import Path

    import pytest
    import torch

    from cute_ep.tools import bench
    from cute_ep.tools.spawn import RanksFailed

    committed = json.loads(Path("perf/results/bench-2026-11-21-4xH200.json").read_text())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(multi_processor_count=132))

    bound = []

    def fake_run_ranks(fn, world, limit_s, bind_cpus, **kwargs):
        assert fn is bench._worker and world == 4
        inspect.signature(fn).bind(0, world, **kwargs)  # the call each rank makes
        bound.append(bind_cpus)
        return committed["ranks"]

    monkeypatch.setattr(bench, "run_ranks", fake_run_ranks)
    # The committed record's formats (records before "fp8-input" existed have these three).
    assert bench.main(["--sms", "all,24,48,96", "--formats", "bf16,fp8,nvfp4",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("bench-*-4xH200.json")
    written = json.loads(path.read_text())
    assert written["ranks"] == committed["ranks"] and written["gpus"] == 4
    assert bound == [False] and "bind_cpus" not in written["config"]
    path.unlink()
    # --bind-cpus pins the ranks (`run_ranks(bind_cpus=True)`), and the record says so.
    assert bench.main(["--sms", "all,24,48,96", "--formats", "bf16,fp8,nvfp4", "--bind-cpus",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("bench-*-4xH200.json")
    assert bound == [False, True] and json.loads(path.read_text())["config"]["bind_cpus"]

    def failing(fn, world, limit_s, **kwargs):
        raise RanksFailed("rank 2: RuntimeError: boom")

    monkeypatch.setattr(bench, "run_ranks", failing)
    with pytest.raises(SystemExit, match="benchmark failed:\nrank 2: RuntimeError: boom"):
        bench.main(["--out", str(tmp_path)])


def test_bench_times_each_step_between_its_own_events(monkeypatch):
    """`_timed_steps` with a fake clock for the CUDA events: each step's time is its own, the
    warm-ups are left out, and every iteration starts after a barrier of the group given."""
    import torch
    import torch.distributed as dist

    from cute_ep.tools import bench

    clock = [0.0]
    barriers = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms, as torch's
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(dist, "barrier", lambda group=None: barriers.append(group))
    calls = []

    def step(ms):
        def run():
            calls.append(ms)
            clock[0] += ms
        return run

    times = bench._timed_steps([step(1.0), step(3.0)], 50, torch.zeros(4), group="g")
    assert times == [[1000.0] * 50, [3000.0] * 50]
    assert calls == [1.0, 3.0] * (50 + bench.WARMUP) and barriers == ["g"] * (50 + bench.WARMUP)
    assert bench._timed(step(2.5), 50, torch.zeros(4)) == [2500.0] * 50


def test_bench_prints_the_traced_timelines_of_a_committed_record(capsys):
    """The v2 record holds a traced dispatch per budget: its timeline table is printed, one row
    per format and budget, the slowest rank's figure in each cell."""
    import json
    from pathlib import Path

    from cute_ep.tools import bench

    record = json.loads(Path("perf/results/bench-2026-11-22-4xH200-v2.json").read_text())
    formats = list(record["ranks"][0]["formats"])
    bench._print(record, formats)
    out = capsys.readouterr().out
    assert "dispatch timeline" in out
    slowest = max(r["formats"]["bf16"]["throughput"]["sweep"][0]["dispatch_trace_us"]["end"]
                  for r in record["ranks"])
    assert f"{slowest:.1f}" in out


def test_the_deepep_gather_index_puts_each_received_token_in_every_row_of_its_pairs():
    """`gather_index`: recv_x rows are messages, sources in order; the handle's rows of each
    (source, message, k) take that message's recv_x row, and unfilled rows (padding) row 0."""
    import torch

    from cute_ep.tools.bench import gather_index

    messages = torch.tensor([2, 1], dtype=torch.int32)  # source 0 sent 2 messages, source 1 one
    rows = torch.full((2, 3, 2), -1, dtype=torch.int32)  # [R, max_tokens, K]
    rows[0, 0] = torch.tensor([0, 3])  # source 0's message 0: rows 0 and 3 (two experts)
    rows[0, 1] = torch.tensor([4, -1])
    rows[1, 0] = torch.tensor([1, 5])
    rows[1, 2] = torch.tensor([6, 6])  # past source 1's count: stale, not read
    assert gather_index(messages, rows, 7).tolist() == [0, 2, 0, 0, 1, 2, 0]


def test_throughput_by_deepeps_method_is_calls_back_to_back_after_one_flush(monkeypatch,
                                                                          capsys):
    """`_lockstep_times`: one dispatch for the handle, then dispatch and combine each timed as
    DeepEP's normal-mode test does: warm-ups, one barrier and L2 flush, then the calls back to
    back between events with no barrier or synchronisation among them, the first dropped and
    the rest averaged; the throughput table prints the two columns."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from cute_ep.tools import bench

    events = []
    elapsed = iter([1.0, 0.3, 0.2, 0.1, 0.4, 0.05, 0.06, 0.07])  # ms, per call in order

    class Event:
        def __init__(self, enable_timing):
            self.ms = None

        def record(self):
            events.append("event")

        def elapsed_time(self, end):
            return next(elapsed)

    class Buf:
        def dispatch(self, x, ids, w, **quant):
            events.append("dispatch")
            return SimpleNamespace(handle="h")

        def combine(self, y, handle):
            assert handle == "h"
            events.append("combine")

        def check(self):
            events.append("check")

    class Flush:
        def zero_(self):
            events.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(dist, "barrier", lambda group=None: events.append("barrier"))
    got = bench._lockstep_times(Buf(), None, None, None, None, {}, 4, Flush())
    assert got == {"lockstep_dispatch_us": (300.0 + 200.0 + 100.0) / 3,
                   "lockstep_combine_us": (50.0 + 60.0 + 70.0) / 3}
    timed = ["event", "dispatch", "event"] * 4
    assert events == (["dispatch"] + ["dispatch"] * bench.WARMUP
                      + ["sync", "barrier", "flush"] + timed + ["sync"]
                      + ["combine"] * bench.WARMUP + ["sync", "barrier", "flush"]
                      + [e if e != "dispatch" else "combine" for e in timed] + ["sync", "check"])

    record = json.loads(Path("perf/results/bench-2026-11-26-2xH100-relaxed.json").read_text())
    for r, rank in enumerate(record["ranks"]):
        for point in rank["formats"]["fp8"]["throughput"]["sweep"]:
            point.update(lockstep_dispatch_us=301.25 + r, lockstep_combine_us=222.5)
    bench._print(record, ["fp8"])
    out = capsys.readouterr().out
    table = out[:out.index("decode:")]
    assert "lockstep" in table and "302.2" in table and "222.5" in table


def test_the_lockstep_kernel_time_is_each_familys_profiled_time_per_layer(monkeypatch, capsys):
    """`_lockstep_kernel_us` (DeepEP's low-latency method) with a stand-in profiler: an
    all-reduce after one barrier, LOCKSTEP_LAYERS layers with no barrier between them, and the
    encoder's time counted in the dispatch's; the decode table prints the two columns."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torch.profiler

    from cute_ep.tools import bench

    events = []
    item = lambda key, us: SimpleNamespace(key=key, device_time_total=us)  # noqa: E731
    items = [item("cute_ep::cutlass::encode_fp8_1", 30.0 * bench.LOCKSTEP_LAYERS),
             item("cute_ep::cutlass::dispatch_fp8_2", 90.0 * bench.LOCKSTEP_LAYERS),
             item("cute_ep::cutlass::combine_3", 40.0 * bench.LOCKSTEP_LAYERS),
             item("void at::native::vectorized_elementwise_kernel", 1e6)]

    class Profile:
        def __init__(self, activities):
            events.append("profile")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return items

    class Buf:
        def dispatch(self, x, ids, w, **quant):
            events.append("dispatch")
            return SimpleNamespace(handle="h")

        def combine(self, y, handle):
            events.append("combine")

        def check(self):
            events.append("check")

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: torch.zeros(2, 2))
    monkeypatch.setattr(torch, "ones", lambda *a, **k: torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(dist, "barrier", lambda group=None: events.append("barrier"))
    monkeypatch.setattr(dist, "all_reduce", lambda t: events.append("all_reduce"))
    got = bench._lockstep_kernel_us(Buf(), None, None, None, None, {})
    assert got == {"kernel_dispatch_us": 120.0, "kernel_combine_us": 40.0}
    profiled = events[events.index("profile"):]
    assert profiled[:2] == ["profile", "all_reduce"] and "barrier" not in profiled
    assert profiled[2:] == ["dispatch", "combine"] * bench.LOCKSTEP_LAYERS + ["check"]

    record = json.loads(Path("perf/results/bench-2026-11-26-2xH100-relaxed.json").read_text())
    for r, rank in enumerate(record["ranks"]):
        rank["formats"]["fp8"]["decode"].update(kernel_dispatch_us=31.5 + r,
                                                kernel_combine_us=20.25)
    bench._print(record, ["fp8"])
    out = capsys.readouterr().out
    decode = out[out.index("decode:"):]
    assert "kernel" in decode and "32.5" in decode and "20.2" in decode


def test_steady_host_time_is_calls_queued_back_to_back_after_one_barrier(monkeypatch, capsys):
    """`_host_us`, steady: one synchronisation and barrier, then the layers' dispatch and combine
    calls with nothing between them (no synchronisation, no barrier), each call's own host time
    and thread CPU time, the median of each; a layer's outputs are released after both calls,
    outside their timers; cold: the same with a synchronisation and a barrier before every
    layer; the decode table prints both host columns."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from cute_ep.tools import bench

    events = []

    class Out:
        handle = "h"

        def __del__(self):
            events.append("released")

    class Buf:
        def dispatch(self, x, ids, w, **quant):
            events.append(("dispatch", quant))
            return Out()

        def combine(self, y, handle):
            assert handle == "h"
            events.append("combine")
            return Out()

    def clocks():
        # Wall: per layer t0, t1 (dispatch), t2, t3 (combine): dispatch 10, 30, 20 us; combine
        # 5, 4, 9 us. CPU: c0, c1, c2 a layer: dispatch 8, 20, 12 us; combine 4, 3, 6 us.
        wall = iter([0.0, 10e-6, 11e-6, 16e-6, 100e-6, 130e-6, 131e-6, 135e-6,
                     200e-6, 220e-6, 221e-6, 230e-6])
        cpu = iter([0.0, 8e-6, 12e-6, 50e-6, 70e-6, 73e-6, 90e-6, 102e-6, 108e-6])
        monkeypatch.setattr(bench.time, "perf_counter", lambda: next(wall))
        monkeypatch.setattr(bench.time, "thread_time", lambda: next(cpu))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(dist, "barrier", lambda group=None: events.append("barrier"))
    quant = {"num_input_tokens": 8}
    clocks()
    got = bench._host_us(Buf(), None, None, None, None, quant, 3, barrier_each=False)
    # Medians, and the wall times' nearest-rank 10th and 90th percentiles.
    assert got == pytest.approx({"dispatch": 20.0, "combine": 5.0, "dispatch_cpu": 12.0,
                                 "combine_cpu": 4.0, "dispatch_p10": 10.0, "dispatch_p90": 30.0,
                                 "combine_p10": 4.0, "combine_p90": 9.0})
    # Both outputs are released after the combine's timer and before the next dispatch.
    layer = [("dispatch", {"num_input_tokens": 8}), "combine", "released", "released"]
    assert events == ["sync", "barrier"] + layer * 3 + ["sync"]
    # Cold: a synchronisation and a barrier before every layer.
    events.clear()
    clocks()
    got = bench._host_us(Buf(), None, None, None, None, quant, 3, barrier_each=True)
    assert got == pytest.approx({"dispatch": 20.0, "combine": 5.0, "dispatch_cpu": 12.0,
                                 "combine_cpu": 4.0, "dispatch_p10": 10.0, "dispatch_p90": 30.0,
                                 "combine_p10": 4.0, "combine_p90": 9.0})
    assert events == (["sync", "barrier"] + layer) * 3 + ["sync"]

    record = json.loads(Path("perf/results/bench-2026-11-26-2xH100-publisher.json").read_text())
    for rank in record["ranks"]:
        rank["formats"]["fp8"]["decode"].update(steady_host_dispatch_us=21.25,
                                                steady_host_combine_us=9.75)
    record["ranks"][0]["clocks"] = {"sm_mhz": 1755, "max_sm_mhz": 1980,
                                    "application_sm_mhz": 1755}
    bench._print(record, ["fp8"])
    out = capsys.readouterr().out
    table = out[out.index("decode:"):]
    assert "steady" in table and "21.2" in table and "9.8" in table
    assert "rank 0: 1755 / 1980 / 1755, rank 1: unknown" in out


def test_the_cpu_probe_is_the_median_time_of_its_fixed_loop(monkeypatch):
    """`cpu_probe_us`: each rep times the same PROBE_ADDS-addition loop; the median of the reps,
    in microseconds (a slow rep does not move it)."""
    from cute_ep.tools import bench

    starts_ends = iter([0.0, 700e-6, 1.0, 1.0 + 650e-6, 2.0, 2.0 + 1200e-6])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(starts_ends))
    assert bench.cpu_probe_us(reps=3) == pytest.approx(700.0)
    monkeypatch.undo()
    real = bench.cpu_probe_us(reps=3)
    assert 0 < real < 1e6


def test_a_rank_records_its_gpus_sm_clocks_or_none(monkeypatch):
    """`gpu_clocks` asks nvidia-smi for the GPU this process numbers `index` (through
    CUDA_VISIBLE_DEVICES) and names the three clocks; any failure gives None, never an error."""
    import subprocess
    from types import SimpleNamespace

    from cute_ep.tools import bench

    asked = []

    def run(argv, **kw):
        asked.append(argv)
        return SimpleNamespace(returncode=0, stdout="1755, 1980, 1755\n")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert bench.gpu_clocks(1, run) == {"sm_mhz": 1755, "max_sm_mhz": 1980,
                                        "application_sm_mhz": 1755}
    assert asked[0][-2:] == ["-i", "3"] and "clocks.max.sm" in asked[0][1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    bench.gpu_clocks(0, run)
    assert asked[1][-2:] == ["-i", "0"]

    def missing(argv, **kw):
        raise FileNotFoundError("nvidia-smi")

    assert bench.gpu_clocks(0, missing) is None
    assert bench.gpu_clocks(0, lambda argv, **kw: SimpleNamespace(
        returncode=0, stdout="[N/A], 1980, 1755")) is None
    assert bench.gpu_clocks(0, lambda argv, **kw: SimpleNamespace(returncode=9, stdout="")) \
        is None

    def slow(argv, **kw):
        raise subprocess.TimeoutExpired(argv, 30)

    assert bench.gpu_clocks(0, slow) is None


def test_a_traced_call_reads_only_the_channels_that_ran(monkeypatch):
    """A decode step runs fewer channels than its Buffer has: the rows of those that never
    started (start 0) are left out, so the stamps stay relative to the first channel's start;
    each stamp as the latest channel's and as the median channel's (waits: the longest and the
    median)."""
    import torch

    from cute_ep.tools import bench

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a: None)
    fields = ("start", "end", "wait_ns")
    trace = torch.tensor([[1000, 5000, 700], [2000, 9000, 300], [1500, 6000, 500], [0, 0, 0]],
                         dtype=torch.int64)
    latest, median = bench._traced(lambda on: None, lambda: trace, lambda: None, fields)
    assert latest == {"end": 8.0, "wait_us": 0.7}
    assert median == {"end": 5.0, "wait_us": 0.5}


def test_a_traced_call_runs_in_step_behind_untraced_ones(monkeypatch):
    """The traced call is queued behind TRACE_LEAD untraced calls after the barrier (so the
    ranks start it in step), and tracing is on for it alone."""
    import torch

    from cute_ep.tools import bench

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a: events.append("barrier"))
    trace = torch.tensor([[1000, 5000]], dtype=torch.int64)
    bench._traced(lambda on: events.append(f"trace {on}"), lambda: trace,
                  lambda: events.append("run"), ("start", "end"))
    assert bench.TRACE_LEAD >= 1
    assert events == ["sync", "barrier", *["run"] * bench.TRACE_LEAD, "trace True", "run",
                      "sync", "trace False"]


def test_bench_groups_the_gpus_into_nodes_on_request():
    """`--gpus-per-node` is parsed (the node run itself needs GPUs and NVSHMEM)."""
    from cute_ep.tools.bench import parser

    assert parser().parse_args([]).gpus_per_node is None
    assert parser().parse_args(["--gpus-per-node", "2"]).gpus_per_node == 2


@pytest.mark.parametrize("fmt,direct", [("bf16", False), ("bf16", True), ("fp8-input", True)])
def test_a_throughput_trace_dispatches_what_the_timed_calls_dispatch(monkeypatch, fmt, direct):
    """`_throughput` traces the dispatch it times: with `--direct-input` both read the direct
    input's rows (the layer before wrote x there), not x itself, which would be staged."""
    from types import SimpleNamespace

    import torch

    import cute_ep.ep
    from cute_ep.tools import bench

    made = {}

    def inputs(cfg, tokens, seed, fmt):
        x = torch.ones(tokens, 128)
        made["x"] = x if fmt == "bf16" else (x, torch.ones(tokens, 1))
        return made["x"], None, None, None, {}

    class Buf:
        geo = SimpleNamespace(header_bytes=0)

        def __init__(self, cfg, sms, direct_input, **geometry):
            made["buf"] = self
            self.view = (torch.zeros(8, 128), torch.zeros(8, 1)) if direct_input else None

        def input_buffer(self):
            return self.view[0] if fmt == "bf16" else self.view

    def record(step, result):
        return lambda buf, x, *rest: made.setdefault(step, x) is not None and result

    out = SimpleNamespace(handle=SimpleNamespace(messages=torch.tensor([1])),
                          row_offsets=torch.tensor([0, 1]))
    monkeypatch.setattr(cute_ep.ep, "Buffer", Buf)
    monkeypatch.setattr(bench, "_inputs", inputs)
    monkeypatch.setattr(bench, "_wire", lambda cfg, fmt, ids: (16, [torch.ones(1)]))
    monkeypatch.setattr(bench, "_layer_times",
                        record("timed", {"dispatch_us": 1.0, "combine_us": 1.0, "out": out}))
    monkeypatch.setattr(bench, "_lockstep_times", record("lockstep", {}))
    monkeypatch.setattr(bench, "_dispatch_trace", record("traced", {}))
    monkeypatch.setattr(bench, "_combine_trace", lambda *a: {})
    monkeypatch.setattr(bench, "_batches", lambda buf, tokens: 1)
    monkeypatch.setattr(bench, "_ctas", lambda buf, tokens: {})
    monkeypatch.setattr(bench, "_nccl_all_to_all", lambda *a: (1.0, 1))
    monkeypatch.setattr(bench, "_p2p_copy_us", lambda *a: None)
    monkeypatch.setattr(bench, "_gather_us", lambda *a: None)
    args = SimpleNamespace(hidden=128, topk=1, experts=2, tokens=4, direct_input=direct,
                           stage_batches=None, ring_chunks=None, iters=1)
    bench._throughput(0, 1, args, fmt, [24], None)
    assert made["timed"] is made["lockstep"] is made["traced"]
    traced = made["traced"] if fmt == "bf16" else made["traced"][0]
    if direct:  # the direct input's first rows
        assert traced.data_ptr() == made["buf"].view[0].data_ptr() and traced.shape[0] == 4
    else:
        assert made["traced"] is made["x"]
