"""One assembly (bfexp.assembly) behind three doors: the same (algorithm, topology, options) gives the
same result, the same notes and the same refusal through the runner's build (bfexp.worker.build on
virtual ranks, from a composed config), the library (bfexp.DistributedOptimizer) and BlueFog's layer
(bfexp.bluefog.DistributedOptimizer); and the two broadcast APIs give every rank the root's start.

Expected outcomes are written out here (the note names both graphs, the refusal names the allowed
keys), not read from the code; the broadcasts are checked against the root's own tensors.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn

import bfexp as bf
import bfexp.bluefog as bfl
from bfexp.compression import TopK
from bfexp.topology import build_topology

RANKS = 3
# A directed 3-cycle 0 -> 1 -> 2 -> 0, as a user gives it: not symmetric, no self loops. The runner reads
# it from a file (a config holds data); the libraries get the Topology object built from the same node.
CYCLE = np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=float)
DIRECTED = {"_target_": "bfexp.topology.FileTopology", "path": "directed.npy", "direction": "out",
            "weights": "uniform"}
TOP_K = {"_target_": "bfexp.compression.TopK", "ratio": 0.3}


COLUMN_STAR = ("star", {"weights": "column"})  # rows of W sum to 4/3 at the center: not row stochastic


# (algorithm, options as a script gives them, topology: (name, options) or a node, expected):
# expected = ("built", rule class, compressor, topology it runs on, notes) or ("refused", error type, text).
CASES = {
    # A graph whose direction the user stated (direction=out) and that has one-way edges is declared directed,
    # as ring directed=true is: refused alike (issue 29), not run on its undirected form.
    "exact_diffusion on a directed user graph": (
        "exact_diffusion", {}, DIRECTED,
        ("refused", "TopologyMismatch", "algorithm=exact_diffusion needs a symmetric doubly stochastic W; "
                                        "topology=file(directed.npy) is declared directed and has no undirected form")),
    "exact_diffusion on a ring declared directed": (
        "exact_diffusion", {}, ("ring", {"directed": True}),
        ("refused", "TopologyMismatch", "algorithm=exact_diffusion needs a symmetric doubly stochastic W; "
                                        "topology=ring(directed=True) is declared directed and has no undirected "
                                        "form; allowed: an undirected graph")),
    "choco_sgd with a TopK object": (
        "choco_sgd", {"compressor": TopK(0.3)}, ("ring", {}), ("built", "ChocoSGD", "TopK(ratio=0.3)", "ring", [])),
    "choco_sgd with a compressor node": (
        "choco_sgd", {"compressor": TOP_K}, ("ring", {}), ("built", "ChocoSGD", "TopK(ratio=0.3)", "ring", [])),
    "choco_sgd with a misspelt compressor key": (
        "choco_sgd", {"compressor": {"_target_": "bfexp.compression.TopK", "ratoi": 0.3}}, ("ring", {}),
        ("refused", "ConfigError", "unknown key 'algorithm.compressor.ratoi'; allowed: ratio")),
    "diloco average=allreduce on a column-weighted graph": (
        "diloco", {"average": "allreduce"}, COLUMN_STAR, ("built", "DiLoCo", None, "star", [])),
    "slowmo average=allreduce on a column-weighted graph": (
        "slowmo", {"average": "allreduce"}, COLUMN_STAR, ("built", "SlowMo", None, "star", [])),
    "slowmo average=topology on a column-weighted graph": (
        "slowmo", {"average": "topology"}, COLUMN_STAR,
        ("refused", "TopologyMismatch", "algorithm=slowmo needs a row stochastic mixing matrix (row sums 1); "
                                        "topology=star with weights=column")),
    "push_sum on an undirected ring": (
        "push_sum", {}, ("ring", {}), ("built", "PushSum", None, "ring", [])),
}


def _outcome(make: Callable[[], Any]) -> tuple:
    """What one rank's door made of a case: the rule it built (class, compressor, graph) or its refusal."""
    try:
        rule = make()
    except Exception as e:  # noqa: BLE001 - the refusal is the outcome under test
        return ("refused", type(e).__name__, str(e))
    compressor = getattr(rule, "compressor", None)
    return ("built", type(rule).__name__, repr(compressor) if compressor is not None else None, rule.topology.label)


def _script_topology(topology: Any) -> tuple[Any, dict]:
    """(topology=, topology_options=) as a script passes them: a name and options, or a Topology object."""
    if isinstance(topology, tuple):
        return topology
    return build_topology(topology, RANKS), {}


def _library(algorithm: str, options: dict, topology: Any) -> tuple[list, list[str]]:
    topo, topo_options = _script_topology(topology)

    def rank() -> tuple:
        model = nn.Linear(3, 2)
        return _outcome(lambda: bf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                                        algorithm, topo, topology_options=topo_options, **options))

    return _recording(lambda: bf.spawn(rank, RANKS, prefix_output=False))


def _bluefog(algorithm: str, options: dict, topology: Any) -> tuple[list, list[str]]:
    topo, topo_options = _script_topology(topology)

    def rank() -> tuple:
        bfl.init()
        model = nn.Linear(3, 2)
        wrapped = None

        def make() -> Any:
            nonlocal wrapped
            wrapped = bfl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, algorithm, topo,
                                               topology_options=topo_options, **options)
            return wrapped._rule
        out = _outcome(make)
        assert wrapped is None or isinstance(wrapped, torch.optim.SGD)  # BlueFog's kind of wrapper
        return out

    return _recording(lambda: bf.spawn(rank, RANKS, prefix_output=False))


