"""The asynchronous algorithms (issue 16): async push-sum, pair-wise gossip, AD-PSGD.

Every rank runs tests/algorithms/async_ranks.py: no rank waits for another
until the end, two ranks are stragglers. References are independent: the
exact average of the starting points (numpy), the sums of the exchanged
tensors, the least-squares optimum (numpy lstsq), the papers' rates.

* async push-sum on a directed, time-varying graph (one_peer_exp2 with
  column weights), stragglers, no gradients: every rank's x / w is the exact
  average (1e-10), and the sums of the numerators and weights are kept;
* gossip with f = 1/2: every exchange keeps the pair's sum (on the exchanged
  tensors), so the ranks' total is kept and they reach the exact average;
  AD-PSGD's atomic averaging likewise;
* on least squares with a diminishing step a_k = a / (1 + k / k0) and two
  4x stragglers (simulated time on scheduled virtual ranks: the same run
  every time), async push-sum and AD-PSGD approach x* at least as fast as
  1/sqrt(k), the rate both papers state (Lian et al. 2018, Thm 1; Spiridonoff
  et al. 2020 for gradient-push), on every rank; the measured error table is
  printed (scripts/async_convergence.py prints and plots longer runs);
* with every step the same (simulated) time, async push-sum's iterates are
  synchronous push-sum's (numpy matrix form, 1e-12);
* the same on real MPI processes (one spawn, real concurrency: RMA locks);
* every new option composes and runs through the CLI; bad values are one
  line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from bfexp.comm.threads import run_threads
from tests.algorithms import async_ranks, configs, lsq
from tests.algorithms.lsq_ranks import LeastSquares
from tests.conftest import REPO
from tests.mpi_helpers import run_ranks
from tests.test_bad_input import RUNNER

N = 8
ONE_PEER_PUSH = {"_target_": "bfexp.topology.OnePeerExp2", "weights": "column"}
EXP2 = {"_target_": "bfexp.topology.Exp2"}
STRAGGLERS = [2, 5]


def averaging_cases(slow: list[int], iterations: int, **timing) -> list[dict]:
    """No gradients (all-zero data): only the averaging runs."""
    common = dict(zero=True, lr=0.1, slow=slow, iterations=iterations, **timing)
    return [
        {"key": "push_sum", "algorithm": "async_push_sum", "topology": ONE_PEER_PUSH, **common},
        {"key": "gossip", "algorithm": "gossip", "topology": EXP2, "log_exchanges": True, **common},
        {"key": "ad_psgd", "algorithm": "ad_psgd", "topology": EXP2, **common},
    ]


def check_averaging(results: list[dict], iterations: int) -> None:
    x0 = np.array([r["push_sum"]["x0"] for r in results])
    mean = x0.mean(axis=0)
    # async push-sum: x / w is the exact average everywhere; the numerators and weights keep their sums.
    ps = [r["push_sum"] for r in results]
    assert np.abs(np.array([r["x"] for r in ps]) - mean).max() < 1e-10
    np.testing.assert_allclose(np.array([r["numerator"] for r in ps]).sum(axis=0), x0.sum(axis=0), atol=1e-12)
    assert abs(sum(r["weight"] for r in ps) - len(results)) < 1e-12
    weights = [r["weight"] for r in ps]
    assert max(weights) / min(weights) > 1.01, f"the stragglers should have moved the weights: {weights}"
    # gossip with f = 1/2: each exchange keeps the pair's sum; so does every rank's total.
    for r in results:
        for mine, theirs, mine_after, theirs_after in r["gossip"]["exchanges"]:
            np.testing.assert_allclose(np.add(mine_after, theirs_after), np.add(mine, theirs), rtol=0, atol=1e-14)
            np.testing.assert_array_equal(mine_after, theirs_after)  # both hold the mean
    # One exchange per rank and step, except where the last one is still in flight (overlap): on a loaded
    # machine (a full suite on 2 cores) 166 of 180 were seen; at least half must happen.
    assert sum(len(r["gossip"]["exchanges"]) for r in results) >= iterations * len(results) // 2
    for key in ("gossip", "ad_psgd"):
        x = np.array([r[key]["x"] for r in results])
        np.testing.assert_allclose(x.sum(axis=0), x0.sum(axis=0), rtol=0, atol=1e-12)
        assert np.abs(x - mean).max() < 1e-10, key


def test_averaging_is_exact_with_stragglers_on_concurrent_virtual_ranks():
    """Unscheduled virtual ranks: real threads, the stragglers really sleep; the windows' locks keep it exact."""
    cases = averaging_cases(STRAGGLERS, 150, sleep_s=0.001)
    check_averaging(run_threads(N, lambda engine: async_ranks.run(engine, cases), timeout=120), 150)


