"""Start the ranks of one job and watch them to the end: one watch loop for MPI ranks, virtual ranks and
`bfexp-run`.

The driver (the Hydra process) never initializes MPI: mpiexec cannot be
nested inside an MPI process. It writes the resolved config into the run
directory, starts the launcher's command (`mpiexec -n R python -m mpi4py -m
bfexp.worker RUN_DIR`; bfexp.sessions), or the ranks as threads of this
process (bfexp.launchers.virtual), follows rank 0's metrics stream for progress, and decides the
job's status. Ranks record their own failure in RUN_DIR/errors/rank<N>.json
(results.record_failure) before they die, so the driver names the rank and
the exception.

Nothing lost, nothing hangs, nothing leaks (the stop rules: one ``Supervisor``, which
bfexp-run's launches use too):

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
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from omegaconf import OmegaConf, open_dict

from bfexp import budget, cgroups, checkpoint, results, summary as summaries, watchdog
from bfexp.config import job_kind, launcher_of, no_lockstep
from bfexp.launchers import Launcher, Local
from bfexp.preflight import AUTO_READS, check_engine, resolve_engine
from bfexp.schema import Settings
from bfexp.sessions import EarlyRanks, start_ranks, terminate_session
from bfexp.signals import SIGNALS, Signals
from bfexp.watchdog import Watchdog, read_heartbeats, signal_stack_dumps

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
    """A job's ranks as the watch loop sees them: processes of a session (``ProcessRanks``), or threads of
    this process (bfexp.launchers.virtual)."""

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


class Supervisor:
    """The stop rules of one watch over a job's ranks, for bfexp's jobs and bfexp-run's launches alike.

    * A stop signal (``signals``): a job (``job``: its log_every and run folder) asks its ranks to stop at
      their next logging step and write a checkpoint, and a second signal ends them at once (``status``
      interrupted either way); without ``job`` (bfexp-run) the first signal ends them.
    * Hung ranks (the watchdog ``hangs``): ended, named with their calls (their stacks, when ``dump``,
      dumped into their logs first; ``stacks`` says where in the message); ``stuck`` keeps them.
    * A rank that failed: the others get ``failure_grace_s`` to go down with it; then the watch ends
      (``end_failed``: ends them, "a rank failed"; else leaves them to the caller).
    """

    def __init__(self, hangs: Watchdog, signals: Signals | None = None, *, job: tuple[int, Path] | None = None,
                 failure_grace_s: float = FAILURE_GRACE_S, end_failed: bool = False, dump: bool = True,
                 stacks: str | None = "logs/rank<N>.log") -> None:
        self.hangs, self.signals, self.job = hangs, signals, job
        self.failure_grace_s, self.end_failed, self.dump, self.stacks = failure_grace_s, end_failed, dump, stacks
        self.handled = signals.job_start if signals is not None else 0
        self.status = results.FAILED
        self.stuck: list[dict] | None = None

    def watch(self, ranks: Ranks, follow: Callable[[], None] = lambda: None) -> str | None:
        """Watch ``ranks`` until they end: ``follow`` their output; end them when a rule gives a reason (returned)."""
        failure_seen_at: float | None = None
        while ranks.running(POLL_S):
            reason = self.signal_reason() or self.hang_reason(ranks)  # first: a signal acts however long follow takes
            follow()
            if not reason and ranks.failed():
                failure_seen_at = failure_seen_at or time.monotonic()
                if time.monotonic() - failure_seen_at > self.failure_grace_s:
                    if not self.end_failed:
                        return None  # a rank failed, the rest did not go down with it (some stuck outside the engine)
                    reason = "a rank failed"
            if reason:
                ranks.end(reason)
                return reason
        return None

    def signal_reason(self) -> str | None:
        """A new stop signal: a job's first asks for a stop at a step boundary, a second ends at once."""
        if self.signals is None or len(self.signals.received) == self.handled:
            return None
        received = self.signals.received
        first = len(received) - self.signals.job_start == 1
        self.handled = len(received)
        name = signal.Signals(received[-1]).name
        self.status = results.INTERRUPTED
        if self.job is None:
            return f"interrupted by {name}"
        if not first:
            return f"interrupted by {name} (a second signal: ended at once)"
        log_every, run_dir = self.job
        if not (self.hangs.training_started() or (run_dir / results.METRICS).exists() or budget.logged(run_dir)):
            return f"interrupted by {name} before training started"
        checkpoint.request_stop(run_dir, f"{name} to the driver")
        print(f"bfexp: {name}: the ranks stop at their next logging step (log_every={log_every}) and write "
              "a checkpoint; send the signal again to end them at once", file=sys.stderr, flush=True)
        return None

    def hang_reason(self, ranks: Ranks) -> str | None:
        """The watchdog's verdict: the stuck ranks, with who waits for whom (virtual ranks)."""
        stuck = self.hangs.check()
        if not stuck:
            return None
        self.status, self.stuck = results.FAILED, stuck
        reason = self.hangs.describe(stuck, ranks.waits() if ranks.waits else None, stacks=self.stacks)
        if self.dump:
            ranks.dump_stacks(self.hangs.latest)
        return reason


