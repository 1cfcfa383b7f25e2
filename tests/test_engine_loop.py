"""The target's step loop on a stand-in model (NullRunner: every argmax is 7) and, for the
draft exchange, a stand-in draft in process: Engine.call, step statistics, what a request
sees when a step fails, and the early exchange (each step's draft request sent during the
step before)."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import types
from collections.abc import Callable, Iterator

import pytest
import torch

from splitspec.attention.base import new_token_slots
from splitspec.feature_memory import FeatureMap, FeatureRing
from splitspec.kv_cache import KVCache, PagePool
from splitspec.v1 import common_pb2, draft_pb2, target_pb2
from target_service.draft_client import (
    ExchangeResult,
    Features,
    FeatureSlot,
    Sent,
    place_features,
)
from target_service.engine import STOPPING, Engine, EngineLimits
from target_service.runner import ModelRunner
from target_service.scheduler import Scheduler
from target_service.startup import DEFER_CHECK, deferred_return


class NullRunner:
    device = "cpu"
    last_graphed = False
    cache = types.SimpleNamespace(page_size=16)

    def __init__(self) -> None:
        self.forwards = []

    def forward(self, batch):
        self.forwards.append((batch.ids.tolist(), batch.attn[0].table.pages))
        return torch.arange(float(len(batch.logit_rows) * 8)).view(-1, 8)

    def copy_slots(self, src, dst):
        raise AssertionError("no compaction expected")

    def stop(self):
        pass


@contextlib.contextmanager
def running_engine(runner: NullRunner, pool: PagePool, draft: object = None,
                   shape: common_pb2.DraftShape | None = None, early: bool = False,
                   capture: tuple[int, ...] = (), defer: int = 0, vocab: int = 8,
                   skip_owed: bool = False) -> Iterator[Engine]:
    """An engine over ``runner`` (and ``draft``, speculating with ``shape``; ``defer`` and
    ``skip_owed``: its limits of those names) with its loop on a thread named engine-loop,
    stopped after."""
    engine = Engine(runner, Scheduler(pool, 4, 8),
                    EngineLimits(vocab, 64, 64, 8, shape or common_pb2.DraftShape(), frozenset(),
                                 early_exchange=early, defer_catch_up=defer,
                                 skip_owed=skip_owed), draft, capture)
    if draft is not None:
        draft.engine = engine
    stop = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop, print), name="engine-loop",
                              daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        stop.set()
        thread.join(5)


def test_engine_call_runs_on_the_engine_thread_and_raises_there_errors_here():
    runner, pool = NullRunner(), PagePool(8)
    with running_engine(runner, pool) as engine:
        assert engine.call(lambda: threading.current_thread().name) == "engine-loop"
        with pytest.raises(ZeroDivisionError):
            engine.call(lambda: 1 / 0)
        logits = engine.last_logits([3, 1, 4, 1, 5])
        assert logits.tolist() == [float(i) for i in range(8)]
        assert runner.forwards[0][0] == [3, 1, 4, 1, 5]
        assert pool.num_free == 8  # the scratch pages went back


@pytest.mark.parametrize("graphed", [False, True])
def test_step_stats_say_whether_the_forward_replayed_a_graph(graphed):
    runner = NullRunner()
    runner.last_graphed = graphed  # what ModelRunner.forward records for its last call
    with running_engine(runner, PagePool(8)) as engine:
        tokens, _ = engine.generate([3, 1, 4], 2, common_pb2.SPECULATION_MODE_OFF)
        assert len(tokens) == 2
        assert engine.last_stats.batch_size == 1 and engine.last_stats.graphed == graphed


def test_a_generation_not_done_in_time_fails_saying_so():
    """Engine.generate (warmup's requests) on an engine whose loop never runs: a RuntimeError
    that says why, not a bare queue.Empty (a start-up step failed with no message)."""
    engine = Engine(NullRunner(), Scheduler(PagePool(8), 4, 8),
                    EngineLimits(8, 64, 64, 8, common_pb2.DraftShape(), frozenset()), None, ())
    with pytest.raises(RuntimeError, match=r"^generation failed: not done within 0.2 s$"):
        engine.generate([3, 1, 4], 2, common_pb2.SPECULATION_MODE_OFF, timeout_s=0.2)


class LateLogits(torch.Tensor):
    """Logits whose first read (the argmax) waits 30 ms: a forward's device work, launched
    by the runner and still running when it returns."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.argmax:
            time.sleep(0.03)
        return super().__torch_function__(func, types, args, kwargs or {})


class LaunchingRunner(NullRunner):
    """Each forward spends 20 ms on the host launching it, then leaves 30 ms to the device."""

    def forward(self, batch):
        time.sleep(0.02)
        return super().forward(batch).as_subclass(LateLogits)


def test_step_stats_split_the_forward_at_its_launch():
    """forward_launch_s is the host's part of forward_s up to the runner's return (the
    launch); the wait for the device after it is in forward_s only."""
    with running_engine(LaunchingRunner(), PagePool(8)) as engine:
        tokens, _ = engine.generate([3, 1, 4], 2, common_pb2.SPECULATION_MODE_OFF)
        assert len(tokens) == 2
        stats = engine.last_stats
        assert stats.batch_size == 1
        assert stats.forward_launch_s >= 0.02
        assert stats.forward_s - stats.forward_launch_s >= 0.03
        assert stats.forward_launch_cpu_s < 0.01  # it slept: the thread did not run


class BusyLaunch(NullRunner):
    """Each forward's launch keeps the engine thread busy for 20 ms."""

    def forward(self, batch):
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
        return super().forward(batch)


def test_step_stats_tell_a_launch_that_ran_from_one_that_waited():
    """forward_launch_cpu_s is the engine thread's CPU time within forward_launch_s: close to
    it for a launch that works (a sleeping one is the test above)."""
    with running_engine(BusyLaunch(), PagePool(8)) as engine:
        engine.generate([3, 1, 4], 2, common_pb2.SPECULATION_MODE_OFF)
        stats = engine.last_stats
        assert stats.forward_launch_s >= 0.02
        assert 0.01 <= stats.forward_launch_cpu_s <= stats.forward_launch_s + 0.002


class OutboxWatch(NullRunner):
    """Records, as each forward is launched, how many events a stream's outbox holds."""

    def __init__(self) -> None:
        super().__init__()
        self.outbox: queue.Queue | None = None
        self.seen: list[int] = []

    def forward(self, batch):
        self.seen.append(self.outbox.qsize())
        return super().forward(batch)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_steps_events_leave_at_the_next_launch_and_all_of_them_before_the_loop_idles(device):
    """A step's events wait for the next step's launch (their stream's gRPC thread then sends
    while the device works), so the first forward finds none and each later forward one
    fewer than the steps before it; the last step's leave before the loop waits for work.
    On the CPU a forward returns only once it has run, so they leave before it: each forward
    finds every earlier step's (the device is a name here; nothing runs on it)."""
    runner = OutboxWatch()
    runner.device = device
    with running_engine(runner, PagePool(8)) as engine:
        stream, runner.outbox = engine.open_stream()
        engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=1, prompt_ids=[3, 1, 4], max_new_tokens=4,
            speculation=common_pb2.SPECULATION_MODE_OFF)))
        deadline = time.monotonic() + 5
        while not engine.is_idle() and time.monotonic() < deadline:  # (read after: qsize
            time.sleep(0.01)  # counts every event put)
        events = [runner.outbox.get(timeout=5) for _ in range(4)]
        assert runner.outbox.empty()
        assert runner.seen == ([0, 0, 1, 2] if device == "cuda" else [0, 1, 2, 3])
        assert [t for e in events for d in e.deltas for t in d.token_ids] == [7, 7, 7, 7]
        assert events[-1].deltas[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        steps = [e.stats.step for e in events]  # each event with its own step's figures
        assert steps == list(range(steps[0], steps[0] + 4))


def test_an_engine_is_not_idle_while_its_last_events_wait_to_be_handed_over():
    """A draining target stops its server once the engine is idle: the finished request's
    last events must be in its stream's outbox by then, not still pending."""
    engine, outbox = _engine_with_request(NullRunner(), [3, 1], 2)
    engine._drain_inbox(block=False)  # the loop's own intake and steps, without its thread
    engine.step()
    engine.step()
    assert engine.num_in_flight == 0 and outbox.qsize() == 1  # the last step's: pending
    assert not engine.is_idle()
    engine._flush()  # as the loop does before it waits for work
    assert engine.is_idle() and outbox.qsize() == 2


class CheckedFeatures(NullRunner):
    """A stand-in whose cache keeps features, as a target serving an EAGLE-3 draft does: each
    forward writes every new token's [position, token] at its slot, and the compaction and
    the draft's reads are ModelRunner's own over that cache. Before each forward it checks
    that every running request's features are its committed tokens', position by position."""

    copy_slots = ModelRunner.copy_slots
    read_features = ModelRunner.read_features
    feature_row_bytes = ModelRunner.feature_row_bytes

    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCache(1, 16, 4, 1, 2, torch.float32, "cpu")
        self.cache.hold_features(2, torch.float32)
        self.engine: Engine | None = None
        self.checked = self.wrong = 0

    def forward(self, batch):
        cached = [s for s in self.engine.scheduler.running if s.num_cached]
        for seq in cached:
            got = self.cache.features[seq.table.slots(range(seq.num_cached))].tolist()
            self.wrong += got != [[p, seq.tokens[p]] for p in range(seq.num_cached)]
        self.checked += len(cached)
        slots = torch.tensor(new_token_slots(batch.attn))
        self.cache.write_features(slots, torch.stack([batch.positions, batch.ids], 1).float())
        return super().forward(batch)


class SlowRunner(NullRunner):
    """Each forward takes 10 ms: a request stays in flight while a test acts."""

    def forward(self, batch):
        time.sleep(0.01)
        return super().forward(batch)


def test_a_draining_engine_refuses_new_requests_as_retryable_and_finishes_those_in_flight():
    """Engine.drain (the target's SIGTERM): every stream hears that the target stops (one
    opened later too); a request admitted before runs to its last token; one that arrives
    after is refused at once, marked retryable, with no token; then the engine is idle (what
    the target's main waits for before it stops)."""
    with running_engine(SlowRunner(), PagePool(8)) as engine:
        stream, outbox = engine.open_stream()

        def admit(request_id: int) -> None:
            engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
                request_id=request_id, prompt_ids=[2, 7], max_new_tokens=10, ignore_eos=True,
                speculation=common_pb2.SPECULATION_MODE_OFF)))

        admit(1)
        deadline = time.monotonic() + 5
        while engine.num_in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        engine.drain()
        admit(2)
        tokens: dict[int, list[int]] = {1: [], 2: []}
        last: dict[int, target_pb2.TokenDelta] = {}
        told = 0  # events saying the target stops
        while len(last) < 2:
            event = outbox.get(timeout=5)
            told += event.target_stopping
            for delta in event.deltas:
                tokens[delta.request_id] += delta.token_ids
                if delta.finish_reason:
                    last[delta.request_id] = delta
        assert told == 1
        assert engine.open_stream()[1].get(timeout=5).target_stopping  # a stream opened later
        assert last[1].finish_reason == common_pb2.FINISH_REASON_LENGTH and len(tokens[1]) == 10
        assert not last[1].retryable and not last[1].error
        assert last[2].finish_reason == common_pb2.FINISH_REASON_ERROR and last[2].retryable
        assert last[2].error == STOPPING and tokens[2] == []
        assert engine.is_idle() and engine.num_in_flight == 0


