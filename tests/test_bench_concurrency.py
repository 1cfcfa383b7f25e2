"""bench/bench_concurrency.py's arithmetic and table, from a fixed report (no services), its
refusals, and (slow) a replay-draft sweep end to end on CPU."""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_concurrency as bc  # bench/ is a script folder, not a package

from draft_service.models import EAGLE3, load_draft_model, read_spec, read_target_embedding
from gateway.policy import AdaptivePolicy, adaptive_shapes
from splitspec.builtin import BUILTIN_TARGET
from splitspec.v1 import common_pb2, target_pb2
from target_service.engine import shape_for

REPO = Path(__file__).resolve().parent.parent


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
    assert "| 1 | 16 | 100.0 | 120.0 | 120.0 | 118.8 | 1.20x | 0.99 (ON) | 0.99-0.99 |" in lines
    assert "| 64 | 128 | 200.0 | 150.0 | 200.0 | 190.0 | 0.75x | 0.95 (OFF) | 0.95-0.95 |" in lines
    assert lines[-1].endswith("met at concurrency 1; missed at 64, 16.")


def noisy_rounds(rounds: int, off_over_on: float, adaptive_over_on: float, spread: float,
                 seed: int) -> dict[str, list[float]]:
    """Rounds whose shared drift (log-normal, sd `spread`) and own noise (a quarter of it)
    hit every mode; the modes' true rates stand as given."""
    import random

    rng = random.Random(seed)
    rates: dict[str, list[float]] = {"OFF": [], "ON": [], "adaptive": []}
    for _ in range(rounds):
        drift = rng.lognormvariate(0, spread)
        for mode, rate in (("OFF", off_over_on), ("ON", 1.0), ("adaptive", adaptive_over_on)):
            rates[mode].append(100 * rate * drift * rng.lognormvariate(0, spread / 4))
    return rates


