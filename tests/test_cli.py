"""The CLI: help, composition errors (one line, exit 2), no heavy imports."""

import subprocess
import sys

import pytest

from bfexp.cli import GROUPS, group_options


def test_help_lists_every_group_and_option(bfexp):
    proc = bfexp("--help")
    assert proc.returncode == 0
    for group in GROUPS:
        assert group in proc.stdout
        for option in group_options(group):
            assert option in proc.stdout


@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm=nosuch", ["algorithm=nosuch", "dsgd", "allreduce"]),
        ("stps=3", ["stps"]),
        ("algorithm.stlye=atc", ["algorithm.stlye"]),
        ("ranks=abc", ["ranks", "abc"]),
        ("ranks=0", ["ranks=0", ">= 1"]),
        ("lr=-1", ["lr=-1"]),
        ("algorithm.style=zzz", ["zzz", "atc"]),
        ("dtype=int8", ["int8", "float32"]),
    ],
)
def test_bad_config_is_one_line_exit_2(bfexp, override, words):
    proc = bfexp(override, "hydra.run.dir=run")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bfexp: error:")
    for w in words:
        assert w in lines[0]
    assert not (bfexp.cwd / "run" / "logs").exists(), "no rank may start on bad input"


def test_cfg_job_and_help_import_neither_torch_nor_mpi4py():
    code = (
        "import sys; sys.argv=['bfexp','--cfg','job']; import bfexp.cli as c\n"
        "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
        "bad=[m for m in ('torch','mpi4py') if m in sys.modules]\n"
        "print('HEAVY', bad)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr
    assert "algorithm:" in proc.stdout and "ranks: 4" in proc.stdout


def test_help_reads_the_options_without_hydras_machinery():
    """`bfexp --help` lists the groups' options from the package's files: it imports neither torch nor
    bfexp.config (Hydra's instantiation, the components' schema), so it answers at once."""
    code = (
        "import sys; sys.argv=['bfexp','--help']; import bfexp.cli as c\n"
        "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED', [m for m in ('torch', 'bfexp.config', 'hydra.utils') if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "LOADED []" in proc.stdout, proc.stdout + proc.stderr
    assert "exact_diffusion" in proc.stdout
