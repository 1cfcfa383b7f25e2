"""An in-process stand-in for the target service, for gateway tests.

It speaks target.proto: GetInfo, GetInitReport, and Serve, where every
admitted sequence emits the next ``tokens_per_step`` ids of a fixed script
each step. It records what the gateway sent (admits, cancels, policies) and
can break its open streams to test reconnection.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitspec.grpc_server import ServiceServer
from splitspec.init_report import InitReport, StepRecord, StepState
from splitspec.tokenizer import tokenizer_sha256
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc


@dataclass
class _Sequence:
    admit: target_pb2.Admit
    num_generated: int = 0
    is_cancelled: bool = False


@dataclass
class FakeTarget(target_pb2_grpc.TargetServicer):
    model_dir: Path
    script_ids: list[int]
    vocab_size: int = 2048
    max_context: int = 256
    max_running: int = 4
    eos_token_ids: tuple[int, ...] = ()
    tokens_per_step: int = 2
    step_s: float = 0.002
    is_paused: threading.Event = field(default_factory=threading.Event)
    admits: list[target_pb2.Admit] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    policies: list[target_pb2.SpecPolicy] = field(default_factory=list)
    _break: threading.Event = field(default_factory=threading.Event)
    _draining: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    num_streams: int = 0
    refusal: target_pb2.TokenDelta | None = None  # set: every admit is answered with this

    def GetInfo(self, request: target_pb2.GetTargetInfoRequest,
                context: grpc.ServicerContext) -> target_pb2.TargetInfo:
        return target_pb2.TargetInfo(
            model_name="fake", vocab_size=self.vocab_size,
            tokenizer_sha256=tokenizer_sha256(self.model_dir),
            eos_token_ids=self.eos_token_ids, max_context=self.max_context,
            max_running=self.max_running, has_draft=True,
            default_shape=common_pb2.DraftShape(num_draft_tokens=4, topk=1, num_steps=4),
            tp_size=1, draft_report=InitReport(service="draft").to_pb(), draft_model_name="fake-draft")

    def GetInitReport(self, request: common_pb2.GetInitReportRequest,
                      context: grpc.ServicerContext) -> common_pb2.InitReport:
        report = InitReport(service="target", steps=[StepRecord("load_model", StepState.OK)])
        return report.to_pb()

    def drain(self, draining: bool = True) -> None:
        """As a target's SIGTERM (or, False, as the target restarted): every stream is told
        that the target stops, and new admits are refused, marked retryable."""
        self.refusal = target_pb2.TokenDelta(
            finish_reason=common_pb2.FINISH_REASON_ERROR, error="the target is stopping",
            retryable=True) if draining else None
        (self._draining.set if draining else self._draining.clear)()

    def break_streams(self) -> None:
        """Abort every open Serve stream with UNAVAILABLE."""
        self._break.set()

    def Serve(self, request_iterator: Iterator[target_pb2.ServeRequest],
              context: grpc.ServicerContext) -> Iterator[target_pb2.ServeEvent]:
        self._break.clear()
        self.num_streams += 1
        inbox: queue.Queue[target_pb2.ServeRequest] = queue.Queue()
        threading.Thread(target=_pump, args=(request_iterator, inbox), daemon=True).start()
        sequences: dict[int, _Sequence] = {}
        step = 0
        told = False  # this stream heard that the target stops
        while context.is_active():
            if self._draining.is_set() and not told:
                told = True
                yield target_pb2.ServeEvent(target_stopping=True)
            if self._break.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "fake target outage")
            refused = self._take(inbox, sequences)
            if refused:
                yield target_pb2.ServeEvent(deltas=refused)
            time.sleep(self.step_s)
            if self.is_paused.is_set():
                continue
            deltas = [self._advance(seq) for seq in sequences.values()]
            for delta in deltas:
                if delta.finish_reason:
                    del sequences[delta.request_id]
            if deltas:
                step += 1
                yield target_pb2.ServeEvent(deltas=deltas, stats=target_pb2.StepStats(
                    step=step, batch_size=len(deltas), speculated=True))

    def _take(self, inbox: queue.Queue[target_pb2.ServeRequest],
              sequences: dict[int, _Sequence]) -> list[target_pb2.TokenDelta]:
        """The requests waiting in inbox; returns the refusals of admits (see ``refusal``)."""
        refused = []
        while not inbox.empty():
            request = inbox.get()
            kind = request.WhichOneof("kind")
            with self._lock:
                if kind == "admit":
                    self.admits.append(request.admit)
                    if self.refusal is not None:
                        refused.append(target_pb2.TokenDelta(request_id=request.admit.request_id))
                        refused[-1].MergeFrom(self.refusal)
                    else:
                        sequences[request.admit.request_id] = _Sequence(request.admit)
                elif kind == "cancel":
                    self.cancels.append(request.cancel.request_id)
                    if request.cancel.request_id in sequences:
                        sequences[request.cancel.request_id].is_cancelled = True
                elif kind == "policy":
                    self.policies.append(request.policy)
        return refused

    def _advance(self, seq: _Sequence) -> target_pb2.TokenDelta:
        admit = seq.admit
        delta = target_pb2.TokenDelta(request_id=admit.request_id)
        if seq.is_cancelled:
            delta.finish_reason = common_pb2.FINISH_REASON_CANCELLED
        else:
            for _ in range(self.tokens_per_step):
                token_id = self.script_ids[seq.num_generated % len(self.script_ids)]
                delta.token_ids.append(token_id)
                seq.num_generated += 1
                is_eos = token_id in self.eos_token_ids and not admit.ignore_eos
                if is_eos or token_id in admit.stop_token_ids:
                    delta.finish_reason = common_pb2.FINISH_REASON_EOS
                elif seq.num_generated >= admit.max_new_tokens:
                    delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                if delta.finish_reason:
                    break
        if seq.num_generated == len(delta.token_ids) and delta.token_ids:
            delta.queue_s = 0.001
        if delta.finish_reason:
            delta.spec.CopyFrom(common_pb2.SpecStats(
                verify_steps=2, drafted_tokens=8, accepted_tokens=3, mean_accepted_length=1.5))
        return delta


def _pump(requests: Iterator[target_pb2.ServeRequest],
          inbox: queue.Queue[target_pb2.ServeRequest]) -> bool:
    """Move the gateway's requests into inbox; False when the stream broke."""
    try:
        for request in requests:
            inbox.put(request)
    except grpc.RpcError:  # the gateway closed or broke the stream: Serve ends too
        return False
    return True


def serve_fake_target(target: FakeTarget) -> ServiceServer:
    """Start the fake target on a free port; health SERVING."""
    server = ServiceServer("127.0.0.1:0", 16, ["splitspec.v1.Target"])
    target_pb2_grpc.add_TargetServicer_to_server(target, server.server)
    server.start()
    server.set_serving()
    return server
