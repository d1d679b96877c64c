"""What the driver asks of a sweep launcher (``hydra/launcher``: a Hydra Launcher plugin, e.g. the Slurm sweep
of bfexp.launchers.slurm_sweep, or a user's own for PBS): two things, asked of its class, never of its name.

* ``runs_here`` (a class attribute, True when absent: Hydra's basic launcher): whether the sweep's jobs
  run on this machine. False (Slurm, PBS: each job on machines of its own) and the driver's check of
  every point before the first job starts leaves this machine's memory out.
* ``statuses``: a launcher whose jobs run in other processes (their own ``bfexp`` on an allocated
  machine) appends each job's status here (``record``), so that the driver exits 1 when one failed,
  as for the jobs it ran itself.

A user's sweep launcher is a class in a ``hydra_plugins`` package (Hydra instantiates launchers from
there only) and a YAML in ``--config-dir``'s hydra/launcher/; tests/pbs/ shows one. Standard library
only until asked (Hydra is imported to find the class).
"""

from __future__ import annotations

from typing import Any

__all__ = ["record", "runs_here", "statuses"]

# Status of every job a sweep launcher ran elsewhere ("completed", "failed", ...), in order.
statuses: list[str] = []


def record(status: str) -> None:
    """A job a sweep launcher ran elsewhere ended with ``status``."""
    statuses.append(status)


def runs_here(node: Any) -> bool:
    """Whether the sweep launcher ``node`` (the composed ``hydra.launcher``) runs its jobs on this machine:
    its class's ``runs_here``. A class that does not import is Hydra's to refuse when it builds it."""
    from hydra.utils import get_class

    target = node.get("_target_") if node is not None else None
    if not target:
        return True
    try:
        cls = get_class(str(target))
    except Exception:  # noqa: BLE001 - Hydra's own error names it, at the sweep's start
        return True
    return bool(getattr(cls, "runs_here", True))
