# Source on the GPU machine (the device tool's run), from the repository root, with ".whl"
# (bench/device/wheels.sh) and optionally ".out" carried:
#     source bench/device/setup.sh
# Installs the carried wheels into .site (no index there), puts .site and the repository on
# PYTHONPATH, and points flashinfer's JIT cache at .fiws, restored from .out/fiws.txz when
# carried. save_kernel_cache writes .fiws back to $OUT/fiws.txz, for the next call's .out.
python3 -m pip install -q --no-deps --no-index --target .site .whl/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH="$PWD/.site:$PWD"
export FLASHINFER_WORKSPACE_BASE="$PWD/.fiws"
mkdir -p .fiws
if [ -f .out/fiws.txz ]; then tar -xJf .out/fiws.txz -C .fiws; fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())"

save_kernel_cache() {
    tar -cJf "$OUT/fiws.txz" --exclude='*.o' --exclude='*.cuda.o' -C .fiws . && ls -la "$OUT/fiws.txz"
}
