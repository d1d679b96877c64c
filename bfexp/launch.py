"""Spawn and watch the ranks of one job.

The driver (the Hydra process) never initializes MPI: mpiexec cannot be
nested inside an MPI process. It writes the resolved config into the run
directory, starts `mpiexec -n R python -m mpi4py -m bfexp.worker RUN_DIR`
(mpi4py's runner aborts every rank when one raises), follows rank 0's
metrics stream for progress, and decides the job's status. Ranks record
their own failure in RUN_DIR/errors/rank<N>.json before they die, so the
driver can name the rank and the exception.

Nothing lost, nothing hangs, nothing leaks:

* a stop signal (Signals: SIGINT, SIGTERM, SIGUSR1) asks the ranks to stop
  at their next logging step and write a checkpoint (bfexp.checkpoint); the
  job ends ``interrupted``, resumable; a second signal ends it at once;
* the hang watchdog (bfexp.watchdog) ends a job whose ranks wait in a
  communication call for ``timeout_s``, after they dump their stacks;
* ranks are ended through mpiexec's session, which holds every rank also
  while mpiexec is still starting them (Open MPI gives each rank a process
  group of its own), and a rank whose driver is gone ends itself;
* the driver holds a little disk in the run folder while ranks run, so a
  full disk still leaves room for summary.json, which always says why;
* before any rank starts, more ranks than this machine's memory holds are
  refused (``check_memory``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import OmegaConf, open_dict

from bfexp import checkpoint, results, watchdog
from bfexp.errors import ConfigError, Interrupted, LaunchError
from bfexp.config import launcher_of
from bfexp.launchers import Launcher, processor_slots
from bfexp.watchdog import Watchdog, dump_thread_stacks, live_heartbeats, read_heartbeats, signal_stack_dumps

# Environment that marks a process as part of an MPI job; a child mpiexec
# that inherits it believes it is nested and fails.
INHERITED_MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "MPI_LOCALRANKID")
# How long ranks get to exit after one of them failed, before the driver kills them.
FAILURE_GRACE_S = 5.0
# How long ranks get to exit after SIGTERM before SIGKILL.
TERMINATE_GRACE_S = 3.0
# How long hung ranks get to write their stacks into their logs before they are ended.
DUMP_WAIT_S = 1.0
# What the driver answers (Signals): Ctrl-C, kill, and Slurm's warning before a time limit.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Disk held in the run folder while ranks run, given back to write the summary when the disk fills up.
RESERVE = ".space_reserve"
RESERVE_BYTES = 64 * 1024
# Memory one rank needs besides its model: a process with torch and mpi4py imported (about 230 MB
# resident here), or a virtual rank's thread, engine and data shard (the default experiment's 128
# virtual ranks take about 0.4 GB in all, the process alone 0.25); each rounded up. A rank holds
# its model about MODEL_COPIES times: parameters, gradients, the local optimizer's and the
# algorithm's buffers.
PROCESS_RANK_BYTES = 250 * 2**20
THREAD_RANK_BYTES = 2 * 2**20
MODEL_COPIES = 4


@dataclass
class JobResult:
    status: str
    run_dir: Path
    summary: dict = field(default_factory=dict)
    returncode: int | None = None


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


def launcher_command(launcher: Launcher, cfg: Any, program: list[str]) -> list[str]:
    """The command that starts the job's ranks, each running ``program``, as ``launcher`` spells it."""
    return launcher.command(int(cfg.ranks), program, [str(a) for a in cfg.engine.get("mpiexec_args", [])])


def launcher_environment(launcher: Launcher, ranks: int) -> dict[str, str]:
    """The ranks' environment: the driver's without MPI state, threads per rank from the ranks sharing a
    machine, and what the launcher adds."""
    return launcher.environment(ranks, rank_environment(ranks, launcher.threads_per_rank(ranks)))


def write_job_config(cfg: Any, run_dir: Path) -> None:
    results.write_text_atomic(run_dir / results.CONFIG, OmegaConf.to_yaml(cfg, resolve=True))


