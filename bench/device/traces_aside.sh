#!/usr/bin/env bash
# Here, around device calls: the step traces in bench/results (*.jsonl.gz, tracked; about
# 40 MB of the tree's 66) are more than a device call's working tree can carry beside the
# carried .whl and .out (64 MiB in all; the GPU benches do not read them). "aside" moves them
# to /tmp/splitspec-traces (the checkout then shows them deleted), "back" restores them, and
# either prints what a call would then send: the files git sees in the tree plus .whl and
# .out.
#     bash bench/device/traces_aside.sh aside   # before the calls
#     bash bench/device/traces_aside.sh back    # after them, before committing
set -euo pipefail
cd "$(dirname "$0")/../.."
stash=/tmp/splitspec-traces
case "${1:-}" in
    aside)
        mkdir -p "$stash"
        shopt -s nullglob
        traces=(bench/results/*.jsonl.gz)
        if [ "${#traces[@]}" -gt 0 ]; then mv "${traces[@]}" "$stash/"; fi
        echo "moved ${#traces[@]} traces to $stash" ;;
    back)
        shopt -s nullglob
        kept=("$stash"/*.jsonl.gz)
        if [ "${#kept[@]}" -gt 0 ]; then mv "${kept[@]}" bench/results/; fi
        echo "restored ${#kept[@]} traces" ;;
    *)
        echo "usage: bash bench/device/traces_aside.sh aside|back"; exit 2 ;;
esac
# (the tracked files moved aside are listed too: stat skips them)
tree=$({ git ls-files -z --cached --others --exclude-standard \
    | xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
carried=$(du -sb .whl .out 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "a device call would send $(( (tree + carried) / 1048576 )) MiB (the tree $(( tree / 1048576 )), .whl and .out $(( carried / 1048576 ))); the limit is 64"
