#!/usr/bin/env bash
# On the GPU machine, from the repository root, ".whl" and ".out" carried (setup.sh):
#     bash bench/device/host_cold.sh
# Does this host run a step's host code slower right after a wait than in a loop? On the
# development VM a unit of step-like host work takes 2-4x longer right after a sleep of
# 0.2-1 ms, and the engine's plain batch-1 step (bench_engine_host.py) 49 us in a loop
# against 120-200 us after a 1 ms sleep (docs/benchmarks.md, forty-sixth part). Served,
# every step starts after a wait (the draft's reply, the device), and the served stack's
# steps take about 0.3 ms more host time than the same calls in a loop on a GPU host
# (forty-fifth part). Runs bench/device/wake_cost.py (free, then pinned to one core), the
# engine bench with and without --idle-us, then profile_served.sh (the served pair with the
# target's engine thread profiled). The engine bench also sends each step's events through
# gRPC threads beside the engine and through a pipe to another process (--sinks; on the VM
# the pipe costs nothing and the gRPC threads 50-250 us a step: forty-seventh part).
# Everything in $OUT (host_cold.log, profile_served.log).
# Run in session 61 on an H100 host: a wait slows the code after it only 1.1-1.3x there;
# session 62's H100 host (its wake_cost and engine rows alone): 2.6x, as on the VM.
set -uo pipefail
source bench/device/setup.sh > /dev/null
{
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\)|MHz|Hypervisor"
    echo "kdamond threads (the kernel's memory-access monitor, which runs on the VM): $(pgrep -c kdamond)"
    python3 bench/device/wake_cost.py
    echo "pinned to core 3:"
    taskset -c 3 python3 bench/device/wake_cost.py
    for idle in 0 1000; do
        python3 bench/bench_engine_host.py --batch 1 --modes off,tree --steps 600 \
            --repeats 3 --idle-us "$idle" --sinks memory,pipe,grpc | tail -7
    done
} 2>&1 | tee "$OUT/host_cold.log"
bash bench/device/profile_served.sh "$@" > /dev/null 2>&1
grep -E "^target|^  (OFF|tree)|step:" "$OUT/profile_served.log" | cut -c1-300
