"""The gateway's side of the target: connect and check, and the one long-lived Serve stream.

Threads: gRPC consumes the outgoing request iterator on its own thread (fed
from a queue); one reader thread per stream dispatches each TokenDelta to the
sink its request registered, never blocking (sinks only enqueue). When the
stream breaks, every in-flight sink gets :class:`StreamLost`, the listener
hears ``target_down`` and a reconnect thread waits for the target, reopens
Serve, resends the policy and calls ``target_up``. A target that says it is
stopping (it drains) also brings ``target_down``: new requests get UNAVAILABLE
here, those in flight go on, and the reconnect after its stream ends clears it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import grpc

from gateway.policy import describe_policy
from gateway.stats import SpecTotals
from splitspec.grpc_server import ServiceError, wait_for_serving
from splitspec.tokenizer import ModelTokenizer
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 30.0
RECONNECT_WAIT_S = 10.0
RECONNECT_PAUSE_S = 1.0
TARGET_STOPPING = ("the target is stopping (it drains the requests in flight); the gateway "
                   "reconnects once it is back: try again then")


class TargetIncompatible(RuntimeError):
    """The target serves a model this gateway cannot front (tokenizer or vocabulary)."""


class StreamLost(NamedTuple):
    """Sent to every in-flight request's sink when the Serve stream breaks."""

    message: str


TargetItem = target_pb2.TokenDelta | StreamLost
Sink = Callable[[TargetItem], None]


class TargetListener(Protocol):
    def target_down(self) -> None: ...
    def target_up(self) -> None: ...


@dataclass(frozen=True)
class TargetPeer:
    """A target that is SERVING and was checked against our tokenizer."""

    address: str
    channel: grpc.Channel
    stub: target_pb2_grpc.TargetStub
    info: target_pb2.TargetInfo
    init_report: common_pb2.InitReport


def check_compatible(tokenizer: ModelTokenizer, info: target_pb2.TargetInfo) -> None:
    """Raise TargetIncompatible, saying what to change, unless the target's tokenizer is ours."""
    if tokenizer.sha256 != info.tokenizer_sha256:
        raise TargetIncompatible(
            f"gateway tokenizer {tokenizer.path} (sha {tokenizer.sha256[:12]}) differs from the "
            f"target's (sha {info.tokenizer_sha256[:12]}, model {info.model_name!r}); "
            f"pass --model <target checkpoint>")
    if tokenizer.vocab_size > info.vocab_size:
        raise TargetIncompatible(
            f"gateway tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids but the target's "
            f"vocabulary has {info.vocab_size}; pass --model <target checkpoint>")


def connect_target(address: str, timeout_s: float, tokenizer: ModelTokenizer) -> TargetPeer:
    """Wait until the target is SERVING, fetch its info and init report, check them."""
    channel = wait_for_serving(address, timeout_s, "target")
    try:
        stub = target_pb2_grpc.TargetStub(channel)
        info = stub.GetInfo(target_pb2.GetTargetInfoRequest(), timeout=RPC_TIMEOUT_S)
        check_compatible(tokenizer, info)
        report = stub.GetInitReport(common_pb2.GetInitReportRequest(), timeout=RPC_TIMEOUT_S)
    except Exception:  # re-raised: only the channel is closed here
        channel.close()
        raise
    return TargetPeer(address=address, channel=channel, stub=stub, info=info, init_report=report)


