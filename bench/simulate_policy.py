"""Replays recorded step traces through the adaptive policy, offline: how close it comes to the
best fixed mode, over many seeds, in seconds instead of a sweep's half hour.

The input is a ``bench_concurrency.py --step-trace`` file. Its runs of one fixed mode (OFF,
ON, chain; or ON of ``--shape chain3`` for the chain) give, per concurrency, a pool of steps for each
draft budget (0: off), with the machine's slow drift taken out of each run and kept as one
factor of time that every mode shares (:class:`Machine`). A simulation feeds a fresh
``gateway.policy.AdaptivePolicy`` one step after another: the policy's budget for the
step's batch size (the target applies it per step; :func:`simulate` says how the size is
drawn) picks the pool, the next step of that pool (from a random starting point, wrapping),
times the drift at the simulated clock, is what the step cost and committed, and the policy
observes it as the target would report it. Per seed, adaptive's tokens per second over the
steps after the first ``--settle`` is compared with the best budget (the highest median over
all seeds) run alone on the same seed (the same drift and pool starts). Until session 14 it
was compared with each seed's highest fixed rate, which flatters the best where budgets are
a few per cent apart.

What it leaves out: a switch of mode costs nothing beyond the steps the policy itself leaves
out, unless ``--catch-up-us`` prices the draft's catch-up after plain steps (:func:`simulate`),
and the drift is OFF's, laid end to end. Calibration: one probe's log ratio (probe
against the steps around it) varied by 0.08-0.11 at 1 stream in simulation with the default
``--window`` and by 0.07-0.12 in the recorded adaptive runs. So it
measures how well the policy resolves modes through this machine's per-step noise, the
question at 1-2 streams on a 2-core CPU, where the sweeps' rounds cannot tell::

    python bench/bench_concurrency.py --start --prompts heldout --concurrency 1,2 \\
        --repeats 5 --modes OFF,ON --min-run-s 10 --step-trace /tmp/tree.jsonl
    python bench/bench_concurrency.py --start --prompts heldout --concurrency 1,2 \\
        --repeats 5 --modes OFF,ON --shape chain3 --min-run-s 10 --step-trace /tmp/chain.jsonl
    python bench/simulate_policy.py /tmp/tree.jsonl /tmp/chain.jsonl --seeds 100

``--variant '{"probe_share": 0.01}'`` adds a second policy built with those settings, on the
same seeds (a setting's effect resolved in seconds, where a sweep's rounds cannot).

The traces behind session 13's policy changes (1-2 streams, 2 CPU cores) are
``bench/results/steps_cpu_session13_{tree,chain}.jsonl.gz``; session 14's sweep (Q) recorded
OFF, the tree, the chain and adaptive at 1 stream in one sweep
(``bench/results/steps_cpu_session14_Q.jsonl.gz``).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import hashlib
import json
import logging
import math
import random
import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from gateway.policy import AdaptivePolicy, adaptive_shapes, describe_policy, requests_out
from splitspec.v1 import common_pb2, target_pb2
from target_service.engine import shape_for

TREE = common_pb2.DraftShape(num_draft_tokens=8, topk=4, num_steps=4)  # the benchmarks' ON


def load_runs(paths: list[Path]) -> dict[int, dict[int, list[list[target_pb2.StepStats]]]]:
    """Per concurrency, per draft budget (0: off), the timed runs of one fixed mode (warm-ups and
    adaptive runs left out), each a list of its steps in order; steps that only prefilled are
    kept (they cost time the policy does not see, as in a real run)."""
    runs: dict[int, dict[int, list[list[target_pb2.StepStats]]]] = defaultdict(
        lambda: defaultdict(list))
    for path in paths:
        for run in _read_runs(path):
            if run["run"] < 0 or run["mode"] not in ("OFF", "ON", "chain"):
                continue
            fields = run["fields"]
            steps = [target_pb2.StepStats(**dict(zip(fields, row, strict=True)))
                     for row in run["steps"]]
            budgets = {s.tree_budget for s in steps if s.speculated}
            if len(budgets) > 1:
                raise ValueError(f"{path}: a {run['mode']} run used budgets {sorted(budgets)}")
            runs[run["concurrency"]][budgets.pop() if budgets else 0].append(steps)
    return runs


def _read_runs(path: Path) -> list[dict[str, Any]]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def adaptive_steps(paths: list[Path], concurrency: int, mode: str = "adaptive"
                   ) -> Iterator[tuple[int, int, target_pb2.StepStats, int | None]]:
    """The steps of the traces' adaptive runs (or ``mode``'s: ``variant``) at ``concurrency``,
    in the recorded order (the untimed runs first): (run, -1 untimed; the step's index in its
    run; the step; the requests in flight the policy was told with it, None in a trace older
    than that)."""
    for path in paths:
        for run in _read_runs(path):
            if run["mode"] == mode and run["concurrency"] == concurrency:
                in_flight = run.get("in_flight") or [None] * len(run["steps"])
                for i, (row, count) in enumerate(zip(run["steps"], in_flight, strict=True)):
                    yield run["run"], i, target_pb2.StepStats(**dict(zip(run["fields"], row,
                                                                         strict=True))), count


def replay(paths: list[Path], concurrency: int, make_policy: Callable[[], AdaptivePolicy],
           mode: str = "adaptive", tables: bool = False) -> list[str]:
    """Feeds the adaptive runs (or ``mode``'s) at ``concurrency`` (its untimed runs first, in
    the recorded order) to one fresh policy, as ``bench_concurrency.py`` did, and returns
    each judgement and switch the policy logged, a line each (prefixed with the run, -1
    untimed, and the step of that run the policy had just observed); with ``tables``, each
    table it sent the target too. With the policy the target ran, its decisions are the
    recorded run's; with another, the replay follows the recorded steps only until its
    first different decision."""
    lines: list[str] = []
    where = (0, 0)  # the run and step the policy is observing

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"run {where[0]} step {where[1]}: {record.getMessage()}")

    handler, logger = Collect(level=logging.DEBUG), logging.getLogger("gateway.policy")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        policy = make_policy()
        for run, step, stats, in_flight in adaptive_steps(paths, concurrency, mode):
            where = (run, step)
            sent = policy.observe(stats, in_flight)
            if tables and sent is not None:
                lines.append(f"run {run} step {step}: table {describe_policy(sent)}")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return lines


def digests(path: Path) -> Iterator[tuple[int, int, str]]:
    """Per concurrency of a trace's adaptive runs (ascending): the lines :func:`replay` gives
    with the tables, and their SHA-256, with the gateway's default policy. The check of a
    change to the policy meant to leave its decisions alone (one that makes it cheaper):
    the same digests before and after it, over the stored traces, mean the same
    judgements at the same ratios (as logged), the same switches and the same table sent
    at every step."""
    found = sorted({run["concurrency"] for run in _read_runs(path) if run["mode"] == "adaptive"})
    for concurrency in found:
        lines = replay([path], concurrency, lambda: AdaptivePolicy(adaptive_shapes("", TREE)),
                       tables=True)
        yield concurrency, len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()


def observe_cost(paths: list[Path], concurrency: int, repeats: int = 3) -> float:
    """Seconds one ``AdaptivePolicy.observe`` call takes on this machine, over the traces'
    adaptive steps at ``concurrency`` fed to a fresh policy (the fastest of ``repeats``
    passes; logging off): the gateway's own work each step, which on 2 CPU cores shares
    them with the target and the draft."""
    steps = [(stats, in_flight) for _, _, stats, in_flight in adaptive_steps(paths, concurrency)]
    best = math.inf
    for _ in range(repeats):
        policy = AdaptivePolicy(adaptive_shapes("", TREE))
        start = time.perf_counter()
        for stats, in_flight in steps:
            policy.observe(stats, in_flight)
        best = min(best, (time.perf_counter() - start) / len(steps))
    return best


JUDGED = re.compile(r"batch <= (\d+): a probe of (\S+) judged at ([0-9.]+) of (\S+) ")
# the parts of the probe's rate and the mode in use's (gateway/policy.py, RateParts)
PARTS = re.compile(r"tokens a step ([0-9.]+) vs ([0-9.]+), step ([0-9.]+) vs ([0-9.]+) ms as "
                   r"run, ([0-9.]+) vs ([0-9.]+) restated, share decoding ([0-9.]+) vs ([0-9.]+)[;)]")
FACTORS = ("tokens a step", "step time as run", "restatement", "share decoding")
# the ratio against the mode in use's steps before the probe alone, and after it alone
SIDES = re.compile(r"against the steps before it alone ([0-9.]+); against the steps after it "
                   r"alone ([0-9.]+)\)")


def _factors(found: re.Match) -> tuple[float, ...]:
    """The logs of a judgement's FACTORS, which sum to the log of its ratio (the probe's rate
    over the mode in use's): tokens a step (the probe's over the mode in use's), step time as
    run (the mode in use's over the probe's), what restating each for a steady run did to
    that, and the share of a request's steps decoding."""
    t_o, t_m, run_o, run_m, steady_o, steady_m, share_o, share_m = map(float, found.groups())
    return (math.log(t_o / t_m), math.log(run_m / run_o),
            math.log(steady_m / run_m) - math.log(steady_o / run_o), math.log(share_o / share_m))


