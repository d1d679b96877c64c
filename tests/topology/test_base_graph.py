"""Base-(k+1) graphs (Takezawa et al. 2023) against numpy: the product of one period of W(t)
is exactly J = 11^T / n for every n and k, in the number of steps the topology states."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bfexp.topology import BaseGraph
from bfexp.topology.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_exact_average_in_the_stated_number_of_steps(k):
    for n in range(5, 41):
        graph = BaseGraph(n, k=k)
        steps = graph.describe()["exact_average_steps"]
        assert steps == graph.period
        product = np.eye(n)
        for t in range(steps):
            product = graph.mixing_matrix(t) @ product
        assert np.abs(product - 1.0 / n).max() < 1e-12, (n, k)
        # and not one step earlier: the stated number is what it takes
        before = np.eye(n)
        for t in range(steps - 1):
            before = graph.mixing_matrix(t) @ before
        assert np.abs(before - 1.0 / n).max() > 1e-3, (n, k)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_step_is_symmetric_doubly_stochastic_with_at_most_k_peers(k):
    for n in range(2, 41):
        graph = BaseGraph(n, k=k)
        for t in range(graph.period):
            w = graph.mixing_matrix(t)
            assert (w >= 0).all()
            np.testing.assert_allclose(w, w.T, atol=1e-15)
            np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-15)
            np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-15)
            assert ((w > 0).sum(axis=1) - 1).max() <= k, (n, k, t)
        assert graph.max_degree() <= (k, k)


def test_step_counts_the_paper_states():
    # n = (k+1)^p: the k-peer hyper-hypercube, p steps; the paper's bound 2 log_{k+1}(n) + 2 otherwise
    for k in (1, 2, 3, 4):
        for p in (1, 2, 3):
            assert BaseGraph((k + 1) ** p, k=k).period == p
        for n in range(2, 100):
            assert BaseGraph(n, k=k).period <= 2 * math.log(n, k + 1) + 2 + 1e-9
    assert BaseGraph(6, k=1).period == 4  # the authors' Base-2 graph with 6 nodes
    assert BaseGraph(12, k=2).period == 3  # 12 = 2 x 2 x 3: one clique step per factor


def test_virtual_ranks_reach_the_exact_average():
    """7 ranks exchange through the engine with the topology's weights, one period: every rank holds the mean."""
    import torch

    from bfexp.comm.threads import run_threads

    n, graph = 7, BaseGraph(7, k=2)
    values = np.random.default_rng(0).normal(size=(n, 5))

    def rank(engine):
        x = torch.tensor(values[engine.rank])
        for t in range(graph.period):
            w = graph.weights(engine.rank, t)
            x = engine.neighbor_allreduce(x, w.self_weight, w.src_weights, list(w.dst_weights))
        return x.tolist()

    got = np.array(run_threads(n, rank, timeout=60))
    assert np.abs(got - values.mean(axis=0)).max() < 1e-12


def test_the_topology_tool_states_the_steps_and_draws_them(capsys, tmp_path):
    main(["base_graph", "--ranks", "6", "--k", "1", "--json"])
    facts = json.loads(capsys.readouterr().out)
    assert facts["exact_average_steps"] == 4 and facts["period"] == 4 and facts["max_in_degree"] == 1
    main(["base_graph", "--ranks", "10", "--k", "2", "--out", str(tmp_path / "g.png")])
    out = capsys.readouterr().out
    assert "exact_average_steps" in out and (tmp_path / "g.png").read_bytes().startswith(PNG_MAGIC)


def test_a_bad_k_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["base_graph", "--ranks", "6", "--k", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "topology.k=0" in err and "allowed" in err and "\n" not in err