class FailingRunner(NullRunner):
    """Its second forward raises: the engine breaks mid-generation."""

    def forward(self, batch):
        if self.forwards:
            raise MemoryError("out of device memory in step 2")
        return super().forward(batch)


def _engine_with_request(runner: NullRunner, prompt: list[int], max_new: int
                         ) -> tuple[Engine, queue.Queue]:
    """An engine over ``runner`` (its loop not started) with one stream's request (OFF)
    waiting in its inbox, and that stream's outbox."""
    engine = Engine(runner, Scheduler(PagePool(8), 4, 8),
                    EngineLimits(8, 64, 64, 8, common_pb2.DraftShape(), frozenset()), None, ())
    stream, outbox = engine.open_stream()
    engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
        request_id=7, prompt_ids=prompt, max_new_tokens=max_new,
        speculation=common_pb2.SPECULATION_MODE_OFF)))
    return engine, outbox


def _failing_engine() -> tuple[Engine, queue.Queue]:
    """An engine whose second step fails, with a gateway stream's request waiting in it."""
    return _engine_with_request(FailingRunner(), [2, 7], 5)


def _generate_error(engine: Engine) -> str:
    with pytest.raises(RuntimeError) as failed:
        engine.generate([3, 1, 4], 4, common_pb2.SPECULATION_MODE_OFF, timeout_s=10)
    return str(failed.value)


