"""Which topologies, engines and options each algorithm accepts, substitutes or refuses (no ranks
needed), and the same through the real CLI: a note for a substitution, one line and exit 2 for a refusal."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

import bfexp.algorithms
from bfexp.algorithms import DDP, DSGD, Allreduce, DecentralizedOptimizer, TopologyMismatch
from bfexp.cli import group_options
from bfexp.errors import ConfigError
from bfexp.topology import AdjacencyTopology, Exp2, Mesh, OnePeerExp2, Ring, Star, SymmetricExp2
from tests.algorithms.configs import algorithm_class, node
from tests.cli_in_process import ran


def resolve_topology(algorithm: str, topology):
    """What the configured algorithm runs on (the class its conf/algorithm YAML names decides)."""
    return algorithm_class(algorithm).resolve_topology(topology)


def resolve(algorithm: str, topology: type, ranks: int = 8, **params):
    return resolve_topology(algorithm, topology(ranks, **params))


def test_every_algorithm_has_a_config_option():
    classes = {c for c in vars(bfexp.algorithms).values()
               if isinstance(c, type) and issubclass(c, DecentralizedOptimizer) and c is not DecentralizedOptimizer}
    options = group_options("algorithm")
    assert {algorithm_class(o) for o in options} == classes
    assert all(algorithm_class(o).name == o for o in options)


def test_exact_diffusion_runs_exp2_on_its_undirected_form():
    used, note = resolve("exact_diffusion", Exp2)
    assert used.name == "symmetric_exp2" and used.weight_scheme == "metropolis"
    w = used.mixing_matrix()
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-15)
    assert "symmetric_exp2" in note and "exp2" in note


@pytest.mark.parametrize("topology", [Ring, SymmetricExp2, Mesh])
def test_exact_diffusion_keeps_a_symmetric_doubly_stochastic_topology(topology):
    built = topology(8)
    used, note = resolve_topology("exact_diffusion", built)
    assert used is built and note is None


def test_exact_diffusion_gives_a_non_regular_uniform_graph_metropolis_weights():
    used, note = resolve("exact_diffusion", Star, weights="uniform")
    assert used.is_symmetric() and used.is_doubly_stochastic() and note


@pytest.mark.parametrize(
    "algorithm, topology, params, words",
    [
        ("exact_diffusion", Ring, {"directed": True}, "declared directed"),
        ("exact_diffusion", OnePeerExp2, {}, "static"),
        ("gradient_tracking", Star, {"weights": "uniform"}, "doubly stochastic"),
        ("push_sum", Star, {"weights": "uniform"}, "column stochastic"),
        ("push_diging", Star, {"weights": "uniform"}, "column stochastic"),
        ("dsgd", Star, {"weights": "column"}, "row stochastic"),
    ],
)
def test_refusals_name_the_algorithm_the_topology_and_what_is_needed(algorithm, topology, params, words):
    with pytest.raises(TopologyMismatch) as info:
        resolve(algorithm, topology, **params)
    message = str(info.value)
    assert "\n" not in message and f"algorithm={algorithm}" in message and words in message
    assert topology.name in message and "allowed" in message


def test_push_algorithms_take_a_non_regular_directed_graph_with_column_weights():
    a = np.zeros((5, 5))
    for i in range(5):
        a[(i + 1) % 5, i] = 1
    a[2, 0] = 1
    topo = AdjacencyTopology(a, direction="in", weights="column")  # a[receiver, sender]
    for name in ("push_sum", "push_diging"):
        assert resolve_topology(name, topo) == (topo, None)
    for name in ("dsgd", "gradient_tracking"):
        with pytest.raises(TopologyMismatch):
            resolve_topology(name, topo)
    # Its direction was stated (direction="in") and it has one-way edges: declared directed, so exact
    # diffusion refuses it as it refuses ring directed=true (issue 29), rather than run on it made two-way.
    with pytest.raises(TopologyMismatch, match="is declared directed and has no undirected form"):
        resolve_topology("exact_diffusion", topo)


@pytest.mark.parametrize("algorithm", ["dsgd", "gradient_tracking", "push_sum", "push_diging"])
def test_time_varying_graphs_are_accepted_where_the_theory_allows(algorithm):
    weights = "column" if algorithm.startswith("push") else "uniform"
    used, note = resolve(algorithm, OnePeerExp2, weights=weights)
    assert used.is_dynamic and note is None


# ------------------------------------------------------------------ options and kinds of job, before any rank
@pytest.mark.parametrize("option", group_options("algorithm"))
def test_every_yaml_states_its_class_defaults_and_they_are_in_range(option):
    cls = algorithm_class(option)
    options = {k: v for k, v in node(option).items() if not k.startswith("_")}
    keywords = {}  # the constructors' keyword options, base first (model is given at run time)
    for klass in reversed(cls.__mro__):
        if issubclass(klass, DecentralizedOptimizer) and "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            keywords.update({p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name != "model"})
    assert options == keywords
    cls.check_options(**options)


@pytest.mark.parametrize(
    "option, options, words",
    [
        ("dsgd", {"communication_period": 0}, "algorithm.communication_period=0; allowed: an integer >= 1"),
        ("push_sum", {"bucket_mb": 0}, "algorithm.bucket_mb=0; allowed: a number > 0"),
        ("ddp", {"communication_period": 4}, "algorithm.communication_period=4; allowed: 1"),
        ("dsgd", {"style": "dta"}, "algorithm.style='dta'; allowed: atc, awc, cta"),
        ("gradient_tracking", {"form": "next"}, "algorithm.form='next'; allowed: diging, atc"),
    ],
)
def test_out_of_range_options_are_refused_in_one_line(option, options, words):
    with pytest.raises(ConfigError) as info:
        algorithm_class(option).check_options(**options)
    assert str(info.value).startswith(words) and "\n" not in str(info.value)


def test_ddp_needs_a_process_per_rank_unless_no_rank_runs():
    from bfexp.comm.threads import ThreadsEngine

    assert ThreadsEngine.virtual and not ThreadsEngine.processes
    with pytest.raises(ConfigError, match="engine=threads"):
        DDP.check_run(ThreadsEngine, throughput_only=False, modeled=False)
    DDP.check_run(ThreadsEngine, throughput_only=True, modeled=True)  # a modeled cluster starts no rank
    for cls in (Allreduce, DSGD):
        cls.check_run(ThreadsEngine, throughput_only=True, modeled=False)


def test_a_built_optimizer_refuses_an_attribute_it_does_not_have_but_its_constructors_may_add_any():
    """A typo (``opt.lrr = 0.1``) would change nothing: refused, naming it and the options. Constructors
    (a subclass's, before and after its parent's) add attributes freely; nothing reads the caller's frame."""
    import torch

    from bfexp.comm.threads import ThreadsEngine, ThreadWorld

    class Tagged(DSGD):
        def __init__(self, *args, tag: str = "t", **kwargs) -> None:
            self.early = tag  # before the base constructor
            super().__init__(*args, **kwargs)
            self.late = tag

        def rename(self) -> None:
            self.renamed = True  # a method, once built: refused like any other new name

    model = torch.nn.Linear(2, 1)
    opt = Tagged(torch.optim.SGD(model.parameters(), lr=0.1), ThreadsEngine(ThreadWorld(1), 0), Ring(1), tag="x")
    assert (opt.early, opt.late) == ("x", "x")
    with pytest.raises(AttributeError, match=r"^Tagged has no attribute 'lrr', so setting it would change nothing; "
                                             r"allowed: its options style, communication_period"):
        opt.lrr = 0.1
    with pytest.raises(AttributeError, match="'renamed'"):
        opt.rename()
    opt.overlap, opt._scratch_note, opt.early = False, 1, "y"  # its options, private names, its attributes


