"""The speculation policy the gateway sends to the target.

A policy is a table: for a decode batch of size b, the first entry with
max_batch_size >= b gives the draft shape; no such entry means no speculation.
Three modes build it:

* static: the seed's threshold (speculate up to ``--spec-disable-batch-threshold``);
* table: the user's table, ``--spec-policy-table "4:8/4/4,16:4/1/4,64:0"``
  (max batch size: num_draft_tokens/topk/num_steps, or 0 for off);
* adaptive: :class:`AdaptivePolicy` measures, per batch-size bucket, the
  target's step time without speculation and with each of a few draft
  budgets (by default the draft's shape and a chain of 3 nodes), the
  tokens a speculative step of each yields and what the tokens sent to the
  draft cost, and uses the budget (or none)
  that gives the most tokens per second, judging short runs of another
  budget against the steps on both sides of them, with a margin against
  flapping.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from splitspec.tree import SMALL_CHAIN
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


def parse_shape(text: str, default: common_pb2.DraftShape) -> common_pb2.DraftShape:
    """``"8/4/4"`` (nodes/topk/depth) or ``"8"`` (topk and depth from ``default``); ``"0"``
    is off. ValueError says what is wrong."""
    parts = [part.strip() for part in text.split("/")]
    if len(parts) not in (1, 3) or not all(part.isdigit() for part in parts):
        raise ValueError(f"draft shape {text.strip()!r} is not NODES or NODES/TOPK/STEPS")
    nodes, topk, steps = (*map(int, parts), default.topk, default.num_steps)[:3]
    return OFF if nodes == 0 else common_pb2.DraftShape(num_draft_tokens=nodes, topk=topk,
                                                         num_steps=steps)


# The small budget the adaptive policy tries besides the draft's own shape: a chain of 3 nodes.
# Under load a verify step is bound by its GEMMs' rows (batch x (nodes + 1)), and on an H200 at
# 16-64 streams a chain of 3 beat both plain decoding and the 8-node tree (docs/benchmarks.md).
SMALL_BUDGET = common_pb2.DraftShape(num_draft_tokens=SMALL_CHAIN, topk=1, num_steps=SMALL_CHAIN)


def adaptive_shapes(spec: str, default: common_pb2.DraftShape) -> list[common_pb2.DraftShape]:
    """The budgets the adaptive policy chooses among besides off: ``spec`` as
    ``"8/4/4,3/1/3"`` (each NODES[/TOPK/STEPS]), or when empty ``default`` and SMALL_BUDGET
    (``default`` alone when it is no larger). ValueError says what is wrong."""
    if not spec.strip():
        small = default.num_draft_tokens > SMALL_BUDGET.num_draft_tokens
        return [default, SMALL_BUDGET] if small else [default]
    shapes = [parse_shape(part, default) for part in spec.split(",") if part.strip()]
    nodes = [shape.num_draft_tokens for shape in shapes]
    if not shapes or 0 in nodes or len(set(nodes)) != len(nodes):
        raise ValueError(f"adaptive shapes {spec!r}: give one or more budgets of different "
                         "node counts, none 0 (off is always a choice)")
    return shapes


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
        shape = parse_shape(shape_text, default)
        entries.append(target_pb2.SpecPolicy.Entry(max_batch_size=max_batch, shape=shape))
        last = max_batch
    if not entries:
        raise ValueError("the policy table is empty")
    return target_pb2.SpecPolicy(entries=entries)


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, ANY_BATCH_SIZE)
WINDOW = 64  # steps of the mode in use the sudden-drop check looks at
PAIRS = 4    # probes whose paired ratios the adaptive policy averages
GAINS = 128  # speculative steps whose committed tokens give speculation's tokens per step
INPUTS = 64  # speculative steps per bucket and budget whose draft inputs give their cost
MIN_SLOPES = 20  # pairs of them below which a budget's cost a token is every budget's
MIN_APART = 8  # tokens: the least difference of inputs between two steps whose slope counts
PROMPTS = 1024  # steps whose prompts and commits give the prompt tokens per committed token
PREFILLS = 128  # steps per bucket and mode whose prompt tokens give what a prompt token costs
VISITS = 1024  # decode steps whose buckets say which buckets the batch only passes through
OUTS = 256  # decode steps per bucket and mode whose requests out of the batch give its steps out
MIN_ENDED = 16  # requests ended in them below which a mode's steps out are its bucket's
SETTLED = 3  # decode steps of a mode in a row before its requests out of the batch are its own
CONFIRM = 2  # probes of a mode whose mean ratio a switch to it needs, unless one is clear
CATCHING_UP = 64  # steps a probe waits for the draft's deferred catch-up before it counts them


def requests_out(in_flight: int, ended: int, batch_size: int) -> int:
    """A step's requests out of the decode batch: those in flight once its final deltas are
    handed out, with those that ended in it (decoded there), less those it decoded."""
    return max(in_flight + ended - batch_size, 0)


def bucket_of(batch_size: int) -> int:
    return next(b for b in BUCKETS if batch_size <= b)


class Sample(NamedTuple):
    """One step as the policy keeps it."""

    period: float     # period_s
    gain: float       # tokens committed per sequence beyond 1 (0 without speculation)
    inputs: int = 0   # draft_input_tokens
    committed: int = 0  # committed_tokens
    draft: float = 0.0  # draft_s
    prefill: int = 0  # prefill_tokens
    follows: bool = True  # the decode step before it ran the same mode


class RateParts(NamedTuple):
    """What :meth:`AdaptivePolicy._rate` makes a mode's rate of: its tokens a step per
    sequence, its samples' mean step time as they ran and as restated for a steady run,
    and the share of a request's steps that decode it."""

    tokens: float
    as_run: float
    steady: float
    share: float

    @property
    def rate(self) -> float:
        return self.tokens / self.steady * self.share


def mean_period(samples: Collection[Sample]) -> float:
    return sum(s.period for s in samples) / len(samples)


_POINT = 1100  # binary places of _Window's fixed point: every finite double is a whole
# number of 2**-1074


def _fixed(x: float) -> int:
    """``x`` exactly, as a whole number of 2**-_POINT."""
    numerator, denominator = x.as_integer_ratio()  # (the denominator a power of two)
    return numerator << (_POINT + 1 - denominator.bit_length())


