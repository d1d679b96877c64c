"""Adding an engine is a class and a YAML (issue 47).

The user's engines live outside bfexp/ (tests/user_engine/counting.py, on the user's PYTHONPATH, and
a YAML in their own config dir): CountingMPI and CountingThreads, the MPI and threads engines under
names of their own that count the allreduce calls they serve. Nothing in bfexp names them, yet they
carry a real job through `bfexp` (their YAML's or an override's `_target_`), a user's script through
`bfexp-run --engine mylab.Class`, and the library (`bf.init(engine=...)`, `bf.spawn(..., engine=...)`).
The references are the user's own: the names their classes give, the calls their script makes, the
sum 1 + 2 + ... + n.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bfexp as bf
from bfexp import api
from bfexp.errors import ConfigError
from tests.cli_in_process import ran

USER = Path(__file__).parent / "user_engine"
SCRIPT = USER / "allreduce_script.py"
JOB = ["ranks=2", "steps=6", "log_every=3", "baseline_steps=0", "scaling.reference_cache=null", "report=false",
       "hydra.run.dir=run"]


def user_env() -> dict[str, str]:
    """The user's environment: their module importable (their package, as pip would make it), no debug output."""
    env = {k: v for k, v in os.environ.items() if k not in ("BFEXP_DEBUG", api.ENGINE_VARIABLE)}
    env["PYTHONPATH"] = os.pathsep.join([str(USER), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=300)


def notes(folder: Path, ranks: int) -> list[list[str]]:
    """What each rank's engine left when it closed: its class, its rank, its allreduce calls."""
    return [(folder / f"counted.rank{r}").read_text().split() for r in range(ranks)]


JOBS = [
    # the user's YAML in their own config dir: engine=<their option>
    ("counting_mpi", ["--config-dir", str(USER / "conf"), "engine=counting_mpi"], "CountingMPI"),
    # no YAML of theirs: a shipped option's node with their class as its _target_ (and its name)
    ("counting_threads", ["engine=threads", "engine._target_=counting.CountingThreads", "engine.name=counting_threads",
                          "ranks=3"], "CountingThreads"),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """The bfexp command lines of this file, one after another in one interpreter with the user's environment
    (tests/cli_in_process.py), each in its own folder: {id: exit code, output, summaries, "cwd": its folder}.
    The user's MPI engine carries real MPI ranks."""
    from tests.cli_in_process import calls

    root = tmp_path_factory.mktemp("user_engine")
    cases = [{"id": engine, "args": [*JOB, *args]} for engine, args, _ in JOBS]
    cases.append({"id": "bad_option", "args": [*JOB, "--config-dir", str(USER / "conf"), "engine=counting_mpi",
                                               "+engine.notes=x"]})
    for case in cases:
        case["folder"] = str(root / case["id"])
    got = calls(cases, timeout=600, env=user_env())
    return {case["id"]: {**got[case["id"]], "cwd": Path(case["folder"])} for case in cases}


@pytest.mark.parametrize("engine, args, cls", JOBS)
def test_user_engine_runs_a_bfexp_job(jobs, engine, args, cls):
    got = jobs[engine]
    ran(got)
    summary = got["summaries"]["run/summary.json"]
    ranks = 3 if "ranks=3" in args else 2
    assert (summary["status"], summary["engine"], summary["ranks"]) == ("completed", engine, ranks)
    left = notes(got["cwd"], ranks)  # every rank ran on the user's class
    assert [(c, int(r)) for c, r, _ in left] == [(cls, r) for r in range(ranks)]
    assert len({calls for _, _, calls in left}) == 1  # collectives: every rank made the same calls


def test_user_engine_options_are_checked_against_its_class(jobs):
    """The user's constructor is the option's schema: a key it lacks is refused before any rank starts."""
    got = jobs["bad_option"]
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"][-3000:]
    [line] = got["stderr"].strip().splitlines()
    assert "engine.notes" in line and "note" in line, line
    assert not (got["cwd"] / "run" / "summary.json").exists()


def script_lines(stdout: str) -> dict[int, dict]:
    """Each rank's JSON line (bfexp-run tags lines with [rank N])."""
    out = {}
    for line in stdout.splitlines():
        if "{" in line:
            record = json.loads(line[line.index("{"):])
            out[record["rank"]] = record
    return out


@pytest.mark.parametrize("engine, ranks, cls, init", [
    ("counting.CountingMPI", 2, "CountingMPI", []),  # MPI ranks: each rank's bf.init() starts the user's class
    ("counting.CountingThreads", 3, "CountingThreads", []),  # virtual ranks in bfexp-run's process
    ("mpi", 2, "CountingMPI", ["--init", "counting.CountingMPI"]),  # the script asks bf.init(engine=...) itself
])
def test_user_engine_runs_a_script_under_bfexp_run(tmp_path, engine, ranks, cls, init):
    proc = run([sys.executable, "-m", "bfexp.run", "-n", str(ranks), "--engine", engine, "python", str(SCRIPT),
                *init], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    seen = script_lines(proc.stdout)
    name = {"CountingMPI": "counting_mpi", "CountingThreads": "counting_threads"}[cls]
    expected = {"size": ranks, "class": cls, "name": name, "total": ranks * (ranks + 1) / 2, "calls": 3}
    assert seen == {r: {"rank": r, **expected} for r in range(ranks)}


def test_bfexp_run_refuses_what_is_no_engine_of_a_script(tmp_path):
    for engine, words in (("counting.Nothing", ["--engine counting.Nothing", "cannot be imported"]),
                          ("nosuch", ["--engine nosuch; allowed:", "mpi", "threads"]),
                          ("stacked", ["--engine stacked", "not a script"])):
        proc = run([sys.executable, "-m", "bfexp.run", "-n", "2", "--engine", engine, "python", str(SCRIPT)], tmp_path)
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert all(w in line for w in words), line


def test_user_engine_through_the_library(tmp_path, monkeypatch):
    """bf.init(engine=<class path>) alone is one rank of the user's class; bf.spawn(engine=...) runs every
    virtual rank on it; asking again for another engine is refused, naming the one running."""
    monkeypatch.syspath_prepend(str(USER))
    monkeypatch.chdir(tmp_path)
    api.shutdown()
    try:
        engine = bf.init(engine="counting.CountingThreads")
        assert (type(engine).__name__, engine.name, bf.size()) == ("CountingThreads", "counting_threads", 1)
        assert bf.init(engine="counting_threads") is engine  # by its own name, too
        assert torch.equal(bf.allreduce(torch.tensor([2.0, 3.0]), op="sum"), torch.tensor([2.0, 3.0]))
        assert engine.allreduce_calls == 1
        from bfexp import bluefog  # BlueFog's layer asks the engine's facts: in memory, on CPU

        bluefog.init()
        assert (bluefog.nccl_built(), bluefog.mpi_threads_supported()) == (False, True)
        with pytest.raises(ConfigError, match=r"bf.init\(engine='threads'\) but this rank runs engine=counting_threads"):
            bf.init(engine="threads")
    finally:
        api.shutdown()

    def job():
        total = bf.allreduce(torch.tensor([float(bf.rank() + 1)]), op="sum")
        return type(bf.engine()).__name__, float(total), bf.engine().allreduce_calls

    assert bf.spawn(job, 4, engine="counting.CountingThreads") == [("CountingThreads", 10.0, 1)] * 4


def test_the_driver_reads_a_user_engine_from_its_source_without_torch(tmp_path):
    """Before torch (it starts process ranks while torch loads) the driver knows the user's engine from the
    class's source: what the classes (theirs and bfexp's bases) say once imported, torch still not imported."""
    code = ("import dataclasses, json, sys\n"
            "from bfexp.comm import engine_facts\n"
            "facts = [dataclasses.astuple(engine_facts(p)) for p in ('counting.CountingMPI', 'counting.CountingThreads')]\n"
            "print(json.dumps([facts, 'torch' in sys.modules]))\n")
    proc = run([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    facts, torch_imported = json.loads(proc.stdout)
    sys.path.insert(0, str(USER))
    try:
        import counting
    finally:
        sys.path.remove(str(USER))
    assert facts == [[c.name, c.virtual, c.processes, c.device_type, c.stacked]
                     for c in (counting.CountingMPI, counting.CountingThreads)]
    assert facts == [["counting_mpi", False, True, "cpu", False], ["counting_threads", True, False, "cpu", False]]
    assert not torch_imported


def test_nothing_outside_the_engines_tests_an_engine_by_its_name():
    """No `engine.name == "mpi"` outside bfexp/comm: what an engine is, its class says (a user's engine has a
    name of its own), as launchers are dispatched by their classes (tests/test_architecture.py)."""
    import ast

    names = {"mpi", "nccl", "threads", "stacked"}
    package = Path(bfexp_package_dir())
    found = []
    for path in package.rglob("*.py"):
        if path.is_relative_to(package / "comm"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                constants = [s.value for s in sides if isinstance(s, ast.Constant)]
                constants += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.Set, ast.List))
                              for e in s.elts if isinstance(e, ast.Constant)]
                if any(c in names for c in constants) and \
                        any(isinstance(s, ast.Attribute) and s.attr in ("name", "engine") for s in sides):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert found == [], f"engines told apart by name outside bfexp/comm: {found}"


def bfexp_package_dir() -> str:
    import bfexp

    return os.path.dirname(bfexp.__file__)
