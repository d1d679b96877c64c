"""Stragglers with less CPU: a slow process rank in a cpu-controller cgroup of its own (cgroup v1).

``heterogeneity.cpu_quota=C`` gives each slow rank that is a process C CPUs
(cpu.cfs_quota_us = C x cpu.cfs_period_us) instead of the sleep its ``factor``
would add: its forward, backward and communication really run slower, as on a
machine with a smaller share of the cores. Virtual ranks keep the simulated form.

One folder per job under the cpu controller, named after the run folder, one
child per slow rank: the rank makes its child and moves itself in after its first
training step (start-up and the first step's one-time costs run at full speed), and
moves itself out and removes the child at its end; the driver removes
whatever is left once the ranks have ended, on failure too (a killed rank's
child is empty then), so no cgroup outlives its job on this machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from bfexp.errors import ConfigError

__all__ = ["CPU_ROOT", "check", "check_available", "clean_up", "job_group", "leave", "remove", "starve"]

CPU_ROOT = Path("/sys/fs/cgroup/cpu")


def job_group(run_dir: Path) -> Path:
    """The job's folder under the cpu controller (the same on every rank and in the driver)."""
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return CPU_ROOT / f"bfexp-job-{key}"


def check_available() -> None:
    """ConfigError (one line) unless a cgroup v1 cpu controller is here and writable (root)."""
    if not (CPU_ROOT / "cpu.cfs_period_us").exists() or not os.access(CPU_ROOT, os.W_OK):
        raise ConfigError(f"heterogeneity.cpu_quota needs a writable cgroup v1 cpu controller at {CPU_ROOT} "
                          "(root); allowed: null (the straggler sleeps instead) on this machine")


def starve(run_dir: Path, rank: int, cpus: float) -> Path:
    """Put this process (every thread of it) into a cgroup of ``cpus`` CPUs; returns its folder."""
    group = job_group(run_dir) / f"rank{rank}"
    group.mkdir(parents=True, exist_ok=True)
    period = int((CPU_ROOT / "cpu.cfs_period_us").read_text())
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * period))))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def leave(group: Path) -> None:
    """This process back to the root group, and its own group removed (a rank's normal end)."""
    with contextlib.suppress(OSError):
        (CPU_ROOT / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()


def remove(run_dir: Path, wait_s: float = 5.0) -> list[str]:
    """The driver, after the ranks ended: remove the job's groups; returns those that could not be
    (a process still in one). Tasks left in a group (a rank not yet reaped) get a moment to go."""
    root = job_group(run_dir)
    if not root.exists():
        return []
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for child in sorted(p for p in root.iterdir() if p.is_dir()):
            try:
                for pid in (child / "cgroup.procs").read_text().split():  # not yet gone: out of the group
                    with contextlib.suppress(OSError):
                        (CPU_ROOT / "cgroup.procs").write_text(pid)
                child.rmdir()
            except OSError:
                left.append(str(child))
        if not left:
            with contextlib.suppress(OSError):
                root.rmdir()
                return []
        if time.monotonic() > deadline:
            return left or [str(root)]
        time.sleep(0.1)


def quota_of(heterogeneity: Any) -> float | None:
    """The job's heterogeneity.cpu_quota, from its heterogeneity node (None: no rank is starved of CPU)."""
    return (heterogeneity or {}).get("cpu_quota")


def check(heterogeneity: Any) -> None:
    """The driver, before process ranks start: a job that starves a rank (its heterogeneity node) needs the
    cpu controller."""
    if quota_of(heterogeneity) is not None:
        check_available()


def clean_up(heterogeneity: Any, run_dir: Path) -> None:
    """The driver, once the job's process ranks ended (any way): its cgroups go."""
    if quota_of(heterogeneity) is not None:
        left = remove(run_dir)
        if left:
            print(f"bfexp: could not remove cgroup(s) {', '.join(left)}", file=sys.stderr, flush=True)
