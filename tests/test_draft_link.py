"""target_service.draft_client.DraftLink against a real gRPC server: replies matched to
their step, and what its log says when the stream ends."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from target_service import draft_client
from target_service.draft_client import DraftLink


class Echo(draft_pb2_grpc.DraftServicer):
    """Answers each request with an empty reply of its step."""

    def Exchange(self, request_iterator, context):
        for request in request_iterator:
            yield draft_pb2.DraftReply(step=request.step)


@pytest.fixture
def link():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=CHANNEL_OPTIONS)
    draft_pb2_grpc.add_DraftServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    link = DraftLink(f"127.0.0.1:{port}", channel, draft_pb2.DraftInfo(), timeout_s=5.0)
    yield link, server
    link.close()
    server.stop(None)


def readers_done() -> None:
    for thread in threading.enumerate():
        if thread.name == "draft-reader":
            thread.join(5)


def test_closing_the_link_is_not_reported_as_a_failure(link, caplog):
    link, _ = link
    caplog.set_level(logging.INFO, logger="target_service.draft_client")
    result = link.exchange(draft_pb2.DraftRequest(step=3))
    assert result.reply is not None and result.reply.step == 3 and not result.stream_restarted
    link.close()
    readers_done()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "draft stream closed here: CANCELLED" in caplog.messages


def test_a_draft_that_goes_away_is_reported(link, caplog):
    link, server = link
    assert link.exchange(draft_pb2.DraftRequest(step=1)).reply is not None
    server.stop(None)
    result = link.exchange(draft_pb2.DraftRequest(step=2))
    assert result.reply is None and "draft stream failed" in result.error
    readers_done()
    assert any(r.levelno == logging.WARNING and "draft stream ended" in r.getMessage()
               for r in caplog.records)


def test_waiting_for_a_peer_says_what_it_sees_meanwhile(caplog):
    """wait_for_serving (connect_draft's and connect_target's wait, up to 120 s by default)
    logs its progress and what the address answered, then times out saying so."""
    from splitspec.grpc_server import wait_for_serving
    from tests.stack import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.INFO, logger="splitspec.grpc_server"), \
            pytest.raises(TimeoutError) as info:
        wait_for_serving(address, 0.8, "draft service", report_every_s=0.2)
    assert f"draft service at {address} was not SERVING within 1s (last: UNAVAILABLE" in str(info.value)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(waits) >= 2, caplog.text
    assert all(f"the draft service at {address} to be SERVING" in w and "UNAVAILABLE" in w
               for w in waits[1:]), waits


class Holding(draft_pb2_grpc.DraftServicer):
    """Echo that holds its reply to step 1 until ``release`` is set (a slow draft)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Exchange(self, request_iterator, context):
        for request in request_iterator:
            if request.step == 1:
                self.release.wait(10)
            yield draft_pb2.DraftReply(step=request.step)