def rank_errors(run_dir: Path) -> list[dict]:
    """Failures the ranks recorded, earliest first."""
    found = []
    for path in sorted((run_dir / results.ERRORS_DIR).glob("rank*.json")):
        record = results.read_json(path)
        if record:
            found.append(record)
    return sorted(found, key=lambda r: r.get("time", 0.0))


def describe_errors(errors: list[dict]) -> str:
    first = errors[0]
    text = f"rank {first['rank']}: {first['type']}: {first['message']}"
    others = sorted({e["rank"] for e in errors[1:]})
    if others:
        text += f" (also failed: ranks {', '.join(map(str, others))})"
    return text


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.*)$")


def exception_in_logs(run_dir: Path) -> str | None:
    """The last Python exception line a rank printed (for ranks that died
    before they could record their failure, e.g. on an import error)."""
    logs = run_dir / results.LOGS_DIR
    for path in sorted(logs.glob("rank*.log")) + [logs / "mpiexec.log"]:
        if not path.exists():
            continue
        for line in reversed(path.read_text(errors="replace").splitlines()):
            m = _EXCEPTION_LINE.match(line.strip())
            if m:
                rank = path.stem[4:] if path.stem.startswith("rank") else "?"
                return f"rank {rank}: {m.group(1)}: {m.group(2)}"
    return None


def failed_summary(cfg: Any, run_dir: Path, error: str, extra: dict | None = None, status: str = results.FAILED) -> dict:
    """A summary for a job that did not finish (failed or interrupted), keeping what rank 0 had logged."""
    from bfexp.worker import job_identity

    summary = results.read_json(run_dir / results.SUMMARY) or job_identity(cfg)
    records = results.read_jsonl(run_dir / results.METRICS)
    if records:
        last = records[-1]
        summary.setdefault("final_loss", last.get("loss"))
        summary.setdefault("final_accuracy", last.get("accuracy"))
        summary.setdefault("consensus_distance", last.get("consensus_distance"))
        summary["steps"] = last.get("step")
    summary.update(extra or {})
    summary["status"] = status
    summary["error"] = error
    results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary


class Signals:
    """SIGINT, SIGTERM and SIGUSR1 to the driver: Ctrl-C, `kill`, and what Slurm sends before a time limit.

    During a job the first one asks its ranks to stop at their next logging
    step and write a checkpoint there (before training started: end them at
    once); a second one ends them at once. Outside a job a signal raises
    Interrupted where the driver is. ``install`` (the CLI, for its whole
    run) or a ``job()`` block (a library caller) puts the handlers in place.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._depth = 0  # job() blocks under way (they nest: launch, then the engine's watch loop)
        self.job_start = 0  # signals received before the job began (each acted on then)
        self._old: dict[int, Any] = {}

    @property
    def in_job(self) -> bool:
        return self._depth > 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            try:
                self._old.setdefault(sig, signal.signal(sig, self._handle))
            except ValueError:  # not the main thread: the caller handles signals
                pass

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if not self.in_job:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def job(self) -> Iterator["Signals"]:
        """While ranks run: signals are flags the watch loop acts on."""
        installed = bool(self._old)
        if not installed:
            self.install()
        if not self._depth:
            self.job_start = len(self.received)
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if not installed:
                self.restore()


SIGNALS = Signals()


class Ending:
    """Why the driver ends a job now (None while it may go on), and the status that gives it."""

    def __init__(self, cfg: Any, run_dir: Path, watch: Watchdog, signals: Signals) -> None:
        self.cfg, self.run_dir, self.watch, self.signals = cfg, run_dir, watch, signals
        self.handled = signals.job_start
        self.status = results.FAILED
        self.stuck: list[dict] | None = None

    def signal_reason(self) -> str | None:
        """A new stop signal: the first asks for a stop at a step boundary, a second ends at once."""
        received = self.signals.received
        if len(received) == self.handled:
            return None
        first = len(received) - self.signals.job_start == 1
        self.handled = len(received)
        name = signal.Signals(received[-1]).name
        self.status = results.INTERRUPTED
        if not first:
            return f"interrupted by {name} (a second signal: ended at once)"
        if not self.watch.training_started() and not (self.run_dir / results.METRICS).exists():
            return f"interrupted by {name} before training started"
        checkpoint.request_stop(self.run_dir, f"{name} to the driver")
        print(f"bfexp: {name}: the ranks stop at their next logging step (log_every={self.cfg.log_every}) and write "
              "a checkpoint; send the signal again to end them at once", file=sys.stderr, flush=True)
        return None

    def hang_reason(self, waits: Callable[[], dict] | None = None) -> str | None:
        """The watchdog's verdict: the stuck ranks (``waits``: who waits for whom, virtual ranks)."""
        stuck = self.watch.check()
        if not stuck:
            return None
        self.status, self.stuck = results.FAILED, stuck
        return self.watch.describe(stuck, waits() if waits else None)


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
    """End mpiexec and every rank it started, also while it is still starting them.

    Open MPI gives each rank a process group of its own, so a group signal
    misses them; they stay in mpiexec's session, which outlives mpiexec. So:
    SIGTERM to the session, then SIGKILL to what is left.
    """
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


