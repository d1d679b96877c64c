"""The driver's stop signals: SIGINT, SIGTERM and SIGUSR1 (Ctrl-C, `kill`, Slurm's warning before a time limit).

During a job a signal is a flag the watch loop acts on (bfexp.launch: the
first asks the ranks to stop at their next logging step and write a
checkpoint, a second ends them at once); outside a job it raises
Interrupted where the driver is. Standard library only: the CLI installs
these handlers before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Iterator

from bfexp.errors import Interrupted

__all__ = ["SIGNALS", "STOP_SIGNALS", "Signals"]

# What the driver answers: Ctrl-C, kill, and Slurm's warning before a time limit.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Signals:
    """The signals the driver received, and whether a job is under way to act on them.

    ``install`` (the CLI, for its whole run) or a ``job()`` block (a library
    caller) puts the handlers in place.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._depth = 0  # job() blocks under way (they nest: launch, then the engine's watch loop)
        self.job_start = 0  # signals received before the job began (each acted on then)
        self._old: dict[int, Any] = {}

    @property
    def in_job(self) -> bool:
        return self._depth > 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            try:
                self._old.setdefault(sig, signal.signal(sig, self._handle))
            except ValueError:  # not the main thread: the caller handles signals
                pass

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if not self.in_job:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def job(self) -> Iterator["Signals"]:
        """While ranks run: signals are flags the watch loop acts on."""
        installed = bool(self._old)
        if not installed:
            self.install()
        if not self._depth:
            self.job_start = len(self.received)
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if not installed:
                self.restore()

    def since(self, start: int) -> int | None:
        """The latest signal received after the first ``start`` ones, or None."""
        return self.received[-1] if len(self.received) > start else None


SIGNALS = Signals()
