"""Start the ranks of one job and watch them to the end: one watch loop for MPI ranks, virtual ranks and
`bfexp-run`.

The driver (the Hydra process) never initializes MPI: mpiexec cannot be
nested inside an MPI process. It writes the resolved config into the run
directory, starts the launcher's command (`mpiexec -n R python -m mpi4py -m
bfexp.worker RUN_DIR`; bfexp.sessions), or the ranks as threads of this
process, follows rank 0's metrics stream for progress, and decides the
job's status. Ranks record their own failure in RUN_DIR/errors/rank<N>.json
(results.record_failure) before they die, so the driver names the rank and
the exception.

Nothing lost, nothing hangs, nothing leaks:

* a stop signal (bfexp.signals) asks the ranks to stop at their next
  logging step and write a checkpoint (bfexp.checkpoint); the job ends
  ``interrupted``, resumable; a second signal ends it at once;
* the hang watchdog (bfexp.watchdog) ends a job whose ranks wait in a
  communication call for ``timeout_s``, after they dump their stacks;
* a rank that failed while the others go on is followed down within
  FAILURE_GRACE_S; process ranks end with their session (bfexp.sessions),
  and a rank whose driver is gone ends itself;
* the driver holds a little disk in the run folder while ranks run
  (results.reserve_space), so a full disk still leaves room for
  summary.json, which always says why;
* before any rank starts, what this machine cannot run or hold is refused
  (bfexp.preflight).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from omegaconf import OmegaConf

from bfexp import budget, cgroups, checkpoint, config, results, summary as summaries, watchdog
from bfexp.config import job_kind, launcher_of
from bfexp.launchers import Launcher
from bfexp.preflight import check_engine, resolve_engine
from bfexp.sessions import TERMINATE_GRACE_S, EarlyRanks, killed_rank, lost_host, start_ranks, terminate_session
from bfexp.signals import SIGNALS, Signals
from bfexp.watchdog import Watchdog, dump_thread_stacks, live_heartbeats, read_heartbeats, signal_stack_dumps

# How often the watch loop looks at the ranks (seconds).
POLL_S = 0.1
# How long ranks get to exit after one of them failed, before the driver ends them.
FAILURE_GRACE_S = 5.0
# How long hung ranks get to write their stacks into their logs before they are ended.
DUMP_WAIT_S = 1.0


@dataclass
class JobResult:
    status: str
    run_dir: Path
    summary: dict = field(default_factory=dict)
    returncode: int | None = None


def write_job_config(cfg: Any, run_dir: Path) -> None:
    results.write_text_atomic(run_dir / results.CONFIG, OmegaConf.to_yaml(cfg, resolve=True))


# ---------------------------------------------------------------- the watch loop


class Ranks(Protocol):
    """A job's ranks as the watch loop sees them: processes of a session, or threads of this process."""

    waits: Callable[[], dict] | None  # who waits for whom (virtual ranks), for a hang's description

    def running(self, wait_s: float) -> bool: ...  # wait up to wait_s; whether they still run
    def failed(self) -> bool: ...  # a rank has failed
    def end(self, reason: str) -> None: ...  # end them now
    def dump_stacks(self, stuck: dict) -> None: ...  # every stack into the rank logs


class ProcessRanks:
    """Process ranks: the launcher's process, leading the session that holds them all."""

    waits = None

    def __init__(self, proc: subprocess.Popen, run_dir: Path) -> None:
        self.proc, self.errors = proc, Path(run_dir) / results.ERRORS_DIR

    def running(self, wait_s: float) -> bool:
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return True
        return False

    def failed(self) -> bool:
        return self.errors.exists()

    def end(self, reason: str) -> None:
        terminate_session(self.proc)  # mpiexec's whole session: no rank outlives the job

    def dump_stacks(self, stuck: dict) -> None:
        signal_stack_dumps(stuck)
        time.sleep(DUMP_WAIT_S)


class ThreadRanks:
    """Virtual ranks: the threads of a ThreadWorld."""

    def __init__(self, world: Any, run_dir: Path) -> None:
        self.world, self.run_dir, self.waits = world, run_dir, world.waits

    def running(self, wait_s: float) -> bool:
        return not self.world.join(wait_s)

    def failed(self) -> bool:
        return self.world.failed

    def end(self, reason: str) -> None:
        from bfexp.errors import RankAborted

        self.world.abort(RankAborted(reason))  # every rank raises at its next engine call, or wakes in a wait
        self.world.join(TERMINATE_GRACE_S)

    def dump_stacks(self, stuck: dict) -> None:
        dump_thread_stacks(self.run_dir, stuck)