def test_a_failed_step_ends_every_request_with_the_cause():
    crashes = []
    engine, outbox = _failing_engine()
    # warmup's and the tests' in-process generation, in flight when the step fails: it gets
    # the engine's failure, not a stray error (its request queued before the loop starts)
    errors = []
    generating = threading.Thread(target=lambda: errors.append(_generate_error(engine)))
    generating.start()
    deadline = time.monotonic() + 5
    while engine._inbox.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    thread = threading.Thread(target=engine.run, args=(threading.Event(), crashes.append),
                              daemon=True)
    thread.start()
    generating.join(15)
    thread.join(5)
    assert errors == ["generation failed: target engine failed: MemoryError: out of device "
                      "memory in step 2"]
    assert [type(e) for e in crashes] == [MemoryError]
    # a gateway stream gets its request's error delta before the stream ends: nothing lost
    events = []
    while (event := outbox.get(timeout=5)) is not None:
        events.append(event)
    finished = [d for e in events for d in e.deltas if d.finish_reason]
    assert [(d.request_id, d.finish_reason) for d in finished] == [
        (7, common_pb2.FINISH_REASON_ERROR)]
    assert "MemoryError: out of device memory in step 2" in finished[0].error


def test_a_stream_opened_after_the_engine_failed_ends_at_once_with_the_cause():
    crashes = []
    engine, _ = _failing_engine()
    thread = threading.Thread(target=engine.run, args=(threading.Event(), crashes.append),
                              daemon=True)
    thread.start()
    thread.join(5)
    assert [type(e) for e in crashes] == [MemoryError]
    # before, nobody was left to answer it: generate waited out its timeout (queue.Empty)
    assert _generate_error(engine) == ("generation failed: target engine failed: MemoryError: "
                                       "out of device memory in step 2")


def test_a_rank_that_died_behind_a_failed_step_is_the_cause_every_stream_reports():
    """Under --tp a collective fails on rank 0 at about the moment another rank dies: the
    failed step waits for the rank watcher (settle_failure), whose abort names the rank, and
    that message, not the collective's, ends the streams."""
    crashes = []
    engine, outbox = _failing_engine()
    engine.settle_failure = lambda: engine.abort("target rank 1 died (exit code -9)")
    thread = threading.Thread(target=engine.run, args=(threading.Event(), crashes.append),
                              daemon=True)
    thread.start()
    thread.join(5)
    assert [type(e) for e in crashes] == [MemoryError]
    assert engine.failure == "target rank 1 died (exit code -9)"
    while outbox.get(timeout=5) is not None:  # the gateway's stream ends
        pass
    assert _generate_error(engine) == "generation failed: target rank 1 died (exit code -9)"


def test_an_aborted_engine_fails_generation_with_its_reason():
    with running_engine(SlowRunner(), PagePool(8)) as engine:
        threading.Timer(0.2, engine.abort, args=("target rank 1 died (exit code -9)",)).start()
        with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code -9\)"):
            engine.generate([3, 1, 4], 60, common_pb2.SPECULATION_MODE_OFF, timeout_s=10)


class ChainDraft:
    """DraftLink's calls in process: for each sequence a chain of its shape's size proposing
    token 7 (NullRunner's argmax, so it is accepted). Records each request with the engine
    step it was sent in."""

    down = False  # the stream never breaks
    report = None  # (DraftLink.report: the draft's start-up report)

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.sent: list[tuple[int, draft_pb2.DraftRequest]] = []
        self._replies: list[draft_pb2.DraftReply] = []
        self.on_send: Callable[[draft_pb2.DraftRequest], None] = lambda request: None

    def feature_slot(self, size: int) -> None:
        """None: the features go in the request, as with a link without shared memory."""

    def send(self, request: draft_pb2.DraftRequest, features: Features | None = None) -> Sent:
        if features is not None:  # in the request, as the link without shared memory does
            place_features(request, features, None, 0)
        self.sent.append((self.engine._step, draft_pb2.DraftRequest.FromString(
            request.SerializeToString())))
        self.on_send(request)
        self._replies.append(draft_pb2.DraftReply(step=request.step, trees=[
            draft_pb2.DraftTree(seq_id=s.seq_id, tokens=[7] * s.shape.num_draft_tokens,
                                parents=list(range(s.shape.num_draft_tokens)))
            for s in request.seqs]))
        return Sent(request.step, time.monotonic() + 5, "", False)

    def ready(self, sent: Sent) -> bool:
        return True  # every reply is in as soon as its request is sent

    def owes(self) -> bool:
        return False  # ... so no reply is ever owed

    def receive(self, sent: Sent) -> ExchangeResult:
        reply = self._replies.pop(0)
        assert reply.step == sent.step
        return ExchangeResult(reply, "", False)


CHAIN = common_pb2.DraftShape(num_draft_tokens=2, topk=1, num_steps=2)
ON = common_pb2.SPECULATION_MODE_ON


@pytest.mark.parametrize("early", [False, True])
def test_early_exchange_asks_for_each_steps_trees_during_the_step_before(early):
    draft = ChainDraft()
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN, early) as engine:
        first, spec = engine.generate([3, 1, 4], 9, ON)
        second, _ = engine.generate([2, 7], 3, ON)
    assert first == [7] * 9 and second == [7] * 3
    assert spec.verify_steps == 3 and spec.accepted_tokens == 6  # 1 + 3 + 3 + 2 (cut)
    steps = [request.step for _, request in draft.sent]
    assert steps == [2, 3, 4, 6]  # one request a decode step (1 and 5 prefill)
    # Early, every request is sent in the step before its own, a prompt's first in its
    # prefill step; otherwise in its own.
    assert [sent_in - request.step for sent_in, request in draft.sent] == [-early] * 4
    # The first sequence is released by the second's first request, in both cases.
    assert list(draft.sent[3][1].release_ids) == [1] and draft.sent[3][1].seqs[0].seq_id == 2


@pytest.mark.parametrize("early", [False, True])
def test_step_stats_count_the_tokens_each_step_sent_the_draft(early):
    """draft_input_tokens: the new tokens of the requests whose replies a step used (sent in
    it, or early in the step before): a prompt's whole catch-up, then a step's commits."""
    draft = ChainDraft()
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN, early) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=1, prompt_ids=[3, 1, 4, 1, 5], max_new_tokens=9, speculation=ON)))
        stats, finished = {}, False
        while not finished:
            event = outbox.get(timeout=10)
            stats[event.stats.step] = event.stats
            finished = any(d.finish_reason for d in event.deltas)
    sent: dict[int, int] = {}
    for _, request in draft.sent:
        sent[request.step] = sent.get(request.step, 0) + sum(len(s.new_tokens)
                                                             for s in request.seqs)
    assert {step: s.draft_input_tokens for step, s in stats.items()
            if s.draft_input_tokens} == sent
    assert list(sent.values())[:2] == [6, 3]  # the prompt and its first token; then 1 + 2


