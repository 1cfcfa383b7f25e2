"""OpenTelemetry through the three services, exported over OTLP/gRPC to a real receiver.

One request yields one trace with spans from the gateway, the target and the
draft, each parented correctly (the client's traceparent at the top), with the
GenAI and SplitSpec attributes; the metrics arrive under their names; a failed
init step is an errored span; and nothing is installed when OTEL_* is unset.
"""

from __future__ import annotations

import grpc
import pytest

from splitspec import telemetry
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.otlp_receiver import OTLPReceiver
from tests.stack import Service

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
GENAI_ATTRIBUTES = {"gen_ai.operation.name", "gen_ai.request.model", "gen_ai.request.max_tokens",
                    "gen_ai.request.temperature", "gen_ai.usage.input_tokens",
                    "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons"}
STEP_ATTRIBUTES = {"splitspec.batch_size", "splitspec.speculation", "splitspec.tree_size",
                   "splitspec.accepted_tokens", "splitspec.forward_s", "splitspec.forward_launch_s",
                   "splitspec.forward_launch_cpu_s", "splitspec.draft_unavailable",
                   "splitspec.draft_s"}
GATEWAY_METRICS = {"gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
                   "gen_ai.server.request.duration"}
TARGET_METRICS = {"splitspec.target.step.duration", "splitspec.target.batch_size",
                  "splitspec.target.steps", "splitspec.target.accepted_length",
                  "splitspec.target.tree.depth_reached", "splitspec.target.tree.depth_accepted"}


def test_exporting_only_when_the_environment_asks():
    assert not telemetry.wanted({})
    assert telemetry.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert telemetry.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not telemetry.wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    assert not telemetry.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                 "OTEL_SDK_DISABLED": "true"})


def test_traceparent_round_trip():
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01".encode()
    span_context = telemetry.span_context_of(parent)
    assert format(span_context.trace_id, "032x") == CLIENT_TRACE
    assert format(span_context.span_id, "016x") == CLIENT_SPAN
    assert telemetry.context_from(b"") is None and telemetry.context_from(b"garbage") is None


@pytest.fixture(scope="module")
def receiver():
    server = OTLPReceiver()
    yield server
    server.stop()


@pytest.mark.slow
def test_one_request_is_one_trace_across_three_processes(receiver, tmp_path):
    env = receiver.env()
    services = []
    try:
        draft = Service("draft_service", [], tmp_path, env=env).wait_serving()
        services.append(draft)
        target = Service("target_service", ["--draft", draft.address], tmp_path, env=env)
        services.append(target.wait_serving())
        gateway = Service("gateway", ["--target", target.address], tmp_path, env=env)
        services.append(gateway.wait_serving())
        with grpc.insecure_channel(gateway.address) as channel:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(
                    text="def fibonacci(n):\n", speculation=1,  # ON
                    stopping=gateway_pb2.StoppingParams(max_new_tokens=16, ignore_eos=True)),
                metadata=[("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")], timeout=60)
        assert reply.usage.completion_tokens == 16

        def trace_complete(r: OTLPReceiver) -> bool:
            names = {s.name for s in r.spans if s.trace_id == CLIENT_TRACE}
            return {"draft.exchange", "target.step", "target.sequence"} <= names and any(
                n.startswith("text_completion") for n in names)

        assert receiver.wait_for(trace_complete), sorted({s.name for s in receiver.spans})
        assert receiver.wait_for(lambda r: r.metric_names.get(
            "splitspec-gateway", set()) >= GATEWAY_METRICS and r.metric_names.get(
            "splitspec-target", set()) >= TARGET_METRICS), receiver.metric_names
    finally:
        for service in reversed(services):
            service.stop()
    spans = [s for s in receiver.spans if s.trace_id == CLIENT_TRACE]
    assert {s.service for s in spans} == {"splitspec-gateway", "splitspec-target",
                                          "splitspec-draft"}
    by_id = {s.span_id: s for s in spans}
    for span in spans:  # every parent is in the trace, except the client's own span
        assert span.parent_span_id in by_id or span.parent_span_id == CLIENT_SPAN, span
    (request,) = [s for s in spans if s.name.startswith("text_completion")]
    assert request.parent_span_id == CLIENT_SPAN and request.service == "splitspec-gateway"
    assert set(request.attributes) >= GENAI_ATTRIBUTES, request.attributes
    assert request.attributes["gen_ai.usage.output_tokens"] == 16
    assert {"splitspec.queue_s", "splitspec.time_to_first_token_s", "splitspec.speculation_mode",
            "splitspec.spec.accepted_length"} <= set(request.attributes)
    (sequence,) = [s for s in spans if s.name == "target.sequence"]
    assert sequence.parent_span_id == request.span_id
    steps = [s for s in spans if s.name == "target.step"]
    assert all(s.parent_span_id == sequence.span_id for s in steps)
    assert all(set(s.attributes) >= STEP_ATTRIBUTES for s in steps)
    assert all((CLIENT_TRACE, sequence.span_id) in s.links for s in steps)
    assert any(s.attributes["splitspec.speculation"] for s in steps)
    exchanges = [s for s in spans if s.name == "draft.exchange"]
    assert exchanges and all(by_id[s.parent_span_id].name == "target.step" for s in exchanges)
    assert all((CLIENT_TRACE, sequence.span_id) in s.links for s in exchanges)
    # Every service's start-up is traced too.
    startups = {s.service for s in receiver.spans if s.name.startswith("startup ")}
    assert startups == {"splitspec-gateway", "splitspec-target", "splitspec-draft"}


@pytest.mark.slow
def test_a_failed_init_step_is_an_errored_span(receiver, tmp_path):
    env = {**receiver.env(), "SPLITSPEC_INJECT_INIT_FAULT": "allocate_kv_cache",
           "OTEL_SERVICE_NAME": "failing-target"}
    target = Service("target_service", [], tmp_path, env=env)
    code, _ = target.wait_exit(timeout_s=60)
    assert code != 0

    def failed_spans(r: OTLPReceiver) -> list:
        return [s for s in r.spans if s.service == "failing-target" and s.status_code == 2]

    assert receiver.wait_for(lambda r: len(failed_spans(r)) >= 2)
    names = {s.name for s in failed_spans(receiver)}
    assert names == {"init allocate_kv_cache", "startup target"}
    (step,) = [s for s in failed_spans(receiver) if s.name == "init allocate_kv_cache"]
    assert "exception" in step.events
