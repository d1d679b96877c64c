"""Topology: who talks to whom at iteration t, and with what weights.

A topology is defined by its mixing matrices W(t), t = 0 .. period-1
(``X+ = W(t) X``, row i = receiver i, W[i, j] = the weight i gives to j's
value). The one adjacency convention of the package: an edge u -> v means
u sends to v, so it is the entry W[v, u]. A subclass only says how to build W(t) (most say which edges exist
and let a weight scheme weigh them, see GraphTopology); one rank's neighbor
weights, stochasticity, connectivity and the spectral gap are derived here.

Workers call ``weights(rank, t)`` every step, so W(t) is built once per
``t mod period``, kept sparse, and each rank's answer is cached.

A topology that cannot run (a rank count the graph cannot take, a
disconnected draw, weights the graph cannot have) raises TopologyError in
the one-line ``key=value; allowed: ...`` form when it is constructed, so a
bad graph never reaches a worker; any other exception is a bug.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bfexp.errors import TopologyError, number_in
from bfexp.topology.mixing import WEIGHT_SCHEMES, NotUndirected, SparseMixing, WeightScheme, weigh


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
    """Raise TopologyError unless ``size`` is a rank count (an integer >= 1)."""
    number_in("ranks", size, low=1, integer=True, error=TopologyError)


class Topology(abc.ABC):
    """A (possibly time-varying) mixing matrix W(t) over ``size`` ranks.

    Subclasses call ``super().__init__`` first, set their own fields, then
    end with ``self.validate()`` so a bad graph never reaches a worker.
    """

    # The conf/topology option name (its label in summaries).
    name: ClassVar[str] = "abstract"
    # Number of distinct W(t) in one cycle; 1 for a static graph.
    period: int = 1
    # True when the user asked for a one-way graph: it then has no undirected form.
    declared_directed: bool = False
    # Appended to the "disconnected" error: how to get a connected graph instead.
    connect_hint: str = ""
    # The values ``weights`` may take; a user's own matrices may also be used as "given".
    weight_choices: ClassVar[tuple[str, ...]] = WEIGHT_SCHEMES

    def __init__(self, size: int, *, weights: WeightScheme = "uniform") -> None:
        check_ranks(size)
        if weights not in self.weight_choices:
            raise TopologyError(f"topology.weights={weights!r}; allowed: {', '.join(self.weight_choices)}")
        self.size = int(size)
        # A WeightScheme, or "given" for a user's weights used as they are (custom.py).
        self.weight_scheme: str = weights
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

    def sum_range(self, axis: str) -> tuple[float, float]:
        """(lowest, highest) sum of W(t)'s ``rows`` or ``columns`` over one period."""
        sums = [m.row_sums() if axis == "rows" else m.column_sums() for m in self._all()]
        return min(float(x.min()) for x in sums), max(float(x.max()) for x in sums)

    def explain(self, need: str) -> tuple[str, str]:
        """(what W lacks, the fix) for a property an algorithm needs: row, column, doubly, symmetric.

        E.g. ``("columns of W sum to 0.5..4", "topology.weights=column")``: the
        numbers say how far off W is, the fix how to get the property.
        """

        def sums(axis: str) -> str:
            lo, hi = self.sum_range(axis)
            span = f"{lo:.4g}" if f"{lo:.4g}" == f"{hi:.4g}" else f"{lo:.4g}..{hi:.4g}"
            return f"{axis} of W sum to {span}" + (f" over t = 0..{self.period - 1}" if self.is_dynamic else "")

        def weigh_or_give(scheme: str, axis: str) -> str:
            given = self.weight_scheme == "given"
            return f"topology.weights={scheme}" + (f" (weigh its edges), or a W whose {axis} sum to 1" if given else "")

        if need == "row":
            return sums("rows"), weigh_or_give("uniform", "rows")
        if need == "column":
            return sums("columns"), weigh_or_give("column", "columns")
        if need == "doubly":
            detail = f"{sums('rows')}, {sums('columns')}"
            if self.directed:
                return detail, "an undirected graph with topology.weights=metropolis, or a regular one"
            return detail, "topology.weights=metropolis"
        if need == "symmetric":
            detail = "W has one-way edges" if self.directed else "W is not symmetric"
            return detail, "an undirected graph (e.g. symmetric_exp2) with topology.weights=metropolis"
        raise ValueError(f"explain({need!r}): a bug, the properties are row, column, doubly, symmetric")

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

    def draw(self, path: Any, spectral_gap: float | None = None) -> Any:
        """Picture of W(t) (one panel per iteration of a period) written to ``path``; see draw.py.
        ``spectral_gap``: this topology's, when the caller has it (a dense product: 20 s at 4096 ranks)."""
        from bfexp.topology.draw import draw

        return draw(self, path, spectral_gap=spectral_gap)

    # checks and forms ---------------------------------------------------
    def validate(self) -> None:
        """Reject weights that mix nothing sensibly and graphs that do not connect all ranks.

        Every W(t) must be nonnegative and row or column stochastic (as its
        weight scheme promises), and the union over one period strongly connected.
        """
        for t, m in enumerate(self._all()):
            if not (np.isfinite(m.values).all() and np.isfinite(m.diag).all()):
                raise TopologyError(
                    f"topology={self.label} has weights in W({t}) that are not finite; allowed: finite weights")
            if (m.values < 0).any() or (m.diag < -1e-12).any():
                raise TopologyError(f"topology={self.label} has negative weights in W({t}); allowed: nonnegative weights")
        needs = {
            "uniform": ("row", self.is_row_stochastic),
            "column": ("column", self.is_column_stochastic),
            "metropolis": ("doubly", self.is_doubly_stochastic),
        }.get(self.weight_scheme)
        if needs is None and not (self.is_row_stochastic() or self.is_column_stochastic()):
            rows, cols = self.sum_range("rows"), self.sum_range("columns")
            raise TopologyError(
                f"topology={self.label} with weights={self.weight_scheme} is neither row nor column stochastic "
                f"(rows of W sum to {rows[0]:.4g}..{rows[1]:.4g}, columns to {cols[0]:.4g}..{cols[1]:.4g}); "
                "allowed: a W whose rows or columns sum to 1, or topology.weights=uniform, metropolis or column "
                "to weigh its edges"
            )
        if needs is not None and not needs[1]():
            raise TopologyError(
                f"topology={self.label} with weights={self.weight_scheme} is not {needs[0]} stochastic; "
                "allowed: weights whose rows (uniform), columns (column) or both (metropolis) sum to 1"
            )
        if not self.is_strongly_connected():
            raise TopologyError(
                f"topology={self.label} is disconnected for ranks={self.size}; "
                f"allowed: a graph that connects every rank{self.connect_hint}"
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
        except NotUndirected:
            raise TopologyError(
                f"topology.weights=metropolis; allowed: uniform or column, since topology={self.label} is "
                f"directed (W({t})), or an undirected topology such as symmetric_exp2"
            ) from None


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


class Undirected(GraphTopology):
    """Another topology's edges made two-way, with Metropolis-Hastings weights at every t."""

    name: ClassVar[str] = "undirected"

    def __init__(self, base: Topology) -> None:
        super().__init__(base.size, weights="metropolis")
        self.base = base
        self.period = base.period
        self.validate()

    @property
    def label(self) -> str:
        """``undirected_`` + the base's label, e.g. ``undirected_random_regular(degree=3, seed=0)``."""
        return f"undirected_{self.base.label}"

    def params(self) -> dict[str, Any]:
        return self.base.params()

    def positions(self) -> np.ndarray:
        return self.base.positions()

    def _edges(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        m = self.base.sparse_matrix(t)
        return np.concatenate([m.senders, m.receivers]), np.concatenate([m.receivers, m.senders])