def test_the_interval_holds_the_true_ratio_and_narrows_with_rounds():
    few = bc.bootstrap_interval(noisy_rounds(5, 0.9, 0.99, 0.1, seed=1))
    many = bc.bootstrap_interval(noisy_rounds(80, 0.9, 0.99, 0.1, seed=1))
    assert few[0] <= 0.99 <= few[1] and many[0] <= 0.99 <= many[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 2
    assert bc.bootstrap_interval(noisy_rounds(2, 0.9, 0.99, 0.1, seed=1)) is None
    # The same runs, the same interval.
    rates = noisy_rounds(20, 0.9, 0.99, 0.1, seed=2)
    assert bc.bootstrap_interval(rates) == bc.bootstrap_interval(rates)


def test_the_aim_line_names_concurrencies_whose_interval_spans_the_aim():
    report = json.loads(json.dumps(REPORT))
    report["settings"]["repeats"] = 10
    for e in report["results"]:  # adaptive 2.5 % under both: 10 noisy rounds cannot tell
        e["tokens_per_s"] = {**noisy_rounds(10, 1.0, 0.975, 0.2, seed=e["concurrency"]),
                             "static": [100.0] * 10}
    s = bc.summarize(report["results"][0])
    assert s["adaptive_interval"][0] < bc.AIM <= s["adaptive_interval"][1]
    assert "interval (rounds resampled) spans 0.97 at concurrency 1" in bc.markdown(report)


def test_from_json_renders_without_running(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(REPORT))
    assert bc.main(["--from-json", str(saved), "--out-md", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == bc.markdown(REPORT)
    assert "| 16 | 32 |" in capsys.readouterr().out


def test_out_png_without_matplotlib_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """--out-png needs matplotlib (the bench extra): without it the command stops at once,
    saying so, rather than after the sweep it asked for (a 12-round CPU sweep wrote its table
    and then died on the plot's import)."""
    real = bc.importlib.util.find_spec
    monkeypatch.setattr(bc.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(REPORT))
    with pytest.raises(SystemExit) as stopped:
        bc.main(["--from-json", str(saved), "--out-md", str(tmp_path / "t.md"),
                 "--out-png", str(tmp_path / "t.png")])
    assert stopped.value.code == 2
    assert "--out-png needs matplotlib, which is not installed: pip install -e '.[bench]'" in \
        capsys.readouterr().err
    assert not (tmp_path / "t.md").exists()  # nothing ran


def call_of(report: dict, concurrencies: list[int], date: str, port: int) -> dict:
    """A call of a sweep split by concurrency: ``report``'s results at ``concurrencies``."""
    part = json.loads(json.dumps(report))
    part["results"] = [e for e in part["results"] if e["concurrency"] in concurrencies]
    part["settings"] |= {"concurrency": concurrencies, "target": f"127.0.0.1:{port}"}
    part |= {"date": date, "command": f"bench_concurrency.py --concurrency {concurrencies}"}
    return part


def test_calls_of_one_sweep_join_into_one_report_and_other_runs_do_not(tmp_path, capsys):
    """--join: the calls of one sweep split by concurrency make the report one call of all of
    them would have (results in order of concurrency, each call's date and command kept);
    reports of other settings, another machine or a shared concurrency are refused."""
    calls = [call_of(REPORT, [16, 64], "2026-12-07T11:15", 1), call_of(REPORT, [1], "11:09", 2)]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, call in zip(paths, calls, strict=True):
        path.write_text(json.dumps(call))
    out = tmp_path / "joined.json"
    assert bc.main(["--join", *map(str, paths), "--out-json", str(out)]) == 0
    joined = json.loads(out.read_text())
    assert [e["concurrency"] for e in joined["results"]] == [1, 16, 64]
    assert joined["results"] == sorted(REPORT["results"], key=lambda e: e["concurrency"])
    assert joined["settings"]["concurrency"] == [1, 16, 64] and joined["complete"]
    assert [c["date"] for c in joined["calls"]] == ["2026-12-07T11:15", "11:09"]
    assert joined["date"] == "2026-12-07T11:15" and joined["machine"] == REPORT["machine"]
    assert bc.markdown(joined).splitlines()[2:] == bc.markdown(
        {**REPORT, "results": joined["results"]}).splitlines()[2:]  # the same table
    capsys.readouterr()
    other = call_of(REPORT, [1], "x", 3)
    other["settings"]["repeats"] = 5
    elsewhere = call_of(REPORT, [1], "x", 3)
    elsewhere["machine"] = {**REPORT["machine"], "label": "one H100"}
    for bad, why in ((other, "differ in repeats"), (elsewhere, "differ in the machine"),
                     (call_of(REPORT, [64], "x", 3), "share a concurrency")):
        paths[1].write_text(json.dumps(bad))
        with pytest.raises(SystemExit):
            bc.main(["--join", *map(str, paths)])
        assert why in capsys.readouterr().err


def test_pooled_sweeps_take_each_sweeps_better_mode_and_all_their_rounds(tmp_path, capsys):
    # Sweep A: OFF better, adaptive 0.99 and 0.97 of it. Sweep B: ON better (1.10x OFF),
    # adaptive 0.99 of ON in each round. A sweep without adaptive adds nothing.
    sweep_a = {"results": [{"concurrency": 1, "tokens_per_s": {
        "OFF": [100.0, 100.0], "ON": [90.0, 90.0], "adaptive": [99.0, 97.0]}}]}
    sweep_b = {"results": [{"concurrency": 1, "tokens_per_s": {
        "OFF": [100.0, 100.0, 100.0], "ON": [110.0] * 3, "adaptive": [108.9] * 3}}]}
    fixed_only = {"results": [{"concurrency": 1, "tokens_per_s": {
        "OFF": [100.0], "ON": [50.0]}}]}
    pooled = bc.pool([sweep_a, sweep_b, fixed_only])
    assert list(pooled) == [1]
    row = pooled[1]
    assert row["ratio"] == pytest.approx(math.exp(statistics.fmean(
        [math.log(r) for r in (0.99, 0.97, 0.99, 0.99, 0.99)])))
    (n_a, ratio_a, _, best_a), (n_b, ratio_b, se_b, best_b) = row["sweeps"]
    assert (n_a, best_a, n_b, best_b) == (2, "OFF", 3, "ON")
    assert ratio_a == pytest.approx(math.sqrt(0.99 * 0.97))
    assert ratio_b == pytest.approx(0.99) and se_b == pytest.approx(0.0, abs=1e-12)
    assert row["sweeps_se"] > 0 and row["rounds_se"] > 0
    paths = []
    for name, report in (("a.json", sweep_a), ("b.json", sweep_b)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(report))
    assert bc.main(["--pool", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "over 2 sweeps (a.json, b.json)" in out
    assert f"| 1 | 2 | 5 | **{row['ratio']:.3f}** (" in out and out.rstrip().endswith("| met |")


@pytest.mark.parametrize("text", ["", "0,1", "4,2", "1,1", "a"])
def test_bad_concurrency_lists_are_refused(text):
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        bc.parse_concurrency(text)


def test_modes_are_parsed_in_table_order_and_need_off_and_on():
    assert bc.parse_modes("adaptive,ON,OFF") == ["OFF", "ON", "adaptive"]
    assert bc.parse_modes("adaptive,chain,ON,OFF") == ["OFF", "ON", "chain", "adaptive"]
    for text in ("ON,adaptive", "OFF,ON,fast", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bc.parse_modes(text)


def test_rotated_rounds_put_each_mode_once_in_each_place():
    modes = ["OFF", "ON", "chain", "adaptive"]
    assert all(bc.round_order(modes, r, "fixed") == modes for r in range(5))
    rounds = [bc.round_order(modes, r, "rotate") for r in range(len(modes))]
    assert rounds[1] == ["ON", "chain", "adaptive", "OFF"]
    for place in range(len(modes)):
        assert sorted(order[place] for order in rounds) == sorted(modes)
    assert bc.round_order(modes, len(modes), "rotate") == modes
    report = json.loads(json.dumps(REPORT))
    report["settings"]["rotate"] = True  # a report from before --order
    assert "interleaved (the order rotated each round)" in bc.markdown(report)
    with pytest.raises(ValueError, match="order must be one of"):
        bc.round_order(modes, 0, "shuffled")


@pytest.mark.parametrize(("argv", "order"), [([], "balanced"), (["--order", "rotate"], "rotate"),
                                             (["--rotate"], "rotate"), (["--no-rotate"], "fixed")])
def test_the_order_flags_and_their_old_spellings(argv, order):
    """--rotate and --no-rotate, the flags before --order, still run the commands
    docs/benchmarks.md records, as --order rotate and --order fixed."""
    assert bc.build_parser().parse_args(argv).order == order


@pytest.mark.parametrize("modes", [["OFF", "ON"], ["OFF", "ON", "adaptive"],
                                   ["OFF", "ON", "static", "adaptive"],
                                   ["OFF", "ON", "chain", "static", "adaptive"]])
def test_balanced_rounds_put_each_mode_after_each_other_alike(modes):
    """Over a cycle of the design's rows each mode runs in each place, and right after each
    other mode, equally often; rotation, by contrast, keeps adaptive after ON."""
    cycle = 2 * len(modes) if len(modes) % 2 else len(modes)
    rounds = [bc.round_order(modes, r, "balanced") for r in range(cycle)]
    assert all(sorted(order) == sorted(modes) for order in rounds)
    places = Counter((mode, i) for order in rounds for i, mode in enumerate(order))
    follows = Counter(pair for order in rounds for pair in zip(order[:-1], order[1:], strict=True))
    assert set(places.values()) == {cycle // len(modes)}
    assert len(follows) == len(modes) * (len(modes) - 1)
    assert set(follows.values()) == {cycle // len(modes)}
    assert bc.round_order(modes, cycle, "balanced") == rounds[0]
    if len(modes) >= 3:
        # rotated, the third mode (adaptive after OFF, ON) follows the second in every round
        # that does not start with it
        rotated = [bc.round_order(modes, r, "rotate") for r in range(len(modes))]
        before_third = Counter(a for order in rotated
                               for a, b in zip(order[:-1], order[1:], strict=True) if b == modes[2])
        assert before_third == {modes[1]: len(modes) - 1}
    report = json.loads(json.dumps(REPORT))
    report["settings"]["order"] = "balanced"
    # the header says whether the rounds made whole cycles of the design's rows
    whole = len(bc.williams_rows(len(bc.modes_of(report))))
    for repeats, whole_cycles in ((whole, True), (2 * whole, True), (whole + 1, False)):
        report["settings"]["repeats"] = repeats
        text = bc.markdown(report)
        assert "interleaved (each round's order a row of a balanced design" in text
        assert ("every mode in every place and after every other mode alike)" in text) \
            == whole_cycles
        assert (f"alike over {whole} rounds; these {repeats} are not a whole number of such "
                "cycles)" in text) != whole_cycles


def test_a_run_with_the_draft_killed_says_so():
    report = json.loads(json.dumps(REPORT))
    assert "KILLED" not in bc.markdown(report)
    report["settings"]["draft_down"] = True
    assert "draft (KILLED once the target served: every mode ran with it away)" in bc.markdown(
        report)


def with_mode(mode: str, factor: float, of: str) -> dict:
    """REPORT run with OFF, ON, adaptive and ``mode``, whose runs are ``factor`` times ``of``'s."""
    report = json.loads(json.dumps(REPORT))
    report["settings"]["modes"] = bc.parse_modes(f"OFF,ON,adaptive,{mode}")
    for e in report["results"]:
        e["tokens_per_s"][mode] = [factor * r for r in e["tokens_per_s"][of]]
    return report


def test_a_variant_policy_is_keyword_arguments_checked_and_tabled_against_adaptive():
    """--variant's JSON must be keyword arguments an AdaptivePolicy takes; a report with the
    variant mode gives its per-round ratio to adaptive a column of its own."""
    assert bc.parse_variant('{"probe_share": 0.01, "borrow_cost": true}') == {
        "probe_share": 0.01, "borrow_cost": True}
    for text in ('{"no_such": 1}', "[1]", "{", '{"shapes": []}'):
        with pytest.raises(argparse.ArgumentTypeError, match="--variant"):
            bc.parse_variant(text)
    assert bc.parse_modes("variant,adaptive,ON,OFF") == ["OFF", "ON", "adaptive", "variant"]
    lines = bc.markdown(with_mode("variant", 1.02, "adaptive")).splitlines()
    assert lines[2].endswith("| variant tok/s | ON / OFF | adaptive / best(OFF, ON) | 90% "
                             "interval | variant / adaptive |")
    assert "| 64 | 128 | 200.0 | 150.0 | 190.0 | 193.8 | 0.75x | 0.95 (OFF) | 0.95-0.95 | 1.020 |" \
        in lines
    assert "untimed OFF, ON, adaptive and variant run(s)" in lines[0]


def test_the_never_mode_is_tabled_against_off():
    """A report with the never mode (AUTO requests, a policy that never speculates) gives its
    per-round ratio to OFF a column of its own."""
    assert bc.parse_modes("never,adaptive,ON,OFF") == ["OFF", "ON", "never", "adaptive"]
    lines = bc.markdown(with_mode("never", 0.98, "OFF")).splitlines()
    assert lines[2] == ("| concurrency | prompts | OFF tok/s | ON tok/s | never (AUTO) tok/s | "
                        "adaptive tok/s | ON / OFF | adaptive / best(OFF, ON) | 90% interval | "
                        "never / OFF |")
    assert "| 64 | 128 | 200.0 | 150.0 | 196.0 | 190.0 | 0.75x | 0.95 (OFF) | 0.95-0.95 | " \
           "0.980 |" in lines
    assert "untimed OFF, ON, never and adaptive run(s)" in lines[0]


def test_table_of_a_replay_run_without_static_labels_draft_target_and_acceptance():
    report = json.loads(json.dumps(REPORT))
    report["settings"] |= {"modes": ["OFF", "ON", "adaptive"], "replay_corrupt_rate": 0.3,
                           "draft": "replay(records.jsonl, corrupt 0.30)",
                           "target_label": "llama (Llama-3.1-8B shape, RANDOM bf16 weights)",
                           "target_flags": ["--early-exchange"]}
    for e in report["results"]:
        del e["tokens_per_s"]["static"]
        e["accepted_per_verify_step"] = {"OFF": [0.0] * 3, "ON": [1.7, 1.8, 1.9],
                                         "adaptive": [1.0] * 3}
        e["draft_trees"] = {"OFF": [0] * 3, "ON": [100] * 3, "adaptive": [50] * 3}
        e["replay_misses"] = {"OFF": [0] * 3, "ON": [1, 0, 0], "adaptive": [0] * 3}
    lines = bc.markdown(report).splitlines()
    assert "target model llama (Llama-3.1-8B shape, RANDOM bf16 weights), target flags " \
           "--early-exchange, replay(records.jsonl, corrupt 0.30) draft" in lines[0]
    # 0.7 + 0.7^2 + 0.7^3 + 0.7^4 = 1.77 for the depth-4 tree.
    assert lines[0].endswith("ON accepted 1.80 draft tokens per verify step (median of all "
                             "runs, 1.70-1.90); 1.77 expected at corrupt 0.30; replay misses "
                             "in timed runs: 3 of 1350 trees.")
    assert lines[2] == ("| concurrency | prompts | OFF tok/s | ON tok/s | adaptive tok/s | "
                        "ON / OFF | adaptive / best(OFF, ON) | 90% interval |")
    assert "| 1 | 16 | 100.0 | 120.0 | 118.8 | 1.20x | 0.99 (ON) | 0.99-0.99 |" in lines
    assert lines[-1].endswith("met at concurrency 1; missed at 64, 16.")


def test_expected_replay_acceptance_follows_the_main_path():
    assert bc.expected_replay_acceptance(0.0, [8, 4, 4]) == 4
    assert bc.expected_replay_acceptance(0.0, [3, 1, 5]) == 3  # main path of min(depth, nodes)
    assert bc.expected_replay_acceptance(1.0, [8, 4, 4]) == 0
    assert bc.expected_replay_acceptance(bc.DEFAULT_CORRUPT_RATE, [8, 4, 4]) == \
        pytest.approx(2.50, abs=0.01)  # the trained built-in pair's acceptance


@pytest.mark.parametrize(("argv", "message"), [
    (["--start", "--random-8b"], "--random-8b builds a Llama-3.1-8B-shaped bf16 checkpoint "
                                 "(16 GB) on the GPU and serves it there: it needs --device cuda "
                                 "(got --device cpu)"),
    (["--start", "--random-8b", "--device", "cuda", "--target-model", "/x"], "pass one"),
    (["--draft-kind", "replay"], "need --start"),
    (["--target-flag=--early-exchange"], "need --start"),
    (["--draft-down"], "need --start"),
    (["--draft-flag=--quantize"], "need --start"),
    (["--replay-cost-head"], "--replay-cost-head is for --draft-kind replay"),
    (["--start", "--draft-kind", "replay", "--replay-cost-head", "--replay-features"],
     "the head asks for its features itself"),
    (["--modes", "OFF,ON,variant"], "the mode variant and --variant go together"),
    (["--variant", '{"probe_share": 0.01}'], "the mode variant and --variant go together"),
    (["--start", "--draft-kind", "replay", "--replay-corrupt-rate", "1.5"],
     "--replay-corrupt-rate must be in [0, 1]"),
])
def test_impossible_requests_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bc.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_max_context_too_small_for_the_prompts_is_refused_before_anything_starts():
    with pytest.raises(SystemExit, match=r"--max-context 32 is below the longest prompt plus "
                                         r"the tokens generated \(\d+\)"):
        bc.main(["--start", "--draft-kind", "replay", "--prompts", "fixed", "--max-context", "32",
                 "--max-new-tokens", "48", "--concurrency", "1"])


@pytest.mark.slow
def test_replay_sweep_runs_end_to_end_at_the_chosen_acceptance(tmp_path):
    """--start --draft-kind replay records the built-in target's continuations, starts the
    replay draft on them and sweeps; at corrupt rate 0 ON accepts the whole main path. With
    --replay-cost-head the draft also runs a random EAGLE-3 head of the target's shape on
    every request, which asks for the target's features: without them, or of the wrong
    size, no tree would be drafted. The never mode's requests may speculate, under a policy
    with no entry: the target never does."""
    out, table, trace = tmp_path / "replay.json", tmp_path / "replay.md", tmp_path / "steps.jsonl"
    trace.write_text("a line an earlier sweep left\n")
    run = subprocess.run(
        [sys.executable, "bench/bench_concurrency.py", "--start", "--draft-kind", "replay",
         "--replay-corrupt-rate", "0", "--replay-cost-head", "--prompts", "fixed",
         "--num-prompts", "4",
         "--concurrency", "1,2", "--repeats", "1", "--max-new-tokens", "8", "--max-context",
         "64", "--modes", "OFF,ON,never,adaptive", "--new-tokens-spread", "0.5", "--min-run-s",
         "0.01", "--out-json",
         str(out), "--out-md", str(table), "--step-trace", str(trace)],
        cwd=REPO, timeout=240, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "recorded 4 continuations of 16 tokens" in run.stderr  # the 4 prompts, 8 + spare
    assert "speculation policy (max batch, tree size): []" in run.stderr  # never's stream
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert report["complete"] and settings["modes"] == ["OFF", "ON", "never", "adaptive"]
    name = "replay(records.jsonl, corrupt 0.00, cost eagle3-random)"
    assert settings["draft"] == settings["draft_model"] == name and settings["replay_cost_head"]
    steps = {step["name"]: step for step in report["target_init"]["steps"]}
    assert steps["capture_cuda_graphs"]["detail"] == "no-op on cpu"  # the start-up, as it went
    assert steps["connect_draft"]["state"] == "STEP_STATE_OK"
    assert report["target_init"]["total_s"] >= steps["load_model"]["duration_s"] > 0
    depth = settings["shape"][2]
    assert [e["concurrency"] for e in report["results"]] == [1, 2]
    for entry in report["results"]:
        assert set(entry["tokens_per_s"]) == {"OFF", "ON", "never", "adaptive"}
        assert all(len(rates) == 1 and rates[0] > 0 for rates in entry["tokens_per_s"].values())
        (accepted,) = entry["accepted_per_verify_step"]["ON"]
        assert accepted > 0.5 * depth, entry["accepted_per_verify_step"]  # R = 0: ~depth
        assert entry["draft_trees"]["ON"][0] > 0 and entry["replay_misses"]["ON"] == [0]
        assert entry["draft_trees"]["OFF"] == entry["draft_trees"]["never"] == [0]
        assert entry["budget_step_shares"]["OFF"] == [{"0": 1.0}]
        assert entry["budget_step_shares"]["never"] == [{"0": 1.0}]
        assert entry["budget_step_shares"]["ON"] == [{"8": 1.0}]  # (every step speculated)
        assert set(entry["budget_step_shares"]["adaptive"][0]) <= {"0", "3", "8"}
        assert all(rates[0] > 0 for rates in entry["steady_tokens_per_s"].values())
        for mode, (first_ms,) in entry["first_token_ms"].items():  # the client's view
            assert 0 < first_ms < entry["request_ms"][mode][0], mode
        for mode, (cpu,) in entry["cpu_s"].items():  # the run's CPU, process by process
            assert set(cpu) == {"client", "target", "draft"} and cpu["target"] > 0, (mode, cpu)
            assert cpu["target"] <= 2 * os.cpu_count() * entry["wall_s"][mode][0], (mode, cpu)
        assert entry["cpu_s"]["ON"][0]["draft"] > 0  # it drafted: the draft worked
        work = sum(bc.request_lengths(entry["num_prompts"], 8, 0.5))  # the spread lengths
        for mode, rates in entry["tokens_per_s"].items():
            assert round(rates[0] * entry["wall_s"][mode][0]) == work, mode
    runs = [json.loads(line) for line in trace.read_text().splitlines()]  # this sweep's only
    # the warm-up, then (runs sized by time) adaptive again, untimed, until it settled (at
    # most --policy-warmup 3 runs), then the timed runs
    taken = [e["policy_warmup_runs"]["adaptive"] for e in report["results"]]
    assert all(1 <= n <= 3 for n in taken), taken
    orders = [[("OFF", -1), ("ON", -1), ("never", -1), ("adaptive", -1), *[("adaptive", -1)] * n,
               ("OFF", 0), ("ON", 0), ("adaptive", 0), ("never", 0)] for n in taken]
    assert [(r["concurrency"], r["mode"], r["run"]) for r in runs] == [
        (c, mode, run) for c, order in zip((1, 2), orders, strict=True) for mode, run in order]
    timed = [r for r in runs if r["run"] == 0 and r["mode"] in ("OFF", "ON")]
    for run, entry in zip(timed, [e for e in report["results"] for _ in (0, 1)], strict=True):
        fields = run["fields"]
        steps = [dict(zip(fields, row, strict=True)) for row in run["steps"]]
        speculated = {s["speculated"] for s in steps if s["batch_size"]}
        assert speculated == {run["mode"] == "ON"}, run["mode"]  # timed OFF and ON runs
        assert {s["waiting"] for s in steps} == {0}  # 2 streams never wait for room
        work = sum(bc.request_lengths(entry["num_prompts"], 8, 0.5))
        # every token but each prompt's first (its prefill's), in some step
        assert sum(s["committed_tokens"] for s in steps) == work - entry["num_prompts"]
        assert all(s["period_s"] > 0 for s in steps)
    for run in runs:  # what the adaptive policy was told (and the others would have been)
        steps = [dict(zip(run["fields"], row, strict=True)) for row in run["steps"]]
        in_flight = run["in_flight"]
        assert len(in_flight) == len(steps)
        assert all(0 <= n <= run["concurrency"] for n in in_flight), in_flight
        # a sequence a step decoded is still in flight after it, unless it ended there
        assert all(n + s["finished_requests"] >= s["batch_size"]
                   for n, s in zip(in_flight, steps, strict=True))
    header = table.read_text().splitlines()[0]
    assert f"{name} draft" in header
    assert "x 4-8 new tokens" in header and settings["new_tokens_spread"] == 0.5
    assert ("then untimed runs of each policy at that size until one in which it settled (at "
            f"most 3; runs taken at each concurrency: adaptive {taken[0]}, {taken[1]})") in header
    assert "interleaved (each round's order a row of a balanced design" in header
    assert settings["order"] == "balanced"
    assert f"{depth:.2f} expected at corrupt 0.00; replay misses in timed runs: 0 of" in header


def test_the_cost_head_is_a_random_eagle3_head_of_the_targets_shape(tmp_path):
    """--replay-cost-head's model: the target's shapes, a draft vocabulary of at most
    32000, no embedding of its own (the draft loads the target's)."""
    folder = bc.random_head(BUILTIN_TARGET, tmp_path)
    with safe_open(folder / "model.safetensors", "pt") as saved:
        assert not any("embed_tokens" in key for key in saved.keys())  # noqa: SIM118 (not a dict)
    spec = read_spec(folder, "auto", BUILTIN_TARGET)
    target = json.loads((BUILTIN_TARGET / "config.json").read_text())
    assert spec.kind == EAGLE3 and spec.target_hidden_size == target["hidden_size"]
    model = load_draft_model(spec, torch.float32, "cpu")
    assert model.draft_vocab_size == min(32000, target["vocab_size"]) == 2048
    embedding = model.module.embed_tokens.weight
    assert embedding.shape == (target["vocab_size"], target["hidden_size"])
    assert torch.equal(embedding, read_target_embedding(BUILTIN_TARGET).float())


def test_runs_sized_by_time_take_whole_waves_and_never_fewer_prompts():
    # 10 s at 216 tok/s of 48 new tokens is 45 prompts: 6 waves of 8.
    assert bc.prompts_for_time(16, 8, 216.0, 10.0, 48) == 48
    assert bc.prompts_for_time(16, 1, 10.0, 10.0, 48) == 16  # already long enough
    assert bc.prompts_for_time(128, 64, 300.0, 10.0, 48) == 128
    assert bc.prompts_for_time(16, 3, 100.0, 10.0, 48) == 21  # 20.8 -> 21, a multiple of 3
    with pytest.raises(SystemExit):
        bc.main(["--min-run-s", "5", "--warmup", "0"])


def test_request_lengths_spread_the_work_the_same_way_for_every_mode():
    assert bc.request_lengths(5, 48, 0.0) == [48] * 5
    lengths = bc.request_lengths(200, 48, 0.5)
    assert lengths == bc.request_lengths(200, 48, 0.5)  # every mode and run: the same work
    assert min(lengths) == 24 and max(lengths) == 48
    assert min(bc.request_lengths(200, 48, 1.0)) == 1
    assert bc.new_tokens_text({"max_new_tokens": 48, "new_tokens_spread": 0.5}) == "24-48"
    assert bc.new_tokens_text({"max_new_tokens": 48}) == "48"  # reports from before the option
    with pytest.raises(SystemExit):
        bc.main(["--new-tokens-spread", "1.5"])


def test_run_figures_count_mixed_steps_and_time_the_steady_state_apart():
    """Under speculation most steps also prefill: a mean over decode-only steps was mostly one
    of the run's draining last steps (45.6 against about 57 at 64 streams on the H200). The
    steady rate leaves out the steps before the first decode and after the last prefill."""
    from bench_speculation import RunStats

    from splitspec.v1 import target_pb2

    def step(n: int, batch: int, prompt_tokens: int, committed: int = 0, period: float = 0.01,
             speculated: bool = False) -> target_pb2.StepStats:
        return target_pb2.StepStats(step=n, batch_size=batch, prefill_tokens=prompt_tokens,
                                    committed_tokens=committed, period_s=period,
                                    speculated=speculated)

    # out of order, as events may carry them: a prompt-only step, two decode steps, a mixed
    # one, then the drain
    stats = RunStats(steps=[step(4, 1, 64, 1, 0.02), step(1, 0, 640, 0, 0.5),
                            step(2, 60, 0, 60, speculated=True), step(3, 58, 0, 58),
                            step(5, 1, 0, 1, 0.3), step(6, 1, 0, 1, 0.3)])
    assert bc.mean_decode_batch(stats) == (60 + 58 + 1 + 1 + 1) / 5
    assert bc.speculated_share(stats) == 1 / 5
    assert bc.steady_tokens_per_s(stats) == pytest.approx((60 + 58 + 1) / 0.04)
    assert bc.mean_decode_batch(RunStats(steps=[step(1, 0, 64)])) == 0.0
    assert bc.steady_tokens_per_s(RunStats(steps=[step(1, 0, 64), step(2, 1, 0, 1)])) == 0.0


def test_a_policy_is_settled_once_a_run_switched_nothing_and_its_bucket_judged_every_mode():
    """bench_concurrency.settled: the policy's untimed runs at the timed size go on until
    one changed no bucket's mode and the concurrency's bucket had judged a probe of each
    mode it does not run (the tree it starts with, and the chain, against off here): a
    probe of its own, so not the tree just left for off, whose ratio the switch restated."""
    policy = AdaptivePolicy(adaptive_shapes("", common_pb2.DraftShape(
        num_draft_tokens=8, topk=4, num_steps=4)))
    before = [b.mode for b in policy.buckets.values()]
    assert not bc.settled(policy, 4, before)  # nothing judged yet
    bucket, just_switched = policy.buckets[4], False
    for _ in range(3000):  # off: a token in 5 ms; the tree and the chain 2 in 20 ms
        budget = shape_for(policy.policy, 4, policy.modes[1]).num_draft_tokens
        policy.observe(target_pb2.StepStats(
            batch_size=4, speculated=budget > 0, tree_budget=budget,
            period_s=0.02 if budget else 0.005, total_s=0.02 if budget else 0.005,
            committed_tokens=8 if budget else 4))
        if bucket.mode == 0 and not bucket.probed(1) and bucket.probed(2):
            # off, the chain probed, the tree not probed since it was left: the switch
            # rated it, but it is not settled
            assert bucket.ratios[1] and 1 not in bucket.entry
            assert not bc.settled(policy, 4, [b.mode for b in policy.buckets.values()])
            just_switched = True
    assert just_switched and bucket.mode == 0 and bucket.probed(1)
    assert not bc.settled(policy, 4, before)  # bucket 4 switched to off since
    assert bc.settled(policy, 4, [b.mode for b in policy.buckets.values()])
    assert not bc.settled(policy, 64, [b.mode for b in policy.buckets.values()])  # none there
