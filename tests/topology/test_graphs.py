"""Graphs against their definitions, and W(t) sums for every option.

References are computed here from the definitions (distances on a circle,
1/(degree+1) weights), never read back from the library.
"""

from __future__ import annotations

import numpy as np
import pytest

from bfexp.errors import TopologyError
from bfexp.topology import build_topology
from bfexp.topology.cli import option_names, option_node
from bfexp.topology.graphs import Exp2

# every packaged conf/topology option that builds from its defaults (file needs a path: test_file_topology.py)
OPTIONS = [o for o in option_names() if "???" not in option_node(o).values()]


def exp_distances(n: int, base: int) -> list[int]:
    return [base**k for k in range(64) if base**k < n]


@pytest.mark.parametrize("base", [2, 3])
@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 16, 17, 33])
def test_exp2_neighbor_sets_match_definition(n, base):
    topo = Exp2(n, base=base)
    w = topo.mixing_matrix()
    for i in range(n):
        expected_in = {(i - d) % n for d in exp_distances(n, base)} - {i}
        expected_out = {(i + d) % n for d in exp_distances(n, base)} - {i}
        assert set(topo.in_neighbors(i)) == expected_in
        assert set(topo.out_neighbors(i)) == expected_out
        # The dense matrix agrees: W[i, j] != 0 exactly for j in N_in(i) and j = i.
        assert set(np.flatnonzero(w[i])) == expected_in | {i}
        # Uniform weights: 1 / (in-degree + 1) on each of them.
        np.testing.assert_allclose(w[i, sorted(expected_in | {i})], 1.0 / (len(expected_in) + 1))


def _all_options(n: int) -> list[tuple[str, dict, int]]:
    """(name, params, ranks_per_machine) for every option that can take n ranks."""
    out = []
    for name in OPTIONS:
        if name == "hypercube" and n & (n - 1):
            continue
        if "weights" not in option_node(name):  # its weights are its construction: test_base_graph.py
            continue
        for weights in ("uniform", "metropolis", "column"):
            params = {"weights": weights}
            if name == "random_regular":
                params["degree"] = 3
            if name == "mesh":
                params["torus"] = n % 2 == 0
            out.append((name, params, (4 if n >= 8 else 1) if name == "inner_outer_exp2" else 0))
    return out


@pytest.mark.parametrize("n", [4, 8, 12, 16])
def test_row_and_column_sums(n):
    checked = 0
    for name, params, rpm in _all_options(n):
        try:
            topo = build_topology({**option_node(name), **params}, n, rpm)
        except TopologyError as exc:
            # Only Metropolis-Hastings on a graph with one-way edges is refused.
            assert params["weights"] == "metropolis" and "undirected" in str(exc), (name, exc)
            continue
        for t in range(topo.period):
            w = np.array(topo.mixing_matrix(t))
            assert (w >= 0).all(), (name, t)
            nnz_row = (w != 0).sum(axis=1)
            nnz_col = (w != 0).sum(axis=0)
            if params["weights"] in ("uniform", "metropolis"):
                np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12, err_msg=f"{name} W({t}) rows")
            if params["weights"] in ("column", "metropolis"):
                np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12, err_msg=f"{name} W({t}) cols")
            if params["weights"] == "uniform":
                np.testing.assert_allclose(w, np.where(w != 0, 1.0 / nnz_row[:, None], 0.0), atol=1e-12)
            if params["weights"] == "column":
                np.testing.assert_allclose(w, np.where(w != 0, 1.0 / nnz_col[None, :], 0.0), atol=1e-12)
            # What a worker sees agrees with the matrix.
            for i in range(n):
                rw = topo.weights(i, t)
                assert rw.self_weight == pytest.approx(w[i, i])
                assert rw.src_weights == pytest.approx({j: w[i, j] for j in np.flatnonzero(w[i]) if j != i})
                assert rw.dst_weights == pytest.approx({k: w[k, i] for k in np.flatnonzero(w[:, i]) if k != i})
            checked += 1
    assert checked >= len(OPTIONS)
