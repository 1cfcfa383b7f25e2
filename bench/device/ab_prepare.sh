#!/usr/bin/env bash
# Here, before an A/B call (bench/device/ab.sh): the code of another commit, for the GPU
# machine to run beside the working tree, in .out/ab/NAME (default "base"; git-ignored;
# carry ".out"). Prepare several names for several commits; rm -r .out/ab/NAME drops one:
#     bash bench/device/ab_prepare.sh REV [NAME]
# Only what the benches read travels (no built-in weights, no bench results): about 1 MB.
set -euo pipefail
rev=${1:?usage: bench/device/ab_prepare.sh REV [NAME]}
name=${2:-base}
if [ "$name" = head ]; then echo "head is the working tree: give another name"; exit 2; fi
dest=.out/ab/$name
rm -rf "$dest" && mkdir -p "$dest"
git archive "$rev" splitspec target_service draft_service gateway protos bench \
    ':(exclude)splitspec/builtin/models/**/*.safetensors' ':(exclude)bench/results' | tar -x -C "$dest"
git rev-parse --short "$rev" > "$dest/REV"
echo "$(cat "$dest/REV") in $dest: $(du -sh "$dest" | cut -f1)"