class _ServeStream:
    """One Serve call: an outgoing queue and a reader thread.

    ``on_end(stream, why)`` is called once, from the reader thread, when the
    stream ends for any reason other than :meth:`close`.
    """

    def __init__(self, stub: target_pb2_grpc.TargetStub, first: target_pb2.ServeRequest,
                 on_event: Callable[[target_pb2.ServeEvent], None],
                 on_end: Callable[[_ServeStream, str], None]) -> None:
        self._outbox: queue.Queue[target_pb2.ServeRequest | None] = queue.Queue()
        self._outbox.put(first)
        self._is_closing = False
        self._on_event = on_event
        self._on_end = on_end
        self._call = stub.Serve(self._requests())
        self._reader = threading.Thread(target=self._read, name="target-stream", daemon=True)

    def start_reading(self) -> None:
        """Start the reader thread; call once the stream is where on_end will look for it."""
        self._reader.start()

    def send(self, request: target_pb2.ServeRequest) -> None:
        self._outbox.put(request)

    def close(self) -> None:
        self._is_closing = True
        self._outbox.put(None)
        self._call.cancel()

    def _requests(self) -> Iterator[target_pb2.ServeRequest]:
        while (request := self._outbox.get()) is not None:
            yield request

    def _read(self) -> None:
        why = "the gateway's stream reader failed (see the traceback in the log)"
        try:
            for event in self._call:
                self._on_event(event)
            why = "the target closed the Serve stream"
        except grpc.RpcError as exc:  # the stream broke: in-flight requests fail in on_end
            why = f"{exc.code().name}: {exc.details()}"
        finally:
            if not self._is_closing:
                self._on_end(self, why)


