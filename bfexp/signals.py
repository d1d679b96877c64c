"""The driver's stop signals: SIGINT, SIGTERM, SIGHUP and SIGUSR1 (Ctrl-C, `kill`, a closed terminal, Slurm's
warning before a time limit), and output that outlives its reader.

During a job a signal is a flag the watch loop acts on (bfexp.launch: the
first asks the ranks to stop at their next logging step and write a
checkpoint, a second ends them at once); outside a job it raises
Interrupted where the driver is. Code the driver runs before a job may
swallow that exception (a library's bare ``except:`` around an optional
import, say): a job then refuses to begin while a signal received outside
any job has not ended the driver. A driver started under ``nohup`` (SIGHUP
ignored) keeps ignoring SIGHUP. A closed terminal or pipe (``bfexp ... |
head -1``: EPIPE; a hung-up terminal: EIO) does not end the run: what the
driver prints from then on goes nowhere (``tolerate_closed_output``).
Standard library only: the CLI installs these before anything heavy is
imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator

from bfexp.errors import Interrupted

__all__ = ["SIGNALS", "STOP_SIGNALS", "Signals", "tolerate_closed_output"]

# What the driver answers: Ctrl-C, kill, a closed terminal, and Slurm's warning before a time limit.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class Signals:
    """The signals the driver received, and whether a job is under way to act on them.

    ``install`` (the CLI, for its whole run) or a ``job()`` block (a library
    caller) puts the handlers in place.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._depth = 0  # job() blocks under way (they nest: launch, then the engine's watch loop)
        self.job_start = 0  # signals received before the job began (each acted on then)
        self.outside: int | None = None  # the latest signal received outside a job
        self._old: dict[int, Any] = {}

    @property
    def in_job(self) -> bool:
        return self._depth > 0

    def install(self) -> None:
        self.outside = None  # a new run of the driver (the CLI installs at its start)
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN and sig not in self._old:
                continue  # nohup: the user asked to outlive the terminal
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
            self.outside = signum
            raise Interrupted(signum)

    @contextlib.contextmanager
    def job(self) -> Iterator["Signals"]:
        """While ranks run: signals are flags the watch loop acts on."""
        installed = bool(self._old)
        if not installed:
            self.install()
        if not self._depth:
            if self.outside is not None:  # its Interrupted was swallowed on the way: act on it now
                signum, self.outside = self.outside, None
                if not installed:
                    self.restore()
                raise Interrupted(signum)
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


class _Outliving:
    """A text stream whose writes stop failing once its reader is gone: the first EPIPE or EIO points the
    file descriptor at /dev/null (the buffered text goes there too) and the program goes on."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _closed(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:  # BrokenPipeError, or EIO from a hung-up terminal
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._closed()
            with contextlib.suppress(OSError):
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tolerate_closed_output() -> None:
    """stdout and stderr outlive a closed pipe or terminal (see the module doc)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Outliving):
            setattr(sys, name, _Outliving(stream))
