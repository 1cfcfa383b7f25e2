"""Speculation is an optimization, never a dependency: toggling it, or losing the draft,
never changes greedy output, and speculation resumes when the draft comes back."""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import signal
import time

import grpc
import pytest

from splitspec.builtin import BUILTIN_TARGET
from splitspec.tokenizer import load_tokenizer
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from tests.stack import Service

pytestmark = pytest.mark.slow

PROMPTS = ["def parse(text):\n", "class Config:\n", "import sys\n\n", "for key in sorted(",
           "    return self._", "with open(path, 'rb') as f:\n"]
TREE = common_pb2.DraftShape(num_draft_tokens=8, topk=4, num_steps=4)
# How the target exchanges with the draft: each step's request in the step (the default), sent
# at the end of the step before, or with a return to speculation whose sequences generated more
# than one token the draft has not seen decoding without it while the draft catches up; each
# through a mailbox in shared memory after a stream's first request (the default), or all on
# the stream
EXCHANGES = pytest.mark.parametrize(
    "flags", [[], ["--early-exchange"], ["--defer-catch-up", "1"], ["--no-exchange-memory"]],
    ids=["exchange", "early-exchange", "deferred-catch-up", "on-the-stream"])


def policy(speculate: bool) -> target_pb2.ServeRequest:
    entries = [target_pb2.SpecPolicy.Entry(max_batch_size=2**32 - 1, shape=TREE)] if speculate else []
    return target_pb2.ServeRequest(policy=target_pb2.SpecPolicy(entries=entries))


def serve(target: Service, prompts: list[list[int]], max_new: int, toggle_every: int = 0,
          speculate: bool = True) -> tuple[dict[int, list[int]], list[target_pb2.ServeEvent]]:
    """Run prompts on one Serve stream; every `toggle_every` events flip the policy. Returns
    the tokens per request and every event (a step's deltas and statistics)."""
    requests: queue.Queue = queue.Queue()
    requests.put(policy(speculate))
    for rid, ids in enumerate(prompts):
        requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=rid, prompt_ids=ids, max_new_tokens=max_new, ignore_eos=True,
            speculation=common_pb2.SPECULATION_MODE_AUTO)))
    out = {rid: [] for rid in range(len(prompts))}
    steps, done, events = [], 0, 0
    with grpc.insecure_channel(target.address) as channel:
        call = target_pb2_grpc.TargetStub(channel).Serve(iter(requests.get, None), timeout=120)
        for event in call:
            events += 1
            steps.append(event)
            if toggle_every and events % toggle_every == 0:
                speculate = not speculate
                requests.put(policy(speculate))
            for delta in event.deltas:
                out[delta.request_id].extend(delta.token_ids)
                done += bool(delta.finish_reason)
            if done == len(prompts):
                break
        call.cancel()
    return out, steps


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer(BUILTIN_TARGET)
    return [tokenizer.encode(p) for p in PROMPTS]


@EXCHANGES
def test_toggling_speculation_every_few_steps_changes_nothing(tmp_path, prompts, flags):
    # With --early-exchange every toggle finds the request sent the step before for the
    # other policy: its trees are dropped, and the draft is asked again.
    draft = Service("draft_service", [], tmp_path).wait_serving()
    target = Service("target_service", ["--draft", draft.address, *flags],
                     tmp_path).wait_serving()
    try:
        plain, _ = serve(target, prompts, 48, speculate=False)
        toggled, steps = serve(target, prompts, 48, toggle_every=3)
    finally:
        target.stop()
        draft.stop()
    assert toggled == plain
    through_mailbox = "continues through the mailbox" in draft.log
    assert through_mailbox == ("--no-exchange-memory" not in flags)
    assert ("; the exchange through the mailbox" in target.log) == through_mailbox
    stats = [e.stats for e in steps]
    assert any(s.speculated for s in stats) and any(not s.speculated for s in stats[1:])
    if "--defer-catch-up" in flags:  # on from warmup's end: a step sent a catch-up alone
        assert "from now on a catch-up of over 1 tokens is deferred" in target.log
        assert "beside its deferred catch-up and verified trees" in target.log  # warmup's check
        assert any(s.draft_input_tokens and not s.speculated for s in stats)
    # which budget each step ran (the target's default tree: 8 nodes)
    assert all(s.tree_budget == (8 if s.speculated else 0) for s in stats)
    # What the speculation policy reads: a decode step's committed tokens are the tokens it
    # delivered (max_new_tokens cuts the last trees), and its period covers its own time.
    decode = [e for e in steps if e.stats.batch_size and not e.stats.prefill_tokens]
    assert decode
    for event in decode:
        assert event.stats.committed_tokens == sum(len(d.token_ids) for d in event.deltas)
        assert event.stats.period_s >= event.stats.total_s > 0
    # What a chain would have accepted, read off each tree's first-child path: set on steps
    # whose every sequence verified a tree, one entry per depth, never more than was committed
    # beyond the bonus tokens (a sequence that reached max_new_tokens counts what it kept).
    spec = [s for s in stats if s.batch_size and s.drafted_tokens == 8 * s.batch_size]
    assert spec and all(s.first_child_accepted for s in spec)
    for s in spec:
        counts = list(s.first_child_accepted)
        assert len(counts) <= 4 and counts == sorted(counts, reverse=True), counts
        assert counts[0] <= s.batch_size and sum(counts) <= s.committed_tokens - s.batch_size, s
    assert any(sum(s.first_child_accepted) for s in spec)
    assert not any(s.first_child_accepted for s in stats if not s.speculated)