def test_step_stats_count_the_prompt_and_generated_tokens_of_the_requests_that_ended():
    """finished_prompt_tokens, finished_generated_tokens and finished_requests: each
    request's once, in the stats of the step that ended it (the adaptive policy's prompt
    tokens per committed token); held_sequences: those the target held as the step began,
    prefilling ones too."""
    with running_engine(NullRunner(), PagePool(8)) as engine:
        stream, outbox = engine.open_stream()
        for request_id, prompt, max_new in ((1, [3, 1, 4, 1, 5], 4), (2, [2, 7, 1], 2)):
            engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
                request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new)))
        ended: dict[int, tuple[int, ...]] = {}  # step -> (prompt, generated, requests, held)
        finished_in: dict[int, int] = {}  # request -> the step whose events ended it
        while len(finished_in) < 2:
            event = outbox.get(timeout=10)
            stats = event.stats
            ended[stats.step] = (stats.finished_prompt_tokens, stats.finished_generated_tokens,
                                 stats.finished_requests, stats.held_sequences)
            finished_in |= {d.request_id: event.stats.step for d in event.deltas
                            if d.finish_reason}
    assert finished_in == {2: 2, 1: 4}  # both prefilled in step 1, one token each a step
    assert ended == {1: (0, 0, 0, 2), 2: (3, 2, 1, 2), 3: (0, 0, 0, 1), 4: (5, 4, 1, 1)}


def test_an_early_request_for_another_shape_is_asked_again():
    draft = ChainDraft()
    runner = SlowRunner()
    with running_engine(runner, PagePool(8), draft, CHAIN, early=True) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=1, prompt_ids=[3, 1, 4], max_new_tokens=40, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_AUTO)))
        outbox.get(timeout=5)  # the prompt's token: later steps decode with the old policy
        one = common_pb2.DraftShape(num_draft_tokens=1, topk=1, num_steps=1)
        engine.submit(stream, target_pb2.ServeRequest(policy=target_pb2.SpecPolicy(entries=[
            target_pb2.SpecPolicy.Entry(max_batch_size=8, shape=one)])))
        tokens, finished = [], False
        while not finished:
            deltas = outbox.get(timeout=10).deltas
            tokens += [t for d in deltas for t in d.token_ids]
            finished = any(d.finish_reason for d in deltas)
    # the policy's first step finds the early request for the old shape: asked again, the
    # draft redoing the last token (every request carries new tokens)
    again = [(first, second) for first, second in zip(draft.sent, draft.sent[1:], strict=False)
             if first[1].step == second[1].step]
    assert len(again) == 1
    (_, early_one), (sent_in, asked) = again[0]
    assert early_one.seqs[0].shape == CHAIN and asked.seqs[0].shape == one
    assert sent_in == asked.step and len(asked.seqs[0].new_tokens) == 1
    assert all(r.seqs[0].shape == one for _, r in draft.sent if r.step > asked.step)
    assert all(len(r.seqs[0].new_tokens) >= 1 for _, r in draft.sent)
    assert set(tokens) == {7}


def test_a_sequence_cancelled_after_its_early_request_is_released():
    draft = ChainDraft()
    with running_engine(SlowRunner(), PagePool(8), draft, CHAIN, early=True) as engine:
        stream, outbox = engine.open_stream()

        def cancel_new(request: draft_pb2.DraftRequest) -> None:
            # the early request that first sends request 2's sequence (seq 2): cancelled
            # before the step it was sent for, so the target never heard back about it
            if any(s.seq_id == 2 and s.start == 0 for s in request.seqs):
                engine.submit(stream, target_pb2.ServeRequest(
                    cancel=target_pb2.Cancel(request_id=2)))

        draft.on_send = cancel_new
        for rid, prompt in ((1, [3, 1, 4]), (2, [2, 7])):
            engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
                request_id=rid, prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                speculation=ON)))
        finished = {}
        while len(finished) < 2:
            for delta in outbox.get(timeout=10).deltas:
                if delta.finish_reason:
                    finished[delta.request_id] = delta.finish_reason
    assert finished == {1: common_pb2.FINISH_REASON_LENGTH, 2: common_pb2.FINISH_REASON_CANCELLED}
    sent_seq_2 = [i for i, (_, r) in enumerate(draft.sent) if any(s.seq_id == 2 for s in r.seqs)]
    released = [i for i, (_, r) in enumerate(draft.sent) if 2 in r.release_ids]
    assert len(sent_seq_2) == 1 and len(released) == 1 and released[0] > sent_seq_2[0]


class BranchDraft(ChainDraft):
    """Proposes, for every sequence, a root child 5 then a root child 7 with children 7 and 5:
    NullRunner's argmax (7) accepts the second child and its first, nodes 2 and 3, which the
    KV compaction (and the kept features) move to the places of nodes 1 and 2."""

    def send(self, request: draft_pb2.DraftRequest, features: Features | None = None) -> Sent:
        sent = super().send(request, features)
        self._replies[-1] = draft_pb2.DraftReply(step=request.step, trees=[
            draft_pb2.DraftTree(seq_id=s.seq_id, tokens=[5, 7, 7, 5], parents=[0, 0, 2, 2])
            for s in request.seqs])
        return sent


class PausingDraft(BranchDraft):
    """BranchDraft with no reply to the requests of the target's steps 3 to 5 (as a draft too
    slow or away): the sequence decodes without speculation meanwhile, and the request after
    catches the draft up on every token since its last reply."""

    def receive(self, sent: Sent) -> ExchangeResult:
        result = super().receive(sent)
        return ExchangeResult(None, "paused", False) if 3 <= sent.step <= 5 else result


class RingDraft(PausingDraft):
    """PausingDraft whose link has a feature memory (DraftLink's FeatureRing) with room
    for every request: the engine reads the features straight into it (feature_slot). Each
    request is recorded with its features copied back out of the memory, as a draft reads
    them, and the memory's region is freed at once (as if the reply had come)."""

    def __init__(self) -> None:
        super().__init__()
        self.ring = FeatureRing(1 << 20)
        self.view = FeatureMap(self.ring.path)
        self.slots = 0

    def feature_slot(self, size: int) -> FeatureSlot | None:
        start = self.ring.reserve(size, len(self.sent))
        self.slots += start is not None
        return None if start is None else FeatureSlot(start, self.ring.array[start:start + size])

    def send(self, request: draft_pb2.DraftRequest, features: Features | None = None) -> Sent:
        if features is not None:
            assert features.offset is not None
            place_features(request, features, self.ring, len(self.sent))
            for item in request.seqs:  # what the draft reads, back into the request
                where = item.hidden_states_at
                item.hidden_states = self.view.read(where.offset, where.length).tobytes()
            self.ring.replied(len(self.sent))
        return super().send(request, None)


