"""What each rank runs for the asynchronous algorithms' tests, on any engine.

``run(engine, cases)`` runs every case one after another (each is a little
asynchronous job of its own) and returns this rank's findings, JSON-able.
The same code runs on virtual ranks (``bfexp.comm.threads.run_threads``)
and on MPI ranks (tests/mpi_helpers.run_ranks), so one MPI spawn can batch
all cases.

A case: an algorithm (built from its conf/algorithm YAML, as the worker
builds it) on this rank's least-squares f_i (tests/algorithms/lsq.py;
``zero``: all-zero data, so every gradient is 0 and only averaging
happens), float64, full-batch gradients from autograd. A step takes
``step_s``, on ``slow`` ranks (stragglers) ``slow_s`` (``engine.advance``:
a sleep on MPI ranks, simulated time on virtual ranks, where a scheduled
world runs the ranks one at a time in clock order: the same run every time). Every rank runs at least
``iterations`` steps; a rank that is done keeps stepping until every rank is
(a nonblocking barrier tells it), so ranks never wait for one another
before the end, then ``finish()`` (collective) drains what is in flight.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from tests.algorithms import configs, lsq
from tests.algorithms.lsq_ranks import LeastSquares


def checkpoints(k_max: int) -> list[int]:
    """Iterations at which the error is recorded: about 8 per factor of 2."""
    ks = sorted({int(round(2 ** (e / 8))) for e in range(0, int(8 * math.log2(k_max)) + 1)} | {k_max})
    return [k for k in ks if 1 <= k <= k_max]


def run_case(engine: Any, case: dict) -> dict:
    rank = engine.rank
    p = lsq.problem(case.get("seed", 0), engine.size, zero=case.get("zero", False))
    if "spread" in case:  # rank i's own optimum is x_0 + spread * (a random unit of i): milder heterogeneity
        rng = np.random.default_rng(case.get("seed", 0))
        local = rng.normal(size=(engine.size, p.A.shape[2]))
        local = np.ones(p.A.shape[2]) + case["spread"] * local / np.linalg.norm(local, axis=1, keepdims=True)
        p = lsq.Problem(p.A, np.einsum("nmd,nd->nm", p.A, local), p.x0)
    model = LeastSquares(p.A[rank], p.b[rank], p.x0[rank])
    topo = configs.topology(case["topology"], engine.size)
    lr0, k0 = case["lr"], case.get("lr_offset", 0.0)  # a_k = lr0 / (1 + k / k0) when k0 > 0, else lr0
    local = torch.optim.SGD(model.parameters(), lr=lr0)
    opt = configs.build(case["algorithm"], local, engine, topo, model=model, **case.get("options", {}))
    if case.get("log_exchanges"):
        opt.exchange_log = []
    slow = rank in case.get("slow", [])
    record = set(checkpoints(case["iterations"]))
    errors: list[list[float]] = []  # [k, ||z_k - x*|| / ||x*||] at the recorded iterations
    xs = p.optimum
    k, done = 0, None
    while True:
        for g in local.param_groups:
            g["lr"] = lr0 / (1 + k / k0) if k0 > 0 else lr0
        opt.zero_grad()  # async push-sum folds what arrived here: the model is z_k
        if k in record and not case.get("zero", False):
            z = opt.flat.detach().numpy()
            errors.append([k, float(((z - xs) ** 2).sum() ** 0.5 / (xs**2).sum() ** 0.5)])
        if done is not None and done.done():
            break
        model().backward()
        opt.step()
        k += 1
        # A step takes step_s, a straggler's slow_s: real time on MPI, simulated on scheduled virtual ranks.
        engine.advance(case.get("slow_s", 0.001) if slow else case.get("step_s", 0.0))
        if slow and case.get("sleep_s"):
            time.sleep(case["sleep_s"])  # unscheduled virtual ranks: a straggler in wall-clock time too
        time.sleep(0)  # unscheduled virtual ranks: let the other ranks' threads run
        if k == case["iterations"]:
            done = engine.ibarrier()  # this rank is done; go on until every rank is
    done.wait()
    opt.finish()
    out: dict = {"x": opt.flat.tolist(), "x0": p.x0[rank].tolist(), "iterations": k, "errors": errors}
    if case["algorithm"] == "async_push_sum":
        out["numerator"] = opt.x.tolist()
        out["weight"] = opt.weight
    if case.get("log_exchanges"):
        out["exchanges"] = [[t.tolist() for t in e] for e in opt.exchange_log]
    if hasattr(opt, "exchanges"):
        out["exchange_count"], out["timeouts"] = opt.exchanges, opt.timeouts
    opt.close()
    return out


def run(engine: Any, cases: list[dict]) -> dict:
    """Every case on this rank: {case key: findings}."""
    return {case["key"]: run_case(engine, case) for case in cases}
