"""Tensor-parallel ranks of the target: launching them, and failing fast when any fails.

``python -m target_service --tp N`` is rank 0: it spawns ranks 1..N-1 (start
method "spawn"), each with a pipe back to it, before running its own init
steps, so all ranks start up together. Every rank runs the same init steps;
a rank sends its :class:`InitReport` over its pipe whenever a step starts,
ends or is skipped, and "ready" once it serves rank 0's calls.

Rank 0's watcher thread waits on every pipe and every process sentinel at
once (``multiprocessing.connection.wait``), never on one rank after another:

- during start-up, a rank that reports a failed step or dies fails the whole
  service at once: the report of every rank is printed (and written to
  ``--init-report``) naming the rank and the step, every rank is killed, and
  rank 0 exits non-zero, even while its main thread is blocked in a
  collective with the dead rank;
- after start-up, a rank that dies calls ``on_lost``: rank 0 reports
  NOT_SERVING, ends the streams in flight with UNAVAILABLE and exits.

Ranks 1..N-1 die with rank 0 (PR_SET_PDEATHSIG), so nothing is left running.
Under ``torchrun`` (RANK and WORLD_SIZE set) the ranks are torchrun's; there,
torchrun stops every rank when one fails.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import NoReturn

from splitspec import telemetry
from splitspec.init_report import InitReport, StepState, describe_failure
from splitspec.signals import leave
from splitspec.v1 import common_pb2

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_address() -> str:
    """host:port of a free local TCP port, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class RankSet:
    """Ranks 1..N-1 as child processes of rank 0, and the thread that watches them."""

    def __init__(self, own: InitReport, size: int, target: Callable[..., None],
                 args: tuple, report_path: object = None) -> None:
        """Start ranks 1..size-1, each running ``target(rank, conn, *args)``."""
        self.own = own  # rank 0's report (its Startup keeps it up to date)
        self.report_path = report_path
        self.reports = {r: InitReport("target", r) for r in range(1, size)}
        self.ready: set[int] = set()
        self.all_ready = threading.Event()
        self.failed = threading.Event()
        self.serving = False
        self.on_lost: Callable[[str], None] | None = None
        self._lost = threading.Event()  # a rank died while serving (on_lost has run)
        self._stopping = False
        self._abort_lock = threading.Lock()
        ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, multiprocessing.Process] = {}
        self.conns: dict[int, Connection] = {}
        for rank in range(1, size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(rank, child_end, *args), name=f"target-rank{rank}")
            proc.start()
            child_end.close()  # else a dead child's pipe never reads EOF here
            self.procs[rank], self.conns[rank] = proc, parent_end
        if size == 1:
            self.all_ready.set()
        threading.Thread(target=self._watch, name="rank-watcher", daemon=True).start()

    def wait_ready(self) -> None:
        """Block until every rank is ready; a failed rank ends the process (see _abort)."""
        while not self.all_ready.wait(0.1):
            if self.failed.is_set():
                raise RuntimeError("a rank failed during start-up")

    def _watch(self) -> None:
        waitables: dict[object, int] = {}
        for rank, proc in self.procs.items():
            waitables[self.conns[rank]] = rank
            waitables[proc.sentinel] = rank
        while waitables:
            for obj in wait(list(waitables)):
                rank = waitables[obj]
                if isinstance(obj, Connection):
                    if not self._receive(rank, obj):
                        del waitables[obj]
                else:
                    del waitables[obj]
                    self._drain(rank)
                    self._died(rank)

    def _receive(self, rank: int, conn: Connection) -> bool:
        """Take one message; False at end of file (the rank closed its pipe or died)."""
        try:
            kind, data = conn.recv()
        except EOFError:  # the rank is gone: its sentinel fires too, and _died reports it
            return False
        report = InitReport.from_pb(common_pb2.InitReport.FromString(data))
        self.reports[rank] = report
        if kind == "failed":
            self._abort(describe_failure(report))
        elif kind == "ready":
            self.ready.add(rank)
            if len(self.ready) == len(self.procs):
                self.all_ready.set()
        return True

    def _drain(self, rank: int) -> None:
        """Take every message a dead rank sent before it exited. Its sentinel and its pipe
        turn ready together, and one message is taken per wait: judged on the last message
        taken, a rank that sent "step RUNNING", "step FAILED" and "failed" and then exited
        was once reported as having died between steps (CI's run of test_tp's fault at
        capture_cuda_graphs on rank 1, a no-op step on CPU, so all were sent at once)."""
        conn = self.conns[rank]
        while conn.poll() and self._receive(rank, conn):
            pass

    def _died(self, rank: int) -> None:
        code = self.procs[rank].exitcode
        if self._stopping:
            return
        if self.serving:
            message = f"target rank {rank} died (exit code {code}); the service cannot go on"
            log.error("%s", message)
            if self.on_lost is not None:
                self.on_lost(message)
            self._lost.set()
            return
        report = self.reports[rank]
        running = next((s for s in report.steps if s.state is StepState.RUNNING), None)
        if running is not None:
            running.state = StepState.FAILED
            running.error_type = "RankDied"
            running.error_message = f"the process exited with code {code} during this step"
        self._abort(describe_failure(report) if running is not None else
                    f"target rank {rank} exited with code {code} during start-up")

    def _abort(self, cause: str) -> NoReturn:
        """Fail start-up for every rank: print and write the report, kill the ranks, exit."""
        self.failed.set()
        with self._abort_lock:  # the watcher and the main thread may both get here
            self.own.ranks = [self.reports[r] for r in sorted(self.reports)]
            text = self.own.to_json()
            print(text, file=sys.stderr, flush=True)
            if self.report_path is not None:
                self.report_path.parent.mkdir(parents=True, exist_ok=True)
                self.report_path.write_text(text)
            log.error("start-up failed: %s", cause)
            self.kill()
            telemetry.flush()
            leave(1)

    def fail_startup(self, settle_s: float = 2.0) -> NoReturn:
        """Rank 0's own step failed: give the other ranks' reports a moment to arrive (a rank
        that failed first is the cause, and its report ends start-up from the watcher),
        then fail start-up with rank 0's failure."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and not self.failed.is_set():
            time.sleep(0.05)
        self._abort(describe_failure(self.own))

    def wait_lost(self, timeout_s: float) -> bool:
        """Whether a rank died while serving, waiting up to ``timeout_s`` for the watcher to
        see it (rank 0's engine fails in a collective at about the moment a rank dies)."""
        return self._lost.wait(timeout_s)

    def stopping(self) -> None:
        """Rank 0 is shutting down: ranks that exit from now on are not failures."""
        self._stopping = True

    def kill(self) -> None:
        """Stop every rank now (SIGKILL after a short SIGTERM grace)."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 2.0
        for proc in self.procs.values():
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)

    def join(self, timeout_s: float) -> None:
        """Wait for the ranks to exit after rank 0 told them to stop; kill what remains."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(deadline - time.monotonic(), 0.0))
        self.kill()


def send(conn: Connection | None, kind: str, report: InitReport) -> None:
    """A rank's message to rank 0 ("report", "failed" or "ready"); no pipe under torchrun."""
    if conn is not None:
        conn.send((kind, report.to_pb().SerializeToString()))
