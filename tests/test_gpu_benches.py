"""The GPU issue's benchmark scripts run end to end on CPU (the H200 runs are the real ones),
so that scarce GPU time is not lost to a script's bug."""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
def test_step_costs_bench_runs_on_cpu(tmp_path):
    """bench_step_costs at the built-in shape: decode, verify and draft timings and ratios."""
    out = tmp_path / "costs.json"
    subprocess.run([sys.executable, "bench/bench_step_costs.py", "--shape", "builtin", "--device",
                    "cpu", "--dtype", "float32", "--iters", "3", "--warmup", "1", "--context", "32",
                    "--out-json", str(out)], cwd=REPO, check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert len(result["target"]["decode_ms"]) == 3 and len(result["draft"]["draft_ms"]) == 3
    assert result["target"]["backend"] == "torch" and not result["target"]["graphs"]
    summary = result["summary"]
    assert summary["verify_over_decode"] > 0 and summary["draft_over_decode"] > 0


@pytest.mark.slow
def test_tp_comm_bench_runs_on_cpu(tmp_path):
    """bench_tp_comm over gloo: the per-step all-reduces (eager; graphs need CUDA) and a
    decode step's announcement, packed and pickled, timed on two ranks."""
    out = tmp_path / "comm.json"
    subprocess.run([sys.executable, "bench/bench_tp_comm.py", "--layers", "2", "--hidden", "64",
                    "--iters", "5", "--out-json", str(out)], cwd=REPO, check=True, timeout=120,
                   capture_output=True)
    result = json.loads(out.read_text())
    assert result["all_reduces_per_step"] == 6 and "graph_step_ms" not in result
    assert result["eager_step_ms"] > 0
    assert all(result[f"{way}_call_ms_batch{b}"] > 0 for way in ("pickled", "packed") for b in (1, 32))


def test_gemv_bench_runs_on_cpu(tmp_path):
    """bench_gemv shrunk, the kernel in Triton's interpreter: torch and one config per shape,
    each agreeing with torch's output to bf16 rounding."""
    pytest.importorskip("triton")
    out = tmp_path / "gemv.json"
    subprocess.run([sys.executable, "bench/bench_gemv.py", "--device", "cpu", "--shrink", "64",
                    "--shapes", "o_proj,down", "--block-n", "8", "--block-k", "32", "--warps",
                    "4", "--repeats", "1", "--out-json", str(out)], cwd=REPO, check=True,
                   timeout=300, capture_output=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["variant"]) for r in rows] == [
        ("o_proj", "torch"), ("o_proj", "triton n8 k32 w4"),
        ("down", "torch"), ("down", "triton n8 k32 w4")]
    assert [(r["n"], r["k"]) for r in rows[::2]] == [(64, 64), (64, 224)]
    assert all(r["us_per_call"] > 0 and r["max_diff_steps"] <= 2 for r in rows)
