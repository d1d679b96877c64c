"""What the driver does with a job's metrics stream: the logger group's options, and trackers.

Rank 0 always writes metrics.jsonl, and the driver follows it for its
progress display; a tracker receives the same records there. Logging from
the driver rather than from a rank keeps trackers out of the ranks (no
tracker process per rank, nothing to import under mpiexec) and works the
same for every engine.

A logger is a component like a launcher: conf/logger/<name>.yaml names its
class with ``_target_``, the constructor is its schema and checks its
options (bad input: ConfigError, exit 2), and ``tracker(identity, resolved,
run_dir)`` opens what receives the records: the job's identity (bfexp.summary.
job_identity) names the run, ``resolved`` (the job's config as plain data, as
written to its run folder) is what it records of the config. A user's own logger subclasses ``Logger``.

wandb is an optional extra. It runs offline unless the user chose a mode
(logger.mode or $WANDB_MODE): a run must never need a network or an
account, and `wandb sync <run dir>/wandb/offline-run-*` uploads it later.
TensorBoard (logger=tensorboard, the tensorboard extra) writes event files
into <run dir>/tensorboard/ with torch's SummaryWriter; `tensorboard
--logdir <run or sweep folder>` shows every job of a sweep as its own run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Sequence

from bfexp import results
from bfexp.errors import ConfigError

__all__ = ["Console", "Jsonl", "Logger", "Several", "TensorBoard", "TensorBoardTracker", "Tracker", "Trackers", "Wandb",
           "WandbTracker", "several"]

WANDB_INSTALL = "pip install 'bfexp[wandb]'"
TENSORBOARD_INSTALL = "pip install 'bfexp[tensorboard]'"
TENSORBOARD_DIR = "tensorboard"  # inside the run folder


class Tracker:
    """Receives every metrics record of one job, then its summary. Does nothing by default."""

    def log(self, record: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:
            self.finish({"status": results.FAILED, "error": f"driver stopped: {exc_type.__name__}"})


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float, str))}


def sweep_dir() -> Path | None:
    """The sweep folder when this process is a Hydra multirun, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return Path(hc.sweep.dir)


def wandb_mode(configured: str | None) -> str:
    """logger.mode, else the user's $WANDB_MODE, else offline."""
    return configured or os.environ.get("WANDB_MODE") or "offline"


class WandbTracker(Tracker):
    """One wandb run per job: the resolved config, every record, the summary."""

    def __init__(self, logger: "Wandb", identity: dict, resolved: dict, run_dir: Path) -> None:
        import wandb

        sweep = sweep_dir()
        if sweep is not None:
            name, group = run_dir.name, logger.group or str(sweep)
        else:
            name = f"{identity['algorithm']}-{identity['topology']}-x{identity['ranks']}-{run_dir.name}"
            group = logger.group
        self._finished = False
        self.run = wandb.init(
            project=logger.project,
            entity=logger.entity,
            group=group,
            name=name,
            job_type=identity["algorithm"],
            tags=list(logger.tags) or None,
            config=resolved,
            dir=str(run_dir),
            mode=wandb_mode(logger.mode),
            # The driver's own stdout and machine stats say nothing about training.
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log(self, record: dict) -> None:
        values = {k: v for k, v in _scalars(record).items() if k != "step"}
        step = record.get("step")
        self.run.log(values, step=int(step) if step is not None else None)

    def finish(self, summary: dict) -> None:
        if self._finished:
            return
        self._finished = True
        self.run.summary.update(_scalars(summary))
        self.run.finish(exit_code=0 if summary.get("status") in (results.COMPLETED, results.DIVERGED) else 1)


class TensorBoardTracker(Tracker):
    """One TensorBoard run per job, in <run dir>/tensorboard/: every record's numbers as scalars at its step,
    the resolved config as text, and at the end the summary's numbers under ``summary/`` and its status."""

    def __init__(self, resolved: dict, run_dir: Path) -> None:
        from omegaconf import OmegaConf
        from torch.utils.tensorboard import SummaryWriter  # the driver has torch by now (its dry build)

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))
        self.writer.add_text("config", "```\n" + OmegaConf.to_yaml(resolved) + "```", 0)
        self.step = 0
        self._finished = False

    def log(self, record: dict) -> None:
        self.step = int(record.get("step") or self.step)
        for key, value in _scalars(record).items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, self.step)

    def finish(self, summary: dict) -> None:
        if self._finished:
            return
        self._finished = True
        for key, value in _scalars(summary).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"summary/{key}", value, self.step)
        self.writer.add_text("summary/status", f"{summary.get('status')}: {summary.get('error') or ''}".rstrip(": "),
                             self.step)
        self.writer.close()


# ---------------------------------------------------------------- the logger group's options


def importable(package: str, what: str, install: str) -> None:
    """``package`` imported now (an optional extra a logger needs): missing, or installed but broken (its import
    raises), ConfigError in one line naming why and the command that installs it."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{what} needs the {package} package; install it with: {install}")
    try:
        importlib.import_module(package)
    except Exception as e:  # a broken install raises anything from its own import
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{what}: the {package} package is installed but does not import ({type(e).__name__}: "
                          f"{first}); allowed: reinstall it with: {install}, or another logger") from None



class Logger:
    """What the driver does with a job's records besides metrics.jsonl: a progress display (``progress``) and
    the tracker ``tracker`` opens. This base shows progress and tracks nothing."""

    name: ClassVar[str] = "logger"

    def __init__(self, progress: bool = True) -> None:
        """``progress``: the driver's progress display (a rich bar on a terminal, plain lines otherwise)."""
        self.progress = progress

    def tracker(self, identity: dict, resolved: dict, run_dir: Path) -> Tracker:
        """What receives the job's records and its summary (a do-nothing Tracker here). ``identity``: the job's
        (bfexp.summary.job_identity); ``resolved``: its config as plain data (OmegaConf.to_container, resolved)."""
        return Tracker()


