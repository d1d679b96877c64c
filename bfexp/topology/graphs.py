"""Static graphs: the edges each one has, as an adjacency matrix A[i, j] = 1 when i receives from j."""

from __future__ import annotations

import numpy as np

from bfexp.topology.base import Topology, uniform_weights


class Ring(Topology):
    """Each rank hears its two ring neighbors (directed: only rank i-1)."""

    name = "ring"

    def __init__(self, size: int, directed: bool = False) -> None:
        super().__init__(size)
        self.directed = directed

    def _build_matrix(self, t: int) -> np.ndarray:
        n = self.size
        a = np.zeros((n, n))
        for i in range(n):
            a[i, (i - 1) % n] = 1
            if not self.directed:
                a[i, (i + 1) % n] = 1
        np.fill_diagonal(a, 0)
        return uniform_weights(a)


class Exp2(Topology):
    """Rank i sends to i + base^k (mod n) for base^k < n: log(n) out-neighbors, directed."""

    name = "exp2"
    directed = True

    def __init__(self, size: int, base: int = 2) -> None:
        if base < 2:
            raise ValueError(f"exp2 base={base}; allowed: an integer >= 2")
        super().__init__(size)
        self.base = base

    def distances(self) -> list[int]:
        out, d = [], 1
        while d < self.size:
            out.append(d)
            d *= self.base
        return out

    def _build_matrix(self, t: int) -> np.ndarray:
        n = self.size
        a = np.zeros((n, n))
        for i in range(n):
            for d in self.distances():
                a[(i + d) % n, i] = 1
        np.fill_diagonal(a, 0)
        return uniform_weights(a)
