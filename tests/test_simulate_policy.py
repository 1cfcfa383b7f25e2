"""bench/simulate_policy.py: replaying recorded step traces through the adaptive policy."""

import gzip
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import simulate_policy as sp  # bench/ is a script folder, not a package
from bench_concurrency import TRACE_FIELDS

from gateway.policy import AdaptivePolicy, adaptive_shapes, parse_table, static_policy
from splitspec.v1 import target_pb2
from target_service.engine import shape_for


def trace_line(mode: str, run: int, budget: int, period_s: float, committed: int,
               steps: int, drift: float = 0.0, seed: int = 0) -> str:
    """A --step-trace line of one run at batch 1: ``steps`` decode steps of ``period_s``
    (+-5 %, and growing by ``drift`` over the run) committing ``committed`` tokens each."""
    rng = random.Random(seed)
    rows = []
    for i in range(steps):
        period = period_s * (1 + drift * i / steps) * rng.uniform(0.95, 1.05)
        row = {"step": i, "batch_size": 1, "prefill_tokens": 0, "speculated": budget > 0,
               "tree_budget": budget, "committed_tokens": committed, "period_s": period,
               "total_s": period, "draft_s": 0.0, "forward_s": period, "waiting": 0,
               "draft_compute_s": 0.0, "draft_input_tokens": committed if budget else 0,
               "finished_prompt_tokens": 0, "finished_generated_tokens": 0,
               "finished_requests": 0, "held_sequences": 1, "catching_up": False,
               "draft_unavailable": False}
        rows.append([row[name] for name in TRACE_FIELDS] + [[]])
    return json.dumps({"concurrency": 1, "mode": mode, "run": run,
                       "fields": [*TRACE_FIELDS, "first_child_accepted"], "steps": rows})


def write_trace(path: Path, on_period_s: float) -> Path:
    """OFF at 10 ms a token and the 8-node tree at ``on_period_s`` for 3 tokens, two runs
    each (and a warm-up and an adaptive run, which the simulator must leave out)."""
    lines = [trace_line("OFF", -1, 0, 0.5, 1, 50), trace_line("adaptive", 0, 8, 0.5, 1, 50)]
    for run in range(2):
        lines.append(trace_line("OFF", run, 0, 0.010, 1, 400, seed=run))
        lines.append(trace_line("ON", run, 8, on_period_s, 3, 150, seed=10 + run))
    path.write_text("\n".join(lines) + "\n")
    return path


def adaptive_on(machine: sp.Machine) -> dict:
    shapes = [s for s in adaptive_shapes("", sp.TREE) if s.num_draft_tokens in machine.pools]
    return sp.summarize(machine, 1, lambda: AdaptivePolicy(shapes), seeds=3, steps=1500,
                        settle=300)


def test_adaptive_replayed_on_traces_runs_the_mode_that_pays(tmp_path):
    """The tree commits 3 tokens in 20 ms (1.5x OFF): replayed, adaptive runs it but for its
    probes and comes within a few per cent of it; at 40 ms (0.75x OFF) it runs OFF."""
    runs = sp.load_runs([write_trace(tmp_path / "fast.jsonl", 0.020)])
    assert {b: len(r) for b, r in runs[1].items()} == {0: 2, 8: 2}  # warm-up, adaptive left out
    result = adaptive_on(sp.Machine(runs[1], 32))
    assert result["fixed_tok_s"][8] > 1.4 * result["fixed_tok_s"][0]
    assert result["share"][8] > 0.85, result
    assert result["ratio_median"] > 0.95, result

    slow = adaptive_on(sp.Machine(sp.load_runs([write_trace(tmp_path / "slow.jsonl",
                                                            0.040)])[1], 32))
    assert slow["share"][0] > 0.85, slow
    assert slow["ratio_median"] > 0.95, slow


def test_a_sweeps_chain_runs_are_the_chains_pool(tmp_path):
    """bench_concurrency's chain mode (a chain of 3 at every batch size) gives the chain its
    own pool, beside OFF's and the tree's from the same sweep."""
    path = write_trace(tmp_path / "t.jsonl", 0.020)
    with path.open("a") as out:
        out.write(trace_line("chain", 0, 3, 0.015, 2, 100) + "\n")
    assert {b: len(r) for b, r in sp.load_runs([path])[1].items()} == {0: 2, 8: 2, 3: 1}


