"""Resume: a run checkpointed at step 10 of 20 continues bit for bit (MPI and virtual ranks); every
algorithm's state survives a checkpoint; a run stopped by a signal resumes from the command it printed;
a sweep killed after 3 of its 6 jobs, run again, skips the 3 (their folders untouched) and runs the rest.

The reference for "bit for bit" is the same job run without interruption: every rank's parameters,
local optimizer state and algorithm buffers after the last step (the checkpoint both runs write
there), compared with torch.equal, and the logged metrics, compared exactly.

The CLI's jobs that need no signal or kill run in one interpreter (tests/cli_in_process.py: `calls`), in two
phases: the ranks are the real ones (MPI processes started by mpiexec where engine=mpi, virtual ranks
otherwise) without an interpreter and torch start per command line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import copy
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bfexp.cli import group_options
from tests.cli_in_process import calls
from tests.conftest import BFEXP, REPO, run_bfexp

CHEAP = ["logger=jsonl", "baseline_steps=0", "scaling.reference_steps=1"]


def rank_states(run: Path, step: int) -> list[dict]:
    folder = run / "checkpoint" / f"step{step}"
    ranks = len(list(folder.glob("rank*.pt")))
    assert ranks, f"no checkpoint at step {step} in {run}"
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def assert_identical(a, b, where: str = "") -> None:
    """Equal to the bit: tensors with torch.equal (same dtype and shape), everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


TRAINING = ("step", "epoch", "loss", "eval_loss", "accuracy", "consensus_distance")