# ---------------------------------------------------------------- the two kinds of ranks


@dataclass(frozen=True)
class Job:
    """What the watch over one job's ranks needs of it, taken from its config by ``launch``: the run's
    settings, its engine and heterogeneity nodes, its identity (for a summary the ranks could not write), and
    whether its ranks log on their own (bfexp.config.no_lockstep)."""

    settings: Settings
    engine: Any
    heterogeneity: Any
    identity: dict
    no_lockstep: bool


def launch_mpi(job: Job, run_dir: Path, launcher: Launcher, on_record: Callable[[dict], None] | None = None,
               early: EarlyRanks | None = None) -> JobResult:
    """Run one job on process ranks (``early``: already started, waiting for the word to go)."""
    ranks_n = int(job.settings.ranks)
    tail = budget.metrics_tail(run_dir, ranks_n, job.no_lockstep)
    hangs = Watchdog(float(job.settings.timeout_s), ranks_n, lambda: read_heartbeats(run_dir), processes=True)
    started = time.monotonic()
    log = early.log if early is not None else open(run_dir / results.LOGS_DIR / "mpiexec.log", "wb")
    with contextlib.closing(log), SIGNALS.job() as signals:
        supervisor = Supervisor(hangs, signals, job=(job.settings.log_every, run_dir))
        if early is not None:
            proc = early.proc
            early.go()
        else:
            proc = start_ranks(launcher, job.engine, job.settings, run_dir, log)
        ranks = ProcessRanks(proc, run_dir)
        try:
            reason = supervisor.watch(ranks, lambda: _follow(tail, on_record))
        finally:
            ranks.end("the job is over")
            if early is not None:
                early.close()
            cgroups.clean_up(job.heterogeneity, run_dir)  # a CPU-starved rank's cgroup: none outlives the job
        if reason is not None or proc.returncode != 0:
            reason = name_lost_hosts(launcher, reason, supervisor.stuck)
            launcher.clean_up(ranks_n)
    _follow(tail, on_record)
    budget.merge_records(run_dir, ranks_n, "measured", job.no_lockstep)
    return finish(job.identity, run_dir, proc.returncode, reason, time.monotonic() - started, status=supervisor.status,
                  stuck=supervisor.stuck, launcher=launcher)


def name_lost_hosts(launcher: Launcher, reason: str | None, stuck: list[dict] | None) -> str | None:
    """A hung job whose stuck ranks ran on other machines: add which of those machines no longer answer
    (a host or link that is down), asked through the launcher."""
    here = socket.gethostname()
    hosts = sorted({s["host"] for s in stuck or () if s.get("host") not in (None, here)})
    if not reason or not hosts:
        return reason
    down = launcher.unreachable(hosts)
    return reason + "".join(f"; host {h} does not answer ({why})" for h, why in sorted(down.items()))


