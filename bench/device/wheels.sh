#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what the GPU machine lacks, for Python 3.12 on x86-64:
# flashinfer and its two runtime packages, grpcio 1.85.1 (the generated code needs it; the
# machine has 1.84), grpc health/reflection, OpenTelemetry.
# flashinfer's wheel (62 MB) is trimmed to its attention sources (about 31 MB) so the
# working tree plus .whl stays under the device tool's 64 MiB carry limit.
# Run here (not on the device), then carry ".whl" (and ".out" for the kernel cache):
#     bash bench/device/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d .whl \
    flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 grpcio==1.85.1 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
    opentelemetry-exporter-otlp-proto-common opentelemetry-proto \
    opentelemetry-semantic-conventions googleapis-common-protos
python3 bench/device/trim_flashinfer.py .whl/flashinfer_python-*.whl
du -sh .whl