def test_a_reply_whose_wait_timed_out_is_owed_until_it_comes(monkeypatch):
    """owes(): after a wait that timed out, the draft still owes that reply (a request sent
    now would queue behind it) for RETRY_AFTER_S from the timeout, however long the deadline
    was (the default deadline is as long as RETRY_AFTER_S); then a step may ask again, and
    after a second timeout with no reply in between, twice as long. Once the reply is in,
    nothing is owed, and the next exchange drops it and gets its own."""
    monkeypatch.setattr(draft_client, "RETRY_AFTER_S", 0.3)  # shorter than the deadline
    holding = Holding()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=CHANNEL_OPTIONS)
    draft_pb2_grpc.add_DraftServicer_to_server(holding, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    link = DraftLink(f"127.0.0.1:{port}", channel, draft_pb2.DraftInfo(), timeout_s=0.4)
    try:
        assert not link.owes()
        assert "no draft reply within 0.40s" in link.exchange(draft_pb2.DraftRequest(step=1)).error
        assert link.owes()
        time.sleep(0.45)
        assert not link.owes()  # asked again once RETRY_AFTER_S has passed
        assert link.exchange(draft_pb2.DraftRequest(step=2)).reply is None  # behind step 1's
        assert link.owes() and link.owed_for == pytest.approx(0.6)
        time.sleep(0.35)
        assert link.owes()  # (past RETRY_AFTER_S, not past twice it)
        holding.release.set()
        deadline = time.monotonic() + 5
        while link.owes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        result = link.exchange(draft_pb2.DraftRequest(step=3))
        assert result.reply is not None and result.reply.step == 3
        assert not link.owes() and link.owed_for == pytest.approx(0.3)
    finally:
        link.close()
        server.stop(None)


BREAK = 999


class Restarting(draft_pb2_grpc.DraftServicer):
    """A draft whose stream breaks on a request of step BREAK (as when its process
    dies); its health, DraftInfo, start-up report and AttachFeatureMemory are the test's
    to set, and
    AttachFeatureMemory waits for ``release`` (a slow attach: a page-locked segment, a
    draft that answers slowly)."""

    def __init__(self) -> None:
        self.info = draft_pb2.DraftInfo(kind="eagle3", model_name="head", needs_hidden_states=True)
        self.report = common_pb2.InitReport(service="draft", ok=True, started_at_unix_s=1.0)
        self.release = threading.Event()
        self.release.set()
        self.attaching = threading.Event()
        self.attached = 0

    def Exchange(self, request_iterator, context):
        for request in request_iterator:
            if request.step == BREAK:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the draft went away")
            yield draft_pb2.DraftReply(step=request.step)

    def GetInfo(self, request, context):
        return self.info

    def GetInitReport(self, request, context):
        return self.report

    def AttachFeatureMemory(self, request, context):
        self.attaching.set()
        self.release.wait(10)
        self.attached += 1
        return draft_pb2.AttachFeatureMemoryReply()


@pytest.fixture
def restarting(monkeypatch):
    monkeypatch.setattr(draft_client, "RECONNECT_EVERY_S", 0.05)
    draft = Restarting()
    health = HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    draft_pb2_grpc.add_DraftServicer_to_server(draft, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    link = DraftLink(f"127.0.0.1:{port}", channel, draft.info, timeout_s=5.0,
                     feature_memory_bytes=1 << 20)
    yield link, draft, health
    draft.release.set()
    link.close()
    server.stop(None)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_broken_stream_is_reopened_in_the_background(restarting, caplog):
    """After a break the link is down: a send returns at once, saying so, and the engine
    asks nothing of it (DraftLink.down). A thread waits for the draft to answer SERVING,
    then makes and attaches the next stream's feature memory, however long that takes,
    without holding up a send; the next send opens the stream on it, and says the draft
    lost its sequences (stream_restarted). The link keeps the restarted draft's start-up
    report (the target's GetInfo and its gateway streams show it)."""
    link, draft, health = restarting
    caplog.set_level(logging.INFO, logger="target_service.draft_client")
    assert link.exchange(draft_pb2.DraftRequest(step=1)).reply is not None
    assert link.feature_memory and not link.down and draft.attached == 1
    assert link.report is None  # (connect_draft asks for it: init_report)
    assert link.init_report() == link.report == draft.report
    health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # restarting: still loading
    draft.report = common_pb2.InitReport(service="draft", ok=True, started_at_unix_s=2.0)
    draft.release.clear()
    draft.attaching.clear()
    broken = link.exchange(draft_pb2.DraftRequest(step=BREAK))
    assert broken.reply is None and "draft stream failed" in broken.error
    assert broken.stream_restarted and link.down and link.feature_memory == ""
    wait_until(lambda: any("not ready for a new stream" in m for m in caplog.messages),
               "the reconnect thread did not ask the draft")
    time.sleep(0.3)  # six more of the thread's polls
    assert link.down and not draft.attaching.is_set()  # not SERVING: nothing attached
    waiting = [m for m in caplog.messages if "not ready for a new stream" in m]
    assert len(waiting) == 1 and "(health NOT_SERVING)" in waiting[0], caplog.messages
    sent = link.send(draft_pb2.DraftRequest(step=2))
    assert sent.error == "draft stream down, reconnecting" and not sent.restarted
    assert link.receive(sent).reply is None

    health.set("", health_pb2.HealthCheckResponse.SERVING)
    assert draft.attaching.wait(10)  # the thread now waits in AttachFeatureMemory ...
    sent = link.send(draft_pb2.DraftRequest(step=3))  # ... and a send does not wait with it
    assert sent.error and link.down and not draft.release.is_set() and draft.attached == 1
    draft.release.set()
    wait_until(lambda: not link.down, "the link did not reconnect")
    result = link.exchange(draft_pb2.DraftRequest(step=4))
    assert result.reply is not None and result.reply.step == 4 and result.stream_restarted
    assert draft.attached == 2 and link.feature_memory  # a new segment (the old one closed)
    assert link.report.started_at_unix_s == 2.0  # the restarted draft's
    assert link.exchange(draft_pb2.DraftRequest(step=5)).stream_restarted is False
    assert any("SERVING again" in m for m in caplog.messages)


def test_a_draft_that_comes_back_as_another_is_not_reconnected(restarting, caplog):
    """A draft restarted with another model (its DraftInfo differs from the one this target
    started with, which set up its capture and checks) gets no new stream until the one the
    target knows is back."""
    link, draft, _ = restarting
    caplog.set_level(logging.INFO, logger="target_service.draft_client")
    draft.info = draft_pb2.DraftInfo(kind="standalone", model_name="small")  # once it restarts
    assert link.exchange(draft_pb2.DraftRequest(step=BREAK)).reply is None
    wait_until(lambda: any("it is now standalone 'small', not the eagle3 'head' this target "
                           "started with" in m for m in caplog.messages), "no reason logged")
    time.sleep(0.3)  # six more of the thread's polls
    assert link.down and draft.attached == 1
    draft.info = link.info
    wait_until(lambda: not link.down, "the link did not reconnect to the draft it knows")
    assert link.exchange(draft_pb2.DraftRequest(step=2)).reply is not None
