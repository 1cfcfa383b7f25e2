"""The device scripts' shared A/B helper (bench/device/ab_trees.sh), run with bash: which
code trees an A/B call compares, and the order each round runs them in."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHOW = """set -u
source bench/device/ab_trees.sh
echo "trees ${trees[*]}"
for i in 1 2 3 4; do round_order "$i"; echo "round $i ${order[*]}"; done
echo "base ${src[base]}"
"""


def _run(root: Path) -> subprocess.CompletedProcess:
    (root / "bench" / "device").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "device" / "ab_trees.sh", root / "bench" / "device")
    return subprocess.run(["bash", "-c", SHOW], cwd=root, capture_output=True, text=True,
                          timeout=30)


def test_ab_trees_lists_prepared_commits_then_head_and_reverses_even_rounds(tmp_path):
    for name, rev in (("base", "45c9c0b"), ("older", "5d66a54")):
        (tmp_path / ".out" / "ab" / name).mkdir(parents=True)
        (tmp_path / ".out" / "ab" / name / "REV").write_text(rev)
    (tmp_path / ".out" / "ab" / "unprepared").mkdir()  # no REV: not a tree
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "trees base older head",
        "round 1 base older head", "round 2 head older base",
        "round 3 base older head", "round 4 head older base",
        f"base {tmp_path}/.out/ab/base"]


def test_ab_trees_stops_the_call_when_nothing_is_prepared(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 2
    assert "ab_prepare.sh" in done.stdout