def launch_threads(job: Job, run_dir: Path, on_record: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job as virtual ranks (bfexp.launchers.virtual), watched as process ranks are."""
    from bfexp.launchers.virtual import VirtualRanks

    ranks_n = int(job.settings.ranks)
    tail = budget.metrics_tail(run_dir, ranks_n, job.no_lockstep)
    ranks = VirtualRanks(job.engine, ranks_n, run_dir)
    hangs = Watchdog(float(job.settings.timeout_s), ranks.threads, ranks.heartbeats, processes=False)
    started, reason = time.monotonic(), None
    try:
        with SIGNALS.job() as signals, ranks.started():
            supervisor = Supervisor(hangs, signals, job=(job.settings.log_every, run_dir))
            reason = supervisor.watch(ranks, lambda: _follow(tail, on_record))
    except OSError:  # the rank logs could not be flushed (a full disk): the job's outcome stands
        pass
    _follow(tail, on_record)
    budget.merge_records(run_dir, ranks_n, "simulated", job.no_lockstep)
    returncode, reason, fallback = ranks.outcome(reason)
    return finish(job.identity, run_dir, returncode, reason, time.monotonic() - started, status=supervisor.status,
                  stuck=supervisor.stuck, fallback=fallback)


def _follow(tail: Any, on_record: Callable[[dict], None] | None) -> None:
    for record in tail.read_new():
        if on_record:
            on_record(record)


# ---------------------------------------------------------------- the verdict


def finish(identity: dict, run_dir: Path, returncode: int | None, reason: str | None, wall_s: float,
           status: str = results.FAILED, stuck: list[dict] | None = None, fallback: str | None = None,
           launcher: Launcher | None = None) -> JobResult:
    """Decide the job's status from what the ranks left behind, and make sure summary.json says it (begun from
    the job's ``identity`` where the ranks wrote none).

    ``reason``: why the driver ended the job (a signal, a hang), with the ``status`` that gives;
    ``fallback``: the failure the driver saw itself (virtual ranks) for when no rank could record one;
    ``launcher``: the process ranks' (its ``diagnose`` reads its log when no rank said why).
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
    error = (results.describe_errors(errors) if errors
             else reason or fallback or _exit_error(run_dir, returncode, launcher))
    if full and full not in error:
        error += f"; {full}"
    extra: dict[str, Any] = {"wall_time_s": wall_s}
    if stuck:
        keys = ("rank", "step", "op", "where", "why", "stalled_s")
        extra["stuck_ranks"] = [{k: s.get(k) for k in keys} for s in stuck]
    manifest = checkpoint.latest(run_dir)
    if manifest:
        extra["checkpoint_step"] = manifest["step"]
    summary = summaries.failed_summary(identity, run_dir, error, extra, status=status)
    return JobResult(status, run_dir, summary, returncode)


def _exit_error(run_dir: Path, returncode: int | None, launcher: Launcher | None) -> str:
    error = f"ranks exited with code {returncode} before finishing"
    found = diagnosis(run_dir, launcher) or results.exception_in_logs(run_dir) or results.launcher_reason(run_dir)
    return f"{error}: {found}" if found else error


def diagnosis(run_dir: Path, launcher: Launcher | None) -> str | None:
    """The launcher's word, from its log, on ranks that went down unrecorded (Launcher.diagnose)."""
    try:
        log = (Path(run_dir) / results.LOGS_DIR / "mpiexec.log").read_text(errors="replace")
    except OSError:
        return None
    hosts = {r: hb.get("host") for r, hb in read_heartbeats(run_dir).items()}
    return (launcher or Local()).diagnose(log, hosts)


# ---------------------------------------------------------------- one job


def planned_flop(run_dir: Path) -> int:
    """One sample's forward FLOP as the driver's plan counted it (plan.json), 0 where no plan was written."""
    from bfexp.plan import Plan

    planned = Plan.read(run_dir)
    return planned.forward_flop_per_sample if planned is not None else 0


def launch(cfg: Any, run_dir: Path, on_record: Callable[[dict], None] | None = None, engine_choice: str | None = None,
           early: EarlyRanks | None = None, launcher: Launcher | None = None, checked: bool = False) -> JobResult:
    """Run one job with the engine its config names (engine=auto: the one it chooses).

    ``checked``: the caller (the CLI) resolved engine=auto and ran the preflight already, once, and
    ``engine_choice`` is its sentence (kept in the summary); ``launcher``: the job's, built once by the
    caller; ``early``: the job's ranks a caller started while it checked the job (engine mpi or nccl).
    """
    from bfexp.comm import engine_class

    run_dir = Path(run_dir)
    if job_kind(cfg.throughput_only, cfg.scaling) == "modeled":  # a cluster that is not here: the cost model answers, no rank starts
        write_job_config(cfg, run_dir)
        summary = summaries.modeled(
            summaries.job_identity(cfg, engine="cost model", batch_size=int(cfg.batch_size)), Settings.of(cfg), run_dir,
            topology=cfg.topology, model=cfg.model, dataset=cfg.dataset, scaling_node=cfg.scaling,
            algorithm=cfg.algorithm, engine=cfg.engine, forward_flop=planned_flop(run_dir))
        return JobResult(summary["status"], run_dir, summary, 0)
    choice = engine_choice
    if not checked:
        engine, choice = resolve_engine(cfg.engine, Settings.of(cfg), **{k: cfg.get(k) for k in AUTO_READS})
        if choice:  # engine=auto: the job runs on a copy of its config with the engine it chose
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.engine = engine
    launcher = launcher or launcher_of(cfg.get("launcher"))
    if not checked:
        check_engine(cfg.engine, int(cfg.ranks), launcher)
    if choice:
        print(choice, flush=True)
    # A rerun of a failed job starts clean; one with a checkpoint continues from it (ConfigError when
    # the checkpoint belongs to another experiment).
    resumed = checkpoint.prepare(checkpoint.experiment(cfg), run_dir,
                                 int(cfg.steps) if cfg.get("epochs") is None else None)
    if resumed:
        print(f"resuming from the checkpoint at step {resumed['step']} in {run_dir}", flush=True)
    with SIGNALS.job():  # a signal from here on stops the ranks; the summary is written before it can end us
        (run_dir / results.LOGS_DIR).mkdir(parents=True, exist_ok=True)
        results.reserve_space(run_dir)
        write_job_config(cfg, run_dir)
        settings = Settings.of(cfg)
        job = Job(settings, cfg.engine, cfg.get("heterogeneity"), summaries.job_identity(cfg),
                  no_lockstep(settings, cfg.algorithm))
        if engine_class(cfg.engine.name).processes:  # mpi; nccl: one MPI rank per GPU, MPI only bootstraps
            cgroups.check(job.heterogeneity)
            result = launch_mpi(job, run_dir, launcher, on_record, early)
        else:
            result = launch_threads(job, run_dir, on_record)
        if choice and result.summary:
            result.summary["engine_choice"] = choice
            with contextlib.suppress(OSError):  # a full disk: the summary the job left stands
                results.write_json_atomic(run_dir / results.SUMMARY, result.summary)
    return result