@pytest.mark.parametrize("draft", [None, "branch", "pausing", "ring"])
def test_the_features_are_the_committed_tokens_position_by_position(draft):
    """The target's features live in its cache (one row a slot): written by each forward,
    moved by the compaction with the K/V (a tree whose accepted path moves: the root's and
    the accepted nodes' rows, in path order), read for each draft request. Before every step
    each request's features are its committed tokens'; every draft request carries those of
    the tokens from the one before its first new token (its catch-up, after a pause too)."""
    runner = CheckedFeatures()
    link = {None: None, "branch": BranchDraft(), "pausing": PausingDraft(),
            "ring": RingDraft()}[draft]
    shape = common_pb2.DraftShape(num_draft_tokens=4, topk=2, num_steps=2)
    with running_engine(runner, PagePool(8), link, shape, capture=(1,)) as engine:
        runner.engine = engine
        tokens, spec = engine.generate([3, 1, 4], 12, ON if draft else common_pb2.SPECULATION_MODE_AUTO)
    assert tokens == [7] * 12 and runner.wrong == 0 and runner.checked >= 4
    committed = [3, 1, 4, *tokens]
    requests = [r.seqs[0] for _, r in link.sent] if link else []
    for item in requests:
        rows = torch.frombuffer(bytearray(item.hidden_states), dtype=torch.float32).view(-1, 2)
        first = max(item.start - 1, 0)
        assert item.new_tokens == committed[item.start:item.start + len(item.new_tokens)]
        assert rows.tolist() == [[p, committed[p]] for p in range(
            first, item.start + len(item.new_tokens) - 1)]
    # the branch's trees each accept two nodes, which move; while the draft does not reply,
    # each request carries every token since its last reply (the last one, the catch-up)
    assert spec.accepted_tokens == {None: 0, "branch": 8, "pausing": 6, "ring": 6}[draft]
    assert [len(item.new_tokens) for item in requests] == {
        None: [], "branch": [4, 3, 3, 3], "pausing": [4, 3, 4, 5, 6, 3],
        "ring": [4, 3, 4, 5, 6, 3]}[draft]
    if draft == "ring":  # every request's features went straight into the memory
        assert link.slots == len(requests)


def test_one_compaction_moves_every_sequences_accepted_path():
    """Two requests of different lengths decode together, each step's trees accepting nodes
    that move: the step compacts both in one copy_slots call, and before every step each
    one's features are its own committed tokens' (CheckedFeatures), as every draft request
    carries them."""
    runner = CheckedFeatures()
    calls = []
    runner.copy_slots = lambda src, dst: calls.append(len(src)) or ModelRunner.copy_slots(
        runner, src, dst)
    link = BranchDraft()
    shape = common_pb2.DraftShape(num_draft_tokens=4, topk=2, num_steps=2)
    prompts = {1: [3, 1, 4], 2: [2, 7]}
    outputs: dict[int, list[int]] = {}
    with running_engine(runner, PagePool(16), link, shape, capture=(1,)) as engine:
        runner.engine = engine
        stream, outbox = engine.open_stream()
        for rid, prompt in prompts.items():
            engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
                request_id=rid, prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                speculation=ON)))
        finished = set()
        while len(finished) < 2:
            for delta in outbox.get(timeout=10).deltas:
                outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
                if delta.finish_reason:
                    finished.add(delta.request_id)
    assert outputs == {1: [7] * 12, 2: [7] * 12} and runner.wrong == 0 and runner.checked >= 8
    # both sequences' moves (two a tree) in one call a step, once both decode
    assert 4 in calls and max(calls) == 4
    by_seq = {item.seq_id: prompts[item.seq_id] + [7] * 12 for _, r in link.sent for item in r.seqs}
    assert len(by_seq) == 2  # seq ids follow the admissions
    for _, request in link.sent:
        for item in request.seqs:
            committed = by_seq[item.seq_id]
            rows = torch.frombuffer(bytearray(item.hidden_states), dtype=torch.float32).view(-1, 2)
            assert rows.tolist() == [[p, committed[p]] for p in range(
                max(item.start - 1, 0), item.start + len(item.new_tokens) - 1)]


def test_a_trees_mask_is_built_once_per_shape():
    """The verify forward's tree masks come from a cache keyed by the whole parent list: the
    same shape shares one tensor, another shape of the same size gets its own."""
    from splitspec.tree import ancestor_mask
    from target_service.engine import tree_mask

    chain, branch = (0, 1, 2), (0, 0, 1)
    assert tree_mask(chain) is tree_mask(chain)
    assert torch.equal(tree_mask(chain), ancestor_mask(list(chain)))
    assert torch.equal(tree_mask(branch), ancestor_mask(list(branch)))
    assert not torch.equal(tree_mask(chain), tree_mask(branch))


def test_each_step_takes_the_shape_its_batch_size_is_given():
    """A stream's policy speculates at batch 1 and not above: two requests decode together
    without a tree, then the longer one alone with one, step by step (the engine keeps each
    stream's shapes per batch size, built once, and drops them when the policy changes)."""
    draft = ChainDraft()
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, target_pb2.ServeRequest(policy=target_pb2.SpecPolicy(entries=[
            target_pb2.SpecPolicy.Entry(max_batch_size=1, shape=CHAIN),
            target_pb2.SpecPolicy.Entry(max_batch_size=8, shape=common_pb2.DraftShape())])))
        for request_id, new_tokens in ((1, 12), (2, 4)):
            engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
                request_id=request_id, prompt_ids=[3, 1, 4], max_new_tokens=new_tokens,
                ignore_eos=True, speculation=common_pb2.SPECULATION_MODE_AUTO)))
        steps, finished = {}, 0
        while finished < 2:
            event = outbox.get(timeout=10)
            steps[event.stats.step] = event.stats
            finished += sum(bool(d.finish_reason) for d in event.deltas)
    decoding = [(s.batch_size, s.speculated) for _, s in sorted(steps.items()) if s.batch_size]
    assert (2, False) in decoding and decoding[-1] == (1, True), decoding
    assert all(speculated == (batch == 1) for batch, speculated in decoding), decoding
    assert {len(request.seqs) for _, request in draft.sent} == {1}  # only the lone request's


