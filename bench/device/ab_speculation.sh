#!/usr/bin/env bash
# On the GPU machine, one lease: bench_speculation.py on the built-in pair (EAGLE-3, bf16,
# 40 held-out prompts of 128 tokens, 3 runs a mode), other commits' code (each in
# .out/ab/NAME, from ab_prepare.sh) against the working tree ("head"), alternated by round
# (in reverse in even rounds: bench/device/ab_trees.sh), so that a change of plain
# decoding's speed between commits is told apart from a change of machine (sessions 25
# and 26 measured OFF's step at 0.288 and 0.321 ms, on two machines).
# bench/device/ab.sh is the same for bench_step_costs.py. Carry ".whl" and ".out"; limit 600 s:
#     ROUNDS=2 bash bench/device/ab_speculation.sh [bench_speculation.py's mode flags]
# The flags default to --shapes auto-off (OFF, and AUTO requests under a policy that never
# speculates). ab_prepare.sh leaves the commits' built-in weights out: every tree serves
# the working tree's. Everything goes to $OUT/ab_spec.log.
set -uo pipefail
source bench/device/setup.sh
source bench/device/ab_trees.sh
rounds=${ROUNDS:-2}
modes=("$@")
if [ "${#modes[@]}" -eq 0 ]; then modes=(--shapes auto-off); fi
for which in "${trees[@]}"; do  # every tree serves the working tree's built-in weights
    if [ "$which" != head ]; then
        rm -rf "${src[$which]}/splitspec/builtin/models"
        ln -s "$root/splitspec/builtin/models" "${src[$which]}/splitspec/builtin/models"
    fi
done
for i in $(seq 1 "$rounds"); do
    round_order "$i"
    for which in "${order[@]}"; do
        rev=$(cat "${src[$which]}/REV" 2>/dev/null || echo the working tree)
        echo "== round $i, $which ($rev)" | tee -a "$OUT/ab_spec.log"
        (cd "${src[$which]}/bench" && PYTHONPATH="$root/.site:${src[$which]}" timeout 240 \
            python3 -u bench_speculation.py --start --draft-kind eagle3 --device cuda \
            --dtype bfloat16 --prompts heldout --num-prompts 40 --max-new-tokens 128 \
            --repeats 3 "${modes[@]}") >> "$OUT/ab_spec.log" 2>&1
        echo "$which: rc $?" | tee -a "$OUT/ab_spec.log"
    done
done
grep -E "^==|: rc |tok/s|plain step" "$OUT/ab_spec.log" | grep -v -E " (INFO|WARNING) "
save_kernel_cache
