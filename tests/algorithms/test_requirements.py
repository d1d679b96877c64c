"""Which topologies and engines each algorithm accepts, substitutes or refuses (no ranks needed),
and the same through the real CLI: a note for a substitution, one line and exit 2 for a refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bfexp.algorithms import ALGORITHMS, TopologyMismatch, resolve_topology
from bfexp.cli import group_options
from bfexp.topology import AdjacencyTopology, build_topology


def resolve(algorithm: str, topology: dict, ranks: int = 8):
    return resolve_topology({"name": algorithm}, build_topology(topology, ranks))


def test_every_algorithm_has_a_config_option():
    assert set(group_options("algorithm")) == set(ALGORITHMS)


def test_exact_diffusion_runs_exp2_on_its_undirected_form():
    used, note = resolve("exact_diffusion", {"name": "exp2"})
    assert used.name == "symmetric_exp2" and used.weight_scheme == "metropolis"
    w = used.mixing_matrix()
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-15)
    assert "symmetric_exp2" in note and "exp2" in note


@pytest.mark.parametrize("topology", [{"name": "ring"}, {"name": "symmetric_exp2"}, {"name": "mesh"}])
def test_exact_diffusion_keeps_a_symmetric_doubly_stochastic_topology(topology):
    built = build_topology(topology, 8)
    used, note = resolve_topology({"name": "exact_diffusion"}, built)
    assert used is built and note is None


def test_exact_diffusion_gives_a_non_regular_uniform_graph_metropolis_weights():
    used, note = resolve("exact_diffusion", {"name": "star", "weights": "uniform"})
    assert used.is_symmetric() and used.is_doubly_stochastic() and note


@pytest.mark.parametrize(
    "algorithm, topology, words",
    [
        ("exact_diffusion", {"name": "ring", "directed": True}, "declared directed"),
        ("exact_diffusion", {"name": "one_peer_exp2"}, "static"),
        ("gradient_tracking", {"name": "star", "weights": "uniform"}, "doubly stochastic"),
        ("push_sum", {"name": "star", "weights": "uniform"}, "column stochastic"),
        ("push_diging", {"name": "star", "weights": "uniform"}, "column stochastic"),
        ("dsgd", {"name": "star", "weights": "column"}, "row stochastic"),
    ],
)
def test_refusals_name_the_algorithm_the_topology_and_what_is_needed(algorithm, topology, words):
    with pytest.raises(TopologyMismatch) as info:
        resolve(algorithm, topology)
    message = str(info.value)
    assert "\n" not in message and f"algorithm={algorithm}" in message and words in message
    assert topology["name"] in message and "allowed" in message


def test_push_algorithms_take_a_non_regular_directed_graph_with_column_weights():
    a = np.zeros((5, 5))
    for i in range(5):
        a[(i + 1) % 5, i] = 1
    a[2, 0] = 1
    topo = AdjacencyTopology(a, weights="column")
    for name in ("push_sum", "push_diging"):
        assert resolve_topology({"name": name}, topo) == (topo, None)
    for name in ("dsgd", "gradient_tracking"):
        with pytest.raises(TopologyMismatch):
            resolve_topology({"name": name}, topo)
    # not declared directed: exact diffusion runs on the same edges made two-way
    used, note = resolve_topology({"name": "exact_diffusion"}, topo)
    assert used.is_symmetric() and used.is_doubly_stochastic() and not used.is_dynamic and note


@pytest.mark.parametrize("algorithm", ["dsgd", "gradient_tracking", "push_sum", "push_diging"])
def test_time_varying_graphs_are_accepted_where_the_theory_allows(algorithm):
    weights = "column" if algorithm.startswith("push") else "uniform"
    used, note = resolve(algorithm, {"name": "one_peer_exp2", "weights": weights})
    assert used.is_dynamic and note is None


# ------------------------------------------------------------------ through the CLI
def test_cli_runs_exact_diffusion_on_exp2_and_records_what_it_used(bfexp):
    proc = bfexp("algorithm=exact_diffusion", "topology=exp2", "ranks=4", "steps=6", "log_every=3",
                 "baseline_steps=0", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    assert "runs on symmetric_exp2 with weights=metropolis" in proc.stdout
    summary = json.loads((bfexp.cwd / "run" / "summary.json").read_text())
    assert summary["topology"] == "exp2"
    assert (summary["topology_used"], summary["topology_weights"]) == ("symmetric_exp2", "metropolis")


@pytest.mark.parametrize(
    "args, words",
    [
        (["algorithm=exact_diffusion", "topology=ring", "topology.directed=true"], "declared directed"),
        (["algorithm=exact_diffusion", "topology=one_peer_exp2"], "needs a static topology"),
        (["algorithm=ddp", "engine=threads"], "engine=threads"),
        (["algorithm=ddp", "algorithm.communication_period=4"], "algorithm.communication_period=4"),
        (["algorithm=ddp", "throughput_only=true"], "algorithm=ddp communicates inside backward"),
        (["algorithm=dsgd", "algorithm.style=dta"], "algorithm.style='dta'; allowed: atc, awc, cta"),
        (["algorithm=gradient_tracking", "algorithm.form=next"], "algorithm.form='next'; allowed: diging, atc"),
    ],
)
def test_cli_refuses_with_one_line_before_any_rank_starts(bfexp, args, words):
    proc = bfexp(*args, "ranks=4", "hydra.run.dir=run")
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not (bfexp.cwd / "run" / "logs").exists(), "no rank may start"
