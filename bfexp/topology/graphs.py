"""Static graphs: the edges each one has (sender -> receiver), the same at every t.

Each class is a conf/topology option: its keyword parameters (after the
run-time ``size``) are the option's schema, and its ``name`` the option name.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from bfexp.errors import TopologyError, number_in
from bfexp.topology.base import GraphTopology, Topology
from bfexp.topology.mixing import WeightScheme

Edges = tuple[np.ndarray, np.ndarray]


def _both_ways(senders: np.ndarray, receivers: np.ndarray) -> Edges:
    return np.concatenate([senders, receivers]), np.concatenate([receivers, senders])


class Ring(GraphTopology):
    """Each rank hears its two ring neighbors; directed: only rank i-1 (a one-way ring)."""

    name: ClassVar[str] = "ring"

    def __init__(self, size: int, *, directed: bool = False, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        self.declared_directed = bool(directed)
        self.validate()

    def params(self) -> dict[str, Any]:
        return {"directed": self.declared_directed} if self.declared_directed else {}

    def _edges(self, t: int) -> Edges:
        i = np.arange(self.size)
        s, r = i, (i + 1) % self.size
        return (s, r) if self.declared_directed else _both_ways(s, r)


class Exp2(GraphTopology):
    """Rank i sends to i + base^k (mod n) for every base^k < n: about log(n) out-neighbors, directed."""

    name: ClassVar[str] = "exp2"

    def __init__(self, size: int, *, base: int = 2, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        number_in("topology.base", base, low=2, integer=True, error=TopologyError)
        self.base = int(base)
        self.validate()

    def params(self) -> dict[str, Any]:
        return {"base": self.base} if self.base != 2 else {}

    def distances(self) -> list[int]:
        return exp_distances(self.size, self.base)

    def _edges(self, t: int) -> Edges:
        i = np.arange(self.size)
        d = np.array(self.distances(), dtype=np.int64)
        return np.repeat(i, d.size), (i[:, None] + d[None, :]).ravel() % self.size

    def undirected(self) -> Topology | None:
        return SymmetricExp2(self.size, base=self.base, weights="metropolis")


class SymmetricExp2(Exp2):
    """Exp2 with every edge two-way: neighbors at i +- base^k, undirected."""

    name: ClassVar[str] = "symmetric_exp2"

    def _edges(self, t: int) -> Edges:
        return _both_ways(*super()._edges(t))

    def undirected(self) -> Topology | None:
        return Topology.undirected(self)


def exp_distances(size: int, base: int) -> list[int]:
    """base^0, base^1, ... below size."""
    out, d = [], 1
    while d < size:
        out.append(d)
        d *= base
    return out


def closest_factors(size: int) -> tuple[int, int]:
    """(rows, cols) with rows * cols = size, rows <= cols, as close as possible."""
    rows = int(np.sqrt(size))
    while size % rows:
        rows -= 1
    return rows, size // rows


class Mesh(GraphTopology):
    """2-D mesh on a rows x cols layout (rank = row * cols + col); torus wraps around, grid does not."""

    name: ClassVar[str] = "mesh"

    def __init__(
        self, size: int, *, torus: bool = True, rows: int = 0, weights: WeightScheme = "metropolis"
    ) -> None:
        super().__init__(size, weights=weights)
        if rows == 0:
            rows = closest_factors(size)[0]
        if isinstance(rows, bool) or int(rows) != rows or rows < 1 or size % rows:
            raise TopologyError(
                f"topology.rows={rows}; allowed: 0 (closest factors) or a divisor of ranks={size}"
            )
        self.torus = bool(torus)
        self.rows, self.cols = int(rows), size // int(rows)
        self.validate()

    def params(self) -> dict[str, Any]:
        return {"torus": self.torus, "rows": self.rows, "cols": self.cols}

    def positions(self) -> np.ndarray:
        i = np.arange(self.size)
        return np.stack([i % self.cols, -(i // self.cols)], axis=1).astype(np.float64)

    def _edges(self, t: int) -> Edges:
        r, c = np.divmod(np.arange(self.size), self.cols)
        senders, receivers = [], []
        for nr, nc in ((r + 1, c), (r, c + 1)):
            if self.torus:
                keep = np.ones(self.size, dtype=bool)
            else:
                keep = (nr < self.rows) & (nc < self.cols)
            senders.append(np.arange(self.size)[keep])
            receivers.append(((nr % self.rows) * self.cols + nc % self.cols)[keep])
        return _both_ways(np.concatenate(senders), np.concatenate(receivers))


class Star(GraphTopology):
    """Every rank talks only to the center rank, both ways."""

    name: ClassVar[str] = "star"

    def __init__(self, size: int, *, center: int = 0, weights: WeightScheme = "metropolis") -> None:
        super().__init__(size, weights=weights)
        if isinstance(center, bool) or int(center) != center or not 0 <= center < size:
            raise TopologyError(f"topology.center={center}; allowed: a rank in 0..{size - 1}")
        self.center = int(center)
        self.validate()

    def params(self) -> dict[str, Any]:
        return {"center": self.center} if self.center else {}

    def positions(self) -> np.ndarray:
        pos = np.zeros((self.size, 2))
        leaves = [i for i in range(self.size) if i != self.center]
        angle = np.pi / 2 - 2 * np.pi * np.arange(len(leaves)) / max(len(leaves), 1)
        pos[leaves] = np.stack([np.cos(angle), np.sin(angle)], axis=1)
        return pos

    def _edges(self, t: int) -> Edges:
        leaves = np.array([i for i in range(self.size) if i != self.center], dtype=np.int64)
        return _both_ways(leaves, np.full_like(leaves, self.center))


class FullyConnected(GraphTopology):
    """Every rank talks to every other: W = 11^T / n with uniform weights."""

    name: ClassVar[str] = "fully_connected"

    def __init__(self, size: int, *, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        self.validate()

    def _edges(self, t: int) -> Edges:
        i = np.arange(self.size)
        return np.repeat(i, self.size), np.tile(i, self.size)


class Hypercube(GraphTopology):
    """Ranks are log2(n)-bit words; neighbors differ in one bit. Needs a power-of-2 rank count."""

    name: ClassVar[str] = "hypercube"

    def __init__(self, size: int, *, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        if size & (size - 1):
            raise TopologyError(f"ranks={size}; allowed: a power of 2 for topology=hypercube")
        self.validate()

    def _edges(self, t: int) -> Edges:
        i = np.arange(self.size)
        bits = [1 << k for k in range(self.size.bit_length() - 1)]
        return np.repeat(i, len(bits)), (i[:, None] ^ np.array(bits, dtype=np.int64)[None, :]).ravel()


class RandomRegular(GraphTopology):
    """A random undirected graph where every rank has ``degree`` neighbors, fixed by ``seed``.

    Every rank draws the same graph from the seed, so no rank has to send it.
    """

    name: ClassVar[str] = "random_regular"
    connect_hint = " (try another seed or degree >= 3)"

    def __init__(self, size: int, *, degree: int = 3, seed: int = 0, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        if isinstance(degree, bool) or int(degree) != degree or not 0 <= degree < size or (size * degree) % 2:
            raise TopologyError(
                f"topology.degree={degree}; allowed: 0 <= degree < ranks with degree * ranks even (ranks={size})"
            )
        self.degree, self.seed = int(degree), int(seed)
        import networkx as nx  # lazy: only this graph needs it

        g = nx.random_regular_graph(self.degree, size, seed=self.seed)
        pairs = np.array(list(g.edges()), dtype=np.int64).reshape(-1, 2)
        self._pairs = _both_ways(pairs[:, 0], pairs[:, 1])
        self.validate()

    def params(self) -> dict[str, Any]:
        return {"degree": self.degree, "seed": self.seed}

    def _edges(self, t: int) -> Edges:
        return self._pairs
