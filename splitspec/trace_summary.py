"""Decode latency from exported spans, for people without a trace backend.

Reads OTLP/JSON lines (what the OpenTelemetry collector's ``file`` exporter
writes: one ExportTraceServiceRequest per line, as in the compose stack's
``spans.jsonl``), takes the target's ``target.step`` spans and prints, per
kind of step (speculative or plain) and batch-size bucket, percentiles of
where a step's time goes: the draft exchange, the verify forward, and the
bookkeeping around them (acceptance, KV compaction, scheduling).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

STEP_SPAN = "target.step"
PERCENTILES = (50, 90, 99)


class Step(NamedTuple):
    batch_size: int
    speculated: bool
    draft_s: float
    forward_s: float
    total_s: float
    accepted: int

    @property
    def bookkeeping_s(self) -> float:
        return max(self.total_s - self.draft_s - self.forward_s, 0.0)


def _attributes(span: object) -> dict:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


def read_steps(lines: Iterable[str]) -> Iterator[Step]:
    """The decode steps (prefill-only steps left out) in OTLP/JSON lines."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        request = ExportTraceServiceRequest()
        try:
            json_format.Parse(line, request, ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise ValueError(f"line {number} is not an OTLP/JSON trace export: {exc}") from exc
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    if span.name != STEP_SPAN:
                        continue
                    a = _attributes(span)
                    if not a.get("splitspec.batch_size"):
                        continue
                    yield Step(int(a["splitspec.batch_size"]), bool(a["splitspec.speculation"]),
                               float(a["splitspec.draft_s"]), float(a["splitspec.forward_s"]),
                               float(a["splitspec.total_s"]), int(a["splitspec.accepted_tokens"]))


def bucket(batch_size: int) -> str:
    """1, 2, 3-4, 5-8, ... (powers of two)."""
    high = 1
    while high < batch_size:
        high *= 2
    low = high // 2 + 1 if high > 2 else high
    return str(high) if low == high else f"{low}-{high}"


def percentile(values: list[float], p: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def summarize(steps: Iterable[Step]) -> list[dict]:
    """One row per (speculated, batch bucket): step count and percentiles in milliseconds."""
    groups: dict[tuple[bool, str], list[Step]] = {}
    for step in steps:
        groups.setdefault((step.speculated, bucket(step.batch_size)), []).append(step)
    rows = []
    for (speculated, batch), group in sorted(groups.items(),
                                             key=lambda kv: (kv[0][0], int(kv[0][1].split("-")[-1]))):
        row = {"speculation": "on" if speculated else "off", "batch": batch, "steps": len(group),
               "accepted_per_step": statistics.fmean(s.accepted for s in group)}
        for part in ("draft_s", "forward_s", "bookkeeping_s", "total_s"):
            values = [getattr(s, part) for s in group]
            for p in PERCENTILES:
                row[f"{part.removesuffix('_s')}_p{p}_ms"] = 1000 * percentile(values, p)
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    """A plain-text table: per part, p50 / p90 / p99 in milliseconds."""
    if not rows:
        return "no target.step spans with decoding sequences found"
    parts = ("draft", "forward", "bookkeeping", "total")
    head = (f"{'spec':4} {'batch':>6} {'steps':>6} {'acc/step':>8}  "
            + "  ".join(f"{p + ' p50/p90/p99 ms':>26}" for p in parts))
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[f'{p}_p50_ms']:7.2f} {r[f'{p}_p90_ms']:8.2f} {r[f'{p}_p99_ms']:8.2f}"
                 for p in parts]
        lines.append(f"{r['speculation']:4} {r['batch']:>6} {r['steps']:>6} "
                     f"{r['accepted_per_step']:8.2f}  " + "  ".join(f"{c:>26}" for c in cells))
    lines.append("draft = the draft exchange as the target waited for it; forward = the verify "
                 "(or decode) forward; bookkeeping = the rest of the step")
    return "\n".join(lines)


def main_summary(path: Path, as_json: bool = False) -> str:
    with Path(path).open(encoding="utf-8") as f:
        rows = summarize(read_steps(f))
    return json.dumps(rows, indent=2) if as_json else render(rows)
