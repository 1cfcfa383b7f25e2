"""bench/bench_speculation.py's account of a run's wall time (read from the target's step
statistics), which separates the adaptive policy's probes and the catch-ups that begin
them from the time between steps."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_speculation as bs  # bench/ is a script folder, not a package

from splitspec.v1 import common_pb2, target_pb2


def step(n: int, speculated: bool, total_s: float, draft_s: float = 0.0,
         batch_size: int = 1, sent: int = 0, graphed: bool = False) -> target_pb2.StepStats:
    return target_pb2.StepStats(step=n, batch_size=batch_size, speculated=speculated,
                                total_s=total_s, draft_s=draft_s, draft_input_tokens=sent,
                                graphed=graphed)


def test_a_runs_time_splits_into_prompts_plain_speculative_resumed_and_between_steps():
    """A prompt alone, then a speculative step (after a prompt: not counted as resuming),
    plain steps (one sends the draft a deferred catch-up), a probe of two speculative
    steps whose first resumes after plain ones (its draft exchange carries the catch-up), and
    plain again; given out of order: the split orders them by step number."""
    steps = [step(5, True, 0.004, draft_s=0.003), step(2, False, 0.001),
             step(3, False, 0.001, draft_s=0.0004, sent=40),
             step(4, False, 0.001), step(6, True, 0.002, draft_s=0.001), step(7, False, 0.001),
             step(1, True, 0.002, draft_s=0.001), step(0, False, 0.003, batch_size=0)]
    split = bs.time_split(steps, wall_s=0.020)
    assert split["prompts_steps"] == 1 and split["prompts_s"] == pytest.approx(0.003)
    assert split["plain_steps"] == 4 and split["plain_s"] == pytest.approx(0.004)
    assert split["speculative_steps"] == 3 and split["speculative_s"] == pytest.approx(0.008)
    assert split["resumed_steps"] == 1 and split["resumed_s"] == pytest.approx(0.004)
    assert split["resumed_draft_s"] == pytest.approx(0.003)
    assert split["plain_sending_steps"] == 1 and split["plain_sending_s"] == pytest.approx(0.001)
    assert split["plain_sending_draft_s"] == pytest.approx(0.0004)
    assert split["between_steps_s"] == pytest.approx(0.020 - 0.015)
    text = bs.describe_split(split)
    assert "prompts alone 0.003 (1) + plain steps 0.004 (4; of which sending the draft " \
        "tokens 0.001 (1), their draft 0.000)" in text
    assert "between steps 0.005" in text


def test_every_run_is_recorded_with_its_rate_parts_and_time_split():
    """--out-json keeps each run's figures: a run of 30 tokens in 0.02 s whose two decode
    steps (one speculative, one plain) and prompt step split its wall time; of the plain
    steps, one replayed a CUDA graph and one ran eagerly."""
    prompt = target_pb2.StepStats(step=0, batch_size=0, prefill_tokens=16, total_s=0.003)
    stats = bs.RunStats(tokens=30, wall_s=0.020, steps=[
        prompt, step(1, True, 0.004, draft_s=0.002, graphed=True), step(2, False, 0.001),
        step(3, False, 0.001, graphed=True)])
    stats.add_request(common_pb2.SpecStats(verify_steps=1, accepted_tokens=2))
    record = bs.run_record(stats)
    assert record["tokens_per_s"] == pytest.approx(1500.0)
    assert record["mean_accepted"] == pytest.approx(2.0)
    assert record["step"]["steps"] == 1 and record["step"]["draft_ms"] == pytest.approx(2.0)
    assert record["step"]["graphed_share"] == 1.0
    assert record["plain_step"]["steps"] == 2 and record["plain_step"]["graphed_share"] == 0.5
    assert record["time_split"]["between_steps_s"] == pytest.approx(0.020 - 0.009)
    json.dumps(record)  # it must be writable as JSON


def test_probes_turn_the_tree_on_for_a_few_steps_after_every_run_of_plain_ones():
    """--shapes probes: off for `every` decode steps, the tree for `steps` speculative ones,
    and again; steps that only prefill do not count, nor in the tree's phase plain ones."""
    tree = common_pb2.DraftShape(num_draft_tokens=8, topk=4, num_steps=4)
    probes = bs.Probes(tree, every=3, steps=2)
    assert not probes.policy.entries
    seen = []
    for n in range(13):
        on = bool(probes.policy.entries) and n != 5  # step 5: a deferred catch-up's
        changed = probes.observe(target_pb2.StepStats(step=n, batch_size=0 if n == 1 else 4,
                                                      speculated=on))
        seen.append(None if changed is None else bool(changed.entries))
    # decode steps 0, 2, 3 end the first off phase; 4, 6 the tree's; 7, 8, 9 off; 10, 11 tree
    assert seen == [None, None, None, True, None, None, False, None, None, True, None, False,
                    None]
    assert probes.policy == target_pb2.SpecPolicy()
    assert probes.observe(target_pb2.StepStats(batch_size=1)) is None
    assert [e.shape for e in probes.observe(target_pb2.StepStats(batch_size=1)).entries] == [tree]


def test_the_outbox_tells_when_grpcs_thread_has_taken_every_request():
    """Outbox.wait_sent returns once the consumer (gRPC's thread in a run) has taken every
    request put and asked for the next, and after its timeout when nothing takes them; the
    consumer gets them in order and stops at None."""
    outbox = bs.Outbox()
    taken: list = []
    gate = threading.Event()

    def consume() -> None:
        for request in outbox:
            gate.wait()  # (sends nothing until the test lets it)
            taken.append(request.admit.request_id)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        for rid in (1, 2):
            outbox.put(target_pb2.ServeRequest(admit=target_pb2.Admit(request_id=rid)))
        start = time.perf_counter()
        outbox.wait_sent(timeout_s=0.05)  # the consumer holds the first: times out
        assert time.perf_counter() - start >= 0.04 and taken == []
        gate.set()
        outbox.wait_sent(timeout_s=5)
        assert taken == [1, 2]
    finally:
        gate.set()
        outbox.put(None)
        consumer.join(5)
    assert not consumer.is_alive()
