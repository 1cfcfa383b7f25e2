"""The gateway's domain object: validate, admit, run; and the live status.

Built only from finished start-up results (config, tokenizer, an open
TargetClient, the init report), so every attribute is usable from the start.
A stopping gateway drains it (:meth:`GatewayCore.drain`): new requests get
UNAVAILABLE, those in flight run to their end or until the drain's time is up.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.generation import RequestRun
from gateway.target_client import TargetClient
from gateway.validation import Limits, validate
from splitspec.grpc_server import ServiceError
from splitspec.init_report import InitReport
from splitspec.tokenizer import ModelTokenizer
from splitspec.v1 import gateway_pb2, target_pb2

log = logging.getLogger(__name__)

# gRPC worker threads beyond one per running and queued request (status, health, spare).
EXTRA_WORKERS = 8
# When --max-running is 0 the server is sized before the target's max_running is
# known; the gateway then runs at most this many requests at once.
MAX_RUNNING_WHEN_UNSET = 1024


def num_server_workers(config: GatewayConfig) -> int:
    """Handler threads: every running and queued request holds one for its whole life."""
    return (config.max_running or MAX_RUNNING_WHEN_UNSET) + config.max_queued + EXTRA_WORKERS


def resolve_max_running(config: GatewayConfig, info: target_pb2.TargetInfo) -> int:
    """--max-running, or the target's max_running (at least 1, at most the thread budget)."""
    if config.max_running:
        return config.max_running
    return max(1, min(info.max_running, MAX_RUNNING_WHEN_UNSET))


class GatewayCore:
    """Starts requests and reports status. Thread-safe."""

    def __init__(self, config: GatewayConfig, tokenizer: ModelTokenizer, target: TargetClient,
                 report: InitReport) -> None:
        info = target.peer.info
        self.limits = Limits(vocab_size=info.vocab_size, max_context=info.max_context,
                             default_max_new_tokens=config.default_max_new_tokens)
        self.admission = Admission(resolve_max_running(config, info), config.max_queued)
        self._tokenizer = tokenizer
        self._target = target
        self._report = report
        self._request_ids = itertools.count(1)  # next() is atomic under the GIL
        self._runs: set[RequestRun] = set()  # started, not yet ended (or their client gone)
        self._runs_changed = threading.Condition()
        self._is_stopping = False

    @property
    def num_in_flight(self) -> int:
        return len(self._runs)

    def start(self, request: gateway_pb2.GenerateRequest, parent: bytes = b"") -> RequestRun:
        """Validate and enqueue; the returned run is iterated for the chunks (``parent``: the
        client's W3C traceparent, if any).

        Raises ServiceError INVALID_ARGUMENT (bad request), RESOURCE_EXHAUSTED (full) or
        UNAVAILABLE (the gateway is stopping).
        """
        arrival_s = time.monotonic()
        generation = validate(request, self.limits, self._tokenizer)
        with self._runs_changed:  # a drain sees every run started before it
            if self._is_stopping:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   "the gateway is stopping: send the request to another one")
            ticket = self.admission.enqueue()
            run = RequestRun(next(self._request_ids), generation, arrival_s, ticket,
                             self.admission, self._target, self._tokenizer, parent,
                             self._target.peer.info.model_name, on_end=self._ended)
            self._runs.add(run)
        return run

    def drain(self, timeout_s: float, interrupt: threading.Event | None = None) -> int:
        """Refuse new requests from now on, and wait until every request in flight has ended,
        at most timeout_s (less if ``interrupt`` is set); abort those still running then
        (their clients get UNAVAILABLE saying so). Returns how many were aborted."""
        deadline = time.monotonic() + timeout_s
        with self._runs_changed:
            self._is_stopping = True
            while (self._runs and (left := deadline - time.monotonic()) > 0
                   and not (interrupt is not None and interrupt.is_set())):
                self._runs_changed.wait(min(left, 0.1))
            left_over = list(self._runs)
        why = ("it was stopped again while waiting" if interrupt is not None and interrupt.is_set()
               else f"it waits --drain-timeout-s {timeout_s:g} s for requests in flight")
        for run in left_over:
            run.abort(f"the gateway stopped before request {run.request_id} finished ({why})")
        return len(left_over)

    def _ended(self, run: RequestRun) -> None:
        with self._runs_changed:
            self._runs.discard(run)
            self._runs_changed.notify_all()

    def status(self) -> gateway_pb2.StatusResponse:
        peer = self._target.peer
        last_step = self._target.last_step
        return gateway_pb2.StatusResponse(
            gateway=self._report.to_pb(),
            target=peer.init_report,
            draft=peer.info.draft_report,
            running=self.admission.num_running,
            queued=self.admission.num_queued,
            speculating=last_step.speculated,
            spec=self._target.spec_totals.to_pb(),
            policy=self._target.policy,
            last_step=last_step,
            model_name=peer.info.model_name,
        )
