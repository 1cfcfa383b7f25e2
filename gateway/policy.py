"""The speculation policy the gateway sends to the target.

A policy is a table: for a decode batch of size b, the first entry with
max_batch_size >= b gives the draft shape; no such entry means no speculation.
Three modes build it:

* static: the seed's threshold (speculate up to ``--spec-disable-batch-threshold``);
* table: the user's table, ``--spec-policy-table "4:8/4/4,16:4/1/4,64:0"``
  (max batch size: num_draft_tokens/topk/num_steps, or 0 for off);
* adaptive: :class:`AdaptivePolicy` measures, per batch-size bucket, the
  target's step time with and without speculation and the tokens a
  speculative step yields, and speculates where that gives more tokens per
  second, judging short runs of the mode not in use against the steps just
  before them, with a margin against flapping.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from splitspec.v1 import common_pb2, target_pb2

log = logging.getLogger(__name__)

# The largest uint32: an entry that covers every batch size.
ANY_BATCH_SIZE = 2**32 - 1
OFF = common_pb2.DraftShape()


class ShapeOverride(NamedTuple):
    """Draft-shape fields from the command line; 0 keeps the target's default for that field."""

    num_draft_tokens: int = 0
    topk: int = 0
    num_steps: int = 0


def resolve_shape(override: ShapeOverride, default: common_pb2.DraftShape) -> common_pb2.DraftShape:
    """The target's default shape with each non-zero override field put in its place."""
    return common_pb2.DraftShape(
        num_draft_tokens=override.num_draft_tokens or default.num_draft_tokens,
        topk=override.topk or default.topk,
        num_steps=override.num_steps or default.num_steps,
    )


def static_policy(disable_batch_threshold: int, shape: common_pb2.DraftShape) -> target_pb2.SpecPolicy:
    """Speculate with ``shape`` up to ``disable_batch_threshold`` sequences; 0 = at any batch size."""
    if disable_batch_threshold < 0:
        raise ValueError(f"disable_batch_threshold must be >= 0 (got {disable_batch_threshold})")
    max_batch_size = disable_batch_threshold or ANY_BATCH_SIZE
    entry = target_pb2.SpecPolicy.Entry(max_batch_size=max_batch_size, shape=shape)
    return target_pb2.SpecPolicy(entries=[entry])


def describe_policy(policy: target_pb2.SpecPolicy) -> str:
    """One line for logs and the init report, e.g. 'batch<=8: 6 nodes, topk 1, depth 6'."""
    if not policy.entries:
        return "never speculate"
    parts = []
    for entry in policy.entries:
        limit = "any batch" if entry.max_batch_size == ANY_BATCH_SIZE else f"batch<={entry.max_batch_size}"
        shape = entry.shape
        what = ("off" if shape.num_draft_tokens == 0 else
                f"{shape.num_draft_tokens} nodes, topk {shape.topk}, depth {shape.num_steps}")
        parts.append(f"{limit}: {what}")
    return "; ".join(parts)


def parse_table(spec: str, default: common_pb2.DraftShape) -> target_pb2.SpecPolicy:
    """``"4:8/4/4,16:4,64:0"`` -> a policy; a shape may give only the node count (the rest
    from ``default``); ``*`` as the batch size means any. ValueError says what is wrong."""
    entries, last = [], 0
    for item in filter(None, (part.strip() for part in spec.split(","))):
        limit, sep, shape_text = item.partition(":")
        if not sep:
            raise ValueError(f"policy table entry {item!r} is not MAX_BATCH:NODES[/TOPK/STEPS]")
        max_batch = ANY_BATCH_SIZE if limit.strip() == "*" else int(limit)
        if max_batch <= last:
            raise ValueError(f"policy table batch sizes must increase: {max_batch} after {last}")
        fields = [int(x) for x in shape_text.split("/")]
        if len(fields) not in (1, 3) or min(fields) < 0:
            raise ValueError(f"policy table shape {shape_text!r} is not NODES or NODES/TOPK/STEPS")
        nodes, topk, steps = (*fields, default.topk, default.num_steps)[:3]
        shape = OFF if nodes == 0 else common_pb2.DraftShape(num_draft_tokens=nodes, topk=topk,
                                                              num_steps=steps)
        entries.append(target_pb2.SpecPolicy.Entry(max_batch_size=max_batch, shape=shape))
        last = max_batch
    if not entries:
        raise ValueError("the policy table is empty")
    return target_pb2.SpecPolicy(entries=entries)


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, ANY_BATCH_SIZE)
WINDOW = 64  # steps of the mode in use the sudden-drop check looks at
PAIRS = 4    # probes whose paired ratios the adaptive policy averages
GAINS = 128  # speculative steps whose committed tokens give speculation's tokens per step


