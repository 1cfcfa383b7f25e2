# Source on the GPU machine (the device tool's run), from the repository root, with ".whl"
# (bench/device/wheels.sh) and optionally ".out" carried:
#     source bench/device/setup.sh
# Unpacks the carried packages (.whl/site.txz) into .site (there is no index there), puts
# .site and the repository on PYTHONPATH, and points flashinfer's JIT cache and Triton's
# kernel cache into .fiws, restored from .out/fiws.txz when carried (flashinfer's kernels
# linked where it loads them without a build: aot_links.sh). save_kernel_cache
# writes .fiws back to $OUT/fiws.txz: copy it to .out/ here for the next call.
# A script that sources this and then runs another that sources it too (host_cold.sh runs
# profile_served.sh) unpacks once: SPLITSPEC_DEVICE_SETUP, exported, names the folder it
# was done in, and lives only as long as the call's processes.
if [ "${SPLITSPEC_DEVICE_SETUP:-}" != "$PWD" ]; then
    mkdir -p .site && tar -xJf .whl/site.txz -C .site --strip-components=1
    export PYTHONPATH="$PWD/.site:$PWD"
    export FLASHINFER_WORKSPACE_BASE="$PWD/.fiws"
    export TRITON_CACHE_DIR="$PWD/.fiws/triton"
    mkdir -p .fiws
    if [ -f .out/fiws.txz ]; then tar -xJf .out/fiws.txz -C .fiws; fi
    source bench/device/aot_links.sh
    link_cached_kernels .site .fiws
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
    python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())"
    export SPLITSPEC_DEVICE_SETUP="$PWD"
fi

# bench_concurrency.py's flags for the 8B shape with RANDOM weights and the replay draft at
# the trained pair's acceptance (corrupt 0.18) carrying an EAGLE-3 head of the 8B shape as
# its cost (forty-eighth to fifty-third parts of docs/benchmarks.md), ragged lengths: what
# costhead.sh, pinning.sh and sweep_8b.sh run, each adding its concurrencies, modes, rounds
# and --machine. (Set on every source, as the helpers below are: an array is not exported.)
COSTHEAD_8B=(--start --device cuda --dtype bfloat16 --random-8b --draft-kind replay
    --replay-corrupt-rate 0.18 --replay-cost-head --prompts heldout --max-new-tokens 48
    --max-context 256 --feature-memory-mb 256 --new-tokens-spread 0.5)

save_kernel_cache() {  # (written aside, then renamed: a call that runs out of time while it
    # compresses leaves no truncated archive to be carried into the next call)
    tar -cJf "$OUT/fiws.txz.part" --exclude='*.o' --exclude='*.cuda.o' -C .fiws . \
        && mv "$OUT/fiws.txz.part" "$OUT/fiws.txz" && ls -la "$OUT/fiws.txz"
}

start_mps() {  # an MPS daemon of this call's own: its own pipe and log folders, so only the
    # processes started after this (which inherit CUDA_MPS_PIPE_DIRECTORY) use it; it changes
    # no setting of the card. Returns non-zero, saying why, where there is none to start.
    if ! command -v nvidia-cuda-mps-control > /dev/null; then
        echo "no nvidia-cuda-mps-control on this machine: no MPS runs"; return 1
    fi
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/splitspec-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/splitspec-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "the MPS daemon did not start"; return 1; }
}

stop_mps() {  # tell start_mps's daemon to quit; its control log's last lines
    echo quit | nvidia-cuda-mps-control
    sleep 1
    tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
