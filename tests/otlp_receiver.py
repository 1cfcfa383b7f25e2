"""A real OTLP/gRPC endpoint for tests: it keeps every span and metric the services export."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str          # resource attribute service.name
    name: str
    trace_id: str         # hex
    span_id: str
    parent_span_id: str   # "" for a root span
    attributes: dict
    status_code: int      # 0 unset, 1 ok, 2 error
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    events: list[str] = field(default_factory=list)


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: object) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer,
                   metrics_service_pb2_grpc.MetricsServiceServicer):
    """Listens on 127.0.0.1:<port>; ``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metric_names: dict[str, set[str]] = {}  # service -> metric names
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """OTEL_* variables that point a service here, exporting quickly."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500"}

    def Export(self, request: object, context: grpc.ServicerContext) -> object:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self._take_spans(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self._take_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def _take_spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(ReceivedSpan(
                            service, s.name, s.trace_id.hex(), s.span_id.hex(),
                            s.parent_span_id.hex(), _attributes(s.attributes), s.status.code,
                            [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            [e.name for e in s.events]))

    def _take_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self._lock:
            for resource_metrics in request.resource_metrics:
                service = _attributes(resource_metrics.resource.attributes).get("service.name", "")
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        self.metric_names.setdefault(service, set()).add(metric.name)

    def wait_for(self, done: Callable[[OTLPReceiver], bool], timeout_s: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if done(self):
                    return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        self.server.stop(0)