def probe_spread(lines: list[str]) -> list[str]:
    """What :func:`replay`'s lines say of the probes' noise: per bucket, mode probed and mode
    in use, how many probes were judged, their ratios' geometric mean, and how far one
    probe's log ratio spreads (its standard deviation); then how many switches the policy
    made. A switch needs the mean of a mode's last PAIRS ratios to clear ``margin`` (2 %):
    where one probe spreads by 0.1, as at 1 stream on a 2-core CPU (docs/benchmarks.md,
    session 51), a mode 3 % behind clears it about one judgement in eight.

    For two modes each probed from the other, the product of the two mean ratios: 1 when the
    probes judge them alike whichever is in use, below 1 when they favour the mode in use
    (each direction's probes finding it ahead), and that product split into the FACTORS of
    the judgements (where the lines carry them): which part of the rate holds the bias. And
    the same product with each probe judged against the mode in use's steps on one side of
    it alone (before it; after it), where the lines carry those: a change of mode's
    after-effect weighs on the probe and the steps after it, not on those before it."""
    logs: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    parts: dict[tuple[int, str, str], list[tuple[float, ...] | None]] = defaultdict(list)
    # per judgement: its log ratio against both sides of the probe, before it alone, after it alone
    sides: dict[tuple[int, str, str], list[tuple[float, float, float] | None]] = defaultdict(list)
    for line in lines:
        if found := JUDGED.search(line):
            key = (int(found[1]), found[2], found[4])
            logs[key].append(math.log(float(found[3])))
            split = PARTS.search(line)
            parts[key].append(_factors(split) if split else None)
            alone = SIDES.search(line)
            sides[key].append((logs[key][-1], math.log(float(alone[1])),
                               math.log(float(alone[2]))) if alone else None)
    out = []
    for (size, probed, in_use), values in sorted(logs.items()):
        spread = f"{statistics.stdev(values):.3f}" if len(values) > 1 else "unknown"
        out.append(f"batch <= {size}: probes of {probed} against {in_use}: {len(values)}, mean "
                   f"ratio {math.exp(statistics.fmean(values)):.3f}, spread of a probe's log "
                   f"ratio {spread}")
    for (size, probed, in_use), values in sorted(logs.items()):
        back = logs.get((size, in_use, probed))
        if back is None or probed > in_use:
            continue
        product = math.exp(statistics.fmean(values) + statistics.fmean(back))
        line = (f"batch <= {size}: {probed} and {in_use}, each probed from the other: mean "
                f"ratios multiply to {product:.3f}")
        there, back_parts = parts[(size, probed, in_use)], parts[(size, in_use, probed)]
        if None not in there + back_parts:
            factors = [math.exp(statistics.fmean(p[i] for p in there)
                                + statistics.fmean(p[i] for p in back_parts))
                       for i in range(len(FACTORS))]
            line += ": " + ", ".join(f"{name} {f:.3f}" for name, f in zip(FACTORS, factors,
                                                                           strict=True))
        out.append(line)
        there, back_sides = sides[(size, probed, in_use)], sides[(size, in_use, probed)]
        if None not in there + back_sides:
            products = [math.exp(statistics.fmean(p[i] for p in there)
                                 + statistics.fmean(p[i] for p in back_sides))
                        for i in range(3)]
            spreads = [_pooled_spread([[p[i] for p in there], [p[i] for p in back_sides]])
                       for i in range(3)]
            out.append(f"batch <= {size}: {probed} and {in_use}, a probe judged against the "
                       f"mode in use's steps on both sides of it, before it alone, after it "
                       f"alone: mean ratios multiply to "
                       + ", ".join(f"{x:.3f}" for x in products)
                       + "; a probe's log ratio spreads "
                       + ", ".join("unknown" if x is None else f"{x:.3f}" for x in spreads))
    switches = sum(": speculation " in line and ", was " in line for line in lines)
    return [*out, f"switches: {switches}"]


