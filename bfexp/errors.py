"""Whose fault an error is, said by its type (as Horovod's common/exceptions.py does).

* ``ConfigError`` and its family: the user's input cannot run. The CLI prints
  the message as one line and exits 2, before any rank starts. The message
  names the bad value and what is allowed: ``key=value; allowed: ...``.
* ``CommError``: ranks disagree on a communication (a mismatched neighbor
  pattern); raised on every rank at run time instead of a hang.
* Anything else is a bug in bfexp (or in the user's own code) and shows its
  traceback.

This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

__all__ = [
    "BfexpError",
    "CommError",
    "ConfigError",
    "DatasetError",
    "LaunchError",
    "TopologyError",
    "TopologyMismatch",
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
