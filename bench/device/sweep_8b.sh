#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" and ".out" carried (setup.sh):
#     [REPEATS=6] bash bench/device/sweep_8b.sh CONCURRENCY [more bench_concurrency.py flags]
# The fifty-first part's sweep (docs/benchmarks.md): the 8B shape with RANDOM weights, the
# replay draft at the trained pair's acceptance (corrupt 0.18) with an EAGLE-3 head of the
# 8B shape drafting every tree (--replay-cost-head), ragged lengths, OFF, ON and adaptive,
# REPEATS rounds (default 6: a whole cycle of the balanced order for three modes) at each
# of CONCURRENCY (e.g. 1,2,4). A call of 600 s holds 1,2,4 or 8,16,32 or 64 at 6 rounds
# (sessions 67-68 on H100s: 300, 280 and 160 s with the kernels cached). Not yet run.
# Writes $OUT/conc_8b_sweep_<CONCURRENCY with _ for ,>.{json,log} and saves the kernel
# caches; join the calls' JSONs with bench_concurrency.py --join.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: [REPEATS=6] bash bench/device/sweep_8b.sh CONCURRENCY [flags]"; exit 2
fi
conc=$1
shift
repeats=${REPEATS:-6}
source bench/device/setup.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
name="conc_8b_sweep_${conc//,/_}"
(cd bench && python3 -u bench_concurrency.py "${COSTHEAD_8B[@]}" --concurrency "$conc" \
    --modes OFF,ON,adaptive --repeats "$repeats" --min-run-s 3 --machine "one $gpu" "$@" \
    --out-json "$OUT/$name.json") > "$OUT/$name.log" 2>&1
status=$?
tail -30 "$OUT/$name.log"
echo "rc $status"
save_kernel_cache
exit "$status"
