"""The performance harness, also `cute-ep bench`: see `cute_ep/tools/bench.py` for what it measures.

    python perf/bench.py [--tokens 4096] [--formats bf16,fp8,nvfp4] [--sms all,24,48,96]
                         [--iters 50] [--out perf/results]
"""

from cute_ep.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
