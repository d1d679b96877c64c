"""Overrides on both sides of Hydra's flags, through the CLI and the installed command.

Hydra 1.3's command line is argparse with the overrides as one positional that ends at the first
flag, so `bfexp algorithm=exact_diffusion topology=exp2 -m ranks=8,32,128` (the README's first
line) was refused ("unrecognized arguments: ranks=8,32,128"; Hydra issue #3053). bfexp puts the
overrides first and the flags after them (`cli.hydra_argument_order`) before Hydra parses.

Beside the documentation's lines (tests/test_docs_commands.py), the orders of Hydra #3053 run through the CLI's own entry
(`bfexp.cli.command`) in ONE interpreter with the job function replaced by one that records each
composed job: Hydra parses the line, composes every job of a sweep (the Slurm launcher's jobs too,
launched here instead of submitted), and nothing runs. (`--cfg job` cannot check a sweep: Hydra
refuses `-m` with `--cfg`.) The headline sweep also runs for real, with tiny settings, through the
installed `bfexp`, and the results page's `bfexp-report` lines run on its folder.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bfexp.cli import hydra_argument_order
from tests.conftest import REPO

BIN = Path(sys.executable).parent  # the venv's bin/: the installed console scripts
HEADLINE = "bfexp algorithm=exact_diffusion topology=exp2 -m ranks=8,32,128"

# A data set, a launcher, a compressor and an engine of the user's own, as README's
# `bfexp --config-dir myconf dataset=blobs`, `... launcher=pbs engine=mpi`, `... +algorithm/compressor=strided`
# and `... engine=noting_mpi` name them.
FILES = {"myconf/dataset/blobs.yaml": "_target_: mylab.Blobs\ncenters: 3\n",
         "myconf/launcher/pbs.yaml": "_target_: mysite.launch.Pbs\nqueue: batch\n",
         "myconf/algorithm/compressor/strided.yaml": "_target_: mylab.Strided\nstride: 2\n",
         "myconf/engine/noting_mpi.yaml": "defaults:\n  - mpi\n  - _self_\n_target_: mylab.NotingMPI\nnote: engine\n"}


def installed(command: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """The console script `command` of this venv, as a user runs it."""
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    return subprocess.run([str(BIN / command), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


# --- the reordering itself ---------------------------------------------------------------------

ORDER_CASES = [
    (["algorithm=exact_diffusion", "topology=exp2", "-m", "ranks=8,32,128"],
     ["algorithm=exact_diffusion", "topology=exp2", "ranks=8,32,128", "-m"]),
    (["seed=1", "--cfg", "job", "steps=2"], ["seed=1", "steps=2", "--cfg", "job"]),
    (["seed=1", "-m", "steps=1,2", "lr=0.3"], ["seed=1", "steps=1,2", "lr=0.3", "-m"]),
    (["--multirun", "steps=1,2", "seed=1"], ["steps=1,2", "seed=1", "--multirun"]),
    (["steps=1,2", "-m"], ["steps=1,2", "-m"]),
    (["-c", "job", "seed=1"], ["seed=1", "-c", "job"]),
    (["-cjob", "seed=1"], ["seed=1", "-cjob"]),
    (["--cfg=hydra", "seed=1", "--resolve", "steps=2"], ["seed=1", "steps=2", "--cfg=hydra", "--resolve"]),
    (["--config-dir=my/conf", "dataset=blobs", "-m", "seed=1,2"],
     ["dataset=blobs", "seed=1,2", "--config-dir=my/conf", "-m"]),
    (["--config-dir", "conf=v2", "dataset=blobs"], ["dataset=blobs", "--config-dir", "conf=v2"]),
    (["--config-dir=a=b", "seed=1"], ["seed=1", "--config-dir=a=b"]),
    (["-cd", "myconf", "dataset=blobs", "-m", "seed=1,2"], ["dataset=blobs", "seed=1,2", "-cd", "myconf", "-m"]),
    (["-cn", "other", "-cp", "pkg://x", "a=1"], ["a=1", "-cn", "other", "-cp", "pkg://x"]),
    (["a=1", "-p", "algorithm", "--cfg", "job", "b=2"], ["a=1", "b=2", "-p", "algorithm", "--cfg", "job"]),
    (["--info", "a=1"], ["a=1", "--info"]),
    (["a=1", "--info", "defaults", "b=2"], ["a=1", "b=2", "--info", "defaults"]),
    (["-i", "searchpath", "a=1"], ["a=1", "-i", "searchpath"]),
    (["--info=config", "a=1"], ["a=1", "--info=config"]),
    (["--shell-completion", "install=bash"], ["install=bash", "--shell-completion"]),
    (["-sc", "query=bash", "a=1"], ["query=bash", "a=1", "-sc"]),
    (["--hydra-help"], ["--hydra-help"]),
    (["--multi", "a=1,2"], ["a=1,2", "--multi"]),  # argparse takes an unambiguous prefix
    (["a=1", "--bogus", "b=2"], ["a=1", "b=2", "--bogus"]),
    (["a=1", "--", "b=2"], ["a=1", "b=2"]),
    (["+experiment=comm_efficient", "-m", "~topology.graph.radius", "++seed=2"],
     ["+experiment=comm_efficient", "~topology.graph.radius", "++seed=2", "-m"]),
    ([], []),
]


@pytest.mark.parametrize("args, expected", ORDER_CASES, ids=[" ".join(a) or "empty" for a, _ in ORDER_CASES])
def test_hydra_argument_order(args, expected):
    from hydra._internal.utils import get_args_parser

    ordered = hydra_argument_order(args)
    assert ordered == expected
    assert hydra_argument_order(ordered) == ordered  # already in Hydra's order: unchanged
    if "--bogus" not in args:  # Hydra's parser reads every override: those before the first flag
        first_flag = next((n for n, t in enumerate(expected) if t.startswith("-")), len(expected))
        assert get_args_parser().parse_args(ordered).overrides == expected[:first_flag]


# --- the real command, in a subprocess ---------------------------------------------------------


@pytest.fixture(scope="module")
def headline_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's first line, for real with tiny settings (engine=threads, 5 steps, ranks 2 and 4):
    overrides on both sides of -m, through the installed `bfexp`, into the folder README's
    bfexp-report line names."""
    cwd = tmp_path_factory.mktemp("headline")
    proc = installed("bfexp", "algorithm=exact_diffusion", "topology=exp2", "engine=threads", "-m", "ranks=2,4",
                     "steps=5", "report=false", "hydra.sweep.dir=multirun/2026-01-01/12-00-00", cwd=cwd)
    return cwd, proc


