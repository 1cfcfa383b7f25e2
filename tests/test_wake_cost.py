"""bench/device/wake_cost.py: a row for each wait, the waits as long as asked."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_each_wait_gets_a_row_and_lasts_at_least_what_was_asked():
    done = subprocess.run([sys.executable, "bench/device/wake_cost.py", "--rounds", "20",
                           "--waits-us", "300"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    rows = [line.strip().rsplit(maxsplit=4) for line in done.stdout.splitlines()[1:]]
    # (where torch sees a GPU, a "cuda sync" row follows)
    assert [(row[0], row[1]) for row in rows[:3]] == [("none", "0"), ("sleep", "300"),
                                                      ("spin", "300")]
    for name, us, unit, again, took in rows:
        assert float(unit) > 0 and float(again) > 0
        if name != "cuda sync":  # (a GPU sleep's length comes from a calibration)
            assert float(took) >= float(us)
