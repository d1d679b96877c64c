"""`bfexp-run` under faults (issue 29): a rank that never reaches a collective, a SIGKILLed bfexp-run, a
failing rank's report, and mpirun's spelling of the rank count.

* a hang ends within --timeout-s + 10 s of its start, naming the waiting rank and its call (the script's
  line), on MPI ranks and on virtual ranks;
* after SIGKILL of bfexp-run, within 10 s: no process of the launch (prterun, ranks) and no temporary folder;
* a failing rank's report: its traceback from the script's first frame, no launcher frames, no Open MPI
  abort banner, no NUL byte; then bfexp-run's one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bfexp import run
from tests.mpi_helpers import live_processes

TIMEOUT_S = 3.0
HANG = """\
import sys, time
import torch
import bfexp as bf
bf.init()
if bf.rank() == 1:
    time.sleep(600)  # never reaches the allreduce
print(f"hang starts {time.time()}", flush=True)
bf.allreduce(torch.ones(1))
"""
# Neither script needs torch (cheap ranks): bfexp-run's part of every rank watches for its driver and records a
# failure whether or not the script uses bfexp.
WAIT = """\
import time
print("ready", flush=True)
time.sleep(600)
"""
FAIL = """\
import os
import time
if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    raise ValueError("boom on purpose")
time.sleep(600)
"""


def launch(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bfexp.run", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, **kw)


def live(word: str) -> list[str]:
    """Live (not zombie) processes whose command line has ``word``."""
    return [f"{pid} {cmdline}" for pid, cmdline in live_processes(word).items()]


def hang(folder: Path, engine: str) -> dict:
    script = folder / "hang_script.py"
    script.write_text(HANG)
    proc = launch(["-n", "2", "--engine", engine, "--timeout-s", str(TIMEOUT_S), "python", str(script)], folder)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    ended, left = time.time(), live(str(script))
    for pid in left:
        os.kill(int(pid.split()[0]), signal.SIGKILL)
    return {"ended": ended, "rc": proc.returncode, "out": out, "left": left}


def sigkill(folder: Path) -> dict:
    script = folder / "wait_script.py"
    script.write_text(WAIT)
    scratch = folder / "tmp"
    scratch.mkdir()
    proc = launch(["-n", "2", "python", str(script)], folder, env=dict(os.environ, TMPDIR=str(scratch)))
    try:
        ready = b"ready" in proc.stdout.readline() + proc.stdout.readline()
        made = [p.name for p in scratch.glob("bfexp-run-*")]
        proc.kill()  # SIGKILL
        proc.wait()
        deadline = time.monotonic() + 10
        while (live(str(script)) or list(scratch.glob("bfexp-run-*"))) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
    left = live(str(script))
    for pid in left:  # leave the machine clean; the test fails on them anyway
        os.kill(int(pid.split()[0]), signal.SIGKILL)
    return {"ready": ready, "made": made, "left": left, "folders": list(scratch.glob("bfexp-run-*"))}


def failing(folder: Path) -> dict:
    script = folder / "failing_script.py"
    script.write_text(FAIL)
    proc = subprocess.run([sys.executable, "-m", "bfexp.run", "-n", "2", "python", str(script)], cwd=folder,
                          capture_output=True, timeout=120)
    left = live(str(script))
    for pid in left:
        os.kill(int(pid.split()[0]), signal.SIGKILL)
    return {"rc": proc.returncode, "out": proc.stdout + proc.stderr, "script": script, "left": left}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """The four launches at once (each mostly waits: for its ranks to start, for a timeout)."""
    root = tmp_path_factory.mktemp("bfexp-run-faults")
    jobs = {"hang-mpi": lambda f: hang(f, "mpi"), "hang-threads": lambda f: hang(f, "threads"),
            "sigkill": sigkill, "failing": failing}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {}
        for name, job in jobs.items():
            (root / name).mkdir()
            futures[name] = pool.submit(job, root / name)
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("engine", ["mpi", "threads"])
def test_a_rank_that_never_reaches_a_collective_ends_the_launch_within_its_timeout(outcomes, engine):
    got = outcomes[f"hang-{engine}"]
    text = got["out"].decode(errors="replace")
    assert got["rc"] == 1, text[-3000:]
    started = float(text.split("hang starts ")[1].split()[0])
    assert got["ended"] - started <= TIMEOUT_S + 10, (got["ended"] - started, text[-2000:])
    last = text.strip().splitlines()[-1]
    assert last.startswith("bfexp-run: hung: no progress for timeout_s=3 s; rank 0: blocked in communication in "
                           "allreduce (") and "hang_script.py:8" in last, last
    if engine == "threads":
        assert "rank 0 waits for rank 1" in last
    assert got["left"] == []


def test_sigkill_of_bfexp_run_leaves_no_process_and_no_folder(outcomes):
    got = outcomes["sigkill"]
    assert got["ready"] and got["made"], got  # the ranks ran, in a temporary folder of bfexp-run's
    assert got["left"] == [], "processes of the launch outlived bfexp-run by 10 s"
    assert got["folders"] == []


def test_a_failing_rank_is_reported_without_the_launchers_frames_or_abort_banners(outcomes):
    got = outcomes["failing"]
    text = got["out"].decode(errors="replace")
    assert got["rc"] == 1, text[-3000:]
    assert b"\0" not in got["out"]
    assert "MPI_ABORT" not in text and "prterun" not in text and "runpy" not in text and "mpi4py" not in text, text
    assert f'[rank 1]   File "{got["script"]}", line 4, in <module>' in text, text
    assert text.strip().splitlines()[-1] == "bfexp-run: rank 1: ValueError: boom on purpose"
    assert got["left"] == []


def test_mpiruns_spelling_of_the_rank_count_is_accepted():
    assert run.parse(["-np", "4", "python", "x.py"]).ranks == 4
    assert run.parse(["-n", "3", "python", "x.py", "-np", "7"]).command == ["python", "x.py", "-np", "7"]
    assert run.parse(["-n", "3", "python", "x.py"]).timeout_s == 300  # the runner's timeout_s
