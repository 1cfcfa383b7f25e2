#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" and ".out" carried (setup.sh):
#     bash bench/device/mps_stack.sh [bench_speculation.py flags]
# The served built-in pair on one GPU at batch 1 (bench/bench_speculation.py --start: the
# draft and the target in their own processes, ON and OFF interleaved), once as they run by
# default and once with both under an MPS daemon of the call's own (setup.sh's start_mps:
# its own pipe directory, told to quit at the end; no setting of the card changes). Output
# in $OUT/mps_stack.log, results in $OUT/mps_stack_{plain,mps}.json.
set -uo pipefail
source bench/device/setup.sh > /dev/null
run() {  # (label)
    (cd bench && timeout 200 python3 -u bench_speculation.py --start --device cuda \
        --dtype bfloat16 --repeats 5 --out-json "$OUT/mps_stack_$1.json" "${@:2}") 2>&1 \
        | grep -v -E " (INFO|WARNING) " | sed "s/^/$1 /"
}
{
    run plain "$@"
    if start_mps; then
        run mps "$@"
        stop_mps
    fi
} 2>&1 | tee "$OUT/mps_stack.log"
