"""bench/bench_draft_host.py: the draft call's host work over the graphed path with the
replay stubbed, every timed call checked to have taken the stand-in graph."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_bench(tmp_path, *args: str) -> tuple[str, list[float]]:
    """The bench's output and its us-a-call figures (one a repeat), on the built-in shape."""
    out = tmp_path / "draft_host.json"
    done = subprocess.run([sys.executable, "bench/bench_draft_host.py", "--context", "40", *args,
                           "--out-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    return done.stdout, json.loads(out.read_text())["us_per_call"]


def test_the_bench_times_calls_through_the_stand_in_graph(tmp_path):
    stdout, runs = run_bench(tmp_path, "--calls", "20", "--repeats", "2", "--seqs", "2")
    assert "draft call host work, builtin shape, 2 sequence(s)" in stdout
    assert len(runs) == 2 and all(us > 0 for us in runs)


def test_idle_us_sleeps_before_each_call_without_timing_it(tmp_path):
    """--idle-us: each call is timed after a wait, the wait itself is not (a 50 ms sleep
    would dwarf the call's host time if it were timed)."""
    stdout, (us,) = run_bench(tmp_path, "--calls", "5", "--repeats", "1", "--idle-us", "50000")
    assert "each after an untimed 50000 us sleep" in stdout
    assert 0 < us < 50000
