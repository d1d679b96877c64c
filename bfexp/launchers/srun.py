"""Slurm: ``srun --mpi=pmix`` inside an allocation (salloc, sbatch, or each job of a
``-m hydra/launcher=slurm`` sweep). mpi4py's Open MPI wires up through Slurm's PMIx
plugin; nodes = ceil(ranks / ranks_per_node)."""

from __future__ import annotations

import os
import re
import shutil
from typing import ClassVar, Sequence

from bfexp.errors import ConfigError, LaunchError, number_in
from bfexp.launchers.base import Launcher
from bfexp.launchers.mpirun import check_interface
from bfexp.launchers.openmpi import ranks_on

__all__ = ["RESOLVERS", "Srun", "allocation_nodes", "diagnose_srun", "nodes_for", "tasks_per_node"]

# srun's word on a task ("srun: error: hostB: task 1: Killed") and on tasks it never heard from again.
_SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$", re.M)
_SRUN_UNHEARD = "Timed out waiting for job step to complete"


def nodes_for(ranks: int, ranks_per_node: int) -> int:
    """Slurm nodes a job of ``ranks`` ranks needs: ceil(ranks / ranks_per_node); 0 per node = one node."""
    ranks, per_node = int(ranks), int(ranks_per_node)
    return 1 if per_node <= 0 else -(-ranks // per_node)


def tasks_per_node(ranks: int, ranks_per_node: int) -> int:
    """Ranks on each of those nodes: ranks_per_node, or every rank when they fit one node."""
    ranks, per_node = int(ranks), int(ranks_per_node)
    return ranks if per_node <= 0 else min(ranks, per_node)


# The interpolation resolvers of the hydra/launcher=slurm preset (conf/hydra/launcher/slurm.yaml): a job's ranks
# -> its allocation. bfexp.launchers.register_resolvers makes them known to OmegaConf.
RESOLVERS = {"bfexp_nodes": nodes_for, "bfexp_tasks_per_node": tasks_per_node}


def allocation_nodes() -> int:
    """Nodes of the Slurm allocation this process runs in."""
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)


def _task_numbers(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def diagnose_srun(log: str, hosts: dict[int, str | None]) -> str | None:
    """srun's word on a machine whose tasks it never heard from again ("host hostB (rank 1) lost: ..."), or on
    tasks that died by a signal ("rank 1 on hostB: killed (srun)"); ``hosts``: rank -> machine (heartbeats)."""
    tasks = list(_SRUN_TASK.finditer(log))
    if _SRUN_UNHEARD in log:  # tasks srun never heard from again: their machine is gone
        heard = set().union(*(_task_numbers(m.group(2)) for m in tasks))
        unheard = {h for r, h in hosts.items() if r not in heard}
        if unheard and None not in unheard:  # every unheard rank said where it ran
            return "; ".join(f"host {h}{ranks_on(hosts, h)} lost: srun never heard from its tasks again "
                             "(the host or its link is down)" for h in sorted(unheard))  # type: ignore[type-var]
    # Tasks that died by a signal; the others exited, most of them aborting because a peer vanished (Open MPI's
    # exit code 14). srun reports them in the order it hears, which under load is not the order they died in.
    killed = [m for m in tasks if "Killed" in m.group(3) or "signal" in m.group(3)]
    if killed:
        return "; ".join(f"rank {m.group(2)} on {m.group(1)}: {m.group(3).strip().lower()} (srun)" for m in killed)
    return None


def find_srun() -> str:
    found = shutil.which("srun")
    if found is None:
        raise LaunchError("launcher=srun needs Slurm's srun on PATH; allowed: launcher=local or launcher=mpirun")
    return found


class Srun(Launcher):
    """``srun --mpi=pmix --ntasks=R`` in the allocation. ``ranks_per_node``: nodes = ceil(ranks /
    ranks_per_node), that many tasks on each; 0 = as Slurm spreads them over the allocation.
    ``network_interface``: as for mpirun; ``extra_args``: more arguments for srun."""

    name: ClassVar[str] = "srun"

    def __init__(self, ranks_per_node: int = 0, network_interface: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.ranks_per_node = number_in("launcher.ranks_per_node", ranks_per_node, low=0, integer=True)
        self.network_interface = network_interface
        self.extra_args = [str(a) for a in extra_args]

    def layout(self, ranks: int) -> list[str]:
        """srun's placement: nodes = ceil(ranks / ranks_per_node), that many tasks on each."""
        if self.ranks_per_node <= 0:
            return []
        return [f"--nodes={nodes_for(ranks, self.ranks_per_node)}",
                f"--ntasks-per-node={tasks_per_node(ranks, self.ranks_per_node)}"]

    def command(self, ranks: int, program: Sequence[str], mpiexec_args: Sequence[str] = ()) -> list[str]:
        return [find_srun(), "--mpi=pmix", f"--ntasks={ranks}", *self.layout(ranks), "--kill-on-bad-exit=1",
                *self.extra_args, *program]

    def hosts(self, ranks: int) -> list[tuple[str, int]]:
        per_node = self.ranks_per_node if self.ranks_per_node > 0 else -(-ranks // allocation_nodes())
        nodes = -(-ranks // per_node)
        return [(f"node{i}", min(per_node, ranks - i * per_node)) for i in range(nodes)]

    def check(self, ranks: int) -> None:
        check_interface(self.network_interface)
        find_srun()
        if not os.environ.get("SLURM_JOB_ID"):
            raise LaunchError("launcher=srun outside a Slurm allocation (no SLURM_JOB_ID); allowed: inside salloc "
                              "or sbatch, or sweep with -m hydra/launcher=slurm")
        nodes = nodes_for(ranks, self.ranks_per_node)
        if nodes > allocation_nodes():
            raise ConfigError(f"ranks={ranks} at launcher.ranks_per_node={self.ranks_per_node} need {nodes} nodes; "
                              f"the allocation has {allocation_nodes()}; allowed: ranks <= "
                              f"{allocation_nodes() * self.ranks_per_node} or a bigger allocation")

    def diagnose(self, log: str, hosts: dict[int, str | None]) -> str | None:
        """Open MPI's words (its ranks), then srun's own (``diagnose_srun``)."""
        return super().diagnose(log, hosts) or diagnose_srun(log, hosts)

    def environment(self, ranks: int, env: dict[str, str]) -> dict[str, str]:
        """Slurm's variables stay (srun reads its allocation from them); PMIx quiet about its security plugin."""
        env.setdefault("PMIX_MCA_psec", "native")
        if self.network_interface:
            env["NCCL_SOCKET_IFNAME"] = self.network_interface
            env["OMPI_MCA_btl_tcp_if_include"] = self.network_interface
        return env
