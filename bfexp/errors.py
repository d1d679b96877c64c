"""Whose fault an error is, said by its type (as Horovod's common/exceptions.py does).

* ``ConfigError`` and its family: the user's input cannot run. The CLI prints
  the message as one line and exits 2, before any rank starts. The message
  names the bad value and what is allowed: ``key=value; allowed: ...``.
* ``CommError``: ranks disagree on a communication (a mismatched neighbor
  pattern); raised on every rank at run time instead of a hang.
* Anything else is a bug in bfexp (or in the user's own code) and shows its
  traceback.

``number_in`` is the one range check of a numeric option (its message
included): every component checks its numbers with it.

This module imports only the standard library: every layer may raise these.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "BfexpError",
    "CommError",
    "ConfigError",
    "DatasetError",
    "LaunchError",
    "TopologyError",
    "TopologyMismatch",
    "number_in",
]


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


class LaunchError(ConfigError):
    """The job cannot be started here (no mpiexec, no GPU for engine=nccl, ...)."""


class CommError(BfexpError, RuntimeError):
    """A communication pattern that cannot complete (e.g. mismatched neighbors), raised on every rank."""


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
