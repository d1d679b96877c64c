"""bfexp.bluefog: BlueFog programs run with only their import line changed.

The programs in programs/ are written against BlueFog's API (``import
bluefog.torch as bf``, BlueFog's examples' style); each test runs them with
that one line replaced, on virtual ranks in this process and on real MPI
ranks (one mpiexec for all three), and checks them against references that
do not come from the code under test: the exact average of the start
values, numpy's least-squares solution, BlueFog's graph definitions written
out as matrices, and numpy one-step updates of each optimizer wrapper.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch

from bfexp import api
from bfexp.bluefog import topology_util as tu
from tests.mpi_helpers import run_ranks

PROGRAMS = Path(__file__).parent / "programs"
NAMES = ["consensus", "optimization", "training"]
ORIGINAL = "import bluefog.torch as bf"
PORTED = "import bfexp.bluefog.torch as bf"


def port(name: str, folder: Path) -> Path:
    """The program with its import line replaced, written to ``folder``; checks nothing else changed."""
    source = (PROGRAMS / f"{name}.py").read_text()
    ported = source.replace(ORIGINAL, PORTED, 1)
    changed = [line for line in difflib.unified_diff(source.splitlines(), ported.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == [f"-{ORIGINAL}", f"+{PORTED}"], changed
    path = folder / f"{name}.py"
    path.write_text(ported)
    return path


# Where the result depends on how the OS interleaves MPI processes: barrier-free push-sum mixes only as
# much as the ranks' loops overlap (a rank that runs its whole loop in one time slice mixes nothing; on a
# loaded 2-core machine 4 ranks of 100 tiny iterations ended 2.5e-4 away). Virtual ranks take turns at every
# window op, the even interleaving; MPI ranks are held to what push-sum keeps whatever the order: the sums.
SCHEDULE_DEPENDENT_ON_MPI = {"push_sum_accumulate"}


def check_consensus(result: dict, mpi: bool = False) -> None:
    for variant, err in result["errors"].items():
        if mpi and variant in SCHEDULE_DEPENDENT_ON_MPI:
            assert math.isfinite(err), (variant, err)
            continue
        assert err < 1e-10, (variant, err)
    assert all(result["checks"].values()), result["checks"]


def check_optimization(result: dict) -> None:
    for method, err in result["errors"].items():
        assert err < 1e-8, (method, err)


def check_training(result: dict) -> None:
    for kind, (before, after) in result["losses"].items():
        assert after < 0.9 * before, (kind, before, after)
    checks = result["checks"]
    assert all(v for k, v in checks.items() if k.endswith(("_typo_raises", "_is_torch_optimizer"))), checks
    assert checks["gradient_allreduce_spread"] == 0.0  # every rank applies the same averaged gradient
    assert checks["awc_spread"] > 0.0  # decentralized: the models differ a little


CHECKS = {"consensus": check_consensus, "optimization": check_optimization, "training": check_training}


def digits(folder: Path) -> list[str]:
    """The training program's arguments: scikit-learn's digits, saved once for every rank to load."""
    from sklearn.datasets import load_digits

    data = load_digits()
    path = folder / "digits.npz"
    np.savez(path, images=data.images, target=data.target)
    return ["--data", str(path)]


def test_programs_on_virtual_ranks(tmp_path):
    """4 virtual ranks on 2 emulated machines (so hierarchical ops cross machines)."""
    argv = {"training": digits(tmp_path)}
    for name in NAMES:
        ranks = api.spawn(port(name, tmp_path), 4, args=argv.get(name, []), ranks_per_machine=2,
                          prefix_output=False, timeout=120)
        for namespace in ranks:
            CHECKS[name](namespace["RESULT"])
        if name == "training":  # same seed, same data split: the ranks agree on the averaged losses
            assert len({str(ns["RESULT"]["losses"]) for ns in ranks}) == 1


def test_programs_on_mpi_ranks(tmp_path):
    """The same three programs on 4 real MPI ranks, one mpiexec."""
    paths = {name: str(port(name, tmp_path)) for name in NAMES}
    argv = {"training": digits(tmp_path)}
    code = f"""
