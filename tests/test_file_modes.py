"""Results files follow the user's umask (issue 44): collaborators on a shared cluster can read them.

Atomic writes go through a temporary file, which Python's tempfile makes 0600 whatever the umask; bfexp
gives each results file the mode a plain open() would: 0o666 less the umask.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BFEXP


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*")
            if p.is_file() and ".hydra" not in p.parts and not p.name.endswith(".log")}


@pytest.mark.parametrize("umask", [0o027, pytest.param(0o022, marks=pytest.mark.large),
                                   pytest.param(0o077, marks=pytest.mark.large)])
def test_a_sweeps_results_files_have_the_mode_the_umask_gives(tmp_path, umask):
    """A two-job sweep on virtual ranks: config.yaml, plan.json, metrics.jsonl, summary.json of each job and the
    sweep's report.csv, report.md and plots, each 0o666 less the umask (0o644 under 022, 0o640 under 027)."""
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    proc = subprocess.run([*BFEXP, "-m", "engine=threads", "ranks=2", "steps=3", "baseline_steps=0", "lr=0.1,0.2",
                           "hydra.sweep.dir=sweep", "logger=jsonl"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env, preexec_fn=lambda: os.umask(umask))
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = modes(tmp_path / "sweep")
    for name in ("config.yaml", "plan.json", "metrics.jsonl", "summary.json"):
        assert sum(Path(f).name == name for f in found) == 2, (name, sorted(found))
    for name in ("report.csv", "report.md"):
        assert name in found, sorted(found)
    assert any(f.endswith(".png") for f in found)
    wrong = {f: oct(m) for f, m in found.items() if m != 0o666 & ~umask}
    assert wrong == {}, f"not {oct(0o666 & ~umask)}: {wrong}"
