"""BlueFog's topology_util: graph builders as networkx DiGraphs, weights, dynamic send/recv schedules.

BlueFog's graph convention: an edge u -> v with weight ``a`` means u sends to
v and v gives u's value weight ``a`` (the adjacency matrix A = W^T of
bfexp's X+ = W X); a self loop carries the self weight. The builders return
exactly BlueFog's matrices. Where bfexp's own graphs have the same edges and
weights (exp2, star and grid with Metropolis weights, fully connected) they
are built by bfexp.topology and converted; BlueFog's rings (a left-only one
too) and its symmetric exponential graph (offsets +-base^k only up to n/2)
have no bfexp twin and are circulants here. The dynamic generators yield
``([send ranks], [recv ranks])`` per iteration, forever, as BlueFog's do.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

import networkx as nx
import numpy as np

from bfexp.errors import number_in
from bfexp.topology import Exp2, FullyConnected, Mesh, Star, Topology
from bfexp.topology.graphs import closest_factors

__all__ = [
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "FullyConnectedGraph",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetRecvWeights",
    "GetSendWeights",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "MeshGrid2DGraph",
    "RingGraph",
    "StarGraph",
    "SymmetricExponentialGraph",
    "from_topology",
]

SendRecv = Iterator[tuple[list[int], list[int]]]


def from_topology(topology: Topology, t: int = 0) -> nx.DiGraph:
    """A bfexp Topology's W(t) as a BlueFog graph (edge u -> v weighted W[v, u], self loops included)."""
    return nx.from_numpy_array(np.asarray(topology.mixing_matrix(t)).T, create_using=nx.DiGraph)


def _circulant(size: int, offsets: Sequence[int]) -> nx.DiGraph:
    """Rank i sends to i + d (mod size) for every d in ``offsets`` (0 = self), uniform weights."""
    number_in("size", size, low=1, integer=True, error=ValueError)
    ds = sorted({d % size for d in offsets} | {0})
    a = np.zeros((size, size))
    for i in range(size):
        a[i, [(i + d) % size for d in ds]] = 1.0 / len(ds)
    return nx.from_numpy_array(a, create_using=nx.DiGraph)


def _is_power(x: int, base: int) -> bool:
    while x % base == 0:
        x //= base
    return x == 1


# ------------------------------------------------------------------ builders


