"""Metropolis-Hastings weights and undirected forms, against the textbook formula."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from bfexp.topology import AdjacencyTopology
from bfexp.topology.graphs import Exp2, Ring


def metropolis_reference(adjacency: np.ndarray) -> np.ndarray:
    """W[i, j] = 1 / (1 + max(d_i, d_j)) on edges; W[i, i] = 1 - sum of the row."""
    n = adjacency.shape[0]
    deg = adjacency.sum(axis=1)
    w = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if i != j and adjacency[i, j]:
                w[i, j] = 1.0 / (1.0 + max(deg[i], deg[j]))
        w[i, i] = 1.0 - w[i].sum()
    return w


@pytest.mark.parametrize("seed", range(6))
def test_metropolis_symmetric_doubly_stochastic_on_random_graphs(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    g = nx.gnp_random_graph(n, float(rng.uniform(0.1, 0.6)), seed=seed)
    if not nx.is_connected(g):  # keep it connected: add a path through all nodes
        g.add_edges_from((i, i + 1) for i in range(n - 1))
    a = nx.to_numpy_array(g, nodelist=range(n), dtype=int)
    w = np.array(AdjacencyTopology(a, direction="undirected", weights="metropolis").mixing_matrix())
    np.testing.assert_allclose(w, metropolis_reference(a), atol=1e-14)
    np.testing.assert_allclose(w, w.T, atol=1e-14)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert (w >= 0).all()


@pytest.mark.parametrize("n", [5, 8, 12])
def test_undirected_forms(n):
    # exp2 -> neighbors at i +- 2^k with Metropolis-Hastings weights.
    und = Exp2(n).undirected()
    w = np.array(und.mixing_matrix())
    a = np.zeros((n, n), dtype=int)
    for i in range(n):
        for d in (2**k for k in range(8) if 2**k < n):
            a[i, (i + d) % n] = a[i, (i - d) % n] = 1
    np.fill_diagonal(a, 0)
    np.testing.assert_allclose(w, metropolis_reference(a), atol=1e-14)
    # An undirected ring already is symmetric and doubly stochastic; a declared one-way ring has no undirected form.
    ring = Ring(n)
    assert ring.undirected() is ring
    assert Ring(n, directed=True).undirected() is None
