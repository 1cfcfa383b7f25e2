"""Rank 0's watcher of ranks 1..N-1 (target_service.ranks.RankSet), on real child processes."""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection

from splitspec.init_report import InitFailed, InitReport, Startup, StepState
from target_service.ranks import RankSet, send
from target_service.startup import STEPS

FAILING = "capture_cuda_graphs"


def fail_at_once(rank: int, conn: Connection) -> None:
    """A rank that reports its steps, fails one, sends "failed" and exits, all at once (as
    a rank whose failing step is a no-op on CPU does)."""
    startup = Startup("target", STEPS, rank, on_change=lambda report: send(conn, "report", report))
    for name in STEPS[:STEPS.index(FAILING)]:
        startup.skip(name, "not run in this test")
    try:
        startup.step(FAILING, lambda: 1 / 0)
    except InitFailed as failed:
        send(conn, "failed", failed.report)
    conn.close()
    os._exit(1)


def die_in_a_step(rank: int, conn: Connection) -> None:
    """A rank that dies while a step runs, without a word."""
    startup = Startup("target", STEPS, rank, on_change=lambda report: send(conn, "report", report))
    startup.skip(STEPS[0], "not run in this test")
    startup.step(STEPS[1], lambda: os._exit(3))


class LateWatcher(RankSet):
    """A RankSet whose watcher starts only once every rank has exited (so that every
    message and the exit are there at its first look), and whose abort is recorded
    instead of ending this process."""

    def __init__(self, target) -> None:
        self.aborts: list[tuple[str, list[InitReport]]] = []
        self.aborted = threading.Event()
        super().__init__(InitReport("target", 0), 2, target, ())

    def _watch(self) -> None:
        for proc in self.procs.values():
            proc.join(60)
        super()._watch()

    def _abort(self, cause: str) -> None:
        self.aborts.append((cause, [self.reports[r] for r in sorted(self.reports)]))
        self.aborted.set()


def first_abort(target) -> tuple[str, InitReport]:
    ranks = LateWatcher(target)
    assert ranks.aborted.wait(60)
    cause, reports = ranks.aborts[0]
    return cause, reports[0]


def test_a_rank_that_failed_and_exited_is_judged_on_its_last_message():
    cause, report = first_abort(fail_at_once)
    assert cause.startswith(f"target rank 1 failed to start at step '{FAILING}': "
                            "ZeroDivisionError"), cause
    failed = [s for s in report.steps if s.state is StepState.FAILED]
    assert [(s.name, s.error_type) for s in failed] == [(FAILING, "ZeroDivisionError")]


def test_a_rank_that_died_in_a_step_is_named_with_that_step():
    cause, report = first_abort(die_in_a_step)
    assert cause.startswith(f"target rank 1 failed to start at step '{STEPS[1]}': RankDied"), cause
    assert "exited with code 3" in cause
