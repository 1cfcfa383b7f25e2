"""The draft exchange's messages and wake-ups through shared memory, for a draft on the
target's host (the target's ``--exchange-memory``).

On the Exchange stream a request and its reply each pass several of gRPC's threads, and at
batch 1 each side sits idle while the other works, so every hop wakes a sleeping thread on
an idle core: 1.46-1.48 ms of transit a step on an H100 host, where the same messages
through shared memory, each side polling for them, took 0.13-0.17 ms; in the stack at batch
1 the step became 0.5-0.8 ms shorter (docs/benchmarks.md, forty-third part). Here the
target and the draft poll a mailbox instead: a segment the target makes for each stream
(an anonymous memfd, or a file in a directory both see, as
:mod:`splitspec.feature_memory`'s), which the draft maps read-write.

The stream stays: it carries the stream's first request, which names the mailbox
(``DraftRequest.mailbox``), and its reply; every later request of the stream and its reply
go through the mailbox, in order, unless one is too big for a slot: then the slot says so
(ON_STREAM) and the message itself follows on the stream. The stream also still says when
either side goes away (a cancelled or broken call ends the draft's wait for the next
request, and the target's wait for a reply).

Layout: CHECK_BYTES check bytes, then at COUNTERS three counters, each written by one side
only: the requests the target posted, the requests the draft took, the replies the draft
posted; then ``slots`` request slots and ``slots`` reply slots, each a length (ON_STREAM:
the message is on the stream) and up to ``slot_bytes`` of a serialised message. Message n
of each direction goes into slot n % slots. The target posts a request only while fewer
than ``slots`` of its replies are unread, so no slot is written again before it was read.

A message is written before the counter that announces it, and read after the counter
said so: this relies on the host making one process's stores visible to another in the
order they were made, which x86-64 does (total store order) and others need not, so the
target uses a mailbox on x86-64 hosts only (:func:`supported`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from splitspec.feature_memory import CHECK_BYTES, make_segment, unlink_segment
from splitspec.v1 import draft_pb2

COUNTERS = 64  # where the counters start (the check bytes before them)
POSTED, TAKEN, REPLIED = 0, 1, 2  # the counters: requests posted, requests taken, replies
SLOTS = 4
SLOT_BYTES = 1 << 20  # a request of 64 sequences that catch up 500 tokens each is ~200 KB
ON_STREAM = -1  # a slot's length when its message travels on the stream instead
LENGTH = struct.Struct("<q")
# How long a waiting side sleeps between looks: a 200th of the time it has waited so far,
# between these bounds (a side that has waited 5 ms looks every 25 us; one idle for a
# second, every millisecond, which costs next to nothing).
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
# Linux wakes a sleeping thread up to its timer slack late, 50 us unless set: a look meant
# 20 us after the last one came 100 us after it on the development machine (50 us with a
# slack of 1 us). A thread's first wait sets its own slack (threads that never wait keep
# theirs).
TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_slack_set = threading.local()
log = logging.getLogger(__name__)
# How a draft that cannot open the mailbox a stream named ends that stream (the details of
# its FAILED_PRECONDITION status begin so): the target then makes no more mailboxes.
REFUSED = "cannot use the exchange mailbox"


class MailboxError(Exception):
    """The mailbox a stream named cannot be opened, or is not one."""


def supported() -> str:
    """Why this host cannot use a mailbox ("" when it can): see the module's note on the
    order of stores."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"the mailbox relies on x86-64's store order; this host is {machine}"
    if not hasattr(os, "memfd_create"):
        return "no memfd_create on this system"
    return ""


def size_of(slots: int, slot_bytes: int) -> int:
    return COUNTERS + 3 * 8 + 2 * slots * (LENGTH.size + slot_bytes)


def tighten_timer_slack() -> None:
    """Set the calling thread's timer slack to TIMER_SLACK_NS, once (Linux; elsewhere
    nothing). A kernel that refuses is logged and the slack stays as it was."""
    if _prctl is None or getattr(_slack_set, "done", False):
        return
    _slack_set.done = True
    zero = ctypes.c_ulong(0)  # (prctl's arguments after the option are unsigned longs)
    if _prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(TIMER_SLACK_NS), zero, zero, zero) != 0:
        log.warning("could not set this thread's timer slack (errno %d): the mailbox's waits "
                    "wake up to 50 us late", ctypes.get_errno())


