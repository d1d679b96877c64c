"""bfexp's command lines called in this interpreter, for the tests that run dozens of command lines
(tests/test_bad_input.py, tests/test_cli_args.py, tests/test_docs_commands.py): one interpreter start instead of
one per line."""

from __future__ import annotations

import contextlib
import io
import traceback
from typing import Any


def captured(function: Any, *args: Any) -> dict[str, Any]:
    """``function(*args)`` with its output captured: the exit code it gave (SystemExit), what it printed, and any
    other exception that escaped it (a bug) as its traceback."""
    err, out = io.StringIO(), io.StringIO()
    code, escaped = 0, None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            function(*args)
        except SystemExit as e:
            code = e.code
        except BaseException:
            escaped = traceback.format_exc()
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue(), "escaped": escaped}


def call(args: list[str]) -> dict[str, Any]:
    """``bfexp ARGS`` here (``captured``), with Hydra's and the CLI's state reset for the next call."""
    import bfexp.cli as cli
    from hydra.core.global_hydra import GlobalHydra

    got = captured(cli.command, args)
    GlobalHydra.instance().clear()
    cli.reset_state()
    return got


def ran(got: dict[str, Any], what: str = "") -> dict[str, Any]:
    """A case of ``call`` or ``calls`` that ran to its end: exit code 0 and nothing escaped; else the assertion
    shows ``what``, the traceback and the ends of its stderr and stdout. Returns the case."""
    assert got["code"] == 0 and got["escaped"] is None, (
        f"{what} exit {got['code']}: {got['escaped'] or ''}{got['stderr'][-3000:]}{got.get('stdout', '')[-2000:]}")
    return got


def compose_only() -> list[dict[str, Any]]:
    """From here on, ``call`` composes every job without running it: the list returned gets each job's Hydra mode,
    choices, overrides, sweep folder and resolved config. A Slurm sweep's points are composed here, not submitted;
    the sweep's check of every point goes too, since it runs a job's own checks (files that exist, classes that
    import), which are run_job's (tests/test_bad_input.py has them)."""
    import bfexp.cli as cli
    import bfexp.launchers.slurm_sweep as slurm_sweep
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    jobs: list[dict[str, Any]] = []

    def record(cfg: Any) -> str:
        hydra = HydraConfig.get()
        jobs.append({"mode": hydra.mode.name, "choices": OmegaConf.to_container(hydra.runtime.choices),
                     "task": list(hydra.overrides.task), "hydra": list(hydra.overrides.hydra),
                     "sweep_dir": str(hydra.sweep.dir), "config": OmegaConf.to_container(cfg, enum_to_str=True)})
        return "completed"

    slurm_sweep.launch = BasicLauncher.launch
    cli.run_job = record
    cli.check_sweep = lambda config: None
    return jobs


MAINS = {"bfexp-report": "bfexp.report", "bfexp-topology": "bfexp.topology.cli"}


def call_main(command: str, args: list[str]) -> dict[str, Any]:
    """Another of bfexp's commands (``bfexp-report``, ``bfexp-topology``) called here with ``args``, as ``call``."""
    import importlib

    return captured(importlib.import_module(MAINS[command]).main, args)


# ``calls``'s child: each case in a folder of its own, through ``call``, then every summary.json the case left there.
_CALLS = """
import json, os, sys
from pathlib import Path
from tests.cli_in_process import call

out = {}
for case in json.loads(sys.argv[1]):
    folder = Path(case["folder"])
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    got = call(case["args"])
    out[case["id"]] = {**got, "stdout": got["stdout"] if case.get("whole_stdout") else got["stdout"][-2000:],
                       "summaries": {str(p.relative_to(folder)): json.loads(p.read_text())
                                     for p in sorted(folder.glob("**/summary.json"))}}
print(json.dumps(out))
"""


def calls(cases: list[dict[str, Any]], timeout: float, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``bfexp`` command lines one after another in one fresh interpreter: each case ({"id", "folder", "args"})
    runs in its folder (made here unless the caller prepared it; cases may share one, in turn); {id: exit code,
    stdout's end (all of it where the case says "whole_stdout": true), stderr, escaped traceback, and {path under
    the folder: summary} of every summary.json it left}."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _CALLS, json.dumps(cases)], capture_output=True, text=True,
                          cwd=repo, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
