#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what the GPU machine lacks, for Python 3.12 on x86-64, as
# one installed site-packages folder packed with xz (.whl/site.txz): flashinfer and its two
# runtime packages, grpcio 1.85.1 (the generated code needs it; the machine has 1.84), grpc
# health/reflection, OpenTelemetry.
# flashinfer's wheel (62 MB) is first trimmed to its attention sources; the installed files
# packed as one xz stream take about 21 MB against 42 MB as wheels, so the working tree,
# .whl and .out stay well under the device tool's 64 MiB carry limit.
# Run here (not on the device), then carry ".whl" (and ".out" for the kernel caches):
#     bash bench/device/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --no-deps)
pip download -q "${platform[@]}" -d "$work/wheels" \
    flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 grpcio==1.85.1 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
    opentelemetry-exporter-otlp-proto-common opentelemetry-proto \
    opentelemetry-semantic-conventions googleapis-common-protos
python3 bench/device/trim_flashinfer.py "$work"/wheels/flashinfer_python-*.whl
pip install -q --no-compile "${platform[@]}" --no-index --target "$work/site" "$work"/wheels/*.whl
rm -rf .whl && mkdir -p .whl
echo "packing $(du -sh "$work/site" | cut -f1) with xz (about 2 minutes on 2 cores)"
tar -cf - -C "$work" site | xz -9e -T0 > .whl/site.txz
du -sh .whl/site.txz
