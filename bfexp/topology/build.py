"""How a ``topology`` config node becomes a Topology: ``build_topology`` (re-exported by bfexp.topology).

Its own module so that what builds topologies from nodes (the ``file`` option
reading a YAML node, bfexp.topology.custom) imports it without importing the
package that imports them.
"""

from __future__ import annotations

from typing import Any, Mapping

from bfexp.errors import TopologyError
from bfexp.topology.base import Topology

__all__ = ["build_topology"]


def build_topology(node: Any, size: int, ranks_per_machine: int = 0) -> Topology:
    """The Topology a ``topology`` node (``_target_`` + options) describes, on ``size`` ranks.

    Raises a ConfigError-family error (one line: the bad value and what is allowed) when it cannot run.
    """
    # Hydra and OmegaConf load only when a config is built, not for a script that makes Exp2(n) itself.
    from omegaconf import DictConfig

    from bfexp.components import RUNTIME, check_node, signature_schema

    if not isinstance(node, (Mapping, DictConfig)):
        raise TypeError(f"a topology node is a mapping with _target_; got {type(node).__name__}")
    # Unknown keys, wrong types and YAML-set run-time arguments fail here, named topology.<key>.
    target, options = check_node(node, "topology", runtime=RUNTIME["topology"])
    if "ranks_per_machine" in signature_schema(target)[0]:
        options["ranks_per_machine"] = ranks_per_machine
    topology = target(size, **options)
    path = node["_target_"]
    if not isinstance(topology, Topology):
        raise TopologyError(
            f"topology._target_={path} returned {type(topology).__name__}; allowed: a bfexp.topology.Topology"
        )
    if topology.size != size:
        raise TopologyError(
            f"topology._target_={path} built {topology.size} ranks for ranks={size}; allowed: a topology on ranks={size}"
        )
    return topology
