# Sourced by ab.sh and ab_speculation.sh, from the repository root: the code trees an A/B
# call compares. Sets root, src (name -> the tree's folder) and trees: every .out/ab/NAME
# with a REV (ab_prepare.sh) in name order, then head (the working tree); exits 2 when
# .out/ab holds none. round_order I sets order, the trees for round I: as listed in odd
# rounds, reversed in even ones. In session 29 the second of two back-to-back step-cost
# processes had the slower host in all 7 pairs, whichever commit it ran (its draft call's
# host work 1.4-2.5x the first's in six, 1.1x in one), so a fixed order charges that to
# whichever tree always comes later. It is not a rule of back-to-back processes: three runs
# of one commit in session 30 got faster run by run. Whatever its cause, alternating keeps
# it from always falling on one tree.
root=$PWD
declare -A src=([head]="$root")
trees=()
for dir in .out/ab/*/; do
    name=$(basename "$dir")
    if [ -f "$dir/REV" ] && [ "$name" != head ]; then
        src[$name]="$root/${dir%/}"
        trees+=("$name")
    fi
done
if [ "${#trees[@]}" -eq 0 ]; then
    echo "nothing in .out/ab: run bench/device/ab_prepare.sh REV [NAME] here first"
    exit 2
fi
trees+=(head)

round_order() {  # round number
    order=("${trees[@]}")
    if (( $1 % 2 == 0 )); then
        order=()
        for (( n=${#trees[@]} - 1; n >= 0; n-- )); do order+=("${trees[n]}"); done
    fi
}
