"""Graphs, dynamic schedules and mixing weights (see base.Topology).

``build_topology(cfg, size)`` turns a ``topology`` config node into a
Topology and raises ValueError, with a one-line message naming the bad value
and what is allowed, for anything that cannot run (a rank count the graph
cannot take, a disconnected graph, weights the graph cannot have). The CLI
calls it before any rank starts and turns the error into exit code 2.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from bfexp.topology.base import GraphTopology, RankWeights, Topology
from bfexp.topology.custom import AdjacencyTopology, MatrixTopology, Undirected
from bfexp.topology.dynamic import InnerOuterExp2, OnePeerExp2, OnePeerRing
from bfexp.topology.graphs import (
    Exp2,
    FullyConnected,
    Hypercube,
    Mesh,
    RandomRegular,
    Ring,
    Star,
    SymmetricExp2,
)
from bfexp.topology.mixing import WEIGHT_SCHEMES

__all__ = [
    "TOPOLOGIES",
    "WEIGHT_SCHEMES",
    "AdjacencyTopology",
    "Exp2",
    "FullyConnected",
    "GraphTopology",
    "Hypercube",
    "InnerOuterExp2",
    "MatrixTopology",
    "Mesh",
    "OnePeerExp2",
    "OnePeerRing",
    "RandomRegular",
    "RankWeights",
    "Ring",
    "Star",
    "SymmetricExp2",
    "Topology",
    "Undirected",
    "build_topology",
    "check_topology",
]

# Config option name (conf/topology/<name>.yaml) -> class. Each class takes
# (size, **the option's parameters); inner_outer_exp2 also ranks_per_machine.
TOPOLOGIES: dict[str, Callable[..., Topology]] = {
    cls.name: cls
    for cls in (
        Ring,
        Exp2,
        SymmetricExp2,
        Mesh,
        Star,
        FullyConnected,
        Hypercube,
        RandomRegular,
        OnePeerExp2,
        OnePeerRing,
        InnerOuterExp2,
    )
}

# Classes that need to know how ranks sit on machines.
_NEEDS_RANKS_PER_MACHINE = {"inner_outer_exp2"}


def build_topology(cfg: Any, size: int, ranks_per_machine: int = 0) -> Topology:
    """The topology a config node (``name`` + parameters) describes, for ``size`` ranks.

    Raises ValueError (one line: the bad value and what is allowed) when it cannot run.
    """
    params = _as_dict(cfg)
    name = params.pop("name", None)
    if name not in TOPOLOGIES:
        raise ValueError(f"topology={name!r}; allowed: {', '.join(TOPOLOGIES)}")
    if name in _NEEDS_RANKS_PER_MACHINE:
        params["ranks_per_machine"] = ranks_per_machine
    accepted = [p for p in inspect.signature(TOPOLOGIES[name]).parameters if p != "size"]
    for key in params:
        if key not in accepted:
            raise ValueError(f"topology={name} has no parameter {key!r}; allowed: {', '.join(accepted)}")
    return TOPOLOGIES[name](size, **params)


def check_topology(cfg: Any, size: int, ranks_per_machine: int = 0) -> None:
    """Raise ValueError when this topology config cannot run on ``size`` ranks."""
    build_topology(cfg, size, ranks_per_machine)


def _as_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"topology config must be a mapping with a 'name'; got {type(cfg).__name__}")
