"""Evaluation that does not dominate: eval_every, the budgeted default, eval_subset, and the
evaluation time reported apart from the training time; `bfexp --verbose` shows where the wall time went.
(The consensus distance, a training figure, is logged at every logged step.)

Virtual ranks (engine=threads): the worker's loop is the same code on every engine.
References are independent of the code under test: which steps must carry evaluated
figures follows from the options alone (multiples of eval_every and the last step; the
two extreme budgets), and an accuracy on a subset of N held-out samples averaged over R
ranks is a multiple of 1 / (N R).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bfexp import results
from bfexp.progress import print_summary
from tests.cli_in_process import calls, ran

SMALL = ["engine=threads", "ranks=2", "logger=jsonl", "baseline_steps=0", "scaling.reference_steps=1"]
EVALUATED = ("eval_loss", "accuracy")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / results.METRICS).read_text().splitlines()]


def evaluated_steps(run: Path) -> list[int]:
    out = []
    for r in records(run):
        present = [r[k] is not None for k in EVALUATED]
        assert all(present) or not any(present), f"step {r['step']}: evaluated figures come together: {r}"
        if all(present):
            out.append(r["step"])
    return out


# The jobs below, each in a folder of its own, one after another in one interpreter (tests/cli_in_process.py).
JOBS = {
    "subset": [*SMALL, "steps=14", "log_every=4", "eval_every=6", "eval_subset=50", "--verbose", "hydra.run.dir=run"],
    "budget": ["-m", *SMALL, "steps=12", "log_every=3", "eval_budget=1e-12,1e12", "eval_points=0",
               "hydra.sweep.dir=sweep", "report=false"],
    "points": ["-m", *SMALL, "steps=200", "log_every=10", "eval_budget=1e-12", "eval_points=10,3,0",
               "hydra.sweep.dir=sweep", "report=false"],
    "loose": [*SMALL, "steps=200", "log_every=10", "eval_budget=1e12", "eval_points=10", "hydra.run.dir=loose",
              "report=false"],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{JOBS's name: (its folder, what calls gave: exit code, stdout's end, stderr)}."""
    root = tmp_path_factory.mktemp("eval_budget")
    got = calls([{"id": name, "folder": str(root / name), "args": args} for name, args in JOBS.items()], timeout=600)
    return {name: (root / name, got[name]) for name in JOBS}


def finished(jobs, name):
    folder, got = jobs[name]
    ran(got)
    return folder, got


def test_eval_every_and_subset_run_small_with_eval_time_apart(jobs):
    folder, proc = finished(jobs, "subset")
    run = folder / "run"
    # Records at every logged step (4, 8, 12), every evaluation (6, 12) and the last step (14).
    assert [r["step"] for r in records(run)] == [4, 6, 8, 12, 14]
    assert evaluated_steps(run) == [6, 12, 14]
    for r in records(run):
        assert r["consensus_distance"] is not None and r["consensus_distance"] >= 0
        if r["accuracy"] is not None:  # mean over 2 ranks of correct / 50
            assert math.isclose(r["accuracy"] * 100, round(r["accuracy"] * 100), abs_tol=1e-9), r["accuracy"]
    summary = json.loads((run / results.SUMMARY).read_text())
    assert summary["evaluations"] == 3 and summary["eval_every"] == 6
    assert summary["eval_time_s"] > 0 and summary["train_time_s"] > 0
    assert summary["final_accuracy"] == records(run)[-1]["accuracy"]
    # The job's table shows both times; --verbose, where the wall time went.
    assert "training time (s)" in proc["stdout"] and "evaluation time (s)" in proc["stdout"]
    assert "where the wall time went" in proc["stdout"] and "dry build" in proc["stdout"]


def test_budget_spaces_evaluations_in_multiples_of_log_every(jobs):
    # A budget nothing fits: the first logged step measures, then only the last evaluates.
    # A budget everything fits: every logged step evaluates.
    folder = finished(jobs, "budget")[0]
    runs = {json.loads((p / results.SUMMARY).read_text())["eval_every"]: p
            for p in (folder / "sweep").iterdir() if (p / results.SUMMARY).exists()}
    assert len(runs) == 2, runs
    tight, loose = runs[max(runs)], runs[min(runs)]
    assert evaluated_steps(tight) == [3, 12] and max(runs) % 3 == 0 and max(runs) > 12
    assert evaluated_steps(loose) == [3, 6, 9, 12] and min(runs) == 3


def test_a_run_evaluates_often_enough_for_a_curve_by_default(jobs):
    """eval_points (10 by default) evenly spaced in multiples of log_every, where the budget would give fewer:
    200 steps logged every 10 evaluate every floor(200 / (10 x 10)) x 10 = 20 steps, plus the first logged step;
    eval_points=3 every floor(200 / 30) = 6 logs, 60 steps; a budget that allows more keeps its own spacing."""
    by_points = {}
    for run in (finished(jobs, "points")[0] / "sweep").iterdir():
        if (run / results.SUMMARY).exists():
            points = int(next(o for o in (run / ".hydra" / "overrides.yaml").read_text().split()
                              if o.startswith("eval_points=")).split("=")[1])
            by_points[points] = evaluated_steps(run)
    assert by_points[10] == [10, *range(20, 201, 20)]
    assert by_points[3] == [10, 60, 120, 180, 200]
    assert by_points[0] == [10, 200]  # the budget alone: nothing fits but the first logged step and the last
    assert evaluated_steps(finished(jobs, "loose")[0] / "loose") == list(range(10, 201, 10))


def test_the_job_table_shows_training_and_evaluation_time(capsys):
    summary = {"algorithm": "dsgd", "topology": "exp2", "ranks": 2, "engine": "threads", "status": "completed",
               "train_time_s": 1.25, "eval_time_s": 0.125}
    print_summary(summary, "somewhere")
    out = capsys.readouterr().out
    assert "training time (s)" in out and "1.25" in out
    assert "evaluation time (s)" in out and "0.125" in out


def test_evaluation_in_chunks_equals_one_pass_by_hand():
    """evaluate() walks the held-out set in cache-sized chunks (the last one short): the mean loss and the
    accuracy equal those of one pass over all samples, computed here with torch directly."""
    import torch
    import torch.nn.functional as F

    from bfexp.metrics import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    x, y = torch.randn(1000, 6, dtype=torch.float64), torch.randint(0, 4, (1000,))
    with torch.no_grad():
        out = model(x)
        loss, accuracy = float(F.cross_entropy(out, y)), float((out.argmax(1) == y).double().mean())
    for chunk in (1, 256, 999, 4096):
        got = evaluate(model, x, y, chunk)
        # (evaluate takes the loss in float32, as training does)
        assert abs(got[0] - loss) < 1e-6 * loss and got[1] == accuracy, (chunk, got, loss, accuracy)
    assert model.training  # the mode it came in with
