"""Ranks started while the driver finishes its checks (sessions.EarlyRanks, watchdog.wait_at_gate).

The driver starts a job's process ranks right after composing and validating its config, so their
start-up (Python, torch, MPI) overlaps the driver's import of torch and its dry build. They wait at a
gate: a job that passes the checks tells them to go; a refused one ends them unseen (exit 2, one line, no
folder left, no process left); a driver that dies is seen by the waiting ranks, which leave.
Real mpiexec and ranks throughout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bfexp import watchdog
from tests.conftest import REPO


def gate_processes(marker: str) -> list[int]:
    """Live processes whose environment names this gate (the early ranks and their mpiexec)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry.name}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker.encode() in env and state != "Z":
            found.append(int(entry.name))
    return found


def test_the_gate_says_go_stop_or_driver_gone(tmp_path, monkeypatch):
    """A rank at the gate waits for the word; "go" lets it on, "stop" or a dead driver sends it away;
    a rank started without a gate goes on at once."""
    monkeypatch.delenv(watchdog.GATE, raising=False)
    assert watchdog.wait_at_gate() is True
    gate = tmp_path / "gate"
    monkeypatch.setenv(watchdog.GATE, str(gate))
    monkeypatch.setenv(watchdog.DRIVER_PID, str(os.getpid()))
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(watchdog.wait_at_gate()))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and got == []  # no word yet: it waits
    gate.write_text("go")
    waiter.join(5)
    assert got == [True]
    gate.write_text("stop")
    assert watchdog.wait_at_gate() is False
    gate.unlink()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv(watchdog.DRIVER_PID, str(dead.pid))  # reaped: no such process any more
    assert watchdog.wait_at_gate() is False


def test_a_job_refused_after_its_ranks_started_leaves_nothing(bfexp, monkeypatch):
    """The data set's files are checked by the dry build, after the ranks were started: exit 2, one line,
    no run folder, no rank or mpiexec left."""
    monkeypatch.setenv("TMPDIR", str(bfexp.cwd))  # the gate folder lands here: its path marks the job's processes
    proc = bfexp("engine=mpi", "ranks=1", "dataset=mnist", f"dataset.root={bfexp.cwd}/nothing",
                 "hydra.run.dir=run", "--verbose")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "dataset.root=" in lines[0], proc.stderr
    assert not (bfexp.cwd / "run").exists()
    assert list(bfexp.cwd.glob("bfexp-gate-*")) == []
    assert gate_processes(str(bfexp.cwd)) == []


