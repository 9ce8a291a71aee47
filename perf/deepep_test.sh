#!/usr/bin/env bash
# DeepEP v1.2.1's own tests/test_intranode.py and tests/test_low_latency.py against
# cute_ep.deepep: the test files are copied from a DeepEP source tree (default build/deepep,
# staged from the baseline tarball) and their `import deep_ep` lines, and nothing else, point at
# cute_ep.deepep. Which: intranode, low_latency or both (default).
#   bash perf/deepep_test.sh [num_processes] [deepep_tree] [which]  (from the repository root)
# test_low_latency.py runs with its defaults but --num-processes (its 288 experts must split
# over the processes).
set -euo pipefail
procs=${1:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
tree=${2:-build/deepep}
which=${3:-both}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=build/deepep-face-tests
rm -rf "$work" && mkdir -p "$work"
cp "$tree"/tests/test_intranode.py "$tree"/tests/test_low_latency.py "$tree"/tests/utils.py "$work"/
sed -i 's/^import deep_ep$/import cute_ep.deepep as deep_ep/' "$work"/test_intranode.py "$work"/test_low_latency.py
diff "$tree"/tests/test_intranode.py "$work"/test_intranode.py || true
cd "$work"
export PYTHONPATH="$OLDPWD:${PYTHONPATH:-}"
if [[ $which != low_latency ]]; then
    python3 test_intranode.py --num-processes "$procs"
fi
if [[ $which != intranode ]]; then
    python3 test_low_latency.py --num-processes "$procs"
fi
