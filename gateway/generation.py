"""One request's life from admission to its last chunk.

A :class:`RequestRun` is iterated on the gRPC handler thread; it blocks on its
inbox, which the target stream's reader thread fills (token deltas, or
StreamLost) and :meth:`RequestRun.cancel` (any thread) pokes. Cancellation:

- queued: ``cancel`` withdraws the ticket; the handler wakes and returns.
- admitted, not yet submitted: the handler sees the flag and releases the slot.
- at the target: the handler wakes on CLIENT_GONE (or the iterator is closed)
  and sends Cancel; the admission slot is released when the target's final
  delta for the request arrives (or the stream is lost), so the gateway never
  has more than max_running requests at the target.

:meth:`RequestRun.abort` (a stopping gateway's drain ran out of time) ends a run
the same way, but the handler then raises the abort's UNAVAILABLE to the client.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum

import grpc

from gateway.admission import Admission, Ticket
from gateway.target_client import StreamLost, TargetClient, TargetItem
from gateway.text_stream import TextStream
from gateway.validation import GenerationRequest
from splitspec import telemetry
from splitspec.grpc_server import ServiceError
from splitspec.tokenizer import ModelTokenizer
from splitspec.v1 import common_pb2, target_pb2

log = logging.getLogger(__name__)

# After a stop string matched: how long to wait for the target's final delta,
# which carries the request's speculation statistics.
STOP_SPEC_WAIT_S = 0.5


class _Signal(Enum):
    CLIENT_GONE = "client gone"


CLIENT_GONE = _Signal.CLIENT_GONE


@dataclass(frozen=True)
class Final:
    """What the last chunk of a request carries besides text."""

    finish_reason: int  # a common_pb2.FinishReason value
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    time_to_first_token_s: float
    total_s: float
    spec: common_pb2.SpecStats


@dataclass(frozen=True)
class Chunk:
    """New text (and new ids when the request asked for them); ``final`` on the last one."""

    text: str
    token_ids: tuple[int, ...] = ()
    final: Final | None = None


def is_final(item: TargetItem) -> bool:
    return isinstance(item, StreamLost) or item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


_TRACER = telemetry.tracer("splitspec.gateway")
_METER = telemetry.meter("splitspec.gateway")
TTFT = _METER.create_histogram(
    "gen_ai.server.time_to_first_token", "s", "Time to generate the first token",
    explicit_bucket_boundaries_advisory=telemetry.TTFT_BUCKETS)
TPOT = _METER.create_histogram(
    "gen_ai.server.time_per_output_token", "s", "Time per output token after the first",
    explicit_bucket_boundaries_advisory=telemetry.TPOT_BUCKETS)
DURATION = _METER.create_histogram(
    "gen_ai.server.request.duration", "s", "Generative AI server request duration",
    explicit_bucket_boundaries_advisory=telemetry.DURATION_BUCKETS)
FINISH_NAMES = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_EOS: "stop",
                common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_CANCELLED: "cancelled",
                common_pb2.FINISH_REASON_ERROR: "error"}
MODE_NAMES = {common_pb2.SPECULATION_MODE_AUTO: "auto", common_pb2.SPECULATION_MODE_ON: "on",
              common_pb2.SPECULATION_MODE_OFF: "off"}
OPERATION = "text_completion"


class RequestRun:
    """Iterate once (on the handler thread) for the request's chunks; the last has ``final``.

    The iteration ends without a final chunk only when the request was
    cancelled. Raises ServiceError(UNAVAILABLE) when the target stream is lost,
    the run was aborted or a stopping target refused the request, and
    ServiceError(INTERNAL) when the target fails the request. ``on_end`` is
    called (once or more) when the run has ended or the client went away.

    The request's span (GenAI conventions) lives from the first iteration to the
    last; its traceparent travels to the target in the Admit.
    """

    def __init__(self, request_id: int, request: GenerationRequest, arrival_s: float,
                 ticket: Ticket, admission: Admission, target: TargetClient,
                 tokenizer: ModelTokenizer, parent: bytes = b"", model: str = "",
                 on_end: Callable[[RequestRun], None] | None = None) -> None:
        self.request_id = request_id
        self.request = request
        self._arrival_s = arrival_s
        self._ticket = ticket
        self._admission = admission
        self._target = target
        self._tokenizer = tokenizer
        self._inbox: queue.Queue[TargetItem | _Signal | ServiceError] = queue.Queue()
        self._is_cancelled = threading.Event()
        self._is_done_at_target = False
        self._parent = parent  # the client's traceparent, if it sent one
        self._model = model
        self._span = None
        self._on_end = on_end or (lambda run: None)
        self._aborted: ServiceError | None = None

    def cancel(self) -> None:
        """The client went away: stop waiting, and stop the request at the target. Idempotent."""
        self._is_cancelled.set()
        self._admission.withdraw(self._ticket)
        self._inbox.put(CLIENT_GONE)
        self._on_end(self)

    def abort(self, message: str) -> None:
        """End the run as :meth:`cancel` does, but with UNAVAILABLE ``message`` to the client."""
        self._aborted = ServiceError(grpc.StatusCode.UNAVAILABLE, message)
        self._is_cancelled.set()
        self._admission.withdraw(self._ticket)
        self._inbox.put(self._aborted)

    def __iter__(self) -> Iterator[Chunk]:
        is_submitted = False
        request = self.request
        # Not made current: the generator may be closed from another thread.
        self._span = _TRACER.start_span(
            f"{OPERATION} {self._model}", context=telemetry.context_from(self._parent),
            kind=telemetry.trace.SpanKind.SERVER, attributes={
                "gen_ai.operation.name": OPERATION, "gen_ai.request.model": self._model,
                "gen_ai.request.max_tokens": request.max_new_tokens,
                "gen_ai.request.temperature": request.sampling.temperature,
                "gen_ai.usage.input_tokens": len(request.prompt_ids),
                "splitspec.request_id": self.request_id,
                "splitspec.speculation_mode": MODE_NAMES.get(request.speculation, "auto")})
        try:
            if not self._admission.wait(self._ticket) or self._is_cancelled.is_set():
                if self._aborted is not None:
                    raise self._aborted
                return
            admitted_s = time.monotonic()
            self._target.submit(self._admit(), self._on_target_item)
            is_submitted = True
            for chunk in self._relay(admitted_s):
                if chunk.final is not None:
                    self._record(chunk.final)
                yield chunk
        except ServiceError as exc:
            self._span.set_status(telemetry.trace.StatusCode.ERROR, exc.message)
            raise
        finally:
            self._span.end()
            if not is_submitted:
                self._admission.release(self._ticket)
            elif not self._is_done_at_target:
                self._target.cancel(self.request_id)
            self._on_end(self)

    def _record(self, final: Final) -> None:
        """The final figures on the span and in the GenAI metrics."""
        spec = final.spec
        self._span.set_attributes({
            "gen_ai.usage.output_tokens": final.completion_tokens,
            "gen_ai.response.finish_reasons": [FINISH_NAMES.get(final.finish_reason, "unknown")],
            "splitspec.queue_s": final.queue_s,
            "splitspec.time_to_first_token_s": final.time_to_first_token_s,
            "splitspec.spec.verify_steps": spec.verify_steps,
            "splitspec.spec.accepted_length": spec.mean_accepted_length})
        attributes = {"gen_ai.operation.name": OPERATION, "gen_ai.request.model": self._model}
        TTFT.record(final.time_to_first_token_s, attributes)
        DURATION.record(final.total_s, attributes)
        if final.completion_tokens > 1:
            TPOT.record((final.total_s - final.time_to_first_token_s)
                        / (final.completion_tokens - 1), attributes)

    def _admit(self) -> target_pb2.Admit:
        request = self.request
        return target_pb2.Admit(
            request_id=self.request_id,
            prompt_ids=request.prompt_ids,
            max_new_tokens=request.max_new_tokens,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            sampling=request.sampling,
            speculation=request.speculation,
            traceparent=telemetry.traceparent(self._span),
        )

    def _on_target_item(self, item: TargetItem) -> None:
        """On the reader thread: the slot frees when the target is done with the request."""
        if is_final(item):
            self._admission.release(self._ticket)
        self._inbox.put(item)

    def _relay(self, admitted_s: float) -> Iterator[Chunk]:
        """Turn target deltas into chunks until the request finishes or is cancelled."""
        request = self.request
        text = TextStream(self._tokenizer, request.prompt_ids, request.stop)
        timing = _Timing(self._arrival_s, admitted_s)
        while True:
            item = self._inbox.get()
            if item is CLIENT_GONE:
                return
            if isinstance(item, ServiceError):  # from abort
                raise item
            if isinstance(item, StreamLost):
                self._is_done_at_target = True
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, item.message)
            timing.see(item)
            num_used = text.num_tokens
            piece = text.push(item.token_ids)
            new_ids = tuple(text.token_ids[num_used:]) if request.include_token_ids else ()
            if is_final(item):
                self._is_done_at_target = True
            if piece.is_stopped:
                spec = item.spec if is_final(item) else self._stop_at_target()
                yield Chunk(piece.text, new_ids, self._final(
                    common_pb2.FINISH_REASON_STOP, text, timing, spec))
                return
            if is_final(item):
                yield self._last_chunk(item, piece.text, new_ids, text, timing)
                return
            if piece.text or new_ids:
                yield Chunk(piece.text, new_ids)

    def _last_chunk(self, delta: target_pb2.TokenDelta, text_now: str, new_ids: tuple[int, ...],
                    text: TextStream, timing: _Timing) -> Chunk:
        if delta.finish_reason == common_pb2.FINISH_REASON_ERROR:
            if delta.retryable:  # the target is stopping: another try may find it back
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   f"the target refused request {self.request_id}: {delta.error}")
            raise ServiceError(grpc.StatusCode.INTERNAL,
                               f"the target failed request {self.request_id}: {delta.error}")
        tail = text.finish()
        reason = common_pb2.FINISH_REASON_STOP if text.is_stopped else delta.finish_reason
        return Chunk(text_now + tail, new_ids, self._final(reason, text, timing, delta.spec))

    def _stop_at_target(self) -> common_pb2.SpecStats:
        """Cancel at the target after a stop string; return its stats if its final delta
        comes soon. Tokens in later deltas are not used."""
        self._target.cancel(self.request_id)
        self._is_done_at_target = True
        deadline = time.monotonic() + STOP_SPEC_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            if item is CLIENT_GONE or isinstance(item, (StreamLost, ServiceError)):
                break
            if is_final(item):
                return item.spec
        return common_pb2.SpecStats()

    def _final(self, reason: int, text: TextStream, timing: _Timing,
               spec: common_pb2.SpecStats) -> Final:
        now = time.monotonic()
        return Final(
            finish_reason=reason,
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=text.num_tokens,
            queue_s=timing.queue_s,
            time_to_first_token_s=timing.first_token_s(now),
            total_s=now - self._arrival_s,
            spec=spec,
        )


class _Timing:
    """Arrival-relative times of one request (monotonic seconds)."""

    def __init__(self, arrival_s: float, admitted_s: float) -> None:
        self._arrival_s = arrival_s
        self._gateway_queue_s = admitted_s - arrival_s
        self._target_queue_s = 0.0
        self._first_token_at_s: float | None = None

    def see(self, delta: target_pb2.TokenDelta) -> None:
        if delta.queue_s:
            self._target_queue_s = delta.queue_s
        if delta.token_ids and self._first_token_at_s is None:
            self._first_token_at_s = time.monotonic()

    @property
    def queue_s(self) -> float:
        return self._gateway_queue_s + self._target_queue_s

    def first_token_s(self, now: float) -> float:
        return (self._first_token_at_s or now) - self._arrival_s
