"""build_topology's contract: `_target_` + options -> a Topology on `size` ranks, for bfexp's
classes and a user's own alike; every bad input is a one-line ConfigError naming the key.

The user's class below lives outside bfexp and is named by its import path,
as a `topology._target_=mypkg.MyGraph` override would name it.
"""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from bfexp.errors import ConfigError, TopologyError
from bfexp.topology import (
    AdjacencyTopology,
    Exp2,
    GraphTopology,
    Hypercube,
    InnerOuterExp2,
    MatrixTopology,
    Mesh,
    RandomRegular,
    Ring,
    Star,
    Topology,
    WeightScheme,
    build_topology,
)


class Chain(GraphTopology):
    """A user's graph: a path 0 - 1 - ... - n-1 (no wrap-around)."""

    name = "chain"

    def __init__(self, size: int, *, weights: WeightScheme = "metropolis") -> None:
        super().__init__(size, weights=weights)
        self.validate()

    def _edges(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        i = np.arange(self.size - 1)
        return np.concatenate([i, i + 1]), np.concatenate([i + 1, i])


class Racks(InnerOuterExp2):
    """A user's class that wants the run's layout, as inner_outer_exp2 does."""

    seen: list[int] = []

    def __init__(self, size: int, *, ranks_per_machine: int = 0, weights: WeightScheme = "uniform") -> None:
        Racks.seen.append(ranks_per_machine)
        super().__init__(size, ranks_per_machine=ranks_per_machine, weights=weights)


def not_a_topology(size: int) -> np.ndarray:
    return np.eye(size)


def wrong_size(size: int) -> Topology:
    return Ring(size + 1)


def target(obj: object) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def one_line_allowed(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "; allowed: " in message, message
    return message


def test_user_class_builds_like_bfexp_classes():
    n = 6
    for node in ({"_target_": target(Chain)}, OmegaConf.create({"_target_": target(Chain), "weights": "metropolis"})):
        topo = build_topology(node, n, ranks_per_machine=3)  # Chain does not take the layout: not passed
        assert isinstance(topo, Chain) and topo.size == n
        # Metropolis-Hastings on a path: degree 1 at the ends, 2 inside -> 1/3 on every edge.
        w = np.zeros((n, n))
        for i in range(n - 1):
            w[i, i + 1] = w[i + 1, i] = 1 / 3
        np.fill_diagonal(w, 1 - w.sum(axis=1))
        np.testing.assert_allclose(topo.mixing_matrix(), w, rtol=0, atol=1e-15)


def test_ranks_per_machine_reaches_targets_that_take_it():
    Racks.seen.clear()
    topo = build_topology({"_target_": target(Racks)}, 12, 3)
    assert Racks.seen == [3] and topo.local_size == 3 and topo.machines == 4
    topo = build_topology({"_target_": "bfexp.topology.InnerOuterExp2", "weights": "uniform"}, 8, 4)
    assert (topo.local_size, topo.machines) == (4, 2)


@pytest.mark.parametrize(
    "node,needles",
    [
        ({"_target_": "bfexp.topology.Ring", "base": 3}, ["topology.base", "directed, weights"]),
        ({"_target_": "bfexp.topology.Ring", "weights": "doubly"}, ["topology.weights='doubly'", "uniform, metropolis, column"]),
        ({"_target_": "bfexp.topology.Exp2", "base": "two"}, ["topology.base='two'", "an integer"]),
        ({"_target_": "bfexp.topology.InnerOuterExp2", "ranks_per_machine": 4}, ["topology.ranks_per_machine", "weights"]),
        ({"_target_": "bfexp.topology.NoSuchGraph"}, ["topology._target_"]),
        ({"name": "ring"}, ["_target_"]),
    ],
)
def test_bad_keys_name_the_key_and_what_is_allowed(node, needles):
    with pytest.raises(ConfigError) as exc:
        build_topology(node, 8)
    message = str(exc.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("fn,needle", [(not_a_topology, "returned ndarray"), (wrong_size, "ranks=5")])
def test_target_must_return_a_topology_on_the_ranks(fn, needle):
    with pytest.raises(TopologyError) as exc:
        build_topology({"_target_": target(fn)}, 5)
    assert needle in one_line_allowed(exc)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: Ring(0), "ranks=0"),
        (lambda: Ring(4, weights="doubly"), "topology.weights='doubly'"),
        (lambda: Exp2(8, base=1), "topology.base=1"),
        (lambda: Exp2(8, weights="metropolis"), "topology.weights=metropolis"),
        (lambda: Hypercube(12), "ranks=12"),
        (lambda: RandomRegular(7, degree=3), "topology.degree=3"),
        (lambda: RandomRegular(12, degree=2, seed=0), "disconnected"),
        (lambda: Mesh(12, rows=5), "topology.rows=5"),
        (lambda: Star(4, center=9), "topology.center=9"),
        (lambda: InnerOuterExp2(8, ranks_per_machine=3), "engine.ranks_per_machine=3"),
        (lambda: InnerOuterExp2(8), "1 machine"),
        (lambda: InnerOuterExp2(8, ranks_per_machine=2), "engine.ranks_per_machine=2"),
        (lambda: MatrixTopology(np.ones((2, 3)), direction="in"), "square"),
        (lambda: MatrixTopology(np.array([[1.5, -0.5], [-0.5, 1.5]]), direction="in"), "negative"),
        (lambda: MatrixTopology(np.array([[0.5, 0.2], [0.2, 0.5]]), direction="in"), "stochastic"),
        (lambda: AdjacencyTopology(np.ones(3), direction="out"), "square"),
        (lambda: AdjacencyTopology(np.zeros((3, 3)), direction="out"), "disconnected"),
    ],
)
def test_user_input_errors_are_topology_errors(make, needle):
    with pytest.raises(TopologyError) as exc:
        make()
    assert needle in one_line_allowed(exc)


def test_not_a_mapping_is_a_bug():
    with pytest.raises(TypeError) as exc:
        build_topology("ring", 4)
    assert not isinstance(exc.value, ConfigError)