def wait_for(ready: Callable[[], bool], deadline: float | None = None,
             stop: Callable[[], bool] | None = None) -> bool:
    """Poll ``ready`` until it is true (True), or until ``deadline`` (time.monotonic()) or
    ``stop`` says to give up (False), sleeping between looks (MIN_SLEEP_S to MAX_SLEEP_S,
    growing with the time waited; the sleep lets other threads have the GIL), with this
    thread's timer slack tightened (:func:`tighten_timer_slack`)."""
    tighten_timer_slack()
    start = time.monotonic()
    while not ready():
        now = time.monotonic()
        if (deadline is not None and now >= deadline) or (stop is not None and stop()):
            return False
        pause = min(max((now - start) / 200, MIN_SLEEP_S), MAX_SLEEP_S)
        time.sleep(pause if deadline is None else max(min(pause, deadline - now), 0.0))
    return True


class _Slots:
    """The counters and slots of a mapped mailbox."""

    def __init__(self, buffer: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.counters = np.ndarray((3,), np.int64, buffer=buffer, offset=COUNTERS)
        self.bytes = np.frombuffer(buffer, dtype=np.uint8)
        self._first = COUNTERS + 3 * 8
        self._stride = LENGTH.size + slot_bytes

    def fits(self, size: int) -> bool:
        return size <= self.slot_bytes

    def _at(self, direction: int, n: int) -> int:
        return self._first + (direction * self.slots + n % self.slots) * self._stride

    def write(self, direction: int, n: int, raw: bytes | None) -> None:
        """Message ``n`` of ``direction`` (0: requests, 1: replies): its bytes, or None for
        one that travels on the stream."""
        at = self._at(direction, n)
        if raw is None:
            self.bytes[at:at + LENGTH.size] = np.frombuffer(LENGTH.pack(ON_STREAM), np.uint8)
            return
        if not self.fits(len(raw)):
            raise ValueError(f"a {len(raw)}-byte message does not fit a "
                             f"{self.slot_bytes}-byte slot")
        self.bytes[at:at + LENGTH.size] = np.frombuffer(LENGTH.pack(len(raw)), np.uint8)
        self.bytes[at + LENGTH.size:at + LENGTH.size + len(raw)] = np.frombuffer(raw, np.uint8)

    def length(self, direction: int, n: int) -> int:
        """Message ``n``'s length in its slot (ON_STREAM: it travels on the stream)."""
        at = self._at(direction, n)
        (length,) = LENGTH.unpack(self.bytes[at:at + LENGTH.size].tobytes())
        return length

    def read(self, direction: int, n: int) -> bytes | None:
        at = self._at(direction, n)
        length = self.length(direction, n)
        if length == ON_STREAM:
            return None
        if not 0 <= length <= self.slot_bytes:
            raise ValueError(f"mailbox slot {n % self.slots} says {length} bytes")
        return self.bytes[at + LENGTH.size:at + LENGTH.size + length].tobytes()

    def release(self) -> None:
        self.counters = np.zeros(3, np.int64)
        self.bytes = np.empty(0, np.uint8)


class Mailbox:
    """The target's side: makes the segment (OSError when it cannot), posts requests and
    takes replies. Used on the engine thread only."""

    def __init__(self, directory: str = "", slots: int = SLOTS,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self._fd, self.path, self._map, self.named = make_segment(
            size_of(slots, slot_bytes), directory, "splitspec-mailbox")
        self.check = os.urandom(CHECK_BYTES)
        self._map[:CHECK_BYTES] = self.check
        self._slots = _Slots(self._map, slots, slot_bytes)
        self.posted = 0  # requests posted (the POSTED counter, which only this side writes)
        self.read = 0    # replies taken

    def fits(self, size: int) -> bool:
        return self._slots.fits(size)

    @property
    def room(self) -> bool:
        """Whether a request may be posted now (fewer than ``slots`` replies unread)."""
        return self.posted - self.read < self.slots

    def post(self, raw: bytes | None) -> None:
        """Post the next request: its bytes, or None when it goes on the stream."""
        if not self.room:
            raise RuntimeError(f"{self.posted - self.read} requests are unanswered in the "
                               f"mailbox: no slot is free")
        self._slots.write(0, self.posted, raw)
        self.posted += 1
        self._slots.counters[POSTED] = self.posted

    @property
    def waiting(self) -> int:
        """Replies posted and not yet taken."""
        return int(self._slots.counters[REPLIED]) - self.read

    @property
    def in_slots(self) -> int:
        """Replies waiting whose bytes are in their slots: those not marked to come on the
        stream (such a reply is in once the stream has brought it)."""
        return sum(self._slots.length(1, n) != ON_STREAM
                   for n in range(self.read, self.read + self.waiting))

    @property
    def next_in_slot(self) -> bool:
        """Whether the next reply is waiting in its slot (not marked to come on the stream)."""
        return self.waiting > 0 and self._slots.length(1, self.read) != ON_STREAM

    def take(self) -> bytes | None:
        """The next reply (:attr:`waiting` must be > 0): its bytes, or None when it comes on
        the stream."""
        if self.waiting <= 0:
            raise RuntimeError("no reply is waiting in the mailbox")
        raw = self._slots.read(1, self.read)
        self.read += 1
        return raw

    def unlink(self) -> None:
        """Remove a file mailbox's name (the draft has opened it, or never will)."""
        if self.named:
            self.named = False
            unlink_segment(self.path, "exchange mailbox")

    def close(self) -> None:
        self.unlink()
        self._slots.release()
        self._map = None
        os.close(self._fd)


class MailboxMap:
    """The draft's side: maps the target's mailbox read-write (OSError when it cannot;
    ValueError when it is not a mailbox), takes requests and posts replies."""

    def __init__(self, path: str, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.path = path
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        if (size := len(self._map)) != size_of(slots, slot_bytes):
            self._map.close()
            raise ValueError(f"{path} is {size} bytes, not a mailbox of {slots} slots of "
                             f"{slot_bytes} bytes")
        self._slots = _Slots(self._map, slots, slot_bytes)
        self.taken = int(self._slots.counters[TAKEN])
        self.replied = int(self._slots.counters[REPLIED])

    @property
    def check_bytes(self) -> bytes:
        return bytes(self._map[:CHECK_BYTES])

    def fits(self, size: int) -> bool:
        return self._slots.fits(size)

    def next_request(self, stop: Callable[[], bool]) -> tuple[bool, bytes | None]:
        """Wait for the next request: (True, its bytes, or None when it comes on the
        stream), or (False, None) once ``stop`` says the stream ended."""
        counters = self._slots.counters
        if not wait_for(lambda: counters[POSTED] > self.taken, stop=stop):
            return False, None
        raw = self._slots.read(0, self.taken)
        self.taken += 1
        counters[TAKEN] = self.taken
        return True, raw

    def post(self, raw: bytes | None) -> None:
        """Post the reply to the last request taken: its bytes, or None when it goes on the
        stream."""
        self._slots.write(1, self.replied, raw)
        self.replied += 1
        self._slots.counters[REPLIED] = self.replied

    def close(self) -> None:
        self._slots.release()
        self._map = None


class ExchangeRequests:
    """The draft's side of one Exchange stream: its requests in order, from the stream, and
    once one names a mailbox, every later one from it (:meth:`answer` sends each reply the
    way its request came). MailboxError from the iteration when the mailbox a request
    names cannot be opened."""

    def __init__(self, request_iterator: Iterator[draft_pb2.DraftRequest],
                 stopped: Callable[[], bool]) -> None:
        self._stream = request_iterator
        self._stopped = stopped
        self.box: MailboxMap | None = None
        self._from_box = False  # whether the request being answered came through the box

    def __iter__(self) -> Iterator[draft_pb2.DraftRequest]:
        while True:
            self._from_box = self.box is not None
            if self.box is None:
                request = next(self._stream, None)
            else:
                more, raw = self.box.next_request(self._stopped)
                if not more:
                    return
                request = (next(self._stream, None) if raw is None
                           else draft_pb2.DraftRequest.FromString(raw))
            if request is None:
                return
            if request.mailbox and self.box is None:
                try:
                    self.box = MailboxMap(request.mailbox)
                except (OSError, ValueError) as exc:  # (re-raised as what it is here)
                    raise MailboxError(f"{request.mailbox}: {exc}") from exc
            yield request

    def answer(self, reply: draft_pb2.DraftReply) -> draft_pb2.DraftReply | None:
        """Send ``reply`` through the mailbox when its request came that way (None), else
        return it for the stream; one too big for a slot is marked there and returned."""
        if not self._from_box:
            return reply
        raw = reply.SerializeToString()
        if self.box.fits(len(raw)):
            self.box.post(raw)
            return None
        self.box.post(None)
        return reply

    def close(self) -> None:
        if self.box is not None:
            self.box.close()
            self.box = None