def bucket_of(batch_size: int) -> int:
    return next(b for b in BUCKETS if batch_size <= b)


def rate(samples: list[tuple[float, float]]) -> float:
    """Tokens per second per sequence of (period_s, gain) samples: a step commits 1 + gain
    tokens per sequence (gain 0 without speculation)."""
    return sum(1 + gain for _, gain in samples) / sum(period for period, _ in samples)


def mean_period(samples: list[tuple[float, float]]) -> float:
    return sum(period for period, _ in samples) / len(samples)


@dataclass
class _Bucket:
    """What was measured at one batch-size bucket."""

    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (period_s, gain) of
    # the mode in use since the last probe was judged (the sudden-drop check)
    gains: deque = field(default_factory=lambda: deque(maxlen=GAINS))  # of speculative steps
    on_batch: deque = field(default_factory=lambda: deque(maxlen=WINDOW))   # batch sizes of on
    off_batch: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # ... and of off
    is_on: bool = True        # the decision (until decided: the nearest decided bucket's)
    decided: bool = False     # judged at least one probe of its own
    probe_left: int = 0       # steps left measuring the other mode
    after_left: int = 0       # steps of the mode in use left to measure after a probe
    since_probe: int = 0
    before: list = field(default_factory=list)  # the mode in use's steps just before the probe
    probe: list = field(default_factory=list)   # this probe's samples of the other mode
    after: list = field(default_factory=list)   # ... and the mode in use's just after it
    ratios: deque = field(default_factory=lambda: deque(maxlen=PAIRS))  # on / off, per probe
    clear_streak: int = 0     # probes in a row that found the mode in use far ahead
    reference: float = 0.0    # the mode in use's rate when the last probe was judged
    probe_cost: float = 1.0   # the other mode's step time over the mode in use's (last probe)
    fresh: bool = False       # the probe's next step is its first (left out)
    settling: bool = False    # the mode in use's next step is its first after a probe (left out)

    def describe(self, on: float, off: float) -> str:
        """The rates a decision was made on, and the batch sizes they were measured at."""
        return (f"{on:.1f} vs {off:.1f} tok/s per sequence in the last probe, mean on/off "
                f"{sum(self.ratios) / len(self.ratios):.2f} over {len(self.ratios)} probe(s), "
                f"measured at mean batch {sum(self.on_batch) / len(self.on_batch):.1f} on and "
                f"{sum(self.off_batch) / len(self.off_batch):.1f} off")


