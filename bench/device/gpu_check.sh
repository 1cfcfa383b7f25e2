#!/usr/bin/env bash
# One device call's worth of checks on the GPU machine, from the repository root, with
# ".whl" and ".out" carried (bench/device/setup.sh):
#     bash bench/device/gpu_check.sh [RUNS]
# The engine's, kernels' and compile watch's GPU tests, then (only if they pass) RUNS
# (default 3) runs of bench_step_costs.py at the 8B shape; logs and each run's JSON go to
# $OUT, and the kernel caches to $OUT/fiws.txz (copy it to .out/ here for the next call).
# On a fresh machine the first pass compiles flashinfer's and Triton's kernels: about 8
# minutes for the tests without carried caches, so keep the call's limit at 600 s. A change
# to a Triton kernel misses the carried cache for all its variants: the tests then took
# 424 s (session 17), so run them alone first (RUNS 0) and the step costs in a second call.
# Each step-cost run takes about 35 s with warm caches, up to about 3 minutes compiling.
set -uo pipefail
runs=${1:-3}
source bench/device/setup.sh
timeout 540 python3 -u -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py \
    tests/test_kernels.py tests/test_compile_watch.py > "$OUT/gpu_tests.log" 2>&1
status=$?
tail -3 "$OUT/gpu_tests.log"
if [ "$status" -eq 0 ]; then
    for i in $(seq 1 "$runs"); do
        (cd bench && timeout 200 python3 -u bench_step_costs.py --out-json "$OUT/step_costs_$i.json" \
            > "$OUT/step_costs_$i.log" 2>&1)
        echo "step costs run $i: rc $?"
        grep -E "^(target decode|target verify|draft tree|draft graph)[ :]" "$OUT/step_costs_$i.log"
    done
else
    echo "GPU tests failed (rc $status): no step costs"
fi
save_kernel_cache
