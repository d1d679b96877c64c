"""First MPI engine operations on real ranks, against numpy references."""

import numpy as np
import pytest

from bfexp.topology import Exp2
from tests.mpi_helpers import run_ranks

OPS = """
import torch
from bfexp.comm.mpi import MPIEngine
from bfexp.topology import Exp2
e = MPIEngine()
e.set_topology(Exp2(e.size))
r, n = e.rank, e.size
x = torch.arange(6, dtype=torch.float64) * (r + 1) + r ** 2
lst = [x[:2].clone().reshape(2, 1), x[2:].clone()]
one_round = e.neighbor_allreduce(x)
fused = e.neighbor_allreduce(lst)
y = x.clone()
for _ in range(200):
    y = e.neighbor_allreduce(y)
total = e.allreduce(x, op="sum")
avg = e.allreduce(lst, op="avg")
root = torch.full((3,), float(r))
b = e.broadcast(root, root=n - 1)
e.barrier()
emit(dict(x=x.tolist(), one_round=one_round.tolist(), fused=torch.cat([t.reshape(-1) for t in fused]).tolist(),
          converged=y.tolist(), total=total.tolist(), avg=torch.cat([t.reshape(-1) for t in avg]).tolist(),
          bcast=b.tolist(), untouched=(root == r).all().item()))
"""


@pytest.mark.parametrize("n", [2, 4])
def test_first_ops_match_numpy(n, tmp_path):
    out = run_ranks(n, OPS, tmp_path)
    X = np.array([o["x"] for o in out])
    W = Exp2(n).mixing_matrix()
    np.testing.assert_allclose([o["one_round"] for o in out], W @ X, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose([o["fused"] for o in out], W @ X, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose([o["converged"] for o in out], np.tile(X.mean(0), (n, 1)), atol=1e-6)
    for o in out:
        np.testing.assert_allclose(o["total"], X.sum(0), rtol=1e-12)
        np.testing.assert_allclose(o["avg"], X.mean(0), rtol=1e-12)
        assert o["bcast"] == [float(n - 1)] * 3
        assert o["untouched"], "broadcast must not overwrite the caller's tensor"
