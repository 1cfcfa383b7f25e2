"""Tokens per second against concurrency for the speculation policies: OFF, ON, static, adaptive.

For each concurrency (requests kept in flight on one Serve stream, as the
gateway does), runs the policies ``--modes`` names (by default these four) interleaved,
``--repeats`` times each:

* OFF: no speculation;
* ON: the draft shape (``--shape``, default the tree of 8 nodes, topk 4, depth 4)
  at every batch size;
* chain (only with ``--modes``): the adaptive policy's small budget, a chain of 3 nodes, at
  every batch size (so that ``bench/simulate_policy.py`` can replay each of adaptive's
  budgets from the same sweep);
* never (only with ``--modes``): requests that may speculate (``SPECULATION_MODE_AUTO``) under
  a policy with no entry, so the target never speculates: plain decoding as adaptive runs it
  where its policy is off, without the adaptive policy's work in the client or its probes
  (so that a gap between adaptive and OFF where adaptive runs off can be placed: on one
  H100 host at 32 streams adaptive's off steps ran 2-3 % longer than OFF's; on another,
  never / OFF was 0.999 and 1.008 at 32 and 64 streams over 8 rounds, and adaptive's off
  runs level with OFF too; docs/benchmarks.md, fiftieth and fifty-first parts); its
  per-round ratio to OFF in the table;
* static: ``gateway.policy.static_policy`` with ``--static-threshold``
  (the gateway's ``--spec-disable-batch-threshold``: speculate up to that batch size);
* adaptive: one ``gateway.policy.AdaptivePolicy`` per concurrency with the gateway's
  default budgets (the shape and a chain of 3 nodes), fed with every step's statistics and
  learning across the repeats; the JSON's ``budget_step_shares`` says which budgets each
  run's steps used;
* variant (only with ``--modes`` and ``--variant``): a second adaptive policy, built with
  the keyword arguments ``--variant`` gives (for example ``'{"borrow_cost": true}'``),
  so that a change of the policy's settings is measured against adaptive in one run, its
  per-round ratio to adaptive in the table.

Each concurrency starts with ``--warmup`` untimed OFF, ON and adaptive (and variant) runs (adaptive
learns in them, as a long-running gateway would have; with ``--min-run-s``, untimed runs of
each policy once the timed runs' size is known, until one in which it settled (at most
``--policy-warmup``, :func:`settled`), since a warm-up of one wave of 64 requests can end
before the policy has judged anything, and at 2-8 streams on 2 CPU cores one run of that
size ended before it had left the tree it starts with): the first
runs on a fresh target are slow (2 CPU cores, 64 streams: OFF 12.4 s then
7.0 s for the same work), and a warm-up per concurrency covers new batch sizes
too. Medians are reported; a ratio is the median of the per-repeat ratios
(modes interleaved, so drift hits all alike); "best" is whichever of OFF and
ON has the higher median. Each round's modes run in turn, in an order from a balanced
(Williams) design, so that over its rows each mode runs in each place and right after each
other mode equally often, against the bias of a run's place and of the run before it
(:func:`round_order`; ``--order rotate``: shifted by one place each round, as sessions 45-54
ran; ``--order fixed``: the same order every round, as before). Beside adaptive / best
goes a 90 % bootstrap interval (whole rounds resampled, the best chosen again in each
resample): on a 2-core CPU two runs of one mode differ by up to 16 % (an A/A sweep,
docs/benchmarks.md), so a few rounds cannot resolve a 3 % aim, and the interval says where
they did not. Writes a markdown table (``--out-md``), the raw numbers with the machine and
command (``--out-json``) and a plot (``--out-png``, needs ``pip install -e '.[bench]'``)::

    python bench/bench_concurrency.py --start --draft-kind eagle3 --prompts heldout \\
        --concurrency 1,2,4,8,16,32,64 --repeats 3 --max-new-tokens 48 --static-threshold 8 \\
        --out-md docs/bench/concurrency_cpu.md --out-json bench/results/concurrency_cpu.json \\
        --out-png docs/bench/concurrency_cpu.png

``--new-tokens-spread F`` draws each request's length from [(1 - F) x max, max] (the same
lengths in every mode): without it every request of a wave generates ``--max-new-tokens``,
so plain decoding keeps each wave in step and prefills it in one step, while speculation
(different tokens per step for each sequence) makes requests finish and arrive one by one.

``--from-json`` re-renders the table and plot of a saved run without running anything;
``--join A.json B.json ...`` joins the saved calls of one sweep split by concurrency (a
GPU call's 10 minutes do not fit 6 rounds at 1-64 streams) into one report;
``--pool A.json B.json ...`` pools several saved sweeps (adaptive against the better fixed
mode, each sweep's and all their rounds', :func:`pool`): on a 2-core CPU the machine's speed
moves between sweeps by as much as the aim, so one sweep's ratio at 1-4 streams scatters.
``--modes`` runs fewer modes (OFF and ON always: the ratios are against them). With
``--start`` both services get ``--device`` and ``--dtype`` (and ``--max-context`` when
given); the target runs ``--max-running`` max(32, largest concurrency) sequences and
captures verify graphs for every budget used, and the draft holds at least as many. The
target's init report (each start-up step's seconds and detail: how many CUDA graphs were
captured, in how long) goes into the JSON as ``target_init``.

**Replay draft** (``--draft-kind replay``, with ``--start``): measures speed at a known
acceptance on a target no trained draft agrees with. The script starts the target alone
(``--target-model``, or ``--random-8b``: a Llama-3.1-8B-shaped checkpoint with RANDOM bf16
weights, written to a temporary folder with ``bench_decode_floor.random_checkpoint``; GPU
only), records its greedy continuations of exactly the sweep's prompts
(``--max-new-tokens`` + 8 tokens, ``splitspec.replay.record``), stops it, then starts
``python -m draft_service --kind replay`` on the records with ``--replay-corrupt-rate`` R and
a target connected to it, and sweeps. Each drafted main-path token is kept with
probability 1 - R, so ON accepts about sum_k (1 - R)^k draft tokens per verify step (k up
to the shape's depth); the default R = 0.18 gives 2.50 for the depth-4 tree, the
acceptance measured for the trained built-in EAGLE-3 pair (docs/benchmarks.md). The
report labels the draft ``replay(records.jsonl, corrupt R)``, gives ON's measured
acceptance beside the expected one, the replay draft's misses (trees for sequences that
left their record: another engine's numerics flipped a near-tie) and says RANDOM weights
where they were. With ``--replay-features`` the draft also takes an EAGLE-3 head's features
(three layer inputs of the target's hidden size a token) with every request, as a trained
head of the target's shape would, so the exchange's cost at high batch is in the figures. The GPU run of issue 7 (one H200; its 10-minute command limit in mind:
``--max-context 256`` keeps the KV cache of 64 sequences to about 2.6 GiB beside the
16 GB of weights; no ``--out-png``: matplotlib may be missing there, so the plot is
drawn afterwards with ``--from-json``; the JSON is saved after every concurrency, so a run
cut off at the limit keeps the concurrencies it finished)::

    python bench/bench_concurrency.py --start --device cuda --dtype bfloat16 --random-8b \\
        --draft-kind replay --replay-corrupt-rate 0.18 --prompts heldout --max-new-tokens 48 \\
        --max-context 256 --concurrency 1,2,4,8,16,32,64 --modes OFF,ON,adaptive --repeats 3 \\
        --out-json $OUT/concurrency_8b_replay.json --out-md $OUT/concurrency_8b_replay.md
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from bench_speculation import (
    SHAPES,
    RunStats,
    add_stack_arguments,
    free_port,
    load_prompts,
    log_policy_decisions,
    run_target,
    start_stack,
    start_target,
)
from simulate_policy import parse_variant

from gateway.policy import AdaptivePolicy, adaptive_shapes, bucket_of, static_policy
from splitspec.builtin import BUILTIN_TARGET
from splitspec.grpc_server import CHANNEL_OPTIONS, wait_for_serving
from splitspec.replay import record, write_records
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class Mode(NamedTuple):
    """How a mode (module docstring) is shown and warmed: its name in the table (``{threshold}``
    is the static threshold), its line's label and marker in the plot, whether it has untimed
    runs before the timed ones (``warm``), and whether it learns in them until settled with
    --min-run-s (``learning``)."""
    column: str
    label: str
    marker: str
    warm: bool = True
    learning: bool = False


# In this order in the runs, the table and the plot. A new mode is a line here, what it sends
# the target in the sweep's ``runs`` (sweep), and its ratio, if any, in summarize.
MODE_TABLE = {
    "OFF": Mode("OFF", "OFF", "o"),
    "ON": Mode("ON", "ON (always)", "s"),
    "chain": Mode("chain 3", "chain of 3 (always)", "v"),
    "never": Mode("never (AUTO)", "AUTO under a policy that never speculates", "x"),
    "static": Mode("static (<={threshold})", "static (speculate up to {threshold})", "^",
                   warm=False),
    "adaptive": Mode("adaptive", "adaptive", "D", learning=True),
    "variant": Mode("variant", "adaptive, variant", "P", learning=True),
}
MODES = tuple(MODE_TABLE)
DEFAULT_MODES = ("OFF", "ON", "static", "adaptive")  # and every report's before "chain"
WARM_MODES = tuple(mode for mode, how in MODE_TABLE.items() if how.warm)
LEARNING_MODES = tuple(mode for mode, how in MODE_TABLE.items() if how.learning)
AIM = 0.97  # adaptive within 3 % of the best of OFF and ON
INTERVAL_LEVEL = 0.9     # of the bootstrap interval around adaptive / best
BOOTSTRAP_SAMPLES = 2000
REPLAY = "replay"
# Recorded beyond --max-new-tokens, so a request's last trees still carry the target's
# tokens at every depth (at least the deepest shape's depth).
REPLAY_SPARE = 8
assert max(steps for _, _, steps in SHAPES.values()) <= REPLAY_SPARE
HEAD_DRAFT_VOCAB = 32000  # a Llama-3.1-8B EAGLE-3 head's (--replay-cost-head)
DEFAULT_CORRUPT_RATE = 0.18  # 2.50 accepted per verify step at depth 4: the trained pair's
SERVING_TIMEOUT_S = 300


def parse_modes(text: str) -> list[str]:
    """``"OFF,ON,adaptive"`` -> those modes, in MODES order; OFF and ON are required (every
    ratio is against them)."""
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not {"OFF", "ON"} <= set(modes):
        raise argparse.ArgumentTypeError(
            f"--modes must name OFF, ON and any of {', '.join(MODES[2:])} (got {text!r})")
    return [mode for mode in MODES if mode in modes]


ORDERS = ("balanced", "rotate", "fixed")


def round_order(modes: list[str], repeat: int, order: str) -> list[str]:
    """The order of round ``repeat``'s runs. ``fixed``: ``modes`` as given. ``rotate``: shifted
    by one place each round, so that over len(modes) rounds each mode runs once in each place;
    but each mode keeps the same predecessor in every round that does not start with it.
    ``balanced`` (the default): the rows of a Williams design (:func:`williams_rows`), one a
    round, so that over a cycle of rows each mode also runs right after each other mode
    equally often within the rounds. A run's predecessor biases it: on the H200 at 64 streams
    (session 45, docs/benchmarks.md), adaptive / OFF was 0.92-0.99 (mean 0.97) in the four
    rounds that ran adaptive right after ON and 0.99 in the two that did not; over ten CPU
    sweeps rotated from the order OFF, ON, adaptive (sessions 50-54), it was 0.8 % lower
    (standard error 0.7 %) in the rounds where adaptive followed ON, which rotation makes two
    in three (three in four with a fourth mode after it), and in the first balanced sweep
    ((AS), session 54) 0.5 % higher. No bias found, then; but rotation could not have spread
    one, and a balanced design does at no cost."""
    if order == "fixed":
        return list(modes)
    if order == "rotate":
        shift = repeat % len(modes)
        return [*modes[shift:], *modes[:shift]]
    if order != "balanced":
        raise ValueError(f"order must be one of {', '.join(ORDERS)} (got {order!r})")
    rows = williams_rows(len(modes))
    return [modes[i] for i in rows[repeat % len(rows)]]


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for n treatments: rows (orders of 0..n-1) in which every index is in
    every place equally often and follows every other index equally often (once each over
    the n rows for even n; over the 2n rows, the n cyclic ones and their mirrors, for odd n).
    The first row goes 0, 1, n-1, 2, n-2, ...; row i adds i to each entry, mod n."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


ORDER_TEXT = {"fixed": "", "rotate": " (the order rotated each round)",
              "balanced": " (each round's order a row of a balanced design: every mode in every "
                          "place and after every other mode alike)"}


def order_text(settings: dict[str, Any], num_modes: int) -> str:
    """How a report's rounds were ordered; for the balanced order, whether its rounds made
    whole cycles of the design's rows (with 3 modes a cycle is 6 rounds: in 2 or 3, adaptive
    runs right after ON in two, and on an H100 at 32-64 streams a plain run right after ON
    ran its steps 1.4 % longer, in the median of 24; docs/benchmarks.md, fiftieth part)."""
    order, repeats = order_of(settings), settings["repeats"]
    cycle = len(williams_rows(num_modes))
    if order != "balanced" or repeats % cycle == 0:
        return ORDER_TEXT[order]
    return (" (each round's order a row of a balanced design, whose rows give every mode every "
            f"place and every predecessor alike over {cycle} rounds; these {repeats} are not a "
            "whole number of such cycles)")


def order_of(settings: dict[str, Any]) -> str:
    """The order a report's rounds ran in (reports from before --order said rotate or not)."""
    return settings.get("order") or ("rotate" if settings.get("rotate") else "fixed")


