"""SIGTERM and SIGINT for a service's main thread: the first asks for a graceful stop (the
gateway and the target drain their requests in flight), a later one cuts that short."""

from __future__ import annotations

import signal
import threading


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
