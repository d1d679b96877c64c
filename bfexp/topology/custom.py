"""Topologies from something other than a named graph: a user's matrix or
adjacency, and the undirected form of another topology."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from bfexp.topology.base import GraphTopology, Topology
from bfexp.topology.mixing import SparseMixing


class MatrixTopology(Topology):
    """Given mixing matrices W(0), ..., W(p-1), used as they are (cycled over t)."""

    name = "matrix"

    def __init__(self, matrices: np.ndarray | Sequence[np.ndarray]) -> None:
        mats = [np.asarray(m, dtype=np.float64) for m in (matrices if isinstance(matrices, (list, tuple)) else [matrices])]
        n = mats[0].shape[0] if mats and mats[0].ndim == 2 else 0
        if n == 0 or any(m.shape != (n, n) for m in mats):
            raise ValueError(f"matrix topology needs square matrices of one size; got shapes {[m.shape for m in mats]}")
        super().__init__(n)
        self.weight_scheme = "given"
        self.period = len(mats)
        self._given = [SparseMixing.from_dense(m) for m in mats]
        self.validate()

    def _build(self, t: int) -> SparseMixing:
        return self._given[t]


class AdjacencyTopology(GraphTopology):
    """Any static graph: A[i, j] != 0 when i receives from j, weighed by a weight scheme."""

    name = "adjacency"

    def __init__(self, adjacency: np.ndarray, weights: str = "uniform") -> None:
        a = np.asarray(adjacency)
        if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
            raise ValueError(f"adjacency must be a square matrix; got shape {a.shape}")
        super().__init__(a.shape[0], weights)
        self._receivers, self._senders = np.nonzero(a)
        self.validate()

    def _edges(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return self._senders, self._receivers


class Undirected(GraphTopology):
    """Another topology's edges made two-way, with Metropolis-Hastings weights at every t."""

    def __init__(self, base: Topology) -> None:
        super().__init__(base.size, "metropolis")
        self.base = base
        self.name = f"undirected_{base.name}"
        self.period = base.period
        self.validate()

    def params(self) -> dict[str, Any]:
        return self.base.params()

    def positions(self) -> np.ndarray:
        return self.base.positions()

    def _edges(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        m = self.base.sparse_matrix(t)
        return np.concatenate([m.senders, m.receivers]), np.concatenate([m.receivers, m.senders])
