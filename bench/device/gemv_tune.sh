#!/usr/bin/env bash
# One device call: tune splitspec/kernels/gemv.py's configs on the GPU, from the repository
# root with ".whl" and ".out" carried (bench/device/setup.sh), limit 600 s:
#     bash bench/device/gemv_tune.sh
# Three runs of bench/bench_gemv.py, each skipped when its variable is "skip":
#   ONE     the EAGLE-3 head's own shapes at one row (draft_qkv, draft_fc, draft_lm_head;
#           its o_proj, gate_up and down are the target's, tuned in session 20): ~120 s
#   TARGET  the target's projections, lm_head too, at 4, 9 and 16 rows (a verify of an
#           8-node tree is 9 rows; all pad to 16): ~250 s
#   HEAD    the head's own shapes at 4 and 6 rows (a tree level of topk 4; the catch-up
#           chain of depth 5 is 6 rows; its other projections pad to 16 rows as the
#           target's do, so TARGET's lines serve them): ~170 s
# and, with EXTRA set (bench_gemv options, e.g. "--shape pair_qkv=768,512 --rows 1,4"), a
# fourth. Each run's log and JSON go to $OUT; the CONFIGS and ROW_CONFIGS lines to paste
# into gemv.py to $OUT/configs.txt; the kernel caches to $OUT/fiws.txz.
set -uo pipefail
source bench/device/setup.sh
cd bench
tune() {  # name, seconds, bench_gemv options...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -u bench_gemv.py --out-json "$OUT/gemv_$name.json" "$@" \
        > "$OUT/gemv_$name.log" 2>&1
    echo "$name: rc $?"
    grep -A40 "^best per shape" "$OUT/gemv_$name.log" | grep -v "^$" | grep -v "CONFIGS"
    grep -E "^(# )?(ROW_)?CONFIGS" "$OUT/gemv_$name.log" >> "$OUT/configs.txt"
}
[ "${ONE:-}" = skip ] || tune one 120 --shapes draft_qkv,draft_fc,draft_lm_head --rows 1
[ "${TARGET:-}" = skip ] || tune target 250 --shapes qkv,o_proj,gate_up,down,lm_head --rows 4,9,16
[ "${HEAD:-}" = skip ] || tune head 170 --shapes draft_qkv,draft_fc,draft_lm_head --rows 4,6
# shellcheck disable=SC2086  # EXTRA is a list of options
[ -z "${EXTRA:-}" ] || tune extra 150 --shapes "" $EXTRA
cd ..
echo "--- configs.txt"
cat "$OUT/configs.txt"
save_kernel_cache
