"""The bandwidth study, small, on the emulated cluster (scripts/cluster_local.sh up --hosts 3; .ci/run runs this
after the multi-host and Slurm tests, since its jobs reshape the hosts' links and quotas): launcher=emulated and
scaling=emulated composed and run, every job's measured step time against the cost model's price of the same job
on the same links and quota, the same for the time each job took to reach a target accuracy, and a 1-host job's
efficiency. Elsewhere these skip, saying why.

The bounds are the ones the cost model is held to (recipes/bandwidth_study/README.md): measured/modeled within
15% at the median, no point beyond 30%.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bfexp.launchers.emulated import STATE

HOSTS = 3
TARGET = 0.6


def missing() -> str | None:
    if os.geteuid() != 0:
        return "the emulated cluster needs root"
    try:
        hosts = (STATE / "hosts").read_text().split()
    except OSError:
        return "the emulated cluster is down; `scripts/cluster_local.sh up --hosts 3` (as root) brings it up"
    if len(hosts) < HOSTS:
        return f"the emulated cluster has {len(hosts)} hosts; this study needs {HOSTS}"
    return None


pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


@pytest.fixture(scope="module")
def folder() -> Path:
    """A folder every host sees (each host's /tmp is its own)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="bfexp-bandwidth-", dir="/var/tmp"))
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def bfexp(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).parent / "bfexp"), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def summaries(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


@pytest.fixture(scope="module")
def study(folder) -> list[dict]:
    """Two methods at two link rates on 3 hosts, a few steps each, held-out accuracy every 8 steps (allreduce
    reaches 0.6 at step 16, one-peer DSGD at 24)."""
    proc = bfexp(folder, "-m", "+experiment=bandwidth_study", f"ranks={HOSTS}", "steps=32", "log_every=8",
                 "eval_every=8", f"target_accuracy={TARGET}", "baseline_steps=4", "scaling.reference_steps=8",
                 "launcher.link_rate=500mbit,2gbit", "+experiment/bandwidth_study=allreduce,dsgd_one_peer_exp2",
                 "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = summaries(folder / "sweep")
    assert len(jobs) == 4
    return jobs


def test_every_job_records_where_it_ran(study):
    for job in study:
        assert job["status"] == "completed"
        cluster = job["emulated_cluster"]
        assert cluster["hosts"] == ["hostA", "hostB", "hostC"] and cluster["allreduce_algorithm"] == "ring"
        assert cluster["wait"] == "sleep"
        assert set(cluster["cpu_per_host"].values()) == {"0.4"}
        assert len(set(cluster["link_rate"].values())) == 1
        assert job["run_machines"] == HOSTS and job["contention"] is None
        assert job["time_source"] == "measured" and job["modeled"]["cluster"] == "emulated"
        # the single-rank reference's rounds ran on every host in turn, under the same quota
        assert job["reference"]["ranks"] == [0, 1, 2] and job["reference"]["rounds"] == 8


def test_measured_step_times_are_what_the_cost_model_prices(study):
    ratios = {}
    for job in study:
        rate = next(iter(job["emulated_cluster"]["link_rate"].values()))
        ratios[(job["algorithm"], rate)] = job["measured"]["step_time_s"] / job["modeled"]["step_time_s"]
    assert 0.85 <= statistics.median(ratios.values()) <= 1.15, ratios
    assert all(0.7 <= r <= 1.3 for r in ratios.values()), ratios
    # where bandwidth is scarce, one message a step beats a ring's 2(n-1)/n of one
    step = {(j["algorithm"], next(iter(j["emulated_cluster"]["link_rate"].values()))): j["step_time_s"] for j in study}
    assert step[("dsgd", "500mbit")] < step[("allreduce", "500mbit")], step


def test_time_to_accuracy_is_what_the_cost_model_prices(study, folder):
    """The report prices each job's recorded steps (operations.json) on the cluster it ran on (its measured
    compute, the links and quota, the wait for the slowest rank): the modeled time to the target accuracy
    against the measured one, the same evaluation of the same job. Issue 48 holds the model to 15% on at
    least 3 of these 4 jobs; none may be off by 30%."""
    from bfexp import report

    jobs = report.collect(folder / "sweep")
    ratios = {}
    for job in jobs:
        measured = report.time_to_target(job.records, "accuracy", TARGET, True)
        modeled = report.time_to_target(job.records, "accuracy", TARGET, True, job.modeled["emulated"])
        assert measured and modeled, (job.name, [r.get("accuracy") for r in job.records])
        ratios[job.name] = measured / modeled
    assert len(ratios) == 4
    assert sum(0.85 <= r <= 1.15 for r in ratios.values()) >= 3, ratios
    assert all(0.7 <= r <= 1.3 for r in ratios.values()), ratios
    # the report's table carries both, per job
    rows = report.build_table(jobs).rows
    assert all(r["time_to_target_accuracy_s@emulated"] and r["time_to_target_accuracy_s"] for r in rows)


def test_one_host_is_its_own_reference(folder):
    proc = bfexp(folder, "+experiment=bandwidth_study", "ranks=1", "steps=24", "log_every=8",
                 "scaling.reference_steps=8", "launcher.wait=yield", "hydra.run.dir=one")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = json.loads((folder / "one" / "summary.json").read_text())
    assert 0.9 <= job["scaling_efficiency"] <= 1.1
    assert job["emulated_cluster"]["hosts"] == ["hostA"] and job["emulated_cluster"]["wait"] == "yield"
