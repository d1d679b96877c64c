"""Issue 29, part B, beyond the one-line table of tests/test_bad_input.py: damaged files a sweep or a run
folder may hold are said for what they are, checkpoints are checked before loading, a swept path makes
one folder per job (and the sweep resumes), and a Slurm sweep without Slurm ends in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO


def _job(folder, summary: bytes | None = None, metrics: bytes | None = None):
    folder.mkdir(parents=True)
    if summary is not None:
        (folder / "summary.json").write_bytes(summary)
    if metrics is not None:
        (folder / "metrics.jsonl").write_bytes(metrics)
    return folder


def test_report_says_a_damaged_summary_or_metrics_in_the_jobs_row(tmp_path):
    """A summary of the wrong shape, a truncated one, undecodable metrics: the job's row says which file and
    how (before: a traceback, or "the job did not finish"); the sweep's other jobs are reported as they are."""
    from bfexp.report import collect

    _job(tmp_path / "0_a", b"[1, 2]")
    _job(tmp_path / "1_b", b'{"status": "completed", "step_time')
    _job(tmp_path / "2_c", b'{"status": "completed"}', b'{"step": 1}\n\xff\xfe\n')
    _job(tmp_path / "3_d", b'{"status": "completed"}', b'{"step": 1}\n{"step": 2}\n')
    jobs = {j.name: j for j in collect(tmp_path)}
    assert "summary.json holds a JSON list, not an object" in jobs["0_a"].summary["error"]
    assert "summary.json is truncated" in jobs["1_b"].summary["error"]
    assert "metrics.jsonl line 2 is not a JSON record" in jobs["2_c"].summary["error"]
    assert [r["step"] for r in jobs["2_c"].records] == [1]
    assert "error" not in jobs["3_d"].summary and len(jobs["3_d"].records) == 2


def test_report_writes_nothing_it_cannot_and_says_so_in_one_line(tmp_path, capsys):
    from bfexp.report import main

    _job(tmp_path / "job", b'{"status": "completed"}')
    (tmp_path / "afile").write_text("a file")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "job"), "--out", str(tmp_path / "afile" / "out"), "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "cannot write the report" in err[0]


def test_a_checkpoint_of_another_model_names_the_keys_and_shapes(tmp_path):
    import torch
    from torch import nn

    from bfexp.checkpoint import FORMAT
    from bfexp.checkpointer import check_state
    from bfexp.errors import ConfigError

    saved = nn.Sequential(nn.Flatten(), nn.Linear(32, 2)).state_dict()
    here = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.ReLU(), nn.Linear(10, 2))
    state = {"format": FORMAT, "rank": 0, "step": 3, "model": saved, "algorithm": {}, "sampler": {}, "loop": {}}
    with pytest.raises(ConfigError) as e:
        check_state(tmp_path / "rank0.pt", state, here, 0)
    text = str(e.value)
    assert "1.weight is (2, 32) in the checkpoint, (10, 64) here" in text and "missing 3.weight" in text
    with pytest.raises(ConfigError, match="format 2"):
        check_state(tmp_path / "rank0.pt", {**state, "format": 2}, here, 0)
    with pytest.raises(ConfigError, match="lacks model"):
        check_state(tmp_path / "rank0.pt", {k: v for k, v in state.items() if k != "model"}, here, 0)
    check_state(tmp_path / "rank0.pt", {**state, "model": here.state_dict()}, here, 0)
    assert torch.is_tensor(saved["1.weight"])


def test_a_damaged_latest_json_is_refused_not_a_restart_from_step_0(tmp_path):
    from bfexp.checkpoint import latest
    from bfexp.errors import ConfigError

    (tmp_path / "checkpoint" / "step4").mkdir(parents=True)
    for r in range(2):
        (tmp_path / "checkpoint" / "step4" / f"rank{r}.pt").write_bytes(b"x")
    manifest = {"format": 1, "step": 4, "ranks": 2, "folder": "step4", "experiment": {}}
    (tmp_path / "checkpoint" / "latest.json").write_text(json.dumps(manifest))
    assert latest(tmp_path, strict=True)["step"] == 4
    for damaged in (b'{"step": 4, "ra', b"\xff", b'{"format": 1, "step": "4"}', b"null"):
        (tmp_path / "checkpoint" / "latest.json").write_bytes(damaged)
        with pytest.raises(ConfigError, match="latest.json is damaged"):
            latest(tmp_path, strict=True)
        assert latest(tmp_path) is None  # a failed job's summary still gets written


def test_a_swept_value_with_a_slash_is_one_folder_and_the_sweep_resumes(tmp_path):
    """``topology.path=g/a.edges,g/b.edges``: one folder per job directly under the sweep folder, and
    ``resume=<sweep>`` finds both finished (before: nested folders, and resume failed on int())."""
    from bfexp.checkpoint import folder_name

    assert folder_name("topology.path=g/a.edges") == "topology.path=g%2Fa.edges"
    assert folder_name("x=../up") == "x=..%2Fup" and folder_name("x=50%") == "x=50%25"
    assert len(folder_name("x=" + "a" * 400).encode()) <= 200
    (tmp_path / "g").mkdir()
    for name in ("a", "b"):
        (tmp_path / "g" / f"{name}.edges").write_text("0 1\n1 0\n")
    script = textwrap.dedent("""
        import json, sys
        from tests.cli_in_process import call
        args = ["engine=threads", "ranks=2", "steps=2", "log_every=1", "baseline_steps=0", "report=false",
                "scaling.reference_steps=1", "scaling.reference_cache=null", "topology=file", "topology.weights=uniform"]
        first = call(["-m", "topology.path=g/a.edges,g/b.edges", "hydra.sweep.dir=sw", *args])
        again = call(["resume=sw"])
        print(json.dumps([first, again]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["code"] == 0 and first["escaped"] is None, first
    jobs = sorted(p for p in (tmp_path / "sw").iterdir() if p.is_dir())
    assert len(jobs) == 2 and all((job / "summary.json").is_file() for job in jobs), jobs
    assert "topology.path=g%2Fa.edges" in jobs[0].name and "topology.path=g%2Fb.edges" in jobs[1].name, jobs
    assert again["code"] == 0 and again["escaped"] is None, again
    assert again["stdout"].count("skipped, its folder untouched") == 2, again["stdout"]


def test_a_slurm_sweep_without_slurm_is_one_line(tmp_path):
    """No sbatch on PATH: one line naming what is missing, exit 3, no folder (before: submitit's traceback)."""
    script = textwrap.dedent("""
        import json, os
        from tests.cli_in_process import call
        os.environ["PATH"] = os.path.dirname(os.sys.executable)
        print(json.dumps(call(["-m", "hydra/launcher=slurm", "ranks=2,4", "steps=2"])))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = got["stderr"].strip().splitlines()
    assert got["code"] == 3 and got["escaped"] is None, got
    assert len(lines) == 1 and "hydra/launcher=slurm needs Slurm: no sbatch" in lines[0], got["stderr"]
    assert list(tmp_path.iterdir()) == []


def test_mpiexec_refusing_its_arguments_says_why(tmp_path):
    """A bad engine.mpiexec_args: the job's error is mpiexec's own reason from logs/mpiexec.log (before:
    only "ranks exited with code 213")."""
    script = textwrap.dedent("""
        import json
        from tests.cli_in_process import call
        print(json.dumps(call(["engine=mpi", "engine.mpiexec_args=[--bogus-flag]", "ranks=2", "steps=2",
                               "hydra.run.dir=run"])))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["code"] == 1 and got["escaped"] is None, got
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert "unrecognized option" in error and "--bogus-flag" in error, error
