"""One file per algorithm; each shows its update rule and cites its paper."""

from __future__ import annotations

from typing import Any

import torch

from bfexp.algorithms.allreduce import Allreduce
from bfexp.algorithms.base import DecentralizedOptimizer, Requirements, TopologyMismatch
from bfexp.algorithms.dsgd import DSGD
from bfexp.comm.engine import Engine
from bfexp.topology import Topology

ALGORITHMS: dict[str, type[DecentralizedOptimizer]] = {
    "dsgd": DSGD,
    "allreduce": Allreduce,
}

__all__ = ["ALGORITHMS", "DecentralizedOptimizer", "Requirements", "TopologyMismatch", "build_algorithm"]


def build_algorithm(
    cfg: Any, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None
) -> DecentralizedOptimizer:
    try:
        cls = ALGORITHMS[cfg.name]
    except KeyError:
        raise ValueError(f"algorithm={cfg.name!r}; allowed: {', '.join(ALGORITHMS)}") from None
    return cls(optimizer, engine, topology, cfg)
