#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" carried (bench/device/setup.sh):
#     bash bench/device/handoff.sh [KERNELS ...]      (default: 40 1)
# bench/bench_gpu_handoff.py for each KERNELS: what a switch between two processes taking
# turns on one GPU adds, as the target's and the draft's do on a one-GPU stack. Then, where
# the machine has nvidia-cuda-mps-control, the same under MPS (the two processes' work
# through one shared context): a daemon of this call's own (setup.sh's start_mps), told to
# quit at the end; MPS changes no setting of the card (its compute mode stays as it is).
# Results: $OUT/handoff_k{KERNELS}[_mps].json; everything printed also in $OUT/handoff.log.
set -uo pipefail
source bench/device/setup.sh > /dev/null
kernels=("$@")
[ ${#kernels[@]} -eq 0 ] && kernels=(40 1)
run_all() {  # (suffix)
    for k in "${kernels[@]}"; do
        (cd bench && timeout 120 python3 -u bench_gpu_handoff.py --kernels "$k" \
            --out-json "$OUT/handoff_k${k}$1.json") 2>&1 | tail -1 | sed "s/^/$1 /"
    done
}
{
    nvidia-smi --query-gpu=name,compute_mode --format=csv,noheader
    run_all ""
    if start_mps; then
        run_all _mps
        stop_mps
    fi
} 2>&1 | tee "$OUT/handoff.log"
