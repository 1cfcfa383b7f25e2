"""A service process's signals and its end. SIGTERM and SIGINT for a service's main thread:
the first asks for a graceful stop (the gateway and the target drain their requests in
flight), a later one cuts that short. A crash in native code prints every thread's Python
stack; a service that has stopped itself leaves without the interpreter's teardown."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import NoReturn


class StopSignals:
    """SIGTERM and SIGINT, counted: ``first`` is set by the first, ``again`` by any later;
    ``wake`` (when given) by every one, for a main thread that waits on other events too."""

    def __init__(self, wake: threading.Event | None = None) -> None:
        self.first, self.again = threading.Event(), threading.Event()
        self.wake = wake
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        (self.again if self.first.is_set() else self.first).set()
        if self.wake is not None:
            self.wake.set()


def report_fatal_signals() -> None:
    """On SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL (a crash in gRPC's, torch's or a kernel's
    native code), print every thread's Python stack to stderr, the service's log, before the
    process dies: the log then says which thread was where, not only the signal."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


def leave(code: int) -> NoReturn:
    """End a service's process with exit status ``code`` once it has stopped itself (its
    server stopped, its engine thread joined, its channels closed, its spans exported): the
    log and the standard streams are flushed, and the interpreter's teardown is skipped.
    That teardown, with gRPC's and torch's native threads still running, once aborted a
    target that had drained and stopped cleanly ("terminate called without an active
    exception", exit -6, in CI's run of test_e2e's SIGTERM test); nothing the service owns is
    left for it to do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
