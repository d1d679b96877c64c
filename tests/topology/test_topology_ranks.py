"""neighbor_allreduce on real MPI ranks, with every topology's weights, equals W(t) @ X.

Each rank mixes its own row of X with the weights ``topology.weights(rank, t)``
gives it; the test compares the rows against numpy's W(t) @ X. Directed
graphs are also run with column weights the push-sum way (senders scale,
receivers add), which must give the same W(t) @ X.
"""

from __future__ import annotations

import numpy as np
import pytest

from bfexp.topology import TOPOLOGIES, build_topology
from tests.mpi_helpers import run_ranks

# The iterations checked: a full period (two for short ones) and a wrap-around.
MAX_T = 12


def cases(n: int) -> list[dict]:
    out = []
    for name in TOPOLOGIES:
        if name == "hypercube" and n & (n - 1):
            continue
        cfg = {"name": name}
        if name == "random_regular":
            cfg["degree"] = 3
        out.append({"cfg": cfg, "rpm": (4 if n >= 8 else 1) if name == "inner_outer_exp2" else 0, "push": False})
        out.append({"cfg": {**cfg, "weights": "column"}, "rpm": out[-1]["rpm"], "push": True})
    return out


def row(rank: int) -> np.ndarray:
    return np.arange(5, dtype=np.float64) * (rank + 1) + rank**2


CODE = """
import json, torch
from bfexp.comm.mpi import MPIEngine
from bfexp.topology import build_topology
cases = json.loads({cases!r})
e = MPIEngine()
r = e.rank
x = torch.arange(5, dtype=torch.float64) * (r + 1) + r ** 2
results = []
for case in cases:
    topo = build_topology(case["cfg"], e.size, case["rpm"])
    e.set_topology(topo)
    per_t = []
    for t in range(min(max(2 * topo.period, 2), {max_t})):
        w = topo.weights(r, t)
        if case["push"]:  # column weights: senders scale, receivers add
            y = e.neighbor_allreduce(x, w.self_weight, {{j: 1.0 for j in w.src_weights}}, w.dst_weights)
        else:             # receivers weigh, senders send plain values
            y = e.neighbor_allreduce(x, w.self_weight, w.src_weights, list(w.dst_weights))
        per_t.append(y.tolist())
    results.append(per_t)
emit(results)
"""


@pytest.mark.parametrize("n", [4, 8])
def test_neighbor_allreduce_matches_mixing_matrix(n, tmp_path):
    import json

    todo = cases(n)
    out = run_ranks(n, CODE.format(cases=json.dumps(todo), max_t=MAX_T), tmp_path, timeout=300)
    x = np.stack([row(i) for i in range(n)])
    for k, case in enumerate(todo):
        topo = build_topology(case["cfg"], n, case["rpm"])
        got_t = len(out[0][k])
        assert got_t == min(max(2 * topo.period, 2), MAX_T)
        for t in range(got_t):
            expected = np.asarray(topo.mixing_matrix(t)) @ x
            got = np.array([out[i][k][t] for i in range(n)])
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{case} t={t}")
