"""The exchange mailbox (splitspec/mailbox.py): its slots and counters, and the target's
DraftLink against the real DraftServicer through it (--exchange-memory)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import grpc
import pytest

from draft_service.drafter import SeqResult
from draft_service.servicer import DraftServicer
from splitspec import mailbox
from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.init_report import InitReport
from splitspec.mailbox import REFUSED, Mailbox, MailboxMap
from splitspec.tree import Tree
from splitspec.v1 import draft_pb2, draft_pb2_grpc
from target_service.draft_client import DraftLink
from tests.stack import serve_draft_in_process

PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30  # prctl(2)
pytestmark = pytest.mark.skipif(bool(mailbox.supported()), reason=mailbox.supported())


def test_requests_and_replies_pass_through_the_slots_in_order():
    box = Mailbox(slots=2, slot_bytes=64)
    peer = MailboxMap(box.path, slots=2, slot_bytes=64)
    try:
        assert peer.check_bytes == box.check
        never = lambda: False  # noqa: E731
        for n in range(5):  # round the two slots twice
            box.post(b"request %d" % n)
            assert peer.next_request(never) == (True, b"request %d" % n)
            assert box.waiting == 0
            peer.post(b"reply %d" % n)
            assert box.waiting == 1 and box.take() == b"reply %d" % n
        # a message that goes on the stream is marked so, both ways
        box.post(None)
        assert peer.next_request(never) == (True, None)
        peer.post(None)
        assert box.waiting == 1 and box.in_slots == 0 and not box.next_in_slot
        assert box.take() is None
        box.post(b"one more")
        assert peer.next_request(never) == (True, b"one more")
        peer.post(b"in its slot")
        assert box.waiting == 1 and box.in_slots == 1 and box.next_in_slot
        assert box.take() == b"in its slot"
        # no slot is written before its reply was read: two requests out, none read
        box.post(b"a")
        box.post(b"b")
        assert not box.room
        with pytest.raises(RuntimeError, match="2 requests are unanswered"):
            box.post(b"c")
        with pytest.raises(ValueError, match="does not fit"):
            MailboxMap(box.path, slots=2, slot_bytes=64).post(b"x" * 65)
    finally:
        peer.close()
        box.close()


def test_a_wait_ends_at_its_deadline_or_when_told_to_stop():
    box = Mailbox(slots=2, slot_bytes=64)
    peer = MailboxMap(box.path, slots=2, slot_bytes=64)
    try:
        start = time.monotonic()
        assert not mailbox.wait_for(lambda: box.waiting > 0, start + 0.05)
        assert 0.05 <= time.monotonic() - start < 0.5
        stop = threading.Event()
        threading.Timer(0.05, stop.set).start()
        assert peer.next_request(stop.is_set) == (False, None)
        # a request posted while the other side sleeps between looks is found
        threading.Timer(0.05, box.post, (b"late",)).start()
        assert peer.next_request(lambda: False) == (True, b"late")
    finally:
        peer.close()
        box.close()


def test_a_thread_that_waits_gets_a_tight_timer_slack():
    """A waiting thread's looks are not left to wake up to 50 us late (Linux's default timer
    slack): its first wait sets its slack to TIMER_SLACK_NS."""
    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)  # (prctl's arguments after the option are unsigned longs)
    slack = {}

    def wait_once() -> None:
        # (a new thread inherits its maker's slack: start from the default)
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(50_000), zero, zero, zero)
        slack["before"] = libc.prctl(PR_GET_TIMERSLACK, zero, zero, zero, zero)
        mailbox.wait_for(lambda: True)
        slack["after"] = libc.prctl(PR_GET_TIMERSLACK, zero, zero, zero, zero)

    thread = threading.Thread(target=wait_once)
    thread.start()
    thread.join()
    assert slack == {"before": 50_000, "after": mailbox.TIMER_SLACK_NS}


def test_a_segment_that_is_not_a_mailbox_of_this_shape_is_refused(tmp_path):
    box = Mailbox(slots=2, slot_bytes=64)
    try:
        with pytest.raises(ValueError, match="not a mailbox of 4 slots"):
            MailboxMap(box.path)
    finally:
        box.close()
    with pytest.raises(OSError):
        MailboxMap(str(tmp_path / "missing"))


def test_a_file_mailbox_loses_its_name_once_the_draft_has_it(tmp_path):
    box = Mailbox(str(tmp_path), slots=2, slot_bytes=64)
    assert box.named and list(tmp_path.iterdir())
    box.unlink()
    assert not list(tmp_path.iterdir())
    box.close()


class Echo:
    """A drafter whose tree for each sequence is its new tokens (so that a big request
    has a big reply), and which records each request's sequences."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def open_session(self) -> object:
        return object()

    def close_session(self, session: object) -> None:
        pass

    def draft(self, session, seqs, release_ids=()):
        self.seen += [item.seq_id for item in seqs]
        return [SeqResult(item.seq_id, Tree(item.new_tokens, list(range(len(item.new_tokens)))),
                          "") for item in seqs]


