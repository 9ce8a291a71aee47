"""The command line, in-process."""

from cute_ep.cli import main


def test_layouts_prints_the_byte_map_and_sizes(capsys):
    assert main(["layouts", "--format", "nvfp4", "--hidden", "7168", "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "4144 bytes" in out  # 3584 payload + 448 scales + 100 metadata, 16-byte aligned
    for name in ("payload", "scales", "expert_ids", "dispatch_recv", "combine_recv",
                 "row_offsets", "scales_offsets", "GPU memory per rank"):
        assert name in out


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
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit, match="2\\+ GPUs"):
            main(["bench"])


def test_bench_never_overwrites_a_record(tmp_path):
    from cute_ep.bench import record_path

    names = []
    for _ in range(3):
        path = record_path(tmp_path, "2026-11-21", "4xH200")
        path.write_text("{}")
        names.append(path.name)
    assert names == ["bench-2026-11-21-4xH200.json", "bench-2026-11-21-4xH200-2.json",
                     "bench-2026-11-21-4xH200-3.json"]
