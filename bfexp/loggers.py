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
from typing import Any, ClassVar, Literal

from bfexp import results
from bfexp.errors import ConfigError

__all__ = ["Console", "Jsonl", "Logger", "TensorBoard", "TensorBoardTracker", "Tracker", "Wandb", "WandbTracker"]

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
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"logger=wandb needs the wandb package; install it with: {WANDB_INSTALL}")
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
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(f"logger=tensorboard needs the tensorboard package; install it with: {TENSORBOARD_INSTALL}")
        super().__init__(progress)

    def tracker(self, identity: dict, resolved: dict, run_dir: Path) -> Tracker:
        return TensorBoardTracker(resolved, Path(run_dir))
