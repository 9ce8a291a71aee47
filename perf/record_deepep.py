"""A JSON record of a DeepEP baseline run, beside the `cute-ep bench` record of the same lease.

    python perf/record_deepep.py DEEPEP_LOG --beside perf/results/bench-<date>-<N>xH200.json

DEEPEP_LOG is the output of DeepEP's `tests/test_intranode.py --num-processes N` (the shape it
runs is printed on its `[config]` line: 4096 tokens per rank, H 7168, top-8 of 256 experts, the
same as `cute-ep bench`). The record keeps the correctness cases it passed and its tuned best
dispatch (FP8, BF16) and combine: SMs, time and its NVL GB/s, and names the bench record it
stands beside (date, device, GPU count copied from it). Written next to that record as
`deepep-<date>-<N>xH200.json`.

Or the output of its `tests/test_low_latency.py` (decode: 128 tokens per rank by default):
every rank's dispatch and combine times (its "Dispatch bandwidth ... | Combine bandwidth" line,
FP8 dispatch), its dispatch + combine time and the send / receive split of each, with the
slowest rank's as the headline; written as `deepep-ll-<date>-<N>xH200.json`. `--face` records
the same logs of DeepEP's tests run against `cute_ep.deepep` (`perf/deepep_test.sh`), written as
`deepep_face-...` / `deepep_face-ll-...`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

_CONFIG = re.compile(r"\[config\] num_tokens=(\d+), hidden=(\d+), num_topk=(\d+)")
_BEST = re.compile(r"\[tuning\] Best (dispatch \((\w+)\)|combine): SMs (\d+), NVL chunk (\d+)"
                   r"[,:]? ([\d.]+) GB/s \(NVL\), t: ([\d.]+) us")
# A case's verdict ends its line, on the case's own line or a later one when other output (a
# warning on stderr) came in between, never past the next case.
_CASE = re.compile(r"^\[testing\] Running with [^\n]*?\.\.\.(?:(?!^\[testing\])[\s\S])*?"
                   r"\b(passed|failed)$", re.MULTILINE)
_LL_BOTH = re.compile(r"\[rank (\d+)\] Dispatch \+ combine bandwidth: ([\d.]+) GB/s, "
                      r"avg_t=([\d.]+) us")
_LL_EACH = re.compile(r"\[rank (\d+)\] Dispatch bandwidth: ([\d.]+) GB/s, avg_t=([\d.]+) us \| "
                      r"Combine bandwidth: ([\d.]+) GB/s, avg_t=([\d.]+) us")
_LL_SPLIT = re.compile(r"\[rank (\d+)\] Dispatch send/recv time: ([\d.]+) \+ ([\d.]+) us \| "
                       r"Combine send/recv time: ([\d.]+) \+ ([\d.]+) us")


def parse_low_latency(text: str) -> dict:
    """Every rank's figures of a test_low_latency log, and the slowest rank's."""
    ranks: dict[int, dict] = {}
    for m in _LL_BOTH.finditer(text):
        ranks.setdefault(int(m.group(1)), {})["dispatch_combine_us"] = float(m.group(3))
    for m in _LL_EACH.finditer(text):
        ranks.setdefault(int(m.group(1)), {}).update(
            dispatch_us=float(m.group(3)), dispatch_gbps=float(m.group(2)),
            combine_us=float(m.group(5)), combine_gbps=float(m.group(4)))
    for m in _LL_SPLIT.finditer(text):
        ranks.setdefault(int(m.group(1)), {}).update(
            dispatch_send_us=float(m.group(2)), dispatch_recv_us=float(m.group(3)),
            combine_send_us=float(m.group(4)), combine_recv_us=float(m.group(5)))
    if not any("dispatch_us" in r for r in ranks.values()):
        raise ValueError("no 'Dispatch bandwidth ... | Combine bandwidth' line: not a finished "
                         "DeepEP test_low_latency log")
    timed = [r for r in ranks.values() if "dispatch_us" in r]
    return {"ranks": [ranks[k] for k in sorted(ranks)],
            "dispatch_us": max(r["dispatch_us"] for r in timed),
            "combine_us": max(r["combine_us"] for r in timed)}


def parse(text: str) -> dict:
    """The config, the correctness cases and the best results of a test_intranode log."""
    config = _CONFIG.search(text)
    if config is None:
        raise ValueError("no [config] line: not a DeepEP test_intranode log")
    best = {}
    for match in _BEST.finditer(text):
        name = "combine" if match.group(1) == "combine" else f"dispatch_{match.group(2).lower()}"
        best[name] = {"sms": int(match.group(3)), "nvl_chunk": int(match.group(4)),
                      "nvl_gbps": float(match.group(5)), "us": float(match.group(6))}
    if not best:
        raise ValueError("no [tuning] Best lines: the run did not finish")
    cases = _CASE.findall(text)
    return {"config": {"tokens": int(config.group(1)), "hidden": int(config.group(2)),
                       "topk": int(config.group(3))},
            "cases_passed": cases.count("passed"), "cases_failed": cases.count("failed"),
            "best": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--beside", required=True, help="the cute-ep bench JSON of the lease")
    parser.add_argument("--face", action="store_true",
                        help="the log is of DeepEP's test run against cute_ep.deepep")
    args = parser.parse_args()
    bench_path = Path(args.beside)
    bench = json.loads(bench_path.read_text())
    text = Path(args.log).read_text()
    low_latency = "[config]" not in text and "Dispatch bandwidth" in text
    test = "test_low_latency.py" if low_latency else "test_intranode.py"
    what = "cute_ep.deepep (DeepEP's test, its import line changed)" if args.face else \
        "DeepEP v1.2.1 " + ("(its NVSHMEM build)" if low_latency else "(intranode, no NVSHMEM)")
    record = {"baseline": f"{what}: tests/{test}", "beside": bench_path.name,
              "date": bench["date"], "device": bench["device"], "gpus": bench["gpus"],
              **(parse_low_latency(text) if low_latency else parse(text))}
    name = ("deepep_face-" if args.face else "deepep-") + ("ll-" if low_latency else "")
    out = bench_path.with_name(bench_path.name.replace("bench-", name, 1))
    out.write_text(json.dumps(record, indent=1) + "\n")
    if low_latency:
        print(f"{out}: dispatch {record['dispatch_us']:.1f} us, combine "
              f"{record['combine_us']:.1f} us (slowest rank)")
    else:
        print(f"{out}: " + ", ".join(f"{k} {v['us']:.0f} us" for k, v in record["best"].items()))


if __name__ == "__main__":
    main()
