"""Communication engines behind one contract (bfexp.comm.engine.Engine).

Each conf/engine/<name>.yaml names its engine class with ``_target_`` and the
class's constructor is the option's schema (MPIEngine, NCCLEngine,
ThreadsEngine, StackedEngine); ``engine=auto`` names ``Auto`` below, which the driver asks
for each job's choice among them. A node also states its class's ``name``
(mpi, nccl, threads): the family the driver starts its ranks as, and what the
summary calls it, so a user's subclass of an engine runs as its base does.

``engine_class(name)`` imports an engine's module only when asked for it:
importing bfexp.comm initializes neither MPI nor CUDA (nor imports torch),
so the driver process can look engines up and read their facts (``virtual``,
``processes``, ``device_type``, ``available``) without becoming an MPI rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from bfexp.errors import ConfigError, number_in

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.comm.engine import Engine

__all__ = ["ENGINES", "PROCESS_ENGINES", "Auto", "engine_class"]

# engine name -> (module, class); the modules are imported on demand.
ENGINES = {
    "mpi": ("bfexp.comm.mpi", "MPIEngine"),
    "nccl": ("bfexp.comm.nccl", "NCCLEngine"),
    "threads": ("bfexp.comm.threads", "ThreadsEngine"),
    "stacked": ("bfexp.comm.stacked", "StackedEngine"),
}

# The engines whose ranks are processes (their classes' ``processes``), known without importing them
# (that imports torch): the driver starts such ranks while it finishes its checks.
PROCESS_ENGINES = frozenset({"mpi", "nccl"})


def engine_class(name: str) -> "type[Engine]":
    """The Engine class of ``engine=name`` (imported now); ConfigError for a name that is none."""
    try:
        module, cls = ENGINES[name]
    except KeyError:
        raise ConfigError(f"engine={name}; allowed: {', '.join(ENGINES)}") from None
    return getattr(importlib.import_module(module), cls)


class Auto:
    """``engine=auto``: the driver chooses the engine of each job (bfexp.preflight.choose_engine) and prints
    why: nccl when every rank has its own GPU; else mpi while the ranks fit the processor slots times
    ``slots_factor``; else stacked when the job can be stacked (bfexp.preflight.stacking_refusal: the
    checks engine=stacked makes), else threads. Its other settings go to the engine it chooses (``choice``)."""

    name: ClassVar[str] = "auto"

    def __init__(self, ranks_per_machine: int = 0, timeline: bool = False, mpiexec_args: tuple[str, ...] = (),
                 slots_factor: float = 4.0) -> None:
        """``ranks_per_machine`` (0: one machine), ``timeline`` and ``mpiexec_args`` (the last only where the
        chosen engine's ranks are processes) as the chosen engine takes them; ``slots_factor``: MPI ranks per
        processor slot (core) before auto switches to threads."""
        self.ranks_per_machine = number_in("engine.ranks_per_machine", ranks_per_machine, low=0, integer=True)
        self.timeline = timeline
        self.mpiexec_args = [str(a) for a in mpiexec_args]
        self.slots_factor = number_in("engine.slots_factor", float(slots_factor), low=0, low_open=True)

    def choice(self, name: str) -> dict[str, Any]:
        """The config node of engine ``name`` (one of ENGINES) with this node's settings that it takes."""
        module, cls = ENGINES[name]
        node: dict[str, Any] = {"_target_": f"{module}.{cls}", "name": name,
                                "ranks_per_machine": self.ranks_per_machine, "timeline": self.timeline}
        if name in PROCESS_ENGINES:
            node["mpiexec_args"] = list(self.mpiexec_args)
        return node
