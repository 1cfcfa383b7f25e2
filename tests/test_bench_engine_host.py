"""bench/bench_engine_host.py: the engine's host time per step over a stand-in model, for
each request mode and batch size, its setup checked by the bench itself (the batch it
meant, speculation only where meant, the tree's two moved nodes accepted)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_bench_times_each_mode_and_batch_and_writes_every_run(tmp_path):
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--batch", "1,3",
                           "--steps", "5", "--repeats", "2", "--out-json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("  batch")]
    assert [line.split(":")[0].split() for line in lines] == [
        ["batch", str(b), mode] for b in (1, 3) for mode in ("off", "auto-off", "tree")]
    runs = json.loads(out.read_text())["runs_us"]
    assert set(runs) == {f"{mode} {b}" for b in (1, 3) for mode in ("off", "auto-off", "tree")}
    assert all(len(r) == 2 and all(us > 0 for us in r) for r in runs.values())


def test_unknown_modes_are_refused():
    done = subprocess.run([sys.executable, "bench/bench_engine_host.py", "--modes", "off,on"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unknown modes ['on']" in done.stderr