def metrics(run: Path) -> list[dict]:
    return [{k: r[k] for k in TRAINING} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def assert_same_training(straight: Path, resumed: Path, step: int) -> None:
    for r, (a, b) in enumerate(zip(rank_states(straight, step), rank_states(resumed, step))):
        for part in ("model", "algorithm", "sampler"):
            assert_identical(a[part], b[part], f"rank {r} {part}")
    assert metrics(straight) == metrics(resumed)


# ---------------------------------------------------------------- a run, through the CLI

STEPS, CHECKPOINT = 20, 10  # a checkpoint halfway; the fault one step after it
FAILING_SWEEP = ["-m", "engine=threads", "ranks=2", "steps=20", "log_every=5", "fail_rank=0,null", "fail_step=3",
                 *CHEAP]


def checkpointed(engine: str) -> list[str]:
    return [f"engine={engine}", "ranks=2", "algorithm=gradient_tracking", "optimizer.momentum=0.9", f"steps={STEPS}",
            "log_every=2", f"checkpoint_every={CHECKPOINT}", *CHEAP]


# phase 1: (case, command lines in turn); phase 2, after the tests' looks between: (case, command line)
FIRST = {
    **{f"checkpointed-{engine}": [
        [*checkpointed(engine), "hydra.run.dir=straight"],
        [*checkpointed(engine), "fail_rank=1", f"fail_step={CHECKPOINT + 1}", "hydra.run.dir=broken"],
        # The same command again, without the injected fault (a run-control key, so it may change).
        ["resume=broken", "fail_rank=null"]] for engine in ("mpi", "threads")},
    "another-experiment": [["engine=threads", "ranks=2", "steps=20", "checkpoint_every=10", "fail_rank=0",
                            "fail_step=15", *CHEAP, "hydra.run.dir=run"]],
    "completed": [["engine=threads", "ranks=2", "steps=10", *CHEAP, "hydra.run.dir=run"]],
    "fail-fast": [[*FAILING_SWEEP, "hydra.sweep.dir=on"], [*FAILING_SWEEP, "fail_fast=true", "hydra.sweep.dir=fast"]],
}
SECOND = {"another-experiment": ["resume=run", "fail_rank=null", "lr=0.5"], "completed": ["resume=run"]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Any]:
    """FIRST's command lines, then each completed run's files' mtimes, then SECOND's: two interpreters for all.
    {"root", "first": {case: [outcome per command line]}, "mtimes": {path: ns}, "second": {case: outcome}}."""
    root = tmp_path_factory.mktemp("resume")
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    got = calls([{"id": f"{case} #{i}", "folder": str(root / case), "args": args}
                 for case, commands in FIRST.items() for i, args in enumerate(commands)], timeout=600, env=env)
    first = {case: [got[f"{case} #{i}"] for i in range(len(commands))] for case, commands in FIRST.items()}
    mtimes = {p: p.stat().st_mtime_ns for p in (root / "completed" / "run").rglob("*")}
    second = calls([{"id": case, "folder": str(root / case), "args": args} for case, args in SECOND.items()],
                   timeout=300, env=env)
    return {"root": root, "first": first, "mtimes": mtimes, "second": second}


def ok(got: dict, code: int = 0) -> None:
    assert got["code"] == code and got["escaped"] is None, got["stderr"][-3000:] + (got["escaped"] or "")


@pytest.mark.parametrize("engine", ["mpi", "threads"])
def test_a_run_checkpointed_halfway_resumes_bit_for_bit(jobs, engine):
    cwd = jobs["root"] / f"checkpointed-{engine}"
    straight, broken, resumed = jobs["first"][f"checkpointed-{engine}"]
    ok(straight)
    ok(broken, 1)
    # the summary the broken run left (read right after it; the resume writes over it)
    assert (broken["summaries"]["broken/summary.json"]["status"],
            broken["summaries"]["broken/summary.json"]["checkpoint_step"]) == ("failed", CHECKPOINT)
    ok(resumed)
    assert f"resuming from the checkpoint at step {CHECKPOINT}" in resumed["stdout"]
    summary = json.loads((cwd / "broken" / "summary.json").read_text())
    assert (summary["status"], summary["resumed_from_step"], summary["steps"]) == ("completed", CHECKPOINT, STEPS)
    assert_same_training(cwd / "straight", cwd / "broken", STEPS)
    final = json.loads((cwd / "straight" / "summary.json").read_text())
    assert summary["final_loss"] == final["final_loss"] and summary["consensus_distance"] == final["consensus_distance"]


def test_a_checkpoint_of_another_experiment_is_refused(jobs):
    [failed] = jobs["first"]["another-experiment"]
    ok(failed, 1)
    proc = jobs["second"]["another-experiment"]
    assert proc["code"] == 2
    assert proc["stderr"].strip().splitlines() == [
        f"bfexp: error: {jobs['root'] / 'another-experiment' / 'run'} has a checkpoint of another experiment: lr=0.5 "
        "(checkpoint: 0.2); optimizer.lr=0.5 (checkpoint: 0.2); allowed: the same ranks, seed, batch_size, lr, dtype, "
        "algorithm, topology, model, dataset, optimizer, "
        "engine.ranks_per_machine (steps, timeouts and logging may change)"]


def test_a_completed_run_is_not_resumed(jobs):
    [completed] = jobs["first"]["completed"]
    ok(completed)
    proc = jobs["second"]["completed"]
    ok(proc)
    assert "already completed; nothing to resume" in proc["stdout"]
    before = jobs["mtimes"]
    assert before and {p: p.stat().st_mtime_ns for p in (jobs["root"] / "completed" / "run").rglob("*")} == before


# ---------------------------------------------------------------- every algorithm's state


def threads_algorithms() -> list[str]:
    """Every algorithm option that runs on virtual ranks (ddp needs a process per rank)."""
    from omegaconf import OmegaConf

    from bfexp.comm.threads import ThreadsEngine
    from bfexp.config import ConfigError, target_of

    out = []
    for option in group_options("algorithm"):
        try:
            target_of(OmegaConf.load(REPO / "conf" / "algorithm" / f"{option}.yaml"), "algorithm").check_run(
                ThreadsEngine, throughput_only=False, modeled=False)
        except ConfigError:
            continue
        out.append(option)
    return out


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from bfexp.config import register_configs

    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


# The compressors that draw random numbers: their generators resume where they stopped.
RANDOM_COMPRESSORS = ["choco_sgd algorithm.compressor=random_k", "compressed_allreduce algorithm.compressor=qsgd"]


@pytest.mark.parametrize("option", threads_algorithms() + RANDOM_COMPRESSORS)
def test_every_algorithm_resumes_bit_for_bit(tmp_path, monkeypatch, option):
    """Momentum, a dynamic graph where the rule allows one (its position is the iteration), 4 ranks;
    a checkpoint at step 6, a rank failing at step 8, the rest from the checkpoint: the same as straight."""
    from omegaconf import OmegaConf

    from bfexp.config import target_of
    from bfexp.launch import launch

    monkeypatch.setenv("BFEXP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    option, *options = option.split()
    static = target_of(OmegaConf.load(REPO / "conf" / "algorithm" / f"{option}.yaml"), "algorithm").requires.static
    job = [f"algorithm={option}", *options, "engine=threads", "ranks=4", "steps=12", "log_every=3", "checkpoint_every=6",
           "optimizer.momentum=0.9", f"topology={'exp2' if static else 'one_peer_exp2'}", *CHEAP]
    config = compose(job)  # every run's: the failing one's differs in its fault-injection keys only
    failing = copy.deepcopy(config)
    failing.fail_rank, failing.fail_step = 2, 8
    assert launch(copy.deepcopy(config), tmp_path / "straight").status == "completed"
    failed = launch(failing, tmp_path / "resumed")
    assert failed.status == "failed" and failed.summary["checkpoint_step"] == 6
    resumed = launch(copy.deepcopy(config), tmp_path / "resumed")
    assert (resumed.status, resumed.summary["resumed_from_step"]) == ("completed", 6)
    assert_same_training(tmp_path / "straight", tmp_path / "resumed", 12)


# ---------------------------------------------------------------- preemption

PREEMPTED_STEPS = 1000  # seconds of training on 3 virtual ranks: the signal, sent at the first record, lands midway


def test_a_preempted_run_writes_a_checkpoint_and_its_resume_command_finishes_it(tmp_path):
    """SIGUSR1 (Slurm's warning before a time limit): the ranks stop at the next logging step,
    write a checkpoint there, the job ends interrupted; the printed command finishes it."""
    run = tmp_path / "run"
    proc = subprocess.Popen(BFEXP + ["engine=threads", "ranks=3", f"steps={PREEMPTED_STEPS}", "log_every=5", *CHEAP,
                                     f"hydra.run.dir={run}"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, err
    summary = json.loads((run / "summary.json").read_text())
    step = summary["checkpoint_step"]
    assert summary["status"] == "interrupted" and f"checkpoint at step {step}" in summary["error"]
    assert 0 < step < PREEMPTED_STEPS and step % 5 == 0
    assert f"resume with: {summary['resume_command']}" in err
    command = summary["resume_command"].split()
    assert command[0] == "bfexp"
    finished = run_bfexp(command[1:], tmp_path, timeout=300)
    assert finished.returncode == 0, finished.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["resumed_from_step"], summary["steps"]) == ("completed", step, PREEMPTED_STEPS)
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(5, PREEMPTED_STEPS + 1, 5)), "each logged step once, in order"


# ---------------------------------------------------------------- sweeps


def job_folders(sweep: Path) -> list[Path]:
    return sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_a_sweep_killed_after_3_of_6_jobs_reruns_only_the_rest(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "engine=threads", "ranks=2", "steps=60", "log_every=20", "seed=0,1,2,3,4,5", *CHEAP,
            f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, BFEXP_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(BFEXP + args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def completed() -> list[Path]:
        done = []
        for folder in job_folders(sweep) if sweep.exists() else []:
            summary = folder / "summary.json"
            if summary.exists() and json.loads(summary.read_text())["status"] == "completed":
                done.append(folder)
        return done

    try:
        deadline = time.monotonic() + 300
        while len(completed()) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no goodbye: the driver is gone mid-sweep
        proc.wait(timeout=30)
    finally:
        proc.kill()
    finished = completed()
    assert 3 <= len(finished) < 6, [p.name for p in job_folders(sweep)]
    untouched = {p: p.stat().st_mtime_ns for folder in finished for p in [folder, *folder.rglob("*")]}

    again = run_bfexp([f"resume={sweep}"], tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr
    for folder in finished:
        assert f"job {folder.name} already completed in {folder}: skipped" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in untouched} == untouched, "a finished job's folder was touched"
    folders = job_folders(sweep)
    assert len(folders) == 6 and not (sweep / ".skipped").exists()
    assert all(json.loads((f / "summary.json").read_text())["status"] == "completed" for f in folders)
    rows = (sweep / "report.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 6, rows


def test_a_failing_job_is_announced_at_once_and_fail_fast_stops_the_sweep(jobs):
    cwd = jobs["root"] / "fail-fast"
    proc, fast = jobs["first"]["fail-fast"]
    ok(proc, 1)
    assert re.search(r"^bfexp: job 0_\S*fail_rank=0\S* failed: rank 0: RuntimeError: injected failure", proc["stderr"],
                     re.M)
    first, second = job_folders(cwd / "on")
    assert json.loads((second / "summary.json").read_text())["status"] == "completed"

    ok(fast, 1)
    assert "fail_fast=true: the sweep's remaining jobs are not run" in fast["stderr"]
    assert [p.name for p in job_folders(cwd / "fast")] == [first.name], "fail_fast is not part of a job's key"