class TargetClient:
    """Admissions, cancellations and policy out; token deltas in. Thread-safe.

    Invariant: a request id is in ``_inflight`` from :meth:`submit` until its
    final delta arrives or the stream is lost, and its sink gets exactly one
    final item (a delta with a finish reason, or StreamLost).
    """

    def __init__(self, peer: TargetPeer, tokenizer: ModelTokenizer, policy: target_pb2.SpecPolicy,
                 listener: TargetListener,
                 on_step: Callable[[target_pb2.StepStats, int], target_pb2.SpecPolicy | None]
                 | None = None) -> None:
        """Open the Serve stream and send ``policy`` first. ``on_step`` sees every step's
        statistics, with the requests in flight once the step's final deltas are handed
        out, and may return a new policy to send (the adaptive policy)."""
        self._on_step = on_step
        self._lock = threading.Lock()
        self._tokenizer = tokenizer
        self._listener = listener
        self._is_closed = threading.Event()
        self._inflight: dict[int, Sink] = {}
        self._policy = policy
        self._peer = peer
        self._down_reason = ""
        self._is_target_stopping = False  # the target said it drains: no new requests to it
        self.spec_totals = SpecTotals()
        self.last_step = target_pb2.StepStats()
        with self._lock:
            self._stream: _ServeStream | None = self._open(peer)
            self._stream.start_reading()

    @property
    def peer(self) -> TargetPeer:
        return self._peer

    @property
    def policy(self) -> target_pb2.SpecPolicy:
        return self._policy

    @property
    def is_connected(self) -> bool:
        return self._stream is not None

    def submit(self, admit: target_pb2.Admit, sink: Sink) -> None:
        """Send an Admit; ``sink`` gets the request's deltas from the reader thread.

        Raises ServiceError(UNAVAILABLE) while the stream is down.
        """
        with self._lock:
            if self._stream is None:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   f"the target stream is down ({self._down_reason}); "
                                   f"the gateway is reconnecting")
            if self._is_target_stopping:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, TARGET_STOPPING)
            if admit.request_id in self._inflight:
                raise ValueError(f"request id {admit.request_id} is already in flight")
            self._inflight[admit.request_id] = sink
            self._stream.send(target_pb2.ServeRequest(admit=admit))

    def cancel(self, request_id: int) -> None:
        """Ask the target to stop a request; no-op if it already finished."""
        with self._lock:
            if self._stream is not None and request_id in self._inflight:
                self._stream.send(target_pb2.ServeRequest(cancel=target_pb2.Cancel(
                    request_id=request_id)))

    def set_policy(self, policy: target_pb2.SpecPolicy) -> None:
        """Send a new policy now (and after every reconnect)."""
        with self._lock:
            self._policy = policy
            if self._stream is not None:
                self._stream.send(target_pb2.ServeRequest(policy=policy))

    def close(self) -> None:
        """Close the stream; in-flight sinks get StreamLost."""
        self._is_closed.set()
        with self._lock:
            stream, self._stream = self._stream, None
            self._down_reason = "the gateway is shutting down"
            lost = self._take_inflight()
        if stream is not None:
            stream.close()
        self._fail(lost, "the gateway is shutting down")
        self._peer.channel.close()

    def _open(self, peer: TargetPeer) -> _ServeStream:
        first = target_pb2.ServeRequest(policy=self._policy)
        return _ServeStream(peer.stub, first, self._on_event, self._on_stream_end)

    def _take_inflight(self) -> list[Sink]:
        sinks = list(self._inflight.values())
        self._inflight.clear()
        return sinks

    @staticmethod
    def _fail(sinks: list[Sink], message: str) -> None:
        for sink in sinks:
            sink(StreamLost(message))

    def _on_event(self, event: target_pb2.ServeEvent) -> None:
        if event.target_stopping:
            with self._lock:
                self._is_target_stopping = True
                in_flight = len(self._inflight)
            log.warning("the target at %s is stopping: new requests get UNAVAILABLE until it is "
                        "back; the %d in flight go on", self._peer.address, in_flight)
            self._listener.target_down()
        if event.HasField("draft_report"):  # the target reconnected to a restarted draft
            self._peer.info.draft_report.CopyFrom(event.draft_report)
            log.info("the target reconnected to its draft, restarted at %s",
                     time.strftime("%Y-%m-%d %H:%M:%S",
                                   time.localtime(event.draft_report.started_at_unix_s)))
        for delta in event.deltas:
            with self._lock:
                is_final = delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                sink = (self._inflight.pop if is_final else self._inflight.get)(delta.request_id, None)
            if is_final:
                self.spec_totals.add(delta.spec)
            if sink is None:
                log.debug("delta for request %d that is not in flight", delta.request_id)
                continue
            sink(delta)
        if event.HasField("stats"):
            self.last_step = event.stats
            with self._lock:
                in_flight = len(self._inflight)
            new_policy = self._on_step(event.stats, in_flight) if self._on_step else None
            if new_policy is not None:
                log.info("speculation policy now: %s", describe_policy(new_policy))
                self.set_policy(new_policy)

    def _on_stream_end(self, stream: _ServeStream, why: str) -> None:
        with self._lock:
            if stream is not self._stream:
                return
            self._stream = None
            self._down_reason = why
            lost = self._take_inflight()
        stream.close()
        log.error("lost the target stream to %s (%s); failing %d requests, reconnecting",
                  self._peer.address, why, len(lost))
        self._listener.target_down()
        self._fail(lost, f"lost the target stream ({why}); the gateway is reconnecting")
        threading.Thread(target=self._reconnect, name="target-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        """Retry until the target is back (or the client is closed), then reopen Serve."""
        while not self._is_closed.is_set():
            try:
                peer = connect_target(self._peer.address, RECONNECT_WAIT_S, self._tokenizer)
            except (TimeoutError, grpc.RpcError, TargetIncompatible) as exc:  # retried; logged
                log.warning("target at %s not back yet: %s", self._peer.address, exc)
                self._is_closed.wait(RECONNECT_PAUSE_S)
                continue
            self._attach(peer)
            return

    def _attach(self, peer: TargetPeer) -> None:
        with self._lock:
            if self._is_closed.is_set():
                peer.channel.close()
                return
            old_channel = self._peer.channel
            _warn_if_limits_changed(self._peer.info, peer.info)
            self._peer = peer
            self._is_target_stopping = False
            self._stream = self._open(peer)
            self._stream.start_reading()
        old_channel.close()
        log.info("reconnected to the target at %s (%s)", peer.address, peer.info.model_name)
        self._listener.target_up()


def _warn_if_limits_changed(old: target_pb2.TargetInfo, new: target_pb2.TargetInfo) -> None:
    """Requests are validated against the limits seen at start-up; say so when the target's differ."""
    fields = ("vocab_size", "max_context", "max_running")
    changed = [f"{f} {getattr(old, f)} -> {getattr(new, f)}" for f in fields
               if getattr(old, f) != getattr(new, f)]
    if changed:
        log.warning("the reconnected target has other limits (%s); the gateway keeps validating "
                    "against the start-up ones: restart the gateway", ", ".join(changed))
