#!/usr/bin/env bash
# On the GPU machine, one lease: bench_concurrency.py's sweep with other commits' code (each
# in .out/ab/NAME, from ab_prepare.sh) against the working tree ("head"), one after the
# other on one machine (the order reversed in even rounds: bench/device/ab_trees.sh), so a
# policy change is told from a change of machine (OFF's runs differed by 5-10 % between
# machines in sessions 37-38, and adaptive's by 5 % between two policies that ran the same
# budgets). Carry ".whl" and ".out"; limit 600 s:
#     CONC=32 ROUNDS=1 [FIRST_ROUND=1] bash bench/device/ab_concurrency.sh [more flags]
# The sweep: the 8B shape with RANDOM weights and the replay draft at corrupt 0.18, OFF, ON
# and adaptive, 3 rounds of runs of at least 4 s at CONC (default 32) streams; the flags add
# to it (e.g. --replay-features --feature-memory-mb 256); HEAD_FLAGS adds flags to the working
# tree's sweep alone, so that a tree of the same commit (ab_prepare.sh HEAD base) is the
# control for a flag (HEAD_FLAGS="--target-flag=--defer-catch-up=16"). Each sweep starts its own stack
# (about 100 s before its first run); 1-2 concurrencies a tree fit a call for two trees.
# Writes $OUT/ab_conc.log (everything printed), and per round and tree the results
# (conc_I_NAME.json) and step traces (steps_I_NAME.jsonl.gz, which bench/simulate_policy.py
# --replay and --batches read), packed into $OUT/ab_results.tar: the device tool brings back
# at most 8 files, which two rounds of two trees would pass (tar -xf it here).
set -uo pipefail
source bench/device/setup.sh
source bench/device/ab_trees.sh
rounds=${ROUNDS:-1}
for which in "${trees[@]}"; do  # every tree tokenizes with the working tree's built-in model
    if [ "$which" != head ]; then
        rm -rf "${src[$which]}/splitspec/builtin/models"
        ln -s "$root/splitspec/builtin/models" "${src[$which]}/splitspec/builtin/models"
    fi
done
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)  # H100 or H200
first=${FIRST_ROUND:-1}  # a later call's rounds: FIRST_ROUND=2 begins with the order reversed
for i in $(seq "$first" $((first + rounds - 1))); do
    round_order "$i"
    for which in "${order[@]}"; do
        rev=$(cat "${src[$which]}/REV" 2>/dev/null || echo the working tree)
        extra=()
        if [ "$which" = head ] && [ -n "${HEAD_FLAGS:-}" ]; then
            read -r -a extra <<< "$HEAD_FLAGS"
            rev="$rev, with $HEAD_FLAGS"
        fi
        echo "== round $i, $which ($rev)" | tee -a "$OUT/ab_conc.log"
        (cd "${src[$which]}/bench" && PYTHONPATH="$root/.site:${src[$which]}" timeout 280 \
            python3 -u bench_concurrency.py --start --device cuda --dtype bfloat16 --random-8b \
            --draft-kind replay --replay-corrupt-rate 0.18 --prompts heldout \
            --max-new-tokens 48 --max-context 256 --concurrency "${CONC:-32}" \
            --modes OFF,ON,adaptive --repeats 3 --min-run-s 4 --machine "one $card" \
            --out-json "$OUT/conc_${i}_$which.json" --step-trace "/tmp/steps_${i}_$which.jsonl" \
            "$@" ${extra[@]+"${extra[@]}"}) >> "$OUT/ab_conc.log" 2>&1
        echo "$which: rc $?" | tee -a "$OUT/ab_conc.log"
        if [ -f "/tmp/steps_${i}_$which.jsonl" ]; then
            gzip -c "/tmp/steps_${i}_$which.jsonl" > "$OUT/steps_${i}_$which.jsonl.gz"
        fi
    done
done
grep -E "^==|: rc |^\| [0-9]|policy:" "$OUT/ab_conc.log" | grep -v -E " (INFO|WARNING) "
packed=$(cd "$OUT" && ls conc_*.json steps_*.jsonl.gz 2>/dev/null)
if [ -n "$packed" ]; then
    # shellcheck disable=SC2086  # (the names are the script's own: no spaces)
    (cd "$OUT" && tar -cf ab_results.tar $packed && rm -f $packed && ls -la ab_results.tar)
fi
save_kernel_cache