def test_a_closed_streams_draft_shapes_go_with_it():
    """The draft shapes the engine keeps for a stream (per request mode and batch size) are
    dropped when the stream closes: stream ids are never reused, so a gateway that reconnects
    again and again would otherwise leave them behind for good."""
    with running_engine(NullRunner(), PagePool(8), ChainDraft(), CHAIN) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=1, prompt_ids=[3, 1, 4], max_new_tokens=4, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_AUTO)))
        while not any(d.finish_reason for d in outbox.get(timeout=10).deltas):
            pass
        kept = engine.call(lambda: dict(engine._shapes))
        engine.close_stream(stream)
        after = engine.call(lambda: dict(engine._shapes))  # (the inbox is first in, first out)
    assert kept == {(stream, common_pb2.SPECULATION_MODE_AUTO, 1): CHAIN}, kept
    assert after == {}


class ArrivingDraft(ChainDraft):
    """ChainDraft during whose wait for a reply, at the engine steps in ``arrivals``, those
    requests (stream, ServeRequest) reach the engine's inbox: requests that come while a step
    waits for the draft."""

    def __init__(self, arrivals: dict[int, list[tuple[int, target_pb2.ServeRequest]]]) -> None:
        super().__init__()
        self.arrivals = arrivals

    def receive(self, sent: Sent) -> ExchangeResult:
        for stream, request in self.arrivals.pop(self.engine._step, []):
            self.engine.submit(stream, request)
        return super().receive(sent)


def admit(request_id: int, prompt: list[int], max_new: int) -> target_pb2.ServeRequest:
    return target_pb2.ServeRequest(admit=target_pb2.Admit(
        request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new, ignore_eos=True,
        speculation=ON))


def deltas_by_step(outbox: queue.Queue, requests: int,
                   reports: list | None = None) -> tuple[dict, dict]:
    """Until ``requests`` requests finished: each request's (step, tokens, finish) deltas, in
    the order they came, and each step's stats; the draft start-up reports the stream was
    told of go into ``reports``."""
    deltas: dict[int, list[tuple[int, list[int], int]]] = {}
    stats: dict[int, target_pb2.StepStats] = {}
    finished = 0
    while finished < requests:
        event = outbox.get(timeout=10)
        if event.HasField("draft_report"):
            assert reports is not None, event
            reports.append(event.draft_report)
            continue
        stats[event.stats.step] = event.stats
        for d in event.deltas:
            deltas.setdefault(d.request_id, []).append(
                (event.stats.step, list(d.token_ids), d.finish_reason))
            finished += bool(d.finish_reason)
    return deltas, stats


def test_a_prompt_that_arrives_while_a_step_waits_for_the_draft_is_prefilled_in_that_step():
    """Engine._late_prompts: request 2 reaches the inbox during step 3's wait for the draft;
    step 3's forward prefills it beside request 1's verify, and its first token comes out with
    step 3's (a step earlier than at the next step's admission), its output unchanged."""
    draft = ArrivingDraft({})
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN) as engine:
        stream, outbox = engine.open_stream()
        draft.arrivals[3] = [(stream, admit(2, [2, 7, 1, 6], 5))]
        engine.submit(stream, admit(1, [3, 1, 4], 12))
        deltas, stats = deltas_by_step(outbox, 2)
    assert deltas[2][0][:2] == (3, [7])  # prefilled in step 3, its first token then
    assert stats[3].prefill_tokens == 4 and stats[3].batch_size == 1
    assert [t for _, tokens, _ in deltas[2] for t in tokens] == [7] * 5
    assert [t for _, tokens, _ in deltas[1] for t in tokens] == [7] * 12


def test_only_the_admissions_before_another_kind_of_request_are_taken_during_a_step():
    """During step 3's wait come: admit 2, cancel 1, admit 3. Admission 2 is prefilled in
    step 3; the cancel and everything after it wait for the loop, in order: request 1 ends
    cancelled at step 4's start, request 3 is prefilled in step 4."""
    draft = ArrivingDraft({})
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN) as engine:
        stream, outbox = engine.open_stream()
        draft.arrivals[3] = [
            (stream, admit(2, [2, 7], 4)),
            (stream, target_pb2.ServeRequest(cancel=target_pb2.Cancel(request_id=1))),
            (stream, admit(3, [5, 5, 5], 4))]
        engine.submit(stream, admit(1, [3, 1, 4], 30))
        deltas, stats = deltas_by_step(outbox, 3)
    assert deltas[2][0][:2] == (3, [7]) and deltas[3][0][:2] == (4, [7])
    assert deltas[1][-1][2] == common_pb2.FINISH_REASON_CANCELLED
    assert stats[3].prefill_tokens == 2 and stats[4].prefill_tokens == 3
    assert engine.is_idle()


def test_a_request_refused_while_a_step_waits_for_the_draft_is_answered():
    """An admission taken during step 3's wait that cannot be served (a token outside the
    vocabulary) ends with its error among the events the engine hands out next: in step 3,
    after its forward's launch, with the last whole step's stats (step 2's)."""
    draft = ArrivingDraft({})
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN) as engine:
        stream, outbox = engine.open_stream()
        draft.arrivals[3] = [(stream, admit(2, [2, 9], 4))]
        engine.submit(stream, admit(1, [3, 1, 4], 6))
        deltas, _ = deltas_by_step(outbox, 2)
    assert deltas[2] == [(2, [], common_pb2.FINISH_REASON_ERROR)]
    assert [t for _, tokens, _ in deltas[1] for t in tokens] == [7] * 6


def _policy(*entries: tuple[int, common_pb2.DraftShape]) -> target_pb2.ServeRequest:
    return target_pb2.ServeRequest(policy=target_pb2.SpecPolicy(entries=[
        target_pb2.SpecPolicy.Entry(max_batch_size=size, shape=shape) for size, shape in entries]))


def _auto(request_id: int, prompt: list[int], max_new: int) -> target_pb2.ServeRequest:
    request = admit(request_id, prompt, max_new)
    request.admit.speculation = common_pb2.SPECULATION_MODE_AUTO
    return request


class TurningRunner(NullRunner):
    """NullRunner that, during its ``at``-th forward, submits ``request`` on ``stream`` of
    ``engine``: a policy that holds from the next step."""

    def __init__(self, at: int, request: target_pb2.ServeRequest) -> None:
        super().__init__()
        self.at, self.request = at, request
        self.engine: Engine | None = None
        self.stream = 0

    def forward(self, batch):
        if len(self.forwards) + 1 == self.at:
            self.engine.submit(self.stream, self.request)
        return super().forward(batch)


