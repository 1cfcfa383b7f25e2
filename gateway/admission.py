"""Admission: at most ``max_running`` requests at the target, a FIFO queue of at most
``max_queued`` behind them, RESOURCE_EXHAUSTED beyond that.

A request holds a :class:`Ticket` from :meth:`Admission.enqueue` until
:meth:`Admission.release`. Invariants (under the lock): num_running <=
max_running; num_queued <= max_queued; a queued ticket is admitted only when
every ticket queued before it has been admitted or has left the queue.
"""

from __future__ import annotations

import enum
import threading
from collections import deque

import grpc

from splitspec.grpc_server import ServiceError


class TicketState(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RELEASED = "released"


class Ticket:
    """One request's place in admission. Its state changes only under the Admission lock."""

    def __init__(self) -> None:
        self.state = TicketState.QUEUED

    @property
    def is_admitted(self) -> bool:
        return self.state is TicketState.ADMITTED


class Admission:
    """Counts running requests and queues the rest in arrival order. Thread-safe."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"need max_running >= 1 and max_queued >= 0 "
                             f"(got {max_running}, {max_queued})")
        self.max_running = max_running
        self.max_queued = max_queued
        self._num_running = 0
        self._queue: deque[Ticket] = deque()
        self._changed = threading.Condition()

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def enqueue(self) -> Ticket:
        """A ticket, admitted at once when a slot is free and nobody waits, else queued.

        Raises ServiceError(RESOURCE_EXHAUSTED) when the queue is full.
        """
        ticket = Ticket()
        with self._changed:
            if len(self._queue) >= self.max_queued and not self._can_admit_now():
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the gateway is full: {self._num_running} requests running "
                    f"(--max-running {self.max_running}) and {len(self._queue)} queued "
                    f"(--max-queued {self.max_queued}); retry later")
            self._queue.append(ticket)
            self._admit_waiting()
        return ticket

    def wait(self, ticket: Ticket, timeout_s: float | None = None) -> bool:
        """Block until the ticket is admitted (True) or released while queued (False).

        Returns False also when timeout_s passes first, leaving the ticket queued.
        """
        with self._changed:
            self._changed.wait_for(lambda: ticket.state is not TicketState.QUEUED, timeout_s)
            return ticket.is_admitted

    def withdraw(self, ticket: Ticket) -> bool:
        """Take a still-queued ticket out of the queue; True if it was queued. Admitted
        tickets are left alone (their request must be cancelled at the target first)."""
        with self._changed:
            if ticket.state is not TicketState.QUEUED:
                return False
            self._queue.remove(ticket)
            ticket.state = TicketState.RELEASED
            self._changed.notify_all()
            return True

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's slot or queue place; idempotent. Admits the next in line."""
        with self._changed:
            if ticket.state is TicketState.QUEUED:
                self._queue.remove(ticket)
            elif ticket.state is TicketState.ADMITTED:
                self._num_running -= 1
            ticket.state = TicketState.RELEASED
            self._admit_waiting()
            self._changed.notify_all()

    def _can_admit_now(self) -> bool:
        return not self._queue and self._num_running < self.max_running

    def _admit_waiting(self) -> None:
        while self._queue and self._num_running < self.max_running:
            head = self._queue.popleft()
            head.state = TicketState.ADMITTED
            self._num_running += 1
        self._changed.notify_all()