def _pooled_spread(groups: list[list[float]]) -> float | None:
    """The standard deviation of values about their own group's mean, pooled over the groups
    (None with no more values than groups)."""
    free = sum(len(g) for g in groups) - len(groups)
    if free < 1:
        return None
    return math.sqrt(sum((x - statistics.fmean(g)) ** 2 for g in groups for x in g) / free)


def batch_lines(paths: list[Path]) -> list[str]:
    """Per timed run of the traces: its throughput against its tokens per second per
    decoding sequence (what the adaptive policy compares), and the mean decode batch at its
    number of streams. At a fixed number of streams a mode that ends requests sooner decodes
    fewer sequences a step: each ended request's stream is out of the batch a few steps
    (docs/benchmarks.md, thirty-fifth part). Where the trace has ``finished_requests`` (and
    ``held_sequences``), also the requests ended a step, their generated tokens each, and the
    steps each one's stream was out of the batch (of them at the target: prefilling or
    waiting for cache space), and where it has each step's requests in flight, the steps
    out that the adaptive policy learns from them (:meth:`AdaptivePolicy.out_steps`), and
    how often an ended request's stream had its next request in the very next step
    (:func:`_joins`)."""
    lines = []
    for path in paths:
        for run in _read_runs(path):
            if run["run"] < 0:
                continue
            ix = {name: i for i, name in enumerate(run["fields"])}
            steps = run["steps"]
            decode = [s for s in steps if s[ix["batch_size"]]]
            if not decode:
                continue
            streams, n = run["concurrency"], len(decode)
            seconds = sum(s[ix["period_s"]] for s in steps)
            tok_s = sum(s[ix["committed_tokens"]] for s in steps) / seconds
            per_seq = (sum(s[ix["committed_tokens"]] / s[ix["batch_size"]] for s in decode)
                       / sum(s[ix["period_s"]] for s in decode))
            batch = sum(s[ix["batch_size"]] for s in decode) / n
            budgets = Counter(s[ix["tree_budget"]] if s[ix["speculated"]] else 0 for s in decode)
            used = ", ".join(f"{b or 'off'} {c / n:.0%}" for b, c in sorted(budgets.items()))
            line = (f"{streams} streams, {run['mode']} run {run['run']} ({used}): {n} decode "
                    f"steps, {seconds:.2f} s, {tok_s:.0f} tok/s, {per_seq:.1f} tok/s a decoding "
                    f"sequence, mean batch {batch:.1f}")
            ended = sum(s[ix["finished_requests"]] for s in steps) if "finished_requests" in ix \
                else 0
            if ended:
                per_step = ended / n
                generated = sum(s[ix["finished_generated_tokens"]] for s in steps) / ended
                line += (f"; {per_step:.2f} requests ended a step, {generated:.1f} tokens each, "
                         f"{(streams - batch) / per_step:.1f} steps out of the batch each")
                if "held_sequences" in ix:
                    held = sum(s[ix["held_sequences"]] - s[ix["batch_size"]] for s in decode) / n
                    line += f" ({held / per_step:.1f} at the target)"
                if run.get("in_flight"):  # what the policy learns (AdaptivePolicy.out_steps)
                    out = sum(requests_out(count, s[ix["finished_requests"]],
                                           s[ix["batch_size"]])
                              for count, s in zip(run["in_flight"], steps, strict=True)
                              if s[ix["batch_size"]])
                    line += f", {out / ended:.1f} by the requests in flight"
                line += _joins(steps, ix, streams)
            lines.append(line)
    return lines


