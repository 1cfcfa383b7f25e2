#!/bin/bash
# Session 55's check of the probes' lean toward the mode in use with the target and the draft
# each on a core of their own (docs/benchmarks.md, "Session 55"): a 2-stream sweep of
# bench_concurrency.py, and with PIN=1 a loop that pins every thread of the target to CPU 0
# and of the draft to CPU 1 (taskset) while it runs (the bench process itself is not pinned).
# usage: bash bench/results/pin_cores_session55.sh NAME PIN(0|1) CONCURRENCY REPEATS [OUT]
NAME=$1; PIN=$2; CONC=$3; REP=$4; OUT=${5:-/tmp}
cd "$(dirname "$0")/../.."
python bench/bench_concurrency.py --start --draft-kind eagle3 --prompts heldout \
  --concurrency "$CONC" --modes OFF,ON,adaptive --repeats "$REP" --max-new-tokens 48 \
  --min-run-s 5 --new-tokens-spread 0.5 --step-trace "$OUT/steps_$NAME.jsonl" \
  --out-json "$OUT/$NAME.json" --out-md "$OUT/$NAME.md" --out-png "$OUT/$NAME.png" \
  > "$OUT/$NAME.log" 2>&1 &
BENCH=$!
if [ "$PIN" = 1 ]; then
  while kill -0 $BENCH 2>/dev/null; do
    for p in $(pgrep -f "m target_service"); do taskset -a -cp 0 "$p" >/dev/null 2>&1; done
    for p in $(pgrep -f "m draft_service"); do taskset -a -cp 1 "$p" >/dev/null 2>&1; done
    sleep 2
  done
fi
wait $BENCH
