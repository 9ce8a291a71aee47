#!/usr/bin/env bash
# compute-sanitizer over the GPU tests, on a machine with the GPUs and the built library:
#   bash tests/sanitize.sh [all|single|multi|<one run's name>]   (logs under $OUT or ./sanitize-logs)
# single: every single-GPU kernel test under memcheck and under racecheck (shared memory races),
#         the one-rank EP layer under memcheck (under racecheck: ep-racecheck-<format>, by name);
# multi:  the 2-GPU dispatch/combine tests once under memcheck (every spawned rank followed).
# A run passes when the sanitizer reports 0 errors and the tests pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Sanitized ranks are slow: a peer wait must not time out, nor a test's limit per rank fire.
export CUTE_EP_TIMEOUT_S=${CUTE_EP_TIMEOUT_S:-300}
export CUTE_EP_TEST_LIMIT_S=900
logs=${OUT:-sanitize-logs}
mkdir -p "$logs"
what=${1:-all}
status=0

run() {  # name tool pytest-args...
    local name=$1 tool=$2
    shift 2
    rm -f "$logs/$name".*.log
    # API calls that fail by design are not reported: NCCL's, torch's and cuda-bindings' own
    # probes (cuGetProcAddress of symbols this driver lacks, torch's fabric-memory cuMemCreate
    # probe, NCCL's cudaFuncGetAttributes over kernels built for other GPUs) return errors on
    # every run. Every access a kernel makes is still checked.
    # racecheck lists each hazard (--racecheck-report hazard): its default analysis mode makes a
    # one-rank FP8 layer take minutes, past the test's 120 s limit per rank.
    local extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    compute-sanitizer --tool "$tool" "${extra[@]}" --target-processes all --error-exitcode 99 \
        --report-api-errors no \
        --log-file "$logs/$name.%p.log" python3 -m pytest -p no:cacheprovider -q -x "$@" \
        > "$logs/$name.pytest.txt" 2>&1
    local rc=$?
    # Each finding starts a "========= <what>" line; the summary line counts them per process.
    local findings
    findings=$(cat "$logs/$name".*.log 2>/dev/null | grep -E "^========= [A-Z]" \
               | grep -v -E "ERROR SUMMARY|COMPUTE-SANITIZER|RACECHECK SUMMARY|LEAK SUMMARY" \
               | sed -E 's/0x[0-9a-f]+/0x../g' | sort | uniq -c | sort -rn | head -20)
    echo "$name ($tool): exit $rc; $(cat "$logs/$name".*.log 2>/dev/null | grep -E "ERROR SUMMARY" \
         | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(tail -1 "$logs/$name.pytest.txt")"
    [ -n "$findings" ] && echo "$findings"
    [ "$rc" -eq 0 ] || status=1
}

single=(tests/gpu/test_block_kernels.py tests/gpu/test_nvfp4.py tests/gpu/test_silu.py
        -k "not 4096 or 2048")
want() { [ "$what" = all ] || [ "$what" = "$1" ] || [ "$what" = "$2" ]; }
want single single-memcheck && run single-memcheck memcheck "${single[@]}"
want single single-racecheck && run single-racecheck racecheck "${single[@]}"
want single ep-one-rank-memcheck && run ep-one-rank-memcheck memcheck tests/gpu/test_ep_inputs.py \
    tests/gpu/test_deepep_face.py
# Dispatch and combine's shared memory (counts, row counters, scratch, rings, scale tiles) under
# racecheck, one rank, one run per format (ep-racecheck-bf16 / -fp8 / -nvfp4): only when named,
# since a sanitized layer takes minutes.
for fmt in bf16 fp8 nvfp4; do
    [ "$what" = "ep-racecheck-$fmt" ] && run "ep-racecheck-$fmt" racecheck \
        "tests/gpu/test_ep_inputs.py::test_one_rank_layer_matches_the_reference[$fmt]"
done
want multi multi-memcheck && run multi-memcheck memcheck tests/multigpu/test_ep.py -k "world2 and H4096-K8-E128"
exit $status
