"""The target warmup's check that speculation reproduces plain decoding, exact in float32 and
up to near-ties of the logits in bf16/fp16; Engine.call, which runs its probes on the
engine thread; and what a request sees when the engine's step fails."""

from __future__ import annotations

import contextlib
import threading
import time
import types
from collections.abc import Iterator

import pytest
import torch

from splitspec.kv_cache import PagePool
from splitspec.v1 import common_pb2, target_pb2
from target_service.engine import Engine, EngineLimits
from target_service.scheduler import Scheduler
from target_service.startup import WARMUP_PROMPT, parting


class Logits:
    """An engine stand-in whose last_logits says what OFF's logits were."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row, self.asked = row, []

    def last_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        self.asked.append(prompt_ids)
        return self.row


def row(values: dict[int, float]) -> torch.Tensor:
    logits = torch.full((16,), -5.0)
    for token, value in values.items():
        logits[token] = value
    return logits


def test_equal_outputs_pass_in_any_precision():
    engine = Logits(row({}))
    assert parting(engine, "tree", [1, 2, 3], [1, 2, 3], exact=True) == ""
    assert parting(engine, "tree", [1, 2, 3], [1, 2, 3], exact=False) == ""
    assert engine.asked == []


def test_float32_allows_no_difference():
    with pytest.raises(RuntimeError, match="verification is broken"):
        parting(Logits(row({4: 10.0, 5: 10.0})), "tree", [1, 5], [1, 4], exact=True)


def test_low_precision_allows_a_near_tie_where_they_part():
    engine = Logits(row({4: 10.0, 5: 9.9}))  # OFF chose 4, ON 5: 0.1 apart of 10
    note = parting(engine, "chain", [1, 5, 7], [1, 4, 2], exact=False)
    assert "chain parted from plain at token 1 on a near-tie" in note
    assert engine.asked == [[*WARMUP_PROMPT, 1]]  # OFF's logits after the common prefix


def test_low_precision_refuses_a_real_disagreement():
    engine = Logits(row({4: 10.0, 5: 2.0}))  # ON's token is far below OFF's choice
    with pytest.raises(RuntimeError, match="far from"):
        parting(engine, "tree", [5, 5], [4, 2], exact=False)


class NullRunner:
    device = "cpu"
    last_graphed = False
    cache = types.SimpleNamespace(page_size=16)

    def __init__(self) -> None:
        self.forwards = []

    def forward(self, batch):
        self.forwards.append((batch.ids.tolist(), batch.attn[0].table.pages))
        return torch.arange(float(len(batch.logit_rows) * 8)).view(-1, 8), None

    def copy_slots(self, src, dst):
        raise AssertionError("no compaction expected")

    def stop(self):
        pass


@contextlib.contextmanager
def running_engine(runner: NullRunner, pool: PagePool) -> Iterator[Engine]:
    """An engine over ``runner`` with its loop on a thread named engine-loop, stopped after."""
    engine = Engine(runner, Scheduler(pool, 4, 8),
                    EngineLimits(8, 64, 64, 8, common_pb2.DraftShape(), frozenset()), None, ())
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


class FailingRunner(NullRunner):
    """Its second forward raises: the engine breaks mid-generation."""

    def forward(self, batch):
        if self.forwards:
            raise MemoryError("out of device memory in step 2")
        return super().forward(batch)


def test_a_failed_step_ends_every_request_with_the_cause():
    crashes = []
    engine = Engine(FailingRunner(), Scheduler(PagePool(8), 4, 8),
                    EngineLimits(8, 64, 64, 8, common_pb2.DraftShape(), frozenset()), None, ())
    other, outbox = engine.open_stream()
    engine.submit(other, target_pb2.ServeRequest(admit=target_pb2.Admit(
        request_id=7, prompt_ids=[2, 7], max_new_tokens=5,
        speculation=common_pb2.SPECULATION_MODE_OFF)))
    thread = threading.Thread(target=engine.run, args=(threading.Event(), crashes.append),
                              daemon=True)
    thread.start()
    # warmup's and the tests' in-process generation: the engine's failure, not a stray error
    with pytest.raises(RuntimeError, match="target engine failed: MemoryError: out of device "
                                           "memory in step 2"):
        engine.generate([3, 1, 4], 4, common_pb2.SPECULATION_MODE_OFF, timeout_s=10)
    thread.join(5)
    assert [type(e) for e in crashes] == [MemoryError]
    # a gateway stream gets its request's error delta before the stream ends: nothing lost
    events = []
    while (event := outbox.get(timeout=5)) is not None:
        events.append(event)
    finished = [d for e in events for d in e.deltas if d.finish_reason]
    assert [(d.request_id, d.finish_reason) for d in finished] == [
        (7, common_pb2.FINISH_REASON_ERROR)]
    assert "MemoryError: out of device memory in step 2" in finished[0].error


class SlowRunner(NullRunner):
    def forward(self, batch):
        time.sleep(0.01)
        return super().forward(batch)


def test_an_aborted_engine_fails_generation_with_its_reason():
    with running_engine(SlowRunner(), PagePool(8)) as engine:
        threading.Timer(0.2, engine.abort, args=("target rank 1 died (exit code -9)",)).start()
        with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code -9\)"):
            engine.generate([3, 1, 4], 60, common_pb2.SPECULATION_MODE_OFF, timeout_s=10)
