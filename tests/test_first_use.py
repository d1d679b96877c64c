"""What a new user meets first (issue 44): a slip gets one line that says what to type instead."""

from __future__ import annotations

import pytest

from tests.conftest import run_bfexp


@pytest.mark.parametrize("override, said", [
    ("stpes=3", "unknown key 'stpes' (did you mean 'steps'?)"),
    ("topolgy=ring", "unknown key 'topolgy' (did you mean 'topology'?)"),
    ("algorithm.styl=awc", "unknown key 'algorithm.styl' (did you mean 'style'?)"),
    ("optimizer.momentun=0.9", "unknown key 'optimizer.momentun' (did you mean 'momentum'?)"),
    ("zzz=1", "unknown key 'zzz'; "),
    ("experiment=bandwidth_study", "allowed: +experiment=NAME, NAME one of async_stragglers, bandwidth_study"),
])
def test_a_slip_is_answered_with_what_to_type(tmp_path, override, said):
    proc = run_bfexp([override], tmp_path, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert said in lines[0], lines[0]
    if "did you mean" not in said:
        assert "did you mean" not in lines[0]


def test_a_sweep_with_an_invalid_point_names_skip_invalid(tmp_path):
    """Without skip_invalid the whole sweep is refused, before any job runs, and the refusal names the option."""
    proc = run_bfexp(["-m", "algorithm=dsgd,exact_diffusion", "topology=one_peer_exp2", "steps=2",
                      "hydra.sweep.dir=sweep"], tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "sweep point algorithm=exact_diffusion" in lines[0] and "skip_invalid=true" in lines[0]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.large  # a sweep of three jobs: .ci/run's larger lane
def test_skip_invalid_runs_the_valid_points_and_reports_the_refused(tmp_path):
    """-m algorithm=dsgd,exact_diffusion topology=exp2,one_peer_exp2 skip_invalid=true: three jobs run (exact
    diffusion on exp2 runs on its undirected form), exact diffusion on the time-varying graph is refused with
    its reason: no folder of its own, listed in refused.json, report.md and on the terminal; exit 0."""
    import json

    proc = run_bfexp(["-m", "algorithm=dsgd,exact_diffusion", "topology=exp2,one_peer_exp2", "skip_invalid=true",
                      "engine=threads", "steps=3", "baseline_steps=0", "logger=jsonl", "hydra.sweep.dir=sweep"],
                     tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 3 and not any("exact_diffusion" in j and "one_peer" in j for j in jobs), jobs
    statuses = [json.loads((sweep / j / "summary.json").read_text())["status"] for j in jobs]
    assert statuses == ["completed"] * 3
    refused = json.loads((sweep / "refused.json").read_text())["refused"]
    assert [sorted(r["overrides"]) for r in refused] == [["algorithm=exact_diffusion", "topology=one_peer_exp2"]]
    assert "needs a static topology" in refused[0]["reason"]
    report = (sweep / "report.md").read_text()
    assert "## Refused points" in report and "`algorithm=exact_diffusion topology=one_peer_exp2`: " in report
    assert "refused, skipped (skip_invalid=true)" in proc.stderr
    assert "refused, not run (skip_invalid=true): algorithm=exact_diffusion topology=one_peer_exp2" in proc.stdout


def test_skip_invalid_with_every_point_refused_refuses_the_sweep(tmp_path):
    proc = run_bfexp(["-m", "lr=-1,-2", "skip_invalid=true", "steps=2", "hydra.sweep.dir=sweep"], tmp_path,
                     timeout=120)
    assert proc.returncode == 2 and "lr=-2" in proc.stderr and "(sweep point lr=-2)" in proc.stderr, proc.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.large  # a sweep of three jobs: .ci/run's larger lane
def test_a_sweep_says_each_job_in_one_line_and_its_table_at_the_end(tmp_path):
    """-m over three points: `job k/3 <status>: ...; about N s left; results: DIR` after each job, no per-job
    table (its 17 rows scrolled the sweep away), the sweep's table once, at the end."""
    import re

    proc = run_bfexp(["-m", "lr=0.1,0.2,0.3", "engine=threads", "steps=3", "baseline_steps=0", "logger=jsonl",
                      "hydra.sweep.dir=sweep"], tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("job ")]
    assert [l.split(" ")[1] for l in lines] == ["1/3", "2/3", "3/3"], proc.stdout[-3000:]
    assert all(" completed: dsgd on exp2, 4 ranks (threads): loss " in l for l in lines)
    assert all(re.search(r"; about \d+ s left; results: ", l) for l in lines[:2]) and "left" not in lines[2]
    assert "step time (s, median)" not in proc.stdout  # the job table's row
    assert proc.stdout.count("sweep: 3 jobs") == 1