def watch(ranks: Ranks, stop: Callable[[], str | None], follow: Callable[[], None] = lambda: None) -> str | None:
    """Watch ``ranks`` until they end: ``follow`` their output, end them when ``stop`` gives a reason (returned),
    or when a rank failed and the rest did not follow it down within FAILURE_GRACE_S."""
    failure_seen_at: float | None = None
    while ranks.running(POLL_S):
        reason = stop()  # first: a stop signal reaches the ranks however long following their output takes
        follow()
        if reason:
            ranks.end(reason)
            return reason
        if ranks.failed():
            failure_seen_at = failure_seen_at or time.monotonic()
            if time.monotonic() - failure_seen_at > FAILURE_GRACE_S:
                return None  # a rank failed and the rest did not go down with it (some stuck outside the engine)
    return None


class Ending:
    """A runner job's reasons to end early: stop signals and the hang watchdog, with the status each gives."""

    def __init__(self, cfg: Any, run_dir: Path, hangs: Watchdog, signals: Signals) -> None:
        self.cfg, self.run_dir, self.hangs, self.signals = cfg, run_dir, hangs, signals
        self.handled = signals.job_start
        self.status = results.FAILED
        self.stuck: list[dict] | None = None

    def reason(self, ranks: Ranks) -> str | None:
        """Why to end the job now, if at all (hung ranks dump their stacks first)."""
        reason = self.signal_reason() or self.hang_reason(ranks.waits)
        if self.stuck:
            ranks.dump_stacks(self.hangs.latest)
        return reason

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
        if not (self.hangs.training_started() or (self.run_dir / results.METRICS).exists()
                or budget.logged(self.run_dir)):
            return f"interrupted by {name} before training started"
        checkpoint.request_stop(self.run_dir, f"{name} to the driver")
        print(f"bfexp: {name}: the ranks stop at their next logging step (log_every={self.cfg.log_every}) and write "
              "a checkpoint; send the signal again to end them at once", file=sys.stderr, flush=True)
        return None

    def hang_reason(self, waits: Callable[[], dict] | None = None) -> str | None:
        """The watchdog's verdict: the stuck ranks (``waits``: who waits for whom, virtual ranks)."""
        stuck = self.hangs.check()
        if not stuck:
            return None
        self.status, self.stuck = results.FAILED, stuck
        return self.hangs.describe(stuck, waits() if waits else None)


# ---------------------------------------------------------------- the two kinds of ranks


def launch_mpi(cfg: Any, run_dir: Path, launcher: Launcher, on_record: Callable[[dict], None] | None = None,
               early: EarlyRanks | None = None) -> JobResult:
    """Run one job on process ranks (``early``: already started, waiting for the word to go)."""
    tail = budget.metrics_tail(cfg, run_dir)
    watch_ranks = Watchdog(float(cfg.timeout_s), int(cfg.ranks), lambda: read_heartbeats(run_dir), processes=True)
    started = time.monotonic()
    log = early.log if early is not None else open(run_dir / results.LOGS_DIR / "mpiexec.log", "wb")
    with contextlib.closing(log), SIGNALS.job() as signals:
        ending = Ending(cfg, run_dir, watch_ranks, signals)
        if early is not None:
            proc = early.proc
            early.go()
        else:
            proc = start_ranks(launcher, cfg, run_dir, log)
        ranks = ProcessRanks(proc, run_dir)
        try:
            reason = watch(ranks, lambda: ending.reason(ranks), lambda: _follow(tail, on_record))
        finally:
            ranks.end("the job is over")
            if early is not None:
                early.close()
            cgroups.clean_up(cfg, run_dir)  # a CPU-starved rank's cgroup: none outlives the job
        if reason is not None or proc.returncode != 0:
            reason = name_lost_hosts(launcher, reason, ending.stuck)
            launcher.clean_up(int(cfg.ranks))
    _follow(tail, on_record)
    budget.merge_records(cfg, run_dir, "measured")
    return finish(cfg, run_dir, proc.returncode, reason, time.monotonic() - started, status=ending.status,
                  stuck=ending.stuck)


