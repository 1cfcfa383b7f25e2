"""The GPU issue's benchmark scripts run end to end on CPU (the H200 runs are the real ones),
so that scarce GPU time is not lost to a script's bug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
    """bench_step_costs at the built-in shape: decode, verify and draft timings and ratios
    (--torch-top-k recorded; on CPU the draft runs torch's ops either way)."""
    out = tmp_path / "costs.json"
    subprocess.run([sys.executable, "bench/bench_step_costs.py", "--shape", "builtin", "--device",
                    "cpu", "--dtype", "float32", "--iters", "3", "--warmup", "1", "--context", "32",
                    "--torch-top-k", "--draft-quantize", "fp8", "--out-json", str(out)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert result["torch_top_k"] is True and result["summary"]["draft_quantize"] == "fp8"
    assert len(result["target"]["decode_ms"]) == 3 and len(result["draft"]["draft_ms"]) == 3
    # each call's first, timed on its own
    assert result["target"]["verify_first_ms"] > 0 and result["draft"]["draft_first_ms"] > 0
    assert result["target"]["backend"] == "torch" and not result["target"]["graphs"]
    summary = result["summary"]
    assert summary["verify_over_decode"] > 0 and summary["draft_over_decode"] > 0
    # the draft's floor, counted by hand for the built-in head (H 256, I 512, 4 heads of 64,
    # 2 KV heads, 1024 draft ids, target H 256), float32, 5 levels: fc once, then qkv (over
    # 2H), o_proj, the MLP and lm_head once a level
    one_level = 512 * 512 + 256 * 256 + 3 * 256 * 512 + 1024 * 256
    floor = 1000 * (256 * 768 + 5 * one_level) * 4 / 4.5e12
    assert summary["draft_floor_ms"] == pytest.approx(floor)
    assert summary["draft_floor_over_decode"] == pytest.approx(floor / summary["decode_ms"])
    # in fp8 a byte a weight, not float32's four
    assert summary["draft_floor_fp8_over_decode"] == pytest.approx(floor / 4 / summary["decode_ms"])


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


def run_gemv_bench(*options: str) -> tuple[list[dict], str]:
    """bench_gemv on CPU, the kernels in Triton's interpreter, one config (16, 32, 4, 3):
    its JSON results and its printed lines."""
    pytest.importorskip("triton")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gemv.json"
        done = subprocess.run(
            [sys.executable, "bench/bench_gemv.py", "--device", "cpu", "--block-n", "16",
             "--block-k", "32", "--warps", "4", "--stages", "3", "--repeats", "1",
             "--out-json", str(out), *options], cwd=REPO, check=True, timeout=300,
            capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
        return json.loads(out.read_text())["results"], done.stdout


def test_top_logprobs_bench_runs_on_cpu(tmp_path):
    """bench_top_logprobs shrunk, the kernels in Triton's interpreter: torch and two configs
    per shape, each checked against a stable sort inside the script, and the best-per-shape
    lines."""
    pytest.importorskip("triton")
    out = tmp_path / "top.json"
    done = subprocess.run(
        [sys.executable, "bench/bench_top_logprobs.py", "--device", "cpu", "--vocab", "300",
         "--rows", "1,3", "--k", "4", "--blocks", "64,128", "--warps", "2", "--calls", "2",
         "--repeats", "1", "--out-json", str(out)], cwd=REPO, check=True, timeout=300,
        capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["variant"]) for r in results] == [
        (rows, v) for rows in (1, 3) for v in ("torch", "b64 w2", "b128 w2")]
    assert all(r["us_per_call"] > 0 and r["vocab"] == 300 and r["k"] == 4 for r in results)
    best = done.stdout.split("best per shape:")[1].strip().splitlines()
    assert [line.split(":")[0] for line in best] == ["V=300     rows   1 k  4",
                                                     "V=300     rows   3 k  4"], done.stdout


def test_gemv_bench_runs_on_cpu():
    """bench_gemv shrunk: torch and one config per shape and row count (gemv at one row,
    few_rows at nine), each agreeing with torch's output to bf16 rounding, and the lines for
    gemv.py's CONFIGS and ROW_CONFIGS."""
    results, printed = run_gemv_bench("--shrink", "64", "--shapes", "o_proj,down", "--shape",
                                      "mine=640,1280", "--rows", "1,9")
    variant = "triton n16 k32 w4 s3"
    assert [(r["shape"], r["rows"], r["variant"]) for r in results] == [
        (shape, rows, v) for rows in (1, 9) for shape in ("o_proj", "down", "mine")
        for v in ("torch", variant)]
    assert [(r["n"], r["k"]) for r in results[:6:2]] == [(64, 64), (64, 224), (10, 20)]
    assert all(r["us_per_call"] > 0 and r["max_diff_steps"] <= 2 for r in results)
    pasted = [line.removeprefix("# ").split(":")[0] for line in printed.splitlines()
              if line.startswith(("CONFIGS", "ROW_CONFIGS", "# ROW_CONFIGS"))]  # "# ": torch won
    shapes = [(64, 64), (64, 224), (10, 20)]
    assert pasted == [f"CONFIGS     ({n}, {k})" for n, k in shapes] + [
        f"ROW_CONFIGS (16, {n}, {k})" for n, k in shapes], printed


def test_gemv_bench_times_fp8_weights_on_cpu():
    """--fp8 --split-k 1,2 --skip-bf16: torch and fp8_rows (K whole and split in two) per
    shape and row count, fp8_rows agreeing with its own rounded weights' product, the
    rounding's relative error, and FP8_CONFIGS' lines (one a shape, from its fewest rows)."""
    results, printed = run_gemv_bench("--shrink", "64", "--shapes", "o_proj,gate_up",
                                      "--rows", "4,1", "--fp8", "--split-k", "1,2",
                                      "--skip-bf16")
    assert [(r["shape"], r["rows"], r["variant"], r["fp8"]) for r in results] == [
        (shape, rows, v, v != "torch") for rows in (4, 1) for shape in ("o_proj", "gate_up")
        for v in ("torch", "fp8 n16 k32 w4 s3", "fp8 n16 k32 w4 s3 split2")]
    fp8 = [r for r in results if r["fp8"]]
    assert all(r["max_diff_steps"] <= 2 and 0 < r["fp8_relative_error"] < 0.1 for r in fp8)
    pasted = [line.split(":")[0] for line in printed.splitlines()
              if line.startswith("FP8_CONFIGS")]
    assert pasted == ["FP8_CONFIGS (64, 64)", "FP8_CONFIGS (448, 64)"], printed
    assert "ROW_CONFIGS" not in printed  # no bfloat16 kernel was timed


def test_gemv_bench_reads_a_checkpoints_projections(tmp_path):
    """--model: an EAGLE-3 head's projections (its layer reads 2H; fc 3 target widths; its own
    vocabulary), named after its folder."""
    from splitspec.builtin import build
    from tests.kernel_cases import WIRED, WIRED_DRAFT_VOCAB

    target = build.write_llama(tmp_path / "t", WIRED, seed=3)
    head = build.write_eagle3_head(tmp_path / "head", target, draft_vocab_size=WIRED_DRAFT_VOCAB)
    results, _ = run_gemv_bench("--shapes", "", "--model", str(head), "--model", str(target))
    assert {r["shape"]: (r["n"], r["k"]) for r in results} == {
        "head_qkv": (128, 128), "head_o_proj": (64, 64), "head_gate_up": (192, 64),
        "head_down": (64, 96), "head_fc": (64, 192), "head_lm_head": (80, 64),
        "t_qkv": (128, 64), "t_o_proj": (64, 64), "t_gate_up": (192, 64), "t_down": (64, 96),
        "t_lm_head": (96, 64)}


@pytest.mark.parametrize("option", [["--shape", "mine=0,64"], ["--shape", "mine=64"],
                                    ["--rows", "65"], ["--shapes", "nope"]])
def test_gemv_bench_refuses_bad_options(option):
    done = subprocess.run([sys.executable, "bench/bench_gemv.py", "--device", "cpu", *option],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "error:" in done.stderr, done.stderr


def test_gemv_bench_lists_a_row_config_only_where_it_beat_torch_at_every_row_count():
    sys.path.insert(0, str(REPO / "bench"))
    from bench_gemv import row_configs

    def result(variant, rows, us, config=None):
        return {"variant": variant, "rows": rows, "us_per_call": us, "config": config,
                "n": 64, "k": 64, "shape": "s"}

    a, b = {"block_n": 16}, {"block_n": 32}
    # b: the least total (18.5 us against 19) and ahead of torch at 4 rows and at 9
    assert row_configs([result("torch", 4, 10), result("a", 4, 8, a), result("b", 4, 9, b),
                        result("torch", 9, 10), result("a", 9, 11, a), result("b", 9, 9.5, b)]
                       ) == {(16, 64, 64): (b, "s, rows 4,9")}
    # a: the least total, but behind torch at 9 rows: not listed
    assert row_configs([result("torch", 4, 10), result("a", 4, 8, a), result("b", 4, 9.5, b),
                        result("torch", 9, 10), result("a", 9, 10.5, a),
                        result("b", 9, 10.2, b)]) == {(16, 64, 64): (None, "s, rows 4,9")}


def test_step_costs_bench_shape_is_the_trained_pairs():
    """--shape bench builds the sizes `--preset bench` trains: the served pair's init reports
    say 168.8M parameters for the target and 41.2M for the head (bench/results/
    pair_e2e_h100_session59.log)."""
    import torch

    from splitspec.model.config import Eagle3Config, LlamaConfig
    from splitspec.model.eagle3 import Eagle3Head
    from splitspec.model.llama import LlamaForCausalLM

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from bench_step_costs import configs
    finally:
        sys.path.remove(str(REPO / "bench"))
    target, head = configs("bench")
    with torch.device("meta"):
        models = [LlamaForCausalLM(LlamaConfig.from_hf(target)), Eagle3Head(Eagle3Config.from_hf(head))]
    counts = [round(sum(p.numel() for p in m.parameters()) / 1e6, 1) for m in models]
    assert counts == [168.8, 41.2]
    assert (head["draft_vocab_size"], target["vocab_size"]) == (8192, 16384)


def test_handoff_bench_runs_on_cpu(tmp_path):
    """bench_gpu_handoff.py: both modes run (the second in its own process, handing turns
    back and forth), and the result says what a switch of process added."""
    out = tmp_path / "handoff.json"
    subprocess.run([sys.executable, "bench/bench_gpu_handoff.py", "--device", "cpu", "--kernels",
                    "4", "--size", "1024", "--turns", "50", "--warmup", "5", "--repeats", "1",
                    "--out-json", str(out)], cwd=REPO, check=True, timeout=120, capture_output=True)
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and len(result["runs_us"]["two"]) == 1
    assert result["one_us"] > 0 and result["two_us"] > 0
    assert result["handoff_us"] == pytest.approx((result["two_us"] - result["one_us"]) / 2)
