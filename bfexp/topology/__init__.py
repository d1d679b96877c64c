"""Graphs, dynamic schedules and mixing weights (see base.Topology).

One adjacency convention throughout: an edge u -> v means u sends to v, and
W[v, u] is the weight v gives u's value (X+ = W X). Your own graph (custom.py):
a networkx graph, a matrix or an edge list in Python (CustomTopology,
MatrixTopology, AdjacencyTopology), files (the ``file`` option) or a
function that makes one (the ``generated`` option); an input that does not
say which way its entries point must be told (``direction=``).

``build_topology(node, size, ranks_per_machine)`` is the one way a config
becomes a Topology. ``node`` is a ``topology`` config node: ``_target_`` (a
class or function, e.g. ``bfexp.topology.Ring`` or a user's own) plus its
options. The target is called as ``target(size, **options)``, with
``ranks_per_machine=`` added only when its signature takes it (the run's
layout, never a YAML key), and must return a Topology on ``size`` ranks.

Anything that cannot run (an unknown key, a value of the wrong type, a rank
count the graph cannot take, a disconnected graph, weights the graph cannot
have) raises a ConfigError (TopologyError for the graph itself) with a
one-line ``key=value; allowed: ...`` message. The CLI calls it before any
rank starts and turns the error into exit code 2.
"""

from __future__ import annotations

from bfexp.topology.base import GraphTopology, RankWeights, Topology, Undirected
from bfexp.topology.base_graph import BaseGraph
from bfexp.topology.build import build_topology
from bfexp.topology.custom import (
    AdjacencyTopology,
    CustomTopology,
    Direction,
    EdgeList,
    FileTopology,
    GeneratedTopology,
    MatrixTopology,
    Weights,
)
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
from bfexp.topology.mixing import WEIGHT_SCHEMES, WeightScheme

__all__ = [
    "WEIGHT_SCHEMES",
    "AdjacencyTopology",
    "BaseGraph",
    "CustomTopology",
    "Direction",
    "EdgeList",
    "Exp2",
    "FileTopology",
    "FullyConnected",
    "GeneratedTopology",
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
    "WeightScheme",
    "Weights",
    "build_topology",
]
