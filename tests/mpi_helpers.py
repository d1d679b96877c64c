"""Spawn real MPI ranks from a test, the way the launcher does.

`run_ranks(n, code)` runs `code` (a Python source string) on n ranks under
mpiexec; each rank can call `emit(obj)` to hand a JSON-able result back,
and the test receives the list of results indexed by rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from bfexp.sessions import rank_environment
from bfexp.launchers import find_mpiexec

PRELUDE = """
import json, os, sys
from mpi4py import MPI
_out = os.environ["BFEXP_TEST_OUT"]
def emit(obj):
    with open(os.path.join(_out, f"rank{MPI.COMM_WORLD.Get_rank()}.json"), "w") as f:
        json.dump(obj, f)
"""


def run_ranks(n: int, code: str, tmp_path: Path, timeout: float = 120.0, env: dict | None = None) -> list:
    """Run `code` on n MPI ranks; return what each rank emit()-ed (None if nothing)."""
    out = tmp_path / f"ranks-out-{n}"
    out.mkdir(parents=True, exist_ok=True)
    script = tmp_path / f"ranks-script-{n}.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    environment = rank_environment(n)
    environment["BFEXP_TEST_OUT"] = str(out)
    environment.update(env or {})
    proc = subprocess.run(
        [find_mpiexec(), "--oversubscribe", "-n", str(n), sys.executable, "-m", "mpi4py", str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )
    if proc.returncode != 0:
        raise AssertionError(f"ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results = []
    for r in range(n):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def live_processes(*words: str) -> dict[int, str]:
    """Live (not zombie) processes other than this one whose command line holds every word: {pid: command line}.
    What fault tests look for after a job or launch ended (ranks, prterun)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if all(word in cmdline for word in words) and state != "Z":
            found[int(entry.name)] = cmdline
    return found
