"""Process ranks: their command and environment, their start in a session of their own, ending that session
whole, and ranks started early while the driver still checks the job.

Open MPI gives each rank a process group of its own, so a group signal
misses them; they stay in mpiexec's session, which outlives mpiexec. The
driver therefore starts the launcher's command in a new session and ends
the session, not the process: no rank outlives its job, also while mpiexec
is still starting them. Standard library only (the driver imports this
before torch).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Sequence

from bfexp import results, watchdog
from bfexp.launchers import TIMEOUT_VARIABLE, Launcher, processor_slots
from bfexp.preflight import PROCESS_RANK_BYTES, available_memory

if TYPE_CHECKING:
    from bfexp.schema import Settings

__all__ = ["EarlyRanks", "launcher_command", "launcher_environment", "rank_environment", "session_processes",
           "start_process_ranks", "start_ranks", "terminate_session", "worker_command"]

# Environment that marks a process as part of an MPI job; a child mpiexec
# that inherits it believes it is nested and fails.
INHERITED_MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "MPI_LOCALRANKID")
# How long ranks get to exit after SIGTERM before SIGKILL.
TERMINATE_GRACE_S = 3.0
# glibc's malloc serves blocks from 128 KiB up with fresh mmaps, zeroed page by page, unless the process
# happened to free such a block earlier (the threshold then adapts). A cnn's activations are such blocks:
# its evaluation on MNIST-sized data took 0.95 s instead of 0.55 s per run at the default threshold.
# Fixed here: blocks up to 32 MiB come from the heap, which keeps up to 64 MiB free before returning it.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}


def rank_environment(ranks: int, threads: int | None = None) -> dict[str, str]:
    """The driver's environment minus inherited MPI state, plus per-rank thread limits (``threads``:
    a launcher's share of a machine's cores; default this machine's shared by ``ranks``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_MPI_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    # R ranks each using every core thrash the machine; share the cores out.
    threads = threads or max(1, processor_slots() // max(1, ranks))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    for key, value in MALLOC_SETTINGS.items():
        env.setdefault(key, value)
    # Open MPI's UCX one-sided component fails its probe on hosts without UCX
    # hardware and says so at every window creation; the default (rdma/sm) serves.
    env.setdefault("OMPI_MCA_osc", "^ucx")
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def worker_command(run_dir: Path) -> list[str]:
    """What every rank runs (mpi4py's runner aborts every rank when one raises)."""
    return [sys.executable, "-m", "mpi4py", "-m", "bfexp.worker", str(run_dir)]


def launcher_command(launcher: Launcher, engine: Any, ranks: int, program: list[str],
                     env: dict[str, str] | None = None) -> list[str]:
    """The command that starts the job's ``ranks``, each running ``program``, as ``launcher`` spells it (with
    the engine node's mpiexec_args); ``env``: the ranks' environment, which it carries to other machines
    (Launcher.forward_environment)."""
    args = [str(a) for a in engine.get("mpiexec_args", [])]
    return launcher.command(int(ranks), program, [*launcher.forward_environment(env or {}), *args])


def launcher_environment(launcher: Launcher, ranks: int, timeout_s: float = 0.0) -> dict[str, str]:
    """The ranks' environment: the driver's without MPI state, threads per rank from the ranks sharing a
    machine, the job's timeout_s, and what the launcher adds."""
    env = rank_environment(ranks, launcher.threads_per_rank(ranks))
    env[TIMEOUT_VARIABLE] = f"{float(timeout_s):g}"
    return launcher.environment(ranks, env)


def start_process_ranks(launcher: Launcher, ranks: int, program: Sequence[str], env: dict[str, str],
                        stdout: IO[bytes] | None, stderr: IO[bytes] | int | None = subprocess.STDOUT,
                        mpiexec_args: Sequence[str] = ()) -> subprocess.Popen:
    """``ranks`` ranks, each running ``program``, started by the launcher's command in a session of its own
    (bfexp and bfexp-run alike): the machines made ready first (Launcher.prepare), the ranks told who their
    driver is (they end themselves when it is gone), ``env`` carried to other machines."""
    launcher.prepare(ranks)
    env = {**env, watchdog.DRIVER_PID: str(os.getpid()), watchdog.DRIVER_HOST: socket.gethostname()}
    command = launcher.command(ranks, list(program), [*launcher.forward_environment(env), *mpiexec_args])
    return subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, cwd=os.getcwd(),
                            start_new_session=True)  # one session holds mpiexec and every rank it starts


