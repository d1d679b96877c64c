"""Topology: who talks to whom at iteration t, and with what weights.

A topology is defined by its mixing matrices W(t), t = 0 .. period-1
(``X+ = W(t) X``, row i = receiver i, W[i, j] = the weight i gives to j's
value). A subclass only says how to build W(t) (most say which edges exist
and let a weight scheme weigh them, see GraphTopology); one rank's neighbor
weights, stochasticity, connectivity and the spectral gap are derived here.

Workers call ``weights(rank, t)`` every step, so W(t) is built once per
``t mod period``, kept sparse, and each rank's answer is cached.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from bfexp.topology.mixing import WEIGHT_SCHEMES, SparseMixing, weigh


@dataclass(frozen=True)
class RankWeights:
    """One rank's view of W(t).

    src_weights: {j: W[i, j]} for the in-neighbors j this rank receives from.
    dst_weights: {k: W[k, i]} for the out-neighbors k this rank sends to.
    Each call returns fresh dicts, so a caller may change them.
    """

    self_weight: float
    src_weights: dict[int, float]
    dst_weights: dict[int, float]


def check_ranks(size: int) -> None:
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"ranks={size}; allowed: an integer >= 1")


class Topology(abc.ABC):
    """A (possibly time-varying) mixing matrix W(t) over ``size`` ranks.

    Subclasses call ``super().__init__`` first, set their own fields, then
    end with ``self.validate()`` so a bad graph never reaches a worker.
    """

    name: str = "abstract"
    # Number of distinct W(t) in one cycle; 1 for a static graph.
    period: int = 1
    # True when the user asked for a one-way graph: it then has no undirected form.
    declared_directed: bool = False
    # Appended to the "disconnected" error: how to get a connected graph instead.
    connect_hint: str = ""

    def __init__(self, size: int, weights: str = "uniform") -> None:
        check_ranks(size)
        if weights not in WEIGHT_SCHEMES:
            raise ValueError(f"topology.weights={weights!r}; allowed: {', '.join(WEIGHT_SCHEMES)}")
        self.size = int(size)
        self.weight_scheme = weights
        self._sparse_cache: dict[int, SparseMixing] = {}
        self._dense_cache: dict[int, np.ndarray] = {}
        self._rank_cache: dict[tuple[int, int], tuple[float, tuple, tuple]] = {}

    # what a subclass provides ---------------------------------------------
    @abc.abstractmethod
    def _build(self, t: int) -> SparseMixing:
        """W(t) for 0 <= t < period."""

    def params(self) -> dict[str, Any]:
        """The parameters that pick this graph among its kind (for messages and the CLI)."""
        return {}

    def positions(self) -> np.ndarray:
        """(size, 2) drawing coordinates: ranks on a circle, rank 0 on top, clockwise."""
        angle = np.pi / 2 - 2 * np.pi * np.arange(self.size) / self.size
        return np.stack([np.cos(angle), np.sin(angle)], axis=1)

    # W(t) ---------------------------------------------------------------
    @property
    def label(self) -> str:
        """``name`` with its parameters, e.g. ``random_regular(degree=3, seed=0)``."""
        p = self.params()
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in p.items())})" if p else self.name

    @property
    def is_dynamic(self) -> bool:
        return self.period > 1

    def sparse_matrix(self, t: int = 0) -> SparseMixing:
        key = t % self.period
        m = self._sparse_cache.get(key)
        if m is None:
            m = self._sparse_cache[key] = self._build(key)
        return m

    def mixing_matrix(self, t: int = 0) -> np.ndarray:
        """Dense, read-only W(t) for analysis and tests (workers use ``weights``)."""
        key = t % self.period
        w = self._dense_cache.get(key)
        if w is None:
            w = self.sparse_matrix(key).dense()
            w.setflags(write=False)
            self._dense_cache[key] = w
        return w

    def weights(self, rank: int, t: int = 0) -> RankWeights:
        """Rank ``rank``'s self weight, in-neighbor weights and out-neighbor weights at iteration t."""
        key = (rank, t % self.period)
        hit = self._rank_cache.get(key)
        if hit is None:
            if not 0 <= rank < self.size:
                raise ValueError(f"rank={rank}; allowed: 0..{self.size - 1}")
            m = self.sparse_matrix(t)
            src, src_w = m.row(rank)
            dst, dst_w = m.column(rank)
            hit = (
                float(m.diag[rank]),
                tuple(zip(src.tolist(), src_w.tolist())),
                tuple(zip(dst.tolist(), dst_w.tolist())),
            )
            self._rank_cache[key] = hit
        return RankWeights(hit[0], dict(hit[1]), dict(hit[2]))

    def in_neighbors(self, rank: int, t: int = 0) -> list[int]:
        return sorted(self.weights(rank, t).src_weights)

    def out_neighbors(self, rank: int, t: int = 0) -> list[int]:
        return sorted(self.weights(rank, t).dst_weights)

    # properties ---------------------------------------------------------
    def _all(self) -> list[SparseMixing]:
        return [self.sparse_matrix(t) for t in range(self.period)]

    def is_row_stochastic(self, tol: float = 1e-10) -> bool:
        return all(np.allclose(m.row_sums(), 1, rtol=0, atol=tol) for m in self._all())

    def is_column_stochastic(self, tol: float = 1e-10) -> bool:
        return all(np.allclose(m.column_sums(), 1, rtol=0, atol=tol) for m in self._all())

    def is_doubly_stochastic(self, tol: float = 1e-10) -> bool:
        return self.is_row_stochastic(tol) and self.is_column_stochastic(tol)

    def is_symmetric(self, tol: float = 1e-12) -> bool:
        return all(m.is_symmetric(tol) for m in self._all())

    @property
    def directed(self) -> bool:
        """Some W(t) has an edge j -> i without i -> j."""
        return not all(_same_pattern(m) for m in self._all())

    def is_strongly_connected(self) -> bool:
        """Over one period, every rank's value reaches every other rank."""
        ms = self._all()
        senders = np.concatenate([m.senders for m in ms])
        receivers = np.concatenate([m.receivers for m in ms])
        return _reaches_all(self.size, senders, receivers) and _reaches_all(self.size, receivers, senders)

    def in_degree(self, rank: int, t: int = 0) -> int:
        return len(self.sparse_matrix(t).row(rank)[0])

    def out_degree(self, rank: int, t: int = 0) -> int:
        return len(self.sparse_matrix(t).column(rank)[0])

    def max_degree(self) -> tuple[int, int]:
        """(max in-degree, max out-degree) over ranks and one period."""
        ms = self._all()
        return (
            max(int(m.in_degrees().max(initial=0)) for m in ms),
            max(int(m.out_degrees().max(initial=0)) for m in ms),
        )

    def period_product(self) -> np.ndarray:
        """W(period-1) ... W(1) W(0): the mixing of one full cycle (dense)."""
        p = np.eye(self.size)
        for t in range(self.period):
            p = self.mixing_matrix(t) @ p
        return p

    def spectral_gap(self) -> float:
        """1 - ||P - J||_2 for P the product over one period, J = 11^T / n."""
        n = self.size
        p = self.period_product()
        return float(1.0 - np.linalg.norm(p - np.full((n, n), 1.0 / n), 2))

    def describe(self) -> dict[str, Any]:
        """Every property, for the CLI and run summaries."""
        in_deg, out_deg = self.max_degree()
        return {
            "name": self.name,
            "params": self.params(),
            "ranks": self.size,
            "weights": self.weight_scheme,
            "dynamic": self.is_dynamic,
            "period": self.period,
            "directed": self.directed,
            "max_in_degree": in_deg,
            "max_out_degree": out_deg,
            "row_stochastic": self.is_row_stochastic(),
            "column_stochastic": self.is_column_stochastic(),
            "doubly_stochastic": self.is_doubly_stochastic(),
            "symmetric": self.is_symmetric(),
            "strongly_connected": self.is_strongly_connected(),
            "spectral_gap": self.spectral_gap(),
        }

    def draw(self, path: Any) -> Any:
        """Picture of W(t) (one panel per iteration of a period) written to ``path``; see draw.py."""
        from bfexp.topology.draw import draw

        return draw(self, path)

    # checks and forms ---------------------------------------------------
    def validate(self) -> None:
        """Reject weights that mix nothing sensibly and graphs that do not connect all ranks.

        Every W(t) must be nonnegative and row or column stochastic (as its
        weight scheme promises), and the union over one period strongly connected.
        """
        for t, m in enumerate(self._all()):
            if (m.values < 0).any() or (m.diag < -1e-12).any():
                raise ValueError(f"topology={self.label} has negative weights in W({t}); allowed: nonnegative weights")
        needs = {
            "uniform": ("row", self.is_row_stochastic),
            "column": ("column", self.is_column_stochastic),
            "metropolis": ("doubly", self.is_doubly_stochastic),
        }.get(self.weight_scheme)
        if needs is None and not (self.is_row_stochastic() or self.is_column_stochastic()):
            raise ValueError(
                f"topology={self.label} is neither row nor column stochastic; "
                "allowed: weights whose rows or columns sum to 1"
            )
        if needs is not None and not needs[1]():
            raise ValueError(
                f"topology={self.label} with weights={self.weight_scheme} is not {needs[0]} stochastic; "
                "allowed: weights whose rows (uniform), columns (column) or both (metropolis) sum to 1"
            )
        if not self.is_strongly_connected():
            raise ValueError(
                f"topology={self.label} is disconnected for ranks={self.size}; "
                f"allowed: a graph that connects every rank{self.connect_hint}"
            )

    def require(
        self,
        *,
        row_stochastic: bool = False,
        column_stochastic: bool = False,
        symmetric: bool = False,
        who: str = "this algorithm",
    ) -> None:
        """Raise a one-line ValueError when W(t) lacks what an algorithm needs."""
        missing = [
            what
            for what, need, has in (
                ("row stochastic", row_stochastic, self.is_row_stochastic),
                ("column stochastic", column_stochastic, self.is_column_stochastic),
                ("symmetric", symmetric, self.is_symmetric),
            )
            if need and not has()
        ]
        if missing:
            hint = ""
            if symmetric or (row_stochastic and column_stochastic):
                hint = "; try an undirected topology with topology.weights=metropolis"
            elif column_stochastic:
                hint = "; try topology.weights=column"
            raise ValueError(
                f"{who} needs W {' and '.join(missing)}; "
                f"topology={self.label} with weights={self.weight_scheme} is not{hint}"
            )

    def undirected(self) -> "Topology | None":
        """A symmetric, doubly stochastic form of this topology, or None when it has none.

        Self when W(t) already is; otherwise the same edges made two-way with
        Metropolis-Hastings weights. None for a graph the user declared directed.
        """
        if self.declared_directed:
            return None
        if self.is_symmetric() and self.is_doubly_stochastic():
            return self
        from bfexp.topology.custom import Undirected

        return Undirected(self)


