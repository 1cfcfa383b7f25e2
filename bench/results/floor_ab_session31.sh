# Throwaway (session 31): head against base (94007d7), the served random-8B target's plain step.
set -uo pipefail
source bench/device/setup.sh
root=$PWD
start=$(date +%s)
(cd bench && PYTHONPATH="$root/.site:$root" python3 -c "
from pathlib import Path; from bench_decode_floor import random_checkpoint
print(random_checkpoint(Path('/tmp/r8b')))") 2>&1 | tail -1
echo "checkpoint after $(( $(date +%s) - start )) s"
for round in 1 2; do
  if [ $round = 1 ]; then order="head base"; else order="base head"; fi
  for t in $order; do
    if [ $t = head ]; then dir=$root; else dir=$root/.out/ab/base; fi
    if (( $(date +%s) - start > 400 )); then echo "skip $t round $round (time)"; continue; fi
    echo "== round $round $t"
    (cd "$dir/bench" && PYTHONPATH="$root/.site:$dir" timeout 200 python3 -u "$root/.out/ab/floor_ab.py" /tmp/r8b "$OUT/target_${t}_$round.log")
    grep DBG "$OUT/target_${t}_$round.log" | sed -E 's/^.*WARNING//' | tail -3
  done
done