def modes_of(report: dict[str, Any]) -> list[str]:
    """The modes a report ran (the default four in reports from before --modes)."""
    return list(report["settings"].get("modes", DEFAULT_MODES))


def expected_replay_acceptance(corrupt_rate: float, shape: list[int] | tuple[int, ...]) -> float:
    """Mean accepted draft tokens per verify step of the replay draft: sum_{k=1..L} (1 - R)^k
    for its main path of L = min(depth, nodes) (draft_service/replay.py)."""
    num, _, steps = shape
    return sum((1 - corrupt_rate) ** k for k in range(1, min(num, steps) + 1))


def parse_concurrency(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; each at least 1, increasing."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1 or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(
            f"--concurrency must be increasing positive integers, e.g. 1,2,4 (got {text!r})")
    return values


def prompts_for(concurrency: int, num_prompts: int) -> int:
    """Prompts run at one concurrency: `num_prompts`, or for 0 max(16, 2 x concurrency)
    (two waves of requests at least)."""
    return num_prompts or max(16, 2 * concurrency)


def prompts_for_time(default: int, concurrency: int, tokens_per_s: float, seconds: float,
                     max_new_tokens: float) -> int:
    """Prompts of `max_new_tokens` new tokens on average that keep a run at `tokens_per_s`
    busy for at least `seconds`: never fewer than `default`, and a whole number of waves of
    `concurrency` requests (so the last wave is as full as the others)."""
    need = max(default, math.ceil(seconds * tokens_per_s / max_new_tokens))
    return math.ceil(need / concurrency) * concurrency


def shortest_request(max_new_tokens: int, spread: float) -> int:
    """The fewest new tokens a request of a run with this spread generates (at least 1)."""
    return max(1, math.ceil((1 - spread) * max_new_tokens))


def request_lengths(count: int, max_new_tokens: int, spread: float) -> list[int]:
    """New tokens of each of `count` requests: all `max_new_tokens` at spread 0; else drawn
    uniformly from [shortest_request, max_new_tokens], the same list for every mode and run
    (seeded), so every mode does the same work."""
    if spread == 0:
        return [max_new_tokens] * count
    low, rng = shortest_request(max_new_tokens, spread), random.Random(0)
    return [rng.randint(low, max_new_tokens) for _ in range(count)]