CONVERGENCE_K = 200


def convergence_cases() -> list[dict]:
    common = dict(lr=0.3, lr_offset=20, iterations=CONVERGENCE_K, slow=STRAGGLERS, spread=1.0, step_s=0.001,
                  slow_s=0.004)
    return [
        # The papers' rule: no push held back (min_weight=0; the default holds pushes below w = 0.5,
        # which keeps a straggler stable when the ranks wait for each other at logging steps).
        {"key": "async_push_sum", "algorithm": "async_push_sum", "topology": EXP2, "options": {"min_weight": 0.0},
         **common},
        {"key": "ad_psgd", "algorithm": "ad_psgd", "topology": EXP2, **common},
    ]


@pytest.fixture(scope="module")
def convergence() -> list[dict]:
    cases = convergence_cases()
    return run_threads(N, lambda engine: async_ranks.run(engine, cases), scheduled=True, timeout=120)


@pytest.mark.parametrize("key", ["async_push_sum", "ad_psgd"])
def test_diminishing_step_reaches_the_optimum_at_the_papers_rate(convergence, key):
    errors = np.array([[e for _, e in r[key]["errors"]] for r in convergence])  # (ranks, checkpoints)
    ks = np.array([k for k, _ in convergence[0][key]["errors"]])
    worst = errors.max(axis=0)  # the worst rank at each of its own iteration counts
    print(f"\n{key}: k, max_rank ||z_k - x*|| / ||x*||, k * err, sqrt(k) * err")
    for k, e in zip(ks, worst):
        print(f"{k:5d} {e:.3e} {k * e:8.3f} {np.sqrt(k) * e:7.3f}")
    # The stragglers ran 4x fewer iterations in the same (simulated) time.
    iterations = [r[key]["iterations"] for r in convergence]
    assert min(iterations) == CONVERGENCE_K and max(iterations) >= 3 * CONVERGENCE_K
    # At least the 1/sqrt(k) rate, from the start: err_k <= err_1 / sqrt(k) for k >= 32 ...
    late = ks >= 32
    assert np.all(worst[late] * np.sqrt(ks[late]) <= worst[0]), (ks[late], worst[late] * np.sqrt(ks[late]))
    # ... and the log-log slope from k = 32 on is steeper than -1/2.
    slope = np.polyfit(np.log(ks[late]), np.log(worst[late]), 1)[0]
    assert slope < -0.5, slope
    assert worst[-1] < 0.05