def reserve_space(run_dir: Path) -> None:
    """Hold a little disk in the run folder, so a full disk still leaves room for the summary."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / RESERVE, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        (Path(run_dir) / RESERVE).unlink(missing_ok=True)


def release_space(run_dir: Path) -> None:
    (Path(run_dir) / RESERVE).unlink(missing_ok=True)


def disk_full(run_dir: Path) -> str | None:
    """A sentence when the run folder's disk has (almost) no room left."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free > RESERVE_BYTES:
        return None
    return f"no space left on the run folder's disk ({free} bytes free in {run_dir})"


_KILLED = re.compile(r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+exited\s+on\s+signal\s+(\d+)")


def killed_rank(run_dir: Path) -> str | None:
    """mpiexec's word on a rank that died by a signal (e.g. SIGKILL by the OOM killer)."""
    try:
        text = (Path(run_dir) / results.LOGS_DIR / "mpiexec.log").read_text(errors="replace")
    except OSError:
        return None
    m = _KILLED.search(text)
    if not m:
        return None
    rank, pid, node, sig = m.groups()
    try:
        name = signal.Signals(int(sig)).name
    except ValueError:
        name = f"signal {sig}"
    return f"rank {rank} (pid {pid} on {node}) was killed by {name}"


def _start_ranks(cfg: Any, run_dir: Path, log: Any, env: dict[str, str] | None = None) -> subprocess.Popen:
    """mpiexec (or the launcher's command) starting the job's ranks, its output into ``log``."""
    launcher = launcher_of(cfg)
    env = launcher_environment(launcher, int(cfg.ranks)) | (env or {})
    env.update({watchdog.DRIVER_PID: str(os.getpid()), watchdog.DRIVER_HOST: socket.gethostname()})
    return subprocess.Popen(
        launcher_command(launcher, cfg, worker_command(run_dir)),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=os.getcwd(),
        start_new_session=True,  # one session holds mpiexec and every rank it starts
    )


class EarlyRanks:
    """A job's ranks started while the driver finishes its checks (torch's import, engine and dry build).

    Starting Python+torch+MPI ranks takes seconds, and so does the driver's import of torch; with a core
    free for the driver the two overlap (see ``wanted``). The ranks import, start MPI and wait at a gate
    file (watchdog.wait_at_gate) before they read the job's config: ``go``
    (launch_mpi, once the config is written) lets them run; ``cancel`` (bad input, a signal) ends them
    unseen, and takes away the log folder it made, so a refused job leaves nothing, as before. A driver
    that dies is seen by the waiting ranks, which leave. Local launcher only (the ranks watch the driver's pid).
    """

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        import tempfile

        self.run_dir = Path(run_dir)
        logs = self.run_dir / results.LOGS_DIR
        self._made_logs = not logs.exists()
        logs.mkdir(parents=True, exist_ok=True)
        self._gate_dir = Path(tempfile.mkdtemp(prefix="bfexp-gate-"))
        self.gate = self._gate_dir / "gate"
        self.log = open(logs / "mpiexec.log", "wb")
        self.taken = False
        self.proc = _start_ranks(cfg, self.run_dir, self.log, {watchdog.GATE: str(self.gate)})

    @staticmethod
    def wanted(cfg: Any) -> bool:
        """Worth it and safe: process ranks on this machine, with torch's import still ahead of the driver,
        a processor slot left for the driver beside every rank, and memory for them twice over.

        With a slot of its own the driver's checks run at full speed beside the ranks' start-up, so a job
        ends sooner by about torch's import (1-rank job on 2 slots: 3.0-3.2 s instead of 4.0-4.3 s) and a
        refused one costs only starting and ending mpiexec (about 0.5 s). Without one
        (ranks >= slots) the two share the CPU: measured on 2 slots with 4 ranks, a refused job took
        2.0-3.6 s instead of 1.5-1.8 s, and a job that ran gained nothing beyond noise. Few ranks, too: the
        memory check comes with the dry build, after this (ranks=1000 engine=mpi is refused there).
        """
        from bfexp.comm import PROCESS_ENGINES

        if cfg.engine.name not in PROCESS_ENGINES or not launcher_of(cfg).on_this_machine or "torch" in sys.modules:
            return False
        ranks, memory = int(cfg.ranks), available_memory()
        return ranks < processor_slots() and memory is not None and ranks * PROCESS_RANK_BYTES * 2 <= memory

    def go(self) -> None:
        self.taken = True  # launch_mpi watches and ends them from here on
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


def launch_mpi(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None,
               early: EarlyRanks | None = None) -> JobResult:
    """Run one job on MPI ranks and watch it to the end: never hangs (the watchdog), never leaves a rank behind.
    ``early``: the job's ranks, already started and waiting for the word to go."""
    run_dir = Path(run_dir)
    (run_dir / results.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    write_job_config(cfg, run_dir)
    tail = results.JsonlTail(run_dir / results.METRICS)
    watch = Watchdog(float(cfg.timeout_s), int(cfg.ranks), lambda: read_heartbeats(run_dir), processes=True)
    started = time.monotonic()
    failure_seen_at: float | None = None
    reason: str | None = None
    log = early.log if early is not None else open(run_dir / results.LOGS_DIR / "mpiexec.log", "wb")
    with contextlib.closing(log), SIGNALS.job() as signals:
        ending = Ending(cfg, run_dir, watch, signals)
        if early is not None:
            proc = early.proc
            early.go()
        else:
            proc = _start_ranks(cfg, run_dir, log)
        try:
            while proc.poll() is None:
                time.sleep(0.1)
                for record in tail.read_new():
                    if on_record:
                        on_record(record)
                reason = ending.signal_reason() or ending.hang_reason()
                if ending.stuck:
                    signal_stack_dumps(watch.latest)
                    time.sleep(DUMP_WAIT_S)
                if reason:
                    break
                if failure_seen_at is None and (run_dir / results.ERRORS_DIR).exists():
                    failure_seen_at = time.monotonic()
                if failure_seen_at is not None and time.monotonic() - failure_seen_at > FAILURE_GRACE_S:
                    break  # a rank failed and the rest did not go down with it
        finally:
            terminate_session(proc)
            if early is not None:
                early.close()
    for record in tail.read_new():
        if on_record:
            on_record(record)
    return finish(cfg, run_dir, proc.returncode, reason, time.monotonic() - started, status=ending.status,
                  stuck=ending.stuck)


def intra_op_threads(ranks: int) -> int:
    """torch threads per rank: R ranks each using every core thrash the machine."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def launch_threads(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job as virtual ranks: threads of this process, each running the worker's `train`.

    Same files and same status rules as MPI: rank 0 writes metrics.jsonl (followed
    here), a raising rank records errors/rank<N>.json and aborts the others; stop
    signals, the hang watchdog and failures abort every rank thread at its next
    engine call (ranks blocked in the engine wake at once).
    """
    import torch

    from bfexp.comm.threads import RankAborted, ThreadWorld, routed_output
    from bfexp.worker import record_failure, run

    run_dir = Path(run_dir)
    (run_dir / results.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    write_job_config(cfg, run_dir)
    tail = results.JsonlTail(run_dir / results.METRICS)
    timeline_dir = run_dir / "timeline" if cfg.engine.get("timeline", False) else None
    world = ThreadWorld(cfg.ranks, cfg.engine.ranks_per_machine, timeline_dir=timeline_dir)
    watch = Watchdog(float(cfg.timeout_s), int(cfg.ranks), lambda: live_heartbeats(run_dir), processes=False)

    def rank_main(engine: Any) -> dict:
        # Every rank reads the config the driver wrote, exactly as an MPI rank does.
        return run(OmegaConf.load(run_dir / results.CONFIG), engine, run_dir)

    def on_error(rank: int, exc: BaseException) -> None:
        if not isinstance(exc, RankAborted):  # the others only follow the failed rank down
            try:
                record_failure(run_dir, rank, exc)
            except OSError:  # a full disk: the driver names the failure from world.errors
                pass

    def follow() -> None:
        for record in tail.read_new():
            if on_record:
                on_record(record)

    started = time.monotonic()
    reason: str | None = None
    failure_seen_at: float | None = None
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(intra_op_threads(cfg.ranks))  # process-wide: set once, here
    try:
        with SIGNALS.job() as signals, routed_output(run_dir / results.LOGS_DIR):
            ending = Ending(cfg, run_dir, watch, signals)
            world.start(rank_main, on_error)
            while not world.join(0.1):
                follow()
                reason = ending.signal_reason() or ending.hang_reason(world.waits)
                if ending.stuck:
                    dump_thread_stacks(run_dir, watch.latest)
                if not reason and world.failed:
                    failure_seen_at = failure_seen_at or time.monotonic()
                    if time.monotonic() - failure_seen_at > FAILURE_GRACE_S:
                        break  # some rank is stuck outside the engine; report without it
                if reason:
                    world.abort(RankAborted(reason))
                    world.join(TERMINATE_GRACE_S)
                    break
    except OSError:  # the rank logs could not be flushed (a full disk): the job's outcome stands
        pass
    finally:
        if not world.alive():  # a rank thread still inside torch keeps the pool it runs on
            torch.set_num_threads(saved_threads)
    follow()
    stuck = world.alive()
    if stuck and reason is None and not world.errors:
        reason = f"rank threads {stuck[:8]} did not finish"
    returncode = 1 if world.errors or stuck else 0
    own = {r: e for r, e in sorted(world.errors.items()) if not isinstance(e, RankAborted)}
    fallback = next((f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                     for r, e in own.items()), None)
    return finish(cfg, run_dir, returncode, reason, time.monotonic() - started, status=ending.status,
                  stuck=ending.stuck, fallback=fallback)


def finish(cfg: Any, run_dir: Path, returncode: int | None, reason: str | None, wall_s: float,
           status: str = results.FAILED, stuck: list[dict] | None = None, fallback: str | None = None) -> JobResult:
    """Decide the job's status from what the ranks left behind, and make sure summary.json says it.

    ``reason``: why the driver ended the job (a signal, a hang), with the
    ``status`` that gives; ``fallback``: the failure the driver saw itself
    (virtual ranks) for when no rank could record one.
    """
    full = disk_full(run_dir)  # before the reserve is given back
    release_space(run_dir)
    errors = rank_errors(run_dir)
    summary = results.read_json(run_dir / results.SUMMARY)
    ended = summary.get("status") if summary else None
    if reason is None and not errors and ended in (results.COMPLETED, results.DIVERGED, results.INTERRUPTED) and returncode == 0:
        if ended != results.INTERRUPTED:  # the watchdog's records served; a stopped job keeps them for a look
            shutil.rmtree(run_dir / watchdog.HEARTBEAT_DIR, ignore_errors=True)
        return JobResult(ended, run_dir, summary, returncode)
    if errors:
        error, status = describe_errors(errors), results.FAILED
    elif reason:
        error = reason
    elif fallback:
        error, status = fallback, results.FAILED
    else:
        status = results.FAILED
        error = f"ranks exited with code {returncode} before finishing"
        found = killed_rank(run_dir) or exception_in_logs(run_dir)
        if found:
            error += f": {found}"
    if full and full not in error:
        error += f"; {full}"
    extra: dict[str, Any] = {"wall_time_s": wall_s}
    if stuck:
        keys = ("rank", "step", "op", "where", "why", "stalled_s")
        extra["stuck_ranks"] = [{k: s.get(k) for k in keys} for s in stuck]
    manifest = checkpoint.latest(run_dir)
    if manifest:
        extra["checkpoint_step"] = manifest["step"]
    summary = failed_summary(cfg, run_dir, error, extra, status=status)
    return JobResult(status, run_dir, summary, returncode)


def available_memory() -> int | None:
    """Bytes of memory available for new processes here (Linux's MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def check_memory(cfg: Any, parameters: int, element_bytes: int) -> None:
    """The job's memory check (``memory_fits``) from its config."""
    from bfexp.comm import engine_class

    engine = engine_class(cfg.engine.name)
    ranks = int(cfg.ranks)
    here = ranks if not engine.processes else launcher_of(cfg).ranks_per_host(ranks)
    memory_fits(engine, ranks, here, parameters * element_bytes)


def memory_fits(engine: Any, ranks: int, here: int, model_bytes: int) -> None:
    """Refuse (ConfigError: one line, exit 2) more ranks on this machine than its memory holds.

    ``here`` of the ``ranks`` ranks of ``engine`` (its class) run on this machine. One rank's footprint:
    PROCESS_RANK_BYTES for a process rank (THREAD_RANK_BYTES for a virtual one) plus MODEL_COPIES copies
    of the model in host memory (a GPU rank keeps its model on the GPU). Compared with MemAvailable.
    """
    model = 0 if engine.device_type == "cuda" else MODEL_COPIES * model_bytes
    per_rank = (PROCESS_RANK_BYTES if engine.processes else THREAD_RANK_BYTES) + model
    available = available_memory()
    if available is None or here * per_rank <= available:
        return
    kind = "processes" if engine.processes else "virtual ranks"
    fit = available // per_rank
    allowed = f"ranks <= {fit}" if fit else "a smaller model"
    if engine.processes:
        allowed += ", or engine=threads (virtual ranks share one process)"
    raise ConfigError(f"ranks={ranks} with engine={engine.name} needs about {_size(here * per_rank)} of memory "
                      f"({here} {kind} of about {_size(per_rank)} here) but {_size(available)} is available; "
                      f"allowed: {allowed}")


def check_engine(cfg: Any) -> None:
    """The job's preflight (``preflight``) from its config."""
    preflight(cfg.engine.name, int(cfg.ranks), launcher_of(cfg), int(cfg.engine.ranks_per_machine or 0))


def preflight(engine_name: str, ranks: int, launcher: Launcher, ranks_per_machine: int = 0) -> None:
    """Before any rank starts: the launcher's preflight (process ranks), and an engine this machine can run
    (LaunchError naming what is missing; a GPU engine needs a GPU per rank of a machine)."""
    from bfexp.comm import engine_class

    engine = engine_class(engine_name)
    per_machine: int | None = ranks_per_machine or None
    if engine.processes:
        launcher.check(ranks)
        if not launcher.on_this_machine:
            per_machine = launcher.ranks_per_host(ranks)
    ok, reason = engine.available(ranks, per_machine)
    if not ok:
        raise LaunchError(f"engine={engine_name} cannot run here: {reason}")


def choose_engine(cfg: Any) -> tuple[str, str]:
    """engine=auto: (engine, why). nccl when every rank has its own GPU; else mpi
    while ranks <= processor slots x slots_factor; else threads."""
    import importlib.util

    from bfexp.comm import engine_class

    ranks, engine = cfg.ranks, cfg.engine
    gpu_note = ""
    if importlib.util.find_spec("cupy") is not None:  # no CuPy: no GPU probe, no torch import here
        ok, why = engine_class("nccl").available(ranks, engine.ranks_per_machine or None)
        if ok:
            return "nccl", f"each of the {ranks} ranks has its own GPU"
        gpu_note = f"; not nccl: {why}"
    slots, factor = processor_slots(), float(engine.slots_factor)
    limit = f"{slots} processor slots x engine.slots_factor={factor:g} = {slots * factor:g}"
    if ranks <= slots * factor:
        return "mpi", f"ranks={ranks} fit {limit}{gpu_note}"
    if not runs_on(cfg, "threads"):
        return "mpi", f"ranks={ranks} exceed {limit}, but this algorithm needs a process per rank{gpu_note}"
    return "threads", f"ranks={ranks} exceed {limit}{gpu_note}"


def runs_on(cfg: Any, engine: str) -> bool:
    """Whether the job's algorithm can run on an engine (ddp needs one process per rank)."""
    from bfexp.comm import engine_class
    from bfexp.config import target_of

    try:
        target_of(cfg.algorithm, "algorithm").check_run(
            engine_class(engine), throughput_only=bool(cfg.throughput_only), modeled=bool(cfg.scaling.modeled))
    except ConfigError:
        return False
    return True


def resolve_engine(cfg: Any) -> tuple[Any, str | None]:
    """engine=auto: a copy of cfg running the engine it chooses, and the sentence saying why."""
    if cfg.engine.name != "auto":
        return cfg, None
    from bfexp.config import engine_config

    name, why = choose_engine(cfg)
    out = cfg.copy()
    with open_dict(out):
        out.engine = engine_config(cfg, name)
    return out, f"engine=auto chose {name}: {why}"


def launch(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None,
           engine_choice: str | None = None, early: EarlyRanks | None = None, checked: bool = False) -> JobResult:
    """Run one job with the engine its config names (engine=auto: the one it chooses).

    ``checked``: the caller (the CLI) resolved engine=auto and ran the preflight already, once, and
    ``engine_choice`` is its sentence (kept in the summary); ``early``: the job's ranks a caller started
    while it checked the job (then the engine is mpi or nccl).
    """
    from bfexp.comm import engine_class
    from bfexp.config import job_kind
    from bfexp.worker import modeled

    run_dir = Path(run_dir)
    if job_kind(cfg) == "modeled":  # a cluster that is not here: the cost model answers, no rank starts
        write_job_config(cfg, run_dir)
        summary = modeled(cfg, run_dir)
        return JobResult(summary["status"], run_dir, summary, 0)
    choice = engine_choice
    if not checked:
        cfg, choice = resolve_engine(cfg)
        check_engine(cfg)
    if choice:
        print(choice, flush=True)
    # A rerun of a failed job starts clean; one with a checkpoint continues from it (ConfigError when
    # the checkpoint belongs to another experiment).
    resumed = checkpoint.prepare(cfg, run_dir, int(cfg.steps) if cfg.get("epochs") is None else None)
    if resumed:
        print(f"resuming from the checkpoint at step {resumed['step']} in {run_dir}", flush=True)
    with SIGNALS.job():  # a signal from here on stops the ranks; the summary is written before it can end us
        reserve_space(run_dir)
        if engine_class(cfg.engine.name).processes:  # mpi; nccl: one MPI rank per GPU, MPI only bootstraps
            result = launch_mpi(cfg, run_dir, on_record, early)
        else:
            result = launch_threads(cfg, run_dir, on_record)
        if choice and result.summary:
            result.summary["engine_choice"] = choice
            with contextlib.suppress(OSError):  # a full disk: the summary the job left stands
                results.write_json_atomic(run_dir / results.SUMMARY, result.summary)
    return result