import runpy
results = {{}}
for name, path in {paths!r}.items():
    sys.argv = [path, *{argv!r}.get(name, [])]
    results[name] = runpy.run_path(path, run_name="__main__")["RESULT"]
emit(results)
"""
    # Waiting ranks yield their core: 4 ranks share 2 here.
    ranks = run_ranks(4, code, tmp_path, timeout=240, env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    for results in ranks:
        for name in NAMES:
            if name == "consensus":
                check_consensus(results[name], mpi=True)
            else:
                CHECKS[name](results[name])


# ------------------------------------------------------------------ optimizer wrappers, one step vs numpy


def _one_step(kind: str) -> list[float]:
    import torch.nn as nn

    import bfexp.bluefog as bf

    bf.init()
    n, me = bf.size(), bf.rank()
    bf.set_topology(bf.RingGraph(n, connect_style=2))  # i sends to i + 1
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(_start(me))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind in ("awc", "atc"):
        wrap = bf.DistributedAdaptWithCombineOptimizer if kind == "awc" else bf.DistributedAdaptThenCombineOptimizer
        opt = wrap(sgd, model)
        opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {(me - 1) % n: 0.5}, [(me + 1) % n]
    elif kind == "hierarchical":
        opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model, bf.CommunicationType.hierarchical_neighbor_allreduce)
        other = 1 - bf.machine_rank()
        opt.self_weight, opt.src_machine_weights, opt.dst_machine_weights = 0.75, {other: 0.25}, [other]
    elif kind == "gradient_allreduce":
        opt = bf.DistributedGradientAllreduceOptimizer(sgd, model)
    else:
        opt = bf.DistributedWinPutOptimizer(sgd, model)
        opt.force_barrier = True
    a, b = _data(me)
    opt.zero_grad()
    (0.5 * ((model(a) - b) ** 2).sum()).backward()
    opt.step()
    out = model.weight.detach().view(-1).tolist()
    if kind == "win_put":
        opt.unregister_window()
    return out


def _start(r: int) -> torch.Tensor:
    return torch.tensor([[1.0 + r, -0.5 * r, 0.25 * r * r]], dtype=torch.float32)


def _data(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(r)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


@pytest.mark.parametrize("kind", ["awc", "atc", "hierarchical", "gradient_allreduce", "win_put"])
def test_optimizer_wrappers_match_numpy(kind):
    n, lr = 4, 0.1
    x = [_start(r).double().numpy().reshape(3) for r in range(n)]
    grads = []
    for r in range(n):
        a, b = (t.double().numpy() for t in _data(r))
        grads.append(a.T @ (a @ x[r] - b.reshape(4)))
    if kind in ("awc", "win_put"):  # W x - lr g(x); the ring's weights 1/2 from i - 1
        want = [0.5 * x[r] + 0.5 * x[(r - 1) % n] - lr * grads[r] for r in range(n)]
    elif kind == "atc":  # W (x - lr g(x))
        y = [x[r] - lr * grads[r] for r in range(n)]
        want = [0.5 * y[r] + 0.5 * y[(r - 1) % n] for r in range(n)]
    elif kind == "hierarchical":  # machines {0,1}, {2,3}: 3/4 own machine's mean + 1/4 the other's
        mean = [(x[0] + x[1]) / 2, (x[2] + x[3]) / 2]
        want = [0.75 * mean[r // 2] + 0.25 * mean[1 - r // 2] - lr * grads[r] for r in range(n)]
    else:
        want = [x[r] - lr * sum(grads) / n for r in range(n)]
    got = api.spawn(_one_step, n, args=(kind,), ranks_per_machine=2, prefix_output=False, timeout=60)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5)


def _refusals() -> dict[str, bool]:
    import torch.nn as nn

    import bfexp.bluefog as bf

    out = {}
    try:
        bf.rank()
        out["needs_init"] = False
    except ValueError as exc:
        out["needs_init"] = "bf.init()" in str(exc)
    bf.init()
    x = torch.zeros(2)
    bf.win_create(x, "x")
    for key, call in {
        "get_win_version": lambda: bf.get_win_version("x"),
        "suspend": bf.suspend,
    }.items():
        try:
            call()
            out[key] = False
        except NotImplementedError:
            out[key] = True
    try:
        with bf.win_mutex("x"):
            bf.win_put(x, "x")
            bf.win_update("x")
        out["win_mutex_two_ops"] = False
    except NotImplementedError:
        out["win_mutex_two_ops"] = True
    with bf.win_mutex("x", for_self=True):  # one op under the mutex is fine
        bf.win_update_then_collect("x")
    bf.win_free()
    model = nn.Linear(2, 1)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        opt.src_weight = {}  # not a knob: src_weights is
        out["typo"] = False
    except AttributeError as exc:
        out["typo"] = "src_weights" in str(exc)
    opt.num_steps_per_communication = 2
    out["knob_kept"] = opt.num_steps_per_communication == 2 and opt._rule.communication_period == 2
    return out


def test_refusals_and_knobs():
    for result in api.spawn(_refusals, 2, prefix_output=False, timeout=60):
        assert all(result.values()), result


# ------------------------------------------------------------------ topology_util vs BlueFog's definitions


def circulant(n: int, offsets: list[int]) -> np.ndarray:
    """BlueFog's circulant graphs: row i is x rolled by i, x uniform over the offsets (0 = self)."""
    x = np.zeros(n)
    x[[d % n for d in offsets]] = 1.0
    x /= x.sum()
    return np.stack([np.roll(x, i) for i in range(n)])