# ------------------------------------------------------------------ through the CLI
REFUSALS = [
    (["algorithm=exact_diffusion", "topology=ring", "topology.directed=true"], "declared directed"),
    (["algorithm=exact_diffusion", "topology=one_peer_exp2"], "needs a static topology"),
    (["algorithm=ddp", "engine=threads"], "engine=threads"),
    (["algorithm=ddp", "algorithm.communication_period=4"], "algorithm.communication_period=4"),
    (["algorithm=ddp", "throughput_only=true"], "algorithm=ddp communicates inside backward"),
    (["algorithm=dsgd", "algorithm.style=dta"], "algorithm.style='dta'; allowed: atc, awc, cta"),
    (["algorithm=gradient_tracking", "algorithm.form=next"], "algorithm.form='next'; allowed: diging, atc"),
]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """This file's command lines through the real CLI, one after another in one interpreter
    (tests/cli_in_process.py), each in its own folder: {case id: exit code, output, summaries, folder}."""
    import os

    from tests.cli_in_process import calls

    root = tmp_path_factory.mktemp("requirements")
    # The substitution is the algorithm's, whatever runs the ranks: virtual ranks (no process per rank).
    cases = [{"id": "exact_diffusion", "whole_stdout": True,
              "args": ["algorithm=exact_diffusion", "topology=exp2", "ranks=4", "steps=6", "log_every=3",
                       "baseline_steps=0", "engine=threads", "hydra.run.dir=run"]}]
    cases += [{"id": f"refusal{i}", "args": [*args, "ranks=4", "hydra.run.dir=run"]}
              for i, (args, _) in enumerate(REFUSALS)]
    for case in cases:
        case["folder"] = str(root / case["id"])
    env = {k: v for k, v in os.environ.items() if k != "BFEXP_DEBUG"}
    got = calls(cases, timeout=600, env=env)
    return {case["id"]: {**got[case["id"]], "folder": Path(case["folder"])} for case in cases}


def test_cli_runs_exact_diffusion_on_exp2_and_records_what_it_used(cli):
    got = cli["exact_diffusion"]
    ran(got)
    assert "runs on symmetric_exp2 with weights=metropolis" in got["stdout"]
    summary = got["summaries"]["run/summary.json"]
    assert summary["topology"] == "exp2"
    assert (summary["topology_used"], summary["topology_weights"]) == ("symmetric_exp2", "metropolis")


@pytest.mark.parametrize("case", range(len(REFUSALS)), ids=[" ".join(a) for a, _ in REFUSALS])
def test_cli_refuses_with_one_line_before_any_rank_starts(cli, case):
    got, words = cli[f"refusal{case}"], REFUSALS[case][1]
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"] + got["stdout"]
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1 and words in lines[0], got["stderr"]
    assert not (got["folder"] / "run" / "logs").exists(), "no rank may start"
