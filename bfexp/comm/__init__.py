"""Communication engines behind one contract (bfexp.comm.engine.Engine).

``engine_class(name)`` imports an engine's module only when asked for it:
importing bfexp.comm initializes neither MPI nor CUDA (nor imports torch),
so the driver process can look engines up and read their facts (``virtual``,
``processes``, ``device_type``, ``available``) without becoming an MPI rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bfexp.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.comm.engine import Engine

__all__ = ["ENGINES", "PROCESS_ENGINES", "engine_class"]

# engine name -> (module, class); the modules are imported on demand.
ENGINES = {
    "mpi": ("bfexp.comm.mpi", "MPIEngine"),
    "nccl": ("bfexp.comm.nccl", "NCCLEngine"),
    "threads": ("bfexp.comm.threads", "ThreadsEngine"),
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