PLAIN_RUN_SHARE = 0.9  # --after: a plain run has at least this share of decode steps unspeculated


def after_lines(paths: list[Path]) -> list[str]:
    """Per concurrency, whether a plain run is slower after a run of some mode: the timed runs
    with at least PLAIN_RUN_SHARE of their decode steps unspeculated (OFF's, never's,
    adaptive's where it ran off), grouped by the mode of the run just before them at that
    concurrency in the same trace (warm-ups included). For each group, the median over its
    runs of each run's median plain decode step (``period_s``, the step as the client saw it)
    and forward (``forward_s``), then the forward's median by quarter of the run (the steps'
    place in the run; the last quarter holds the drain, where the batch shrinks), each beside
    its ratio to the runs after any other mode. A plain decode step: it decoded, did not speculate and
    prefilled no prompt. Sessions 66 and 67 found a plain run 1-2 % slower after an ON run on
    an H100, at the run's start; session 68, on another H100 host, did not (docs/benchmarks.md,
    fifty-first and fifty-second parts)."""
    runs: dict[tuple[int, str], list[PlainRun]] = defaultdict(list)
    for path in paths:
        before: dict[int, str] = {}
        for run in _read_runs(path):
            streams, previous = run["concurrency"], before.get(run["concurrency"])
            before[streams] = run["mode"]
            plain = _plain_run(run) if run["run"] >= 0 and previous is not None else None
            if plain is not None:
                runs[streams, previous].append(plain)
    lines = []
    for streams, previous in sorted(runs):
        mine = runs[streams, previous]
        others = [r for (s, p), group in runs.items() if s == streams and p != previous
                  for r in group]
        quarters = [_figure(mine, others, lambda group, q=q: [t for r in group
                                                               for t in r.quarters[q]])
                    for q in range(4)]
        lines.append(
            f"{streams} streams, plain runs after {previous}: {_runs(len(mine))}, step "
            f"{_figure(mine, others, lambda group: [r.step for r in group])}, forward "
            f"{_figure(mine, others, lambda group: [r.forward for r in group])}; the forward "
            f"by quarter of the run {', '.join(quarters)}"
            + (f" (in brackets: against the {_runs(len(others))} after other modes)"
               if others else ""))
    return lines