class AdaptivePolicy:
    """Chooses speculation on or off per batch-size bucket from measured step statistics.

    The mode in use is measured at every step; every ``probe_every`` steps the
    other mode runs for ``probe_steps`` steps (a probe). A probe is judged
    against the mode in use's ``probe_steps`` steps on either side of it: a
    paired on/off ratio of tokens per second per sequence, from steps close in
    time, so drift (a machine that slows down, a busy neighbour for a second,
    a workload that changes) hits both sides alike. A step's time is what
    drifts; speculation's tokens per step do not (they depend on the draft and
    the text), and a few steps of them are noisy (0 to depth+1 accepted), so a
    ratio takes the step times from the sandwich and the tokens per
    speculative step from the last GAINS of them. The first step of each mode
    after a change of mode is left out (turning speculation back on begins
    with the draft's catch-up). Invariant: a bucket switches only when a probe
    is judged and the mean of its last PAIRS ratios favours the other mode by
    more than ``margin`` (relative), so per-step noise does not make it flap.
    The margin is 2 %: a bucket can stay in a mode up to a margin behind the
    other, and the policy's aim is to stay within 3 % of the better mode (a
    margin of 5 % let a bucket sit for good in a mode 4 % behind).

    Probes are spaced by time, not by steps: when the other mode's steps take
    k times as long as the mode in use's (k > 1), the interval is k times
    ``probe_every`` steps, so a probe costs the same share of the time
    whichever mode is in use (on an H200 at 32 streams a verify step took 3.5
    plain ones, and probes spaced by steps took a fifth of the time there).
    Each probe in a row that finds the mode in use ahead by more than
    ``clear`` (relative, 20 %) doubles the interval to the next, up to
    ``2**max_doublings`` times (re-measuring a mode that is far behind costs
    tokens and says little); a closer call or a switch resets it. A change of
    workload that makes the mode in use much worse is seen within WINDOW steps:
    when its rate over a full window falls ``sudden`` (40 %) below its rate at
    the last probe, the next probe starts then (a shorter, gentler trigger
    fires on noise and probes every few dozen steps).

    A bucket that has not yet judged a probe of its own follows the nearest
    bucket that has (the best mode changes slowly with the batch size), and
    first probes after ``first_probe`` steps of its own: buckets a workload only
    passes through (the tail of a wave of requests) then cost nothing, where
    probing each on its first steps ran most of those steps without
    speculation.
    """

    def __init__(self, shape: common_pb2.DraftShape, margin: float = 0.02, min_samples: int = 8,
                 probe_every: int = 100, probe_steps: int = 8, clear: float = 0.2,
                 max_doublings: int = 4, first_probe: int = 16, sudden: float = 0.4) -> None:
        self.shape = shape
        self.first_probe = first_probe
        self.margin = margin
        self.clear, self.max_doublings, self.sudden = clear, max_doublings, sudden
        self.min_samples, self.probe_every, self.probe_steps = min_samples, probe_every, probe_steps
        self.buckets = {b: _Bucket() for b in BUCKETS}
        self._policy = self._build()

    @property
    def policy(self) -> target_pb2.SpecPolicy:
        return self._policy

    def observe(self, stats: target_pb2.StepStats) -> target_pb2.SpecPolicy | None:
        """Learn from one decode step; returns the new policy when it changed."""
        if stats.prefill_tokens or stats.batch_size == 0 or stats.period_s <= 0:
            return None  # prefill steps say nothing about decode speed
        size = bucket_of(stats.batch_size)
        bucket = self.buckets[size]
        # The step's period (not its own time): the loop's work between steps is paid once per
        # step, so it weighs more on plain decoding's many short steps. The gain counts the
        # tokens committed, not accepted ones that max_new_tokens then dropped.
        gain = max(stats.committed_tokens / stats.batch_size - 1, 0.0) if stats.speculated else 0.0
        sample = (stats.period_s, gain)
        counted = False
        if stats.speculated == bucket.is_on:
            if bucket.settling:  # the first step back after a probe
                bucket.settling = False
            elif not bucket.probe_left:  # (a probe's steps the target ran late are left out)
                # the steps after a probe are judged with it (the window starts over then)
                (bucket.after if bucket.after_left else bucket.window).append(sample)
                counted = True
        elif bucket.probe_left:
            if bucket.fresh:  # a probe's first step: the change of mode
                bucket.fresh = False
            else:
                bucket.probe.append(sample)
                counted = True
        if counted and stats.speculated:
            bucket.gains.append(gain)
        (bucket.on_batch if stats.speculated else bucket.off_batch).append(stats.batch_size)
        self._decide(bucket, size)
        policy = self._build()
        if policy == self._policy:
            return None
        self._policy = policy
        return policy

    def _decide(self, bucket: _Bucket, size: int) -> None:
        if bucket.probe_left:
            bucket.probe_left -= 1
            if bucket.probe_left == 0:
                bucket.after_left, bucket.after = self.probe_steps, []
                bucket.settling = True  # the first step back in the mode in use
            return
        if bucket.after_left:
            bucket.after_left -= 1
            if bucket.after_left == 0:
                self._judge(bucket, size)
            return
        bucket.since_probe += 1
        if len(bucket.window) < self.min_samples:
            return
        interval = (round(self.probe_every * max(bucket.probe_cost, 1.0))
                    << min(bucket.clear_streak, self.max_doublings)
                    if bucket.ratios else self.first_probe)
        sudden = (bool(bucket.reference) and len(bucket.window) == WINDOW
                  and rate(list(bucket.window)) < bucket.reference * (1 - self.sudden))
        if sudden or bucket.since_probe >= interval:
            bucket.probe_left, bucket.since_probe, bucket.probe = self.probe_steps, 0, []
            bucket.before = list(bucket.window)[-self.probe_steps:]
            bucket.fresh = True

    def _rates(self, bucket: _Bucket, current: list, other: list) -> tuple[float, float]:
        """(on, off) tokens per second per sequence: step times from the samples, tokens per
        speculative step from the last GAINS speculative steps."""
        gain = sum(bucket.gains) / len(bucket.gains) if bucket.gains else 0.0
        on, off = (current, other) if bucket.is_on else (other, current)
        return (1 + gain) / mean_period(on), 1 / mean_period(off)

    def _judge(self, bucket: _Bucket, size: int) -> None:
        """A probe and the steps after it ended: its paired ratio, and the decision on the
        last PAIRS of them."""
        current = bucket.before + bucket.after
        bucket.window.clear()
        if len(bucket.probe) < 2 or not current:
            return  # the target applied the probe too late to measure it: no judgement
        on, off = self._rates(bucket, current, bucket.probe)
        bucket.probe_cost = mean_period(bucket.probe) / mean_period(current)
        bucket.ratios.append(on / off)
        bucket.decided = True
        ahead = 1 + self.clear
        clear = on / off > ahead if bucket.is_on else off / on > ahead
        bucket.clear_streak = bucket.clear_streak + 1 if clear else 0
        mean = sum(bucket.ratios) / len(bucket.ratios)
        bucket.reference = on if bucket.is_on else off
        if (mean < 1 - self.margin) if bucket.is_on else (mean > 1 + self.margin):
            # the next step changes mode (after the steps that followed the probe)
            bucket.is_on, bucket.clear_streak, bucket.settling = not bucket.is_on, 0, True
            bucket.reference = on if bucket.is_on else off
            bucket.probe_cost = 1 / bucket.probe_cost  # the old mode is now the other one
            log.info("batch <= %d: speculation %s (%s)", size, "on" if bucket.is_on else "off",
                     bucket.describe(on, off))

    def _follow_neighbours(self) -> None:
        """Undecided buckets take the decision of the nearest decided one (the smaller on a
        tie); with none decided, they stay on. A bucket in a probe or in the steps after it
        keeps its mode until that probe is judged (its samples are sorted by that mode)."""
        decided = [i for i, b in enumerate(self.buckets.values()) if b.decided]
        if not decided:
            return
        buckets = list(self.buckets.values())
        for i, bucket in enumerate(buckets):
            if not bucket.decided and not (bucket.probe_left or bucket.after_left):
                bucket.is_on = buckets[min(decided, key=lambda j: (abs(j - i), j))].is_on

    def _build(self) -> target_pb2.SpecPolicy:
        self._follow_neighbours()
        entries: list[target_pb2.SpecPolicy.Entry] = []
        for size, bucket in self.buckets.items():
            speculate = bucket.is_on != (bucket.probe_left > 0)
            shape = self.shape if speculate else OFF
            if entries and entries[-1].shape == shape:
                entries[-1].max_batch_size = size
            else:
                entries.append(target_pb2.SpecPolicy.Entry(max_batch_size=size, shape=shape))
        return target_pb2.SpecPolicy(entries=entries)
