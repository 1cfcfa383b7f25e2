#!/usr/bin/env bash
# On the GPU machine, one lease: other commits' code (each in .out/ab/NAME, from
# ab_prepare.sh) against the working tree ("head"), alternated, so drift between machines
# and leases hits all alike:
#     bash bench/device/ab.sh [RUNS]      (carry ".whl" and ".out"; limit 600 s)
# First bench_decode_attention.py's Triton kernel at batch 1 and 8, 512 and 2048 keys, for
# each (ATTN=0 skips it); then RUNS (default 2) rounds of bench_step_costs.py (with
# COSTS_FLAGS, e.g. "--shape builtin"), the trees in name order with head last, in
# reverse in even rounds (ab_trees.sh says why). Everything printed goes to $OUT/ab.log; the JSON to
# $OUT/attn_NAME.json and $OUT/costs.json (each run's, in order); the kernel caches to
# $OUT/fiws.txz. The first
# step-cost run of a commit whose kernels are not in the carried cache compiles them (up
# to about 3 minutes). With PROFILE=1, one more step-cost run each under torch.profiler
# (--profile: per-kernel tables of 5 calls of each step, kernel counts included), packed
# into $OUT/profiles.tgz (a folder a tree); timings of those runs are not comparable. With
# TRACE=1 those runs also write each profile's Chrome trace (bench/device/kernel_gaps.py;
# $OUT/traces.tgz), and $OUT/gaps.txt says where each one's device time went between
# kernels. With LAYOUT=1, three more step-cost runs each under bench/device/pool_layout.py
# (as is, --decode-alone, --own-pools): each graph's allocations in the graphs' pool, in
# $OUT/layout.txt (and $OUT/layouts.tgz); each run's timings are in ab.log as usual.
set -uo pipefail
runs=${1:-2}
source bench/device/setup.sh
source bench/device/ab_trees.sh
for name in "${trees[@]}"; do
    echo "$name: $(cat "${src[$name]}/REV" 2>/dev/null || echo the working tree)"
done | tee "$OUT/ab.log"
bench() {  # which, timeout, script and its arguments: run from that tree's bench/
    local which=$1 limit=$2
    shift 2
    (cd "${src[$which]}/bench" && PYTHONPATH="$root/.site:${src[$which]}" timeout "$limit" \
        python3 -u "$@") >> "$OUT/ab.log" 2>&1
    echo "$which $1: rc $?" | tee -a "$OUT/ab.log"
}
if [ "${ATTN:-1}" = 1 ]; then
    for which in "${trees[@]}"; do
        bench "$which" 150 bench_decode_attention.py --variants triton --batch 1,8 \
            --context 512,2048 --out-json "$OUT/attn_$which.json"
    done
fi
mkdir -p /tmp/costs
for i in $(seq 1 "$runs"); do
    round_order "$i"
    for which in "${order[@]}"; do
        bench "$which" 240 bench_step_costs.py ${COSTS_FLAGS:-} \
            --out-json "/tmp/costs/${i}_$which.json"
    done
done
if [ "${PROFILE:-0}" = 1 ] || [ "${TRACE:-0}" = 1 ]; then
    for which in "${trees[@]}"; do
        if [ "${TRACE:-0}" = 1 ]; then
            bench "$which" 240 "$root/bench/device/kernel_gaps.py" run "/tmp/trace/$which" \
                bench_step_costs.py --profile "/tmp/prof/$which"
            python3 bench/device/kernel_gaps.py report /tmp/trace/"$which"/*.json \
                | tee -a "$OUT/gaps.txt"
        else
            bench "$which" 240 bench_step_costs.py --profile "/tmp/prof/$which"
        fi
    done
    tar -czf "$OUT/profiles.tgz" -C /tmp/prof .
    if [ "${TRACE:-0}" = 1 ]; then tar -czf "$OUT/traces.tgz" -C /tmp/trace .; fi
fi
if [ "${LAYOUT:-0}" = 1 ]; then  # where each graph's buffers land (bench/device/pool_layout.py)
    mkdir -p /tmp/layout
    for which in "${trees[@]}"; do
        for variant in default decode-alone own-pools; do
            flag=(); [ "$variant" != default ] && flag=(--"$variant")
            echo "layout $which $variant:" >> "$OUT/ab.log"
            bench "$which" 240 "$root/bench/device/pool_layout.py" run \
                "/tmp/layout/${which}_$variant.json" "${flag[@]}" bench_step_costs.py
            python3 bench/device/pool_layout.py report "/tmp/layout/${which}_$variant.json" \
                >> "$OUT/layout.txt"
        done
    done
    tar -czf "$OUT/layouts.tgz" -C /tmp/layout .
fi
python3 - "$OUT/costs.json" <<'PY'
import json, pathlib, sys
runs = [{"run": p.stem, **json.loads(p.read_text())}
        for p in sorted(pathlib.Path("/tmp/costs").glob("*.json"))]
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))
PY
grep -E "^layout |: rc [0-9]+$|us_per_layer|^target (decode|verify):|replay|^draft (tree|graph) \(" "$OUT/ab.log"
save_kernel_cache