class _Window:
    """The mode in use's last WINDOW samples, with the exact sums of their periods and of
    their tokens a sequence (1 + gain), kept as samples come and go: each step reads
    their mean period and rate, and summing the 64 samples anew took a third of
    :meth:`AdaptivePolicy.observe`'s time. Both are exact sums, rounded once."""

    __slots__ = ("samples", "_periods", "_tokens")

    def __init__(self) -> None:
        self.samples: deque[tuple[Sample, int, int]] = deque()
        self._periods = self._tokens = 0

    def append(self, sample: Sample) -> None:
        if len(self.samples) == WINDOW:
            _, period, tokens = self.samples.popleft()
            self._periods -= period
            self._tokens -= tokens
        period, tokens = _fixed(sample.period), _fixed(1 + sample.gain)
        self.samples.append((sample, period, tokens))
        self._periods += period
        self._tokens += tokens

    def clear(self) -> None:
        self.samples.clear()
        self._periods = self._tokens = 0

    def __len__(self) -> int:
        return len(self.samples)

    def last(self, count: int) -> list[Sample]:
        return [sample for sample, _, _ in list(self.samples)[-count:]]

    def mean_period(self) -> float:
        return self._periods / (len(self.samples) << _POINT)

    def rate(self) -> float:
        """Tokens per second per sequence: a step commits 1 + gain tokens per sequence."""
        return self._tokens / self._periods


def _deques(maxlen: int) -> defaultdict:
    return defaultdict(lambda: deque(maxlen=maxlen))


@dataclass
class _Bucket:
    """What was measured at one batch-size bucket. Modes are indices into
    :attr:`AdaptivePolicy.modes` (0: off); "the other modes" are those not in use."""

    window: _Window = field(default_factory=_Window)  # the last Samples of the mode
    # in use since the last probe was judged (the sudden-drop check)
    gains: defaultdict = field(default_factory=lambda: _deques(GAINS))  # per speculative mode
    batches: defaultdict = field(default_factory=lambda: _deques(WINDOW))  # batch sizes per mode
    inputs: defaultdict = field(default_factory=lambda: _deques(INPUTS))  # per speculative
    # mode: (draft_input_tokens, draft_s) of its steps after one of the same mode
    prefills: defaultdict = field(default_factory=lambda: _deques(PREFILLS))  # per mode, off
    # too: (prefill_tokens, period_s - draft_s) of its steps after one of the same mode
    outs: defaultdict = field(default_factory=lambda: _deques(OUTS))  # per mode, off too:
    # (requests in flight out of the batch, requests ended) of its steps SETTLED into a run
    mode: int = 1             # the mode in use (until decided: the nearest decided bucket's)
    decided: bool = False     # judged at least one probe of its own
    probing: int = 0          # the mode of the current or last probe
    probe_left: int = 0       # steps left measuring it
    after_left: int = 0       # steps of the mode in use left to measure after a probe
    since: defaultdict = field(default_factory=lambda: defaultdict(int))  # steps since each
    # other mode's last probe
    before: list = field(default_factory=list)  # the mode in use's steps just before the probe
    probe: list = field(default_factory=list)   # this probe's samples
    first: Sample | None = None  # this probe's first step (the change of mode: a catch-up)
    late: float = 0.0  # seconds the steps before it that decoded without speculation while
    # the draft caught up (StepStats.catching_up) took beyond off's steps before the probe
    late_steps: int = 0  # how many there were
    back: Sample | None = None   # ... and the mode in use's first step after it (another)
    after: list = field(default_factory=list)   # ... and the mode in use's just after it
    ratios: defaultdict = field(default_factory=lambda: _deques(PAIRS))  # per other mode: its
    # rate over the mode in use's, per probe
    streaks: defaultdict = field(default_factory=lambda: defaultdict(int))  # per other mode:
    # probes in a row that found it far behind
    costs: defaultdict = field(default_factory=lambda: defaultdict(lambda: 1.0))  # per other
    # mode: its step time over the mode in use's (last probe)
    lost: dict = field(default_factory=dict)  # per other mode: the seconds its last probe
    # lost against the mode in use (its catch-ups included)
    entry: dict = field(default_factory=dict)  # per mode: the catch-up that began its last
    # probe (seconds)
    reference: float = 0.0    # the mode in use's rate when the last probe was judged
    held: int | None = None   # a mode the last judgement of it favoured, not switched to only
    # because the mode in use's tokens per step were not yet known, or one probe said so
    recheck: int | None = None  # the mode left for one whose cost a draft token was not yet
    # known: probed again as soon as it is
    fresh: bool = False       # the probe's next step is its first (left out)
    settling: bool = False    # the mode in use's next step is its first after a probe (left out)

    @property
    def is_on(self) -> bool:
        """Speculating (with whichever budget)."""
        return self.mode != 0

    @property
    def clear_streak(self) -> int:
        return max(self.streaks.values(), default=0)

    def probed(self, mode: int) -> bool:
        """Whether this bucket judged a probe of ``mode`` of its own. The ratios a switch
        restates for the mode it left do not count: what a probe of that mode costs (the
        catch-up that begins it, :attr:`entry`) is known only from one."""
        return bool(self.ratios.get(mode)) and mode in self.entry


def describe_mode(shape: common_pb2.DraftShape) -> str:
    return (f"{shape.num_draft_tokens}/{shape.topk}/{shape.num_steps}"
            if shape.num_draft_tokens else "off")


