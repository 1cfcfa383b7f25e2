"""bench/bench_decode_floor.py runs end to end on CPU (the H200 run is the real one): it
starts the target, reads its init report, times decode steps and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitspec.builtin import BUILTIN_TARGET

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_decode_floor_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "floor.json"
    subprocess.run([sys.executable, "bench/bench_decode_floor.py", "--model", str(BUILTIN_TARGET),
                    "--device", "cpu", "--dtype", "float32", "--variants", "torch",
                    "--repeats", "1", "--new-tokens", "8", "--log-dir", str(tmp_path),
                    "--out-json", str(out)], cwd=REPO, check=True, timeout=300,
                   capture_output=True)
    result = json.loads(out.read_text())
    run = result["variants"]["torch"]
    assert result["parameters"] > 1e6 and result["label"].startswith("target")
    assert run["init_steps"]["init_attention_backend"]["detail"].startswith("torch")
    assert 0 < run["forward_ms"] <= run["step_ms"] and run["serving_s"] > 0
