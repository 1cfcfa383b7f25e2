"""The target's end of the long-lived draft stream: one request and one reply per step
(with the target's --early-exchange, the request is sent during the step before). An
EAGLE-3 draft's features go into shared memory when the draft can read it
(:mod:`splitspec.feature_memory`), else on the stream; with ``exchange_memory`` the
requests after a stream's first and their replies go through a mailbox in shared memory
(:mod:`splitspec.mailbox`) when the draft can map it. A stream that breaks is reopened in
the background, once the draft answers SERVING again."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.feature_memory import FeatureRing
from splitspec.grpc_server import wait_for_serving
from splitspec.mailbox import REFUSED, Mailbox, wait_for
from splitspec.mailbox import supported as mailbox_supported
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

_END = object()
RETRY_AFTER_S = 2.0
RECONNECT_EVERY_S = 0.5  # how often a broken stream's background reconnect asks the draft
OWED_MAX_S = 30.0  # the longest a draft that stays silent goes unasked (DraftLink.owes)


class ExchangeResult(NamedTuple):
    reply: draft_pb2.DraftReply | None  # None when the draft could not answer in time
    error: str                          # why not ("" with a reply)
    stream_restarted: bool              # the draft lost all sequence state since the last call


class Sent(NamedTuple):
    """A request on its way (:meth:`DraftLink.send`): what :meth:`DraftLink.receive` needs."""

    step: int
    deadline: float        # time.monotonic() by which its reply must be in
    error: str             # why it was not sent ("" when it was)
    restarted: bool        # the stream was reopened to send it


class Features(NamedTuple):
    """A request's EAGLE-3 features (:meth:`DraftLink.send`): ``rows`` [n, bytes a row] of
    ``width`` ``dtype`` values a row, the first ``counts[0]`` for its first sequence, and so
    on; ``offset``: where they already lie in the stream's feature memory, written there
    through :meth:`DraftLink.feature_slot` (None: anywhere else)."""

    rows: np.ndarray
    counts: list[int]
    width: int
    dtype: str
    offset: int | None = None


class _Opening(NamedTuple):
    """What a stream about to open needs, made off the engine thread: its feature memory
    (None: the features travel on the stream), whether requests may be written into it
    directly (:meth:`DraftLink.feature_slot`), and its mailbox (None: every request and
    reply travel on the stream)."""

    ring: FeatureRing | None
    direct: bool
    box: Mailbox | None = None

    def close(self) -> None:
        """Let an opening no stream will use go."""
        if self.ring is not None:
            self.ring.close()
        if self.box is not None:
            self.box.close()


class FeatureSlot(NamedTuple):
    """Room for a request's features in the stream's feature memory: ``rows``, the
    ``array`` view to write them into, at ``offset``."""

    offset: int
    rows: np.ndarray


def place_features(request: draft_pb2.DraftRequest, features: Features,
                   ring: FeatureRing | None, key: int) -> None:
    """Give each of ``request.seqs`` its features: where they already lie in ``ring``, else
    in it (held for the request ``key``, :meth:`FeatureRing.put`) when it has room, else in
    the request itself."""
    if features.offset is not None:
        if ring is None:
            raise RuntimeError("features written into a feature memory the stream no longer has")
        offset = features.offset
    else:
        offset = ring.put(features.rows, key) if ring is not None else None
    row_bytes = features.rows.shape[1]
    at = 0
    for item, count in zip(request.seqs, features.counts, strict=True):
        item.hidden_dim, item.dtype = features.width, features.dtype
        if offset is None:
            item.hidden_states = features.rows[at:at + count].tobytes()
        else:
            item.hidden_states_at.offset = offset + at * row_bytes
            item.hidden_states_at.length = count * row_bytes
        at += count
    if offset is not None:
        request.feature_memory = ring.path


class DraftLink:
    """Owns the Exchange stream; reopens it (after a pause) when it breaks.

    A reply is matched to its request by ``step``; a late reply to a request
    that already timed out is dropped. With ``feature_memory_bytes`` and a draft
    that needs features, each stream it opens gets a segment of that size
    (:class:`FeatureRing`; a file in ``feature_memory_dir`` when given) if the draft can
    read it. With ``exchange_memory``, each stream also gets a mailbox (:mod:`splitspec.mailbox`)
    if the draft can map it: the stream's first request names it, and every later request
    and its reply go through it.

    The link's methods run on the engine thread, one at a time, and none of them waits for
    the draft beyond a reply's deadline. A stream that breaks is reopened in the background
    (:meth:`_reconnect`): a thread asks the draft's health every RECONNECT_EVERY_S and,
    once it answers SERVING with the same DraftInfo, makes the new stream's feature memory
    and attaches it (a call to the draft, and on a GPU target the page-locking of the
    segment: 256 MiB by default); the next :meth:`send` opens the stream on it. Until then
    the link is :attr:`down` and the engine asks nothing of it.
    """

    def __init__(self, address: str, channel: grpc.Channel, info: draft_pb2.DraftInfo,
                 timeout_s: float, feature_memory_bytes: int = 0,
                 pin_features: bool = False, feature_memory_dir: str = "",
                 exchange_memory: bool = False) -> None:
        self.address = address
        self.info = info
        self.timeout_s = timeout_s
        self.feature_memory_bytes = feature_memory_bytes
        self.feature_memory_dir = feature_memory_dir  # (a mailbox's too)
        self.exchange_memory = exchange_memory  # a mailbox for each stream, if it can
        self.pin_features = pin_features  # a CUDA target: the segment page-locked
        self._direct = False  # whether feature_slot offers room in the segment
        self._stub = draft_pb2_grpc.DraftStub(channel)
        self._channel = channel
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._call: grpc.Future | None = None
        self._ring: FeatureRing | None = None
        self._box: Mailbox | None = None
        self._sent = self._answered = 0  # requests sent and replies read on this stream
        self._late_at = 0.0  # when a wait for a reply last timed out (time.monotonic())
        self._silent = 0  # waits timed out since the draft last answered anything
        self._lock = threading.Lock()  # guards _opening, which the reconnect thread sets
        self._opening: _Opening | None = None  # made by _reconnect for the next send to open
        self._reconnecting: threading.Thread | None = None
        self._broken = threading.Event()  # set by a break, until _reconnect has an opening
        self._closed = threading.Event()
        # The draft's start-up report (init_report): after a break, the one it gives when it
        # can take a stream again (a restarted draft's own), set before that stream opens.
        self.report: common_pb2.InitReport | None = None
        self._open(self._prepare())

    @classmethod
    def connect(cls, address: str, timeout_s: float, exchange_timeout_s: float,
                feature_memory_bytes: int = 0, pin_features: bool = False,
                feature_memory_dir: str = "", exchange_memory: bool = False) -> DraftLink:
        channel = wait_for_serving(address, timeout_s, "draft service")
        info = draft_pb2_grpc.DraftStub(channel).GetInfo(draft_pb2.GetDraftInfoRequest(), timeout=10)
        return cls(address, channel, info, exchange_timeout_s, feature_memory_bytes,
                   pin_features, feature_memory_dir, exchange_memory)

    @property
    def feature_memory(self) -> str:
        """Where this stream's features go: the segment's path, or "" (on the stream)."""
        return self._ring.path if self._ring is not None else ""

    @property
    def mailbox(self) -> str:
        """This stream's mailbox's path, or "" (the exchange travels on the stream)."""
        return self._box.path if self._box is not None else ""

    def init_report(self) -> common_pb2.InitReport:
        """The draft's start-up report, asked for now (and kept as :attr:`report`)."""
        self.report = self._stub.GetInitReport(common_pb2.GetInitReportRequest(), timeout=10)
        return self.report

    def feature_slot(self, size: int) -> FeatureSlot | None:
        """Room for the next request's ``size`` bytes of features in the stream's feature
        memory, held for it, to be written there straight from the target's cache (its
        ``Features`` then carry the offset); None when they are to go another way (no
        memory, no room, a stream :meth:`send` would reopen, or a GPU target whose segment
        could not be page-locked)."""
        ring = self._ring
        if ring is None or self._call is None or not self._direct:
            return None  # (a stream send reopens gets a new segment)
        start = ring.reserve(size, self._sent)
        return None if start is None else FeatureSlot(start, ring.array[start:start + size])

    def _open(self, opening: _Opening) -> None:
        """Open a stream on ``opening``'s feature memory (fast: nothing here waits for the
        draft)."""
        self._close_memory()
        self._ring, self._direct, self._box = opening
        self._sent = self._answered = 0
        self._requests = queue.Queue()
        self._replies = queue.Queue()
        requests = self._requests
        self._call = self._stub.Exchange(iter(requests.get, _END))
        threading.Thread(target=self._read, args=(self._call, self._replies), daemon=True,
                         name="draft-reader").start()

    def _prepare(self) -> _Opening:
        """What the next stream needs: its feature memory, when the draft needs features and
        one was asked for (at start-up, on the caller's thread; later, on the reconnect
        thread)."""
        opening = _Opening(None, False)
        if self.info.needs_hidden_states and self.feature_memory_bytes > 0:
            opening = self._attach_ring()
        if self.exchange_memory:
            opening = opening._replace(box=self._attach_mailbox())
        return opening

    def _attach_ring(self) -> _Opening:
        """A new segment for the stream about to open, or none when the draft cannot read it
        (the features then travel on the stream; the log says why)."""
        if not self.feature_memory_dir and not hasattr(os, "memfd_create"):  # not Linux
            log.info("draft features travel on the stream: no memfd_create on this system")
            return _Opening(None, False)
        try:
            ring = FeatureRing(self.feature_memory_bytes, self.feature_memory_dir)
        except OSError as exc:  # out of memory or file descriptors: the stream still works
            log.warning("draft features travel on the stream, not through shared memory: "
                        "%d bytes of it could not be made: %s", self.feature_memory_bytes, exc)
            return _Opening(None, False)
        if error := self._attach(ring.path, ring.check):
            ring.close()
            log.warning("draft features travel on the stream, not through shared memory: %s",
                        error)
            return _Opening(None, False)
        direct = True
        if self.pin_features and (error := ring.pin()):
            log.warning("draft features staged before they go into shared memory: %s", error)
            direct = False
        log.info("draft features through shared memory %s (%.0f MiB%s)", ring.path,
                 ring.size / 2**20, ", page-locked" if ring.pinned else "")
        return _Opening(ring, direct)

    def _attach(self, path: str, check: bytes) -> str:
        """Whether the draft can open the segment at ``path`` (AttachFeatureMemory): "", or
        why not."""
        request = draft_pb2.AttachFeatureMemoryRequest(path=path, check=check)
        try:
            return self._stub.AttachFeatureMemory(request, timeout=self.timeout_s).error
        except grpc.RpcError as exc:  # a draft without the call, or not answering now
            return f"AttachFeatureMemory failed: {exc.code().name} {exc.details()}"

    def _attach_mailbox(self) -> Mailbox | None:
        """A mailbox for the stream about to open, or none when this host or the draft
        cannot use one (the exchange then travels on the stream; the log says why)."""
        if problem := mailbox_supported():
            log.info("draft exchange on the stream, not through a mailbox: %s", problem)
            self.exchange_memory = False
            return None
        try:
            box = Mailbox(self.feature_memory_dir)
        except OSError as exc:  # out of memory or file descriptors: the stream still works
            log.warning("draft exchange on the stream: its mailbox could not be made: %s", exc)
            return None
        if error := self._attach(box.path, box.check):
            box.close()
            log.warning("draft exchange on the stream, not through a mailbox: %s", error)
            return None
        log.info("draft exchange through the mailbox %s after each stream's first request",
                 box.path)
        return box

    def _draft_problem(self) -> str:
        """Why the draft cannot take a new stream now ("" when it can): not SERVING, or not
        answering, or (restarted) another draft than the one this target started with. When
        it can, its start-up report is kept as :attr:`report`."""
        try:
            status = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                return f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            info = self._stub.GetInfo(draft_pb2.GetDraftInfoRequest(), timeout=self.timeout_s)
            if info != self.info:  # (its report is not asked for: no stream will open)
                return (f"it is now {info.kind} {info.model_name!r}, not the {self.info.kind} "
                        f"{self.info.model_name!r} this target started with")
            report = self._stub.GetInitReport(common_pb2.GetInitReportRequest(),
                                              timeout=self.timeout_s)
        except grpc.RpcError as exc:  # down, or still starting: asked again later
            return f"{exc.code().name} {exc.details()}"
        self.report = report
        return ""

    def _reconnect(self) -> None:
        """The reconnect thread (started at the first break): after each break, every
        RECONNECT_EVERY_S until the draft can take a stream again, then the new stream's
        feature memory, for the next send to open it on."""
        while True:
            self._broken.wait()
            said = ""
            while not self._closed.wait(RECONNECT_EVERY_S):
                problem = self._draft_problem()
                if problem:
                    if problem != said:
                        log.info("draft at %s not ready for a new stream (%s): asking again "
                                 "every %g s", self.address, problem, RECONNECT_EVERY_S)
                        said = problem
                    continue
                opening = self._prepare()
                with self._lock:
                    if not self._closed.is_set():
                        # cleared first: a break after the stream opens on it sets it again
                        self._broken.clear()
                        self._opening, opening = opening, None
                if opening is None:
                    log.info("draft at %s SERVING again: its stream reopens at the next step",
                             self.address)
                    break
                opening.close()  # the link closed meanwhile
            if self._closed.is_set():
                return

    @property
    def down(self) -> bool:
        """Whether the stream is broken and not yet ready to reopen: a request now would only
        be dropped (the engine does not build one)."""
        return self._call is None and self._opening is None

    def _close_memory(self) -> None:
        """Let the stream's feature memory and mailbox go."""
        _Opening(self._ring, False, self._box).close()
        self._ring, self._direct, self._box = None, False, None

    def _read(self, call: Iterator, replies: queue.Queue) -> None:
        try:
            for reply in call:
                replies.put(reply)
        except grpc.RpcError as exc:  # the stream ended: the exchange that waits reports it
            if call is self._call:
                log.warning("draft stream ended: %s %s", exc.code().name, exc.details())
            else:  # this side closed or replaced it (close, _break): nothing went wrong
                log.info("draft stream closed here: %s", exc.code().name)
            replies.put(exc)
            return
        replies.put(grpc.RpcError("draft stream closed by the draft"))

    def exchange(self, request: draft_pb2.DraftRequest) -> ExchangeResult:
        """Send ``request`` and wait for its reply (at most the link's timeout)."""
        return self.receive(self.send(request))

    def send(self, request: draft_pb2.DraftRequest, features: Features | None = None) -> Sent:
        """Queue ``request`` on the stream (reopened first when it broke and its pause is
        over) without waiting: its reply is :meth:`receive`'s, due within the timeout.
        ``features`` go into the stream's feature memory when it has room, else into the
        request."""
        restarted = False
        if self._call is None:
            with self._lock:
                opening, self._opening = self._opening, None
            if opening is None:
                return Sent(request.step, 0.0, "draft stream down, reconnecting", False)
            self._open(opening)
            restarted = True
        box = self._box
        if box is not None and self._sent and not box.room:  # (the draft is far behind)
            return Sent(request.step, 0.0, f"{box.posted - box.read} draft requests are "
                        f"unanswered in the mailbox", restarted)
        if features is not None:
            if restarted and features.offset is not None:
                raise RuntimeError("features were written into the feature memory of a stream "
                                   "that send reopened (feature_slot offers none then)")
            place_features(request, features, self._ring, self._sent)
        if box is None:
            self._requests.put(request)
        elif not self._sent:  # the stream's first request names its mailbox
            request.mailbox = box.path
            self._requests.put(request)
        else:
            raw = request.SerializeToString()
            fits = box.fits(len(raw))
            box.post(raw if fits else None)
            if not fits:
                self._requests.put(request)
        self._sent += 1
        return Sent(request.step, time.monotonic() + self.timeout_s, "", restarted)

    def ready(self, sent: Sent) -> bool:
        """Whether :meth:`receive` would take ``sent``'s reply without waiting: a reply (or
        the stream's end) is in, or its deadline has passed, or it was never sent. (A late
        reply to an earlier request also counts: receive then drops it and waits, within the
        deadline, for this one's.) A reply the mailbox marks as coming on the stream is in
        once the stream has brought it."""
        return (bool(sent.error) or not self._replies.empty()
                or (self._box is not None and self._box.next_in_slot)
                or time.monotonic() >= sent.deadline)

    def owes(self) -> bool:
        """Whether the draft has yet to answer a request on this stream whose wait timed out,
        the timeout less than :meth:`owed_for` ago. A new request would queue behind the
        late one (the draft answers in order) and most likely wait out its own deadline too:
        with the draft service's "slow" fault, a reply held 0.5 s against a 0.2 s deadline
        cost the step after a second wait of 0.2 s, and a draft stalled for 10 s would cost
        every step the whole deadline (2 s by default). The late reply's arrival ends it at
        once; until then a step asks again only after owed_for."""
        return (self._silent > 0 and self._call is not None
                and self._answered + self._replies.qsize()
                + (self._box.in_slots if self._box is not None else 0) < self._sent
                and time.monotonic() - self._late_at < self.owed_for)

    @property
    def owed_for(self) -> float:
        """Seconds from a timeout to the next request while the draft stays silent:
        RETRY_AFTER_S after the first, doubling with each timeout after it (a draft stopped
        for good then costs a deadline after 2, 4, 8, 16 s, then every OWED_MAX_S), until
        any reply comes."""
        return min(RETRY_AFTER_S * 2 ** max(self._silent - 1, 0), OWED_MAX_S)

    def receive(self, sent: Sent) -> ExchangeResult:
        """The reply to ``sent``, or why there is none by its deadline; replies to earlier
        requests still on the stream are dropped."""
        if sent.error:
            return ExchangeResult(None, sent.error, sent.restarted)
        while True:
            item = self._next_reply(sent.deadline)
            if item is None:
                self._late_at = time.monotonic()
                self._silent += 1
                return ExchangeResult(None, f"no draft reply within {self.timeout_s:.2f}s",
                                      sent.restarted)
            if isinstance(item, Exception):
                if self._box is not None and _refused(item):
                    log.warning("draft exchange on the stream from now on: %s", item.details())
                    self.exchange_memory = False
                self._break()
                return ExchangeResult(None, f"draft stream failed: {item}", True)
            self._answered += 1
            if self._box is not None and self._box.named:  # the draft has opened it
                self._box.unlink()
            self._silent = 0
            if self._ring is not None:  # the draft has read the features of every request so far
                self._ring.replied(self._answered - 1)
            if item.step == sent.step:
                return ExchangeResult(item, "", sent.restarted)
            log.info("dropping late draft reply for step %d", item.step)

    def _next_reply(self, deadline: float) -> draft_pb2.DraftReply | Exception | None:
        """The stream's next reply (or the exception that ended the stream), or None when
        none came by ``deadline``: on the stream, or after the first one of a stream with a
        mailbox, through it (where the mailbox says so, on the stream after all)."""
        box, replies = self._box, self._replies
        if box is not None and self._answered:
            if not wait_for(lambda: box.waiting > 0 or not replies.empty(), deadline):
                return None
            if box.waiting > 0:
                raw = box.take()
                if raw is not None:
                    return draft_pb2.DraftReply.FromString(raw)
            else:  # the stream ended (it carries no reply the mailbox has not announced)
                return replies.get_nowait()
        try:
            return replies.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return None

    def _break(self) -> None:
        call, self._call = self._call, None  # first: the reader then knows it was this side
        if call is not None:
            call.cancel()
        self._requests.put(_END)
        self._close_memory()
        self._broken.set()
        if self._reconnecting is None:
            self._reconnecting = threading.Thread(target=self._reconnect, daemon=True,
                                                  name="draft-reconnect")
            self._reconnecting.start()

    def close(self) -> None:
        self._closed.set()
        self._broken.set()  # wakes the reconnect thread, to end
        if self._reconnecting is not None:
            self._reconnecting.join()
        with self._lock:
            opening, self._opening = self._opening, None
        if opening is not None:
            opening.close()
        call, self._call = self._call, None
        if call is not None:
            self._requests.put(_END)
            call.cancel()
        self._close_memory()
        self._channel.close()


def _refused(error: Exception) -> bool:
    """Whether a stream ended because the draft could not use the mailbox it named."""
    return (isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.FAILED_PRECONDITION
            and (error.details() or "").startswith(REFUSED))
