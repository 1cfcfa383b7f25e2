#!/usr/bin/env bash
# One device call: measure the draft's top-k kernels (splitspec/kernels/top_logprobs.py,
# top_logprobs.ROUTED on since session 23) against torch's top k, from the repository root
# with ".whl" and ".out" carried (bench/device/setup.sh), limit 600 s:
#     bash bench/device/top_logprobs.sh [RUNS]
# First bench_top_logprobs.py over its grid (vocabularies 32000 and 128256, 1-64 rows, k 4
# and 8, three blocks x two warp counts; its compiles included, a few minutes at most), then
# RUNS (default 2) rounds of bench_step_costs.py at the 8B shape, the draft's top k through
# torch (--torch-top-k) and then through the kernels, alternated. Logs and JSON go to
# $OUT; the kernel caches to $OUT/fiws.txz. Run the GPU tests (gpu_check.sh 0) first: they
# compile the kernels' test variants and check them against torch.
set -uo pipefail
runs=${1:-2}
source bench/device/setup.sh
cd bench
timeout 240 python3 -u bench_top_logprobs.py --out-json "$OUT/top_logprobs.json" \
    > "$OUT/top_logprobs.log" 2>&1
echo "bench_top_logprobs: rc $?"
sed -n '/^best per shape/,$p' "$OUT/top_logprobs.log"
for i in $(seq 1 "$runs"); do
    for mode in torch kernels; do
        if [ "$mode" = kernels ]; then flags=(); else flags=(--torch-top-k); fi
        timeout 150 python3 -u bench_step_costs.py "${flags[@]}" \
            --out-json "$OUT/step_costs_${mode}_$i.json" > "$OUT/step_costs_${mode}_$i.log" 2>&1
        echo "$mode run $i: rc $?"
        grep -E "^(target decode|draft tree|draft graph)[ :]" "$OUT/step_costs_${mode}_$i.log"
    done
done
cd ..
save_kernel_cache
