"""Exchanges the engine's topology gives (weights left out) are checked once per (round, size, dtype),
then trusted: repeats skip the declaration gather and still compute W(t) X; exchanges with explicit
weights are still checked, so a mismatch raises CommError on every rank after trusted repeats too.

One spawn of 4 real MPI ranks (the round trip it saves is MPI's); the reference is numpy's W(t) @ X
from the topology's own mixing matrices.
"""

from __future__ import annotations

import numpy as np

from bfexp.topology import OnePeerExp2
from tests.mpi_helpers import run_ranks

CODE = """
import torch
import bfexp.comm.engine as eng
from bfexp.comm.mpi import MPIEngine
from bfexp.topology import OnePeerExp2

declared = []
class Counting(eng.Declaration):
    def __init__(self, *a, **k):
        declared.append(a[0])
        super().__init__(*a, **k)
eng.Declaration = Counting  # instrumentation: count declarations the engine makes

e = MPIEngine()
r, n = e.rank, e.size
e.set_topology(OnePeerExp2(n))
out = {"rounds": []}
for k in range(6):  # rounds 0, 1, 0, 1, ...: each checked the first time
    x = torch.arange(5, dtype=torch.float64) + 10.0 * r + k
    e.neighbor_allreduce_(x, t=k)
    out["rounds"].append(x.tolist())
out["declared_topology"] = len(declared)
try:  # explicit weights: checked; rank 0 expects from 1, which does not send
    e.neighbor_allreduce(torch.ones(3, dtype=torch.float64), 0.5, {1: 0.5} if r == 0 else {}, [])
    out["raised"] = None
except Exception as exc:
    out["raised"] = type(exc).__name__
h = e.ineighbor_allreduce_(torch.ones(5, dtype=torch.float64), t=0)  # trusted again, nonblocking
out["after"] = h.wait().tolist()
e.close()
emit(out)
"""


def test_topology_exchanges_are_checked_once_then_trusted(tmp_path):
    n = 4
    got = run_ranks(n, CODE, tmp_path)
    topo = OnePeerExp2(n)
    period = topo.period
    for k in range(6):
        X = np.stack([np.arange(5.0) + 10.0 * r + k for r in range(n)])
        expected = topo.mixing_matrix(k) @ X
        for r in range(n):
            np.testing.assert_allclose(got[r]["rounds"][k], expected[r], rtol=0, atol=1e-12)
    for r in range(n):
        assert got[r]["declared_topology"] == period  # one check per round of the period, none for repeats
        assert got[r]["raised"] == "CommError"
        np.testing.assert_allclose(got[r]["after"], np.ones(5))
