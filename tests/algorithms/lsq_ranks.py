"""What each MPI rank runs for the least-squares proofs: every case at once.

A case is one algorithm (wrapping a torch optimizer, as a user would) on
this rank's f_i, with full-batch gradients computed by torch autograd in
float64. All cases advance in lock step: every case's zero_grad, then every
case's forward/backward, then every case's step. Their exchanges therefore
overlap one another, so one spawn of ranks runs them all in little time.

The model splits x into two parameters and bucket_mb is tiny, so the
overlapped cases really send two buckets per exchange. Each algorithm is
built from its conf/algorithm YAML, as the worker builds it.
"""

from __future__ import annotations

import torch
from torch import nn

from bfexp.comm.mpi import MPIEngine
from tests.algorithms import configs, lsq

TINY_BUCKET_MB = 1e-9  # one parameter per bucket


class LeastSquares(nn.Module):
    """f_i(x) = 1/2 ||A_i x - b_i||^2 with x = (head, tail) as two parameters."""

    def __init__(self, A, b, x0) -> None:
        super().__init__()
        self.A = torch.tensor(A, dtype=torch.float64)
        self.b = torch.tensor(b, dtype=torch.float64)
        x0 = torch.tensor(x0, dtype=torch.float64)
        self.head = nn.Parameter(x0[:1].clone())
        self.tail = nn.Parameter(x0[1:].clone())

    def forward(self) -> torch.Tensor:
        r = self.A @ torch.cat([self.head, self.tail]) - self.b
        return 0.5 * (r @ r)


def local_optimizer(case: dict, params):
    name = case.get("optimizer", "sgd")
    if name == "adam":
        return torch.optim.Adam(params, lr=case["lr"])
    return torch.optim.SGD(params, lr=case["lr"], momentum=case.get("momentum", 0.0))


def state(case: dict, opt) -> dict:
    """What the test checks: x_i (the model), and trackers / push-sum numerators where the rule has them."""
    out = {"x": opt.flat.tolist()}
    if hasattr(opt, "y"):
        out["y"] = opt.y.tolist()
    if case["algorithm"] == "push_sum":
        out["numerator"] = opt.x.tolist()
        out["weight"] = float(opt.weight)
    return out


def run(cases: list[dict], emit, engine=None) -> None:
    """Every case on this rank (of ``engine``: the MPI engine by default), lock step; ``emit`` gets the traces."""
    engine = MPIEngine() if engine is None else engine
    rank = engine.rank
    runs = []
    for case in cases:
        p = lsq.problem(case.get("seed", 0), engine.size, zero=case.get("zero", False))
        x0 = p.x0[0] if case.get("same_start") else p.x0[rank]
        model = LeastSquares(p.A[rank], p.b[rank], x0)
        topo = configs.topology(case["topology"], engine.size) if case.get("topology") else None
        options = {"bucket_mb": TINY_BUCKET_MB, **case.get("options", {})}
        opt = configs.build(case["algorithm"], local_optimizer(case, model.parameters()), engine, topo, model=model,
                            **options)
        runs.append({"case": case, "model": model, "opt": opt, "trace": [state(case, opt)]})
    steps = max(c["iterations"] for c in cases)
    for k in range(steps):
        live = [r for r in runs if k < r["case"]["iterations"]]
        for r in live:
            r["opt"].zero_grad()
        for r in live:
            r["model"]().backward()
        for r in live:
            r["opt"].step()
            keep = r["case"].get("keep", "all")
            if keep == "all" or k + 1 <= keep or k + 1 == r["case"]["iterations"]:
                r["trace"].append(state(r["case"], r["opt"]))
    for r in runs:
        r["opt"].close()
    emit({r["case"]["key"]: r["trace"] for r in runs})


def on_threads(ranks: int, cases: list[dict]) -> list:
    """``run(cases)`` on ``ranks`` virtual ranks (bfexp's threads engine) in this process: what each rank emitted,
    by rank, as tests/mpi_helpers.run_ranks returns MPI ranks' (the threads engine trains bit for bit as MPI does:
    tests/test_threads_equivalence.py). One torch thread, as each MPI rank has."""
    from bfexp.comm.threads import run_threads

    def rank(engine):
        emitted = []
        run(cases, emitted.append, engine)
        return emitted[0]

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_threads(ranks, rank, timeout=900)
    finally:
        torch.set_num_threads(saved)
