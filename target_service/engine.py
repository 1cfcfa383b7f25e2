"""The target's continuous-batching step loop (rank 0).

Each step: take admissions, cancellations and policy updates from the inbox;
admit what fits; ask the draft for trees for the decoding sequences that
speculate this step (one exchange); run ONE forward over the newcomers'
prompts (causal) and every decoding sequence's root plus tree (tree mask);
accept a path plus one more token (greedy: the longest path the argmax
follows; sampling: see splitspec.sampling); compact the KV cache to the
accepted path; emit token deltas. The loop never waits on the gateway.

With ``early_exchange`` the next step's draft request leaves at the end of this
step, before its deltas are emitted (Engine._send_early): the next step uses
the trees of the sequences whose tokens and shape it still matches and asks
again for the others (after a new policy, or a cancellation that changed the
batch size and with it the policy's shape).

With ``defer_catch_up`` a return to speculation (the step before verified no
tree) where a sequence generated more than that many tokens the draft has not
seen does not wait for the draft to catch up: the catch-up is sent alone, with no tree
asked, and the steps decode without speculation until its reply is in, taken
then as an early request's (Engine._defers).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from splitspec import telemetry
from splitspec.attention.base import SeqAttention
from splitspec.kv_cache import PageTable
from splitspec.sampling import SamplingParams, accept_sampled_tree, choose, probabilities
from splitspec.tree import (
    EMPTY_TREE,
    Acceptance,
    Proposal,
    Tree,
    accept_tree,
    ancestor_mask,
    depths,
    first_child_run,
    tree_error,
)
from splitspec.v1 import common_pb2, draft_pb2, target_pb2
from target_service.draft_client import DraftLink, ExchangeResult, Features, Sent
from target_service.runner import ForwardBatch, ModelRunner
from target_service.scheduler import Scheduler
from target_service.sequence import Sequence, SpecCounters

log = logging.getLogger(__name__)

NO_SPECULATION = common_pb2.DraftShape()
STOPPING = "the target is stopping and admits no new requests (a later try may succeed)"
STOPPING_EVENT = target_pb2.ServeEvent(target_stopping=True)

_TRACER = telemetry.tracer("splitspec.target")
_METER = telemetry.meter("splitspec.target")
STEP_DURATION = _METER.create_histogram(
    "splitspec.target.step.duration", "s", "Wall time of one engine step",
    explicit_bucket_boundaries_advisory=telemetry.STEP_BUCKETS)
BATCH_SIZE = _METER.create_histogram(
    "splitspec.target.batch_size", "{sequence}", "Decoding sequences in one step",
    explicit_bucket_boundaries_advisory=(1, 2, 4, 8, 16, 32, 64, 128, 256))
STEPS = _METER.create_counter("splitspec.target.steps", "{step}",
                              "Engine steps, by whether a draft tree was verified")
ACCEPTED_LENGTH = _METER.create_histogram(
    "splitspec.target.accepted_length", "{token}", "Draft tokens accepted per verified tree",
    explicit_bucket_boundaries_advisory=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
DEPTH_REACHED = _METER.create_counter(
    "splitspec.target.tree.depth_reached", "{tree}", "Verified trees whose path reached a depth")
DEPTH_ACCEPTED = _METER.create_counter(
    "splitspec.target.tree.depth_accepted", "{tree}",
    "Verified trees with a node accepted at a depth (acceptance per depth = accepted / reached)")


@functools.lru_cache(maxsize=1024)
def tree_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """A verify tree's ancestor mask, one tensor shared by every step and sequence whose tree
    has these parents (a draft's trees of one budget take few shapes; building one was a
    tensor per sequence per step). Read only, as every reader of SeqAttention.tree is."""
    return ancestor_mask(list(parents))


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_context: int
    max_prefill_tokens: int
    max_tree_nodes: int
    default_shape: common_pb2.DraftShape
    eos_ids: frozenset[int]
    early_exchange: bool = False  # ask for the next step's trees at the end of this one
    defer_catch_up: int = 0  # tokens: a return to speculation where a sequence generated more
    # that the draft has not seen decodes without speculation while the draft catches up
    # (Engine._defers; 0: the step waits for the catch-up)
    skip_owed: bool = False  # after an exchange whose wait timed out, the steps neither ask the
    # draft nor speculate until it has answered (DraftLink.owes; False: each step asks and
    # waits, its request queued behind the late one)


class _Call(NamedTuple):
    """A function for the engine thread to run between steps (see :meth:`Engine.call`)."""

    fn: Callable[[], object]
    reply: queue.Queue


class _ForwardResult(NamedTuple):
    prefill_tokens: list[int]     # the token after each prompt, prefill order
    accepted: list[Acceptance]    # each decoding sequence's accepted path and tokens, decode order
    launched: float               # perf_counter() once the runner had launched the forward
    launched_cpu: float           # and the engine thread's thread_time() then


class _Early(NamedTuple):
    """A draft request sent at the end of a step for the next one (Engine._send_early)."""

    sent: Sent
    seqs: dict[int, tuple[int, common_pb2.DraftShape]]  # seq_id -> (its tokens then, shape)
    releases: list[int]                                 # the release_ids it carried
    tokens: int                                         # tokens it sent (its catch-up)
    catch_up: bool = False  # a deferred catch-up (Engine._send_catch_up): no trees asked


class _Stream(NamedTuple):
    outbox: queue.Queue  # ServeEvent, then None when the stream is closed


def shape_for(policy: target_pb2.SpecPolicy, batch_size: int,
              default: common_pb2.DraftShape) -> common_pb2.DraftShape:
    """The draft shape the policy gives a decode batch of this size (zeros filled from default)."""
    for entry in policy.entries:
        if batch_size <= entry.max_batch_size:
            shape = entry.shape
            if shape.num_draft_tokens == 0:
                return NO_SPECULATION
            return common_pb2.DraftShape(
                num_draft_tokens=shape.num_draft_tokens,
                topk=shape.topk or default.topk,
                num_steps=shape.num_steps or default.num_steps,
            )
    return NO_SPECULATION


def first_child_counts(decode: list[Sequence], trees: dict[int, Tree],
                       accepted: list[Acceptance], committed: list[int]) -> list[int]:
    """StepStats.first_child_accepted: entry d counts the sequences whose tree's first-child
    path was accepted to at least d + 1 nodes (one entry per depth of the deepest tree);
    empty unless every decoding sequence verified a top-k tree. A sequence that reached
    max_new_tokens counts only what it committed (``committed``, per sequence: the path and
    the bonus token, cut), as the step's committed_tokens does: a chain would have been cut
    alike, and the policy compares the two."""
    if len(trees) < len(decode) or not decode:  # a plain step, or some sequence had no tree
        return []
    verified = [trees[seq.seq_id] for seq in decode]
    if any(not tree.num_nodes or tree.proposals for tree in verified):
        return []
    counts = [0] * max(max(depths(tree.parents)) for tree in verified)
    for tree, acceptance, kept in zip(verified, accepted, committed, strict=True):
        for d in range(min(first_child_run(tree, acceptance.path), kept - 1)):
            counts[d] += 1
    return counts


def _input_tokens(request: draft_pb2.DraftRequest) -> int:
    return sum(len(item.new_tokens) for item in request.seqs)


def always_speculate(shape: common_pb2.DraftShape) -> target_pb2.SpecPolicy:
    """A policy that speculates with this shape at every batch size."""
    return target_pb2.SpecPolicy(entries=[
        target_pb2.SpecPolicy.Entry(max_batch_size=2**32 - 1, shape=shape)])


class Engine:
    """Owns the model, the KV cache and every sequence. Thread-safe entry points:
    :meth:`open_stream`, :meth:`submit`, :meth:`close_stream`, :meth:`generate`."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, limits: EngineLimits,
                 draft: DraftLink | None, capture: tuple[int, ...]) -> None:
        self.runner = runner
        self.page_size = runner.cache.page_size
        self.device = runner.device
        # A forward on the CPU returns once it has run, not once it is launched: there the
        # last step's events leave before it, not a whole forward late (see _flush).
        self._forward_blocks = torch.device(runner.device).type == "cpu"
        self.scheduler = scheduler
        self.limits = limits
        self.draft = draft
        self._draft_report = draft.report if draft is not None else None  # the last told
        self.capture = capture
        self._policies: dict[int, target_pb2.SpecPolicy] = {}  # per stream; default: always_speculate
        # (stream, request mode, batch size) -> the shape its policy gives: looked up for every
        # decoding sequence every step, built once; cleared when a policy changes or a stream
        # closes
        self._shapes: dict[tuple[int, int, int], common_pb2.DraftShape] = {}
        self.totals = SpecCounters()
        self.last_stats = target_pb2.StepStats()
        self._inbox: queue.Queue = queue.Queue()
        self._deferred: list[object] = []  # inbox items a step left for the loop (_late_prompts)
        self._streams: dict[int, _Stream] = {}
        self._by_request: dict[tuple[int, int], Sequence] = {}
        self._stream_ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._step = 0
        self._draft_compute_s = 0.0
        self._draft_input_tokens = 0
        self._draft_unavailable = False  # this step's draft could not be asked, or did not answer
        # the requests that ended since the last stats: their prompt and generated tokens, count
        self._finished = [0, 0, 0]
        self._period_start: float | None = None  # end of the last step or of a wait for work
        self._step_traceparent = b""
        self._pending_releases: list[int] = []
        self._early: _Early | None = None  # the next step's draft request, already sent
        self._speculated = False  # whether the last step that decoded verified a tree
        self._pending: dict[int, list[target_pb2.TokenDelta]] = {}  # stream id -> deltas to send
        self._lock = threading.Lock()
        self.failure = ""  # why the engine cannot serve any more (see abort)
        self._draining = False  # stopping: new requests are refused (see drain)
        # Called when a step fails, before requests and streams end: under --tp, waits for the
        # rank watcher to report a rank that died, so that its abort names the cause (a
        # collective's error names no rank).
        self.settle_failure: Callable[[], object] | None = None

    # ---- thread-safe entry points -------------------------------------------------------

    def open_stream(self) -> tuple[int, queue.Queue]:
        with self._lock:
            stream_id = next(self._stream_ids)
            stream = self._streams[stream_id] = _Stream(queue.Queue())
            if self.failure:  # the engine has stopped: nobody would ever answer this stream
                stream.outbox.put(None)
            elif self._draining:
                stream.outbox.put(STOPPING_EVENT)
            return stream_id, stream.outbox

    def abort(self, message: str) -> None:
        """Thread-safe: the engine cannot go on (a rank died). Every stream ends now and its
        gRPC call fails with UNAVAILABLE and ``message``; the step loop is left alone (it
        may be blocked in a collective with the dead rank). Its message replaces the step's
        own failure (a collective's error names no rank; this names the one that died)."""
        with self._lock:
            self.failure = message
        self._end_streams()

    def drain(self) -> None:
        """Thread-safe: the target is stopping. Every stream is told so (a ServeEvent with
        ``target_stopping``: the gateway stops sending requests and turns NOT_SERVING), and
        from now on every new request is refused at once (an error delta marked retryable,
        which the gateway answers with UNAVAILABLE); the requests admitted before go on to
        their end."""
        with self._lock:
            self._draining = True
            for stream in list(self._streams.values()):  # (the engine thread may close one)
                stream.outbox.put(STOPPING_EVENT)

    @property
    def num_in_flight(self) -> int:
        """Thread-safe: requests admitted and not yet finished."""
        return len(self._by_request)

    def is_idle(self) -> bool:
        """Thread-safe: no request in flight, none waiting to be admitted or refused, and
        no event left to hand to a stream."""
        return (not self._by_request and self._inbox.empty() and not self._deferred
                and not self._pending)

    def submit(self, stream_id: int, request: target_pb2.ServeRequest) -> None:
        self._inbox.put((stream_id, request))

    def close_stream(self, stream_id: int) -> None:
        self._inbox.put((stream_id, None))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, mode: int,
                 policy: target_pb2.SpecPolicy | None = None,
                 sampling: common_pb2.SamplingParams | None = None,
                 timeout_s: float = 60.0) -> tuple[list[int], common_pb2.SpecStats]:
        """Run one request through the live loop, on a stream of its own (warmup and tests)."""
        tokens: list[int] = []
        ended: list[common_pb2.SpecStats] = []

        def take(event: target_pb2.ServeEvent) -> bool:
            for delta in event.deltas:
                tokens.extend(delta.token_ids)
                if delta.finish_reason:
                    ended.append(delta.spec)
            return bool(ended)

        self.run_stream([target_pb2.Admit(
            request_id=1, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
            ignore_eos=True, speculation=mode, sampling=sampling)], policy, take, timeout_s)
        return tokens, ended[0]

    def run_stream(self, admits: list[target_pb2.Admit], policy: target_pb2.SpecPolicy | None,
                   until: Callable[[target_pb2.ServeEvent], bool],
                   timeout_s: float = 60.0) -> None:
        """Run ``admits`` through the live loop on a stream of their own (warmup and tests),
        handing each event to ``until`` until it returns True; closing the stream then
        cancels whatever still runs. A request that fails, the stream's end or not being done
        within ``timeout_s`` raises RuntimeError, which names the cause (a start-up step fails
        with it)."""
        stream_id, outbox = self.open_stream()
        if policy is not None:
            self.submit(stream_id, target_pb2.ServeRequest(policy=policy))
        for admit in admits:
            self.submit(stream_id, target_pb2.ServeRequest(admit=admit))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    event = outbox.get(timeout=max(deadline - time.monotonic(), 0.001))
                except queue.Empty:
                    raise RuntimeError(f"generation failed: not done within {timeout_s:g} s"
                                       ) from None  # (queue.Empty says nothing more)
                if event is None:  # the stream ended before the requests finished
                    raise RuntimeError(f"generation failed: {self.failure or 'stream closed'}")
                for delta in event.deltas:
                    if delta.finish_reason == common_pb2.FINISH_REASON_ERROR:
                        raise RuntimeError(f"generation failed: {delta.error}")
                if until(event):
                    return
        finally:
            self.close_stream(stream_id)

    def set_limits(self, **changes: object) -> None:
        """Thread-safe: these EngineLimits fields changed from the next step on. Start-up sets
        ``defer_catch_up`` and ``skip_owed`` once warmup is over: both let steps decode on
        without the draft, and warmup's checks need their short requests to verify trees (on
        a draft that had timed out, a deferred catch-up queued behind the late reply left all
        of a request's 8 tokens to plain steps; with the draft service's "slow" fault, whose
        held reply outlasts such a request, so did skipping while it was owed)."""
        self.call(lambda: setattr(self, "limits", dataclasses.replace(self.limits, **changes)))

    def call(self, fn: Callable[[], object], timeout_s: float = 60.0) -> object:
        """Thread-safe: run fn on the engine thread between two steps and return its result
        (its exception is raised here). For start-up checks that need the model itself."""
        reply: queue.Queue = queue.Queue(maxsize=1)
        self._inbox.put(_Call(fn, reply))
        ok, value = reply.get(timeout=timeout_s)
        if not ok:
            raise value
        return value

    def last_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """The target's logits [V] after prompt_ids, from one prefill on scratch pages."""

        def prefill() -> torch.Tensor:
            n = len(prompt_ids)
            table = PageTable(self.page_size)
            table.reserve(self.scheduler.pool, n)
            try:
                table.num_slots = n
                logits = self.runner.forward(ForwardBatch(
                    torch.tensor(prompt_ids), torch.arange(n), [SeqAttention(table, n, n)],
                    [n - 1]))
            finally:
                table.release(self.scheduler.pool)
            return logits[0].cpu()

        return self.call(prefill)

    # ---- the loop ---------------------------------------------------------------------

    def run(self, stop: threading.Event, on_crash: Callable[[BaseException], None]) -> None:
        """Step until stop is set, then release the other ranks (on this thread: no call may
        race the last step). A failing step fails every request and calls on_crash."""
        try:
            while not stop.is_set():
                idle = not self.scheduler.has_work
                if idle:
                    self._flush()  # the last step's events, before the wait for work
                self._drain_inbox(block=idle)
                if idle:  # the next step's period starts after the wait, not before it
                    self._period_start = time.perf_counter()
                if self.scheduler.has_work:
                    self.step()
            self._flush()
            self.runner.stop()
        except Exception as exc:  # the engine is broken: fail requests, report, let main exit
            log.exception("engine step failed; failing all requests")
            if self.settle_failure is not None:
                self.settle_failure()  # a rank that died behind this error is the cause
            with self._lock:  # an abort (a rank died) named the cause already: keep it
                self.failure = self.failure or f"target engine failed: {type(exc).__name__}: {exc}"
            self._fail_all(self.failure)
            on_crash(exc)

    def _drain_inbox(self, block: bool) -> None:
        deferred, self._deferred = self._deferred, []
        for item in deferred:  # what the last step left, first (the inbox's order)
            self._process(item)
        try:
            item = (self._inbox.get(timeout=0.05) if block and not deferred
                    else self._inbox.get_nowait())
        except queue.Empty:
            if deferred:
                self._flush()
            return
        while True:
            self._process(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._flush()  # admission errors are answered at once

    def _process(self, item: object) -> None:
        if isinstance(item, _Call):
            self._run_call(item)
        else:
            self._handle(*item)

    def _late_prompts(self, prefill: list[Sequence], span: object) -> list[Sequence]:
        """Prompts admitted after the step began (while it waited for the draft), to prefill
        in this step's forward rather than the next one's; they fit the step's prompt-token
        budget beside ``prefill``. Under speculation a request that ends hands its last tokens
        out at the next step's first wait, the draft's reply; the stream's next request
        arrives during that wait and would otherwise sit out that step and prefill in the one
        after (docs/benchmarks.md, thirty-fifth part). Only admissions are taken from the
        inbox here, in order, up to its first item of another kind: that item and all after
        it are left for the loop's drain between steps (a stream closed now would free pages
        this step's forward uses; a call runs on the engine thread between steps)."""
        took = False
        while not self._deferred:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call) or item[1] is None or not item[1].HasField("admit"):
                self._deferred.append(item)
                break
            self._handle(*item)
            took = True
        if not took:
            return []
        # (an admission refused here is answered with the step's events: handed out now, at a
        # plain step they would leave before its forward's launch; see _flush)
        self.scheduler.admit()
        late = [s for s in self.scheduler.prefill_batch(self.limits.max_prefill_tokens)
                if s not in prefill]
        if telemetry.enabled():
            for seq in late:
                if seq.span is not None:
                    span.add_link(seq.span.get_span_context())
        return late

    @staticmethod
    def _run_call(call: _Call) -> None:
        try:
            value = call.fn()
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises it
            call.reply.put((False, exc))
        else:
            call.reply.put((True, value))

    def _handle(self, stream_id: int, request: target_pb2.ServeRequest | None) -> None:
        if request is None:
            self._close(stream_id)
        elif request.HasField("admit"):
            self._admit(stream_id, request.admit)
        elif request.HasField("cancel"):
            seq = self._by_request.get((stream_id, request.cancel.request_id))
            if seq is not None:
                seq.is_cancelled = True
        elif request.HasField("policy"):
            log.info("stream %d speculation policy (max batch, tree size): %s", stream_id,
                     [(e.max_batch_size, e.shape.num_draft_tokens) for e in request.policy.entries])
            self._policies[stream_id] = request.policy
            self._shapes.clear()

    def _admit(self, stream_id: int, admit: target_pb2.Admit) -> None:
        stop_ids = set(admit.stop_token_ids) | (set() if admit.ignore_eos else set(self.limits.eos_ids))
        seq = Sequence(
            request_id=admit.request_id, stream_id=stream_id, prompt_ids=list(admit.prompt_ids),
            max_new_tokens=admit.max_new_tokens, stop_ids=frozenset(stop_ids),
            speculation=admit.speculation, table=PageTable(self.page_size),
            seq_id=next(self._seq_ids), sampling=SamplingParams.from_pb(admit.sampling).with_seed())
        if self._draining:
            self._emit(seq, [], common_pb2.FINISH_REASON_ERROR, STOPPING, retryable=True)
            return
        problem = self._admission_error(seq)
        if problem:
            self._emit(seq, [], common_pb2.FINISH_REASON_ERROR, problem)
            return
        seq.span = _TRACER.start_span(
            "target.sequence", context=telemetry.context_from(admit.traceparent), attributes={
                "splitspec.request_id": seq.request_id, "splitspec.seq_id": seq.seq_id,
                "gen_ai.usage.input_tokens": len(seq.prompt_ids)})
        self._by_request[(stream_id, seq.request_id)] = seq
        self.scheduler.add(seq)

    def _admission_error(self, seq: Sequence) -> str:
        if not seq.prompt_ids or seq.max_new_tokens < 1:
            return "empty prompt or max_new_tokens < 1"
        if len(seq.prompt_ids) + seq.max_new_tokens > self.limits.max_context:
            return (f"prompt ({len(seq.prompt_ids)}) + max_new_tokens ({seq.max_new_tokens}) exceeds "
                    f"the context of {self.limits.max_context}")
        if max(seq.prompt_ids) >= self.limits.vocab_size:
            return f"token id {max(seq.prompt_ids)} >= vocabulary size {self.limits.vocab_size}"
        if not self.scheduler.can_ever_fit(seq):
            return "the KV cache is too small for this request"
        params = seq.sampling
        if params.temperature < 0 or params.top_k < 0 or not 0 <= params.top_p <= 1:
            return f"invalid sampling parameters {params}"
        return ""

    def _close(self, stream_id: int) -> None:
        for seq in [s for s in self._by_request.values() if s.stream_id == stream_id]:
            self._finish(seq)
        self._policies.pop(stream_id, None)
        self._shapes.clear()
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.outbox.put(None)

    def _fail_all(self, message: str) -> None:
        """Every request ends with an error delta naming ``message``, then every stream."""
        for seq in list(self._by_request.values()):
            self._emit(seq, [], common_pb2.FINISH_REASON_ERROR, message)
        self._flush()
        self._end_streams()

    def _end_streams(self) -> None:
        """The engine cannot serve any more (``failure`` says why): every stream ends, and one
        opened later ends at once (open_stream reads ``failure`` under the same lock, so no
        stream is missed)."""
        with self._lock:
            for stream in list(self._streams.values()):  # (the engine thread may close one)
                stream.outbox.put(None)

    # ---- one step ---------------------------------------------------------------------

    def step(self) -> None:
        start = time.perf_counter()
        self._step += 1
        for seq in [s for s in self._by_request.values() if s.is_cancelled]:
            self._emit(seq, [], common_pb2.FINISH_REASON_CANCELLED)
            self._finish(seq)
        self.scheduler.admit()
        prefill = self.scheduler.prefill_batch(self.limits.max_prefill_tokens)
        decode = self.scheduler.decode_batch()
        held = len(self.scheduler.running) + len(self.scheduler.waiting)
        if not prefill and not decode:
            self._flush()  # cancellations still answer
            return
        span = self._step_span([*prefill, *decode])
        draft_start = time.perf_counter()
        self._draft_compute_s = 0.0
        self._draft_input_tokens = 0
        self._draft_unavailable = False
        self._step_traceparent = telemetry.traceparent(span)
        trees, budget = self._draft_trees(decode)
        prefill += self._late_prompts(prefill, span)
        forward_start, forward_start_cpu = time.perf_counter(), time.thread_time()
        result = self._forward(prefill, decode, trees)
        forward_end = time.perf_counter()
        drafted, accepted, kept = self._commit(prefill, decode, trees, result)
        if self.limits.early_exchange and self._early is None:
            self._early = self._send_early()
        committed = sum(kept)
        end = time.perf_counter()
        period_start = start if self._period_start is None else self._period_start
        self._period_start = end
        speculated = any(t.num_nodes for t in trees.values())
        if decode:
            self._speculated = speculated
        self.last_stats = target_pb2.StepStats(
            step=self._step, batch_size=len(decode),
            prefill_tokens=sum(len(s.prompt_ids) for s in prefill),
            speculated=speculated, tree_budget=budget if speculated else 0,
            drafted_tokens=drafted, accepted_tokens=accepted,
            draft_s=forward_start - draft_start, forward_s=forward_end - forward_start,
            forward_launch_s=result.launched - forward_start,
            forward_launch_cpu_s=result.launched_cpu - forward_start_cpu,
            total_s=end - start, waiting=len(self.scheduler.waiting),
            draft_compute_s=self._draft_compute_s, period_s=end - period_start,
            draft_input_tokens=self._draft_input_tokens,
            committed_tokens=committed, graphed=self.runner.last_graphed,
            first_child_accepted=first_child_counts(decode, trees, result.accepted, kept),
            finished_prompt_tokens=self._finished[0],
            finished_generated_tokens=self._finished[1], finished_requests=self._finished[2],
            held_sequences=held, catching_up=self._early is not None and self._early.catch_up,
            draft_unavailable=self._draft_unavailable)
        self._finished = [0, 0, 0]
        self._record_step(self.last_stats, span)
        span.end()

    def _record_step(self, stats: target_pb2.StepStats, span: object) -> None:
        """The step's figures on its span and in the step metrics (nothing when not exporting)."""
        if telemetry.enabled():
            speculated = {"splitspec.speculation": stats.speculated}
            STEPS.add(1, speculated)
            STEP_DURATION.record(stats.total_s, speculated)
            if stats.batch_size:
                BATCH_SIZE.record(stats.batch_size)
            span.set_attributes({
                "splitspec.step": stats.step, "splitspec.batch_size": stats.batch_size,
                "splitspec.prefill_tokens": stats.prefill_tokens,
                "splitspec.speculation": stats.speculated,
                "splitspec.draft_unavailable": stats.draft_unavailable,
                "splitspec.tree_size": stats.drafted_tokens,
                "splitspec.accepted_tokens": stats.accepted_tokens,
                "splitspec.draft_s": stats.draft_s, "splitspec.draft_compute_s": stats.draft_compute_s,
                "splitspec.forward_s": stats.forward_s,
                "splitspec.forward_launch_s": stats.forward_launch_s,
                "splitspec.forward_launch_cpu_s": stats.forward_launch_cpu_s,
                "splitspec.total_s": stats.total_s})

    def _step_span(self, seqs: list[Sequence]) -> object:
        """The step's span: a child of its oldest sequence's span, linked to all of them."""
        if not telemetry.enabled():
            return _TRACER.start_span("target.step")
        spans = [s.span for s in sorted(seqs, key=lambda s: s.seq_id) if s.span is not None]
        links = [telemetry.trace.Link(s.get_span_context()) for s in spans]
        parent = telemetry.trace.set_span_in_context(spans[0]) if spans else None
        return _TRACER.start_span("target.step", context=parent, links=links)

    def _shape(self, seq: Sequence, batch_size: int) -> common_pb2.DraftShape:
        if self.draft is None or seq.speculation == common_pb2.SPECULATION_MODE_OFF:
            return NO_SPECULATION
        key = (seq.stream_id, seq.speculation, batch_size)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._policy_shape(seq, batch_size)
        return shape

    def _policy_shape(self, seq: Sequence, batch_size: int) -> common_pb2.DraftShape:
        policy = self._policies.get(seq.stream_id)
        if policy is None:
            return self.limits.default_shape
        if seq.speculation == common_pb2.SPECULATION_MODE_ON:
            # ON ignores the batch-size limits but keeps the stream's tree shape.
            shaped = [e for e in policy.entries if e.shape.num_draft_tokens > 0]
            if not shaped:
                return self.limits.default_shape
            return shape_for(policy, shaped[0].max_batch_size, self.limits.default_shape)
        return shape_for(policy, batch_size, self.limits.default_shape)

    def _draft_trees(self, decode: list[Sequence]) -> tuple[dict[int, Tree], int]:
        """The trees of the sequences that speculate this step ({} when none can) and the
        largest tree size asked of the draft: from the request the last step sent early
        (:meth:`_send_early`) for the sequences whose shape and tokens it still matches, and
        from one exchange for the others; none while a deferred catch-up runs
        (:meth:`_defers`), while the draft owes a late reply (:meth:`DraftLink.owes`), or
        while its stream is down (:attr:`DraftLink.down`: reconnecting in the background)."""
        shapes, wanting = self._wanting(decode)
        budget = max((shapes[s.seq_id].num_draft_tokens for s in wanting), default=0)
        early, self._early = self._early, None
        if early is not None and early.catch_up and not self.draft.ready(early.sent):
            self._early = early  # the draft is still catching up: decode without waiting
            return {}, 0
        trees: dict[int, Tree] = {}
        if early is not None:  # its reply first: the draft has caught up on what it sent
            self._draft_input_tokens += early.tokens
            self._flush()  # the last step's events, while the draft works (see _flush)
            early_trees: dict[int, Tree] = {}
            if not self._take_reply(self.draft.receive(early.sent), early.seqs, early.releases,
                                    early_trees):
                return self._without_draft()
            matched = {s.seq_id for s in wanting
                       if early.seqs.get(s.seq_id) == (len(s.tokens), shapes[s.seq_id])}
            trees = {i: tree for i, tree in early_trees.items() if i in matched}
            wanting = [s for s in wanting if s.seq_id not in matched]
        if wanting and self.draft is not None:
            if not self._may_ask():
                return self._without_draft()
            caught_up = early is not None and early.catch_up  # (the rest it waits for)
            if not caught_up and self._defers(wanting):
                self._early = self._send_catch_up(wanting)
                return {}, 0
            request, asked, features = self._draft_request(wanting, shapes, self._step)
            sent = self.draft.send(request, features)
            self._draft_input_tokens += _input_tokens(request)
            self._flush()
            if not self._take_reply(self.draft.receive(sent), asked,
                                    list(request.release_ids), trees):
                return self._without_draft()
        return trees, budget

    def _may_ask(self) -> bool:
        """Whether a draft request now could be answered in time: not while the stream is
        down (it would be dropped unsent; the link reconnects meanwhile), nor, once served
        (``skip_owed``), while the draft owes a late reply (it would queue behind it)."""
        return not (self.draft.down or (self.limits.skip_owed and self.draft.owes()))

    def _without_draft(self) -> tuple[dict[int, Tree], int]:
        """No trees this step, for want of the draft (StepStats.draft_unavailable)."""
        self._draft_unavailable = True
        return {}, 0

    def _defers(self, wanting: list[Sequence]) -> bool:
        """Whether this step leaves the draft's catch-up to run beside it: when the last step
        verified no tree (speculation returns, after plain decoding or a draft that was away)
        and a sequence generated more than ``defer_catch_up`` tokens the draft has not seen. A
        return from off at 64 streams on an H200 sent about 5,000 tokens with their features,
        44-62 ms against a 7 ms plain step (docs/benchmarks.md, thirty-eighth part). A new
        sequence's prompt alone does not count: sending it is what a steady run does (a
        step that waited for it would not speculate less), and on 2 CPU cores at 2 streams
        a rule that counted it deferred 173 catch-ups in five runs, most of them one new
        request's prompt after a plain step (the batch at 1 between two requests, where the
        policy differed)."""
        limit = self.limits.defer_catch_up
        return bool(limit) and not self._speculated and any(
            len(s.tokens) - max(s.draft_synced, len(s.prompt_ids)) > limit for s in wanting)

    def _send_catch_up(self, seqs: list[Sequence]) -> _Early:
        """Send the draft ``seqs``' catch-up alone (no trees asked) without waiting for it:
        until its reply is in, the steps decode without speculation and send the draft
        nothing; the step that finds it in takes it as an early request's (whose trees it
        never matches), and those sequences then send only what was committed since."""
        catch_up = dict.fromkeys((s.seq_id for s in seqs), NO_SPECULATION)
        request, asked, features = self._draft_request(seqs, catch_up, self._step)
        self._draft_input_tokens += _input_tokens(request)  # this step's: it sent them
        return _Early(self.draft.send(request, features), asked, list(request.release_ids), 0,
                      catch_up=True)

    def _wanting(self, decode: list[Sequence]
                 ) -> tuple[dict[int, common_pb2.DraftShape], list[Sequence]]:
        """Each decoding sequence's draft shape at this batch size, and those that speculate."""
        shapes = {s.seq_id: self._shape(s, len(decode)) for s in decode}
        return shapes, [s for s in decode if shapes[s.seq_id].num_draft_tokens > 0]

    def _draft_request(self, seqs: list[Sequence], shapes: dict[int, common_pb2.DraftShape],
                       step: int) -> tuple[draft_pb2.DraftRequest,
                                           dict[int, tuple[int, common_pb2.DraftShape]],
                                           Features | None]:
        """The request for ``seqs``, what it asks of each (its tokens now, shape), and the
        features it carries (None when the draft needs none)."""
        request = draft_pb2.DraftRequest(
            step=step, release_ids=self._pending_releases,
            seqs=[self._draft_input(s, shapes[s.seq_id]) for s in seqs],
            traceparent=self._step_traceparent)
        features = self._features(seqs, request.seqs) if self.capture else None
        return request, {s.seq_id: (len(s.tokens), shapes[s.seq_id]) for s in seqs}, features

    def _features(self, seqs: list[Sequence], items: list[draft_pb2.SeqDraftInput]) -> Features:
        """Each item's captured features, from its first new token's predecessor (the draft
        pairs a token with the features of the one before) to the last cached token: read from
        the cache's features in one gather and one copy to the host for the whole request,
        straight into the draft's feature memory where the link has room there."""
        spans = [range(max(item.start - 1, 0), seq.num_cached) for seq, item in zip(seqs, items,
                                                                                    strict=True)]
        slots = [slot for seq, span in zip(seqs, spans, strict=True)
                 for slot in seq.table.slots(span)]
        place = self.draft.feature_slot(len(slots) * self.runner.feature_row_bytes)
        rows = self.runner.read_features(slots, place.rows if place is not None else None)
        return Features(rows.view(torch.uint8).numpy(), [len(span) for span in spans],
                        rows.shape[1], str(rows.dtype).removeprefix("torch."),
                        place.offset if place is not None else None)

    def _send_early(self) -> _Early | None:
        """Send the next step's draft request now, at the end of this step, so that its way to
        the draft, the drafting and the reply's way back run while this step's tokens are
        emitted and the next step is scheduled (docs/benchmarks.md: the exchange's transit).
        The next step's decode batch is this one's unfinished sequences plus the prompts just
        prefilled; what changes before it starts (a cancellation, a policy) is settled then."""
        if self.draft is None or not self._may_ask():
            return None
        shapes, wanting = self._wanting(
            [s for s in self.scheduler.decode_batch() if not s.is_cancelled])
        if not wanting:
            return None
        request, asked, features = self._draft_request(wanting, shapes, self._step + 1)
        return _Early(self.draft.send(request, features), asked, list(request.release_ids),
                      _input_tokens(request))

    def _take_reply(self, result: ExchangeResult,
                    sent: dict[int, tuple[int, common_pb2.DraftShape]], releases: list[int],
                    trees: dict[int, Tree]) -> bool:
        """Record what a draft reply says about the sequences it was sent for (their trees
        into ``trees``, how far the draft has caught up); False when there is no reply (this
        step decodes without speculation)."""
        if result.stream_restarted:
            for seq in self.scheduler.running:
                seq.draft_synced = 0
            self._tell_draft_report()
        if result.reply is None:
            log.warning("step %d decodes without speculation: %s", self._step, result.error)
            return False
        released = set(releases)
        self._pending_releases = [i for i in self._pending_releases if i not in released]
        self._draft_compute_s += result.reply.draft_s
        running = {s.seq_id: s for s in self.scheduler.running}
        for (seq_id, (num_tokens, shape)), pb in zip(sent.items(), result.reply.trees,
                                                    strict=False):
            seq = running.get(seq_id)
            if seq is None:  # finished since it was sent: the draft holds it until released
                if seq_id not in self._pending_releases:
                    self._pending_releases.append(seq_id)
                continue
            tree = self._accept_tree(seq, pb, shape.num_draft_tokens, num_tokens)
            if tree is not None:
                trees[seq_id] = tree
        return True

    def _draft_input(self, seq: Sequence, shape: common_pb2.DraftShape) -> draft_pb2.SeqDraftInput:
        # At least the last token: a request the early one already caught up (asked again for
        # another shape) redoes it, as a draft that drafts from new tokens expects.
        start = min(seq.draft_synced, len(seq.tokens) - 1)
        item = draft_pb2.SeqDraftInput(seq_id=seq.seq_id, start=start,
                                       new_tokens=seq.tokens[start:], shape=shape)
        if not seq.sampling.is_greedy:
            item.sampling.CopyFrom(seq.sampling.to_pb())
        if telemetry.enabled() and seq.span is not None:
            item.traceparent = telemetry.traceparent(seq.span)
        return item

    def _accept_tree(self, seq: Sequence, pb: draft_pb2.DraftTree, budget: int,
                     num_tokens: int) -> Tree | None:
        """The tree of a reply to a request that sent the sequence's first ``num_tokens``
        tokens (None: none, or one the target refuses)."""
        if pb.seq_id != seq.seq_id or pb.error:
            log.warning("draft could not serve sequence %d: %s", seq.seq_id, pb.error or "wrong seq_id")
            seq.draft_synced = 0  # resend everything next time
            return None
        seq.draft_synced = num_tokens
        # A greedy sequence verifies by argmax whatever the draft sent: proposals do not matter.
        proposals = () if seq.sampling.is_greedy else tuple(
            Proposal(list(p.tokens), list(p.probs)) for p in pb.proposals)
        tree = Tree(list(pb.tokens), list(pb.parents), proposals)
        problem = tree_error(tree, self.limits.vocab_size, budget)
        if problem:
            log.warning("rejected draft tree for sequence %d: %s", seq.seq_id, problem)
            seq.spec.rejected_trees += 1
            return None
        return tree

    def _forward(self, prefill: list[Sequence], decode: list[Sequence],
                 trees: dict[int, Tree]) -> _ForwardResult:
        """One forward over every new token: prompts (causal) and roots plus trees (tree mask).

        Returns the token after every prompt and what every decoding sequence
        accepts (the captured features, if any, are in the cache's).
        """
        ids: list[int] = []   # host lists, one tensor each at the end (a tensor per sequence
        pos: list[int] = []   # cost more than the rest of a large batch's bookkeeping)
        attn = []
        for seq in prefill:
            n = len(seq.prompt_ids)
            ids.extend(seq.prompt_ids)
            pos.extend(range(n))
            attn.append(SeqAttention(seq.table, kv_len=n, q_len=n))
        for seq in decode:
            tree = trees.get(seq.seq_id, EMPTY_TREE)
            length = seq.num_cached
            ids.append(seq.tokens[-1])
            ids.extend(tree.tokens)
            pos.extend(length + d for d in depths(tree.parents))
            attn.append(SeqAttention(seq.table, kv_len=length + 1 + tree.num_nodes,
                                     q_len=1 + tree.num_nodes,
                                     tree=tree_mask(tuple(tree.parents)) if tree.num_nodes else None))
        starts = list(itertools.accumulate([a.q_len for a in attn], initial=0))
        logit_rows = [starts[i + 1] - 1 for i in range(len(prefill))]
        for i in range(len(prefill), len(attn)):
            logit_rows.extend(range(starts[i], starts[i + 1]))
        if self._forward_blocks:
            self._flush()
        logits = self.runner.forward(ForwardBatch(torch.tensor(ids), torch.tensor(pos), attn,
                                                  logit_rows, self.capture))
        launched, launched_cpu = time.perf_counter(), time.thread_time()
        self._flush()  # the last step's events, while the device works (see _flush)
        with torch.inference_mode():
            prefill_tokens, accepted = self._choose(logits, prefill, decode, trees)
        return _ForwardResult(prefill_tokens, accepted, launched, launched_cpu)

    def _choose(self, logits: torch.Tensor, prefill: list[Sequence], decode: list[Sequence],
                trees: dict[int, Tree]) -> tuple[list[int], list[Acceptance]]:
        """The token after every prompt, and every decoding sequence's acceptance.

        Greedy: the argmax. Sampling: the draw of the sequence's seed at the
        position the token takes; a top-k tree accepts the child that draw lands
        on, a sampled tree (with proposals) is verified by recursive rejection
        sampling (see splitspec.sampling)."""
        greedy = logits.argmax(dim=-1).tolist()
        prefill_tokens = []
        for row, seq in enumerate(prefill):
            prefill_tokens.append(greedy[row] if seq.sampling.is_greedy else
                                  choose(logits[row: row + 1], seq.sampling,
                                         [len(seq.prompt_ids)])[0])
        accepted, row = [], len(prefill)
        for seq in decode:
            tree = trees.get(seq.seq_id, EMPTY_TREE)
            rows, num = logits[row: row + 1 + tree.num_nodes], 1 + tree.num_nodes
            params = seq.sampling
            if params.is_greedy:
                accepted.append(accept_tree(tree, greedy[row: row + num]))
            elif tree.proposals:
                accepted.append(accept_sampled_tree(tree, probabilities(rows, params), params.seed,
                                                    seq.num_cached))
            else:
                where = [seq.num_cached + 1 + d for d in depths(tree.parents)]
                accepted.append(accept_tree(tree, choose(rows, params, where)))
            row += num
        return prefill_tokens, accepted

    def _commit(self, prefill: list[Sequence], decode: list[Sequence], trees: dict[int, Tree],
                result: _ForwardResult) -> tuple[int, int, list[int]]:
        """Accept, compact and emit for every sequence; returns the decoding sequences'
        drafted and accepted tokens, and the tokens each committed."""
        self._compact(decode, result.accepted)  # before a commit can finish a sequence
        for seq, token in zip(prefill, result.prefill_tokens, strict=True):
            self._commit_prefill(seq, token)
        drafted = accepted = 0
        committed = []
        for seq, acceptance in zip(decode, result.accepted, strict=True):
            tree = trees.get(seq.seq_id, EMPTY_TREE)
            committed.append(self._commit_decode(seq, tree, acceptance))
            accepted += len(acceptance.path)
            drafted += tree.num_nodes
        return drafted, accepted, committed

    def _commit_prefill(self, seq: Sequence, token: int) -> None:
        seq.num_cached = len(seq.prompt_ids)
        seq.table.num_slots = seq.num_cached
        self._emit_tokens(seq, [token])

    def _compact(self, decode: list[Sequence], accepted: list[Acceptance]) -> None:
        """Move every sequence's accepted path down to the slots after its committed ones,
        its K/V and the features the cache keeps: one copy of the slots to the device and one
        compaction for the whole batch (per sequence, those cost more host time than the rest
        of its bookkeeping; docs/benchmarks.md, twenty-first part). Their pages are distinct,
        so no move overlaps another sequence's."""
        src: list[int] = []
        dst: list[int] = []
        for seq, acceptance in zip(decode, accepted, strict=True):
            # tree index i (0 the root) of the kept run [root, *path] goes to index i's place
            moves = [(node, place) for place, node in enumerate(acceptance.path, 1)
                     if node != place]
            if moves:
                length = seq.num_cached
                src += seq.table.slots([length + node for node, _ in moves])
                dst += seq.table.slots([length + place for _, place in moves])
        if src:
            rows = torch.tensor(src + dst, device=self.device)
            self.runner.copy_slots(rows[:len(src)], rows[len(src):])

    def _commit_decode(self, seq: Sequence, tree: Tree, acceptance: Acceptance) -> int:
        """Commit the tokens of a sequence whose accepted path :meth:`_compact` moved into
        place; returns how many were committed (the accepted path and the bonus token, cut
        at max_new_tokens)."""
        seq.num_cached += 1 + len(acceptance.path)  # the root and the accepted nodes
        seq.table.num_slots = seq.num_cached
        if tree.num_nodes:
            depth = max(depths(tree.parents))
            seq.spec.record_verify(tree.num_nodes, depth, len(acceptance.path))
            if telemetry.enabled():  # per sequence and depth: skipped entirely when not exporting
                ACCEPTED_LENGTH.record(len(acceptance.path))
                for d in range(1, min(len(acceptance.path) + 1, depth) + 1):
                    DEPTH_REACHED.add(1, {"splitspec.depth": d})
                    if d <= len(acceptance.path):
                        DEPTH_ACCEPTED.add(1, {"splitspec.depth": d})
        else:
            seq.spec.plain_steps += 1
        return self._emit_tokens(seq, acceptance.tokens)

    # ---- output -----------------------------------------------------------------------

    def _emit_tokens(self, seq: Sequence, tokens: list[int]) -> int:
        """Commit and send tokens (those past max_new_tokens are dropped); returns how many
        were kept."""
        kept = seq.commit(tokens)
        self._emit(seq, kept, seq.finish_reason)
        if seq.finish_reason:
            self._finish(seq)
        return len(kept)

    def _emit(self, seq: Sequence, tokens: list[int], finish: int, error: str = "",
              retryable: bool = False) -> None:
        delta = target_pb2.TokenDelta(request_id=seq.request_id, token_ids=tokens,
                                      finish_reason=finish, error=error, retryable=retryable)
        if finish:
            delta.spec.CopyFrom(seq.spec.to_pb())
            delta.queue_s = seq.queue_s
        self._pending.setdefault(seq.stream_id, []).append(delta)

    def _finish(self, seq: Sequence) -> None:
        if self._by_request.pop((seq.stream_id, seq.request_id), None) is None:
            return
        self._finished[0] += len(seq.prompt_ids)
        self._finished[1] += len(seq.tokens) - len(seq.prompt_ids)
        self._finished[2] += 1
        self.scheduler.finish(seq)
        self.totals.merge(seq.spec)
        if seq.span is not None:
            if telemetry.enabled():
                spec = seq.spec.to_pb()
                seq.span.set_attributes({
                    "gen_ai.usage.output_tokens": len(seq.tokens) - len(seq.prompt_ids),
                    "splitspec.spec.verify_steps": spec.verify_steps,
                    "splitspec.spec.accepted_length": spec.mean_accepted_length})
            seq.span.end()
        if seq.draft_synced:
            self._pending_releases.append(seq.seq_id)

    def _tell_draft_report(self) -> None:
        """The draft stream was reopened: when the draft's start-up report changed (it was
        restarted), every gateway stream gets the new one, for its GetStatus."""
        report = self.draft.report
        if report is None or report == self._draft_report:
            return
        self._draft_report = report
        event = target_pb2.ServeEvent(draft_report=report)
        for stream in list(self._streams.values()):  # (open_stream may add one)
            stream.outbox.put(event)

    def _flush(self) -> None:
        """Hand the pending events to their streams' outboxes.

        A step's events leave at the next step's first wait (for the draft's reply, or
        after its forward's launch; on the CPU, where the forward returns only once it has
        run, before it) or before the loop waits for work, not at the step's end: each
        stream's gRPC thread then serialises and sends while this thread waits on the
        device or the draft. Sent at once, that work ran while the next step's host
        work did, and since every torch call gives the GIL up, that host work waited for it
        (docs/benchmarks.md, twenty-seventh part)."""
        pending, self._pending = self._pending, {}
        for stream_id, deltas in pending.items():
            stream = self._streams.get(stream_id)
            if stream is not None:
                stream.outbox.put(target_pb2.ServeEvent(deltas=deltas, stats=self.last_stats))
