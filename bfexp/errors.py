"""Whose fault an error is, said by its type (as Horovod's common/exceptions.py does).

* ``ConfigError`` and its family: the user's input cannot run. The CLI prints
  the message as one line and exits 2 (EXIT_BAD_INPUT), before any rank
  starts. The message names the bad value and what is allowed:
  ``key=value; allowed: ...``.
* ``LaunchError``: the input is fine but this machine or cluster cannot
  start the job: no mpiexec or srun, a host that does not resolve or answer
  ssh, no GPU for engine=nccl, no Slurm allocation. One line, exit 3
  (EXIT_ENVIRONMENT), before any rank starts.
* A job that ran and failed (a rank raised, hung or died) is no exception
  in the driver: its summary says why and the CLI exits 1 (EXIT_JOB_FAILED).
* ``Interrupted``: a stop signal; the CLI exits 128 + the signal's number.
* ``CommError``: ranks disagree on a communication (a mismatched neighbor
  pattern); raised on every rank at run time instead of a hang.
  ``RankAborted``: raised in a virtual rank because another one failed or
  the job was stopped. ``Hung``: virtual ranks the hang watchdog found stuck
  (bfexp-run ends with it, exit 1).
* Anything else is a bug in bfexp (or in the user's own code) and shows its
  traceback.

``number_in`` is the one range check of a numeric option (its message
included): every component checks its numbers with it. ``text_of`` is the
one read of a user's text file (an edge list, a hostfile): a file that
cannot be read or decoded is one line naming it.

This module imports only the standard library: every layer may raise these.
"""

from __future__ import annotations

import math
import numbers
import signal
from typing import Any

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_ENVIRONMENT",
    "EXIT_JOB_FAILED",
    "BfexpError",
    "CommError",
    "ConfigError",
    "DatasetError",
    "Hung",
    "Interrupted",
    "LaunchError",
    "NoJobsError",
    "NotUndirected",
    "RankAborted",
    "TopologyError",
    "TopologyMismatch",
    "number_in",
    "text_of",
]

EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3


class BfexpError(Exception):
    """Base of bfexp's own exceptions."""


class ConfigError(BfexpError, ValueError):
    """A config value that cannot run; the message names the value and what is allowed (exit 2)."""


class TopologyError(ConfigError):
    """A graph that cannot be built for this rank count or with these weights."""


class TopologyMismatch(ConfigError):
    """A topology the algorithm's theory does not cover; the message says why and what would."""


class DatasetError(ConfigError):
    """A data set that cannot be loaded as configured (missing files, too few samples for the ranks)."""


class NotUndirected(ConfigError):
    """Metropolis-Hastings weights asked for on a graph with a one-way edge."""


class NoJobsError(ConfigError):
    """A folder given to bfexp-report holds no job directories."""


class LaunchError(BfexpError):
    """The environment cannot start the job as asked (no mpiexec or srun, a host that does not answer,
    no GPU for engine=nccl, no Slurm allocation): not the input's fault, exit 3."""


class CommError(BfexpError, RuntimeError):
    """A communication pattern that cannot complete (e.g. mismatched neighbors), raised on every rank."""


class RankAborted(RuntimeError):
    """Raised in a rank thread because another rank failed or the job was stopped."""


class Hung(BfexpError):
    """Virtual ranks that the hang watchdog found stuck (the message names them and their calls)."""


class Interrupted(BaseException):
    """The driver got a stop signal outside a running job (composing, checking, writing results),
    or a job ended because of one: the driver ends with exit status 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def number_in(key: str, value: Any, *, low: float | None = None, high: float | None = None,
              low_open: bool = False, high_open: bool = False, integer: bool = False, note: str = "",
              error: type[Exception] = ConfigError) -> Any:
    """Raise ``error`` (one line: ``key=value; allowed: ...`` with the range) unless ``value`` is a
    finite number in the range (an int when ``integer``: 2.0 is not; a bool is neither); returns ``value``.
    ``note`` follows the range, e.g. "(0 = off)"."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (not integer or isinstance(value, numbers.Integral))  # numpy's integers too
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        if low is not None and high is not None:
            bounds = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            bounds = f" {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            bounds = f" {'<' if high_open else '<='} {high:g}"
        else:
            bounds = ""
        raise error(f"{key}={value!r}; allowed: {kind}{bounds}{' ' + note if note else ''}")
    return value


def text_of(path: Any, key: str, allowed: str, error: type[Exception] = ConfigError, limit: int | None = None) -> str:
    """A user's text file as UTF-8 text; ``error`` (one line: ``key=path cannot be read (why); allowed: ...``)
    for a file that is missing, a folder, unreadable, not text (undecodable bytes), not a regular file (a
    FIFO, /dev/zero: refused without blocking or reading) or over ``limit`` bytes (default 2 GiB)."""
    from bfexp.files import GiB, read_file

    try:
        return read_file(path, 2 * GiB if limit is None else limit).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = f"{type(e).__name__}: {e.strerror}" if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise error(f"{key}={path} cannot be read ({why}); allowed: {allowed}") from None