def test_headline_sweep_runs_both_jobs(headline_sweep):
    cwd, proc = headline_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = cwd / "multirun/2026-01-01/12-00-00"
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split("_")[0] for p in jobs] == ["0", "1"]
    summaries = [json.loads((p / "summary.json").read_text()) for p in jobs]
    assert [s["status"] for s in summaries] == ["completed", "completed"]
    assert [s["ranks"] for s in summaries] == [2, 4]
    assert {s["algorithm"] for s in summaries} == {"exact_diffusion"} and {s["topology"] for s in summaries} == {"exp2"}


@pytest.mark.parametrize("args", [
    ["seed=1", "-m", "steps=1,2", "lr=0.3", "--cfg", "job"],
    shlex.split(HEADLINE)[1:] + ["--cfg", "job"],
])
def test_sweep_with_cfg_job_is_hydras_one_line_refusal(bfexp, args):
    """Hydra 1.3 refuses -m with --cfg (its own check, after parsing): one line, exit 2, not a traceback
    and not "unrecognized arguments"."""
    proc = bfexp(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == ("bfexp: error: Only one of --run, --multirun, --cfg, --info and --shell_completion "
                        "can be specified")


@pytest.mark.parametrize("args", [
    ["seed=1", "--cfg", "job", "steps=2"],
    ["--cfg", "job", "seed=1", "steps=2"],
    ["seed=1", "steps=2", "--cfg", "job"],
    ["seed=1", "-c", "job", "steps=2"],
    ["seed=1", "--cfg=job", "steps=2"],
])
def test_overrides_on_both_sides_of_cfg_job(bfexp, args):
    proc = bfexp(*args)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^seed: 1$", proc.stdout, re.M) and re.search(r"^steps: 2$", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("args", [
    ["-cd", "myconf", "dataset=blobs", "--cfg", "job", "seed=3"],
    ["dataset=blobs", "--config-dir", "myconf", "seed=3", "--cfg", "job"],
    ["dataset=blobs", "--config-dir=myconf", "--cfg", "job", "seed=3"],
])
def test_config_dir_among_overrides(bfexp, args):
    for path, text in FILES.items():
        (bfexp.cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (bfexp.cwd / path).write_text(text)
    proc = bfexp(*args)
    assert proc.returncode == 0, proc.stderr
    assert "_target_: mylab.Blobs" in proc.stdout and re.search(r"^seed: 3$", proc.stdout, re.M), proc.stdout


def test_info_defaults_with_overrides_on_both_sides(bfexp):
    proc = bfexp("algorithm=allreduce", "--info", "defaults", "topology=ring")
    assert proc.returncode == 0, proc.stderr
    assert "algorithm/allreduce" in proc.stdout and "topology/ring" in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, named", [
    (["--bogus"], "unrecognized arguments: --bogus;"),
    (["seed=1", "--bogus", "steps=2"], "unrecognized arguments: --bogus;"),
    (["seed=1", "--cfg", "nope"], "argument --cfg/-c: invalid choice: 'nope'"),
    (["seed=1", "--config"], "ambiguous option: --config could match"),
])
def test_bad_flag_is_one_line_exit_2(bfexp, args, named):
    proc = bfexp(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("bfexp: error: ") and named in lines[0], lines[0]
    assert not (bfexp.cwd / "outputs").exists()


def test_shell_completion_install_bash_as_before(bfexp):
    """`bfexp --shell-completion install=bash` (README): install=bash is the value of Hydra's query, an override."""
    outputs = [bfexp(*args) for args in (["--shell-completion", "install=bash"], ["install=bash", "-sc"])]
    for proc in outputs:
        assert proc.returncode == 0, proc.stderr
        assert "hydra_bash_completion()" in proc.stdout and "complete -o nospace" in proc.stdout
    assert outputs[0].stdout == outputs[1].stdout


def test_hydra_help(bfexp):
    proc = bfexp("--hydra-help")
    assert proc.returncode == 0 and "--multirun" in proc.stdout, proc.stderr


# --- bfexp-report: options on both sides of the folder -----------------------------------------


def readme_report_lines() -> list[str]:
    """The `bfexp-report` lines of the results page (docs/getting-started/results.md)."""
    page = REPO / "docs" / "getting-started" / "results.md"
    return [line.split("#")[0].strip() for line in page.read_text().splitlines()
            if re.match(r"\s+(\.venv/bin/)?bfexp-report ", line)]


def test_bfexp_report_readme_lines_and_options_on_both_sides(headline_sweep):
    cwd, proc = headline_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = "multirun/2026-01-01/12-00-00"
    run = sorted(p for p in (cwd / sweep).iterdir() if p.is_dir())[0]
    shutil.copytree(run, cwd / "outputs/2026-01-01/12-00-00")  # README's second line reads outputs/
    lines = readme_report_lines()
    assert len(lines) == 3 and sweep in lines[0] and "--out my_report" in lines[1], lines
    assert sweep in lines[2] and "--cluster h100_cluster,ethernet_10g" in lines[2], lines
    for line in lines:  # as the README writes them (with plots)
        report = installed("bfexp-report", *shlex.split(line)[1:], cwd=cwd)
        assert report.returncode == 0, (line, report.stderr)
    assert (cwd / sweep / "report.csv").is_file() and (cwd / "my_report/report.csv").is_file()
    # the last line priced every job of the headline sweep on both clusters (scaling=local's jobs: their
    # steps from operations.json, a rank's compute from the clusters' device figures)
    with open(cwd / sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        assert float(row["modeled_train_time_s@h100_cluster"]) < float(row["modeled_train_time_s@ethernet_10g"]), row
    assert (cwd / sweep / "modeled_h100_cluster.png").is_file()
    for n, args in enumerate([["--out", "r0", "--no-plots", sweep], ["--no-plots", sweep, "--out", "r1"],
                              [sweep, "--no-plots", "--out=r2"]]):
        report = installed("bfexp-report", *args, cwd=cwd)
        assert report.returncode == 0, (args, report.stderr)
        assert (cwd / f"r{n}" / "report.csv").is_file() and not list((cwd / f"r{n}").glob("*.png"))


# --- command lines beside the documentation's (tests/test_docs_commands.py has those) ------------

# The orders of the Hydra #3053 report, and resume= before a flag.
EXTRA = {
    "both-sides-of-m": ("bfexp seed=1 -m steps=1,2 lr=0.3", {}),
    "m-last": ("bfexp seed=1 steps=1,2 -m", {}),
    "multirun-first": ("bfexp --multirun seed=1 steps=1,2", {}),
    "resume-sweep-with-a-flag": ("bfexp resume=sweep seed=3 -cd myconf dataset=blobs", {
        "sweep/multirun.yaml": "hydra:\n  overrides:\n    hydra: []\n    task: ['ranks=2,4']\n  runtime:\n"
                               "    config_sources:\n    - {path: bfexp.conf, schema: pkg, provider: main}\n"}),
}

DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from tests.cli_in_process import call, compose_only

    jobs = compose_only()
    out = {}
    for case in json.loads(sys.argv[1]):
        folder = Path(case["folder"])
        for path, text in case["files"].items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
        os.chdir(folder)
        start = time.perf_counter()
        jobs.clear()
        got = call(case["args"])
        out[case["id"]] = {**got, "stdout": got["stdout"][:20000], "jobs": list(jobs),
                           "seconds": time.perf_counter() - start}
    print(json.dumps(out, default=str))
""")


@pytest.fixture(scope="module")
def composed(tmp_path_factory) -> dict:
    """Every EXTRA case through `bfexp.cli.command` in one interpreter, each in a fresh folder:
    {id: exit code, stderr, stdout, escaped traceback, jobs}."""
    root = tmp_path_factory.mktemp("orders")
    cases = [(cid, command, {**FILES, **files}) for cid, (command, files) in EXTRA.items()]
    payload = [{"id": cid, "args": shlex.split(command)[1:], "folder": str(root / f"case{n}"), "files": files}
               for n, (cid, command, files) in enumerate(cases)]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(payload)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])




def check_composed(got: dict, args: list[str]) -> None:
    assert got["escaped"] is None, got["escaped"]
    assert "unrecognized arguments" not in got["stderr"] and "usage:" not in got["stderr"], got["stderr"]
    assert got["code"] in (0, None), got["stderr"]
    overrides = [t for t in args if "=" in t and not t.startswith("-") or t.startswith("~")]
    task = [o for o in overrides if not o.startswith("hydra")]  # hydra/launcher=..., hydra.x=...: Hydra's own
    if any(a in ("-m", "--multirun") for a in args):
        assert got["jobs"] and {j["mode"] for j in got["jobs"]} == {"MULTIRUN"}, got
        fixed = [o for o in overrides if "," not in re.sub(r"\[[^]]*\]", "", o)]
        for job in got["jobs"]:
            assert set(fixed) <= set(job["task"] + job["hydra"]), (fixed, job["task"], job["hydra"])
        sweeps = [o for o in overrides if o not in fixed]
        assert len(got["jobs"]) >= (2 if sweeps else 1)
    elif any(a in ("--help", "--cfg", "--shell-completion") for a in args):
        assert got["jobs"] == [] and got["stdout"].strip(), got
    else:
        assert [j["mode"] for j in got["jobs"]] == ["RUN"], got
        assert got["jobs"][0]["task"] == task






@pytest.mark.parametrize("cid", ["both-sides-of-m", "m-last", "multirun-first"])
def test_overrides_on_both_sides_of_m_compose(composed, cid):
    got = composed[cid]
    check_composed(got, shlex.split(EXTRA[cid][0])[1:])
    assert [j["config"]["steps"] for j in got["jobs"]] == [1, 2]
    assert {j["config"]["seed"] for j in got["jobs"]} == {1}
    if cid == "both-sides-of-m":
        assert {j["config"]["lr"] for j in got["jobs"]} == {0.3}


def test_resume_sweep_with_a_flag_among_overrides(composed):
    """resume=DIR puts `-m` and the saved overrides around the given ones; a flag among those must
    still reach Hydra after all of them."""
    got = composed["resume-sweep-with-a-flag"]
    assert got["escaped"] is None and got["code"] in (0, None), got["stderr"]
    assert [j["config"]["ranks"] for j in got["jobs"]] == [2, 4]
    assert all(j["config"]["seed"] == 3 and j["choices"]["dataset"] == "blobs" for j in got["jobs"])
    assert {j["sweep_dir"] for j in got["jobs"]} == {"sweep"}
