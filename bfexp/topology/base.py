"""Topology: who talks to whom at iteration t, and with what weights.

A topology is defined by its mixing matrices W(t), t = 0 .. period-1
(``X+ = W(t) X``, row i = receiver i). Everything else — one rank's
neighbor weights, stochasticity, connectivity, spectral gap — is derived from
them, so a new graph only has to say how to build W(t).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class RankWeights:
    """One rank's view of W(t).

    src_weights: {j: W[i, j]} for the in-neighbors j this rank receives from.
    dst_weights: {k: W[k, i]} for the out-neighbors k this rank sends to.
    """

    self_weight: float
    src_weights: dict[int, float]
    dst_weights: dict[int, float]


class Topology(abc.ABC):
    name: str = "abstract"
    # Number of distinct W(t) in one cycle; 1 for a static graph.
    period: int = 1
    directed: bool = False

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"ranks={size}; allowed: an integer >= 1")
        self.size = size
        self._matrix = lru_cache(maxsize=None)(self._build_matrix)

    @abc.abstractmethod
    def _build_matrix(self, t: int) -> np.ndarray:
        """W(t) for 0 <= t < period, as an (n, n) float64 array."""

    @property
    def is_dynamic(self) -> bool:
        return self.period > 1

    def mixing_matrix(self, t: int = 0) -> np.ndarray:
        w = self._matrix(t % self.period)
        w.setflags(write=False)
        return w

    def weights(self, rank: int, t: int = 0) -> RankWeights:
        w = self.mixing_matrix(t)
        row, col = w[rank], w[:, rank]
        src = {int(j): float(row[j]) for j in np.flatnonzero(row) if j != rank}
        dst = {int(k): float(col[k]) for k in np.flatnonzero(col) if k != rank}
        return RankWeights(float(w[rank, rank]), src, dst)

    def in_neighbors(self, rank: int, t: int = 0) -> list[int]:
        return sorted(self.weights(rank, t).src_weights)

    def out_neighbors(self, rank: int, t: int = 0) -> list[int]:
        return sorted(self.weights(rank, t).dst_weights)

    # properties ---------------------------------------------------------
    def period_product(self) -> np.ndarray:
        """W(period-1) ... W(1) W(0): the mixing of one full cycle."""
        p = np.eye(self.size)
        for t in range(self.period):
            p = self.mixing_matrix(t) @ p
        return p

    def is_row_stochastic(self, tol: float = 1e-10) -> bool:
        return all(np.allclose(self.mixing_matrix(t).sum(1), 1, atol=tol) for t in range(self.period))

    def is_column_stochastic(self, tol: float = 1e-10) -> bool:
        return all(np.allclose(self.mixing_matrix(t).sum(0), 1, atol=tol) for t in range(self.period))

    def is_doubly_stochastic(self, tol: float = 1e-10) -> bool:
        return self.is_row_stochastic(tol) and self.is_column_stochastic(tol)

    def is_symmetric(self, tol: float = 1e-12) -> bool:
        return all(np.allclose(self.mixing_matrix(t), self.mixing_matrix(t).T, atol=tol) for t in range(self.period))

    def is_strongly_connected(self) -> bool:
        """Over one period, every rank's value reaches every other rank."""
        reach = np.eye(self.size, dtype=bool)
        union = np.zeros((self.size, self.size), dtype=bool)
        for t in range(self.period):
            union |= self.mixing_matrix(t) != 0
        for _ in range(self.size):
            nxt = reach | ((union.astype(np.int64) @ reach.astype(np.int64)) > 0)
            if (nxt == reach).all():
                break
            reach = nxt
        return bool(reach.all())

    def spectral_gap(self) -> float:
        """1 - ||P - J||_2 for P the product over one period, J = 11^T / n."""
        n = self.size
        p = self.period_product()
        return float(1.0 - np.linalg.norm(p - np.full((n, n), 1.0 / n), 2))

    def describe(self) -> dict:
        return {
            "name": self.name,
            "ranks": self.size,
            "dynamic": self.is_dynamic,
            "period": self.period,
            "row_stochastic": self.is_row_stochastic(),
            "column_stochastic": self.is_column_stochastic(),
            "symmetric": self.is_symmetric(),
            "strongly_connected": self.is_strongly_connected(),
            "spectral_gap": self.spectral_gap(),
        }


def uniform_weights(adjacency: np.ndarray) -> np.ndarray:
    """W[i, j] = 1 / (in-degree(i) + 1) for j in N_in(i) and j = i: row stochastic."""
    a = (adjacency != 0).astype(np.float64)
    np.fill_diagonal(a, 1.0)
    return a / a.sum(axis=1, keepdims=True)