def new_tokens_text(settings: dict[str, Any]) -> str:
    """'48' or, with a spread, '24-48' (the range of each request's new tokens)."""
    spread, top = settings.get("new_tokens_spread", 0.0), settings["max_new_tokens"]
    return f"{shortest_request(top, spread)}-{top}" if spread else str(top)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def describe_machine(device: str, dtype: str, started_here: bool) -> dict[str, Any]:
    """What ran the benchmark; `label` names it in the plot's title."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    accelerator = None
    if device.startswith("cuda"):
        import torch

        accelerator = torch.cuda.get_device_name(torch.device(device))
    cpu = cpu_model()
    label = (f"{accelerator}, {dtype}" if accelerator else f"{cores} cores of {cpu}, {dtype}")
    return {"label": label, "platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "cpu_count": cores, "torch": version("torch"), "device": device,
            "accelerator": accelerator, "dtype": dtype,
            "services_started_here": started_here}


def speculated_share(stats: RunStats) -> float:
    """Share of the steps with decoding sequences that speculated, mixed ones included (before
    session 26, decode-only steps: mostly a run's draining tail, see mean_decode_batch)."""
    decode = [s for s in stats.steps if s.batch_size]
    return sum(s.speculated for s in decode) / len(decode) if decode else 0.0


def steady_tokens_per_s(stats: RunStats) -> float:
    """Committed decode tokens per second from the run's first decode step to its last step
    that prefilled a prompt: while every stream is decoding or on its way to its next
    request. After the last prompt arrives a closed loop of fixed size drains, and a mode
    whose requests end one by one (speculation) drains over many steps at small batches
    where plain decoding's wave ends at once (docs/benchmarks.md, twenty-second part); real
    traffic keeps a queue instead. 0.0 when the run has no such window. (A prompt's first
    token, from its prefill, is not counted: the same count per request in every mode.)"""
    ordered = sorted(stats.steps, key=lambda s: s.step)
    first = next((i for i, s in enumerate(ordered) if s.batch_size), None)
    last = max((i for i, s in enumerate(ordered) if s.prefill_tokens), default=None)
    if first is None or last is None or last < first:
        return 0.0
    window = ordered[first:last + 1]
    seconds = sum(s.period_s for s in window)
    return sum(s.committed_tokens for s in window) / seconds if seconds else 0.0


def budget_shares(stats: RunStats) -> dict[str, float]:
    """Share of the steps with decoding sequences run at each tree budget ("0": plain), as
    the target reported it: which budgets the adaptive policy chose."""
    decode = [s for s in stats.steps if s.batch_size]
    counts = collections.Counter(s.tree_budget if s.speculated else 0 for s in decode)
    return {str(budget): count / len(decode) for budget, count in sorted(counts.items())}


def mixed_steps(stats: RunStats) -> tuple[float, float, float]:
    """(share of steps that prefill and decode in one forward, their mean ms, the mean ms of
    decode-only steps): a workload whose requests arrive one by one prefills in many of its
    steps, and each costs more than a plain one (an eager forward when its prompts exceed
    the target's prefill graphs)."""
    mixed = [s.total_s for s in stats.steps if s.prefill_tokens and s.batch_size]
    decode = [s.total_s for s in stats.steps if not s.prefill_tokens and s.batch_size]
    mean_ms = lambda xs: 1000 * statistics.fmean(xs) if xs else 0.0  # noqa: E731
    return (len(mixed) / len(stats.steps) if stats.steps else 0.0), mean_ms(mixed), mean_ms(decode)


def eager_share(stats: RunStats) -> float:
    """Share of the steps with decoding sequences that ran eagerly (no CUDA graph; every step
    on CPU)."""
    decode = [s for s in stats.steps if s.batch_size]
    return sum(not s.graphed for s in decode) / len(decode) if decode else 0.0


def request_latency_ms(stats: RunStats) -> tuple[float, float]:
    """Median milliseconds from a request's admit to its first token's arrival at the
    client, and to its last (the client's view: queueing, prefill and delivery included)."""
    return (1000 * statistics.median(stats.first_token_s),
            1000 * statistics.median(stats.request_s))


def graph_tree_sizes(shape_name: str) -> str:
    """The target's --graph-tree-sizes: ON's tree size and every adaptive budget's."""
    num, topk, steps = SHAPES[shape_name]
    shape = common_pb2.DraftShape(num_draft_tokens=num, topk=topk, num_steps=steps)
    sizes = {num, *(s.num_draft_tokens for s in adaptive_shapes("", shape))}
    return ",".join(map(str, sorted(sizes)))


def init_steps(pb: common_pb2.InitReport) -> dict[str, Any]:
    """A service's start-up as the sweep saw it: each step's state, seconds and detail (how
    many graphs were captured, and in how long), and the seconds of all steps."""
    steps = [{"name": s.name, "state": common_pb2.StepState.Name(s.state),
              "duration_s": round(s.duration_s, 3), "detail": s.detail} for s in pb.steps]
    return {"steps": steps, "total_s": round(sum(s.duration_s for s in pb.steps), 3)}


def mean_decode_batch(stats: RunStats) -> float:
    """The mean count of decoding sequences over the steps that decode, mixed ones included.
    (Until session 26 it left mixed steps out. Under speculation most steps are mixed, so that
    mean was mostly of the run's last steps, where the batch drains: 45.6 for ON at 64 streams
    on the H200 where the middle of the run decoded about 57, docs/benchmarks.md.)"""
    decode = [s.batch_size for s in stats.steps if s.batch_size]
    return statistics.fmean(decode) if decode else 0.0


def best_of(rates: dict[str, list[float]]) -> str:
    """The better of OFF and ON: the one of the higher median (ON on a tie)."""
    return "ON" if statistics.median(rates["ON"]) >= statistics.median(rates["OFF"]) else "OFF"


def per_round(rates: dict[str, list[float]], a: str, b: str) -> float:
    """The median of mode a's per-round rates over mode b's (rounds paired)."""
    return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))


def adaptive_over_best(rates: dict[str, list[float]]) -> tuple[float, str]:
    """Adaptive over the best of OFF and ON, per round (median), and which mode was best."""
    best = best_of(rates)
    return per_round(rates, "adaptive", best), best


def bootstrap_interval(rates: dict[str, list[float]], level: float = INTERVAL_LEVEL,
                       samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
                       ) -> tuple[float, float] | None:
    """A percentile bootstrap interval of :func:`adaptive_over_best` (None under 3 rounds).

    Whole rounds are resampled, so each keeps its modes' pairing (the drift they shared),
    and the best mode is chosen again in every resample: where OFF and ON are close,
    picking the higher of two noisy medians flatters the best, and the interval carries
    that. Seeded: the same runs give the same interval."""
    rounds = len(rates["adaptive"])
    if rounds < 3:
        return None
    rng = random.Random(seed)
    estimates = []
    for _ in range(samples):
        picks = [rng.randrange(rounds) for _ in range(rounds)]
        estimates.append(adaptive_over_best({mode: [rates[mode][i] for i in picks]
                                             for mode in ("OFF", "ON", "adaptive")})[0])
    estimates.sort()
    tail = (1 - level) / 2
    return (estimates[int(tail * (samples - 1))], estimates[math.ceil((1 - tail) * (samples - 1))])


def summarize(entry: dict[str, Any], modes: list[str] | tuple[str, ...] = DEFAULT_MODES
              ) -> dict[str, Any]:
    """Medians and ratios of one concurrency's raw runs (`entry` as stored in the JSON);
    the adaptive figures are None where adaptive did not run. ``adaptive_interval``: the
    bootstrap interval of ``adaptive_best`` (None under 3 rounds)."""
    rates = entry["tokens_per_s"]
    med = {mode: statistics.median(rates[mode]) for mode in modes}
    best, on_off = best_of(rates), per_round(rates, "ON", "OFF")
    adaptive_best = adaptive_off = aim_met = interval = variant_adaptive = never_off = None
    if "never" in modes:
        never_off = per_round(rates, "never", "OFF")
    if "variant" in modes and "adaptive" in modes:
        variant_adaptive = per_round(rates, "variant", "adaptive")
    if "adaptive" in modes:
        adaptive_best, adaptive_off = per_round(rates, "adaptive", best), per_round(
            rates, "adaptive", "OFF")
        aim_met = adaptive_best >= AIM and (on_off <= 1 or adaptive_off > 1)
        interval = bootstrap_interval(rates)
    return {"concurrency": entry["concurrency"], "median": med, "best": best, "on_off": on_off,
            "adaptive_best": adaptive_best, "adaptive_off": adaptive_off, "aim_met": aim_met,
            "adaptive_interval": interval, "variant_adaptive": variant_adaptive,
            "never_off": never_off}


def _mean_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (NaN for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1
                  else math.nan)


