#!/usr/bin/env bash
# compute-sanitizer over the GPU tests, on a machine with the GPUs and the built library:
#   bash tests/sanitize.sh [single|multi|all]   (logs under $OUT or ./sanitize-logs)
# single: every single-GPU kernel test under memcheck and under racecheck (shared memory races);
# multi:  the 2-GPU dispatch/combine tests once under memcheck (every spawned rank followed).
# A run passes when the sanitizer reports 0 errors and the tests pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export CUTE_EP_TIMEOUT_S=300  # sanitized ranks are slow; a peer wait must not time out
logs=${OUT:-sanitize-logs}
mkdir -p "$logs"
what=${1:-all}
status=0

run() {  # name tool pytest-args...
    local name=$1 tool=$2
    shift 2
    compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 99 \
        --log-file "$logs/$name.%p.log" python3 -m pytest -p no:cacheprovider -q -x "$@" \
        > "$logs/$name.pytest.txt" 2>&1
    local rc=$?
    local errors
    errors=$(cat "$logs/$name".*.log 2>/dev/null | grep -c "^========= [A-Z].*\(Invalid\|Race\|Error\)" || true)
    echo "$name ($tool): exit $rc, sanitizer error lines $errors, $(tail -1 "$logs/$name.pytest.txt")"
    [ "$rc" -eq 0 ] || status=1
}

if [ "$what" = single ] || [ "$what" = all ]; then
    single=(tests/gpu/test_block_kernels.py tests/gpu/test_nvfp4.py tests/gpu/test_silu.py
            -k "not 4096 or 2048")
    run single-memcheck memcheck "${single[@]}"
    run single-racecheck racecheck "${single[@]}"
    run ep-one-rank-memcheck memcheck tests/gpu/test_ep_inputs.py
fi
if [ "$what" = multi ] || [ "$what" = all ]; then
    run multi-memcheck memcheck tests/multigpu/test_ep.py -k "world2 and H4096-K8-E128"
fi
exit $status
