"""Graphs, dynamic schedules and mixing weights (see base.Topology)."""

from __future__ import annotations

from typing import Any

from bfexp.topology.base import RankWeights, Topology
from bfexp.topology.graphs import Exp2, Ring

__all__ = ["RankWeights", "Topology", "build_topology"]


def build_topology(cfg: Any, size: int, ranks_per_machine: int = 0) -> Topology:
    """The topology a config node (name + parameters) describes, for `size` ranks."""
    name = cfg.name
    if name == "ring":
        topo: Topology = Ring(size, directed=bool(cfg.get("directed", False)))
    elif name == "exp2":
        topo = Exp2(size, base=int(cfg.get("base", 2)))
    else:
        raise ValueError(f"topology={name!r}; allowed: ring, exp2")
    if cfg.get("weights", "uniform") != "uniform":
        raise ValueError(f"topology.weights={cfg.weights!r}; allowed here: uniform")
    return topo
