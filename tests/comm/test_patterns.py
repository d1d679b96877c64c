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


REPEATS = """
import numpy as np
import torch
import bfexp.comm.mpi as mpi
from bfexp.comm.mpi import MPIEngine
from bfexp.topology import Exp2, OnePeerExp2

made = []
class Counting(mpi._Repeat):
    def __init__(self, tensor, spec):
        made.append(tensor.numel())
        super().__init__(tensor, spec)
mpi._Repeat = Counting  # instrumentation: count the set-ups the engine keeps

e = MPIEngine()
r, n = e.rank, e.size
if r == 0:  # rank 0 never takes the kept set-up: the messages must still pair with the others'
    e._post_repeated_neighbor_allreduce = lambda key, tensor, t: None
out = {}
e.set_topology(OnePeerExp2(n))
flat = torch.arange(12, dtype=torch.float64) + 100.0 * r
lo, hi = flat[:5], flat[5:]
history = []
for k in range(7):  # both slices in flight at once, new view objects of the same memory every round
    h_lo = e.ineighbor_allreduce_(flat[:5], t=k)
    h_hi = e.ineighbor_allreduce_(flat[5:], t=k)
    got = h_hi.wait()
    h_lo.wait()
    history.append(flat.tolist())
out["one_peer"] = history
out["one_peer_made"] = list(made)
out["bytes_sent"] = e.bytes_sent
del made[:]
e.set_topology(Exp2(n))
x = torch.ones(4, dtype=torch.float32) * (r + 1)
for k in range(3):
    e.neighbor_allreduce_(x)
out["exp2"] = x.tolist()
out["exp2_made"] = list(made)
out["returned_given"] = e.ineighbor_allreduce_(x).wait() is x
e.close()
emit(out)
"""


def test_repeated_exchanges_keep_their_set_up_and_compute_w_x(tmp_path):
    """After its check, a topology round's exchange of one tensor memory reuses one set-up (buffers,
    peers) per round and address: chained W(k) X over 7 rounds of the one-peer graph on two slices in
    flight at once, and exp2 after set_topology, equal numpy's products, with rank 0 on the general
    path (the same messages); the bytes counted are those sent."""
    n = 4
    got = run_ranks(n, REPEATS, tmp_path)
    topo = OnePeerExp2(n)
    X = np.stack([np.arange(12.0) + 100.0 * r for r in range(n)])
    for k in range(7):
        X = topo.mixing_matrix(k) @ X
        for r in range(n):
            np.testing.assert_allclose(got[r]["one_peer"][k], X[r], rtol=1e-12)
    from bfexp.topology import Exp2

    e = Exp2(n).mixing_matrix(0)
    Y = np.linalg.matrix_power(e, 3) @ np.stack([np.full(4, r + 1.0) for r in range(n)])
    for r in range(n):
        np.testing.assert_allclose(got[r]["exp2"], Y[r], rtol=1e-6)
        assert got[r]["returned_given"] is True
        # one peer per round: 7 rounds x 12 float64 = 672 bytes, whichever path sent them
        assert got[r]["bytes_sent"] == 7 * 12 * 8
    assert got[0]["one_peer_made"] == [] and got[0]["exp2_made"] == []
    for r in range(1, n):  # rounds 0 and 1 are checked first; from their repeat on: one set-up per round and slice
        assert sorted(got[r]["one_peer_made"]) == [5, 5, 7, 7]
        assert got[r]["exp2_made"] == [4]  # the second and third exchange share one
