"""The Python API hides nothing (issue 20): a substituted graph warns and is exposed, a misspelt
option raises naming the allowed ones, and the model's parameters stay live after wrapping.

Wrappers run on virtual ranks (bfexp.comm.threads.run_threads): the same
algorithm code as MPI ranks, in one process.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from bfexp.algorithms import DSGD, ExactDiffusion, PushSum, TopologyMismatch
from bfexp.comm.threads import run_threads
from bfexp.topology import CustomTopology, Exp2, Ring, Star
from tests.algorithms import lsq

N = 8


def lsq_run(make_topology, algorithm=ExactDiffusion, steps: int = 5, **options):
    """Each rank's iterates of ``algorithm`` on its least-squares f_i, and the topology it ran on."""
    p = lsq.problem(1, N)

    def rank(engine):
        r = engine.rank
        x = torch.nn.Parameter(torch.tensor(p.x0[r], dtype=torch.float64))
        A, b = torch.tensor(p.A[r]), torch.tensor(p.b[r])
        opt = algorithm(torch.optim.SGD([x], lr=0.02), engine, make_topology(), **options)
        trace = []
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * ((A @ x - b) ** 2).sum()).backward()
            opt.step()
            trace.append(x.detach().clone())
        opt.close()
        return {"trace": torch.stack(trace), "used": opt.topology}

    return run_threads(N, rank)


def test_exact_diffusion_warns_naming_both_graphs_and_runs_on_the_one_it_exposes():
    with pytest.warns(UserWarning) as record:
        out = run_threads(1, lambda engine: ExactDiffusion(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), engine, Exp2(N)).topology)
    (used,) = out
    messages = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "topology=exp2" in messages[0] and "runs on symmetric_exp2" in messages[0]
    assert used.name == "symmetric_exp2" and used.weight_scheme == "metropolis"
    # It really runs on that graph: the same iterates as exact diffusion given it directly (no warning).
    with pytest.warns(UserWarning, match="runs on symmetric_exp2"):
        substituted = lsq_run(lambda: Exp2(N))
    direct = lsq_run(lambda: Exp2(N).undirected())
    for r in range(N):
        assert torch.equal(substituted[r]["trace"], direct[r]["trace"])
        assert substituted[r]["used"].label == "symmetric_exp2"
    # and not on exp2 itself, whose W is not symmetric
    w_used = np.asarray(direct[0]["used"].mixing_matrix())
    assert not np.array_equal(w_used, Exp2(N).mixing_matrix()) and np.array_equal(w_used, w_used.T)


def test_a_users_graph_declared_directed_is_refused_not_substituted():
    """Its direction stated (direction="in") and its edges one-way: a directed graph the user asked for, refused
    as ring directed=true is (issue 29), where it used to run on its undirected form with a warning."""
    ring = np.roll(np.eye(N), 1, axis=1)  # W[i, i+1]: i receives from i+1, a one-way ring
    with pytest.raises(TopologyMismatch, match=r"topology=custom\(direction=in\) is declared directed and has no "
                                               r"undirected form"):
        run_threads(1, lambda engine: ExactDiffusion(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), engine,
            CustomTopology(ring, direction="in", weights="uniform")).topology)


@pytest.mark.parametrize("topology", [lambda: Ring(N), lambda: Exp2(N).undirected()])
def test_no_warning_when_the_graph_is_used_as_given(topology):
    given = topology()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (used,) = run_threads(1, lambda engine: ExactDiffusion(sgd(), engine, given).topology)
    assert used is given


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_a_graph_the_rule_cannot_run_on_is_refused_not_replaced():
    star = Star(5, weights="uniform")  # rows sum to 1, columns do not
    with pytest.raises(TopologyMismatch, match="columns of W sum to .*; allowed: topology.weights=column"):
        run_threads(1, lambda engine: PushSum(sgd(), engine, star))


@pytest.mark.parametrize(
    "cls, options, unknown, allowed",
    [
        (DSGD, {"stlye": "awc"}, "stlye", "style"),
        (ExactDiffusion, {"comunication_period": 2}, "comunication_period", "communication_period"),
        (PushSum, {"overlap": False, "bucket": 1}, "bucket", "bucket_mb"),
    ],
)
def test_unknown_options_raise_type_error_naming_the_allowed_ones(cls, options, unknown, allowed):
    def build(engine):
        cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), engine, Ring(4, weights="metropolis"),
            **options)

    with pytest.raises(TypeError) as exc:
        run_threads(1, build)
    message = str(exc.value)
    assert f"unknown option(s) {unknown}" in message and "allowed:" in message
    assert allowed in message.split("allowed:")[1] and "overlap" in message.split("allowed:")[1]


def test_parameters_taken_from_the_model_stay_live_after_wrapping():
    def rank(engine):
        torch.manual_seed(engine.rank)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        before = list(model.parameters())  # taken before wrapping
        opt = DSGD(torch.optim.SGD(model.parameters(), lr=0.1), engine, Ring(engine.size), model=model)
        after = list(model.parameters())  # taken after wrapping
        weight = after[0]
        start = weight.detach().clone()
        x = torch.randn(5, 3)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        same_objects = all(a is b for a, b in zip(before, after))
        # every parameter is a view of the one flat buffer and reads what the optimizer wrote there
        offset, views = 0, True
        for p in after:
            views = views and p.untyped_storage().data_ptr() == opt.flat.untyped_storage().data_ptr()
            views = views and torch.equal(p.detach().reshape(-1), opt.flat[offset: offset + p.numel()])
            offset += p.numel()
        moved = not torch.equal(weight.detach(), start)
        now = weight.detach().clone()
        with torch.no_grad():
            opt.flat.add_(1.0)  # a write to the buffer shows through the tensor taken from model.parameters()
        seen = torch.equal(weight.detach(), now + 1.0) and torch.equal(before[0].detach(), now + 1.0)
        opt.close()
        return same_objects, views, moved, seen

    for result in run_threads(4, rank):
        assert result == (True, True, True, True)
