"""bench/bench_concurrency.py's arithmetic and table, from a fixed report (no services)."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_concurrency as bc  # bench/ is a script folder, not a package


def entry(concurrency: int, off: list[float], on: list[float], static: list[float],
          adaptive: list[float]) -> dict:
    return {"concurrency": concurrency, "num_prompts": max(16, 2 * concurrency),
            "tokens_per_s": {"OFF": off, "ON": on, "static": static, "adaptive": adaptive}}


REPORT = {
    "machine": {"label": "2 cores of Test CPU, float32", "torch": "2.13.0", "device": "cpu"},
    "date": "2026-11-29T12:00:00+00:00",
    "settings": {"draft": "eagle3", "shape_name": "tree", "shape": [8, 4, 4],
                 "static_threshold": 8, "prompts": "heldout", "prompt_len": 64,
                 "max_new_tokens": 48, "repeats": 3, "warmup": 1},
    "results": [
        # ON wins; adaptive 1 % under ON in each run.
        entry(1, [100, 110, 90], [120, 132, 108], [120, 132, 108], [118.8, 130.68, 106.92]),
        # OFF wins; adaptive 5 % under OFF: misses the aim.
        entry(64, [200, 200, 200], [150, 160, 140], [200, 200, 200], [190, 190, 190]),
        # ON wins, adaptive within 3 % of ON.
        entry(16, [100, 100, 100], [101, 101, 101], [100, 100, 100], [99, 99, 99]),
    ],
    "complete": True,
}


def test_ratios_are_medians_of_per_repeat_ratios_against_the_best_median():
    on_wins, off_wins, close = (bc.summarize(e) for e in REPORT["results"])
    assert on_wins["median"] == {"OFF": 100, "ON": 120, "static": 120, "adaptive": 118.8}
    assert on_wins["best"] == "ON"
    assert on_wins["on_off"] == pytest.approx(1.2)
    assert on_wins["adaptive_best"] == pytest.approx(0.99)
    assert on_wins["aim_met"]
    assert off_wins["best"] == "OFF"
    assert off_wins["on_off"] == pytest.approx(0.75)
    assert off_wins["adaptive_best"] == pytest.approx(0.95)
    assert not off_wins["aim_met"]
    # Within 3 % of the best (ON), yet below OFF where ON is above it: not met.
    assert close["adaptive_best"] == pytest.approx(99 / 101)
    assert not close["aim_met"]


def test_markdown_table_rows_and_aim_line():
    table = bc.markdown(REPORT)
    lines = table.splitlines()
    assert lines[0].startswith("2 cores of Test CPU, float32; torch 2.13.0, cpu; 2026-11-29")
    assert "static (<=8) tok/s" in lines[2]
    assert "| 1 | 16 | 100.0 | 120.0 | 120.0 | 118.8 | 1.20x | 0.99 (ON) |" in lines
    assert "| 64 | 128 | 200.0 | 150.0 | 200.0 | 190.0 | 0.75x | 0.95 (OFF) |" in lines
    assert lines[-1].endswith("met at concurrency 1; missed at 64, 16.")


def test_from_json_renders_without_running(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(REPORT))
    assert bc.main(["--from-json", str(saved), "--out-md", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == bc.markdown(REPORT)
    assert "| 16 | 32 |" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["", "0,1", "4,2", "1,1", "a"])
def test_bad_concurrency_lists_are_refused(text):
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        bc.parse_concurrency(text)