class GraphTopology(Topology):
    """A topology given by its edges at each t, weighted by a weight scheme."""

    @abc.abstractmethod
    def _edges(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(senders, receivers): edge e carries senders[e]'s value to receivers[e] at iteration t."""

    def _build(self, t: int) -> SparseMixing:
        senders, receivers = self._edges(t)
        try:
            return weigh(self.size, senders, receivers, self.weight_scheme)
        except ValueError as exc:
            if self.weight_scheme != "metropolis":
                raise
            raise ValueError(
                f"topology.weights=metropolis needs an undirected graph; topology={self.label} is directed "
                f"(W({t})); allowed: uniform, column, or an undirected topology such as symmetric_exp2"
            ) from exc


def _same_pattern(m: SparseMixing) -> bool:
    mirror = np.lexsort((m.receivers, m.senders))
    return bool(np.array_equal(m.senders[mirror], m.receivers) and np.array_equal(m.receivers[mirror], m.senders))


def _reaches_all(size: int, senders: np.ndarray, receivers: np.ndarray) -> bool:
    """Breadth-first search from rank 0 along senders -> receivers."""
    order = np.argsort(senders, kind="stable")
    targets = receivers[order]
    ptr = np.concatenate(([0], np.cumsum(np.bincount(senders, minlength=size))))
    seen = np.zeros(size, dtype=bool)
    seen[0] = True
    frontier = np.array([0])
    while frontier.size:
        nxt = np.concatenate([targets[ptr[v] : ptr[v + 1]] for v in frontier])
        nxt = np.unique(nxt[~seen[nxt]])
        seen[nxt] = True
        frontier = nxt
    return bool(seen.all())


def log2_ceil(n: int) -> int:
    """ceil(log2 n) for n >= 1, in exact integer arithmetic."""
    return (int(n) - 1).bit_length()
