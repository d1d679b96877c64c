"""Back ends own their knowledge (issue 47): a PBS-style site plugs in as a launcher class and a YAML, with a
sweep class for ``hydra/launcher``, and bfexp's cli.py and config.py know nothing of it; a launcher reads its
own log; sweep launchers are asked by class; Hydra's private API and the stop rules each live in one place.

The site is tests/pbs/: pbs_site.Pbs starts real MPI ranks through the site's mpiexec wrapper (which notes
each start), conf/launcher/pbs.yaml names it; hydra_plugins/bfexp_pbs_sweep.PbsSweep submits each sweep point
with qsub (tests/pbs/qsub: a stand-in that runs the job at once, as its own ``bfexp``).
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BFEXP

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "bfexp"
SITE = REPO / "tests" / "pbs"


def _modules() -> dict[str, ast.AST]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[module] = ast.parse(path.read_text(), str(path))
    return out


def test_a_pbs_site_with_sweeps_is_a_class_and_a_yaml(tmp_path):
    """``-m hydra/launcher=pbs launcher=pbs``: each point a qsub job, its ranks real MPI ranks started by the
    site's wrapper; a point whose rank fails makes the sweep exit 1, as a local sweep does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(SITE), os.environ["PATH"]]), "QSUB_RECORD": str(tmp_path / "qsub.txt")}
    env.pop("BFEXP_DEBUG", None)
    proc = subprocess.run([*BFEXP, "--config-dir", str(SITE / "conf"), "-m", "hydra/launcher=pbs", "launcher=pbs",
                           "launcher.queue=debug", "engine=mpi", "ranks=2", "steps=6", "log_every=2",
                           "baseline_steps=0", "fail_rank=null,1", "fail_step=3", "fail_mode=raise",
                           "hydra.sweep.dir=sweep"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr + proc.stdout[-3000:]
    submitted = (tmp_path / "qsub.txt").read_text().splitlines()
    assert len(submitted) == 2, submitted
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if (p / "summary.json").exists())
    summaries = [json.loads((job / "summary.json").read_text()) for job in jobs]
    assert [s["status"] for s in summaries] == ["completed", "failed"], summaries
    assert "rank 1" in summaries[1]["error"], summaries[1]["error"]
    assert "job #1" in proc.stdout and "failed" in proc.stdout, proc.stdout[-2000:]
    # every point's ranks started through the site's wrapper, inside its qsub job, in the queue asked for
    starts = (tmp_path / "pbs_record.txt").read_text().splitlines()
    assert [line.split()[:2] for line in starts] == [[line.split()[0], "debug"] for line in submitted], starts
    for line, job in zip(starts, jobs):
        assert " -n 2 " in line and line.endswith(f"-m bfexp.worker {job}"), line


def test_a_launcher_reads_its_own_log(tmp_path):
    """The driver asks the job's launcher what its log says (Launcher.diagnose): the site's own words first,
    then Open MPI's, which every launcher inherits."""
    sys.path.insert(0, str(SITE))
    try:
        from pbs_site import Pbs
    finally:
        sys.path.remove(str(SITE))
    from bfexp.launch import diagnosis

    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "mpiexec.log"
    log.write_text("=>> PBS: job killed: walltime 65 exceeded limit 60\n")
    assert diagnosis(tmp_path, Pbs()) == "PBS ended the job: walltime 65 exceeded limit 60"
    log.write_text("prterun noticed that process rank 1 with PID 4242 on node n7 exited on signal 9 (Killed).\n")
    assert diagnosis(tmp_path, Pbs()) == "rank 1 (pid 4242 on n7) was killed by SIGKILL"
    log.write_text("nothing it knows\n")
    assert diagnosis(tmp_path, Pbs()) is None


def test_sweep_launchers_are_asked_by_class():
    from omegaconf import OmegaConf

    from bfexp.launchers.sweep import runs_here

    sys.path.insert(0, str(SITE))
    try:
        for target, here in (("hydra_plugins.bfexp_pbs_sweep.PbsSweep", False),
                             ("hydra_plugins.bfexp_slurm_launcher.launcher.SlurmSweepLauncher", False),
                             ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", True)):
            assert runs_here(OmegaConf.create({"_target_": target})) is here, target
    finally:
        sys.path.remove(str(SITE))


# Lines that still read a launcher's name, each to go when its module asks the class (none left).
PENDING: set = set()


def test_no_module_outside_the_launchers_reads_a_launchers_name():
    """Which launcher a job has, or which sweep launcher a sweep has, is asked of its class (an attribute, a
    method), never read from its ``_target_`` or name: no comparison, ``in`` or ``endswith`` of a string that
    names a launcher, outside bfexp/launchers."""
    from bfexp.launchers import Emulated, Launcher, Local, Mpirun, Srun

    classes = {c.__name__ for c in (Emulated, Local, Mpirun, Srun)} | {"SlurmSweepLauncher", Launcher.__name__}
    names = {c.name for c in (Emulated, Local, Mpirun, Srun)} | {"slurm"}
    found = set()
    for module, tree in _modules().items():
        if module.startswith("bfexp.launchers"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and all(isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq))
                                                     for op in node.ops):
                strings = [n.value for n in (node.left, *node.comparators)
                           if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("endswith", "startswith"):
                strings = [n.value for n in node.args if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            else:
                continue
            about_launchers = re.search(r"launcher|_target_", ast.unparse(node))
            for s in strings:
                if re.search(rf"(^|\.)({'|'.join(classes)})$", s) or (about_launchers and s.lower() in names):
                    found.add((module, repr(s)))
    assert found - PENDING == set(), f"launcher names read outside bfexp/launchers: {sorted(found - PENDING)}"
    assert PENDING <= found, f"no longer read, remove from PENDING: {sorted(PENDING - found)}"


def test_hydra_private_api_lives_in_one_module():
    """``hydra._internal`` is imported, and Hydra's objects patched, only in bfexp/hydra_internals.py."""
    found = []
    for module, tree in _modules().items():
        if module == "bfexp.hydra_internals":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hydra._internal"):
                found.append(f"{module}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("hydra._internal") for a in node.names):
                found.append(f"{module}:{node.lineno} import")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("hydra._internal"):  # importlib.import_module("hydra._internal...")
                found.append(f"{module}:{node.lineno} {node.value[:40]!r}")
    assert found == [], f"Hydra's private API outside bfexp/hydra_internals.py: {found}"


def test_no_frame_introspection_through_private_names():
    """Call sites come from the public inspect.currentframe, not sys._getframe."""
    found = [f"{module}:{node.lineno}" for module, tree in _modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "_getframe"]
    assert found == [], found


def test_the_stop_rules_live_in_one_supervisor():
    """bfexp's jobs (process and virtual ranks) and bfexp-run's launches build launch.Supervisor; no other
    class or function holds a failure grace, and only the Supervisor calls the hang watchdog's verdict."""
    trees = _modules()
    builders = sorted(module for module, tree in trees.items() for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                      == "Supervisor")
    assert builders == ["bfexp.launch", "bfexp.launch", "bfexp.run"], builders
    checks = []
    for module, tree in trees.items():
        for cls in [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]:
            for node in ast.walk(cls):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check" \
                        and "hangs" in ast.unparse(node.func.value):
                    checks.append(f"{module}.{cls.name}")
    assert set(checks) == {"bfexp.launch.Supervisor", "bfexp.launch.hang_reason"}, checks


def test_errors_are_defined_in_errors_py():
    """Every exception class of bfexp is errors.py's (Hung included)."""
    from bfexp import errors

    found = [f"{module}:{node.lineno} {node.name}" for module, tree in _modules().items() if module != "bfexp.errors"
             for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
             and any(getattr(b, "id", getattr(b, "attr", "")) in ("Exception", "BaseException") for b in node.bases)]
    assert found == [], found
    assert issubclass(errors.Hung, errors.BfexpError)


@pytest.mark.parametrize("name", ["openmpi", "srun", "virtual"])
def test_back_end_modules_import_nothing_above_them(name):
    """launchers/ modules import neither the driver's supervision (launch, cli, run) nor each other's users."""
    tree = _modules()[f"bfexp.launchers.{name}"]
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"bfexp.launch", "bfexp.cli", "bfexp.run"}, imported
