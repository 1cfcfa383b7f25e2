"""Start-up as a sequence of named steps, recorded in one structured report.

A service runs each step through :meth:`Startup.step`. The step's result is
returned to the caller, which builds the next component only from finished
results; a step that raises is recorded (type, message, traceback), logged, and
turned into :class:`InitFailed`, which the service's ``main`` turns into a JSON
report on stderr, an optional report file and a non-zero exit.

Fault injection for tests: ``SPLITSPEC_INJECT_INIT_FAULT=<step>`` (or
``<step>@<rank>``, several separated by commas) makes that step raise
:class:`InjectedFault` before it runs.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from splitspec import telemetry
from splitspec.v1 import common_pb2

log = logging.getLogger(__name__)

FAULT_ENV = "SPLITSPEC_INJECT_INIT_FAULT"
_TRACER = telemetry.tracer("splitspec.startup")

T = TypeVar("T")


class StepState(enum.Enum):
    PENDING = common_pb2.STEP_STATE_PENDING
    RUNNING = common_pb2.STEP_STATE_RUNNING
    OK = common_pb2.STEP_STATE_OK
    FAILED = common_pb2.STEP_STATE_FAILED
    SKIPPED = common_pb2.STEP_STATE_SKIPPED


class InjectedFault(RuntimeError):
    """Raised by a step named in SPLITSPEC_INJECT_INIT_FAULT."""


class InitFailed(Exception):
    """A start-up step failed; ``report`` says which, where and why."""

    def __init__(self, report: InitReport) -> None:
        super().__init__(describe_failure(report))
        self.report = report


def describe_failure(report: InitReport) -> str:
    """'<service> rank <r> failed to start at step <name>: <type>: <message>', for the first
    failed step of the process, else of the first failed rank it gathered."""
    failure = report.first_failure()
    if failure is None:
        return f"{report.service} rank {report.rank} failed to start"
    where, step = failure
    return (f"{where.service} rank {where.rank} failed to start at step {step.name!r}: "
            f"{step.error_type}: {step.error_message}")


@dataclass
class StepRecord:
    name: str
    state: StepState = StepState.PENDING
    duration_s: float = 0.0
    detail: str = ""
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""

    def to_pb(self) -> common_pb2.InitStep:
        return common_pb2.InitStep(
            name=self.name,
            state=self.state.value,
            duration_s=self.duration_s,
            detail=self.detail,
            error_type=self.error_type,
            error_message=self.error_message,
            traceback=self.traceback,
        )

    @classmethod
    def from_pb(cls, pb: common_pb2.InitStep) -> StepRecord:
        return cls(
            name=pb.name,
            state=StepState(pb.state),
            duration_s=pb.duration_s,
            detail=pb.detail,
            error_type=pb.error_type,
            error_message=pb.error_message,
            traceback=pb.traceback,
        )


@dataclass
class InitReport:
    service: str
    rank: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    started_at_unix_s: float = field(default_factory=time.time)
    ranks: list[InitReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every step of this process and of every gathered rank finished (or was skipped)."""
        own = all(s.state in (StepState.OK, StepState.SKIPPED) for s in self.steps)
        return own and all(r.ok for r in self.ranks)

    @property
    def failed_step(self) -> StepRecord | None:
        """The first failed step of this process, else of the first failed rank."""
        failure = self.first_failure()
        return failure[1] if failure is not None else None

    def first_failure(self) -> tuple[InitReport, StepRecord] | None:
        """(the report of the process that failed, its failed step): this process first,
        then the gathered ranks in order."""
        for step in self.steps:
            if step.state is StepState.FAILED:
                return self, step
        for rank in self.ranks:
            failure = rank.first_failure()
            if failure is not None:
                return failure
        return None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for step in data["steps"]:
            step["state"] = step["state"].name
        data["ranks"] = [r.to_dict() for r in self.ranks]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_pb(self) -> common_pb2.InitReport:
        return common_pb2.InitReport(
            service=self.service,
            rank=self.rank,
            ok=self.ok,
            steps=[s.to_pb() for s in self.steps],
            started_at_unix_s=self.started_at_unix_s,
            ranks=[r.to_pb() for r in self.ranks],
        )

    @classmethod
    def from_pb(cls, pb: common_pb2.InitReport) -> InitReport:
        return cls(
            service=pb.service,
            rank=pb.rank,
            steps=[StepRecord.from_pb(s) for s in pb.steps],
            started_at_unix_s=pb.started_at_unix_s,
            ranks=[cls.from_pb(r) for r in pb.ranks],
        )