def pool(reports: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Adaptive against the better fixed mode, per concurrency, over several saved sweeps.

    In each sweep a round's ratio is adaptive's rate over the better of OFF and ON in that
    round's pairing, the better being the mode of the higher geometric mean over the sweep's
    rounds. Per concurrency: each sweep's geometric mean of those ratios with its standard
    error (``sweeps``: (rounds, ratio, standard error, the better mode)), and all the sweeps'
    rounds together: their geometric mean, its standard error over the rounds
    (``rounds_se``, relative) and over the sweeps' means (``sweeps_se``, relative; NaN for
    one sweep), which is the larger where the machine's speed drifts between sweeps. Sweeps
    without adaptive at a concurrency are left out there."""
    logs: dict[int, list[list[float]]] = collections.defaultdict(list)
    sweeps: dict[int, list[tuple[int, float, float, str]]] = collections.defaultdict(list)
    for report in reports:
        for entry in report["results"]:
            rates = entry["tokens_per_s"]
            if "adaptive" not in rates:
                continue
            on = [math.log(a / b) for a, b in zip(rates["ON"], rates["OFF"], strict=True)]
            best = "ON" if statistics.fmean(on) > 0 else "OFF"
            ratios = [math.log(a / b) - (o if best == "ON" else 0.0)
                      for a, b, o in zip(rates["adaptive"], rates["OFF"], on, strict=True)]
            mean, se = _mean_se(ratios)
            logs[entry["concurrency"]].append(ratios)
            sweeps[entry["concurrency"]].append((len(ratios), math.exp(mean), se, best))
    pooled = {}
    for concurrency in sorted(logs):
        mean, rounds_se = _mean_se([r for ratios in logs[concurrency] for r in ratios])
        sweeps_se = _mean_se([statistics.fmean(ratios) for ratios in logs[concurrency]])[1]
        pooled[concurrency] = {"ratio": math.exp(mean), "rounds_se": rounds_se,
                               "sweeps_se": sweeps_se, "sweeps": sweeps[concurrency]}
    return pooled


def pool_markdown(reports: list[dict[str, Any]], names: list[str]) -> str:
    """The table of :func:`pool`: a row per concurrency, each sweep's figure beside the
    pooled one, and whether the pooled ratio meets the aim."""
    pooled = pool(reports)
    if not pooled:
        raise SystemExit("none of the reports ran adaptive")
    lines = [f"adaptive / the better of OFF and ON, geometric means of per-round ratios over "
             f"{len(reports)} sweeps ({', '.join(names)}); standard errors in brackets "
             f"(pooled: over the rounds, then over the sweeps' means); aim: the pooled ratio "
             f">= {AIM:g}.", "",
             "| streams | sweeps | rounds | **pooled** | each sweep (standard error; rounds, "
             "better mode) | aim |",
             "|---:|---:|---:|---:|---|---|"]
    for concurrency, row in pooled.items():
        each = "; ".join(f"{ratio:.3f} ({se:.3f}; {rounds}, {best})"
                         for rounds, ratio, se, best in row["sweeps"])
        rounds = sum(s[0] for s in row["sweeps"])
        met = "met" if row["ratio"] >= AIM else "missed"
        lines.append(f"| {concurrency} | {len(row['sweeps'])} | {rounds} | **{row['ratio']:.3f}** "
                     f"({row['rounds_se']:.3f}, {row['sweeps_se']:.3f}) | {each} | {met} |")
    return "\n".join(lines) + "\n"


def policy_warmup_text(report: dict[str, Any]) -> str:
    """What the header says of the policies' untimed runs at the timed size."""
    most = report["settings"].get("policy_warmup")
    if most is True or most == 1:  # (a report from before session 50 says True)
        return "; one more untimed run of each policy at that size"
    if not most:
        return ""
    took = {mode: [str(e.get("policy_warmup_runs", {}).get(mode, "?")) for e in report["results"]]
            for mode in LEARNING_MODES if mode in report["settings"]["modes"]}
    runs = "; ".join(f"{mode} {', '.join(counts)}" for mode, counts in took.items())
    return (f"; then untimed runs of each policy at that size until one in which it settled "
            f"(at most {most}; runs taken at each concurrency: {runs})")


def acceptance_line(report: dict[str, Any]) -> str:
    """ON's accepted draft tokens per verify step over the concurrencies (and, for the replay
    draft, what its corrupt rate should give and how many trees missed); '' when unknown."""
    settings = report["settings"]
    on = [a for entry in report["results"]
          for a in entry.get("accepted_per_verify_step", {}).get("ON", [])]
    if not on:
        return ""
    line = (f" ON accepted {statistics.median(on):.2f} draft tokens per verify step "
            f"(median of all runs, {min(on):.2f}-{max(on):.2f})")
    if settings.get("replay_corrupt_rate") is not None:
        expected = expected_replay_acceptance(settings["replay_corrupt_rate"], settings["shape"])
        misses = sum(sum(entry.get("replay_misses", {}).get(mode, []))
                     for entry in report["results"] for mode in modes_of(report))
        trees = sum(sum(entry.get("draft_trees", {}).get(mode, []))
                    for entry in report["results"] for mode in modes_of(report))
        line += (f"; {expected:.2f} expected at corrupt {settings['replay_corrupt_rate']:.2f}; "
                 f"replay misses in timed runs: {misses} of {trees} trees")
    return line + "."