@EXCHANGES
def test_draft_killed_mid_generation_then_restarted(tmp_path, prompts, flags):
    draft = Service("draft_service", [], tmp_path).wait_serving()
    target = Service("target_service", ["--draft", draft.address, "--draft-timeout-s", "1",
                                        *flags], tmp_path).wait_serving()
    gateway = Service("gateway", ["--target", target.address], tmp_path).wait_serving()
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway.address))

    def generate(text: str, mode: int) -> gateway_pb2.GenerateResponse:
        return stub.Generate(gateway_pb2.GenerateRequest(
            text=text, speculation=mode, include_token_ids=True,
            stopping=gateway_pb2.StoppingParams(max_new_tokens=160, ignore_eos=True)), timeout=120)

    try:
        expected = [list(generate(t, common_pb2.SPECULATION_MODE_OFF).token_ids) for t in PROMPTS]
        first = stub.GetStatus(gateway_pb2.GetStatusRequest(), timeout=10).draft
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            running = [pool.submit(generate, t, common_pb2.SPECULATION_MODE_ON) for t in PROMPTS]
            time.sleep(0.5)
            draft.proc.kill()  # no goodbye: the stream just breaks
            replies = [f.result() for f in running]
        assert [list(r.token_ids) for r in replies] == expected
        assert all(r.finish_reason == common_pb2.FINISH_REASON_LENGTH for r in replies)
        # Each request speculated before the kill and decoded plainly after it.
        assert all(r.spec.verify_steps > 0 and r.spec.plain_steps > 0 for r in replies), replies
        assert "decodes without speculation" in target.log
        assert gateway.health() == 1 and target.health() == 1  # still SERVING
        # GetStatus says why the last step went without speculation
        status = stub.GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
        assert status.last_step.draft_unavailable and not status.speculating, status.last_step
        # The draft comes back on the same port: speculation resumes, output unchanged.
        draft = Service("draft_service", [], tmp_path, port=draft.port).wait_serving()
        deadline = time.monotonic() + 15  # the target asks the draft's health every 0.5 s
        while True:
            again = generate(PROMPTS[0], common_pb2.SPECULATION_MODE_ON)
            assert list(again.token_ids) == expected[0]
            if again.spec.verify_steps > 0:
                break
            assert time.monotonic() < deadline, "speculation did not resume after the restart"
        # GetStatus, and the target's info, show the restarted draft's start-up report
        status = stub.GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
        assert status.draft.ok and status.draft.started_at_unix_s > first.started_at_unix_s
        info = target_pb2_grpc.TargetStub(grpc.insecure_channel(target.address)).GetInfo(
            target_pb2.GetTargetInfoRequest(), timeout=10)
        assert info.draft_report == status.draft
    finally:
        for service in (gateway, target, draft):
            service.stop()


@EXCHANGES
def test_slow_draft_exchanges_are_skipped_without_changing_output(tmp_path, prompts, flags):
    draft = Service("draft_service", [], tmp_path,
                    env={"SPLITSPEC_INJECT_DRAFT_FAULT": "slow"}).wait_serving()
    target = Service("target_service", ["--draft", draft.address, "--draft-timeout-s", "0.2",
                                        *flags], tmp_path).wait_serving()
    # A held reply holds the draft's stream for 0.5 s; the steps meanwhile decode without
    # asking (a request would queue behind it: EngineLimits.skip_owed), as they do while a
    # deferred catch-up (--defer-catch-up) waits. A serve of 32 tokens lasts about that long,
    # so one held reply can leave a whole serve without a tree (three in a row did, with the
    # deferral, in a fresh-clone CI run). So serves, each with plain decoding's output, until
    # one verifies a tree, for up to 20 s.
    try:
        plain, _ = serve(target, prompts, 32, speculate=False)
        deadline = time.monotonic() + 20
        while True:
            slow, steps = serve(target, prompts, 32)
            assert slow == plain
            if any(e.stats.speculated for e in steps) or time.monotonic() > deadline:
                break
    finally:
        target.stop()
        draft.stop()
    assert any(e.stats.speculated for e in steps), "no exchange came back in time"
    assert "no draft reply within 0.20s" in target.log
    assert "dropping late draft reply" in target.log


def test_a_stopped_draft_costs_one_deadline_not_one_a_step(tmp_path, prompts):
    """A draft that stops answering (SIGSTOP: its stream stays open) costs the step that
    waits for it one deadline; the steps after it neither ask nor wait while its reply is
    owed (EngineLimits.skip_owed), so a serve of 64 steps times out once, not at each step
    (before, each request queued behind the late one and waited 0.3 s). Output unchanged.
    Once the draft runs again its late reply comes in, and the next serve speculates."""
    draft = Service("draft_service", [], tmp_path).wait_serving()
    target = Service("target_service", ["--draft", draft.address, "--draft-timeout-s", "0.3"],
                     tmp_path).wait_serving()
    try:
        plain, _ = serve(target, prompts, 64, speculate=False)
        os.kill(draft.proc.pid, signal.SIGSTOP)
        try:
            stopped, steps = serve(target, prompts, 64)
        finally:
            os.kill(draft.proc.pid, signal.SIGCONT)
        timeouts = target.log.count("no draft reply within 0.30s")
        again, steps_again = serve(target, prompts, 64)
    finally:
        target.stop()
        draft.stop()
    assert stopped == plain and again == plain
    assert len(steps) >= 64 and not any(e.stats.speculated for e in steps)
    assert 1 <= timeouts <= 2, timeouts  # (a second only if the serve outlived 2 s)
    assert any(e.stats.speculated for e in steps_again)