def name_lost_hosts(launcher: Launcher, reason: str | None, stuck: list[dict] | None) -> str | None:
    """A hung job whose stuck ranks ran on other machines: add which of those machines no longer answer
    (a host or link that is down), asked through the launcher."""
    here = socket.gethostname()
    hosts = sorted({s["host"] for s in stuck or () if s.get("host") not in (None, here)})
    if not reason or not hosts:
        return reason
    down = launcher.unreachable(hosts)
    return reason + "".join(f"; host {h} does not answer ({why})" for h, why in sorted(down.items()))


def intra_op_threads(ranks: int) -> int:
    """torch threads per rank: R ranks each using every core thrash the machine."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def launch_threads(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job as virtual ranks: threads of this process, each running the worker's `run`, with MPI's files
    and status rules (a raising rank records its failure and aborts the others at their next engine call)."""
    import torch

    from bfexp.comm.stacked import freed_memory_kept
    from bfexp.comm.threads import ThreadWorld, routed_output
    from bfexp.errors import RankAborted
    from bfexp.worker import run

    from bfexp.comm import engine_class

    tail = budget.metrics_tail(cfg, run_dir)
    timeline_dir = run_dir / "timeline" if cfg.engine.get("timeline", False) else None
    node = {**OmegaConf.to_container(cfg.engine, resolve=True), "_partial_": True}
    # engine=stacked: ONE thread runs every rank as one batched program (bfexp.comm.stacked), supervised as a
    # world of one virtual rank; its engine holds the job's ranks.
    stacked = engine_class(cfg.engine.name).stacked
    threads = 1 if stacked else int(cfg.ranks)
    engine = config.build(node, "engine", **({"size": int(cfg.ranks)} if stacked else {}))  # (world, rank)
    world = ThreadWorld(threads, 0 if stacked else cfg.engine.ranks_per_machine, timeline_dir=timeline_dir,
                        engine=engine)
    watch_ranks = Watchdog(float(cfg.timeout_s), threads, lambda: live_heartbeats(run_dir), processes=False)

    def rank_main(engine: Any) -> dict:  # every rank reads the config the driver wrote, as an MPI rank does
        return run(OmegaConf.load(run_dir / results.CONFIG), engine, run_dir)

    def on_error(rank: int, exc: BaseException) -> None:
        if not isinstance(exc, RankAborted):  # the others only follow the failed rank down
            with contextlib.suppress(OSError):  # a full disk: the driver names the failure from world.errors
                results.record_failure(run_dir, rank, exc)

    started, reason = time.monotonic(), None
    saved_threads = torch.get_num_threads()
    # process-wide: set once, here. engine=stacked: one torch thread; its ops are many small batched
    # kernels, which two threads on this shared 2-core machine ran 3-5x slower than one (128 ranks).
    torch.set_num_threads(1 if stacked else intra_op_threads(threads))
    try:
        with SIGNALS.job() as signals, routed_output(run_dir / results.LOGS_DIR), \
                (freed_memory_kept() if stacked else contextlib.nullcontext()):
            ending = Ending(cfg, run_dir, watch_ranks, signals)
            ranks = ThreadRanks(world, run_dir)
            world.start(rank_main, on_error)
            reason = watch(ranks, lambda: ending.reason(ranks), lambda: _follow(tail, on_record))
    except OSError:  # the rank logs could not be flushed (a full disk): the job's outcome stands
        pass
    finally:
        if not world.alive():  # a rank thread still inside torch keeps the pool it runs on
            torch.set_num_threads(saved_threads)
    _follow(tail, on_record)
    budget.merge_records(cfg, run_dir, "simulated")
    stuck = world.alive()
    if stuck and reason is None and not world.errors:
        reason = f"rank threads {stuck[:8]} did not finish"
    own = {r: e for r, e in sorted(world.errors.items()) if not isinstance(e, RankAborted)}
    fallback = next((f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                     for r, e in own.items()), None)
    return finish(cfg, run_dir, 1 if world.errors or stuck else 0, reason, time.monotonic() - started,
                  status=ending.status, stuck=ending.stuck, fallback=fallback)


def _follow(tail: Any, on_record: Callable[[dict], None] | None) -> None:
    for record in tail.read_new():
        if on_record:
            on_record(record)


# ---------------------------------------------------------------- the verdict