class HeldDraft(ChainDraft):
    """ChainDraft whose reply to the target's step 3 misses its deadline and is still owed
    through steps 4 and 5 (a draft that holds a reply: the draft service's "slow" fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.late = False

    def receive(self, sent: Sent) -> ExchangeResult:
        result = super().receive(sent)
        if sent.step != 3:
            return result
        self.late = True
        return ExchangeResult(None, "no draft reply within 0.20s", False)

    def owes(self) -> bool:
        return self.late and self.engine._step < 6  # the late reply is in from step 6 on


def test_while_the_draft_owes_a_late_reply_the_steps_neither_wait_nor_ask():
    """DraftLink.owes, with skip_owed (as served): a request sent behind a reply that missed
    its deadline would queue behind it and likely wait out its own too. So the steps decode
    without speculation and send nothing until the draft has answered (step 6 here), which
    then catches it up on what they committed. Output unchanged; with the early exchange
    too. Without skip_owed (warmup) the steps go on asking."""
    for early in (False, True):
        caught_up, reports = through_steps_without_the_draft(HeldDraft(), early, skip_owed=True)
        assert reports == []  # the stream never broke
        # from where the last answered request left the draft (the prompt and the first
        # token): step 2's 3 tokens, whose request timed out, and steps 3 to 5's
        assert caught_up.start == 4 and len(caught_up.new_tokens) == 6, early
    draft = HeldDraft()
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN, False,
                        skip_owed=False) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, admit(1, [3, 1, 4], 20))
        _, stats = deltas_by_step(outbox, 1)
    asked = {step for step, _ in draft.sent}
    assert {4, 5} <= asked and stats[4].speculated, sorted(asked)


def through_steps_without_the_draft(draft: ChainDraft, early: bool, **limits: bool
                                    ) -> tuple[draft_pb2.SeqDraftInput, list[common_pb2.InitReport]]:
    """Serve one 20-token request with ``draft``, which fails the target's step 3 and cannot
    be asked at steps 4 and 5: the output is unchanged, those steps ask nothing, steps 3-5
    decode without speculation and say why (StepStats.draft_unavailable: the adaptive policy
    learns nothing from them), and step 6 speculates again; a stream reopened for it tells
    the gateway's stream the draft's start-up report when it changed. Returns what step 6
    sent, and the reports the stream was told."""
    reports: list[common_pb2.InitReport] = []
    with running_engine(NullRunner(), PagePool(8), draft, CHAIN, early, **limits) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, admit(1, [3, 1, 4], 20))
        deltas, stats = deltas_by_step(outbox, 1, reports)
    assert [t for _, chunk, _ in deltas[1] for t in chunk] == [7] * 20
    asked = {step for step, _ in draft.sent}
    assert {4, 5}.isdisjoint(asked) and 6 in asked, (early, sorted(asked))
    assert [stats[n].speculated for n in range(2, 8)] == [True, False, False, False,
                                                          True, True], early
    assert [stats[n].draft_unavailable for n in range(2, 8)] == [False, True, True, True,
                                                                 False, False], early
    (caught_up,) = [r.seqs[0] for _, r in draft.sent if r.step == 6]
    return caught_up, reports


class BreakingDraft(ChainDraft):
    """ChainDraft whose stream breaks at the reply to the target's step 3 and is down (being
    reopened in the background) through steps 4 and 5; the send at step 6 reopens it, so
    its reply says the draft lost every sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.report = common_pb2.InitReport(service="draft", ok=True, started_at_unix_s=1.0)
        self.restarted = common_pb2.InitReport(service="draft", ok=True, started_at_unix_s=2.0)

    def send(self, request: draft_pb2.DraftRequest, features: Features | None = None) -> Sent:
        if request.step == 6:  # the restarted draft's, kept before the stream reopens
            self.report = self.restarted
        return super().send(request, features)

    def receive(self, sent: Sent) -> ExchangeResult:
        result = super().receive(sent)
        if sent.step == 3:
            self.broken = True
            return ExchangeResult(None, "draft stream failed: UNAVAILABLE", True)
        return result._replace(stream_restarted=sent.step == 6)

    @property
    def down(self) -> bool:
        return self.broken and self.engine._step < 6  # reopened for step 6


def test_while_the_draft_stream_is_down_the_steps_build_no_request():
    """DraftLink.down: a request built while the stream is down would be dropped unsent, and
    building it cost the step the draft input's gather (every token since the draft lost
    the sequence, with its features: at 16 streams on this CPU the tree ran at 0.90 of off
    while the draft was away). So the steps send nothing until it is back, and the first
    request after it catches the draft up from the start. Output unchanged; with the early
    exchange too."""
    for early in (False, True):
        draft = BreakingDraft()
        caught_up, reports = through_steps_without_the_draft(draft, early)
        assert caught_up.start == 0 and list(caught_up.new_tokens[:3]) == [3, 1, 4], early
        assert reports == [draft.restarted], reports  # once, when the stream reopened


class CatchingUpDraft(ChainDraft):
    """ChainDraft whose reply to a request that asks no tree is in only once the engine has
    asked whether it is ``busy_steps`` times (a catch-up that takes that many steps)."""

    def __init__(self, busy_steps: int) -> None:
        super().__init__()
        self.busy_steps = busy_steps
        self.asked: list[int] = []  # the engine steps that asked

    def ready(self, sent: Sent) -> bool:
        self.asked.append(self.engine._step)
        return len(self.asked) > self.busy_steps


def _run_off_then_on(defer: int, early: bool = False, busy_steps: int = 0
                     ) -> tuple[dict, dict, list[tuple[int, draft_pb2.DraftRequest]]]:
    """One request of 12 tokens after a 9-token prompt under a policy that never speculates,
    turned to the chain at batch 1 after its 6th forward (the prefill and 5 plain steps):
    deltas and stats by step, and the draft's requests (a draft whose catch-up is in only
    after ``busy_steps`` more steps)."""
    draft = CatchingUpDraft(busy_steps)
    runner = TurningRunner(6, _policy((1, CHAIN), (8, common_pb2.DraftShape())))
    with running_engine(runner, PagePool(8), draft, CHAIN, early, defer=defer) as engine:
        runner.engine = engine
        runner.stream, outbox = engine.open_stream()
        engine.submit(runner.stream, _policy((8, common_pb2.DraftShape())))
        engine.submit(runner.stream, _auto(1, [3, 1, 4, 1, 5, 0, 2, 6, 5], 12))
        deltas, stats = deltas_by_step(outbox, 1)
    return deltas, stats, draft.sent


