"""One file per algorithm; each shows its update rule and cites its paper.

Every algorithm wraps a torch optimizer (see base.DecentralizedOptimizer):

    opt = build_algorithm(cfg.algorithm, torch.optim.SGD(model.parameters(), lr=0.1),
                          engine, topology, model=model)
    # the usual loop: opt.zero_grad(); loss.backward(); opt.step()
"""

from __future__ import annotations

from typing import Any

import torch

from bfexp.algorithms.allreduce import Allreduce
from bfexp.algorithms.base import DecentralizedOptimizer, Requirements, TopologyMismatch
from bfexp.algorithms.ddp import DDP
from bfexp.algorithms.dsgd import DSGD
from bfexp.algorithms.exact_diffusion import ExactDiffusion
from bfexp.algorithms.gradient_tracking import GradientTracking
from bfexp.algorithms.push_diging import PushDIGing
from bfexp.algorithms.push_sum import PushSum
from bfexp.comm.engine import Engine
from bfexp.topology import Topology

ALGORITHMS: dict[str, type[DecentralizedOptimizer]] = {
    cls.name: cls
    for cls in (DSGD, ExactDiffusion, GradientTracking, PushSum, PushDIGing, Allreduce, DDP)
}

__all__ = [
    "ALGORITHMS",
    "DDP",
    "DSGD",
    "Allreduce",
    "DecentralizedOptimizer",
    "ExactDiffusion",
    "GradientTracking",
    "PushDIGing",
    "PushSum",
    "Requirements",
    "TopologyMismatch",
    "algorithm_class",
    "build_algorithm",
    "resolve_job",
    "resolve_topology",
]


def algorithm_class(name: str) -> type[DecentralizedOptimizer]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r}; allowed: {', '.join(ALGORITHMS)}") from None


def resolve_topology(cfg: Any, topology: Topology) -> tuple[Topology, str | None]:
    """The topology the configured algorithm runs on, and a note when it substituted one.

    Raises TopologyMismatch (a ValueError, one line) when the algorithm cannot run on it.
    The CLI calls this before any rank starts; every worker calls it again and gets the same.
    """
    return algorithm_class(cfg["name"]).resolve_topology(topology)


def resolve_job(cfg: Any, topology: Topology, engine: str) -> tuple[Topology, str | None]:
    """Everything about the algorithm the CLI checks before any rank starts.

    ``engine`` is the engine the job will run on (after engine=auto chose).
    Returns the topology the algorithm runs on and a note when it substituted
    one; raises ValueError (one line) for what cannot run.
    """
    cls = algorithm_class(cfg.algorithm.name)
    cls.check_job(cfg, engine)
    return cls.resolve_topology(topology)


def build_algorithm(
    cfg: Any,
    optimizer: torch.optim.Optimizer,
    engine: Engine,
    topology: Topology | None,
    model: torch.nn.Module | None = None,
) -> DecentralizedOptimizer:
    """The configured algorithm wrapping ``optimizer``, on the topology its rule runs on (see resolve_topology)."""
    cls = algorithm_class(cfg["name"])
    if cls.uses_topology and topology is not None:
        topology, _ = cls.resolve_topology(topology)
    return cls(optimizer, engine, topology, cfg, model=model)