class AdaptivePolicy:
    """Chooses, per batch-size bucket, speculation off or one of a few draft budgets from
    measured step statistics.

    The mode in use is measured at every step; every ``probe_every`` steps
    another mode runs for ``probe_steps`` steps (a probe). A probe is judged
    against the mode in use's ``probe_steps`` steps on either side of it: a
    paired ratio of tokens per second per sequence, from steps close in
    time, so drift (a machine that slows down, a busy neighbour for a second,
    a workload that changes) hits both sides alike. A step's time is what
    drifts; speculation's tokens per step do not (they depend on the draft,
    the budget and the text), and a few steps of them are noisy (0 to
    depth+1 accepted), so a ratio takes the step times from the sandwich and
    the tokens per speculative step of each budget from its last GAINS steps.
    A chain's (topk 1) come also from every step of a tree at least as deep
    (:meth:`_chain_gains`): what its first-child path accepted is what the
    chain would have.
    The first step of each mode after a change of mode is left out (turning
    speculation back on begins with the draft's catch-up). Steps that also
    prefill prompts count: a prompt's cost depends on the mode (added to a
    decode step that reading the weights bounds it is nearly free; added to a
    verify step bound by its GEMMs it costs its full compute; on an H200 at 32
    streams 1.4 ms against 8 ms), so each mode's cost a prompt token is learnt
    from its own steps, and every step is restated for the prompts a steady run
    prefills (:meth:`_rate`). Invariant: a bucket switches only when a
    probe is judged and the (geometric) mean of that mode's last PAIRS ratios
    favours it by more than ``margin`` (relative), so per-step noise does not
    make it flap, and those are at least ``confirm`` (2) ratios or they favour it
    by more than ``clear`` (:meth:`_confirmed`): a mode one probe favoured less
    clearly is probed again at once (a first probe can be lucky). The margin is
    2 %: a bucket can stay in a mode up to a margin behind another, and the
    policy's aim is to stay within 3 % of the best (a margin of 5 % let a
    bucket sit for good in a mode 4 % behind).
    A speculative mode in use is not left until its tokens per step come
    from ``min_gains`` sequence-steps (steps times their batch size): once
    it is left, only its probes' few steps add to them, so a switch made on
    the first dozen steps (one prompt that drafts badly) could stand for
    thousands of steps (``bench/simulate_policy.py`` on 1-stream CPU traces:
    one run in ten at 0.945 of the best or less; with the guard, 0.984). A switch a
    judgement favoured but held back for that reason is judged again as soon as the guard
    allows it: the next probe of that mode is due once its judgement will find them known
    (simulated with the trained bench pair's step costs at batch 1 on an H200, the tree then
    runs 81 steps, not 132, before plain decoding takes over).

    Each other mode has its own probe schedule, spaced by time, not by
    steps: when its steps take k times as long as the mode in use's (k > 1),
    its interval is k times ``probe_every`` steps, so a probe costs the same
    share of the time whichever mode is in use (on an H200 at 32 streams a
    verify step took 3.5 plain ones), and at least so far apart that what its
    probes lose (their catch-ups, and their steps' shortfall) is its part of
    ``probe_share`` (2 %) of the time: one budget, split evenly between the
    other modes, so that the probes of all of them lose at most 2 % together
    (the aim is 3 % of the best; at 2 % a mode, two modes' probes lost 4-5 %
    at 64 streams on a 2-core CPU, where the tree's step took 7 plain ones
    and a probe of it 1.3 s of a 6-s run). Each probe in a row that finds the mode
    in use ahead by more than ``clear`` (relative, 20 %) doubles that mode's
    interval, up to ``2**max_doublings`` times (re-measuring a mode that is
    far behind costs tokens and says little); a closer call resets it, and so
    does a switch, but for modes still that far behind the new mode in use.
    When several modes are due, the most overdue is probed. A
    change of workload that makes the mode in use much worse is seen within
    WINDOW steps: when its rate over a full window falls ``sudden`` (40 %)
    below its rate at the last probe, the next probe starts then (a shorter,
    gentler trigger fires on noise and probes every few dozen steps).

    What the draft is sent costs too. A speculative step's sequences each send the draft
    the tokens committed since their last request (an EAGLE-3 head a feature row with
    each, 24 KiB at the 8B shape), a new sequence its whole prompt, and a return to
    speculation everything committed while it was off. So a probe that follows a catch-up
    of every sequence (left out as its first step) sends less than a steady run of that
    budget, which pays for each new sequence's prompt: with a head's features at 32 streams
    on an H200, a 3-token chain's probes beat plain decoding while a steady chain ran at
    0.81 of it, and the policy kept returning to it (adaptive 0.87 of off). Each
    speculative step's time is therefore restated for the input a steady run sends
    (:meth:`_rate`): the committed tokens and ``prompt_ratio`` prompt tokens per committed
    token, at the budget's :meth:`input_cost` per token, a median slope of the target's
    draft wait over the tokens it sent (``draft_input_tokens``); and a probe's cost, which
    spaces its probes and says whether it is far behind, includes the catch-ups at its
    first step and at the first step back. A target that does not report
    draft_input_tokens leaves both as they were.

    A target with ``--defer-catch-up`` does not wait for a return's catch-up: it decodes
    without speculation until the draft has caught up, and says so (``catching_up``). Those
    steps are not a probe's (it measures its ``probe_steps`` once they are over, waiting at
    most CATCHING_UP steps), and their time beyond off's steps before the probe counts in
    what it cost, as a catch-up the step waited for does.

    Rates are per request in flight, not per decoding sequence (:meth:`out_steps`): a
    request that ends leaves its stream out of the batch for a few steps, so at a fixed
    number of streams a mode that ends requests sooner decodes fewer sequences a step (the
    gateway tells :meth:`observe` its requests in flight; without them, as from a replayed
    trace, every rate is per decoding sequence as before).

    A bucket that has not yet judged a probe of its own follows the nearest
    bucket that has (the best mode changes slowly with the batch size), and
    first probes each other mode after ``first_probe`` steps of its own:
    buckets a workload only passes through (the tail of a wave of requests)
    then cost nothing, where probing each on its first steps ran most of those
    steps without speculation. Every bucket starts with the first budget. A
    bucket the batch only passes through, a step or two at a time
    (:meth:`passed_through`), does not probe at all, and follows the others as
    if it had not decided; in the others a probe starts only where what is left of the
    bucket's visit can hold it (:meth:`_fits`).
    """

    def __init__(self, shapes: Sequence[common_pb2.DraftShape], margin: float = 0.02,
                 min_samples: int = 8, probe_every: int = 100, probe_steps: int = 8,
                 clear: float = 0.2, max_doublings: int = 4, first_probe: int = 16,
                 sudden: float = 0.4, min_gains: int = 64, unknown_cost: float = 0.0,
                 probe_share: float = 0.02, passing: bool = True,
                 confirm: int = CONFIRM, borrow_cost: bool = False) -> None:
        nodes = [shape.num_draft_tokens for shape in shapes]
        if not shapes or 0 in nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"AdaptivePolicy needs budgets of different, non-zero node "
                             f"counts (got {nodes})")
        self.modes = [OFF, *shapes]  # mode 0: off
        self._by_budget = {n: i for i, n in enumerate(nodes, start=1)}
        self.first_probe = first_probe
        self.margin = margin
        self.clear, self.max_doublings, self.sudden = clear, max_doublings, sudden
        self.min_samples, self.probe_every, self.probe_steps = min_samples, probe_every, probe_steps
        self.min_gains = min_gains
        self.unknown_cost = unknown_cost  # a budget's input_cost before its own is known
        self.borrow_cost = borrow_cost  # or every budget's, once that is known (input_cost)
        self.probe_share = probe_share  # of the time, at most, that all probes lose (_interval)
        self.passing = passing  # whether buckets the batch passes through follow others
        self.confirm = confirm  # probes a switch needs, unless one found the mode clearly ahead
        self._visits: deque[tuple[int, bool]] = deque(maxlen=VISITS)  # the last decode
        # steps' buckets, and whether each entered its bucket (the step before was another's)
        self._visit_counts: Counter[int] = Counter()
        self._entry_counts: Counter[int] = Counter()
        self._last_size = 0
        self._in_visit = 0  # decode steps since the batch entered its bucket
        self.buckets = {b: _Bucket() for b in BUCKETS}
        # per step: (prompt tokens prefilled, committed, finished requests' prompt tokens,
        # their generated tokens, and their number)
        self._prompts: deque[tuple[int, int, int, int, int]] = deque(maxlen=PROMPTS)
        self._prompt_sums = [0, 0, 0, 0, 0]
        self._last_mode: int | None = None  # the last decode step's
        self._run = 0  # decode steps in a row of the last decode step's mode
        self._slope_memo: dict[str, dict[int | None, np.ndarray]] = {}  # _slopes, per table
        self._nearest: dict[tuple[int, ...], list[int]] = {}  # per set of decided buckets
        # (indices), each bucket's nearest decided one (the smaller on a tie)
        self._shown: tuple[int, ...] = ()  # each bucket's mode in the table last built
        self._policy = target_pb2.SpecPolicy()
        self._build()

    @property
    def policy(self) -> target_pb2.SpecPolicy:
        return self._policy

    def _mode_of(self, stats: target_pb2.StepStats) -> int | None:
        """The mode a step ran: off, or the budget its tree size names (a target that does not
        report the size: the one budget there is); None for a size this policy never sent."""
        if not stats.speculated:
            return 0
        if not stats.tree_budget and len(self.modes) == 2:
            return 1
        return self._by_budget.get(stats.tree_budget)

    def observe(self, stats: target_pb2.StepStats,
                in_flight: int | None = None) -> target_pb2.SpecPolicy | None:
        """Learn from one decode step; returns the new policy when it changed. ``in_flight``:
        the requests the gateway had sent the target and not yet seen end, as the step's
        stats came (after its final deltas); without it, requests out of the batch are not
        counted (:meth:`out_steps`)."""
        mode = self._mode_of(stats)
        self._slope_memo.clear()  # (this step's points change them)
        self._count_prompts((stats.prefill_tokens, stats.committed_tokens,
                             stats.finished_prompt_tokens, stats.finished_generated_tokens,
                             stats.finished_requests))
        if stats.batch_size == 0 or not 0 < stats.period_s < math.inf or mode is None:
            return None  # prompts alone (or a period not measured) say nothing of decode speed
        if stats.draft_unavailable:
            # Decoded plainly for want of the draft (down, or late): it says nothing of what
            # the modes cost, and a probe under way waits for it to come back. The next
            # speculative step follows plain ones (its catch-up is a change of mode's).
            self._last_mode = 0
            return None
        size = bucket_of(stats.batch_size)
        bucket = self.buckets[size]
        if len(self._visits) == VISITS:
            old, entered = self._visits[0]
            self._visit_counts[old] -= 1
            self._entry_counts[old] -= entered
        entered = size != self._last_size
        self._visits.append((size, entered))
        self._visit_counts[size] += 1
        self._entry_counts[size] += entered
        self._last_size = size
        self._in_visit = 1 if entered else self._in_visit + 1
        # The step's period (not its own time): the loop's work between steps is paid once per
        # step, so it weighs more on plain decoding's many short steps. The gain counts the
        # tokens committed, not accepted ones that max_new_tokens then dropped.
        gain = max(stats.committed_tokens / stats.batch_size - 1, 0.0) if mode else 0.0
        sample = Sample(stats.period_s, gain, stats.draft_input_tokens, stats.committed_tokens,
                        stats.draft_s, stats.prefill_tokens, mode == self._last_mode)
        counted = False
        if mode == bucket.mode:
            if bucket.settling:  # the first step back after a probe (its catch-up counts in
                bucket.settling, bucket.back = False, sample  # the probe's cost)
            elif bucket.probe_left and bucket.fresh and stats.catching_up and bucket.before:
                # a probe from off whose draft catches up beside the steps (the target's
                # --defer-catch-up): left out, and not one of the probe's steps (_decide), but
                # what it took beyond off's steps before the probe counts in the probe's cost
                bucket.late += sample.period - mean_period(bucket.before)
            elif not bucket.probe_left:  # (a probe's steps the target ran late are left out)
                # the steps after a probe are judged with it (the window starts over then)
                (bucket.after if bucket.after_left else bucket.window).append(sample)
                counted = True
        elif bucket.probe_left and mode == bucket.probing:
            if bucket.fresh:  # a probe's first step: the change of mode (its catch-up counts
                bucket.fresh, bucket.first = False, sample  # in the probe's cost, not its rate)
            else:
                bucket.probe.append(sample)
                counted = True
        if counted and mode:
            bucket.gains[mode].append(gain)
        if mode == self._last_mode:  # (not a change of mode: see input_cost)
            if mode:
                bucket.inputs[mode].append((stats.draft_input_tokens, stats.draft_s))
            bucket.prefills[mode].append((stats.prefill_tokens, stats.period_s - stats.draft_s))
        self._run = self._run + 1 if mode == self._last_mode else 1
        if in_flight is not None and self._run > SETTLED:
            out = requests_out(in_flight, stats.finished_requests, stats.batch_size)
            bucket.outs[mode].append((out, stats.finished_requests))
        self._last_mode = mode
        if mode and stats.first_child_accepted:
            self._chain_gains(bucket, mode, stats)
        bucket.batches[mode].append(stats.batch_size)
        self._decide(bucket, size, stats.catching_up)
        old = self._policy
        policy = self._build()  # (a new table only when a bucket's shown mode changed)
        return None if policy is old else policy

    def _chain_gains(self, bucket: _Bucket, mode: int, stats: target_pb2.StepStats) -> None:
        """A step of a tree tells what each chain budget no deeper than it would have gained
        (its first-child path is the chain the draft would have sent): those chains' tokens
        per step are then read off every step of the tree, not off their few probe steps (at
        0 to depth accepted a step, 7 probe steps left a chain 7 % behind the tree at batch 1
        looking ahead of it often enough to run it on most steps of some runs)."""
        depth = self.modes[mode].num_steps
        for m, shape in enumerate(self.modes):
            length = min(shape.num_draft_tokens, shape.num_steps)
            if m not in (0, mode) and shape.topk == 1 and length <= depth:
                accepted = sum(stats.first_child_accepted[:length])
                bucket.gains[m].append(accepted / stats.batch_size)

    def _count_prompts(self, counts: tuple[int, int, int, int, int]) -> None:
        if len(self._prompts) == PROMPTS:
            for i, old in enumerate(self._prompts[0]):
                self._prompt_sums[i] -= old
        self._prompts.append(counts)
        for i, new in enumerate(counts):
            self._prompt_sums[i] += new

    @property
    def prompt_ratio(self) -> float:
        """Prompt tokens per committed token that a steady run prefills: over the last
        PROMPTS steps, the requests that ended there, their prompt tokens over the tokens
        they generated; before any ended (or from a target that does not report them), the
        prompt tokens prefilled over the tokens committed (0 before any). The second counts
        a wave of prompts before their requests generate a token: 1.75 against 1.33 at the
        first probes of a benchmark whose streams start together, which overstates what a
        steady speculative run sends the draft (docs/benchmarks.md, thirty-third part)."""
        prompt, committed, finished_prompt, finished_generated, _ = self._prompt_sums
        if finished_generated:
            return finished_prompt / finished_generated
        return prompt / committed if committed else 0.0

    @property
    def tokens_per_request(self) -> float:
        """Tokens a request generates, on average over those that ended in the last PROMPTS
        steps (0 before any ended, or from a target that does not report them)."""
        generated, ended = self._prompt_sums[3:]
        return generated / ended if ended else 0.0

    def out_steps(self, bucket: _Bucket, mode: int) -> float:
        """Steps of ``mode`` a request is out of the decode batch at its bucket, on average:
        the requests in flight that a step did not decode (arriving, prefilling, waiting for
        the target, or ended there and not yet answered) over the requests that ended, per
        step (Little's law), from its last OUTS steps at least SETTLED into a run of it (a
        step earlier counts requests the mode before it ended). With fewer than MIN_ENDED
        requests ended in them, every mode's steps of the bucket; with fewer still, 0.

        Each request that ends leaves its stream out of the batch for a few steps, so at a
        fixed number of streams (or a fixed request latency) a mode that ends requests
        sooner decodes fewer sequences a step: at 64 streams on an H200 the 3-token chain's
        steps decoded 54.3 sequences against plain decoding's 61.4, and the chain, 2 % ahead
        per decoding sequence, ran at 0.89 of plain decoding (docs/benchmarks.md,
        thirty-fifth part). The steps at the target count (a prompt's prefill, the one in
        which a step's last tokens go out), the client's own pause between requests does
        not: it is time, the same in every mode. A target that other gateways share decodes
        their sequences too, so this gateway counts too few out (at worst none: per decoding
        sequence, as without the count)."""
        def totals(series: Collection[deque]) -> tuple[int, int]:
            return (sum(out for d in series for out, _ in d),
                    sum(ended for d in series for _, ended in d))

        out, ended = totals([bucket.outs[mode]] if mode in bucket.outs else [])
        if ended < MIN_ENDED:
            out, ended = totals(list(bucket.outs.values()))
        return out / ended if ended >= MIN_ENDED else 0.0

    def input_cost(self, mode: int | None = None) -> float:
        """Seconds of draft wait per token sent to the draft by ``mode`` (a budget's index;
        None: every budget's): the median slope of draft_s over draft_input_tokens between
        pairs of steps of one bucket and budget (each one's last INPUTS speculative steps
        that followed one of the same mode; pairs whose inputs differ by at least half the
        median, and MIN_APART; never below 0). With fewer than MIN_SLOPES such pairs,
        ``unknown_cost`` (default 0): the budget is judged as if its tokens cost nothing, as
        before this cost was counted, and once it runs its steps say what they cost.
        (Another budget's cost in its place kept a chain that paid out of use: the tree's
        steps come first, and its draft paid more a token. Its probe's catch-up in its
        place overstated it twofold and kept a chain that paid out of use on the H200:
        docs/benchmarks.md, thirty-third part.) Pairs closer than that say little: at one stream a step sends 1-5
        tokens, and the draft's noise over a difference of one token made the median slope
        anything; a new prompt's tokens, against those steps, say what a prompt costs.

        The steps' inputs vary with the prompts that arrive, so this is what a prompt costs
        a steady run. Per budget: at 32 streams on an H200 a new sequence's tokens cost the
        8-node tree's draft 30-45 us each and the 3-token chain's 24 (session 36). A median
        of pairwise slopes (Theil and Sen's), not a least-squares one: a few big catch-ups
        weigh most in a least-squares slope, and there they cost more a token than steady
        steps' inputs (39 against 25 us); in a bucket that mostly runs plain decoding they
        decided it. A change of mode's catch-up is left out for the same reason.

        With ``borrow_cost`` a budget whose own cost is unknown takes every budget's, where
        that is known, before ``unknown_cost``: not the default. At 64 streams on the H200
        the chain's first probe from off, judged at 0 us a token, came out 4-8 % ahead
        where at the tree's cost it was level, and the switch cost 8 % (thirty-seventh
        part); under session 37's dearer feature path the same borrowing would have cut
        the chain's first probes at 16-32 streams, where it paid, from 1.21-1.41 to
        1.04-1.12. The option is there for an A/B of the two (bench_concurrency.py's mode
        variant, ``--variant '{"borrow_cost": true}'``)."""
        slopes = self._slopes("inputs")
        pooled = slopes[None] if mode is None else slopes.get(mode, _NONE)
        if len(pooled) < MIN_SLOPES and self.borrow_cost:
            pooled = slopes[None]
        if len(pooled) < MIN_SLOPES:
            return self.unknown_cost
        return max(float(np.median(pooled)), 0.0)

    def cost_known(self, mode: int) -> bool:
        """Whether ``mode``'s :meth:`input_cost` is its own (not ``unknown_cost``)."""
        return len(self._slopes("inputs").get(mode, _NONE)) >= MIN_SLOPES

    def prefill_cost(self, mode: int) -> float:
        """Seconds of a step of ``mode`` (0: off) per prompt token it prefilled, the draft
        wait left out: the median slope of period_s - draft_s over prefill_tokens between
        pairs of its steps, as :meth:`input_cost` takes its slope; with too few pairs of
        its own, every mode's pairs; with too few of those, 0 (the steps are judged as they
        ran, as before this cost was counted). A prompt costs a verify step more than a
        plain one (at 64 streams of the 8B shape on an H200: 20 us a token off, 23 with the
        chain, 29 with the 8-node tree), but far less than nothing."""
        slopes = self._slopes("prefills")
        own = slopes.get(mode, _NONE)
        pooled = own if len(own) >= MIN_SLOPES else slopes[None]
        if len(pooled) < MIN_SLOPES:
            return 0.0
        return max(float(np.median(pooled)), 0.0)

    def _slopes(self, table: str) -> dict[int | None, np.ndarray]:
        """The pairwise slopes of each bucket's ``table`` points (bucket.inputs or
        bucket.prefills: per mode, (x, y) of its steps that followed one of the same mode),
        per mode and (key None) all modes': pairs of one bucket and mode whose x differ by
        at least half their median and MIN_APART. Worked out once per table between two
        steps: a judgement reads them several times (each time 0.3 ms of numpy on a 2-core
        CPU, at 2 streams a third of observe's time)."""
        if (memo := self._slope_memo.get(table)) is not None:
            return memo
        slopes: dict[int | None, list[np.ndarray]] = defaultdict(list)
        for bucket in self.buckets.values():
            for m, points in getattr(bucket, table).items():
                if len(points) < 3:
                    continue
                xy = np.array(points, dtype=np.float64)
                dx = xy[:, 0, None] - xy[None, :, 0]
                dy = xy[:, 1, None] - xy[None, :, 1]
                apart = max(MIN_APART, np.median(xy[:, 0]) / 2)
                upper = np.triu(np.abs(dx) >= apart, 1)
                slopes[m].append(dy[upper] / dx[upper])
        every = [group for groups in slopes.values() for group in groups]
        memo = self._slope_memo[table] = {m: np.concatenate(groups)
                                          for m, groups in slopes.items()} | {
            None: np.concatenate(every) if every else _NONE}
        return memo

    def _catch_up(self, first: Sample | None, mode: int, steps: list[Sample]) -> float:
        """The draft wait a change of mode's first step (of ``mode``) spent on more input
        than a steady step sends, at the mode's input_cost a token: what the change cost
        beyond a step of the mode. Before that cost is known, the first step's time beyond
        the mean of the mode's ``steps`` around it (at unknown_cost, a chain's first
        catch-up from off at 64 streams on an H200 cost nothing where it took 0.1 s, and its
        probe's steps came out at 1.8 plain steps' time each, not 5.3)."""
        if first is None or not mode:
            return 0.0
        if self.cost_known(mode) or not steps:
            excess = first.inputs - (1 + self.prompt_ratio) * first.committed
            return min(max(excess * self.input_cost(mode), 0.0), first.draft)
        return min(max(first.period - mean_period(steps), 0.0), first.draft)

    def _interval(self, bucket: _Bucket, mode: int, period: float | None = None) -> int:
        """Steps of the mode in use between probes of ``mode``: ``probe_every`` times its
        step time over the mode in use's, and at least enough that what its last probe lost
        (:attr:`_Bucket.lost`) is the mode's part of ``probe_share`` (an even split between
        the modes not in use) of the time between two (a probe of the chain from off at 64
        streams on an H200 with a head's features lost 0.1-0.2 s to its catch-up, which 100
        plain steps' 0.65 s cannot carry). ``period``: the mean period of the bucket's
        window, when the caller has it."""
        if not bucket.ratios[mode]:
            return self.first_probe
        share = self.probe_share / (len(self.modes) - 1)
        period = bucket.window.mean_period() if period is None else period
        steps = max(self.probe_every * max(bucket.costs[mode], 1.0),
                    bucket.lost.get(mode, 0.0) / share / period)
        return round(steps) << min(bucket.streaks[mode], self.max_doublings)

    def _decide(self, bucket: _Bucket, size: int, catching_up: bool = False) -> None:
        if bucket.probe_left:
            if catching_up and bucket.late_steps < CATCHING_UP:
                bucket.late_steps += 1  # the probe's steps begin once the draft has caught up
                return
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
        others = [m for m in range(len(self.modes)) if m != bucket.mode]
        for m in others:
            bucket.since[m] += 1
        if len(bucket.window) < self.min_samples or self.passed_through(size):
            return
        period = bucket.window.mean_period()  # (once: each mode's interval reads it)
        due = {m: bucket.since[m] / self._interval(bucket, m, period) for m in others}
        if bucket.held is not None and self._gains_known(bucket, self.probe_steps):
            due[bucket.held] = max(due[bucket.held], 1.0)  # judged again once it may switch
        if bucket.recheck is not None and self.cost_known(bucket.mode):
            due[bucket.recheck] = max(due[bucket.recheck], 1.0)
        chosen = max(due, key=due.__getitem__)  # the most overdue (on a tie, the smaller)
        sudden = (bool(bucket.reference) and len(bucket.window) == WINDOW
                  and bucket.window.rate() < bucket.reference * (1 - self.sudden))
        if sudden or (due[chosen] >= 1 and self._fits(size)):
            bucket.probing, bucket.probe_left, bucket.probe = chosen, self.probe_steps, []
            bucket.first = bucket.back = None
            bucket.late, bucket.late_steps = 0.0, 0
            bucket.since[chosen] = 0
            if chosen == bucket.recheck:
                bucket.recheck = None
            bucket.before = bucket.window.last(self.probe_steps)
            bucket.fresh = True

    def _gain(self, bucket: _Bucket, mode: int) -> float:
        gains = bucket.gains[mode] if mode else ()
        return sum(gains) / len(gains) if gains else 0.0

    def _rate(self, bucket: _Bucket, mode: int, samples: list[Sample], cost: float) -> float:
        """Tokens per second per request in flight of ``mode`` (:meth:`_rate_parts`)."""
        return self._rate_parts(bucket, mode, samples, cost).rate

    def _rate_parts(self, bucket: _Bucket, mode: int, samples: list[Sample],
                    cost: float) -> RateParts:
        """The parts of ``mode``'s tokens per second per request in flight: step times from
        the samples, tokens per speculative step from that budget's last GAINS steps, and
        the share of a request's steps that decode it (L / g of L / g + :meth:`out_steps`,
        with L its tokens and g a step's; 1 where neither is known). Each step's time is
        restated for the prompts a steady run prefills (prompt_ratio prompt tokens per
        committed token) at the mode's :meth:`prefill_cost` a token: prompts arrive when
        requests end, and a probe of a few steps, or the steps around it, may see a wave of
        them or none (at 64 streams on an H200 a chain's probes between two waves looked 3 %
        ahead of off, whose steps around them had prefilled a wave; run steadily the chain
        was 19 % behind). A speculative step's time is restated too for the draft input a
        steady run of the budget sends: each committed token, and a prompt with each new
        sequence, at ``cost`` a token (the budget's input_cost). A step that sent more (a
        catch-up) costs less, one that sent less (no prompt arrived in a short probe) more,
        but never less than its time outside the draft wait. A step that followed one of
        another mode (the batch had just crossed into this bucket from one in another mode)
        keeps its catch-up: where the batch only passes through a bucket, each of its steps
        follows another mode's, and a steady run there pays for that catch-up every time (at
        64 streams on an H200, 40 ms each time the wave of a tree at 17-32 sequences began
        among plain steps, against 35 ms for the whole step without speculation)."""
        per_commit = 1 + self.prompt_ratio
        periods = [max(s.period - cost * (s.inputs - per_commit * s.committed),
                       s.period - s.draft) if mode and s.follows else s.period
                   for s in samples]
        prefill = self.prefill_cost(mode)
        steady = [max(t - prefill * s.prefill, 0.0) + prefill * self.prompt_ratio * s.committed
                  for t, s in zip(periods, samples, strict=True)]
        if sum(steady) > 0:
            periods = steady
        per_step = 1 + self._gain(bucket, mode)
        # a request's L / per_step decoding steps come with out_steps more of the mode's
        length = self.tokens_per_request
        decoding = 1 / (1 + self.out_steps(bucket, mode) * per_step / length) if length else 1.0
        return RateParts(per_step, mean_period(samples), sum(periods) / len(periods), decoding)

    def _judge(self, bucket: _Bucket, size: int) -> None:
        """A probe and the steps after it ended: its paired ratio, and the decision on the
        last PAIRS of that mode's."""
        current = bucket.before + bucket.after
        bucket.window.clear()
        other = bucket.probing
        if len(bucket.probe) < 2 or not current:
            return  # the target applied the probe too late to measure it: no judgement
        per_token = {m: self.input_cost(m) for m in {bucket.mode, other} if m}
        parts = (self._rate_parts(bucket, bucket.mode, current, per_token.get(bucket.mode, 0.0)),
                 self._rate_parts(bucket, other, bucket.probe, per_token.get(other, 0.0)))
        mine, theirs = parts[0].rate, parts[1].rate
        # What the probe cost, the catch-ups at its first step and at the first step back
        # included (a return to speculation brings the draft up to date on everything
        # since it last ran: 100-560 ms at 32 streams of an 8B target with an EAGLE-3
        # head's features, against 6 ms a plain step): its time against the same number of
        # the mode in use's steps, and its tokens per second against theirs. The first
        # spaces the probes of that mode, so that they take the same share of the time
        # whatever they cost; the second says whether it is far behind, which spaces them
        # further (a mode whose steady steps are ahead never is: its probes cost a
        # catch-up, but it would pay that only once).
        bucket.entry[other] = (self._catch_up(bucket.first, other, bucket.probe)
                               + max(bucket.late, 0.0))
        catch_ups = bucket.entry[other] + self._catch_up(bucket.back, bucket.mode, bucket.after)
        spent = sum(s.period for s in bucket.probe) + catch_ups
        bucket.costs[other] = spent / len(bucket.probe) / mean_period(current)
        got = (1 + self._gain(bucket, other)) * len(bucket.probe) / spent
        # a sequence's tokens in the probe, its first step's too (beyond its catch-up, that
        # step is one of the mode's: at 64 streams on a 2-core CPU, 8 % of a tree probe's loss)
        tokens = (1 + self._gain(bucket, other)) * (len(bucket.probe) + (bucket.first is not None))
        bucket.lost[other] = catch_ups + max(tokens / theirs - tokens / mine, 0.0)
        bucket.ratios[other].append(theirs / mine)
        bucket.decided = True
        clear = theirs < mine and mine / min(theirs, got) > 1 + self.clear
        bucket.streaks[other] = bucket.streaks[other] + 1 if clear else 0
        bucket.reference = mine
        mean = _geometric_mean(bucket.ratios[other])
        if log.isEnabledFor(logging.DEBUG):
            costs = ", ".join(f"{describe_mode(self.modes[m])} {c * 1e6:.1f} us"
                              for m, c in sorted(per_token.items()))
            outs = ", ".join(f"{describe_mode(self.modes[m])} {self.out_steps(bucket, m):.1f}"
                             for m in sorted({bucket.mode, other}))
            # the ratio against each side of the sandwich alone (a change of mode's
            # after-effect weighs on the probe and the steps after it, not those before it)
            cost = per_token.get(bucket.mode, 0.0)
            sides = "".join(
                f"; against the steps {name} it alone "
                f"{theirs / self._rate(bucket, bucket.mode, steps, cost):.3f}"
                for name, steps in (("before", bucket.before), ("after", bucket.after))
                if bucket.before and bucket.after)
            log.debug("batch <= %d: a probe of %s judged at %.3f of %s (%.1f vs %.1f tok/s "
                      "per request in flight; cost a token sent: %s; %.2f prompt tokens per "
                      "committed one; %.1f tokens a request, steps out of the batch: %s; "
                      "tokens a step %.3f vs %.3f, step %.4f vs %.4f ms as run, %.4f vs %.4f "
                      "restated, share decoding %.3f vs %.3f%s)", size,
                      describe_mode(self.modes[other]), theirs / mine,
                      describe_mode(self.modes[bucket.mode]), theirs, mine, costs or "none",
                      self.prompt_ratio, self.tokens_per_request, outs,
                      parts[1].tokens, parts[0].tokens, parts[1].as_run * 1e3,
                      parts[0].as_run * 1e3, parts[1].steady * 1e3, parts[0].steady * 1e3,
                      parts[1].share, parts[0].share, sides)
        # a speculative mode in use is left only once its tokens per step are known, and on
        # one probe only if that probe found the other mode clearly ahead
        known = self._gains_known(bucket, 0)
        favoured = mean > 1 + self.margin
        confirmed = self._confirmed(bucket.ratios[other])
        if favoured and not (known and confirmed):
            bucket.held = other
        elif bucket.held == other:
            bucket.held = None
        if favoured and known and confirmed:
            was = bucket.mode
            hinges = self._hinges_on_unknown_cost(bucket, other, mine)
            self._switch(bucket, other)
            new, old = describe_mode(self.modes[other]), describe_mode(self.modes[was])
            log.info("batch <= %d: speculation %s, was %s (%.1f vs %.1f tok/s per request in "
                     "flight in the last probe, mean ratio %.2f over %d probe(s), at mean batch %.1f "
                     "(%s) and %.1f (%s), a request out of the batch %.1f and %.1f steps)", size,
                     new, old, theirs, mine, mean, len(bucket.ratios[was]),
                     _mean(bucket.batches[other]), new, _mean(bucket.batches[was]), old,
                     self.out_steps(bucket, other), self.out_steps(bucket, was))
            bucket.reference = theirs
            if hinges:
                # The switch was judged at unknown_cost, which is optimistic, and at the
                # other budgets' cost it would not have been made: that ratio says little,
                # and the mode left is judged again as soon as the new one's own cost is
                # known (at 64 streams on an H200, 8 steps later; a chain switched to this
                # way had run at 0.73 of off for 3.5 s before its next probe of off).
                bucket.recheck = was
                bucket.ratios[was].clear()

    def _confirmed(self, ratios: Collection[float]) -> bool:
        """Whether a mode's last probes (their ratios over the mode in use) are enough to
        switch to it on: ``confirm`` of them, or fewer that found it clearly ahead (by
        ``clear``). One probe's ratio is noisy and can be biased: at 64 streams on an H200
        the chain's first probe from off came out 4-8 % ahead in each of three runs (judged
        at unknown_cost, 0, for its draft input: at the tree's cost a token, level), and
        later probes 14 % behind to 7 % ahead; run steadily it was 6 % behind, and the
        switch at the first probe left adaptive at 0.92 of off (docs/benchmarks.md,
        thirty-seventh part)."""
        mean = _geometric_mean(ratios)
        return len(ratios) >= self.confirm or mean > 1 + self.clear

    def _hinges_on_unknown_cost(self, bucket: _Bucket, mode: int, mine: float) -> bool:
        """Whether a probe of ``mode`` judged favourable (against the mode in use's rate
        ``mine``) had no cost a draft token of its own, and at the other budgets' would not
        have been (with no budget's cost known, as from a target that does not report
        draft_input_tokens: never)."""
        pooled = self._slopes("inputs")[None]
        if not mode or self.cost_known(mode) or len(pooled) < MIN_SLOPES:
            return False
        ratio = self._rate(bucket, mode, bucket.probe, max(float(np.median(pooled)), 0.0)) / mine
        return _geometric_mean([*list(bucket.ratios[mode])[:-1], ratio]) <= 1 + self.margin

    def _gains_known(self, bucket: _Bucket, more_steps: int) -> bool:
        """Whether the mode in use's tokens per step come from ``min_gains`` sequence-steps
        (with ``more_steps`` more steps of it); always, for off."""
        return (not bucket.mode or (len(bucket.gains[bucket.mode]) + more_steps)
                * _mean(bucket.batches[bucket.mode]) >= self.min_gains)

    def _switch(self, bucket: _Bucket, new: int) -> None:
        """Make ``new`` the mode in use (after the steps that followed its probe): every other
        mode's ratios and step-time ratio are restated against it. A mode still far behind
        keeps its back-off (two close modes that trade places must not bring back frequent
        probes of one far behind both: at 64 streams on an H200 an 8-node tree's probe steps
        take 2-5x a plain or chain step); the old mode and the rest start it over."""
        old = bucket.mode
        gain = _geometric_mean(bucket.ratios[new])  # new over old
        cost = bucket.costs.pop(new)
        bucket.lost.pop(new, None)
        ratios = bucket.ratios.pop(new)
        for m in list(bucket.ratios):
            bucket.ratios[m] = deque((r / gain for r in bucket.ratios[m]), maxlen=PAIRS)
            bucket.costs[m] = bucket.costs[m] / cost
            behind = bucket.ratios[m] and max(bucket.ratios[m]) * (1 + self.clear) < 1
            if not behind:
                bucket.streaks[m] = 0
        bucket.ratios[old] = deque((1 / r for r in ratios), maxlen=PAIRS)
        bucket.costs[old] = 1 / cost
        # a probe of the mode left begins with a catch-up, as its last one did (at 64
        # streams with a head's features, the chain's: 0.08 s, and 0.39 s at the next)
        bucket.lost[old] = bucket.entry.get(old, 0.0)
        bucket.streaks[old] = 0
        bucket.since.pop(new, None)
        bucket.since[old] = 0
        bucket.mode, bucket.settling, bucket.held, bucket.recheck = new, True, None, None

    def _stay(self, size: int) -> float:
        """Decode steps the batch stayed in bucket ``size`` each time it entered it, on
        average over the last VISITS steps (0: not there; infinite: there since before)."""
        if not self._entry_counts[size]:
            return math.inf if self._visit_counts[size] else 0.0
        return self._visit_counts[size] / self._entry_counts[size]

    def passed_through(self, size: int) -> bool:
        """Whether the batch only passes through bucket ``size`` (with ``passing``): in the
        last VISITS decode steps it was there, for fewer than ``probe_steps`` steps at a
        time on average, and stayed that long in another bucket. Such a bucket does not
        probe, and forgets what it decided (:meth:`_follow_neighbours`): its steps each
        follow another bucket's, so a mode of its own would begin each with a catch-up, and
        a probe there would take a step now and then for thousands of steps (at 64 streams
        on an H200, the 8-node tree at 17-32 sequences each time a wave of prompts began,
        with a head's features: 20-45 ms of catch-up each time, 0.15-0.2 s a run). Where the
        batch stays nowhere that long (it wanders across a bucket's edge), buckets probe
        as before. A bucket the workload no longer reaches keeps what it decided."""
        if not self.passing or len(self._visits) < VISITS // 4:
            return False
        stay = self._stay(size)
        return 0 < stay < self.probe_steps and self._stays_elsewhere(size, self.probe_steps)

    def _stays_elsewhere(self, size: int, steps: int) -> bool:
        """Whether the batch stays ``steps`` steps a visit, on average, in a bucket other
        than ``size`` (else it wanders, and no bucket is told from one passed through)."""
        return any(self._stay(other) >= steps for other in self._visit_counts if other != size)

    def _fits(self, size: int) -> bool:
        """Whether a probe that starts now is likely to end before the batch leaves bucket
        ``size`` (with ``passing``): its first step and ``probe_steps`` more, within what is
        left of the bucket's average stay. A probe the batch leaves resumes at its next
        visit, with another catch-up (at 64 streams on a 2-core CPU, the drain's visits to
        17-32 sequences lasted 8 steps, and its probes took 2-4 steps a run, each run's
        first after off's steps at 64: 0.2-0.3 s of a 6-s run). The stay is the average of
        the visits that ended in the last VISITS steps; with none, the probe fits. Where the
        batch stays in no other bucket long enough to hold a probe (it wanders across a
        bucket's edge), probes start as before."""
        if not self.passing:
            return True
        current = min(self._in_visit, len(self._visits))  # this visit's steps among them
        ended = self._entry_counts[size] - (self._in_visit <= len(self._visits))
        if ended <= 0:
            return True
        need = self.probe_steps + 1
        if (self._visit_counts[size] - current) / ended - self._in_visit >= need:
            return True
        return not self._stays_elsewhere(size, need)

    def _follow_neighbours(self) -> None:
        """Undecided buckets take the mode of the nearest decided one (the smaller on a tie);
        with none decided, they keep the first budget. A bucket in a probe or in the steps
        after it keeps its mode until that probe is judged (its samples are sorted by mode).
        A decided bucket the batch only passes through starts over, undecided."""
        for size, bucket in self.buckets.items():
            if (bucket.decided and not (bucket.probe_left or bucket.after_left)
                    and self.passed_through(size)):
                self.buckets[size] = _Bucket(mode=bucket.mode)
                self._slope_memo.clear()  # (its points are gone)
        buckets = list(self.buckets.values())
        decided = tuple(i for i, b in enumerate(buckets) if b.decided)
        if not decided:
            return
        nearest = self._nearest.get(decided)
        if nearest is None:  # (a few sets of decided buckets in a run: worked out once each)
            nearest = self._nearest[decided] = [
                min(decided, key=lambda j, i=i: (abs(j - i), j)) for i in range(len(buckets))]
        for bucket, near in zip(buckets, nearest, strict=True):
            if not bucket.decided and not (bucket.probe_left or bucket.after_left):
                bucket.mode = buckets[near].mode

    def _build(self) -> target_pb2.SpecPolicy:
        """The table the target applies (kept as :attr:`policy`): per bucket, its probe's
        mode or its mode in use. Built anew only when one of those changed (each step's
        observe asks; building the proto and comparing it was about a fifth of observe's
        time)."""
        self._follow_neighbours()
        shown = tuple(b.probing if b.probe_left else b.mode for b in self.buckets.values())
        if shown == self._shown:
            return self._policy
        self._shown = shown
        entries: list[target_pb2.SpecPolicy.Entry] = []
        for size, mode in zip(self.buckets, shown, strict=True):
            shape = self.modes[mode]
            if entries and entries[-1].shape == shape:
                entries[-1].max_batch_size = size
            else:
                entries.append(target_pb2.SpecPolicy.Entry(max_batch_size=size, shape=shape))
        self._policy = target_pb2.SpecPolicy(entries=entries)
        return self._policy


_NONE = np.empty(0)


def _geometric_mean(ratios: Collection[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def _mean(values: deque) -> float:
    return sum(values) / len(values) if values else float("nan")
