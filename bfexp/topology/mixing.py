"""Mixing weights: turn a graph's edges into a sparse W(t).

W is kept sparse (self weights + off-diagonal entries) so a 1000-rank graph
with a handful of neighbors each costs kilobytes, not a dense n x n matrix,
and one rank's weights are a slice, not a scan of a row.

Weight schemes (``topology.weights``):

* ``uniform``: W[i, j] = 1 / (in-degree(i) + 1) for j in N_in(i) and j = i.
  Row stochastic on any graph; doubly stochastic on regular ones.
* ``metropolis``: Metropolis-Hastings, W[i, j] = 1 / (1 + max(deg i, deg j))
  on edges, the rest on the diagonal. Symmetric and doubly stochastic on any
  undirected graph, which is what exact diffusion needs.
* ``column``: W[k, i] = 1 / (out-degree(i) + 1) for k in N_out(i) and k = i.
  Column stochastic on any graph: what push-sum needs on directed graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from bfexp.errors import NotUndirected

# The values of ``topology.weights``; the Literal is the schema, the tuple its members.
WeightScheme = Literal["uniform", "metropolis", "column"]
WEIGHT_SCHEMES: tuple[str, ...] = get_args(WeightScheme)


@dataclass(frozen=True)
class SparseMixing:
    """W(t) as self weights plus off-diagonal entries sorted by receiver.

    Entry e says receiver ``receivers[e]`` gives weight ``values[e]`` to
    sender ``senders[e]``'s value (W[receiver, sender]). ``row_ptr`` slices
    the entries of one receiver; ``col_order``/``col_ptr`` those of one sender.
    """

    size: int
    diag: np.ndarray
    receivers: np.ndarray
    senders: np.ndarray
    values: np.ndarray
    row_ptr: np.ndarray
    col_order: np.ndarray
    col_ptr: np.ndarray

    @classmethod
    def from_entries(
        cls, size: int, diag: np.ndarray, receivers: np.ndarray, senders: np.ndarray, values: np.ndarray
    ) -> "SparseMixing":
        """Entries must be unique, off-diagonal and nonzero; they are sorted here."""
        receivers = np.asarray(receivers, dtype=np.int64)
        senders = np.asarray(senders, dtype=np.int64)
        values = np.asarray(values, dtype=np.float64)
        order = np.lexsort((senders, receivers))
        receivers, senders, values = receivers[order], senders[order], values[order]
        row_ptr = np.concatenate(([0], np.cumsum(np.bincount(receivers, minlength=size))))
        col_order = np.argsort(senders, kind="stable")
        col_ptr = np.concatenate(([0], np.cumsum(np.bincount(senders, minlength=size))))
        arrays = (np.asarray(diag, dtype=np.float64), receivers, senders, values, row_ptr, col_order, col_ptr)
        for a in arrays:
            a.setflags(write=False)
        return cls(size, *arrays)

    @classmethod
    def from_dense(cls, w: np.ndarray) -> "SparseMixing":
        w = np.asarray(w, dtype=np.float64)
        off = w.copy()
        np.fill_diagonal(off, 0.0)
        receivers, senders = np.nonzero(off)
        return cls.from_entries(w.shape[0], np.diag(w).copy(), receivers, senders, off[receivers, senders])

    @property
    def num_edges(self) -> int:
        return int(self.values.size)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(senders, weights) that receiver i combines: W[i, j] != 0, j != i."""
        a, b = self.row_ptr[i], self.row_ptr[i + 1]
        return self.senders[a:b], self.values[a:b]

    def column(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(receivers, weights) that sender i reaches: W[k, i] != 0, k != i."""
        idx = self.col_order[self.col_ptr[i] : self.col_ptr[i + 1]]
        return self.receivers[idx], self.values[idx]

    def in_degrees(self) -> np.ndarray:
        return np.diff(self.row_ptr)

    def out_degrees(self) -> np.ndarray:
        return np.diff(self.col_ptr)

    def row_sums(self) -> np.ndarray:
        return self.diag + np.bincount(self.receivers, self.values, minlength=self.size)

    def column_sums(self) -> np.ndarray:
        return self.diag + np.bincount(self.senders, self.values, minlength=self.size)

    def is_symmetric(self, tol: float = 1e-12) -> bool:
        """W == W^T: every entry (i, j, w) has its mirror (j, i, w)."""
        if not np.array_equal(self.out_degrees(), self.in_degrees()):
            return False
        mirror = np.lexsort((self.receivers, self.senders))
        return bool(
            np.array_equal(self.senders[mirror], self.receivers)
            and np.array_equal(self.receivers[mirror], self.senders)
            and np.allclose(self.values[mirror], self.values, rtol=0, atol=tol)
        )

    def dense(self) -> np.ndarray:
        w = np.zeros((self.size, self.size))
        w[self.receivers, self.senders] = self.values
        w[np.arange(self.size), np.arange(self.size)] = self.diag
        return w



def unique_edges(size: int, senders: np.ndarray, receivers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges sender -> receiver without self loops or repeats (a graph may list an edge twice)."""
    s = np.asarray(senders, dtype=np.int64).ravel() % size
    r = np.asarray(receivers, dtype=np.int64).ravel() % size
    keys = np.unique(r[s != r] * size + s[s != r])
    return keys % size, keys // size


def is_undirected(size: int, senders: np.ndarray, receivers: np.ndarray) -> bool:
    """Every edge j -> i has its reverse i -> j (edges must be unique)."""
    forward = np.sort(receivers * size + senders)
    backward = np.sort(senders * size + receivers)
    return bool(np.array_equal(forward, backward))


def weigh(size: int, senders: np.ndarray, receivers: np.ndarray, scheme: str) -> SparseMixing:
    """W for the graph with edges senders[e] -> receivers[e] under a weight scheme.

    Raises NotUndirected for ``metropolis`` on a directed graph (the caller
    names the topology in the user's error) and ValueError for an unknown
    scheme (a bug: constructors check the scheme first).
    """
    senders, receivers = unique_edges(size, senders, receivers)
    in_deg = np.bincount(receivers, minlength=size).astype(np.float64)
    out_deg = np.bincount(senders, minlength=size).astype(np.float64)
    if scheme == "uniform":
        values = 1.0 / (in_deg[receivers] + 1.0)
        diag = 1.0 / (in_deg + 1.0)
    elif scheme == "column":
        values = 1.0 / (out_deg[senders] + 1.0)
        diag = 1.0 / (out_deg + 1.0)
    elif scheme == "metropolis":
        if not is_undirected(size, senders, receivers):
            raise NotUndirected("metropolis weights need an undirected graph")
        values = 1.0 / (1.0 + np.maximum(in_deg[receivers], in_deg[senders]))
        diag = 1.0 - np.bincount(receivers, values, minlength=size)
    else:
        raise ValueError(f"unknown weight scheme {scheme!r}; constructors accept only {WEIGHT_SCHEMES}")
    return SparseMixing.from_entries(size, diag, receivers, senders, values)
