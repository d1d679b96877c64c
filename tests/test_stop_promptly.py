"""A stop request stops within seconds at any log_every (issue 44).

The ranks agree on a stop at logging steps; at log_every=100000 a SIGTERM waited until the job's next
logging step (hours), longer than Slurm's KillWait, so a preempted job was killed before its checkpoint.
Between logging steps the ranks now poll about once a second (bfexp.worker.StopPoll). Each case runs the
real CLI, sends SIGTERM once the ranks train, and times the driver's exit: within 5 s, the job
`interrupted` with a checkpoint at the step it stopped, nothing left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import BFEXP


def wait_training(run: "os.PathLike", proc: subprocess.Popen, virtual: bool, within_s: float = 120) -> None:
    """Until the ranks train: an MPI rank's heartbeat past step 1, or (virtual ranks, whose heartbeats stay in
    memory) the job's config written and a few seconds more."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        steps = []
        for b in (run / "heartbeat").glob("rank*.json") if (run / "heartbeat").is_dir() else []:
            try:
                steps.append(int(json.loads(b.read_text()).get("step", 0)))
            except (ValueError, OSError):
                pass
        if steps and min(steps) > 1:
            return
        if virtual and (run / "config.yaml").exists():
            time.sleep(4)  # virtual ranks: training by now
            return
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start training (exit {proc.poll()})")


def stop_and_time(run, args: list[str], cwd, virtual: bool = False) -> tuple[float, dict, subprocess.Popen]:
    proc = subprocess.Popen([*BFEXP, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_training(run, proc, virtual)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return took, json.loads((run / "summary.json").read_text()), proc


@pytest.mark.parametrize("engine", ["mpi"])
def test_sigterm_stops_a_job_within_5_s_at_any_log_every(tmp_path, engine):
    took, summary, proc = stop_and_time(
        tmp_path / "run", [f"engine={engine}", "ranks=2", "steps=1000000", "log_every=100000", "baseline_steps=0",
                           "report=false", "logger=jsonl", "hydra.run.dir=run"], tmp_path, virtual=engine == "threads")
    assert took < 5.0, f"the job took {took:.1f} s to stop"
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    step = summary["checkpoint_step"]
    assert summary["status"] == "interrupted" and 1 < step < 100000, summary
    assert (tmp_path / "run" / "checkpoint" / f"step{step}").is_dir()
    assert f"stopped at step {step}" in summary["error"]
