"""Components the way a config names them, for the algorithm tests.

Algorithms by their config option: conf/algorithm/<name>.yaml (shipped as
bfexp.conf), built the Hydra way, as the worker builds them; reading the
option's ``_target_`` rather than a table of names covers the YAML too.
Topologies by a ``_target_`` node (a class path and its parameters), so a
case is plain data that travels to the ranks.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import numpy as np
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf


def node(name: str, **options: Any) -> DictConfig:
    """conf/algorithm/<name>.yaml with ``options`` overriding its keys."""
    text = resources.files("bfexp.conf").joinpath("algorithm", f"{name}.yaml").read_text()
    return OmegaConf.merge(OmegaConf.create(text), options)  # type: ignore[return-value]


def algorithm_class(name: str) -> type:
    """The class conf/algorithm/<name>.yaml builds."""
    return get_class(node(name)._target_)


def build(name: str, optimizer: Any, engine: Any, topology: Any, model: Any = None, **options: Any) -> Any:
    """The configured algorithm wrapping ``optimizer``, on the topology its rule runs on (as the worker does)."""
    cfg = node(name, **options)
    cls = get_class(cfg._target_)
    if cls.uses_topology:
        topology, _ = cls.resolve_topology(topology)
    return instantiate(cfg)(optimizer, engine, topology, model=model)


def topology(spec: dict, size: int) -> Any:
    """The topology a ``_target_`` node describes: a graph on ``size`` ranks, or the ``adjacency`` given."""
    params = {k: v for k, v in spec.items() if k != "_target_"}
    cls = get_class(spec["_target_"])
    if "adjacency" in params:
        return cls(np.array(params.pop("adjacency")), **params)
    return cls(size, **params)
