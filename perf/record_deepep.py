"""A JSON record of a DeepEP baseline run, beside the `cute-ep bench` record of the same lease.

    python perf/record_deepep.py DEEPEP_LOG --beside perf/results/bench-<date>-<N>xH200.json

DEEPEP_LOG is the output of DeepEP's `tests/test_intranode.py --num-processes N` (the shape it
runs is printed on its `[config]` line: 4096 tokens per rank, H 7168, top-8 of 256 experts, the
same as `cute-ep bench`). The record keeps the correctness cases it passed and its tuned best
dispatch (FP8, BF16) and combine: SMs, time and its NVL GB/s, and names the bench record it
stands beside (date, device, GPU count copied from it). Written next to that record as
`deepep-<date>-<N>xH200.json`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

_CONFIG = re.compile(r"\[config\] num_tokens=(\d+), hidden=(\d+), num_topk=(\d+)")
_BEST = re.compile(r"\[tuning\] Best (dispatch \((\w+)\)|combine): SMs (\d+), NVL chunk (\d+)"
                   r"[,:]? ([\d.]+) GB/s \(NVL\), t: ([\d.]+) us")
_CASE = re.compile(r"^\[testing\] Running with .* \.\.\. (passed|failed)", re.MULTILINE)


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
    args = parser.parse_args()
    bench_path = Path(args.beside)
    bench = json.loads(bench_path.read_text())
    record = {"baseline": "DeepEP v1.2.1 tests/test_intranode.py (intranode, no NVSHMEM)",
              "beside": bench_path.name, "date": bench["date"], "device": bench["device"],
              "gpus": bench["gpus"], **parse(Path(args.log).read_text())}
    out = bench_path.with_name(bench_path.name.replace("bench-", "deepep-", 1))
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{out}: " + ", ".join(f"{k} {v['us']:.0f} us" for k, v in record["best"].items()))


if __name__ == "__main__":
    main()
