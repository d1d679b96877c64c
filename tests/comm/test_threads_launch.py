"""engine=threads and engine=auto through the real CLI: the same files, statuses and failures as MPI."""

import json
import signal
import subprocess
import time

import pytest
from omegaconf import OmegaConf

from bfexp.launchers import processor_slots
from bfexp.preflight import AUTO_READS, choose_engine
from bfexp.schema import Settings
from tests.conftest import BFEXP


def summary_of(run):
    return json.loads((run / "summary.json").read_text())


def test_a_failing_rank_thread_fails_the_job_naming_the_rank(bfexp):
    proc = bfexp("engine=threads", "ranks=6", "fail_rank=3", "fail_step=5", "steps=1000000", "log_every=1",
                 "hydra.run.dir=run", timeout=120)
    assert proc.returncode == 1
    run = bfexp.cwd / "run"
    summary = summary_of(run)
    assert summary["status"] == "failed" and summary["engine"] == "threads"
    assert summary["error"].startswith("rank 3: RuntimeError: injected failure"), summary["error"]
    assert [p.name for p in (run / "errors").iterdir()] == ["rank3.json"], "the others only followed it down"


def test_sigterm_stops_every_rank_thread(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(BFEXP + ["engine=threads", "ranks=8", "steps=100000000", "log_every=1", f"hydra.run.dir={run}"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run / "metrics.jsonl").exists(), "the job never started training"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)  # the process exits: its rank threads stopped
    finally:
        proc.kill()
    assert rc == 128 + signal.SIGTERM
    summary = summary_of(run)
    assert summary["status"] == "interrupted" and summary["error"].startswith("stopped at step")


def test_auto_runs_threads_beyond_the_slots_with_the_files_of_an_mpi_job(bfexp):
    """Beyond the slots a job that cannot be stacked (stragglers: each rank its own clock) runs on threads."""
    proc = bfexp("ranks=16", "engine.slots_factor=0.001", "steps=30", "log_every=10", "heterogeneity=stragglers",
                 "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    slots = processor_slots()
    why = f"engine=auto chose threads: ranks=16 exceed {slots} processor slots x engine.slots_factor=0.001 = {slots * 0.001:g}"
    assert why in proc.stdout and "completed" in proc.stdout
    run = bfexp.cwd / "run"
    summary = summary_of(run)
    assert (summary["status"], summary["engine"], summary["ranks"], summary["steps"]) == ("completed", "threads", 16, 30)
    assert why in summary["engine_choice"]
    assert "not stacked: engine=stacked steps every rank in lock step" in summary["engine_choice"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert OmegaConf.load(run / "config.yaml").engine.name == "threads"  # what every rank read


def auto(ranks: int, factor: float, algorithm: str = "dsgd", *more: str):
    """A job's whole config under engine=auto (what it reads: the ranks, the algorithm, and for
    engine=stacked the model, data set, optimizer and options)."""
    from tests.test_threads_equivalence import compose

    return compose([f"ranks={ranks}", "engine=auto", f"engine.slots_factor={factor}", f"algorithm={algorithm}", *more])


@pytest.mark.parametrize("ranks, factor, algorithm, more, engine", [
    (2, 1000.0, "dsgd", [], "mpi"),
    (10**6, 1.0, "dsgd", [], "stacked"),  # beyond the slots, one batched program when the job allows
    (10**6, 1.0, "exact_diffusion", ["model=mlp", "dataset=digits"], "stacked"),
    (10**6, 1.0, "dsgd", ["model=cnn", "dataset=digits"], "threads"),  # convolutions: threads are as fast
    (10**6, 1.0, "gossip", [], "threads"),  # asynchronous: no batched order
    (10**6, 1.0, "dsgd", ["heterogeneity=stragglers"], "threads"),  # each rank its own clock
    (10**6, 1.0, "dsgd", ["model=resnet50", "dataset=digits"], "threads"),  # batch norm
    (10**6, 1.0, "ddp", [], "mpi"),  # torch.distributed needs a process per rank
])
def test_auto_choice(ranks, factor, algorithm, more, engine):
    job = auto(ranks, factor, algorithm, *more)
    chosen, why = choose_engine(job.engine, Settings.of(job), **{k: job.get(k) for k in AUTO_READS})
    assert chosen == engine, why
    assert f"ranks={ranks}" in why and f"engine.slots_factor={factor:g}" in why
    assert ("not stacked:" in why) == (engine == "threads")


def test_a_bad_slots_factor_is_refused_before_any_rank_starts(bfexp):
    proc = bfexp("engine.slots_factor=0", "hydra.run.dir=run")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "bfexp: error: engine.slots_factor=0.0; allowed: a number > 0"
    assert not (bfexp.cwd / "run" / "summary.json").exists()