def test_the_drift_of_a_run_is_shared_by_all_modes_not_replayed_per_mode(tmp_path):
    """A run whose steps slow down from 10 to 20 ms: its pool keeps the mean step time but not
    the ramp, and the ramp becomes the drift every mode's steps are multiplied by."""
    path = tmp_path / "drift.jsonl"
    path.write_text(trace_line("OFF", 0, 0, 0.010, 1, 1000, drift=1.0) + "\n"
                    + trace_line("ON", 0, 8, 0.020, 3, 300) + "\n")
    machine = sp.Machine(sp.load_runs([path])[1], 32)
    off = [s.period_s for s in machine.pools[0]]
    mean = sum(off) / len(off)
    assert 0.0145 < mean < 0.0155
    assert max(abs(p / mean - 1) for p in off[100:-100]) < 0.1  # the +-5 % noise is kept
    assert machine.drift_at(0.0) < 0.75 and machine.drift_at(machine.length_s * 0.99) > 1.25
    assert machine.drift_at(machine.length_s * 1.01) < 0.75  # the clock wraps


def test_the_command_line_prints_a_line_per_concurrency(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", 0.020)
    assert sp.main([str(path), "--seeds", "2", "--steps", "800", "--settle", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("concurrency 1: off: ") and "adaptive / best (8): median" in out
    # --variant: a second policy's line after adaptive's, on the same seeds; a policy that
    # never probes stays on its first budget, the tree, which is the best here
    assert sp.main([str(path), "--seeds", "2", "--steps", "800", "--settle", "200",
                    "--variant", '{"probe_every": 100000, "first_probe": 100000}']) == 0
    adaptive, variant = capsys.readouterr().out.splitlines()
    assert "adaptive / best (8)" in adaptive and "variant / best (8): median 1.000" in variant
    assert variant.endswith("steps 8 100%")


def test_a_policy_that_always_runs_the_best_budget_scores_exactly_one(tmp_path):
    """The comparison is the same seed's run of the best budget (the one of the highest
    median over the seeds): the same drift and pool starts, so running it is a ratio of 1."""
    machine = sp.Machine(sp.load_runs([write_trace(tmp_path / "t.jsonl", 0.020)])[1], 32)

    class TreeAlways:  # what summarize needs of a policy
        policy = static_policy(0, sp.TREE)

        def observe(self, stats):
            return None

    result = sp.summarize(machine, 1, TreeAlways, seeds=4, steps=900, settle=100)
    assert result["best"] == 8
    assert result["ratio_min"] == result["ratio_median"] == 1.0


def test_gzipped_traces_load_as_the_plain_ones(tmp_path):
    plain = write_trace(tmp_path / "t.jsonl", 0.020)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert sp.load_runs([packed]) == sp.load_runs([plain])


@pytest.mark.parametrize("argv", [["--steps", "100", "--settle", "100"], ["--window", "0"],
                                  ["--seeds", "0"]])
def test_impossible_settings_are_refused(tmp_path, capsys, argv):
    path = write_trace(tmp_path / "t.jsonl", 0.020)
    with pytest.raises(SystemExit) as exit_:
        sp.main([str(path), *argv])
    assert exit_.value.code == 2
    assert "--steps must exceed --settle, and --seeds and --window be >= 1" in (
        capsys.readouterr().err)


def test_each_step_runs_the_budget_the_policy_gives_its_own_batch_size():
    """A 2-stream workload whose batch drops to 1 now and then, under a policy of the tree at
    batch 1 and OFF above: every replayed step of 1 sequence speculates and every step of 2
    does not, as the target applies the policy to the batch it runs (chosen by the batch
    before, a lone step of 1 after steps of 2 ran OFF)."""
    def run(budget: int, period_s: float, committed: int) -> list:
        return [target_pb2.StepStats(batch_size=size, speculated=budget > 0 and size > 0,
                                     tree_budget=budget,
                                     committed_tokens=committed * size, period_s=period_s)
                for size in [2, 2, 2, 1, 2, 1, 1, 2, 2, 0] * 20]

    machine = sp.Machine({0: [run(0, 0.010, 1)], 8: [run(8, 0.020, 3)]}, 8)
    policy = parse_table("1:8/4/4,*:0", sp.TREE)
    seen = []
    sp.simulate(machine, lambda batch: shape_for(policy, batch, sp.TREE).num_draft_tokens,
                seen.append, concurrency=2, steps=600, settle=0, seed=3)
    sizes = {(s.batch_size, s.speculated) for s in seen}
    assert sizes == {(1, True), (2, False), (0, False)}, sizes

    # where the tree's runs never decoded 1 sequence, OFF's steps of 1 stand, in OFF
    no_ones = [s for s in run(8, 0.020, 3) if s.batch_size != 1]
    machine = sp.Machine({0: [run(0, 0.010, 1)], 8: [no_ones]}, 8)
    seen.clear()
    sp.simulate(machine, lambda batch: shape_for(policy, batch, sp.TREE).num_draft_tokens,
                seen.append, concurrency=2, steps=600, settle=0, seed=3)
    assert {(s.batch_size, s.speculated) for s in seen} == {(1, False), (2, False), (0, False)}


def test_a_speculative_step_after_plain_ones_pays_the_drafts_catch_up_on_what_they_committed():
    """With catch_up_s, the first speculative step after 10 plain ones (1 token each) costs
    10 tokens' catch-up more, in its period, draft wait and draft input; the steps after it
    do not, and without catch_up_s nothing is added. A sequence is caught up on at most its
    mean length: prompt and half its generated tokens, from the requests OFF's runs ended."""
    def run(budget: int, period_s: float, committed: int, ended: bool = False) -> list:
        return [target_pb2.StepStats(batch_size=1, speculated=budget > 0, tree_budget=budget,
                                     committed_tokens=committed, period_s=period_s,
                                     draft_input_tokens=committed if budget else 0,
                                     finished_requests=int(ended and i % 40 == 0),
                                     finished_prompt_tokens=4 * int(ended and i % 40 == 0),
                                     finished_generated_tokens=4 * int(ended and i % 40 == 0))
                for i in range(400)]

    def first_speculative_steps(machine: sp.Machine, catch_up_s: float) -> list:
        seen: list[target_pb2.StepStats] = []
        sp.simulate(machine, lambda _batch: 8 if len(seen) >= 10 else 0, seen.append,
                    concurrency=1, steps=14, settle=0, seed=1, catch_up_s=catch_up_s)
        assert [s.speculated for s in seen] == [False] * 10 + [True] * 4
        return seen[10:]

    machine = sp.Machine({0: [run(0, 0.010, 1)], 8: [run(8, 0.020, 3)]}, 8)
    assert machine.sequence_tokens == float("inf")  # no request ended in these runs
    first, *rest = first_speculative_steps(machine, 0.001)
    assert first.period_s == pytest.approx(0.020 + 10 * 0.001)
    assert first.draft_s == pytest.approx(10 * 0.001) and first.draft_input_tokens == 3 + 10
    assert [s.period_s for s in rest] == pytest.approx([0.020] * 3)
    assert first_speculative_steps(machine, 0.0)[0].period_s == pytest.approx(0.020)

    capped = sp.Machine({0: [run(0, 0.010, 1, ended=True)], 8: [run(8, 0.020, 3)]}, 8)
    assert capped.sequence_tokens == 6  # a prompt of 4 and half of 4 generated
    first = first_speculative_steps(capped, 0.001)[0]
    assert first.period_s == pytest.approx(0.020 + 6 * 0.001) and first.draft_input_tokens == 9


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
SESSION38_64 = RESULTS / "steps_8b_replay_h200_session38_features_memory.jsonl.gz"
SESSION38_NO_FEATURES = RESULTS / "steps_8b_replay_h200_session38_nofeatures.jsonl.gz"
# These traces' adaptive runs were made by a policy that switched on a single probe's
# ratio: their tests, which check what follows such a switch, judge as it did.
ONE_PROBE = {"confirm": 1}


def test_a_replay_of_recorded_adaptive_runs_makes_the_live_policys_decisions():
    """64 streams with a head's features on the H200 (session 38): the live policy turned
    the 8-node tree off in its untimed run, then switched to the chain at its first probe,
    judged at 1.15 of off with no cost a token of its own yet, and back to off 3.5 s later.
    Fed the same steps, a fresh policy (of this code: its ratios differ, the prompts'
    prefill restated) makes the same two switches at the same steps; with the chain's cost
    known, it judges off at 1.36 of the chain and switches back. Judged at the 20 us a
    token the chain's steady steps then cost, its first probe comes out behind off and the
    bucket stays off. The batch passes through 17-32 sequences when a wave of prompts
    begins, and that bucket does not probe; made to (passing=False), the 8-node tree's probe
    there, whose steps each followed plain ones and caught the draft up, counts those
    catch-ups: far behind off."""
    live = sp.replay([SESSION38_64], 64, lambda: AdaptivePolicy(adaptive_shapes("", sp.TREE),
                                                                **ONE_PROBE))
    switches = [line.split(" (")[0] for line in live if "speculation" in line]
    assert switches == ["run -1 step 33: batch <= 64: speculation off, was 8/4/4",
                        "run 0 step 17: batch <= 64: speculation 3/1/3, was off",
                        "run 0 step 172: batch <= 64: speculation off, was 3/1/3"], live
    assert "run 0 step 172: batch <= 64: a probe of off judged at 1.3" in "\n".join(live)
    assert not any("batch <= 32" in line for line in live), live  # passed through: no probe
    passing = sp.replay([SESSION38_64], 64, lambda: AdaptivePolicy(adaptive_shapes("", sp.TREE),
                                                                   passing=False, **ONE_PROBE))
    tree = next(line for line in passing if "batch <= 32: a probe of 8/4/4" in line)
    assert float(tree.split("judged at ")[1].split()[0]) < 0.6, tree
    costed = sp.replay([SESSION38_64], 64, lambda: AdaptivePolicy(
        adaptive_shapes("", sp.TREE), unknown_cost=0.00002, **ONE_PROBE))
    first = next(line for line in costed if "a probe of 3/1/3" in line)
    assert first.startswith("run 0 step 17: batch <= 64: a probe of 3/1/3 judged at 0.9"), first
    assert not any("speculation 3/1/3, was off" in line for line in costed), costed


def adaptive_steps(path: Path, concurrency: int) -> list[target_pb2.StepStats]:
    """The steps of a trace's adaptive runs at ``concurrency``, in the recorded order."""
    return [stats for _, _, stats, _ in sp.adaptive_steps([path], concurrency)]


def test_a_switch_judged_at_an_unknown_cost_is_judged_again_once_it_is_known():
    """The same steps: the chain, switched to at its first probe with no cost a token of its
    own (at the tree's, it would have stayed off), has one 8 steps later, and off's probe
    starts then, not 100 steps later. Where the chain wins at the tree's cost too (32
    streams without features), the switch stands as judged."""
    policy = AdaptivePolicy(adaptive_shapes("", sp.TREE), **ONE_PROBE)
    probing_off = []
    for i, stats in enumerate(adaptive_steps(SESSION38_64, 64)[:300]):
        policy.observe(stats)
        chain_in_use = policy.buckets[64].mode == 2
        if chain_in_use and not shape_for(policy.policy, 64, sp.TREE).num_draft_tokens:
            probing_off.append(i)
    switched = 55 + 17  # the untimed run's 55 steps, then run 0's 18th
    assert probing_off and switched < probing_off[0] <= switched + 20, (switched, probing_off[:3])

    policy = AdaptivePolicy(adaptive_shapes("", sp.TREE), **ONE_PROBE)
    steps = adaptive_steps(SESSION38_NO_FEATURES, 32)
    for stats in steps:
        policy.observe(stats)
        if policy.buckets[32].mode == 2:
            break
    assert policy.buckets[32].mode == 2 and policy.buckets[32].recheck is None
    assert len(policy.buckets[32].ratios[1]) == 1  # the tree's, restated against the chain


def test_replay_prints_judgements_and_refuses_a_concurrency_without_adaptive_runs(capsys):
    assert sp.main([str(SESSION38_64), "--replay", "--concurrency", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("concurrency 64:\n  run -1 step 33: batch <= 64: a probe of off "
                          "judged at 1.49")
    judged = out.count(" judged at ")  # the summary counts every judgement once
    counted = re.findall(r"  batch <= \d+: probes of \S+ against \S+: (\d+), mean ratio", out)
    assert judged and sum(map(int, counted)) == judged
    assert re.search(r"\n  switches: \d+\n$", out)
    assert sp.main([str(SESSION38_64), "--replay", "--concurrency", "64", "--time-observe"]) == 0
    assert re.search(r"\n  switches: \d+\n  observe: \d+\.\d us a call ", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        sp.main([str(SESSION38_64), "--replay", "--concurrency", "16"])
    with pytest.raises(SystemExit):
        sp.main([str(SESSION38_64), "--replay", "--unknown-cost-us", "-1"])


def test_replay_with_a_variant_replays_the_variants_runs_with_its_settings(tmp_path, capsys):
    """A sweep's variant runs (here session 38's adaptive runs, copied as a variant's) are
    replayed by a policy built with --variant's settings, after adaptive's replay: with
    confirm 1, as those runs were made, the variant's replay makes the recorded switches."""
    runs = [json.loads(line) for line in gzip.decompress(SESSION38_64.read_bytes()).splitlines()]
    copied = [{**run, "mode": "variant"} for run in runs if run["mode"] == "adaptive"]
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(run) + "\n" for run in runs + copied))
    assert sp.main([str(trace), "--replay", "--concurrency", "64",
                    "--variant", json.dumps(ONE_PROBE)]) == 0
    out = capsys.readouterr().out
    adaptive, variant = out.split("concurrency 64, the variant's runs ({'confirm': 1}):\n")
    live = sp.replay([SESSION38_64], 64, lambda: AdaptivePolicy(adaptive_shapes("", sp.TREE),
                                                                **ONE_PROBE))
    assert [line for line in variant.splitlines() if " judged at " in line or "was" in line] \
        == [f"  {line}" for line in live]
    assert "run 0 step 17: batch <= 64: speculation 3/1/3, was off" in variant
    # confirm 2: no switch on the chain's first probe
    assert "run 0 step 17: batch <= 64: speculation 3/1/3, was off" not in adaptive
    assert sp.main([str(SESSION38_64), "--replay", "--concurrency", "64",
                    "--variant", json.dumps(ONE_PROBE)]) == 0  # no variant runs: adaptive's only
    assert "the variant's runs" not in capsys.readouterr().out


def test_probe_spread_gives_each_pair_of_modes_its_probes_mean_and_spread():
    lines = [f"run 0 step {i}: batch <= 1: a probe of off judged at {r} of 8/4/4 (1 vs 1 tok/s)"
             for i, r in enumerate((1.1, 1 / 1.1, 1.1, 1 / 1.1))]
    lines += ["run 1 step 5: batch <= 1: a probe of 3/1/3 judged at 0.950 of off (1 vs 1 tok/s)",
              "run 1 step 7: batch <= 2: a probe of off judged at 0.9 of 8/4/4 (1 vs 1 tok/s)",
              "run 1 step 9: batch <= 1: speculation off, was 8/4/4 (1 vs 1 tok/s per request)"]
    spread = math.log(1.1) * math.sqrt(4 / 3)  # four log ratios of +-log 1.1
    assert sp.probe_spread(lines) == [
        "batch <= 1: probes of 3/1/3 against off: 1, mean ratio 0.950, spread of a probe's "
        "log ratio unknown",
        f"batch <= 1: probes of off against 8/4/4: 4, mean ratio 1.000, spread of a probe's "
        f"log ratio {spread:.3f}",
        "batch <= 2: probes of off against 8/4/4: 1, mean ratio 0.900, spread of a probe's "
        "log ratio unknown",
        "switches: 1"]


def judged(probed: str, in_use: str, tokens: tuple[float, float], run: tuple[float, float],
           steady: tuple[float, float], share: tuple[float, float] = (1.0, 1.0),
           sides: tuple[float, float] | None = None) -> str:
    """A judgement's line as AdaptivePolicy logs it, its ratio the product of its parts (each
    pair: the probe's, then the mode in use's), and where ``sides`` is given, the ratios
    against the mode in use's steps before the probe alone and after it alone."""
    ratio = tokens[0] / steady[0] * share[0] / (tokens[1] / steady[1] * share[1])
    alone = "" if sides is None else (f"; against the steps before it alone {sides[0]:.3f}; "
                                      f"against the steps after it alone {sides[1]:.3f}")
    return (f"run 0 step 1: batch <= 2: a probe of {probed} judged at {ratio:.3f} of {in_use} "
            f"(1 vs 1 tok/s per request in flight; tokens a step {tokens[0]:.3f} vs "
            f"{tokens[1]:.3f}, step {run[0]:.4f} vs {run[1]:.4f} ms as run, {steady[0]:.4f} vs "
            f"{steady[1]:.4f} restated, share decoding {share[0]:.3f} vs {share[1]:.3f}{alone})")


def test_probe_spread_finds_probes_that_favour_the_mode_in_use_and_which_part_holds_it():
    """Off's steps take 5 ms and the tree's 15 (3 tokens a step: level). Probed from off the
    tree's steps ran at 16.5 ms, and off's probed from the tree at 5.5: each direction's
    probes favoured the mode in use by 10 %, all of it in the step time as run."""
    lines = [judged("8/4/4", "off", (3, 1), (16.5, 5), (16.5, 5)),
             judged("off", "8/4/4", (1, 3), (5.5, 15), (5.5, 15)),
             "run 1 step 9: batch <= 2: speculation off, was 8/4/4 (1 vs 1 tok/s per request)"]
    spread = sp.probe_spread(lines)
    assert spread[-2:] == [
        "batch <= 2: 8/4/4 and off, each probed from the other: mean ratios multiply to 0.826: "
        "tokens a step 1.000, step time as run 0.826, restatement 1.000, share decoding 1.000",
        "switches: 1"]
    # the same bias, but restating the probes' steps made them dearer (their prompts): there
    lines = [judged("8/4/4", "off", (3, 1), (15, 5), (16.5, 5)),
             judged("off", "8/4/4", (1, 3), (5, 15), (5.5, 15))]
    assert sp.probe_spread(lines)[-2].endswith(
        "tokens a step 1.000, step time as run 1.000, restatement 0.826, share decoding 1.000")
    # with each side's ratio: the mode in use's steps after a probe ran 10 % slower than
    # those before it (a change of mode's after-effect), so each probe was judged 5 % low
    # against both, not at all against the steps after it alone
    lines = [judged("8/4/4", "off", (3, 1), (16.5, 5), (16.5, 5), sides=(0.909, 1.0)),
             judged("off", "8/4/4", (1, 3), (5.5, 15), (5.5, 15), sides=(0.909, 1.0))]
    assert sp.probe_spread(lines)[-2] == (
        "batch <= 2: 8/4/4 and off, a probe judged against the mode in use's steps on both "
        "sides of it, before it alone, after it alone: mean ratios multiply to 0.826, 0.826, "
        "1.000; a probe's log ratio spreads unknown, unknown, unknown")
    # two probes each way, 4 % apart against the steps after them and level against both
    lines += [judged("8/4/4", "off", (3, 1), (16.5, 5), (16.5, 5), sides=(0.909, 0.96)),
              judged("off", "8/4/4", (1, 3), (5.5, 15), (5.5, 15), sides=(0.909, 1.04))]
    # each direction's two log ratios about their mean, pooled (2 degrees of freedom)
    spread = math.sqrt((math.log(0.96) ** 2 + math.log(1.04) ** 2) / 4)
    assert sp.probe_spread(lines)[-2].endswith(
        f"mean ratios multiply to 0.826, 0.826, 0.999; a probe's log ratio spreads 0.000, "
        f"0.000, {spread:.3f}")
    lines[0] = re.sub(r"; against the steps before.*\)$", ")", lines[0])  # one line without
    assert "judged against" not in "\n".join(sp.probe_spread(lines))
    assert sp.probe_spread(lines)[-2].endswith("share decoding 1.000")  # the parts still parse
    # lines without the parts (an older policy's): the product alone
    lines = [re.sub(r"; tokens a step .*\)$", ")", line) for line in lines]
    assert sp.probe_spread(lines)[-2] == ("batch <= 2: 8/4/4 and off, each probed from the "
                                          "other: mean ratios multiply to 0.826")


def test_a_replayed_judgements_parts_make_its_ratio():
    """The policy's log line carries its ratio's parts, which multiply back to the ratio."""
    lines = sp.replay([SESSION38_64], 64, lambda: AdaptivePolicy(adaptive_shapes("", sp.TREE)))
    ratios = [(float(found[3]), sp._factors(sp.PARTS.search(line)))
              for line in lines if (found := sp.JUDGED.search(line))]
    assert ratios
    for ratio, factors in ratios:
        assert math.exp(sum(factors)) == pytest.approx(ratio, rel=2e-3)
    # the mode in use's rate over the steps on both sides of a probe is the steps' mean, so
    # the ratio against both lies between those against each side alone
    sides = [(float(found[3]), *map(float, alone.groups())) for line in lines
             if (found := sp.JUDGED.search(line)) and (alone := sp.SIDES.search(line))]
    assert len(sides) == len(ratios)
    assert any(before != after for _, before, after in sides)
    for ratio, before, after in sides:
        assert min(before, after) - 1e-3 <= ratio <= max(before, after) + 1e-3


SESSION39_64 = RESULTS / "steps_8b_replay_h200_session39_ab1_head_9350253.jsonl.gz"


def test_a_probe_that_loses_time_is_spaced_so_probes_lose_a_small_share():
    """64 streams with a head's features on the H200 (session 39): the chain's first probe
    from off was judged level with off (1.01 at a steady run's prompts), but its first step
    caught 64 sequences up (0.1 s) and its steps ran between two waves: the probe lost 0.1 s.
    Spaced by its step time alone, the next would come 100 x 5.25 steps later (3.7 s at
    the 7 ms a plain step then took: 3 % of the time lost); spaced so that a probe loses at
    most 2 % of the time, 740 steps later."""
    def interval_after_first_probe(**options: float) -> int:
        policy = AdaptivePolicy(adaptive_shapes("", sp.TREE), **ONE_PROBE, **options)
        for stats in adaptive_steps(SESSION39_64, 64):
            policy.observe(stats)
            bucket = policy.buckets[64]
            if bucket.ratios[2] and not bucket.after_left and len(bucket.window) >= 8:
                return policy._interval(bucket, 2)
        raise AssertionError("no probe of the chain")

    assert 500 <= interval_after_first_probe(probe_share=1.0) <= 550
    assert interval_after_first_probe() >= 700


def test_a_mode_left_is_probed_again_no_sooner_than_its_catch_up_allows():
    """64 streams with a head's features on the H200 (session 39, the second A/B): the chain
    ran from its first probe until a probe of off turned it off. Its next probe begins with a
    catch-up of everything committed while off (its last one began with 0.08 s of it): it is
    spaced by that, 540 steps later, not by the step times alone (270; there it caught up
    0.39 s, 9 % of a 4.4-s run)."""
    def chain_interval_after_leaving_it(**options: float) -> int:
        policy = AdaptivePolicy(adaptive_shapes("", sp.TREE), **ONE_PROBE, **options)
        left = False
        for stats in adaptive_steps(RESULTS / "steps_8b_replay_h200_session39_ab2_head_517b641"
                                    ".jsonl.gz", 64):
            was = policy.buckets[64].mode
            policy.observe(stats)
            bucket = policy.buckets[64]
            left = left or (was == 2 and bucket.mode == 0)
            if left and len(bucket.window) >= 8 and not bucket.after_left:
                return policy._interval(bucket, 2)
        raise AssertionError("the chain was never left")

    assert chain_interval_after_leaving_it() >= 500
    assert chain_interval_after_leaving_it(probe_share=1.0) < 300


def test_batches_tells_throughput_from_the_rate_a_decoding_sequence(tmp_path, capsys):
    """--batches: at 5 streams, a run whose steps decode 3 sequences (two streams are out of
    the batch, one of them held by the target) and end one request of 6 tokens every 2
    steps: its throughput is 3/5 of 5 times its rate a decoding sequence, and each ended
    request's stream was out 4 steps, 2 of them at the target; told the requests in flight,
    the policy would count the 2 at the target."""
    fields = [*TRACE_FIELDS, "first_child_accepted"]
    rows = []
    for i in range(10):
        row = dict.fromkeys(TRACE_FIELDS, 0) | {
            "step": i, "batch_size": 3, "committed_tokens": 3, "period_s": 0.01,
            "finished_requests": i % 2, "finished_generated_tokens": 6 * (i % 2),
            "held_sequences": 4}
        rows.append([row[name] for name in TRACE_FIELDS] + [[]])
    in_flight = [4 - i % 2 for i in range(10)]  # the 4 held, but one that just ended
    lines = [json.dumps({"concurrency": 5, "mode": mode, "run": run, "fields": fields,
                         "steps": rows, "in_flight": in_flight})
             for mode, run in (("OFF", -1), ("OFF", 0))]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert sp.main([str(path), "--batches"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "5 streams, OFF run 0 (off 100%): 10 decode steps, 0.10 s, 300 tok/s, 100.0 tok/s a "
        "decoding sequence, mean batch 3.0; 0.50 requests ended a step, 6.0 tokens each, "
        "4.0 steps out of the batch each (2.0 at the target), 2.0 by the requests in flight"]


def test_batches_tells_how_often_the_next_request_joined_the_next_step(tmp_path, capsys):
    """--batches at 2 streams: of the three steps that end a request with both streams
    decoding, the step after the first prefills the next prompt beside the other stream (it
    joined at once), the one after the second decodes that stream alone (it missed that
    step), and the one after the third ends the run; a request that ends with one stream
    out is not counted."""
    fields = [*TRACE_FIELDS, "first_child_accepted"]
    plan = [(2, 0, 0), (2, 0, 1), (1, 64, 0), (2, 0, 1), (1, 0, 0), (1, 64, 1), (2, 0, 0),
            (2, 0, 1)]  # (batch, prompt tokens prefilled, requests ended)
    rows = []
    for i, (batch, prefill, ended) in enumerate(plan):
        row = dict.fromkeys(TRACE_FIELDS, 0) | {
            "step": i, "batch_size": batch, "prefill_tokens": prefill, "committed_tokens": batch,
            "period_s": 0.01, "finished_requests": ended, "finished_generated_tokens": 8 * ended}
        rows.append([row[name] for name in TRACE_FIELDS] + [[]])
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"concurrency": 2, "mode": "ON", "run": 0, "fields": fields,
                                "steps": rows}) + "\n")
    assert sp.main([str(path), "--batches"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("; the next request joined the next step after 1 of 2 ends (50%)")


def test_the_digest_of_a_traces_decisions_changes_with_any_decision(capsys, monkeypatch):
    """--digest replays a trace's adaptive runs and hashes what the policy decided: its
    judgements, its switches and the table it sent at every step that changed it. The same
    policy gives the same digest; one that switches on a single probe (confirm 1: the chain
    at step 17 of session 38's 64-stream run) gives another."""
    lines = sp.replay([SESSION38_64], 64, lambda: AdaptivePolicy(adaptive_shapes("", sp.TREE)),
                      tables=True)
    tables = [line for line in lines if ": table " in line]
    assert tables and all(re.fullmatch(r"run -?\d+ step \d+: table .*batch.*", t) for t in tables)
    assert [line for line in lines if ": table " not in line] == sp.replay(
        [SESSION38_64], 64, lambda: AdaptivePolicy(adaptive_shapes("", sp.TREE)))
    assert sp.main([str(SESSION38_64), "--digest"]) == 0
    first = capsys.readouterr().out
    at_64 = rf"{SESSION38_64.name} concurrency 64: {len(lines)} lines, [0-9a-f]{{16}}"
    assert re.search(rf"(?m)^{at_64}$", first) and re.search(r"\nall: [0-9a-f]{16}\n$", first)
    assert sp.main([str(SESSION38_64), "--digest"]) == 0
    assert capsys.readouterr().out == first
    monkeypatch.setattr(sp, "AdaptivePolicy", lambda shapes: AdaptivePolicy(shapes, **ONE_PROBE))
    assert sp.main([str(SESSION38_64), "--digest"]) == 0
    other = capsys.readouterr().out
    assert not re.search(rf"(?m)^{at_64}$", other) and other.splitlines()[-1] != first.splitlines()[-1]


def test_after_tells_a_plain_run_slowed_by_the_run_before_it(tmp_path, capsys):
    """--after: at 1 stream, a plain run right after an ON run has its first quarter's steps
    at 12 ms, a plain run after another plain one all at 10 ms; each plain run also has a
    prompt's step (not a plain decode step, left out) and the ON runs are not plain runs.
    The slowed run's median step is still 10 ms (three quarters at 10), its first quarter
    1.2 times the other's; warm-ups count only as the run before."""
    fields = [*TRACE_FIELDS, "first_child_accepted"]

    def run_line(mode: str, run: int, periods: list[float]) -> str:
        rows = []
        for i, period in enumerate([0.05, *periods]):  # the first step prefills the prompt
            speculated = mode == "ON"
            row = dict.fromkeys(TRACE_FIELDS, 0) | {
                "step": i, "batch_size": 1, "prefill_tokens": 16 if i == 0 else 0,
                "speculated": speculated, "tree_budget": 8 if speculated else 0,
                "committed_tokens": 3 if speculated else 1, "period_s": period,
                "total_s": period, "forward_s": period - 0.001}
            rows.append([row[name] for name in TRACE_FIELDS] + [[]])
        return json.dumps({"concurrency": 1, "mode": mode, "run": run, "fields": fields,
                           "steps": rows})

    plain, slowed = [0.010] * 15, [0.012] * 3 + [0.010] * 12  # 16 steps: 4 a quarter
    lines = [run_line("ON", -1, [0.02] * 15), run_line("OFF", 0, slowed),
             run_line("ON", 0, [0.02] * 15), run_line("OFF", 1, slowed),
             run_line("OFF", 2, plain), run_line("ON", 1, [0.02] * 15)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert sp.main([str(path), "--after"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "1 streams, plain runs after OFF: 1 run, step 10.000 ms (1.000), forward 9.000 ms "
        "(1.000); the forward by quarter of the run 9.000 ms (0.818), 9.000 ms (1.000), "
        "9.000 ms (1.000), 9.000 ms (1.000) (in brackets: against the 2 runs after other modes)",
        "1 streams, plain runs after ON: 2 runs, step 10.000 ms (1.000), forward 9.000 ms "
        "(1.000); the forward by quarter of the run 11.000 ms (1.222), 9.000 ms (1.000), "
        "9.000 ms (1.000), 9.000 ms (1.000) (in brackets: against the 1 run after other modes)"]
