#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" and ".out" carried (setup.sh):
#     bash bench/device/costhead.sh [QUANTS]        # QUANTS: "bf16 fp8" (default), "bf16" or "fp8"
# The 8B shape at 1 and 2 streams, OFF against ON, with the replay draft at the trained
# pair's acceptance (corrupt 0.18) carrying an EAGLE-3 head of the target's shape as its
# cost model (bench_concurrency.py --replay-cost-head; docs/benchmarks.md, forty-eighth
# part): the speculative step with a real draft's time in it, which the replay's free trees
# left out of every 8B ratio before session 63. One run for each of QUANTS: the head in
# bfloat16, then with its projections in fp8 (--quantize fp8). Each run's log and JSON in
# $OUT (conc_8b_costhead_<quant>.{log,json}); the kernel caches saved.
set -uo pipefail
source bench/device/setup.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
failed=0
for quant in ${1:-bf16 fp8}; do
    case "$quant" in
        bf16) extra=() ;;
        fp8) extra=(--draft-flag=--quantize --draft-flag=fp8) ;;
        *) echo "costhead.sh: unknown quant '$quant' (bf16 or fp8)"; exit 2 ;;
    esac
    (cd bench && python3 -u bench_concurrency.py "${COSTHEAD_8B[@]}" "${extra[@]}" \
        --concurrency 1,2 --modes OFF,ON --repeats 3 --min-run-s 4 --machine "one $gpu" \
        --out-json "$OUT/conc_8b_costhead_$quant.json") > "$OUT/conc_8b_costhead_$quant.log" 2>&1
    status=$?
    tail -8 "$OUT/conc_8b_costhead_$quant.log"
    echo "$quant: rc $status"
    if [ "$status" -ne 0 ]; then failed=$status; fi
done
save_kernel_cache
exit "$failed"  # a failed run fails the call, after the other head's run and the caches
