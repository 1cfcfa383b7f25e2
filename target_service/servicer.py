"""gRPC face of the target: Serve (the gateway's stream), GetInfo, GetInitReport."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc

from splitspec.init_report import InitReport
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import Engine

log = logging.getLogger(__name__)


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, engine: Engine, info: target_pb2.TargetInfo, report: InitReport) -> None:
        self.engine = engine
        self.info = info
        self.report = report

    def Serve(self, request_iterator: Iterator[target_pb2.ServeRequest],
              context: grpc.ServicerContext) -> Iterator[target_pb2.ServeEvent]:
        if self.engine.failure:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.failure)
        stream_id, outbox = self.engine.open_stream()
        log.info("gateway stream %d opened by %s", stream_id, context.peer())
        threading.Thread(target=self._pump, args=(stream_id, request_iterator), daemon=True,
                         name=f"serve-{stream_id}").start()
        def ended() -> None:  # the call is over (the gateway left, or this server stops):
            self.engine.close_stream(stream_id)
            outbox.put(None)  # this thread stops waiting, whether or not the engine still runs

        context.add_callback(ended)
        while (event := outbox.get()) is not None:
            yield event
        if self.engine.failure:
            log.error("gateway stream %d ends: %s", stream_id, self.engine.failure)
            context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.failure)
        log.info("gateway stream %d closed", stream_id)

    def _pump(self, stream_id: int, requests: Iterator[target_pb2.ServeRequest]) -> None:
        try:
            for request in requests:
                self.engine.submit(stream_id, request)
        except grpc.RpcError as exc:  # the gateway went away: its sequences are freed below
            # (grpcio raises it here without a message: say what it means)
            log.info("gateway stream %d ended: %s", stream_id,
                     str(exc) or "the call was cancelled or broken")
        finally:
            self.engine.close_stream(stream_id)

    def GetInfo(self, request: target_pb2.GetTargetInfoRequest,
                context: grpc.ServicerContext) -> target_pb2.TargetInfo:
        """The target's info; its draft_report is the draft's latest (a restarted draft's)."""
        report = self.engine.draft.report if self.engine.draft is not None else None
        if report is None or report == self.info.draft_report:
            return self.info
        info = target_pb2.TargetInfo()
        info.CopyFrom(self.info)
        info.draft_report.CopyFrom(report)
        return info

    def GetInitReport(self, request: common_pb2.GetInitReportRequest,
                      context: grpc.ServicerContext) -> common_pb2.InitReport:
        return self.report.to_pb()
