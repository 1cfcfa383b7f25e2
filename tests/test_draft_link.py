"""target_service.draft_client.DraftLink against a real gRPC server: replies matched to
their step, and what its log says when the stream ends."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import pytest

from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.v1 import draft_pb2, draft_pb2_grpc
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
