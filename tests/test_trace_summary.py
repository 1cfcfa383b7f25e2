"""splitspec trace-summary: decode-latency percentiles from OTLP/JSON lines of step spans."""

from __future__ import annotations

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from splitspec.cli import main
from splitspec.trace_summary import bucket, read_steps, summarize


def step_span(batch: int, speculated: bool, draft_ms: float, forward_ms: float, total_ms: float,
              accepted: int = 0) -> dict:
    values = {"splitspec.batch_size": AnyValue(int_value=batch),
              "splitspec.speculation": AnyValue(bool_value=speculated),
              "splitspec.draft_s": AnyValue(double_value=draft_ms / 1000),
              "splitspec.forward_s": AnyValue(double_value=forward_ms / 1000),
              "splitspec.total_s": AnyValue(double_value=total_ms / 1000),
              "splitspec.accepted_tokens": AnyValue(int_value=accepted)}
    return {"name": "target.step", "attributes": [KeyValue(key=k, value=v) for k, v in values.items()]}


def export_line(spans: list[dict]) -> str:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for span in spans:
        s = scope.spans.add(name=span["name"])
        s.attributes.extend(span["attributes"])
    scope.spans.add(name="draft.exchange")  # other spans are ignored
    return json_format.MessageToJson(request, indent=None)


def test_percentiles_per_mode_and_batch_bucket(tmp_path):
    spec = [step_span(1, True, 2.0 + i % 3, 5.0, 8.0 + i % 3, accepted=2) for i in range(30)]
    plain = [step_span(3, False, 0.0, 4.0, 4.5) for _ in range(10)]
    path = tmp_path / "spans.jsonl"
    path.write_text(export_line(spec[:15]) + "\n" + export_line(spec[15:] + plain) + "\n\n")
    with path.open() as f:
        steps = list(read_steps(f))
    assert len(steps) == 40
    rows = summarize(steps)
    assert [(r["speculation"], r["batch"], r["steps"]) for r in rows] == [("off", "3-4", 10),
                                                                          ("on", "1", 30)]
    on = rows[1]
    assert on["draft_p50_ms"] == 3.0 and on["forward_p90_ms"] == 5.0
    assert abs(on["bookkeeping_p50_ms"] - 1.0) < 1e-9 and on["accepted_per_step"] == 2
    assert abs(rows[0]["bookkeeping_p99_ms"] - 0.5) < 1e-9


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == ["1", "2", "3-4", "3-4", "5-8", "5-8",
                                                             "9-16", "33-64"]


def test_command_prints_the_table_and_refuses_bad_input(tmp_path, capsys):
    good = tmp_path / "spans.jsonl"
    good.write_text(export_line([step_span(2, True, 1.0, 2.0, 3.5, 1)]) + "\n")
    assert main(["trace-summary", str(good)]) == 0
    out = capsys.readouterr().out
    assert "draft p50/p90/p99 ms" in out
    assert out.splitlines()[2].split()[:3] == ["on", "2", "1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["trace-summary", str(bad)]) == 2
    assert "line 1 is not an OTLP/JSON trace export" in capsys.readouterr().err
    assert main(["trace-summary", str(tmp_path / "missing.jsonl")]) == 2
