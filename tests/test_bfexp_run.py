"""`bfexp-run` and the three-line port of a plain PyTorch script (issue 13).

One MPI launch of tests/data/mnist_style_train_bf.py on 4 ranks is the reference: ranks saw
different data, started from identical parameters, the loss fell. The same script as virtual
ranks (`bfexp-run --engine threads`, and `bf.spawn` as a notebook would call it) prints the
very same numbers. A failing rank ends an MPI job promptly, named, with no process left behind.
"""

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bfexp as bf
from bfexp import run

DATA = Path(__file__).parent / "data"
PLAIN, PORTED = DATA / "mnist_style_train.py", DATA / "mnist_style_train_bf.py"
RANKS, EPOCHS = 4, 2
ARGS = ["--epochs", str(EPOCHS)]
LINE = re.compile(r"^\[rank (\d+)\] (.*)$")


def by_rank(text: str) -> dict[int, list[str]]:
    """What each rank printed (the launcher tags every line), script lines only."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m.group(2).startswith(("Initial", "Train", "Epoch", "Test")):
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


def numbers(lines: list[str], prefix: str, pattern: str) -> list[float]:
    return [float(re.search(pattern, s).group(1)) for s in lines if s.startswith(prefix)]


@pytest.fixture(scope="module")
def mpi_output() -> dict[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "bfexp.run", "-n", str(RANKS), "python", str(PORTED), *ARGS],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return by_rank(proc.stdout)


def test_the_port_changes_at_most_three_lines():
    plain, ported = PLAIN.read_text().splitlines(), PORTED.read_text().splitlines()
    changed = [line for line in difflib.ndiff(plain, ported) if line.startswith("+ ")]
    removed = [line for line in difflib.ndiff(plain, ported) if line.startswith("- ")]
    assert len(changed) <= 3 and len(removed) <= 2, changed + removed
    assert any("import bfexp" in c for c in changed)


def test_four_mpi_ranks_train_on_different_data_from_one_start(mpi_output):
    assert sorted(mpi_output) == list(range(RANKS))
    checksums = {tuple(numbers(lines, "Initial", r"checksum (\S+)")) for lines in mpi_output.values()}
    assert len(checksums) == 1  # rank 0's parameters everywhere (broadcast by the wrapper)
    sums, samples = set(), 0
    for lines in mpi_output.values():
        seen = numbers(lines, "Epoch 1:", r"input sum (\S+)")
        samples += int(numbers(lines, "Epoch 1:", r"trained on (\d+) samples")[0])
        sums.add(seen[0])
        tests = numbers(lines, "Test", r"Average loss: ([0-9.]+)")
        assert len(tests) == EPOCHS and tests[-1] < tests[0]  # the loss fell on every rank
    assert len(sums) == RANKS and samples == 1500  # each rank its own quarter of the 1500 training digits


def test_virtual_ranks_print_the_mpi_numbers(mpi_output, capsys):
    """bfexp-run --engine threads, and bf.spawn as a notebook calls it: bit for bit MPI's output."""
    with pytest.raises(SystemExit) as end:
        run.main(["-n", str(RANKS), "--engine", "threads", "python", str(PORTED), *ARGS])
    assert end.value.code == 0
    assert by_rank(capsys.readouterr().out) == mpi_output
    bf.spawn(str(PORTED), RANKS, args=ARGS)
    assert by_rank(capsys.readouterr().out) == mpi_output


def test_eight_virtual_ranks_train_on_different_data_from_one_start(capsys):
    """`bfexp-run -n 8 --engine threads`: more ranks than this machine has cores, one process."""
    with pytest.raises(SystemExit) as end:
        run.main(["-n", "8", "--engine", "threads", "python", str(PORTED), *ARGS])
    assert end.value.code == 0
    out = by_rank(capsys.readouterr().out)
    assert sorted(out) == list(range(8))
    assert len({tuple(numbers(lines, "Initial", r"checksum (\S+)")) for lines in out.values()}) == 1
    assert len({numbers(lines, "Epoch 1:", r"input sum (\S+)")[0] for lines in out.values()}) == 8
    assert sum(int(numbers(lines, "Epoch 1:", r"trained on (\d+) samples")[0]) for lines in out.values()) == 1500
    for lines in out.values():
        tests = numbers(lines, "Test", r"Average loss: ([0-9.]+)")
        assert len(tests) == EPOCHS and tests[-1] < tests[0]


def live_processes(needle: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


FAILING = """
import os
import time

import torch

import bfexp as bf

print("environment", os.environ.get("OMPI_MCA_osc"), os.environ.get("OMP_NUM_THREADS"),
      os.environ.get("MALLOC_MMAP_THRESHOLD_"), flush=True)
if bf.rank() == 2:
    raise ValueError("boom on purpose")
bf.allreduce(torch.ones(1))  # the other ranks wait here for rank 2, which never comes
time.sleep(600)
"""


def test_a_failing_rank_ends_the_job_named_with_no_orphans(tmp_path, capsys):
    """Over --hosts (mpirun's placement) with --log-dir: exit 1, rank 2's ValueError named, its traceback
    in rank2.log, no process of the job left; the same script on virtual ranks ends the same way."""
    script = tmp_path / "failing_script.py"
    script.write_text(FAILING)
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "bfexp.run", "-n", "4", "--hosts", "localhost:4",
                           "--log-dir", str(logs), "python", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "bfexp-run: rank 2: ValueError: boom on purpose" in proc.stderr
    assert "ValueError: boom on purpose" in (logs / "rank2.log").read_text()
    assert sorted(p.name for p in logs.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    assert live_processes(str(script)) == []
    # the runner's rank environment: Open MPI's UCX one-sided probe off, cores shared out among the 4 ranks,
    # malloc's blocks up to 32 MiB from the heap
    threads = max(1, (os.cpu_count() or 1) // 4)
    assert f"environment ^ucx {threads} {32 * 1024 * 1024}" in (logs / "rank0.log").read_text()

    with pytest.raises(SystemExit) as end:
        run.main(["-n", "3", "--engine", "threads", "python", str(script)])
    assert end.value.code == 1
    assert "bfexp-run: rank 2: ValueError: boom on purpose" in capsys.readouterr().err


def test_threads_run_a_module_with_per_rank_logs(tmp_path, monkeypatch):
    """`bfexp-run --engine threads --log-dir D python -m MODULE ARGS`: each virtual rank's output in D/rank<N>.log."""
    (tmp_path / "hello_ranks.py").write_text(
        "import sys\nimport torch\nimport bfexp as bf\n"
        "total = float(bf.allreduce(torch.tensor([bf.rank() + 1.0]), op='sum'))\n"
        "print(f'rank {bf.rank()} of {bf.size()} got {sys.argv[1:]} total {total}')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as end:
        run.main(["-n", "3", "--engine", "threads", "--log-dir", str(tmp_path / "logs"), "python", "-m", "hello_ranks",
                  "--flag", "x"])
    assert end.value.code == 0
    for r in range(3):
        assert (tmp_path / "logs" / f"rank{r}.log").read_text() == f"rank {r} of 3 got ['--flag', 'x'] total 6.0\n"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["-n", "0", "python", "x.py"], "-n 0; allowed: an integer >= 1"),
        (["-n", "2", "python", "no/such/script.py"], "script no/such/script.py does not exist"),
        (["-n", "2", "--engine", "threads", "--hosts", "a:2", "python", "x.py"], "--engine mpi across machines"),
        (["-n", "2"], "no command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as end:
        run.main(argv)
    assert end.value.code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
