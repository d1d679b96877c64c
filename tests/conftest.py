import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BFEXP = [sys.executable, "-m", "bfexp.cli"]


def run_bfexp(args: list[str], cwd: Path, timeout: float = 240.0, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in `cwd` (its outputs/ and multirun/ land there)."""
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    return subprocess.run(BFEXP + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.fixture
def bfexp(tmp_path):
    def call(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
        return run_bfexp(list(args), tmp_path, timeout=timeout)

    call.cwd = tmp_path
    return call