def adjacency(g: nx.DiGraph) -> np.ndarray:
    return nx.to_numpy_array(g, nodelist=range(g.number_of_nodes()))


def test_graph_builders_match_bluefog():
    cases = [
        (tu.ExponentialTwoGraph(6), circulant(6, [0, 1, 2, 4])),
        (tu.ExponentialGraph(10, base=3), circulant(10, [0, 1, 3, 9])),
        (tu.SymmetricExponentialGraph(12), circulant(12, [0, 1, 4, 8, 11])),
        (tu.SymmetricExponentialGraph(6), circulant(6, [0, 1, 5])),  # 4 > 6 // 2: not a neighbor
        (tu.RingGraph(5), circulant(5, [0, 1, -1])),
        (tu.RingGraph(5, connect_style=1), circulant(5, [0, -1])),
        (tu.RingGraph(5, connect_style=2), circulant(5, [0, 1])),
        (tu.RingGraph(2), np.full((2, 2), 0.5)),
        (tu.FullyConnectedGraph(4), np.full((4, 4), 0.25)),
    ]
    star = np.diag(np.full(5, 1 - 1 / 5))
    star[2, :] = star[:, 2] = 1 / 5
    cases.append((tu.StarGraph(5, center_rank=2), star))
    # 2 x 3 grid, Metropolis-Hastings: 1 / max(|N_i|, |N_j|) with N including self
    edges = [(0, 1), (1, 2), (3, 4), (4, 5), (0, 3), (1, 4), (2, 5)]
    nbrs = {i: {i} for i in range(6)}
    for i, j in edges:
        nbrs[i].add(j)
        nbrs[j].add(i)
    grid = np.zeros((6, 6))
    for i, j in edges:
        grid[i, j] = grid[j, i] = 1 / max(len(nbrs[i]), len(nbrs[j]))
    grid += np.diag(1 - grid.sum(axis=1))
    cases.append((tu.MeshGrid2DGraph(6), grid))
    for g, want in cases:
        np.testing.assert_allclose(adjacency(g), want, rtol=0, atol=1e-12)
    assert tu.IsTopologyEquivalent(tu.ExponentialGraph(8), tu.ExponentialTwoGraph(8))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(8), tu.ExponentialTwoGraph(8))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(8), None)
    assert tu.IsRegularGraph(tu.RingGraph(6)) and not tu.IsRegularGraph(tu.StarGraph(6))
    assert tu.GetRecvWeights(tu.StarGraph(5, 2), 0) == (pytest.approx(0.8), {2: pytest.approx(0.2)})
    self_w, send = tu.GetSendWeights(tu.RingGraph(5, connect_style=2), 4)
    assert self_w == pytest.approx(0.5) and send == {0: pytest.approx(0.5)}