class PlainRun(NamedTuple):
    step: float  # the run's median plain decode step (period_s)
    forward: float  # and forward (forward_s)
    quarters: list[list[float]]  # the forwards of its plain decode steps, by quarter of the run


def _plain_run(run: dict[str, Any]) -> PlainRun | None:
    """A --step-trace run's plain decode steps (they decoded, did not speculate and prefilled
    no prompt), or None where it is no plain run: more than 1 - PLAIN_RUN_SHARE of its
    decode steps speculated, or none was plain."""
    ix = {name: i for i, name in enumerate(run["fields"])}
    steps = run["steps"]
    plain = [row[ix["batch_size"]] > 0 and not row[ix["speculated"]]
             and not row[ix["prefill_tokens"]] for row in steps]
    decode = [row for row in steps if row[ix["batch_size"]]]
    speculated = sum(1 for row in decode if row[ix["speculated"]])
    if not any(plain) or speculated > (1 - PLAIN_RUN_SHARE) * len(decode):
        return None
    kept = [row for row, is_plain in zip(steps, plain, strict=True) if is_plain]
    n = len(steps)
    quarters = [[row[ix["forward_s"]] for row, is_plain in zip(
        steps[q * n // 4:(q + 1) * n // 4], plain[q * n // 4:(q + 1) * n // 4], strict=True)
        if is_plain] for q in range(4)]
    return PlainRun(statistics.median(row[ix["period_s"]] for row in kept),
                    statistics.median(row[ix["forward_s"]] for row in kept), quarters)


def _figure(mine: list[PlainRun], others: list[PlainRun],
            values: Callable[[list[PlainRun]], list[float]]) -> str:
    """The median of ``values(mine)`` in ms, and beside it its ratio to that of ``others``."""
    value = statistics.median(values(mine) or [math.nan])
    other = values(others)
    return f"{value * 1e3:.3f} ms" + (f" ({value / statistics.median(other):.3f})"
                                      if other else "")


def _runs(count: int) -> str:
    return f"{count} run" + ("" if count == 1 else "s")


def _joins(steps: list[list], ix: dict[str, int], streams: int) -> str:
    """How often a stream's next request joined the very next step: of the steps that ended a
    request with every stream decoding, the share whose next decode step also prefilled a
    prompt. The target prefills a prompt that arrives while a step waits for the draft's
    reply in that step (Engine._late_prompts), so a request sent within that wait joins at
    once, and one sent later leaves its stream out of a whole step; plain steps have no such
    wait (docs/benchmarks.md, session 52)."""
    pairs = [(a, b) for a, b in zip(steps, steps[1:], strict=False)
             if a[ix["finished_requests"]] and a[ix["batch_size"]] == streams
             and b[ix["batch_size"]]]
    if not pairs:
        return ""
    joined = sum(1 for _, b in pairs if b[ix["prefill_tokens"]])
    return (f"; the next request joined the next step after {joined} of {len(pairs)} ends "
            f"({joined / len(pairs):.0%})")


def smooth(values: list[float], window: int) -> list[float]:
    """The mean of each value's centred window (shorter at the ends)."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    half = window // 2
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((sums[hi] - sums[lo]) / (hi - lo))
    return out


class Machine:
    """Each budget's steps with the machine's slow drift taken out, and that drift as one
    factor of time shared by all modes (as a real machine's is).

    A run's step times wander by tens of per cent over seconds (2 cores, three processes:
    OFF at 1 stream 6 to 9 ms a step within one run). The drift is what the policy's
    sandwiches cancel, but runs of different modes were recorded at different times, so
    replaying them side by side would make the drift look like a difference between the
    modes. So each step's time is divided by its run's centred ``window``-step mean and
    multiplied by its budget's mean step time (what remains: the fast noise, and that budget's
    cost); the drift is the OFF runs' smoothed step time over its mean, laid end to end in
    seconds, and every replayed step is multiplied by its value at the replay's clock."""

    def __init__(self, runs: dict[int, list[list[target_pb2.StepStats]]], window: int) -> None:
        self.pools: dict[int, list[target_pb2.StepStats]] = {}
        self._kinds: dict[int, dict[tuple[int, bool], list[int]]] = {}  # next_like's index
        for budget, budget_runs in runs.items():
            steps = [s for run in budget_runs for s in run]
            mean = statistics.fmean(s.period_s for s in steps)
            pool = []
            for run in budget_runs:
                for step, level in zip(run, smooth([s.period_s for s in run], window),
                                       strict=True):
                    flat = target_pb2.StepStats()
                    flat.CopyFrom(step)
                    flat.period_s = step.period_s / level * mean
                    pool.append(flat)
            self.pools[budget] = pool
        self.clock: list[float] = []  # OFF's seconds, end to end, and the drift from there on
        self.drift: list[float] = []
        off = [s for run in runs[0] for s in run]
        mean = statistics.fmean(s.period_s for s in off)
        elapsed = 0.0
        for run in runs[0]:
            for step, level in zip(run, smooth([s.period_s for s in run], window), strict=True):
                self.clock.append(elapsed)
                self.drift.append(level / mean)
                elapsed += step.period_s
        self.length_s = elapsed
        # a decoding sequence's mean length, prompt and half its generated tokens (what a
        # catch-up sends it at most): from the requests the OFF runs ended, unbounded where
        # the traces do not count them
        ended = sum(s.finished_requests for s in off)
        self.sequence_tokens = (sum(s.finished_prompt_tokens + s.finished_generated_tokens / 2
                                    for s in off) / ended if ended else float("inf"))

    def next_like(self, budget: int, step: target_pb2.StepStats, start: int) -> int | None:
        """The index of ``budget``'s pool's next step (from ``start``, wrapping) that decoded
        as many sequences as ``step`` and, like it, did or did not prefill a prompt (a mixed
        step costs more); None when none did."""
        where = self._kinds.setdefault(budget, defaultdict(list))
        if not where:
            for i, other in enumerate(self.pools[budget]):
                where[other.batch_size, other.prefill_tokens > 0].append(i)
        places = where.get((step.batch_size, step.prefill_tokens > 0))
        if not places:
            return None
        return places[bisect.bisect_left(places, start) % len(places)]

    def drift_at(self, seconds: float) -> float:
        return self.drift[bisect.bisect_right(self.clock, seconds % self.length_s) - 1]


def simulate(machine: Machine, choose: Callable[[int], int],
             observe: Callable[[target_pb2.StepStats], object], concurrency: int, steps: int,
             settle: int, seed: int, catch_up_s: float = 0.0) -> tuple[float, Counter]:
    """Tokens per second after the first ``settle`` of ``steps`` steps, each run with the
    budget ``choose`` gives for its own batch size (and shown to ``observe``), and the share of
    those steps per budget. A seed fixes where each pool and the drift start, so runs of
    different choices with one seed see the same machine.

    The target applies the policy to the batch it is about to run, and that batch is what
    the steps before left (an ending frees a slot, the next steps prefill into it). So the
    next step of the pool the step before came from says the batch size, and whether a
    prompt is prefilled beside it. When the policy gives that size another budget, the step
    is the next one of that budget's pool of the same size and kind, and the walk goes on in
    that pool. Where that pool has none (OFF's runs at 4 streams never decode 2 sequences:
    their requests end together), the drawn step stands, in its own budget. (Until session
    33 the budget was the one for the batch size of the step before, so at 2 streams a lone
    batch of 1 between batches of 2 ran in the budget of 2: the budget of 1 was seldom
    measured, and its probes were never judged.)

    With ``catch_up_s`` (seconds of draft wait a token), a speculative step after plain ones
    first catches the draft up: every token those steps committed or prefilled, at most
    each decoding sequence's mean length (``Machine.sequence_tokens``), adds that much to
    its period, its draft wait and its draft input, as a probe from off pays on a real
    target (with the built-in pair on 2 CPU cores, 20 us a token beyond a steady step's
    draft wait, or 24-36 by the slope over the probes' first steps; session 43). Without it
    a change of mode costs nothing."""
    rng = random.Random(seed)
    cursor = {budget: rng.randrange(len(pool)) for budget, pool in sorted(machine.pools.items())}
    clock = rng.uniform(0, machine.length_s)
    tokens, seconds, used = 0, 0.0, Counter()

    def chosen(batch_size: int) -> int:
        budget = choose(batch_size)
        if budget not in machine.pools:
            raise ValueError(f"budget {budget} was chosen, which the traces lack (they have "
                             f"{sorted(machine.pools)})")
        return budget

    budget = chosen(concurrency)
    behind = 0  # tokens the plain steps since the last speculative one left the draft to catch
    for i in range(steps):
        at = cursor[budget]
        drawn = machine.pools[budget][at]
        if drawn.batch_size and (own := chosen(drawn.batch_size)) != budget and (
                found := machine.next_like(own, drawn, cursor[own])) is not None:
            budget, at = own, found
        pool = machine.pools[budget]
        sample = target_pb2.StepStats()
        sample.CopyFrom(pool[at])
        cursor[budget] = (at + 1) % len(pool)
        sample.period_s *= machine.drift_at(clock)
        if catch_up_s and not budget:
            behind += sample.committed_tokens + sample.prefill_tokens
        elif catch_up_s and behind and sample.batch_size:
            sent = min(behind, sample.batch_size * machine.sequence_tokens)
            sample.period_s += sent * catch_up_s
            sample.draft_s += sent * catch_up_s
            sample.draft_input_tokens += round(sent)
            behind = 0
        clock += sample.period_s
        observe(sample)
        if i >= settle:
            tokens += sample.committed_tokens
            seconds += sample.period_s
            used[budget] += 1
    total = sum(used.values())
    return tokens / seconds, Counter({b: n / total for b, n in used.items()})


def summarize(machine: Machine, concurrency: int, make_policy: Callable[[], AdaptivePolicy],
              seeds: int, steps: int, settle: int, catch_up_s: float = 0.0) -> dict[str, Any]:
    """Per seed, adaptive's rate over the best fixed budget's on the same machine and seed.
    The best budget is the one of the highest median over all seeds, not each seed's
    highest: where budgets are a few per cent apart, the highest of a seed's noisy rates is
    flattered, and adaptive would look that much worse than it is."""
    shares, fixed, adaptive = Counter(), defaultdict(list), []
    for seed in range(seeds):
        for budget in machine.pools:
            rate, _ = simulate(machine, lambda _b, budget=budget: budget, lambda _s: None,
                               concurrency, steps, settle, seed, catch_up_s)
            fixed[budget].append(rate)
        policy = make_policy()
        budget_of = lambda batch, p=policy: shape_for(p.policy, batch, TREE).num_draft_tokens  # noqa: E731
        tok_s, used = simulate(machine, budget_of, policy.observe, concurrency, steps, settle,
                               seed, catch_up_s)
        adaptive.append(tok_s)
        shares.update(used)
    best = max(fixed, key=lambda budget: statistics.median(fixed[budget]))
    ratios = sorted(a / f for a, f in zip(adaptive, fixed[best], strict=True))
    return {"concurrency": concurrency,
            "fixed_tok_s": {b: statistics.median(r) for b, r in fixed.items()},
            "steps": {budget: len(pool) for budget, pool in machine.pools.items()},
            "best": best,
            "ratio_median": statistics.median(ratios), "ratio_p10": ratios[len(ratios) // 10],
            "ratio_min": ratios[0], "share": {b: n / seeds for b, n in sorted(shares.items())}}


def parse_variant(text: str) -> dict[str, Any]:
    """``'{"probe_share": 0.01}'`` -> the keyword arguments of the variant's AdaptivePolicy,
    checked by building one (this script's ``--variant`` and bench_concurrency.py's)."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--variant must be a JSON object: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError(f"--variant must be a JSON object, got {text!r}")
    try:
        AdaptivePolicy(adaptive_shapes("", TREE), **kwargs)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--variant {text}: {exc}") from exc
    return kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, nargs="+",
                        help="--step-trace files (gzipped where they end in .gz)")
    parser.add_argument("--seeds", type=int, default=100, help="simulations per concurrency")
    parser.add_argument("--steps", type=int, default=6000, help="steps per simulation")
    parser.add_argument("--settle", type=int, default=500,
                        help="first steps left out of adaptive's rate (its first probes)")
    parser.add_argument("--window", type=int, default=32,
                        help="steps of the centred mean that is a run's drift")
    parser.add_argument("--concurrency", type=int, nargs="*", help="default: all in the traces")
    parser.add_argument("--replay", action="store_true",
                        help="instead: feed the recorded adaptive runs, step by step, to a fresh "
                             "policy per concurrency (as the benchmark did) and print each "
                             "judgement and switch, then how far one probe's ratio spreads "
                             "per pair of modes (probe_spread); with the policy the target "
                             "ran, its decisions are the recorded ones; with --variant, the "
                             "same for the traces' variant runs, replayed with those settings")
    parser.add_argument("--digest", action="store_true",
                        help="instead: replay each trace's adaptive runs with the default "
                             "policy and print, per trace and concurrency, a digest of its "
                             "decisions (judgements, switches, the table at each step), then "
                             "one of them all: equal before and after a change to the policy "
                             "that must not change what it decides")
    parser.add_argument("--time-observe", action="store_true",
                        help="with --replay: also time one AdaptivePolicy.observe call on "
                             "these steps (the gateway's work a step)")
    parser.add_argument("--unknown-cost-us", type=float, default=0.0,
                        help="the policy's unknown_cost: microseconds of draft wait a token "
                             "sent, for a budget whose own cost is not known yet (default 0)")
    parser.add_argument("--catch-up-us", type=float, default=0.0,
                        help="microseconds of draft wait a token for the catch-up a speculative "
                             "step after plain ones pays (default 0: a change of mode costs "
                             "nothing): what those steps' draft_s exceeds a steady step's "
                             "by, over their draft_input_tokens, in the adaptive runs")
    parser.add_argument("--variant", type=parse_variant, default=None, metavar="JSON",
                        help="also simulate a second policy built with these keyword arguments "
                             "(e.g. '{\"probe_share\": 0.01}'), on the same seeds, and print "
                             "its line after adaptive's (as bench_concurrency.py --variant)")
    parser.add_argument("--after", action="store_true",
                        help="instead: per concurrency, the plain runs' median step and forward "
                             "grouped by the mode of the run before them, and the forward by "
                             "quarter of the run, each against the runs after the other modes "
                             "(is a plain run slower after ON?)")
    parser.add_argument("--batches", action="store_true",
                        help="instead: per timed run, its throughput against its tokens per "
                             "second per decoding sequence, its mean decode batch and (where "
                             "the trace has them) how long an ended request's stream was out "
                             "of the batch, the steps out a request the policy learns from "
                             "the requests in flight, and how often an ended request's stream "
                             "had its next request in the very next step")
    args = parser.parse_args(argv)
    if args.after:
        for line in after_lines(args.traces):
            print(line)
        return 0
    if args.batches:
        for line in batch_lines(args.traces):
            print(line)
        return 0
    if args.digest:
        every = hashlib.sha256()
        for path in args.traces:
            for concurrency, count, digest in digests(path):
                print(f"{path.name} concurrency {concurrency}: {count} lines, {digest[:16]}")
                every.update(digest.encode())
        print(f"all: {every.hexdigest()[:16]}")
        return 0
    if args.steps <= args.settle or min(args.seeds, args.window) < 1:
        parser.error("--steps must exceed --settle, and --seeds and --window be >= 1")
    if min(args.unknown_cost_us, args.catch_up_us) < 0:
        parser.error("--unknown-cost-us and --catch-up-us must be >= 0")
    if args.replay:
        by_mode: dict[str, set[int]] = defaultdict(set)  # the concurrencies each mode ran
        for path in args.traces:
            for run in _read_runs(path):
                by_mode[run["mode"]].add(run["concurrency"])
        found, variants = sorted(by_mode["adaptive"]), by_mode["variant"]
        variant_settings = {"unknown_cost": args.unknown_cost_us * 1e-6, **(args.variant or {})}
        for concurrency in args.concurrency or found:
            if concurrency not in found:
                parser.error(f"concurrency {concurrency}: the traces have no adaptive run")
            print(f"concurrency {concurrency}:")
            lines = replay(args.traces, concurrency, lambda: AdaptivePolicy(
                adaptive_shapes("", TREE), unknown_cost=args.unknown_cost_us * 1e-6))
            for line in [*lines, *probe_spread(lines)]:
                print(f"  {line}")
            if args.time_observe:
                print(f"  observe: {observe_cost(args.traces, concurrency) * 1e6:.1f} us a call "
                      f"(the fastest of 3 passes)")
            if args.variant is not None and concurrency in variants:
                # a bench_concurrency.py sweep's variant, replayed with its own settings
                print(f"concurrency {concurrency}, the variant's runs ({args.variant}):")
                lines = replay(args.traces, concurrency, lambda: AdaptivePolicy(
                    adaptive_shapes("", TREE), **variant_settings), "variant")
                for line in [*lines, *probe_spread(lines)]:
                    print(f"  {line}")
        return 0
    runs = load_runs(args.traces)
    for concurrency in args.concurrency or sorted(runs):
        budgets = runs[concurrency]
        if 0 not in budgets or TREE.num_draft_tokens not in budgets:
            parser.error(f"concurrency {concurrency}: the traces need OFF and ON (tree) runs")
        # the gateway's default budgets (the tree and a chain of 3), less those not recorded
        shapes = [s for s in adaptive_shapes("", TREE) if s.num_draft_tokens in budgets]
        machine = Machine(budgets, args.window)
        policies = {"adaptive": {}} | ({} if args.variant is None else {"variant": args.variant})
        for name, options in policies.items():
            result = summarize(machine, concurrency,
                               lambda shapes=shapes, options=options: AdaptivePolicy(
                                   shapes, **options),
                               args.seeds, args.steps, args.settle, args.catch_up_us * 1e-6)
            fixed = ", ".join(f"{b or 'off'}: {r:.1f} tok/s ({result['steps'][b]} steps)"
                              for b, r in sorted(result["fixed_tok_s"].items()))
            share = ", ".join(f"{b or 'off'} {s:.0%}" for b, s in result["share"].items())
            print(f"concurrency {concurrency}: {fixed}; {name} / best "
                  f"({result['best'] or 'off'}): median "
                  f"{result['ratio_median']:.3f}, p10 {result['ratio_p10']:.3f}, min "
                  f"{result['ratio_min']:.3f} over {args.seeds} seeds; steps {share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
