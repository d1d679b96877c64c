"""The communication-efficient rules on 8 ranks against the papers' matrix forms.

8 ranks, heterogeneous least squares (tests/algorithms/lsq.py), float64,
full-batch gradients, one world of 8 virtual ranks for every case (bfexp's
threads engine in this process, lsq_ranks.on_threads; it trains bit for bit as
MPI does, tests/test_threads_equivalence.py, and every engine operation these
rules use is checked on both engines against numpy by tests/comm/test_contract.py);
lsq_ranks.py builds each algorithm from its conf/algorithm YAML. Claims:

* CHOCO-SGD with the identity compressor (gamma = 1) is DSGD adapt-then-combine:
  the numpy matrix form and DSGD's own run, to 1e-12;
* CHOCO-SGD with top-k and with scaled sign equals the paper's matrix form
  (X_hat_0 = 0) iterate for iterate, to 1e-10; with stochastic compressors
  (QSGD, random-k) the models' mean moves by the mean gradient step;
* Gossip-PGA with H = 1 is allreduce SGD; with H > 1 DSGD (atc, awc, cta),
  exact diffusion, DIGing, push-sum and CHOCO-SGD equal their matrix forms
  with J = 11^T / n on every H-th round;
* DiLoCo with sync period 1, inner SGD and outer SGD (lr 1, no momentum) is
  allreduce SGD; with H > 1 and Nesterov momentum it equals the paper's
  algorithm (allreduce) and the mixed form over a static and a dynamic graph;
  SlowMo equals its Algorithm 1;
* QG-DSGDm (and its Nesterov form) equals the paper's Algorithm 1;
* error-feedback compressed allreduce with the identity compressor is
  allreduce SGD, with top-k it equals EF-SGD's recursion (also with local steps).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.algorithms import configs, lsq, lsq_ranks
from tests.algorithms import lsq_efficient as ref

N = lsq.RANKS
LR = 0.1
K = 30  # iterations compared with the references
LONG = 100  # iterations of the cases compared with centralized gradient descent

RING = {"_target_": "bfexp.topology.Ring"}
SEXP2 = {"_target_": "bfexp.topology.SymmetricExp2"}
EXP2 = {"_target_": "bfexp.topology.Exp2"}
ONE_PEER = {"_target_": "bfexp.topology.OnePeerExp2"}
ONE_PEER_PUSH = {"_target_": "bfexp.topology.OnePeerExp2", "weights": "column"}
TOP_HALF = {"_target_": "bfexp.compression.TopK", "ratio": 0.5}  # k = 2 of 4
TOP_QUARTER = {"_target_": "bfexp.compression.TopK", "ratio": 0.25}  # k = 1 of 4


def case(key, algorithm, topology, *, lr=LR, iterations=K, **extra) -> dict:
    return {"key": key, "algorithm": algorithm, "topology": topology, "lr": lr, "iterations": iterations,
            "keep": "all", **extra}


CASES = {c["key"]: c for c in [
    # CHOCO-SGD
    case("choco_identity/ring", "choco_sgd", RING, options={"compressor": "identity", "gamma": 1.0}),
    case("dsgd_atc/ring", "dsgd", RING, options={"style": "atc"}),
    case("choco_identity/exp2_momentum", "choco_sgd", EXP2, momentum=0.9,
         options={"compressor": "identity", "gamma": 1.0}),
    case("choco_top_k/ring", "choco_sgd", RING, options={"compressor": TOP_HALF, "gamma": 0.4}),
    case("choco_top_k/sexp2_momentum", "choco_sgd", SEXP2, momentum=0.5,
         options={"compressor": TOP_QUARTER, "gamma": 0.3}),
    case("choco_sign/ring", "choco_sgd", RING, options={"compressor": "sign", "gamma": 0.2}),
    case("choco_qsgd/ring", "choco_sgd", RING,
         options={"compressor": {"_target_": "bfexp.compression.QSGD", "bits": 3, "scaled": True}, "gamma": 0.3}),
    case("choco_random_k/sexp2", "choco_sgd", SEXP2,
         options={"compressor": {"_target_": "bfexp.compression.RandomK", "ratio": 0.5, "seed": 3}, "gamma": 0.3}),
    # Gossip-PGA
    case("pga1/dsgd", "dsgd", RING, iterations=LONG, same_start=True, options={"global_average_every": 1}),
    case("pga3/dsgd_atc", "dsgd", RING, options={"style": "atc", "global_average_every": 3}),
    case("pga3/dsgd_awc_overlap_off", "dsgd", RING,
         options={"style": "awc", "global_average_every": 3, "overlap": False}),
    case("pga2/dsgd_cta", "dsgd", ONE_PEER, options={"style": "cta", "global_average_every": 2}),
    case("pga2/exact_diffusion", "exact_diffusion", SEXP2, options={"global_average_every": 2}),
    case("pga3/diging", "gradient_tracking", SEXP2, options={"form": "diging", "global_average_every": 3}),
    case("pga2/push_sum", "push_sum", ONE_PEER_PUSH, options={"global_average_every": 2}),
    case("pga4/choco_identity", "choco_sgd", RING,
         options={"compressor": "identity", "gamma": 1.0, "global_average_every": 4}),
    # DiLoCo and SlowMo
    case("diloco_sync1", "diloco", RING, iterations=LONG, same_start=True,
         options={"communication_period": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False,
                  "average": "allreduce"}),
    case("diloco_h4/allreduce", "diloco", RING, same_start=True, options={"communication_period": 4,
                                                                          "average": "allreduce"}),
    case("diloco_h3/ring", "diloco", RING, options={"communication_period": 3, "outer_momentum": 0.5}),
    case("diloco_h2/one_peer_heavy_ball", "diloco", ONE_PEER,
         options={"communication_period": 2, "nesterov": False}),
    case("slowmo_h3/allreduce", "slowmo", RING, same_start=True, momentum=0.5,
         options={"communication_period": 3, "average": "allreduce", "slow_momentum": 0.7}),
    case("slowmo_h2/ring", "slowmo", RING, options={"communication_period": 2, "slow_lr": 0.8}),
    # QG-DSGDm
    case("qg/ring", "qg_dsgdm", RING),
    case("qg_nesterov/sexp2", "qg_dsgdm", SEXP2, options={"nesterov": True, "momentum": 0.8}),
    case("qg/one_peer", "qg_dsgdm", ONE_PEER),
    # error-feedback compressed allreduce
    case("ef_identity", "compressed_allreduce", None, iterations=LONG, same_start=True,
         options={"compressor": "identity"}),
    case("ef_top_k", "compressed_allreduce", None, same_start=True, options={"compressor": TOP_QUARTER}),
    case("ef_top_k_period2", "compressed_allreduce", None, same_start=True, momentum=0.5,
         options={"compressor": TOP_HALF, "communication_period": 2}),
]}


@pytest.fixture(scope="module")
def runs():
    """{case key: iterates (iterations + 1, ranks, dim)}, one world of 8 virtual ranks for all."""
    out = lsq_ranks.on_threads(N, list(CASES.values()))
    return {key: np.array([[state["x"] for state in rank_out[key]] for rank_out in out]).swapaxes(0, 1)
            for key in CASES}


def problem(c: dict) -> lsq.Problem:
    return lsq.problem(0, N)


def start(c: dict) -> np.ndarray:
    p = problem(c)
    return np.tile(p.x0[0], (N, 1)) if c.get("same_start") else p.x0


def optimizer(c: dict):
    return lsq.local_optimizer("sgd", c["lr"], c.get("momentum", 0.0))


def matrices(c: dict):
    return configs.topology(c["topology"], N).mixing_matrix


def options(c: dict) -> dict:
    return c.get("options", {})


def centralized(c: dict) -> np.ndarray:
    p = problem(c)
    return np.array(lsq.centralized(p, p.x0[0], optimizer(c), c["iterations"]).x)


def close(got: np.ndarray, want, atol: float) -> None:
    np.testing.assert_allclose(got, np.array(want), atol=atol, rtol=0)


# ------------------------------------------------------------------ CHOCO-SGD
@pytest.mark.parametrize("key", ["choco_identity/ring", "choco_identity/exp2_momentum"])
def test_choco_with_the_identity_compressor_is_dsgd(runs, key):
    c = CASES[key]
    want = lsq.dsgd(problem(c), lsq.Schedule(matrices(c)), optimizer(c), K, "atc").x
    close(runs[key], want, 1e-12)
    if key == "choco_identity/ring":
        close(runs[key], runs["dsgd_atc/ring"], 1e-12)


@pytest.mark.parametrize("key, compress", [
    ("choco_top_k/ring", lambda V: ref.top_k(V, 0.5)),
    ("choco_top_k/sexp2_momentum", lambda V: ref.top_k(V, 0.25)),
    ("choco_sign/ring", ref.sign),
])
def test_choco_equals_the_papers_matrix_form(runs, key, compress):
    c = CASES[key]
    want = ref.choco(problem(c), matrices(c)(0), optimizer(c), K, options(c)["gamma"], compress).x
    close(runs[key], want, 1e-10)
    assert np.abs(runs[key][-1] - runs[key][-1].mean(axis=0)).max() > 1e-6, "the ranks still differ: not trivial"


@pytest.mark.parametrize("key", ["choco_qsgd/ring", "choco_random_k/sexp2"])
def test_choco_with_stochastic_compression_keeps_the_mean_on_a_doubly_stochastic_graph(runs, key):
    X, p = runs[key], problem(CASES[key])
    predicted = X[:-1].mean(axis=1) - LR * np.stack([p.grad(x).mean(axis=0) for x in X[:-1]])
    assert np.abs(X[1:].mean(axis=1) - predicted).max() < 1e-12
    assert np.abs(X[-1] - X[-1].mean(axis=0)).max() > 1e-6


# ------------------------------------------------------------------ Gossip-PGA
def test_gossip_pga_every_step_is_allreduce_sgd(runs):
    close(runs["pga1/dsgd"], centralized(CASES["pga1/dsgd"]), 1e-10)


@pytest.mark.parametrize("key, rule", [
    ("pga3/dsgd_atc", lambda p, s, o: lsq.dsgd(p, s, o, K, "atc")),
    ("pga3/dsgd_awc_overlap_off", lambda p, s, o: lsq.dsgd(p, s, o, K, "awc")),
    ("pga2/dsgd_cta", lambda p, s, o: lsq.dsgd(p, s, o, K, "cta")),
    ("pga2/exact_diffusion", lambda p, s, o: lsq.exact_diffusion(p, s, o, K)),
    ("pga3/diging", lambda p, s, o: lsq.diging(p, s, o, K)),
    ("pga2/push_sum", lambda p, s, o: lsq.push_sum(p, s, o, K)),
    ("pga4/choco_identity", lambda p, s, o: lsq.dsgd(p, s, o, K, "atc")),
])
def test_gossip_pga_replaces_every_hth_round_by_the_exact_average(runs, key, rule):
    c = CASES[key]
    schedule = lsq.Schedule(ref.pga(matrices(c), options(c)["global_average_every"], N))
    close(runs[key], rule(problem(c), schedule, optimizer(c)).x, 1e-12)


# ------------------------------------------------------------------ DiLoCo, SlowMo
def test_diloco_with_sync_period_1_and_plain_outer_sgd_is_allreduce_sgd(runs):
    close(runs["diloco_sync1"], centralized(CASES["diloco_sync1"]), 1e-10)


@pytest.mark.parametrize("key", ["diloco_h4/allreduce", "diloco_h3/ring", "diloco_h2/one_peer_heavy_ball"])
def test_diloco_equals_its_outer_nesterov_rule(runs, key):
    c, o = CASES[key], options(CASES[key])
    step = ref.nesterov_sgd(o.get("outer_lr", 0.7), o.get("outer_momentum", 0.9), o.get("nesterov", True))
    mixing = None if o.get("average") == "allreduce" else matrices(c)
    want = ref.outer(problem(c), start(c), optimizer(c), K, o["communication_period"], step, mixing)
    close(runs[key], want.x, 1e-12)


@pytest.mark.parametrize("key", ["slowmo_h3/allreduce", "slowmo_h2/ring"])
def test_slowmo_equals_its_algorithm_1(runs, key):
    c, o = CASES[key], options(CASES[key])
    step = ref.slow_momentum(o.get("slow_lr", 1.0), o.get("slow_momentum", 0.5), c["lr"])
    mixing = None if o.get("average") == "allreduce" else matrices(c)
    want = ref.outer(problem(c), start(c), optimizer(c), K, o["communication_period"], step, mixing)
    close(runs[key], want.x, 1e-12)


# ------------------------------------------------------------------ QG-DSGDm
@pytest.mark.parametrize("key", ["qg/ring", "qg_nesterov/sexp2", "qg/one_peer"])
def test_qg_dsgdm_equals_its_algorithm_1(runs, key):
    c, o = CASES[key], options(CASES[key])
    want = ref.qg_dsgdm(problem(c), lsq.Schedule(matrices(c)), c["lr"], o.get("momentum", 0.9),
                        o.get("nesterov", False), K)
    close(runs[key], want.x, 1e-12)


# ------------------------------------------------------------------ error-feedback compressed allreduce
def test_compressed_allreduce_with_the_identity_is_allreduce_sgd(runs):
    close(runs["ef_identity"], centralized(CASES["ef_identity"]), 1e-10)


@pytest.mark.parametrize("key, ratio", [("ef_top_k", 0.25), ("ef_top_k_period2", 0.5)])
def test_compressed_allreduce_equals_error_feedback_sgd(runs, key, ratio):
    c = CASES[key]
    want = ref.error_feedback(problem(c), problem(c).x0[0], optimizer(c), K,
                              options(c).get("communication_period", 1), lambda V: ref.top_k(V, ratio))
    close(runs[key], want.x, 1e-10)