def ExponentialTwoGraph(size: int) -> nx.DiGraph:
    """Rank i sends to i + 2^k for every 2^k < size; self included, uniform weights."""
    return ExponentialGraph(size, 2)


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:
    """Rank i sends to i + base^k for every base^k < size; self included, uniform weights (bfexp's exp2)."""
    number_in("size", size, low=1, integer=True, error=ValueError)
    if size == 1:
        return _circulant(1, [])
    return from_topology(Exp2(size, base=base, weights="uniform"))


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:
    """Rank i talks both ways with i +- base^k for base^k <= size // 2; uniform weights."""
    offsets = [d for d in range(1, size) if _is_power(d if d <= size // 2 else size - d, base)]
    return _circulant(size, offsets)


def MeshGrid2DGraph(size: int, shape: tuple[int, int] | None = None) -> nx.DiGraph:
    """A rows x cols grid (no wrap-around; rows <= cols closest factors by default), Metropolis-Hastings weights."""
    rows, cols = closest_factors(size) if shape is None else (int(shape[0]), int(shape[1]))
    if rows * cols != size:
        raise ValueError(f"shape={shape}; allowed: (rows, cols) with rows * cols = size={size}")
    if size == 1:
        return _circulant(1, [])
    return from_topology(Mesh(size, torus=False, rows=rows, weights="metropolis"))


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """Every rank talks both ways with ``center_rank``; edge weights 1/size (Metropolis-Hastings)."""
    if size == 1:
        return _circulant(1, [])
    return from_topology(Star(size, center=center_rank, weights="metropolis"))


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """A ring: connect_style 0 both ways (weights 1/3), 1 each rank sends to i - 1, 2 to i + 1 (weights 1/2)."""
    if connect_style not in (0, 1, 2):
        raise ValueError(f"connect_style={connect_style}; allowed: 0 (both ways), 1 (left), 2 (right)")
    offsets = {0: [1, -1], 1: [-1], 2: [1]}[connect_style]
    return _circulant(size, offsets)


def FullyConnectedGraph(size: int) -> nx.DiGraph:
    """Every rank talks to every rank, weights 1/size."""
    return from_topology(FullyConnected(size, weights="uniform")) if size > 1 else _circulant(1, [])


# ------------------------------------------------------------------ reading graphs


def _weight(topo: nx.DiGraph, u: int, v: int) -> float:
    return float(topo[u][v].get("weight", 1.0))


def _self_and_neighbors(rank: int, weights: Iterable[tuple[int, float]]) -> tuple[float, dict[int, float]]:
    """(the self loop's weight or 0, {neighbor: weight}) from (other end, weight) of ``rank``'s edges."""
    self_weight, neighbors = 0.0, {}
    for other, w in weights:
        if other == rank:
            self_weight = w
        else:
            neighbors[int(other)] = w
    return self_weight, neighbors


def GetRecvWeights(topo: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """(self weight, {in-neighbor: weight}) that ``rank`` gives what it receives, read off the graph."""
    return _self_and_neighbors(rank, ((src, _weight(topo, src, rank)) for src in topo.predecessors(rank)))


def GetSendWeights(topo: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """(self weight, {out-neighbor: weight}) on ``rank``'s outgoing edges."""
    return _self_and_neighbors(rank, ((dst, _weight(topo, rank, dst)) for dst in topo.successors(rank)))


def IsTopologyEquivalent(topo1: nx.DiGraph | None, topo2: nx.DiGraph | None) -> bool:
    """Same weighted adjacency matrix (not isomorphism); False when either is None."""
    if topo1 is None or topo2 is None:
        return False
    if topo1.number_of_nodes() != topo2.number_of_nodes() or topo1.number_of_edges() != topo2.number_of_edges():
        return False
    return bool(np.array_equal(nx.to_numpy_array(topo1), nx.to_numpy_array(topo2)))


def IsRegularGraph(topo: nx.DiGraph) -> bool:
    """Every node has the same degree (in plus out)."""
    return len({topo.degree(r) for r in topo.nodes}) <= 1


# ------------------------------------------------------------------ dynamic schedules


def GetDynamicOnePeerSendRecvRanks(topo: nx.DiGraph, self_rank: int) -> SendRecv:
    """Each iteration every rank sends to the next of its out-neighbors (clockwise order, cycling).

    Yields ``([send rank], [ranks that send to self_rank this iteration])``.
    """
    size = topo.number_of_nodes()
    clockwise = [
        sorted((r for r in topo.successors(rank) if r != rank), key=lambda r, me=rank: (r - me) % size)
        for rank in range(size)
    ]
    index = 0
    while True:
        def target(rank: int) -> int:
            return clockwise[rank][index % len(clockwise[rank])]

        recv = [r for r in range(size) if r != self_rank and clockwise[r] and target(r) == self_rank]
        yield [target(self_rank)], recv
        index += 1


def _homogeneous(world_size: int, local_size: int) -> int:
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local_size={local_size}; allowed: a divisor of world_size={world_size} (homogeneous)")
    return world_size // local_size


def GetExp2DynamicSendRecvMachineRanks(
    world_size: int, local_size: int, self_rank: int, local_rank: int
) -> SendRecv:
    """One-peer exp2 among machines: at iteration k machine m sends to m + 2^(k mod (floor(log2(M-1)) + 1))."""
    machines = _homogeneous(world_size, local_size)
    if self_rank % local_size != local_rank:
        raise ValueError(f"local_rank={local_rank}; allowed: self_rank % local_size = {self_rank % local_size}")
    if machines < 2:
        raise ValueError(f"world_size={world_size}, local_size={local_size}; allowed: at least 2 machines")
    machine = self_rank // local_size
    steps = int(math.log2(machines - 1)) + 1
    index = 0
    while True:
        d = 2 ** (index % steps)
        yield [(machine + d) % machines], [(machine - d) % machines]
        index += 1


def _inner_outer(world_size: int, local_size: int, self_rank: int, exp2: bool) -> SendRecv:
    """At iteration k local rank k mod L of each machine talks across machines; the rest talk inside it."""
    machines = _homogeneous(world_size, local_size)
    if local_size <= 2:
        raise ValueError(f"local_size={local_size}; allowed: > 2 (use GetExp2DynamicSendRecvMachineRanks "
                         "or GetDynamicOnePeerSendRecvRanks)")
    outer_steps = int(math.log2(machines - 1)) + 1 if exp2 and machines > 1 else 1
    inner_steps = int(math.log2(local_size - 2)) + 1 if exp2 else 1
    machine, me = divmod(self_rank, local_size)
    index = 0
    while True:
        outer = index % local_size
        if me == outer:
            d = 2 ** (index % outer_steps)
            send = ((machine + d) % machines) * local_size + me
            recv = ((machine - d) % machines) * local_size + me
        else:
            d = 2 ** (index % inner_steps)
            # Inside the machine, skip over the rank that talks outside this iteration.
            ahead = d + 1 if d >= (outer - me) % local_size else d
            behind = d + 1 if d >= (me - outer) % local_size else d
            send = machine * local_size + (me + ahead) % local_size
            recv = machine * local_size + (me - behind) % local_size
        yield [send], [recv]
        index += 1


def GetInnerOuterRingDynamicSendRecvRanks(world_size: int, local_size: int, self_rank: int) -> SendRecv:
    """Inner ring inside each machine, outer ring across machines, one peer per iteration."""
    return _inner_outer(world_size, local_size, self_rank, exp2=False)


def GetInnerOuterExpo2DynamicSendRecvRanks(world_size: int, local_size: int, self_rank: int) -> SendRecv:
    """Inner exp2 inside each machine, outer exp2 across machines, one peer per iteration."""
    return _inner_outer(world_size, local_size, self_rank, exp2=True)
