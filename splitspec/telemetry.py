"""OpenTelemetry for the three services: configured only by the standard OTEL_* variables.

:func:`setup` installs the SDK (OTLP exporters, gRPC by default) when the
environment asks for an exporter (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``..._METRICS_ENDPOINT``, or
``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` other than ``none``) and
``OTEL_SDK_DISABLED`` is not true. Otherwise nothing is installed and the API's
no-op tracer and meter stay in place: a span costs one function call.
Endpoint, headers, TLS, batching and export intervals come from the SDK's own
OTEL_* variables; ``OTEL_SERVICE_NAME`` overrides the service's default name.

W3C trace context crosses the services in the messages themselves
(``Admit.traceparent``, ``DraftRequest.traceparent``), because the gRPC
streams are long-lived: one stream carries many requests and steps.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Link, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_providers: list[object] = []  # the SDK providers setup() installed, for flush()


def enabled() -> bool:
    """Whether setup() installed the SDK (hot paths skip building attributes otherwise)."""
    return bool(_providers)

# Bucket boundaries of the GenAI semantic conventions (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                1.024)


def wanted(env: dict[str, str] | None = None) -> bool:
    """Whether the OTEL_* environment asks for traces or metrics to be exported."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if any(env.get(name) for name in endpoints):
        return True
    return any(env.get(name, "none").strip().lower() not in ("", "none")
               for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"))


def setup(service: str) -> bool:
    """Install the SDK for this process when the environment asks for it; True if it did."""
    if not wanted():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or f"splitspec-{service}"
    resource = Resource.create({"service.name": name, "service.namespace": "splitspec"})
    tracer_provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() != "none":
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(tracer_provider)
    readers = []
    if os.environ.get("OTEL_METRICS_EXPORTER", "otlp").lower() != "none":
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meter_provider)
    _providers.extend((tracer_provider, meter_provider))
    log.info("OpenTelemetry: exporting as %s over OTLP", name)
    return True


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered (before the process exits, e.g. after a failed start-up)."""
    for provider in _providers:
        provider.force_flush(timeout_ms)


def shutdown() -> None:
    for provider in _providers:
        provider.shutdown()
    _providers.clear()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(name)


def traceparent(span: Span | None = None) -> bytes:
    """The W3C traceparent of span (default: the current one) as bytes; b"" when not recording."""
    span = span or trace.get_current_span()
    if not span.get_span_context().is_valid:
        return b""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "").encode()


def context_from(parent: bytes | str) -> otel_context.Context | None:
    """The context a traceparent names (None when empty or malformed)."""
    if not parent:
        return None
    text = parent.decode() if isinstance(parent, bytes) else parent
    ctx = _PROPAGATOR.extract({"traceparent": text})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def span_context_of(parent: bytes | str) -> SpanContext | None:
    ctx = context_from(parent)
    return trace.get_current_span(ctx).get_span_context() if ctx is not None else None


def links_to(parents: list[bytes]) -> list[Link]:
    """Links to the spans the traceparents name (the requests a step served)."""
    out = []
    for parent in parents:
        span_context = span_context_of(parent)
        if span_context is not None:
            out.append(Link(span_context))
    return out
