#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" and ".out" carried (setup.sh):
#     bash bench/device/profile_served.sh [bench_speculation.py flags]
# Where a served batch-1 step's host time goes on the GPU host: bench/bench_speculation.py
# --start on the built-in pair (OFF, then the tree, interleaved; more flags passed on), with
# the target's engine thread under cProfile (--profile-out, written when the bench stops the
# target); then the profile's heaviest functions by own time and by cumulative time, and
# the step split the bench prints. In process, a batch-1 decode call takes 0.078 ms of host
# time on an H100 machine; served, 0.31 ms passes before its graph's launch
# (docs/benchmarks.md, forty-fifth part). Profiling slows every call it sees, so read the
# shares, not the times; from Python 3.12 (the GPU hosts') cProfile sees every thread of the
# target, so the gRPC threads' calls are mixed in. Output in $OUT/profile_served.log, the
# profile in $OUT/engine.prof.
set -uo pipefail
source bench/device/setup.sh > /dev/null
{
    (cd bench && timeout 300 python3 -u bench_speculation.py --start --device cuda \
        --dtype bfloat16 --repeats 3 --target-flag="--profile-out=$OUT/engine.prof" "$@") 2>&1 \
        | grep -v -E " (INFO|WARNING) "
    python3 -c "
import pstats, sys
stats = pstats.Stats(sys.argv[1])
stats.sort_stats('tottime').print_stats(30)
stats.sort_stats('cumulative').print_stats(40)
stats.print_callees(r'\((_forward|run_plan|forward|plan|step)\)')
" "$OUT/engine.prof"
} 2>&1 | tee "$OUT/profile_served.log"
