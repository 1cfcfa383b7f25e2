"""bench/device/clock_runs.py: the GPU's samples inside each timed run of a stamped log."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
T0 = 1796601600.0  # 2026-12-07 00:00:00 UTC


def test_each_timed_runs_samples_are_those_between_the_run_before_and_its_end(tmp_path):
    """The first warm-up (with the stack's start) and the warm-ups are left out; OFF's runs
    hold the samples at 1980 MHz, ON's at 1700, and a sample outside every run counts for
    none; a failed query's line, and one without a value, are skipped."""
    log = [(5.0, "warm-up: concurrency 1, OFF: 160 tok/s (2.0 s, 24 prompts, not counted)"),
           (10.0, "warm-up: concurrency 1, ON: 300 tok/s (not counted)"),
           (20.0, "[1/4] concurrency 1, OFF, run 1/2: 165 tok/s; 10 s so far"),
           (30.0, "[2/4] concurrency 1, ON, run 1/2: 310 tok/s; 20 s so far"),
           (31.0, "2026-12-07 00:00:31,000 target INFO something in between"),
           (40.0, "[3/4] concurrency 1, ON, run 2/2: 305 tok/s; 30 s so far"),
           (50.0, "[4/4] concurrency 1, OFF, run 2/2: 166 tok/s; 40 s so far")]
    (tmp_path / "run.log").write_text("".join(f"{T0 + t:.6f} {text}\n" for t, text in log))
    rows = ["timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
            "temperature.gpu"]
    for t in range(0, 60, 2):  # a sample every 2 s
        on = 20 <= t < 40
        stamp = f"2026/12/07 00:00:{t:02d}.000"
        rows.append(f"{stamp}, {1700 if on else 1980} MHz, 2619 MHz, {400 if on else 300}.5 W, "
                    f"{50 if on else 45}")
    rows.insert(5, "Unable to determine the device handle: Unknown Error")
    rows.insert(7, "2026/12/07 00:00:21.000, 100 MHz, 2619 MHz, [N/A], 50")  # (no power)
    (tmp_path / "clocks.csv").write_text("\n".join(rows) + "\n")
    done = subprocess.run([sys.executable, "bench/device/clock_runs.py",
                           str(tmp_path / "clocks.csv"), str(tmp_path / "run.log")], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.splitlines() == [
        "run.log: concurrency 1, OFF: 2 runs, 10 samples; SM MHz 1980, memory MHz 2619, W 300, "
        "C 45",
        "run.log: concurrency 1, ON: 2 runs, 10 samples; SM MHz 1700, memory MHz 2619, W 400, "
        "C 50"]


def test_each_run_with_the_mode_before_it_and_its_first_seconds(tmp_path):
    """--runs --first-s 4: the plain run after ON has its first 4 s at 1700 MHz (then 1980),
    the one after the warm-up all at 1980."""
    log = [(5.0, "warm-up: concurrency 2, ON: 300 tok/s (not counted)"),
           (10.0, "warm-up: concurrency 2, OFF: 160 tok/s (not counted)"),
           (20.0, "[1/3] concurrency 2, OFF, run 1/2: 165 tok/s; 10 s so far"),
           (30.0, "[2/3] concurrency 2, ON, run 1/1: 310 tok/s; 20 s so far"),
           (40.0, "[3/3] concurrency 2, OFF, run 2/2: 166 tok/s; 30 s so far")]
    (tmp_path / "run.log").write_text("".join(f"{T0 + t:.6f} {text}\n" for t, text in log))
    rows = [f"2026/12/07 00:00:{t:02d}.500, {1700 if 20 <= t < 34 else 1980} MHz, 2619 MHz, "
            f"300 W, 45" for t in range(60)]
    (tmp_path / "clocks.csv").write_text("\n".join(rows) + "\n")
    done = subprocess.run([sys.executable, "bench/device/clock_runs.py",
                           str(tmp_path / "clocks.csv"), str(tmp_path / "run.log"), "--runs",
                           "--first-s", "4"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.splitlines()[:3] == [
        "run.log: concurrency 2, OFF run 1 (after OFF, 10.0 s): 4 samples; SM MHz 1980, "
        "memory MHz 2619, W 300, C 45",
        "run.log: concurrency 2, ON run 1 (after OFF, 10.0 s): 4 samples; SM MHz 1700, "
        "memory MHz 2619, W 300, C 45",
        "run.log: concurrency 2, OFF run 2 (after ON, 10.0 s): 4 samples; SM MHz 1700, "
        "memory MHz 2619, W 300, C 45"]
