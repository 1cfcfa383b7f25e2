#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" and ".out" carried (setup.sh):
#     bash bench/device/mps_stack.sh [bench_speculation.py flags]
# The served built-in pair on one GPU at batch 1 (bench/bench_speculation.py --start: the
# draft and the target in their own processes, ON and OFF interleaved), once as they run by
# default and once with both under an MPS daemon of the call's own (as bench/device/
# handoff.sh starts it: its own pipe directory, told to quit at the end; no setting of the
# card changes). Output in $OUT/mps_stack.log, results in $OUT/mps_stack_{plain,mps}.json.
set -uo pipefail
source bench/device/setup.sh > /dev/null
run() {  # (label)
    (cd bench && timeout 200 python3 -u bench_speculation.py --start --device cuda \
        --dtype bfloat16 --repeats 5 --out-json "$OUT/mps_stack_$1.json" "${@:2}") 2>&1 \
        | grep -v -E " (INFO|WARNING) " | sed "s/^/$1 /"
}
{
    run plain "$@"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/splitspec-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/splitspec-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        run mps "$@"
        echo quit | nvidia-cuda-mps-control
    else
        echo "the MPS daemon did not start"
    fi
} 2>&1 | tee "$OUT/mps_stack.log"
