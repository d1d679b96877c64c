"""Spectral gaps and period products against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bfexp.topology.dynamic import InnerOuterExp2, OnePeerExp2
from bfexp.topology.graphs import Exp2, Ring


@pytest.mark.parametrize("n", range(3, 41))
def test_ring_gap_closed_form(n):
    ring = Ring(n)
    w = np.array(ring.mixing_matrix())
    assert np.allclose(w[w != 0], 1 / 3)  # the weights the closed form is for
    expected = (2 / 3) * (1 - math.cos(2 * math.pi / n))
    assert ring.spectral_gap() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", range(2, 65, 2))
def test_static_exp2_norm_closed_form(n):
    w = np.array(Exp2(n).mixing_matrix())
    norm = np.linalg.norm(w - np.full((n, n), 1 / n), 2)
    assert norm == pytest.approx(1 - 2 / (1 + math.ceil(math.log2(n))), abs=1e-12)
    assert Exp2(n).spectral_gap() == pytest.approx(1 - norm, abs=1e-12)


@pytest.mark.parametrize("n", [2**k for k in range(1, 7)])
def test_one_peer_exp2_period_product_is_exact_average(n):
    topo = OnePeerExp2(n)
    k = int(math.log2(n))
    assert topo.period == k
    for start in range(k + 2):  # any k consecutive iterations, also across a period boundary
        p = np.eye(n)
        for t in range(start, start + k):
            p = np.array(topo.mixing_matrix(t)) @ p
        np.testing.assert_allclose(p, np.full((n, n), 1 / n), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "n,per_machine", [(4, 1), (8, 4), (12, 3), (16, 4), (24, 8), (30, 5), (64, 8), (40, 10)]
)
def test_inner_outer_exp2_doubly_stochastic(n, per_machine):
    topo = InnerOuterExp2(n, ranks_per_machine=per_machine)
    for t in range(2 * topo.period):
        w = np.array(topo.mixing_matrix(t))
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        # One message out and one in per rank; only one rank per machine leaves its machine.
        off = (w > 0) & ~np.eye(n, dtype=bool)
        assert (off.sum(axis=0) <= 1).all() and (off.sum(axis=1) <= 1).all()
        senders, receivers = np.nonzero(off.T)
        crossing = senders[senders // per_machine != receivers // per_machine]
        assert len(set(crossing // per_machine)) == len(crossing)
    assert topo.is_strongly_connected()