def finish(cfg: Any, run_dir: Path, returncode: int | None, reason: str | None, wall_s: float,
           status: str = results.FAILED, stuck: list[dict] | None = None, fallback: str | None = None) -> JobResult:
    """Decide the job's status from what the ranks left behind, and make sure summary.json says it.

    ``reason``: why the driver ended the job (a signal, a hang), with the ``status`` that gives;
    ``fallback``: the failure the driver saw itself (virtual ranks) for when no rank could record one.
    """
    full = results.disk_full(run_dir)  # before the reserve is given back
    results.release_space(run_dir)
    errors = results.rank_errors(run_dir)
    summary = results.read_json(run_dir / results.SUMMARY)
    ended = summary.get("status") if summary else None
    if reason is None and not errors and ended in (results.COMPLETED, results.DIVERGED, results.INTERRUPTED) and returncode == 0:
        if ended != results.INTERRUPTED:  # the watchdog's records served; a stopped job keeps them for a look
            shutil.rmtree(run_dir / watchdog.HEARTBEAT_DIR, ignore_errors=True)
        return JobResult(ended, run_dir, summary, returncode)
    status = results.FAILED if errors or not reason else status
    error = results.describe_errors(errors) if errors else reason or fallback or _exit_error(run_dir, returncode)
    if full and full not in error:
        error += f"; {full}"
    extra: dict[str, Any] = {"wall_time_s": wall_s}
    if stuck:
        keys = ("rank", "step", "op", "where", "why", "stalled_s")
        extra["stuck_ranks"] = [{k: s.get(k) for k in keys} for s in stuck]
    manifest = checkpoint.latest(run_dir)
    if manifest:
        extra["checkpoint_step"] = manifest["step"]
    summary = summaries.failed_summary(cfg, run_dir, error, extra, status=status)
    return JobResult(status, run_dir, summary, returncode)


def _exit_error(run_dir: Path, returncode: int | None) -> str:
    error = f"ranks exited with code {returncode} before finishing"
    found = killed_rank(run_dir) or lost_host(run_dir) or results.exception_in_logs(run_dir) or \
        results.launcher_reason(run_dir)
    return f"{error}: {found}" if found else error


# ---------------------------------------------------------------- one job


def launch(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None, engine_choice: str | None = None,
           early: EarlyRanks | None = None, launcher: Launcher | None = None, checked: bool = False) -> JobResult:
    """Run one job with the engine its config names (engine=auto: the one it chooses).

    ``checked``: the caller (the CLI) resolved engine=auto and ran the preflight already, once, and
    ``engine_choice`` is its sentence (kept in the summary); ``launcher``: the job's, built once by the
    caller; ``early``: the job's ranks a caller started while it checked the job (engine mpi or nccl).
    """
    from bfexp.comm import engine_class

    run_dir = Path(run_dir)
    if job_kind(cfg) == "modeled":  # a cluster that is not here: the cost model answers, no rank starts
        write_job_config(cfg, run_dir)
        summary = summaries.modeled(cfg, run_dir)
        return JobResult(summary["status"], run_dir, summary, 0)
    choice = engine_choice
    if not checked:
        cfg, choice = resolve_engine(cfg)
    launcher = launcher or launcher_of(cfg)
    if not checked:
        check_engine(cfg, launcher)
    if choice:
        print(choice, flush=True)
    # A rerun of a failed job starts clean; one with a checkpoint continues from it (ConfigError when
    # the checkpoint belongs to another experiment).
    resumed = checkpoint.prepare(cfg, run_dir, int(cfg.steps) if cfg.get("epochs") is None else None)
    if resumed:
        print(f"resuming from the checkpoint at step {resumed['step']} in {run_dir}", flush=True)
    with SIGNALS.job():  # a signal from here on stops the ranks; the summary is written before it can end us
        (run_dir / results.LOGS_DIR).mkdir(parents=True, exist_ok=True)
        results.reserve_space(run_dir)
        write_job_config(cfg, run_dir)
        if engine_class(cfg.engine.name).processes:  # mpi; nccl: one MPI rank per GPU, MPI only bootstraps
            cgroups.check(cfg)
            result = launch_mpi(cfg, run_dir, launcher, on_record, early)
        else:
            result = launch_threads(cfg, run_dir, on_record)
        if choice and result.summary:
            result.summary["engine_choice"] = choice
            with contextlib.suppress(OSError):  # a full disk: the summary the job left stands
                results.write_json_atomic(run_dir / results.SUMMARY, result.summary)
    return result
