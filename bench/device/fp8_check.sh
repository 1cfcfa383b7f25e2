#!/usr/bin/env bash
# One device call: the draft with its projections in fp8 (the draft service's --quantize
# fp8), from the repository root with ".whl" and ".out" carried (bench/device/setup.sh),
# limit 600 s:
#     bash bench/device/fp8_check.sh [ROUNDS]
# 1. the GPU tests of fp8_rows (against its torch reference, compiled) and of the draft's
#    start-up meeting every Triton variant serving uses, with --quantize fp8 and without;
# 2. unless TUNE=skip, bench_gemv.py --fp8 over a grid at 4 rows, the EAGLE-3 head's shapes
#    at the 8B size: the FP8_CONFIGS lines for gemv.py (~120 s);
# 3. ROUNDS (default 1) rounds of bench_step_costs.py at the 8B shape, the head as loaded
#    and in fp8, the order reversed in even rounds (~50 s a run);
# 4. unless ACCEPT=skip, bench_speculation.py on the built-in pair in bfloat16: two stacks,
#    the second's draft with --quantize fp8, tokens/s and acceptance of each (~100 s).
# Logs and JSON go to $OUT, the kernel caches to $OUT/fiws.txz.
set -uo pipefail
rounds=${1:-1}
source bench/device/setup.sh
timeout 200 python3 -u -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    tests/test_gpu_engine.py -k "fp8_rows or variant_serving_uses" > "$OUT/fp8_tests.log" 2>&1
echo "GPU tests: rc $?"; tail -2 "$OUT/fp8_tests.log"
cd bench
if [ "${TUNE:-}" != skip ]; then
    timeout 150 python3 -u bench_gemv.py --fp8 --skip-bf16 --rows 4 \
        --shapes draft_qkv,o_proj,gate_up,down,draft_fc,draft_lm_head --block-n 32,64,128 \
        --block-k 256,512 --warps 4 --stages 3,4 --split-k 1,2,4 \
        --out-json "$OUT/gemv_fp8_tune.json" \
        > "$OUT/gemv_fp8_tune.log" 2>&1
    echo "tune: rc $?"; grep -A20 "^fp8 weights" "$OUT/gemv_fp8_tune.log"
fi
for i in $(seq 1 "$rounds"); do
    order="none fp8"; [ $((i % 2)) -eq 0 ] && order="fp8 none"
    for q in $order; do
        timeout 150 python3 -u bench_step_costs.py --draft-quantize "$q" \
            --out-json "$OUT/costs_${q}_$i.json" > "$OUT/costs_${q}_$i.log" 2>&1
        echo "step costs $q round $i: rc $?"
        grep -E "^(target decode|draft tree|draft graph)[ :]" "$OUT/costs_${q}_$i.log"
        grep -E "draft_over_decode|draft_graph_ms|floor" "$OUT/costs_${q}_$i.log"
    done
done
if [ "${ACCEPT:-}" != skip ]; then
    timeout 240 python3 -u bench_speculation.py --start --device cuda --dtype bfloat16 \
        --draft-flag=--quantize --draft-flag=fp8 --prompts heldout --num-prompts 24 \
        --repeats 3 --max-new-tokens 128 > "$OUT/accept_fp8.log" 2>&1
    echo "acceptance: rc $?"; grep -E "^target|^  (OFF|tree)" "$OUT/accept_fp8.log"
fi
cd ..
save_kernel_cache
