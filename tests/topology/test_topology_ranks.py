"""neighbor_allreduce on real MPI ranks, with every topology's weights, equals W(t) @ X.

Each rank mixes its own row of X with the weights ``topology.weights(rank, t)``
gives it; the test compares the rows against numpy's W(t) @ X. Directed
graphs are also run with column weights the push-sum way (senders scale,
receivers add), which must give the same W(t) @ X.

Your own graph runs the same way: the ``file`` option reads a folder of three
random directed matrices, a time-varying graph that must cycle W(0), W(1),
W(2), W(0), ... like the built-in dynamic graphs; here W(t) is the matrix
numpy wrote, not the library's reading of it.
"""

from __future__ import annotations

import numpy as np
import pytest

from bfexp.topology import build_topology
from bfexp.topology.cli import option_names, option_node
from tests.mpi_helpers import run_ranks

# The iterations checked: a full period (two for short ones) and a wrap-around.
MAX_T = 12


def three_matrices(n: int, seed: int = 0) -> list[np.ndarray]:
    """Random row-stochastic W(t), W[i, j]: i receives from j; each has the one-way ring i -> i + t + 1."""
    rng = np.random.default_rng(seed)
    mats = []
    for t in range(3):
        w = rng.random((n, n)) * (rng.random((n, n)) < 0.3) + np.eye(n) + np.roll(np.eye(n), -(t + 1), axis=1)
        mats.append(w / w.sum(axis=1, keepdims=True))
    return mats


def cases(n: int, folder) -> list[dict]:
    out = []
    for name in option_names():
        if name == "hypercube" and n & (n - 1):
            continue
        cfg = option_node(name)
        if name == "file":  # a time-varying graph: a folder of three matrices
            (folder / "seq").mkdir()
            for t, w in enumerate(three_matrices(n)):
                np.save(folder / "seq" / f"W{t}.npy", w)
            cfg.update(path=str(folder / "seq"), direction="in")
        if name == "random_regular":
            cfg["degree"] = 3
        out.append({"cfg": cfg, "rpm": (4 if n >= 8 else 1) if name == "inner_outer_exp2" else 0, "push": False})
        if "weights" in cfg:  # the same graph with column weights, sent the push-sum way
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


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.large)])  # .ci/run: 8 ranks too
def test_neighbor_allreduce_matches_mixing_matrix(n, tmp_path):
    import json

    todo = cases(n, tmp_path)
    out = run_ranks(n, CODE.format(cases=json.dumps(todo), max_t=MAX_T), tmp_path, timeout=300)
    x = np.stack([row(i) for i in range(n)])
    written = three_matrices(n)
    for k, case in enumerate(todo):
        topo = build_topology(case["cfg"], n, case["rpm"])
        got_t = len(out[0][k])
        assert got_t == min(max(2 * topo.period, 2), MAX_T)
        own = case["cfg"]["_target_"].endswith("FileTopology") and case["cfg"]["weights"] == "given"
        assert not own or got_t == 6  # two cycles of the three matrices
        for t in range(got_t):
            expected = (written[t % 3] if own else np.asarray(topo.mixing_matrix(t))) @ x
            got = np.array([out[i][k][t] for i in range(n)])
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{case} t={t}")
