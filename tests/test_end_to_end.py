"""Whole jobs through the real CLI and real MPI ranks.

The jobs that need no signal run in one interpreter (tests/cli_in_process.py: `calls`, each in a folder of
its own): their ranks are the real ones (MPI processes started by mpiexec; virtual ranks where the claim is
about training, not processes: the same worker code, bit for bit, tests/test_threads_equivalence.py) without
a driver's interpreter and torch start per job.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.cli_in_process import calls, ran
from tests.conftest import BFEXP

SUMMARY_FIELDS = {
    "algorithm", "topology", "ranks", "engine", "seed", "status", "error", "final_loss", "final_accuracy",
    "consensus_distance", "steps", "step_time_s", "throughput_samples_per_s", "wall_time_s",
}
RECORD_FIELDS = {"step", "epoch", "loss", "accuracy", "consensus_distance", "elapsed_s"}


def load_run(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


JOBS = {
    "default": ["hydra.run.dir=run"],
    **{f"reduces-{a}": [f"algorithm={a}", "engine=threads", "steps=120", "log_every=5", "hydra.run.dir=run"]
       for a in ("dsgd", "allreduce")},
    "failing-rank": ["ranks=2", "fail_rank=1", "fail_step=20", "steps=1000000", "log_every=5", "hydra.run.dir=run"],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """JOBS through the CLI in one interpreter: {name: (its folder, its outcome)}."""
    root = tmp_path_factory.mktemp("jobs")
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    got = calls([{"id": name, "folder": str(root / name), "args": args} for name, args in JOBS.items()],
                timeout=400, env=env)
    return {name: (root / name, got[name]) for name in JOBS}


def test_default_experiment(jobs):
    """No overrides: DSGD (atc) on exp2, 4 MPI ranks, synthetic non-iid logistic regression."""
    cwd, proc = jobs["default"]
    ran(proc)
    run = cwd / "run"
    summary, records = load_run(run)
    assert SUMMARY_FIELDS <= set(summary)
    assert (summary["algorithm"], summary["topology"], summary["ranks"], summary["engine"]) == ("dsgd", "exp2", 4, "mpi")
    assert summary["status"] == "completed" and summary["error"] is None
    assert all(RECORD_FIELDS <= set(r) for r in records)
    assert records[-1]["step"] == summary["steps"] == 200
    assert sorted((run / "logs").glob("rank*.log")) and (run / "config.yaml").exists()
    assert "completed" in proc["stdout"]  # the summary table


@pytest.mark.parametrize("algorithm", ["dsgd", "allreduce"])
def test_training_reduces_loss(jobs, algorithm):
    cwd, proc = jobs[f"reduces-{algorithm}"]
    ran(proc)
    summary, records = load_run(cwd / "run")
    first = records[0]["eval_loss"]
    assert summary["final_eval_loss"] < 0.9 * first
    assert summary["final_accuracy"] > 0.7


def test_failing_rank_fails_the_job_fast(jobs):
    cwd, proc = jobs["failing-rank"]
    assert proc["code"] != 0 and proc["escaped"] is None, proc["escaped"]
    summary, records = load_run(cwd / "run")
    assert summary["status"] == "failed"
    assert summary["error"].startswith("rank 1: RuntimeError: injected failure")
    assert records, "metrics logged before the failure are kept"


def test_sigterm_ends_every_rank(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(BFEXP + ["ranks=2", "steps=100000000", "log_every=1", f"hydra.run.dir={run}"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run / "metrics.jsonl").exists(), "the job never started training"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == 128 + signal.SIGTERM
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"]
    leftover = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"rank processes left running: {leftover}"


@pytest.mark.large  # make test's form: test_cli_args' headline sweep, run for real (two jobs)
def test_multirun_leaves_one_directory_per_job(bfexp):
    proc = bfexp("-m", "ranks=2,4", "topology=ring,exp2", "steps=10", "hydra.sweep.dir=sweep", timeout=300)
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(p for p in (bfexp.cwd / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 4
    seen = set()
    for job in jobs:
        summary, _ = load_run(job)
        assert summary["status"] == "completed"
        seen.add((summary["ranks"], summary["topology"]))
    assert seen == {(2, "ring"), (4, "ring"), (2, "exp2"), (4, "exp2")}