def test_a_job_started_early_runs_and_says_so(bfexp):
    from bfexp.launchers import processor_slots

    if processor_slots() < 2:
        pytest.skip("ranks start early only beside a processor slot left for the driver")
    proc = bfexp("engine=mpi", "ranks=1", "steps=5", "log_every=5", "baseline_steps=0", "hydra.run.dir=run",
                 "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert "driver: ranks started early (they wait for the checks)" in proc.stdout
    assert "rank 0: MPI init; the driver's checks, if started early" in proc.stdout
    assert (bfexp.cwd / "run" / "summary.json").exists() and (bfexp.cwd / "run" / "logs" / "mpiexec.log").exists()


DRIVER = """
import sys, time
from hydra import compose, initialize_config_module
from bfexp.config import register_configs
from bfexp.config import launcher_of
from bfexp.schema import Settings
from bfexp.sessions import EarlyRanks
register_configs()
with initialize_config_module(config_module="bfexp.conf", version_base=None):
    cfg = compose(config_name="config", overrides=["engine=mpi", "ranks=2"])
early = EarlyRanks(cfg.engine, Settings.of(cfg), sys.argv[1], launcher_of(cfg.get("launcher")))
print(early.proc.pid, early.gate, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["cancel", "driver killed"])
def test_waiting_ranks_end_when_cancelled_or_when_the_driver_dies(tmp_path, how):
    """Started and waiting: cancel() ends them and takes its log folder away; a SIGKILLed driver
    (nobody to cancel) is noticed by the ranks, which leave, and mpiexec with them."""
    run_dir = tmp_path / "run"
    if how == "cancel":
        from hydra import compose, initialize_config_module

        from bfexp.config import launcher_of, register_configs
        from bfexp.schema import Settings
        from bfexp.sessions import EarlyRanks

        register_configs()
        with initialize_config_module(config_module="bfexp.conf", version_base=None):
            cfg = compose(config_name="config", overrides=["engine=mpi", "ranks=3"])
        early = EarlyRanks(cfg.engine, Settings.of(cfg), run_dir, launcher_of(cfg.get("launcher")))
        marker = str(early.gate)
        deadline = time.monotonic() + 60
        while len(gate_processes(marker)) < 4 and time.monotonic() < deadline:  # mpiexec + 3 ranks
            time.sleep(0.1)
        assert len(gate_processes(marker)) >= 4
        early.cancel()
        assert gate_processes(marker) == []
        assert not (run_dir / "logs").exists() and not Path(marker).parent.exists()
        return
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, start_new_session=True)
    try:
        _, marker = driver.stdout.readline().split()
        deadline = time.monotonic() + 60
        while len(gate_processes(marker)) < 3 and time.monotonic() < deadline:  # mpiexec + 2 ranks
            time.sleep(0.1)
        assert len(gate_processes(marker)) >= 3
        time.sleep(2)  # let the ranks reach the gate (imports, MPI) or not: either way they must go
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 60
        while gate_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gate_processes(marker) == [], "ranks outlived their driver"
        assert not Path(marker).parent.exists(), "the gate's folder outlived the driver's ranks"
    finally:
        if driver.poll() is None:
            driver.kill()


def test_process_engines_are_the_engines_whose_ranks_are_processes():
    """The driver decides before importing any engine (that imports torch), reading the classes' source: what
    it reads there is what the imported classes say, and it has still not imported torch."""
    import json

    from bfexp.comm import PROCESS_ENGINES, engine_class, engine_options

    code = ("import dataclasses, json, sys\n"
            "from bfexp.comm import PROCESS_ENGINES, engine_facts, engine_options\n"
            "facts = {o: dataclasses.astuple(engine_facts(o)) for o in engine_options()}\n"
            "print(json.dumps([facts, sorted(PROCESS_ENGINES), 'torch' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    read, process_engines, torch_imported = json.loads(out.stdout)
    imported = {name: engine_class(name) for name in engine_options()}
    assert read == {name: [c.name, c.virtual, c.processes, c.device_type, c.stacked] for name, c in imported.items()}
    assert process_engines == sorted(PROCESS_ENGINES) == ["mpi", "nccl"] and not torch_imported
    assert PROCESS_ENGINES == {name for name, c in imported.items() if c.processes}


def test_ranks_start_early_only_beside_a_free_slot_for_the_driver(monkeypatch):
    """Ranks start early only where the driver keeps a processor slot of its own, they surely fit, and the
    driver still has torch's import ahead: ranks=1000 engine=mpi must meet the memory check, not be started.
    Without a free slot the early ranks of a job refused by its dry build cost more than they save: with 4
    ranks on 2 slots, bfexp steps=1 took 1.26x a bare mpiexec instead of 1.41x, but tests/test_untrusted_input.py
    and test_first_use.py (mostly refusals) took 191 s instead of 119 s."""
    from hydra import compose, initialize_config_module

    from bfexp.config import launcher_of, register_configs
    from bfexp.launchers import processor_slots
    from bfexp.sessions import EarlyRanks

    register_configs()

    def cfg(*overrides: str):
        with initialize_config_module(config_module="bfexp.conf", version_base=None):
            return compose(config_name="config", overrides=list(overrides))

    def wanted(job) -> bool:
        return EarlyRanks.wanted(job.engine, int(job.ranks), launcher_of(job.get("launcher")))

    import torch  # noqa: F401  (loaded here whichever test this worker ran before)

    slots = processor_slots()
    assert not wanted(cfg("engine=mpi", "ranks=1"))  # torch is loaded in this process
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh driver (restored after the test)
    assert wanted(cfg("engine=mpi", f"ranks={slots - 1}")) == (slots > 1)
    assert not wanted(cfg("engine=mpi", f"ranks={slots}"))
    assert not wanted(cfg("engine=mpi", "ranks=1000"))
    assert not wanted(cfg("engine=threads", "ranks=1"))
    assert not wanted(cfg("engine=mpi", "ranks=1", "launcher=mpirun", "launcher.hosts=localhost:2"))