def start_ranks(launcher: Launcher, engine: Any, settings: Settings, run_dir: Path, log: IO[bytes],
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """The launcher's command starting the job's ranks (``settings.ranks``, the engine node's mpiexec_args) in
    a session of its own, its output into ``log``."""
    env = launcher_environment(launcher, int(settings.ranks), float(settings.timeout_s or 0)) | (env or {})
    args = [str(a) for a in engine.get("mpiexec_args", [])]
    return start_process_ranks(launcher, int(settings.ranks), worker_command(run_dir), env, log, mpiexec_args=args)


def session_processes(sid: int) -> list[int]:
    """Live processes of a session (mpiexec's: it leads its own, and its ranks stay in it)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def terminate_session(proc: subprocess.Popen) -> None:
    """End the session ``proc`` leads (mpiexec and every rank it started): SIGTERM, then SIGKILL to what is left."""
    for sig, grace in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, 5.0)):
        pids = session_processes(proc.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap mpiexec: a zombie is not a live process
            if not session_processes(proc.pid):
                break
            time.sleep(0.05)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


class EarlyRanks:
    """A job's ranks started while the driver finishes its checks (torch's import, engine and dry build).

    Starting Python+torch+MPI ranks takes seconds, and so does the driver's import of torch; with a core
    free for the driver the two overlap (see ``wanted``). The ranks import, start MPI and wait at a gate
    file (watchdog.wait_at_gate) before they read the job's config: ``go`` (the launch, once the config is
    written) lets them run; ``cancel`` (bad input, a signal) ends them unseen, and takes away the log
    folder it made, so a refused job leaves nothing. A driver that dies is seen by the waiting ranks, which
    leave. Local launcher only (the ranks watch the driver's pid).
    """

    def __init__(self, engine: Any, settings: Settings, run_dir: Path, launcher: Launcher) -> None:
        self.run_dir = Path(run_dir)
        logs = self.run_dir / results.LOGS_DIR
        self._made_logs = not logs.exists()
        logs.mkdir(parents=True, exist_ok=True)
        self._gate_dir = Path(tempfile.mkdtemp(prefix="bfexp-gate-"))
        self.gate = self._gate_dir / "gate"
        self.log = open(logs / "mpiexec.log", "wb")
        self.taken = False
        self.proc = start_ranks(launcher, engine, settings, self.run_dir, self.log, {watchdog.GATE: str(self.gate)})

    @staticmethod
    def wanted(engine: Any, ranks: int, launcher: Launcher) -> bool:
        """Worth it and safe (the job's engine node, its ``ranks``): process ranks on this machine, with torch's
        import still ahead of the driver, a processor slot left for the driver beside every rank, and memory for
        them twice over.

        With a slot of its own the driver's checks run at full speed beside the ranks' start-up, so a job
        ends sooner by about torch's import (1-rank job on 2 slots: 3.0-3.2 s instead of 4.0-4.3 s) and a
        refused one costs only starting and ending mpiexec (about 0.5 s). Without one
        (ranks >= slots) the two share the CPU: measured on 2 slots with 4 ranks, a refused job took
        2.0-3.6 s instead of 1.5-1.8 s (a file of such refusals, tests/test_untrusted_input.py, 191 s instead
        of 119 s), while a job that ran gained about a second (bfexp steps=1: 11.4 s instead of 12.8 s). Few
        ranks, too: the memory check comes with the dry build, after this (ranks=1000 engine=mpi is refused
        there).
        """
        from bfexp.comm import PROCESS_ENGINES

        if engine.name not in PROCESS_ENGINES or not launcher.on_this_machine or "torch" in sys.modules:
            return False
        ranks, memory = int(ranks), available_memory()
        return ranks < processor_slots() and memory is not None and ranks * PROCESS_RANK_BYTES * 2 <= memory

    def go(self) -> None:
        self.taken = True  # the launch watches and ends them from here on
        results.write_text_atomic(self.gate, "go")

    def close(self) -> None:
        """After the job: the gate's folder goes (the log is the job's)."""
        self.log.close()
        shutil.rmtree(self._gate_dir, ignore_errors=True)

    def cancel(self) -> None:
        """End the waiting ranks and remove what starting them made (nothing once they were told to go)."""
        if self.taken:
            return
        self.taken = True
        terminate_session(self.proc)
        self.close()
        if self._made_logs:
            shutil.rmtree(self.run_dir / results.LOGS_DIR, ignore_errors=True)