def markdown(report: dict[str, Any]) -> str:
    """The table of a run, with a line saying what ran and where the aim is met."""
    settings, machine = report["settings"], report["machine"]
    modes = modes_of(report)
    threshold = settings["static_threshold"]
    prompt_len = f" of {settings['prompt_len']} tokens" if settings["prompts"] == "heldout" else ""
    target = f"target model {settings['target_label']}, " if settings.get("target_label") else ""
    warm = [m for m in WARM_MODES if m in modes]
    flags = settings.get("target_flags")
    target += f"target flags {' '.join(flags)}, " if flags else ""
    lines = [
        f"{machine['label']}; torch {machine['torch']}, {machine['device']}; {report['date']}. "
        f"{target}{settings['draft']} draft"
        f"{' (KILLED once the target served: every mode ran with it away)' if settings.get('draft_down') else ''}"
        f", {settings['shape_name']} shape "
        f"{'/'.join(map(str, settings['shape']))} (nodes/topk/depth); {settings['prompts']} "
        f"prompts{prompt_len} x {new_tokens_text(settings)} new tokens, greedy; "
        f"{settings['repeats']} runs per mode, interleaved"
        f"{order_text(settings, len(modes))}, medians, after "
        f"{settings.get('warmup', 0)} untimed {', '.join(warm[:-1])} and {warm[-1]} run(s) at "
        f"each concurrency" + (f"; timed runs sized to last at least {settings['min_run_s']:g} s "
                               "at the fastest mode's warm-up rate" if settings.get("min_run_s")
                               else "")
        + policy_warmup_text(report) + "." + acceptance_line(report),
        "",
    ]
    header = ["concurrency", "prompts",
              *(f"{MODE_TABLE[m].column.format(threshold=threshold)} tok/s" for m in modes),
              "ON / OFF"]
    if "adaptive" in modes:
        header += ["adaptive / best(OFF, ON)", f"{INTERVAL_LEVEL:.0%} interval"]
    if "variant" in modes and "adaptive" in modes:
        header += ["variant / adaptive"]
    if "never" in modes:
        header += ["never / OFF"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    summaries = [summarize(entry, modes) for entry in report["results"]]
    for entry, s in zip(report["results"], summaries, strict=True):
        cells = [str(s["concurrency"]), str(entry["num_prompts"]),
                 *(f"{s['median'][m]:.1f}" for m in modes), f"{s['on_off']:.2f}x"]
        if "adaptive" in modes:
            interval = s["adaptive_interval"]
            cells += [f"{s['adaptive_best']:.2f} ({s['best']})",
                      f"{interval[0]:.2f}-{interval[1]:.2f}" if interval else "-"]
        if s["variant_adaptive"] is not None:
            cells += [f"{s['variant_adaptive']:.3f}"]
        if s["never_off"] is not None:
            cells += [f"{s['never_off']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if "adaptive" in modes:
        met = [str(s["concurrency"]) for s in summaries if s["aim_met"]]
        missed = [str(s["concurrency"]) for s in summaries if not s["aim_met"]]
        lines += ["", f"Aim (adaptive >= {AIM:.2f} x best, and above OFF where ON is): met at "
                  f"concurrency {', '.join(met) or 'none'}"
                  + (f"; missed at {', '.join(missed)}." if missed else ".")]
        unsure = [str(s["concurrency"]) for s in summaries
                  if s["adaptive_interval"] and s["adaptive_interval"][0] < AIM
                  <= s["adaptive_interval"][1]]
        if unsure:
            lines[-1] += (f" The {INTERVAL_LEVEL:.0%} interval (rounds resampled) spans {AIM:.2f} "
                          f"at concurrency {', '.join(unsure)}: there these rounds cannot "
                          "tell met from missed.")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s against concurrency (log2 axis), one line per mode; bars span the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    xs = [entry["concurrency"] for entry in results]
    threshold = report["settings"]["static_threshold"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes_of(report):
        how = MODE_TABLE[mode]
        runs = [entry["tokens_per_s"][mode] for entry in results]
        med = [statistics.median(r) for r in runs]
        err = [[m - min(r) for m, r in zip(med, runs, strict=True)],
               [max(r) - m for m, r in zip(med, runs, strict=True)]]
        ax.errorbar(xs, med, yerr=err, marker=how.marker, capsize=3,
                    label=how.label.format(threshold=threshold))
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens / s (median)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    settings = report["settings"]
    lines = [f"Speculation policy against concurrency: {report['machine']['label']}"]
    if settings.get("target_label"):
        lines.append(f"target model {settings['target_label']}")
    lines.append(f"{settings['draft']} draft, shape {'/'.join(map(str, settings['shape']))}, "
                 f"{new_tokens_text(settings)} new tokens, {report['date'][:10]}")
    # (wrapped: a replay draft's and a random target's labels ran past the figure's edge)
    ax.set_title("\n".join(textwrap.fill(line, 80) for line in lines), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_json(report: dict[str, Any], path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


# Settings that may differ between the calls of one sweep split by concurrency (the 10-minute
# limit of a GPU call): what each call ran, and where its target listened.
JOIN_FREE = ("concurrency", "target")


def join(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of a sweep run as several calls over disjoint concurrencies, with the same
    machine and settings otherwise: their results in order of concurrency, each call's date,
    concurrencies and command under ``calls``; the date, command and start-up report the first
    call's. Raises ValueError where the reports are not parts of one sweep."""
    first = reports[0]
    fixed = {k: v for k, v in first["settings"].items() if k not in JOIN_FREE}
    for report in reports[1:]:
        other = {k: v for k, v in report["settings"].items() if k not in JOIN_FREE}
        differ = sorted(k for k in fixed.keys() | other.keys() if fixed.get(k) != other.get(k))
        if differ or report["machine"]["label"] != first["machine"]["label"]:
            raise ValueError("the reports are not parts of one sweep: they differ in "
                             + ", ".join(differ or ["the machine"]))
    concurrencies = [e["concurrency"] for r in reports for e in r["results"]]
    if len(set(concurrencies)) != len(concurrencies):
        raise ValueError(f"the reports share a concurrency: {sorted(concurrencies)}")
    results = sorted((e for r in reports for e in r["results"]), key=lambda e: e["concurrency"])
    return {**first, "settings": {**first["settings"], "concurrency": sorted(concurrencies)},
            "results": results, "complete": all(r.get("complete") for r in reports),
            "calls": [{"date": r["date"], "concurrency": r["settings"]["concurrency"],
                       "command": r["command"]} for r in reports]}


def render(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table; write it and the plot where asked."""
    if not report["results"]:
        raise SystemExit("the report has no results to render")
    table = markdown(report)
    print(table, end="")
    if args.out_md:
        args.out_md.parent.mkdir(parents=True, exist_ok=True)
        args.out_md.write_text(table)
    if args.out_png:
        plot(report, args.out_png)
        print(f"plot: {args.out_png}", file=sys.stderr)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user and system, all threads) used so far by this process ("client": the
    benchmark plays the clients and the gateway, adaptive's policy included) and by each
    named process (the target and draft it started), from /proc; {} where there is none. On
    2 CPU cores every process's share comes out of the others': a run's figures tell which
    one's work grew (the clock ticks are 10 ms: enough over runs of seconds)."""
    if not Path("/proc/self/stat").exists():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    used = {"client": time.process_time()}
    for name, pid in pids.items():
        # the fields after the command name's closing parenthesis; utime and stime are the
        # stat file's 14th and 15th
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        used[name] = (int(fields[11]) + int(fields[12])) / tick
    return used


def draft_counts(draft: draft_pb2_grpc.DraftStub | None) -> tuple[int, int]:
    """The draft's (trees, replay misses) since it started; (0, 0) without a draft stub."""
    if draft is None:
        return 0, 0
    status = draft.GetStatus(draft_pb2.GetDraftStatusRequest(), timeout=10)
    return status.trees, status.replay_misses


# waiting: sequences in the target's queue at the step (no room among the running yet), so
# that a trace tells them from those on their way back from the client; catching_up: a step
# without speculation while the draft caught up (the target's --defer-catch-up);
# draft_unavailable: one without it for want of the draft (down or late)
TRACE_FIELDS = ("step", "batch_size", "prefill_tokens", "speculated", "tree_budget",
                "committed_tokens", "period_s", "total_s", "draft_s", "forward_s", "waiting",
                "draft_compute_s", "draft_input_tokens", "finished_prompt_tokens",
                "finished_generated_tokens", "finished_requests", "held_sequences",
                "catching_up", "draft_unavailable")


def write_trace(path: Path | None, concurrency: int, mode: str, run: int,
                stats: RunStats) -> None:
    """Append one run's steps to the --step-trace file: a JSON line with the TRACE_FIELDS of
    each step (and its first_child_accepted), and beside them each step's requests in flight
    as the policy was told them (``in_flight``); run -1 is a warm-up."""
    if path is None:
        return
    rows = [[round(v, 7) if isinstance(v, float) else v  # 0.1 us: the clock's, not float's
             for v in (getattr(s, name) for name in TRACE_FIELDS)]
            + [list(s.first_child_accepted)] for s in stats.steps]
    with path.open("a") as out:
        out.write(json.dumps({"concurrency": concurrency, "mode": mode, "run": run,
                              "fields": [*TRACE_FIELDS, "first_child_accepted"],
                              "steps": rows, "in_flight": stats.in_flight},
                             separators=(",", ":")) + "\n")


def untimed_run(stub: target_pb2_grpc.TargetStub, prompts: list[list[int]], lengths: list[int],
                policy: Any, concurrency: int, mode: str, trace: Path | None,
                start: float) -> float:
    """One run not counted (a warm-up, traced as run -1): its tokens per second."""
    stats = run_target(stub, prompts, lengths, policy, concurrency)
    write_trace(trace, concurrency, mode, -1, stats)
    print(f"warm-up: concurrency {concurrency}, {mode}: {stats.tokens_per_s:.1f} tok/s "
          f"({stats.wall_s:.1f} s, {len(prompts)} prompts, not counted); "
          f"{time.perf_counter() - start:.0f} s so far", file=sys.stderr, flush=True)
    return stats.tokens_per_s


def settled(policy: AdaptivePolicy, concurrency: int, modes_before: list[int]) -> bool:
    """Whether a policy's untimed run at ``concurrency`` left it settled: no bucket changed
    mode in it (``modes_before``: each bucket's mode when it began), and the bucket of that
    many sequences has judged a probe of every mode it does not run. A probe of its own: a
    mode the bucket left has ratios from the probes that made it switch, but what a probe of
    it costs (its catch-up) is known only once it was probed, and until then its first
    probe comes early (at 64 streams on an H100 with an EAGLE-3 head's cost, the tree left
    for off in the warm-up came back as a probe 1.5 s into the first timed run, which ran at
    0.85 of OFF; docs/benchmarks.md, fiftieth part)."""
    bucket = policy.buckets[bucket_of(concurrency)]
    return ([b.mode for b in policy.buckets.values()] == modes_before
            and all(bucket.probed(m) for m in range(len(policy.modes)) if m != bucket.mode))


def sweep(stub: target_pb2_grpc.TargetStub, all_prompts: list[list[int]],
          args: argparse.Namespace, report: dict[str, Any],
          draft: draft_pb2_grpc.DraftStub | None = None,
          pids: dict[str, int] | None = None) -> None:
    """Run every concurrency, appending to report["results"] (and saving it) as each ends;
    with `draft` (the replay draft's stub), each timed run's trees and replay misses too;
    each timed run's CPU seconds (:func:`cpu_seconds`: this process's and those of ``pids``,
    name -> process id)."""
    num, topk, steps = SHAPES[args.shape]
    shape = common_pb2.DraftShape(num_draft_tokens=num, topk=topk, num_steps=steps)
    static = static_policy(args.static_threshold, shape)
    modes = args.modes
    warm_modes = [mode for mode in WARM_MODES if mode in modes]
    total = len(args.concurrency) * args.repeats * len(modes)
    done, start = 0, time.perf_counter()
    for concurrency in args.concurrency:
        prompts = all_prompts[:prompts_for(concurrency, args.num_prompts)]
        # one per concurrency: it learns across the repeats
        adaptive = AdaptivePolicy(adaptive_shapes("", shape))
        variant = (AdaptivePolicy(adaptive_shapes("", shape), **args.variant)
                   if args.variant is not None else None)
        runs: dict[str, tuple[int, int, int] | target_pb2.SpecPolicy | AdaptivePolicy | None] = {
            "OFF": None, "ON": SHAPES[args.shape], "chain": SHAPES["chain3"],
            "never": target_pb2.SpecPolicy(), "static": static, "adaptive": adaptive,
            "variant": variant}
        keys = ["tokens_per_s", "steady_tokens_per_s", "wall_s", "accepted_per_verify_step",
                "speculated_step_share",
                "mean_decode_batch", "mixed_step_share", "mixed_step_ms", "decode_step_ms",
                "eager_step_share", "budget_step_shares", "first_token_ms", "request_ms",
                "cpu_s"] + (
                    ["draft_trees", "replay_misses"] if draft else [])
        entry: dict[str, Any] = {"concurrency": concurrency, "num_prompts": len(prompts),
                                 **{key: {mode: [] for mode in modes} for key in keys},
                                 "warmup_tokens_per_s": {mode: [] for mode in warm_modes}}
        # Untimed: the first runs at a new batch size are slow, and the adaptive policy learns
        # here what a long-running gateway has long known.
        lengths = request_lengths(len(prompts), args.max_new_tokens, args.new_tokens_spread)
        for _ in range(args.warmup):
            for mode in warm_modes:
                entry["warmup_tokens_per_s"][mode].append(untimed_run(
                    stub, prompts, lengths, runs[mode], concurrency, mode, args.step_trace, start))
        if args.min_run_s and entry["warmup_tokens_per_s"][warm_modes[0]]:
            # Sized by time, not by prompts: a run of a few seconds is at the noise of a shared
            # machine (runs of 3.5 s at 8 streams varied by 1.3x for one mode and policy). The
            # fastest mode's warm-up rate sets the size, so every mode runs at least that long.
            fastest = max(max(rates) for rates in entry["warmup_tokens_per_s"].values())
            count = prompts_for_time(len(prompts), concurrency, fastest, args.min_run_s,
                                     statistics.fmean(lengths))
            prompts = [all_prompts[i % len(all_prompts)] for i in range(count)]
            lengths = request_lengths(count, args.max_new_tokens, args.new_tokens_spread)
            entry["num_prompts"] = count
            print(f"concurrency {concurrency}: {count} prompts per timed run (at least "
                  f"{args.min_run_s:g} s at {fastest:.1f} tok/s)", file=sys.stderr, flush=True)
            # A policy's warm-up of one wave can end before it judged anything where the batch
            # is large (64 streams on an H200: 37 steps, no probe judged, and the first timed
            # run began with 7 steps of the tree, 0.7x plain decoding there), and one run as
            # long as a timed one was not enough at 2-8 streams on 2 CPU cores (the first
            # timed run of adaptive still speculated on 59-91 % of its steps, at 0.78-0.92 of
            # off): untimed runs of each policy, as long as a timed one, until it settled.
            entry["policy_warmup_runs"] = {}
            for mode in LEARNING_MODES:
                if mode not in modes:
                    continue
                policy, taken = runs[mode], 0
                while taken < args.policy_warmup:
                    before = [b.mode for b in policy.buckets.values()]
                    untimed_run(stub, prompts, lengths, policy, concurrency, mode,
                                args.step_trace, start)
                    taken += 1
                    if settled(policy, concurrency, before):
                        break
                entry["policy_warmup_runs"][mode] = taken
        for repeat in range(args.repeats):
            for mode in round_order(modes, repeat, args.order):  # interleaved: drift hits all
                trees, misses = draft_counts(draft)
                cpu_before = cpu_seconds(pids or {})
                stats = run_target(stub, prompts, lengths, runs[mode], concurrency)
                cpu = {name: round(used - cpu_before[name], 3)
                       for name, used in cpu_seconds(pids or {}).items()}
                entry["cpu_s"][mode].append(cpu)
                write_trace(args.step_trace, concurrency, mode, repeat, stats)
                entry["tokens_per_s"][mode].append(stats.tokens_per_s)
                entry["steady_tokens_per_s"][mode].append(steady_tokens_per_s(stats))
                entry["wall_s"][mode].append(stats.wall_s)
                entry["accepted_per_verify_step"][mode].append(stats.mean_accepted)
                entry["speculated_step_share"][mode].append(speculated_share(stats))
                entry["mean_decode_batch"][mode].append(mean_decode_batch(stats))
                mixed_share, mixed_ms, decode_ms = mixed_steps(stats)
                entry["mixed_step_share"][mode].append(mixed_share)
                entry["mixed_step_ms"][mode].append(mixed_ms)
                entry["decode_step_ms"][mode].append(decode_ms)
                entry["eager_step_share"][mode].append(eager_share(stats))
                first_ms, request_ms = request_latency_ms(stats)
                entry["first_token_ms"][mode].append(first_ms)
                entry["request_ms"][mode].append(request_ms)
                budgets = budget_shares(stats)
                entry["budget_step_shares"][mode].append(budgets)
                replay = ""
                if draft is not None:
                    trees_after, misses_after = draft_counts(draft)
                    entry["draft_trees"][mode].append(trees_after - trees)
                    entry["replay_misses"][mode].append(misses_after - misses)
                    replay = (f", {misses_after - misses} of {trees_after - trees} trees "
                              "missed their record")
                done += 1
                print(f"[{done}/{total}] concurrency {concurrency}, {mode}, run "
                      f"{repeat + 1}/{args.repeats}: {stats.tokens_per_s:.1f} tok/s "
                      f"(steady {steady_tokens_per_s(stats):.1f}; {stats.wall_s:.1f} s, "
                      f"{speculated_share(stats):.0%} of steps "
                      f"speculated, mean batch {mean_decode_batch(stats):.1f}, {mixed_share:.0%} "
                      f"of steps mixed at {mixed_ms:.1f} ms against {decode_ms:.1f} ms, "
                      f"{eager_share(stats):.0%} eager, budgets "
                      f"{', '.join(f'{b}: {v:.0%}' for b, v in budgets.items())}, "
                      f"{stats.mean_accepted:.2f} accepted per verify step{replay}; first "
                      f"token {first_ms:.1f} ms, request {request_ms:.0f} ms, medians; CPU "
                      f"{', '.join(f'{name} {used:.2f} s' for name, used in cpu.items())}); "
                      f"{time.perf_counter() - start:.0f} s so far", file=sys.stderr, flush=True)
        report["results"].append(entry)
        save_json(report, args.out_json)  # partial: a long sweep that dies keeps what it ran


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes and wait for each to exit."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait()


def build_random_8b(work: Path) -> Path:
    """The Llama-3.1-8B-shaped RANDOM bf16 checkpoint (with the built-in tokenizer), written
    under work on the GPU."""
    from bench_decode_floor import random_checkpoint

    folder = work / "llama-3.1-8b-shape-random"
    started = time.perf_counter()
    params = random_checkpoint(folder)
    print(f"{folder}: {params / 1e9:.2f} B parameters, RANDOM bf16 weights, written in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return folder


def random_head(target_model: Path, work: Path) -> Path:
    """An EAGLE-3 head of the target's shape with RANDOM bf16 weights and a draft vocabulary
    of HEAD_DRAFT_VOCAB (a Llama-3.1-8B head's), written under work without embed_tokens
    (the draft reads the target's): --replay-cost-head's model, timed, never trusted."""
    from splitspec.builtin import build

    target = json.loads((target_model / "config.json").read_text(encoding="utf-8"))
    vocab = min(HEAD_DRAFT_VOCAB, target["vocab_size"])
    folder = build.write_eagle3_head(work / "eagle3-random", target_model,
                                     draft_vocab_size=vocab, embedding=False)
    print(f"{folder}: an EAGLE-3 head of {target_model.name}'s shape, RANDOM bf16 weights, "
          f"draft vocabulary {vocab}", file=sys.stderr, flush=True)
    return folder


def record_replay(target_model: Path, prompts: list[list[int]], args: argparse.Namespace,
                  service_args: list[str], path: Path) -> None:
    """Start the target alone on target_model, record its greedy continuations of prompts
    (--max-new-tokens + REPLAY_SPARE tokens, speculation OFF) to path, stop it."""
    unique = list(dict.fromkeys(map(tuple, prompts)))  # --prompts fixed cycles 8 prompts
    proc, address = start_target(target_model, args.device, args.dtype, service_args)
    try:
        wait_for_serving(address, SERVING_TIMEOUT_S, "target (recording)",
                         alive=lambda: proc.poll() is None).close()
        started = time.perf_counter()
        records = record(address, [list(p) for p in unique], args.max_new_tokens + REPLAY_SPARE)
    finally:
        stop([proc])
    write_records(path, records)
    print(f"recorded {len(records)} continuations of {args.max_new_tokens + REPLAY_SPARE} "
          f"tokens in {time.perf_counter() - started:.1f} s to {path}", file=sys.stderr,
          flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line (every flag; :func:`main` checks their values)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stack_arguments(  # --device and --dtype are also recorded with the results
        parser, (REPLAY,), "; replay: the replay draft on the target's recorded continuations "
        "(see --replay-corrupt-rate)")
    parser.add_argument("--replay-corrupt-rate", type=float, default=DEFAULT_CORRUPT_RATE,
                        help="--draft-kind replay: chance R that a drafted token on the recorded "
                             "path is wrong; ON then accepts about sum_k (1 - R)^k draft tokens "
                             f"per verify step (default {DEFAULT_CORRUPT_RATE}: 2.50 for the "
                             "depth-4 tree, the trained built-in pair's measured acceptance)")
    parser.add_argument("--replay-features", action="store_true",
                        help="--draft-kind replay: the draft also takes an EAGLE-3 head's "
                             "features with every request (draft_service --replay-features), "
                             "so the exchange carries what a head of the target's shape gets")
    parser.add_argument("--replay-cost-head", action="store_true",
                        help="--draft-kind replay: the draft also runs an EAGLE-3 head of the "
                             "target's shape with RANDOM bf16 weights on every request "
                             "(draft_service --replay-cost-model; written to a temporary "
                             "folder), so the draft's time is in the figures, not only the "
                             "target's side; it asks for the head's features")
    parser.add_argument("--draft-flag", action="append", default=[],
                        help="with --start: one more flag for the draft (repeatable; e.g. "
                             "--draft-flag=--quantize --draft-flag=fp8); recorded")
    parser.add_argument("--feature-memory-mb", type=int,
                        help="with --start: the target's --feature-memory-mb (default: the "
                             "target's; 0 sends a head's features on the draft stream)")
    parser.add_argument("--target-flag", action="append", default=[],
                        help="with --start: one more flag for the target (repeatable; e.g. "
                             "--target-flag=--early-exchange); recorded with the results")
    parser.add_argument("--draft-down", action="store_true",
                        help="with --start: kill the draft (SIGKILL) once the target serves, so "
                             "that every mode runs with the draft away: what asking for "
                             "speculation costs while the target reconnects; recorded")
    parser.add_argument("--target-model", type=Path,
                        help="with --start: the target checkpoint folder (default: --models' "
                             "target/); its tokenizer encodes the prompts")
    parser.add_argument("--random-8b", action="store_true",
                        help="with --start and --device cuda: write a Llama-3.1-8B-shaped "
                             "checkpoint with RANDOM bf16 weights to a temporary folder and use "
                             "it as the target (labelled as such; removed at the end)")
    parser.add_argument("--max-context", type=int, default=0,
                        help="with --start: both services' --max-context (0: their default); "
                             "sizes the target's KV cache with --max-running")
    parser.add_argument("--modes", type=parse_modes, default=list(DEFAULT_MODES),
                        help=f"comma-separated modes to run: OFF and ON, and any of "
                             f"{', '.join(MODES[2:])} (default: {', '.join(DEFAULT_MODES)})")
    parser.add_argument("--variant", type=parse_variant, default=None,
                        help="with the mode variant in --modes: a JSON object of keyword "
                             "arguments for a second AdaptivePolicy, run interleaved with the "
                             "others (e.g. '{\"probe_share\": 0.01}'): a policy change A/B in "
                             "one run, its ratio to adaptive per round in the table")
    parser.add_argument("--machine", default="", help="names the machine in the plot and table "
                                                      "(default: described from this host)")
    parser.add_argument("--shape", default="tree", choices=list(SHAPES),
                        help="draft shape of ON, static and adaptive")
    parser.add_argument("--static-threshold", type=int, default=8,
                        help="static policy: speculate up to this batch size (0: at any)")
    parser.add_argument("--concurrency", type=parse_concurrency, default=[1, 2, 4, 8, 16, 32, 64],
                        help="comma-separated requests in flight, e.g. 1,2,4,8,16,32,64")
    parser.add_argument("--prompts", default="heldout", choices=["fixed", "heldout"],
                        help="snippets of held-out stdlib files, or the 8 fixed code prompts "
                             "(cycled)")
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="prompts per concurrency (0: max(16, 2 x concurrency))")
    parser.add_argument("--min-run-s", type=float, default=0.0,
                        help="size each timed run by time: enough prompts (cycled, whole waves "
                             "of the concurrency) that the fastest mode's warm-up rate would "
                             "take this long (0: --num-prompts decides; needs --warmup >= 1)")
    parser.add_argument("--prompt-len", type=int, default=64, help="with --prompts heldout")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--new-tokens-spread", type=float, default=0.0,
                        help="0 = every request generates --max-new-tokens (its waves stay in "
                        "step without speculation); F in (0, 1] = each request's length is drawn "
                        "from [(1 - F) x max, max], the same for every mode, so requests finish "
                        "and arrive one by one in every mode, as real traffic does")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    parser.add_argument("--order", choices=ORDERS, default="balanced",
                        help="each round's order of the modes: balanced (default: the rows of "
                             "a Williams design, so that each mode runs in each place and right "
                             "after each other mode equally often over a cycle of rows: 2 rounds "
                             "for 2 modes, 6 for 3, 4 for 4), rotate (shifted by one place each "
                             "round: each mode keeps the same predecessor, as sessions 45-54 "
                             "ran) or fixed (the same every round, as every sweep before "
                             "session 45 ran)")
    # the flags before --order, kept so that the commands docs/benchmarks.md records still run
    parser.add_argument("--rotate", dest="order", action="store_const", const="rotate",
                        help=argparse.SUPPRESS)
    parser.add_argument("--no-rotate", dest="order", action="store_const", const="fixed",
                        help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed OFF, ON and adaptive runs at each concurrency before the timed ones (adaptive learns in them)")
    parser.add_argument("--policy-warmup", type=int, default=3,
                        help="with --min-run-s: untimed runs of each policy at the timed runs' "
                             "size, until one in which it settled (no bucket switched, and the "
                             "concurrency's bucket had judged a probe of its own of each other "
                             "mode), at most this many (1: one run, as every sweep before "
                             "session 50 ran)")
    parser.add_argument("--out-md", type=Path, help="write the markdown table here")
    parser.add_argument("--out-json", type=Path, help="write the raw numbers here")
    parser.add_argument("--out-png", type=Path, help="write the plot here (needs matplotlib)")
    parser.add_argument("--step-trace", type=Path,
                        help="append every run's per-step statistics (period, batch, mode, "
                             "tokens committed) to this JSON-lines file, a line per run: what "
                             "bench/simulate_policy.py replays")
    parser.add_argument("--from-json", type=Path,
                        help="render the table and plot of this saved run; run nothing")
    parser.add_argument("--join", type=Path, nargs="+", metavar="JSON",
                        help="join saved runs of one sweep split over calls by concurrency "
                             "into one report (--out-json), and render it; run nothing")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                        help="print adaptive against the better fixed mode over these saved "
                             "runs (per sweep and all their rounds together); run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    log_policy_decisions()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out_png and importlib.util.find_spec("matplotlib") is None:
        # said now, not after the sweep (a 12-round CPU sweep wrote its table, then died
        # on the plot's import half an hour in)
        parser.error("--out-png needs matplotlib, which is not installed: "
                     "pip install -e '.[bench]' (or leave --out-png out)")
    if args.from_json:
        render(json.loads(args.from_json.read_text()), args)
        return 0
    if args.join:
        try:
            joined = join([json.loads(path.read_text()) for path in args.join])
        except ValueError as exc:  # a usage error: said as one, without a traceback
            parser.error(f"--join: {exc}")
        save_json(joined, args.out_json)
        render(joined, args)
        return 0
    if args.pool:
        print(pool_markdown([json.loads(path.read_text()) for path in args.pool],
                            [path.name for path in args.pool]), end="")
        return 0
    if args.num_prompts and args.num_prompts < max(args.concurrency):
        parser.error(f"--num-prompts {args.num_prompts} is below the concurrency "
                     f"{max(args.concurrency)}: the batch could never fill")
    if min(args.static_threshold, args.warmup) < 0 or min(
            args.repeats, args.max_new_tokens, args.policy_warmup) < 1:
        parser.error("--static-threshold and --warmup must be >= 0, --repeats, "
                     "--max-new-tokens and --policy-warmup >= 1")
    if not 0 <= args.new_tokens_spread <= 1:  # NaN fails too
        parser.error(f"--new-tokens-spread must be in [0, 1], got {args.new_tokens_spread}")
    if args.min_run_s < 0 or (args.min_run_s and not args.warmup):
        parser.error("--min-run-s must be >= 0, and sizes runs from the warm-up's rates: "
                     "it needs --warmup >= 1")
    replay = args.draft_kind == REPLAY
    if args.step_trace:  # a line per run of this sweep only
        args.step_trace.parent.mkdir(parents=True, exist_ok=True)
        args.step_trace.write_text("")
    if args.random_8b and not args.device.startswith("cuda"):
        parser.error(f"--random-8b builds a Llama-3.1-8B-shaped bf16 checkpoint (16 GB) on the "
                     f"GPU and serves it there: it needs --device cuda (got --device "
                     f"{args.device}); on CPU pass --target-model or use the built-in target")
    if args.random_8b and args.target_model:
        parser.error("--random-8b and --target-model both name the target: pass one")
    if not args.start and (replay or args.random_8b or args.target_model or args.max_context
                           or args.feature_memory_mb is not None or args.target_flag
                           or args.draft_flag or args.draft_down):
        parser.error("--draft-kind replay, --random-8b, --target-model, --max-context, "
                     "--feature-memory-mb, --target-flag, --draft-flag and --draft-down start "
                     "services: "
                     "they need --start "
                     "(against a running stack the report takes the draft's name from the "
                     "target)")
    if ("variant" in args.modes) != (args.variant is not None):
        parser.error("the mode variant and --variant go together: --variant gives its policy")
    if args.replay_features and args.replay_cost_head:
        parser.error("--replay-features and --replay-cost-head: the head asks for its features "
                     "itself (pass one)")
    if (args.replay_features or args.replay_cost_head) and not replay:
        flag = "--replay-features" if args.replay_features else "--replay-cost-head"
        parser.error(f"{flag} is for --draft-kind replay")
    if not 0 <= args.replay_corrupt_rate <= 1:  # NaN fails too
        parser.error(f"--replay-corrupt-rate must be in [0, 1], got {args.replay_corrupt_rate}")
    if args.max_context < 0:
        parser.error(f"--max-context must be >= 0, got {args.max_context}")
    machine = describe_machine(args.device, args.dtype, args.start)
    if args.machine:
        machine["label"] = args.machine
    report: dict[str, Any] = {
        "machine": machine, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "settings": {"target": args.target,
                     "shape_name": args.shape, "shape": list(SHAPES[args.shape]),
                     "static_threshold": args.static_threshold, "prompts": args.prompts,
                     "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                     "new_tokens_spread": args.new_tokens_spread,
                     "repeats": args.repeats, "warmup": args.warmup, "min_run_s": args.min_run_s,
                     "order": args.order,
                     "policy_warmup": args.policy_warmup if args.min_run_s and args.warmup else 0,
                     "concurrency": args.concurrency, "modes": args.modes,
                     "random_weights": args.random_8b, "max_context": args.max_context or None,
                     "replay_corrupt_rate": args.replay_corrupt_rate if replay else None,
                     "replay_features": args.replay_features and replay,
                     "replay_cost_head": args.replay_cost_head and replay,
                     "draft_flags": args.draft_flag,
                     "feature_memory_mb": args.feature_memory_mb,
                     "target_flags": args.target_flag, "variant": args.variant,
                     "draft_down": args.draft_down},
        "results": [], "complete": False}
    procs: list[subprocess.Popen] = []
    draft: draft_pb2_grpc.DraftStub | None = None
    draft_channel = None
    work = Path(tempfile.mkdtemp(prefix="bench_concurrency_"))
    try:
        target_model = args.target_model or args.models / "target"
        num = max(prompts_for(c, args.num_prompts) for c in args.concurrency)
        print(f"loading {num} {args.prompts} prompts", file=sys.stderr, flush=True)
        # The random checkpoint ships the built-in tokenizer: encode before building it.
        prompts = load_prompts(args.prompts, BUILTIN_TARGET if args.random_8b else target_model,
                               num, args.prompt_len)
        prompts = [prompts[i % len(prompts)] for i in range(num)]  # fixed: 8 prompts, cycled
        need = max(map(len, prompts)) + args.max_new_tokens + (REPLAY_SPARE if replay else 0)
        if args.max_context and need > args.max_context:
            raise SystemExit(f"--max-context {args.max_context} is below the longest prompt "
                             f"plus the tokens generated ({need}): raise it")
        if args.random_8b:
            target_model = build_random_8b(work)
        if args.start:
            max_running = max(32, *args.concurrency)
            context = ["--max-context", str(args.max_context)] if args.max_context else []
            draft_args, draft_port = None, None
            memory = ([] if args.feature_memory_mb is None
                      else ["--feature-memory-mb", str(args.feature_memory_mb)])
            if replay:
                records = work / "records.jsonl"
                record_replay(target_model, prompts, args,
                              ["--max-running", str(max_running), *context], records)
                draft_args = ["--kind", REPLAY, "--replay-file", str(records),
                              "--replay-corrupt-rate", str(args.replay_corrupt_rate),
                              *(["--replay-features"] if args.replay_features else []),
                              *(["--replay-cost-model", str(random_head(target_model, work))]
                                if args.replay_cost_head else [])]
                draft_port = free_port()
            procs, args.target = start_stack(args.draft_kind, args.models, args.device,
                                             args.dtype, max_running=max_running,
                                             target_model=target_model, draft_args=draft_args,
                                             draft_port=draft_port, extra_args=context,
                                             draft_extra=args.draft_flag,
                                             target_args=["--graph-tree-sizes",
                                                          graph_tree_sizes(args.shape),
                                                          *memory, *args.target_flag])
            report["settings"]["target"] = args.target
            if draft_port is not None:
                draft_channel = grpc.insecure_channel(f"127.0.0.1:{draft_port}",
                                                      options=CHANNEL_OPTIONS)
                draft = draft_pb2_grpc.DraftStub(draft_channel)
        channel = wait_for_serving(args.target, SERVING_TIMEOUT_S, "target",
                                   alive=lambda: all(p.poll() is None for p in procs))
        stub = target_pb2_grpc.TargetStub(channel)
        info = stub.GetInfo(target_pb2.GetTargetInfoRequest())
        if not info.has_draft:
            raise SystemExit(f"target {args.target} has no draft: ON would not speculate")
        if info.max_running < max(args.concurrency):
            raise SystemExit(f"target {args.target} runs at most {info.max_running} sequences at "
                             f"once, below concurrency {max(args.concurrency)}: start it with "
                             f"--max-running {max(args.concurrency)}")
        if info.max_context < need:
            raise SystemExit(f"target {args.target} holds {info.max_context} tokens per "
                             f"sequence, below the longest prompt plus the tokens generated "
                             f"({need}): start it with --max-context {need}")
        report["target_init"] = init_steps(stub.GetInitReport(common_pb2.GetInitReportRequest()))
        graphs = next(s for s in report["target_init"]["steps"] if s["name"] == "capture_cuda_graphs")
        print(f"target start-up: {report['target_init']['total_s']:.1f} s of steps; "
              f"capture_cuda_graphs {graphs['duration_s']:.1f} s: {graphs['detail']}",
              file=sys.stderr, flush=True)
        link = next(s for s in report["target_init"]["steps"] if s["name"] == "connect_draft")
        print(f"target connect_draft: {link['detail']}", file=sys.stderr, flush=True)
        if args.draft_down:
            procs[0].kill()  # start_stack's first process: the draft
            procs[0].wait()
            draft = None
            print("draft killed (--draft-down)", file=sys.stderr, flush=True)
        report["settings"]["target_model"] = info.model_name
        report["settings"]["target_label"] = (
            f"{info.model_name} (Llama-3.1-8B shape, RANDOM bf16 weights)" if args.random_8b
            else info.model_name)
        report["settings"]["draft_model"] = info.draft_model_name
        report["settings"]["draft"] = (info.draft_model_name if replay or not args.start
                                       else args.draft_kind)
        if replay and not info.draft_model_name.startswith(f"{REPLAY}("):
            raise SystemExit(f"target {args.target}'s draft is {info.draft_model_name!r}, not "
                             "the replay draft started here")
        # start_stack's processes: the draft (unless killed above), then the target
        pids = {"draft": procs[0].pid, "target": procs[1].pid} if procs else {}
        if args.draft_down:
            del pids["draft"]
        sweep(stub, prompts, args, report, draft, pids)
    finally:
        if draft_channel is not None:
            draft_channel.close()
        stop(procs)
        shutil.rmtree(work, ignore_errors=True)
    report["complete"] = True
    save_json(report, args.out_json)
    render(report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