def take(gen, k: int) -> list:
    return [next(gen) for _ in range(k)]


def test_dynamic_schedules():
    n = 8
    topo = tu.ExponentialTwoGraph(n)
    for r in range(n):
        for k, (send, recv) in enumerate(take(tu.GetDynamicOnePeerSendRecvRanks(topo, r), 6)):
            d = 2 ** (k % 3)
            assert (send, recv) == ([(r + d) % n], [(r - d) % n])
    # 4 machines of 2: machine 2 sends 1, 2, 1, 2 machines ahead (floor(log2 3) + 1 = 2 distances)
    got = take(tu.GetExp2DynamicSendRecvMachineRanks(8, 2, 5, 1), 4)
    assert got == [([3], [1]), ([0], [0]), ([3], [1]), ([0], [0])]
    # inner-outer exp2, 2 machines of 4, iteration 0: local rank 0 crosses, the others skip over it
    sends = [take(tu.GetInnerOuterExpo2DynamicSendRecvRanks(8, 4, r), 1)[0][0][0] for r in range(8)]
    assert sends == [4, 2, 3, 1, 0, 6, 7, 5]
    for make in (tu.GetInnerOuterExpo2DynamicSendRecvRanks, tu.GetInnerOuterRingDynamicSendRecvRanks):
        schedules = [take(make(12, 4, r), 10) for r in range(12)]
        for k in range(10):
            sends = [schedules[r][k][0][0] for r in range(12)]
            assert sorted(sends) == list(range(12))  # one message out and one in per rank
            for r in range(12):
                assert schedules[sends[r]][k][1] == [r]  # the receiver expects exactly that sender
    with pytest.raises(ValueError, match="local_size"):
        next(tu.GetInnerOuterRingDynamicSendRecvRanks(8, 2, 0))
    assert math.isclose(sum(adjacency(tu.ExponentialTwoGraph(5))[:, 0]), 1.0)


def _traced() -> bool:
    import time

    import bfexp.bluefog as bf

    bf.init()
    with bf.timeline_context("x", "gradient computation"):
        time.sleep(0.001)
    return bf.timeline_end_activity("never started")  # False, as BlueFog's for an activity not open


def test_timeline_activities_land_in_bfexp_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("BFEXP_TIMELINE", str(tmp_path))
    assert api.spawn(_traced, 2, prefix_output=False) == [False, False]
    for r in range(2):
        assert '"gradient computation"' in (tmp_path / f"rank{r}.json").read_text()


def _utilities() -> dict:
    import torch.nn as nn

    import bfexp.bluefog as bf

    bf.init()
    me = bf.rank()
    torch.manual_seed(me)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1), momentum=0.5 + 0.1 * me)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # a momentum buffer that differs per rank
    bf.broadcast_parameters(model.state_dict(), root_rank=1)
    bf.broadcast_optimizer_state(opt, root_rank=1)
    buf = opt.state[model.weight]["momentum_buffer"]
    before = model.bias.detach().clone()
    bf.allreduce_parameters(dict(model.named_parameters()))
    return {"weight": model.weight.detach().view(-1).tolist(), "lr": opt.param_groups[0]["lr"],
            "momentum": opt.param_groups[0]["momentum"], "buffer": buf.view(-1).tolist(),
            "bias_kept": torch.allclose(model.bias, before)}


def test_parameter_and_optimizer_state_utilities():
    ranks = api.spawn(_utilities, 3, prefix_output=False)
    assert all(r == ranks[1] for r in ranks)  # rank 1's model and state everywhere
    assert ranks[0]["lr"] == pytest.approx(0.2) and ranks[0]["momentum"] == pytest.approx(0.6)
    assert ranks[0]["bias_kept"]  # averaging equal parameters changes nothing