class Wrapped(draft_pb2_grpc.DraftServicer):
    """The real servicer's calls, for a subclass to change its Exchange."""

    def __init__(self, inner: DraftServicer) -> None:
        self.inner = inner
        self.AttachFeatureMemory = inner.AttachFeatureMemory
        self.GetInfo, self.GetInitReport = inner.GetInfo, inner.GetInitReport


class Refusing(Wrapped):
    """Answers AttachFeatureMemory as the real draft does, and names a mailbox that cannot
    be opened to its Exchange (as a draft would see one it may not write)."""

    def Exchange(self, request_iterator, context):
        def renamed():
            for request in request_iterator:
                if request.mailbox:
                    request.mailbox = "/nonexistent/splitspec-mailbox"
                yield request
        return self.inner.Exchange(renamed(), context)


@pytest.fixture
def draft():
    drafter = Echo()
    servicer = DraftServicer(drafter, draft_pb2.DraftInfo(kind="echo"), InitReport("draft"))
    servers, links = [], []

    def start(wrapper=None) -> DraftLink:
        server, address = serve_draft_in_process(wrapper(servicer) if wrapper else servicer)
        servers.append(server)
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        link = DraftLink(address, channel, servicer.info, timeout_s=5.0, exchange_memory=True)
        links.append(link)
        return link

    yield drafter, start
    for link in links:
        link.close()
    for server in servers:
        server.stop(None)


def request(step: int, tokens: int = 3) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(step=step, seqs=[draft_pb2.SeqDraftInput(
        seq_id=step, new_tokens=[7] * tokens)])


def test_the_exchange_goes_through_the_mailbox_after_a_streams_first_request(draft, caplog):
    """Every reply is its request's; the first travels on the stream, the rest through the
    mailbox, except a message too big for a slot (1 MiB), which the slot marks and the
    stream carries: here a request of 400,000 tokens and its echo."""
    drafter, start = draft
    caplog.set_level(logging.INFO)
    link = start()
    assert link.mailbox.startswith("/proc/")
    for step, tokens in ((1, 3), (2, 3), (3, 400_000), (4, 3), (5, 3)):
        result = link.exchange(request(step, tokens))
        assert result.error == "" and result.reply.step == step
        assert list(result.reply.trees[0].tokens) == [7] * tokens
    assert drafter.seen == [1, 2, 3, 4, 5]
    box = link._box
    assert (box.posted, box.read) == (4, 4)  # steps 2-5 (step 3 marked: on the stream)
    assert f"continues through the mailbox {link.mailbox}" in caplog.text
    # ready() sees a reply in the mailbox
    sent = link.send(request(6))
    deadline = time.monotonic() + 5
    while not link.ready(sent):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert link._box.waiting == 1 and link.receive(sent).reply.step == 6


class SlowStream(Wrapped):
    """Sends every reply the stream carries after the first (those the mailbox marks as
    too big for a slot) 1 s late, as a big message can take its time on the stream."""

    def Exchange(self, request_iterator, context):
        for n, reply in enumerate(self.inner.Exchange(request_iterator, context)):
            if n:
                time.sleep(1.0)
            yield reply