def _runner(algorithm: str, options: dict, topology: Any) -> tuple[list, list[str]]:
    """The job's config as the driver composes it (objects given by their nodes: a config holds data),
    built on each virtual rank by the worker, which keeps the notes the driver prints."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf, open_dict

    from bfexp import worker
    from bfexp.comm.threads import run_threads
    from bfexp.config import Settings, register_configs

    name = topology[0] if isinstance(topology, tuple) else "ring"
    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[f"algorithm={algorithm}", f"topology={name}",
                                                       f"ranks={RANKS}", "engine=threads"])
    with open_dict(cfg):
        for key, value in options.items():
            cfg.algorithm[key] = TOP_K if isinstance(value, TopK) else value
        if isinstance(topology, tuple):
            cfg.topology.merge_with(topology[1])
        else:
            cfg.topology = OmegaConf.create(topology)
    notes: list[str] = []

    def rank(engine: Any) -> tuple:
        def make() -> Any:
            job = worker.build(Settings.of(cfg), engine, dataset=cfg.dataset, model=cfg.model, optimizer=cfg.optimizer,
                               algorithm=cfg.algorithm, topology=cfg.topology, with_data=False)
            notes.extend(job.notes)
            return job.optimizer
        return _outcome(make)

    outcomes, said = _recording(lambda: run_threads(RANKS, rank))
    return outcomes, said + notes


def _recording(run: Callable[[], list]) -> tuple[list, list[str]]:
    """Each rank's outcome, and the UserWarnings the ranks gave (warnings are process-wide state)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcomes = run()
    return outcomes, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


DOORS = {"runner": _runner, "library": _library, "bluefog": _bluefog}


@pytest.fixture
def in_folder_with_graph(tmp_path, monkeypatch):
    """Run where the user's graph file lies (paths are read from where bfexp runs)."""
    np.save(tmp_path / "directed.npy", CYCLE)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("case", CASES)
def test_every_door_builds_warns_and_refuses_alike(case, door, in_folder_with_graph):
    algorithm, options, topology, expected = CASES[case]
    outcomes, said = DOORS[door](algorithm, options, topology)
    assert len(set(outcomes)) == 1, outcomes  # every rank alike
    outcome = outcomes[0]
    if expected[0] == "refused":
        kind, text = expected[1:]
        assert outcome[:2] == ("refused", kind) and outcome[2].startswith(text) and "\n" not in outcome[2]
        assert said == []
    else:
        assert outcome == expected[:4]
        assert sorted(said) == sorted(expected[4] * RANKS)  # each rank says each note once, in the same words


@pytest.mark.parametrize("door", ["library", "bluefog"])
def test_a_directed_adjacency_topology_object_is_refused_in_both_libraries(door):
    """The object a script makes (AdjacencyTopology), which no config can carry: the same refusal."""
    from bfexp.topology import AdjacencyTopology

    topology = AdjacencyTopology(CYCLE, direction="out")
    outcomes, said = DOORS[door]("exact_diffusion", {}, (topology, {}))
    # Declared directed (direction=out, one-way edges): refused as ring directed=true is, on every rank alike.
    assert len(set(outcomes)) == 1 and outcomes[0][:2] == ("refused", "TopologyMismatch"), outcomes
    assert outcomes[0][2].startswith("algorithm=exact_diffusion needs a symmetric doubly stochastic W; "
                                     "topology=adjacency(direction=out) is declared directed and has no undirected form")
    assert said == []


# ------------------------------------------------------------------ the broadcasts


def _start(door: str, momentum: float, root: int) -> dict:
    """Ranks seeded apart, with their own learning rates; the root alone has stepped (momentum state,
    when the optimizer keeps any). Returns what the rank holds before and after the door's broadcasts."""
    me = bf.rank()
    torch.manual_seed(me)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1), momentum=momentum)
    if me == root:
        model(torch.randn(5, 3)).pow(2).mean().backward()
        optimizer.step()

    def held() -> dict:
        state = [v.clone() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"tensors": [t.detach().clone() for t in model.state_dict().values()],
                "lr": optimizer.param_groups[0]["lr"], "state": state}

    before = held()
    if door == "bfexp":
        bf.broadcast_parameters(model, root=root)
        bf.broadcast_optimizer_state(optimizer, root=root)
    else:
        bfl.init()
        bfl.broadcast_parameters(model.state_dict(), root_rank=root)
        bfl.broadcast_optimizer_state(optimizer, root_rank=root)
    return {"before": before, "after": held()}


def _same(a: dict, b: dict) -> bool:
    return (a["lr"] == b["lr"] and len(a["state"]) == len(b["state"])
            and all(torch.equal(x, y) for key in ("tensors", "state") for x, y in zip(a[key], b[key])))


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["stateless SGD", "momentum SGD"])
def test_both_broadcast_apis_give_every_rank_the_roots_start(momentum):
    root = 1
    held = {door: bf.spawn(_start, 2, args=(door, momentum, root), prefix_output=False)
            for door in ("bfexp", "bluefog")}
    for door, ranks in held.items():
        reference = ranks[root]["before"]  # the root's own tensors, learning rate and state
        assert not _same(ranks[0]["before"], reference)  # rank 0 did start elsewhere
        for r, rank in enumerate(ranks):
            assert _same(rank["after"], reference), (door, r)
    assert len(held["bfexp"][root]["before"]["state"]) == (6 if momentum else 0)