class Console(Logger):
    """logger=console: progress in the driver, no tracker."""

    name: ClassVar[str] = "console"


class Jsonl(Logger):
    """logger=jsonl: metrics.jsonl only: no progress display, just the summary table at the end."""

    name: ClassVar[str] = "jsonl"

    def __init__(self, progress: bool = False) -> None:
        super().__init__(progress)


class Wandb(Logger):
    """logger=wandb: Weights & Biases from the driver, beside the progress display: one run per job, grouped
    by sweep."""

    name: ClassVar[str] = "wandb"

    def __init__(self, progress: bool = True, project: str = "bfexp", entity: str | None = None,
                 mode: Literal["offline", "online", "disabled"] | None = None, group: str | None = None,
                 tags: tuple[str, ...] = ()) -> None:
        """``mode`` null: $WANDB_MODE when the user set it, else offline (sync later with `wandb sync`);
        ``group`` null: the sweep folder for a multirun, none for a single run. wandb must be importable
        (the optional extra): ConfigError with the command that installs it."""
        importable("wandb", "logger=wandb", WANDB_INSTALL)
        super().__init__(progress)
        self.project, self.entity, self.mode, self.group, self.tags = project, entity, mode, group, tuple(tags)

    def tracker(self, identity: dict, resolved: dict, run_dir: Path) -> Tracker:
        """The job's wandb run. One that cannot start (e.g. online mode without a login) costs the job its
        tracking, not its training: one warning line, and the run goes on."""
        try:
            return WandbTracker(self, identity, resolved, Path(run_dir))
        except ImportError:
            raise  # the constructor checked; reaching here is a bug worth seeing
        except Exception as e:  # wandb raises its own error types for login/network problems
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"bfexp: warning: wandb did not start ({first}); the job runs without it", file=sys.stderr)
            return Tracker()


class TensorBoard(Logger):
    """logger=tensorboard: TensorBoard event files from the driver (torch's SummaryWriter), beside the progress
    display: one run per job in <run dir>/tensorboard/."""

    name: ClassVar[str] = "tensorboard"

    def __init__(self, progress: bool = True) -> None:
        """The tensorboard package must be importable (the optional extra): ConfigError with the command that
        installs it."""
        importable("tensorboard", "logger=tensorboard", TENSORBOARD_INSTALL)
        super().__init__(progress)

    def tracker(self, identity: dict, resolved: dict, run_dir: Path) -> Tracker:
        """The job's event files. A folder that cannot hold them (run/tensorboard a file, a full disk) costs the
        job its tracking, not its training: one warning line, and the run goes on."""
        try:
            return TensorBoardTracker(resolved, Path(run_dir))
        except Exception as e:  # the writer's OSError, a broken package's own error types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"bfexp: warning: tensorboard did not start ({type(e).__name__}: {first}); the job runs without it",
                  file=sys.stderr)
            return Tracker()


class Trackers(Tracker):
    """Several trackers as one: each record and the summary go to every one, in the order named."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def finish(self, summary: dict) -> None:
        for tracker in self.trackers:
            tracker.finish(summary)

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        for tracker in self.trackers:
            tracker.__exit__(exc_type, *exc)


class Several(Logger):
    """``logger=[wandb,tensorboard]``: every logger the list names (``loggers``, options of the logger group),
    each built from its own option's node with ``options[name]`` laid over it (Hydra merges a list's options
    into one node; the driver takes them apart, ``several``). Progress is shown when any of them shows it."""

    name: ClassVar[str] = "several"

    def __init__(self, loggers: Sequence[str] = (), options: Mapping[str, Mapping[str, Any]] | None = None,
                 progress: bool | None = None) -> None:
        from bfexp.components import build, option_node

        if not loggers:
            raise ConfigError("logger.loggers=[]; allowed: one or more options of the logger group, e.g. "
                              "logger=[wandb,tensorboard]")
        options = dict(options or {})
        self.loggers = [build({**option_node("logger", str(n)), **dict(options.get(str(n), {}))}, "logger")
                        for n in loggers]
        super().__init__(any(logger.progress for logger in self.loggers) if progress is None else progress)

    def tracker(self, identity: dict, resolved: dict, run_dir: Path) -> Tracker:
        return Trackers([logger.tracker(identity, resolved, run_dir) for logger in self.loggers])


def several(overrides: Sequence[str], merged: Mapping[str, Any]) -> dict[str, Any] | None:
    """The logger node of a list selection on the command line (``logger=[wandb,tensorboard]`` among
    ``overrides``, the last one of the group), or None for one option. Each named option's own node, with
    the keys the user set (``logger.project=x``) given to each logger that takes them.
    Hydra merges a list's options into one node, the last ``_target_`` winning: rebuilt apart here."""
    from bfexp.components import option_node

    chosen = [str(o) for o in overrides if str(o).partition("=")[0].lstrip("+") == "logger"]
    value = chosen[-1].partition("=")[2].strip() if chosen else ""
    if not (value.startswith("[") and value.endswith("]")):
        return None
    names = [n.strip().strip("'\"") for n in value[1:-1].split(",") if n.strip()]
    given = {str(o).lstrip("+").partition("=")[0].partition(".")[2] for o in overrides
             if str(o).lstrip("+").startswith("logger.")}  # the keys the user set: logger.project=x
    options = {n: {k: merged[k] for k in option_node("logger", n) if k in given and k in merged} for n in names}
    return {"_target_": f"{__name__}.Several", "loggers": names, "options": options}