@pytest.mark.parametrize("early", [False, True])
def test_a_return_to_speculation_catches_the_draft_up_while_the_step_decodes_without(early):
    """defer_catch_up: the first step after plain ones whose sequence generated more than that
    many tokens the draft has not seen (6, in 5 plain steps and the prefill) sends its
    catch-up alone (no tree asked) and decodes without a tree; the next step sends only what it committed, and verifies a tree. The
    tokens are those of a step that waits for the catch-up. With the early exchange, the
    step that defers sends nothing early (the catch-up is the next step's early request)."""
    waited, waited_stats, waited_sent = _run_off_then_on(0, early)
    deferred, stats, sent = _run_off_then_on(4, early)
    tokens = [t for _, chunk, _ in deferred[1] for t in chunk]
    assert tokens == [t for _, chunk, _ in waited[1] for t in chunk] == [7] * 12
    # waiting: the first request carries the prompt and every token so far, and asks a tree
    first = waited_sent[0][1].seqs[0]
    assert first.start == 0 and first.shape == CHAIN and len(first.new_tokens) == 9 + 6
    assert waited_stats[waited_sent[0][0]].speculated
    # deferred: the same catch-up, with no tree asked, in a step that verifies none ...
    (sent_in, catch_up), (next_in, after) = sent[:2]
    item = catch_up.seqs[0]
    assert item.start == 0 and item.shape == common_pb2.DraftShape()
    assert len(item.new_tokens) == 9 + 6
    assert not stats[sent_in].speculated and stats[sent_in].batch_size == 1
    assert stats[sent_in].draft_input_tokens == len(item.new_tokens)  # the step that sent it
    # ... and the next step sends the one token that step committed, and speculates
    assert next_in == sent_in + 1 and after.seqs[0].shape == CHAIN
    assert after.seqs[0].start == len(item.new_tokens) and len(after.seqs[0].new_tokens) == 1
    assert stats[next_in].speculated
    assert stats[next_in].draft_input_tokens == len(after.seqs[0].new_tokens)


def test_the_steps_decode_without_speculation_until_the_deferred_catch_up_is_in():
    """A catch-up the draft takes three more steps over: those steps decode without a tree
    and send the draft nothing; the step that finds the reply in sends what was committed
    since (4 tokens: this step's and the three's) and verifies a tree. Output unchanged."""
    deltas, stats, sent = _run_off_then_on(4, busy_steps=3)
    assert [t for _, chunk, _ in deltas[1] for t in chunk] == [7] * 12
    (sent_in, catch_up), (next_in, after) = sent[:2]
    assert catch_up.seqs[0].shape == common_pb2.DraftShape()
    assert next_in == sent_in + 4
    assert [stats[n].speculated for n in range(sent_in, next_in + 1)] == [False] * 4 + [True]
    assert [stats[n].catching_up for n in range(sent_in - 1, next_in + 1)] == (
        [False] + [True] * 4 + [False])
    assert [stats[n].draft_input_tokens for n in range(sent_in + 1, next_in)] == [0] * 3
    assert after.seqs[0].start == len(catch_up.seqs[0].new_tokens)
    assert len(after.seqs[0].new_tokens) == 4


def test_warmup_runs_a_deferred_return_and_fails_start_up_when_it_does_not_work():
    """startup.deferred_return, warmup's check of --defer-catch-up: a request that decoded
    DEFER_CHECK + 2 tokens beside another returns to speculation alone, decodes beside its
    deferred catch-up and verifies a tree; it is cancelled then, and its tokens are plain
    decoding's. A draft whose catch-up never comes in, or an engine that does not defer,
    fails it, saying which; the engine is left deferring over DEFER_CHECK (warmup then sets
    the configured limit)."""
    with running_engine(NullRunner(), PagePool(16), CatchingUpDraft(2), CHAIN, vocab=16
                        ) as engine:
        note = deferred_return(engine, CHAIN, exact=True)
        assert engine.limits.defer_catch_up == DEFER_CHECK
        deadline = time.monotonic() + 5
        while not engine.is_idle():  # the cancelled request is gone once its close is taken
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert note == ("; a return to speculation decoded 3 steps beside its deferred catch-up "
                    "and verified trees")
    with running_engine(NullRunner(), PagePool(16), CatchingUpDraft(10**6), CHAIN, vocab=16
                        ) as engine, pytest.raises(RuntimeError) as never_in:
        deferred_return(engine, CHAIN, exact=True)
    # the longer request: 64 tokens of context less the prompt, 6 of them before the return
    assert str(never_in.value) == (
        f"a return to speculation after {DEFER_CHECK + 2} plain tokens deferred its catch-up "
        "(49 steps decoded beside it) but verified no tree before the request's end (56 "
        "tokens)")
    with running_engine(NullRunner(), PagePool(16), ChainDraft(), CHAIN, vocab=16
                        ) as engine, pytest.raises(RuntimeError, match="deferred no catch-up"):
        engine._defers = lambda wanting: False
        deferred_return(engine, CHAIN, exact=True)


def test_a_return_within_the_limit_a_new_prompt_or_a_step_after_a_tree_waits_for_its_catch_up():
    """No deferral where no sequence generated more than defer_catch_up tokens the draft has
    not seen (6 in 5 plain steps and the prefill, at 6); for a new sequence's prompt, however
    long (a steady run sends every prompt: here the first request on an engine that has not
    yet verified a tree, a prompt of 8 at 2); nor where the step before verified a tree."""
    _, stats, sent = _run_off_then_on(6)
    assert sent[0][1].seqs[0].shape == CHAIN and stats[sent[0][0]].speculated
    draft = ChainDraft()
    with running_engine(SlowRunner(), PagePool(8), draft, CHAIN, defer=2) as engine:
        stream, outbox = engine.open_stream()
        engine.submit(stream, admit(1, [3, 1, 4, 1, 5, 0, 2, 6], 40))
        while len(draft.sent) < 4:  # speculating: its later steps send 1-3 tokens
            outbox.get(timeout=10)
        engine.submit(stream, admit(2, [2, 7, 1, 6, 2, 6], 4))
        deltas, _ = deltas_by_step(outbox, 2)
    assert deltas[2][-1][0] < deltas[1][-1][0]  # request 2 ran beside request 1
    first = draft.sent[0][1].seqs[0]
    assert first.start == 0 and len(first.new_tokens) == 9 and first.shape == CHAIN
    # request 2's prompt joined a speculating batch: sent with a tree asked too
    assert {s.shape.num_draft_tokens for _, r in draft.sent for s in r.seqs} == {2}
    assert {s.seq_id for _, r in draft.sent for s in r.seqs} == {1, 2}
