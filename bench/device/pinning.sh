#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" (and ".out") carried (setup.sh):
#     bash bench/device/pinning.sh [ROUNDS]    # FIRST_ROUND=3: a later call's rounds
# Does pinning each process of the stack to CPUs of its own change the 8B shape's ON / OFF at
# 1 and 2 streams? costhead.sh's bfloat16 command (the replay draft at corrupt 0.18 with an
# EAGLE-3 head of the 8B shape drafting every tree), ROUNDS times (default 1) each way,
# unpinned and pinned, the two alternating first. Pinned: the client (bench_concurrency.py)
# on CLIENT_CPUS (default 6,7), and, as soon as they start, every thread of the target on
# TARGET_CPUS (2,3) and of the draft on DRAFT_CPUS (4,5) (taskset -a -p; threads made later
# inherit it). Each run's log and JSON in $OUT (conc_8b_pin_<way>_<round>.{log,json}), the
# CPUs' layout in $OUT/cpus.txt, and the GPU's clocks, power and temperature every 100 ms in
# $OUT/clocks.csv (timestamps there and in the logs' "so far" lines, which come with the
# seconds since the epoch here) for telling a GPU's clocks from host work.
set -uo pipefail
source bench/device/setup.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
rounds=${1:-1}
client_cpus=${CLIENT_CPUS:-6,7} target_cpus=${TARGET_CPUS:-2,3} draft_cpus=${DRAFT_CPUS:-4,5}
{ lscpu; lscpu -e; } > "$OUT/cpus.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 > "$OUT/clocks.csv" 2>&1 &
sampler=$!

pin_when_up() {  # pin the target's and the draft's threads once each process is there
    local service cpus pid
    for service in target draft; do
        cpus=$target_cpus; [ "$service" = draft ] && cpus=$draft_cpus
        for _ in $(seq 1200); do
            pid=$(pgrep -f -- "-m ${service}_service" | head -1)
            if [ -n "$pid" ]; then
                taskset -a -p -c "$cpus" "$pid" > /dev/null && echo "pinned $service ($pid) to $cpus"
                break
            fi
            sleep 0.05
        done
    done
}

run() {  # run <way> <round>: one costhead.sh command, its output lines stamped with the time
    local way=$1 round=$2 prefix=() watcher=
    for _ in $(seq 200); do  # the last run's services gone, so that none of theirs is pinned
        pgrep -f -- "-m (target|draft)_service" > /dev/null || break
        sleep 0.1
    done
    if [ "$way" = pinned ]; then
        prefix=(taskset -c "$client_cpus")
        pin_when_up &
        watcher=$!
    fi
    (cd bench && "${prefix[@]}" python3 -u bench_concurrency.py "${COSTHEAD_8B[@]}" \
        --concurrency 1,2 --modes OFF,ON --repeats 3 --min-run-s 4 --machine "one $gpu" \
        --out-json "$OUT/conc_8b_pin_${way}_$round.json") 2>&1 \
        | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done \
        > "$OUT/conc_8b_pin_${way}_$round.log"
    local status=${PIPESTATUS[0]}
    if [ -n "$watcher" ]; then wait "$watcher"; fi
    grep -h "^[0-9.]* | [12] |" "$OUT/conc_8b_pin_${way}_$round.log"
    echo "$way $round: rc $status"
    return "$status"
}

failed=0
first=${FIRST_ROUND:-1}
for round in $(seq "$first" $((first + rounds - 1))); do
    if [ $((round % 2)) -eq 1 ]; then ways=(unpinned pinned); else ways=(pinned unpinned); fi
    for way in "${ways[@]}"; do
        run "$way" "$round" || failed=1
    done
done
kill "$sampler"
save_kernel_cache
exit "$failed"