def injected_faults(rank: int, env: dict[str, str] | None = None) -> set[str]:
    """Step names that must fail on this rank, from SPLITSPEC_INJECT_INIT_FAULT."""
    spec = (env if env is not None else os.environ).get(FAULT_ENV, "")
    names = set()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, only_rank = item.partition("@")
        if not only_rank or int(only_rank) == rank:
            names.add(name)
    return names


class Startup:
    """Runs and records the named start-up steps of one process.

    The planned step names are listed up front so that the report shows what
    was never reached (PENDING) when an earlier step fails.
    """

    def __init__(self, service: str, step_names: list[str], rank: int = 0,
                 on_change: Callable[[InitReport], None] | None = None) -> None:
        self.report = InitReport(service=service, rank=rank)
        self.report.steps = [StepRecord(name) for name in step_names]
        self.on_change = on_change  # told of every step that starts, ends or is skipped
        # One span for the start-up, one child span per step (an errored one when it fails).
        self._span = _TRACER.start_span(f"startup {service}", attributes={
            "splitspec.service": service, "splitspec.rank": rank})
        self._span_open = True
        self._faults = injected_faults(rank)
        unknown = self._faults - set(step_names)
        if unknown:
            log.warning("%s ignores unknown steps in %s: %s", service, FAULT_ENV, sorted(unknown))

    def _record(self, name: str) -> StepRecord:
        for step in self.report.steps:
            if step.name == name:
                return step
        raise KeyError(f"step {name!r} is not among the planned steps of {self.report.service}")

    def step(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one step and return its result; raise InitFailed when it raises.

        ``fn`` may return ``(result, detail)`` through :class:`Detailed` to put a
        short description of what it built into the report.
        """
        record = self._record(name)
        record.state = StepState.RUNNING
        self._changed()
        log.info("%s rank %d: %s ...", self.report.service, self.report.rank, name)
        start = time.perf_counter()
        try:
            with _TRACER.start_as_current_span(
                    f"init {name}", context=telemetry.trace.set_span_in_context(self._span),
                    attributes={"splitspec.service": self.report.service,
                                "splitspec.rank": self.report.rank, "splitspec.step": name}):
                if name in self._faults:
                    raise InjectedFault(f"fault injected into {name} by {FAULT_ENV}")
                result = fn(*args, **kwargs)
        except Exception as exc:  # becomes a failed init step, logged here
            record.duration_s = time.perf_counter() - start
            record.state = StepState.FAILED
            record.error_type = type(exc).__name__
            record.error_message = str(exc)
            record.traceback = traceback.format_exc()
            log.error(
                "%s rank %d: step %s failed: %s: %s",
                self.report.service, self.report.rank, name, record.error_type, exc,
            )
            self._changed()
            self._end_span(f"step {name} failed: {record.error_type}: {exc}")
            raise InitFailed(self.report) from exc
        record.duration_s = time.perf_counter() - start
        record.state = StepState.OK
        if isinstance(result, Detailed):
            record.detail = result.detail
            result = result.value
        self._changed()
        log.info("%s rank %d: %s ok (%.2fs) %s", self.report.service, self.report.rank, name,
                 record.duration_s, record.detail)
        return result

    def skip(self, name: str, why: str) -> None:
        """Record a step that this configuration does not need."""
        if name in self._faults:
            # An injected fault must fail even a skipped step: tests rely on every step failing.
            self.step(name, lambda: None)
        record = self._record(name)
        record.state = StepState.SKIPPED
        record.detail = why
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.report)
        if self._span_open and all(s.state in (StepState.OK, StepState.SKIPPED)
                                   for s in self.report.steps):
            self._end_span("")

    def _end_span(self, error: str) -> None:
        """End the start-up span, errored when a step failed (whoever fails the start-up
        exports it before the process exits: fail_startup, or the TP rank watcher)."""
        if not self._span_open:
            return
        self._span_open = False
        if error:
            self._span.set_status(telemetry.trace.StatusCode.ERROR, error)
        self._span.end()


@dataclass
class Detailed:
    """A step result with a short description for the report."""

    value: Any
    detail: str


def fail_startup(error: InitFailed, report_path: Path | None) -> int:
    """Print the report as JSON to stderr, write it to report_path; return the exit code."""
    text = error.report.to_json()
    telemetry.flush()
    print(text, file=sys.stderr, flush=True)
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(text)
    log.error("%s", error)
    return 1


def write_report(report: InitReport, report_path: Path | None) -> None:
    """Write a successful report to report_path when one was asked for."""
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(report.to_json())