def test_equal_step_times_give_synchronous_push_sum_iterates():
    """Scheduled virtual ranks, every step the same simulated time, charged between backward and step (as
    the worker charges compute): async push-sum's iterates are push-sum's matrix form x+ = A(x - aG(z))."""
    K = 20

    def target(engine):
        p = lsq.problem(0, engine.size)
        model = LeastSquares(p.A[engine.rank], p.b[engine.rank], p.x0[engine.rank])
        opt = configs.build("async_push_sum", torch.optim.SGD(model.parameters(), lr=0.1), engine,
                            configs.topology(ONE_PEER_PUSH, engine.size), model=model)
        zs = []
        for _ in range(K):
            opt.zero_grad()
            zs.append(opt.flat.tolist())
            model().backward()
            engine.advance(0.01)
            opt.step()
        opt.finish()
        zs.append(opt.flat.tolist())
        opt.close()
        return zs

    got = np.array(run_threads(N, target, scheduled=True, timeout=60)).transpose(1, 0, 2)  # (k, rank, dim)
    p = lsq.problem(0, N)
    ref = lsq.push_sum(p, lsq.Schedule(configs.topology(ONE_PEER_PUSH, N).mixing_matrix), lsq.LocalSGD(0.1), K)
    np.testing.assert_allclose(got, np.array(ref.x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("min_weight, expected", [(0.25, [0.5, 0.25, 0.125] + [0.125] * 7), (0.0, [0.5 ** k for k in range(1, 11)])])
def test_a_rank_pushing_alone_holds_its_push_below_min_weight(min_weight, expected):
    """Rank 0 steps 10 times while the others do not fold (as when a straggler runs on past ranks waiting at
    a logging step): each push sends half of (x, w) away, so w halves until it is below the floor, then the
    push is held; with no floor w -> 2^-10. Afterwards the sums are intact: every z is the exact average."""

    def target(engine):
        torch.manual_seed(engine.rank)
        model = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
        start = model.weight.detach().clone().reshape(-1)
        opt = configs.build("async_push_sum", torch.optim.SGD(model.parameters(), lr=0.1), engine,
                            configs.topology(ONE_PEER_PUSH, engine.size), model=model, overlap=False,
                            min_weight=min_weight)
        weights = []
        if engine.rank == 0:
            for _ in range(10):
                opt.zero_grad()
                model.weight.grad = torch.zeros_like(model.weight)  # no gradient: only the mixing moves mass
                opt.step()
                weights.append(opt.weight)
        engine.barrier()  # every push of rank 0 has landed
        opt.finish()  # every rank folds what arrived
        x, w = opt.x.clone(), opt.weight
        opt.close()
        return weights, start.tolist(), x.tolist(), w

    out = run_threads(4, target, timeout=60)
    assert [round(w, 12) for w in out[0][0]] == expected
    # No mass made or lost: the numerators sum to the starts' sum, the weights to the rank count.
    np.testing.assert_allclose(np.sum([o[2] for o in out], axis=0), np.sum([o[1] for o in out], axis=0),
                               rtol=0, atol=1e-12)
    assert abs(sum(o[3] for o in out) - 4.0) < 1e-12


MPI_RANKS = 3  # processes importing torch on a shared machine: the spawn costs more than the checks


def test_averaging_is_exact_on_mpi_ranks(tmp_path):
    """One spawn of real processes: one-sided RMA with passive-target locks, stragglers sleeping for real."""
    # Every rank sleeps a little each step, so that processes on few cores do not spin against the locks.
    cases = averaging_cases([1], 60, step_s=0.0005, slow_s=0.002)
    # Gossip with background exchanges and a timeout every exchange exceeds: flow control cuts scores,
    # but an exchange is never dropped half way, so the sum is still kept.
    cases.append({**cases[1], "key": "gossip_late", "log_exchanges": False, "options": {"timeout_s": 1e-9}})
    code = f"""
        from bfexp.comm.mpi import MPIEngine
        from tests.algorithms import async_ranks
        engine = MPIEngine()
        emit(async_ranks.run(engine, {cases!r}))
        engine.close()
    """
    results = run_ranks(MPI_RANKS, code, tmp_path, timeout=180, env={"PYTHONPATH": str(REPO)})
    check_averaging(results, 60)
    late = [r["gossip_late"] for r in results]
    x, x0 = np.array([r["x"] for r in late]), np.array([r["x0"] for r in late])
    np.testing.assert_allclose(x.sum(axis=0), x0.sum(axis=0), rtol=0, atol=1e-12)
    assert np.abs(x - x0.mean(axis=0)).max() < 1e-10
    print("gossip_late: exchanges", [r["exchange_count"] for r in late], "timed out", [r["timeouts"] for r in late])


# ---------------------------------------------------------------- the options through the CLI

SMALL = ["ranks=4", "steps=8", "log_every=4", "engine=threads", "baseline_steps=1", "scaling.reference_steps=1",
         "scaling.reference_cache=null", "hydra.run.dir=run"]
RUNS = {
    "push_sum_dynamic": ["algorithm=async_push_sum", "topology=one_peer_exp2", "topology.weights=column",
                         "algorithm.overlap=false", "algorithm.communication_period=2", "algorithm.min_weight=0.5"],
    "gossip_clock": ["algorithm=gossip", "algorithm.interpolation=clock", "algorithm.fetch_probability=0.5",
                     "algorithm.timeout_s=0.01", "algorithm.two_way=false", "algorithm.seed=3",
                     "algorithm.overlap=false"],
    "gossip_loss": ["algorithm=gossip", "algorithm.interpolation=loss", "algorithm.divergence_threshold=0.5",
                    "algorithm.factor=0.25", "algorithm.communication_period=2"],
    "ad_psgd": ["algorithm=ad_psgd", "algorithm.seed=1", "algorithm.overlap=false", "topology=ring"],
}
REFUSED = {
    "factor": (["algorithm=gossip", "algorithm.factor=2"], ["algorithm.factor=2", "(0, 1]"]),
    "fetch": (["algorithm=gossip", "algorithm.fetch_probability=0"], ["algorithm.fetch_probability=0", "(0, 1]"]),
    "timeout": (["algorithm=gossip", "algorithm.timeout_s=-1"], ["algorithm.timeout_s=-1", "> 0"]),
    "divergence": (["algorithm=gossip", "algorithm.divergence_threshold=-1"], ["divergence_threshold=-1", ">= 0"]),
    "interpolation": (["algorithm=gossip", "algorithm.interpolation=fancy"], ["interpolation", "clock"]),
    "seed": (["algorithm=ad_psgd", "algorithm.seed=-1"], ["algorithm.seed=-1", ">= 0"]),
    "pga": (["algorithm=async_push_sum", "algorithm.global_average_every=2"], ["global_average_every=2", "0"]),
    "min_weight": (["algorithm=async_push_sum", "algorithm.min_weight=1"], ["algorithm.min_weight=1", "[0, 1)"]),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> tuple[dict, dict]:
    """Every run and refusal through bfexp.cli.command in one interpreter: ({id: outcome}, {id: summary})."""
    root = tmp_path_factory.mktemp("async_cli")
    cases = [{"id": k, "args": [*v, *SMALL], "folder": str(root / k)} for k, v in RUNS.items()]
    cases += [{"id": k, "args": [*v, *SMALL], "folder": str(root / k)} for k, (v, _) in REFUSED.items()]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    summaries = {k: json.loads((root / k / "run" / "summary.json").read_text()) for k in RUNS
                 if (root / k / "run" / "summary.json").exists()}
    return outcomes, summaries


@pytest.mark.parametrize("run", list(RUNS))
def test_every_option_composes_and_runs(cli_runs, run):
    outcomes, summaries = cli_runs
    assert outcomes[run]["code"] == 0 and outcomes[run]["escaped"] is None, outcomes[run]
    summary = summaries[run]
    assert summary["status"] == "completed", summary.get("error")
    assert summary["algorithm"] == RUNS[run][0].split("=")[1]
    assert np.isfinite(summary["final_loss"])


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_option_is_one_line_exit_2(cli_runs, case):
    got = cli_runs[0][case]
    lines = got["stderr"].strip().splitlines()
    assert got["code"] == 2 and got["escaped"] is None, got
    assert len(lines) == 1 and lines[0].startswith("bfexp: error:"), got["stderr"]
    for word in REFUSED[case][1]:
        assert word in lines[0], lines[0]