def test_a_reply_marked_in_the_mailbox_is_in_once_the_stream_brought_it(draft):
    """ready() does not count a reply the mailbox marks as coming on the stream until the
    stream has brought it (receive would wait for it), nor does owes(), which counts the
    mailbox's replies by in_slots."""
    _, start = draft
    link = start(SlowStream)
    assert link.exchange(request(1)).reply is not None  # the stream's first
    sent = link.send(request(2, 400_000))  # its echo does not fit a slot
    deadline = time.monotonic() + 5
    while link._box.waiting == 0:  # marked in its slot, on its way on the stream
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not link.ready(sent) and link._box.in_slots == 0
    result = link.receive(sent)
    assert result.reply is not None and result.reply.step == 2
    assert link.exchange(request(3)).reply.step == 3  # then the mailbox again


def test_a_late_reply_in_the_mailbox_is_owed_then_dropped(draft, monkeypatch):
    """A reply that comes after its deadline is owed (owes) until it is in the mailbox,
    and the next exchange drops it and gets its own, as on the stream."""
    drafter, start = draft
    link = start()
    assert link.exchange(request(1)).reply is not None  # the stream's first
    hold = threading.Event()
    draft_once = drafter.draft

    def slow(session, seqs, release_ids=()):
        if seqs[0].seq_id == 2:
            hold.wait(10)
        return draft_once(session, seqs, release_ids)

    monkeypatch.setattr(drafter, "draft", slow)
    link.timeout_s = 0.2
    assert "no draft reply within 0.20s" in link.exchange(request(2)).error
    assert link.owes()
    hold.set()
    deadline = time.monotonic() + 5
    while link.owes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    result = link.exchange(request(3))
    assert result.reply is not None and result.reply.step == 3


def test_a_draft_that_cannot_use_the_mailbox_gets_the_exchange_on_the_stream(draft, caplog):
    """The draft fails the stream that named a mailbox it cannot open (FAILED_PRECONDITION):
    the target makes no more mailboxes, and its next stream carries the exchange."""
    drafter, start = draft
    caplog.set_level(logging.INFO)
    link = start(Refusing)
    failed = link.exchange(request(1))
    assert failed.reply is None and REFUSED in failed.error
    assert not link.exchange_memory
    assert "draft exchange on the stream from now on" in caplog.text
    deadline = time.monotonic() + 10  # the reconnect thread asks every 0.5 s
    while (result := link.exchange(request(2))).reply is None:
        assert time.monotonic() < deadline, result.error
        time.sleep(0.1)
    assert link.mailbox == "" and link.exchange(request(3)).reply.step == 3


def test_no_mailbox_where_the_draft_cannot_open_it(draft, caplog):
    """AttachFeatureMemory says the draft cannot open the segment (another host): the
    stream carries everything."""
    class NoAttach(draft_pb2_grpc.DraftServicer):
        def __init__(self, inner):
            self.Exchange = inner.Exchange

        def AttachFeatureMemory(self, request, context):
            return draft_pb2.AttachFeatureMemoryReply(error="cannot open it here")

    _, start = draft
    caplog.set_level(logging.INFO)
    link = start(NoAttach)
    assert link.mailbox == ""
    assert "not through a mailbox: cannot open it here" in caplog.text
    assert link.exchange(request(1)).reply.step == 1
    assert link.exchange(request(2)).reply.step == 2


def test_a_host_that_cannot_use_a_mailbox_keeps_the_exchange_on_the_stream(draft, caplog,
                                                                        monkeypatch):
    """Not x86-64 (the mailbox relies on its store order): the link says why once, makes no
    mailbox, and every exchange travels on the stream."""
    _, start = draft
    monkeypatch.setattr(mailbox.platform, "machine", lambda: "aarch64")
    caplog.set_level(logging.INFO)
    link = start()
    assert link.mailbox == "" and not link.exchange_memory
    assert "relies on x86-64's store order; this host is aarch64" in caplog.text
    assert [link.exchange(request(step)).reply.step for step in (1, 2, 3)] == [1, 2, 3]
