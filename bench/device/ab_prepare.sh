#!/usr/bin/env bash
# Here, before an A/B call (bench/device/ab.sh): the code of another commit, for the GPU
# machine to run beside the working tree, in .out/ab (git-ignored; carry ".out"):
#     bash bench/device/ab_prepare.sh REV
# Only what the benches read travels (no built-in weights, no bench results): about 1 MB.
set -euo pipefail
rev=${1:?usage: bench/device/ab_prepare.sh REV}
rm -rf .out/ab && mkdir -p .out/ab
git archive "$rev" splitspec target_service draft_service gateway protos bench \
    ':(exclude)splitspec/builtin/models/**/*.safetensors' ':(exclude)bench/results' | tar -x -C .out/ab
git rev-parse --short "$rev" > .out/ab/REV
echo "$(cat .out/ab/REV) in .out/ab: $(du -sh .out/ab | cut -f1)"
