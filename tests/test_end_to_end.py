"""Whole jobs through the real CLI and real MPI ranks."""

import json
import signal
import subprocess
import time

import pytest

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


def test_default_experiment(bfexp):
    """No overrides: DSGD (atc) on exp2, 4 MPI ranks, synthetic non-iid logistic regression."""
    proc = bfexp("hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    run = bfexp.cwd / "run"
    summary, records = load_run(run)
    assert SUMMARY_FIELDS <= set(summary)
    assert (summary["algorithm"], summary["topology"], summary["ranks"], summary["engine"]) == ("dsgd", "exp2", 4, "mpi")
    assert summary["status"] == "completed" and summary["error"] is None
    assert all(RECORD_FIELDS <= set(r) for r in records)
    assert records[-1]["step"] == summary["steps"] == 200
    assert sorted((run / "logs").glob("rank*.log")) and (run / "config.yaml").exists()
    assert "completed" in proc.stdout  # the summary table


@pytest.mark.parametrize("algorithm", ["dsgd", "allreduce"])
def test_training_reduces_loss(bfexp, algorithm):
    proc = bfexp(f"algorithm={algorithm}", "steps=120", "log_every=5", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    summary, records = load_run(bfexp.cwd / "run")
    first = records[0]["eval_loss"]
    assert summary["final_eval_loss"] < 0.9 * first
    assert summary["final_accuracy"] > 0.7


def test_failing_rank_fails_the_job_fast(bfexp):
    proc = bfexp("fail_rank=1", "fail_step=20", "steps=1000000", "log_every=5", "hydra.run.dir=run", timeout=90)
    assert proc.returncode != 0
    summary, records = load_run(bfexp.cwd / "run")
    assert summary["status"] == "failed"
    assert summary["error"].startswith("rank 1: RuntimeError: injected failure")
    assert records, "metrics logged before the failure are kept"


def test_sigterm_ends_every_rank(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(BFEXP + ["steps=100000000", "log_every=1", f"hydra.run.dir={run}"], cwd=tmp_path,
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
