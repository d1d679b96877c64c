"""What the driver shows on its terminal: progress while ranks run, a table at the end.

Ranks under mpiexec write to pipes, where progress bars break; the driver
renders progress from rank 0's metrics stream instead.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from bfexp import results

console = Console(stderr=False)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ConsoleProgress:
    """A rich progress bar on a terminal; one plain line per record elsewhere (CI, pipes).

    Progress is counted in steps, or in epochs when the job is given `epochs`
    (the driver does not know the shard sizes, so it cannot count steps then), or
    in seconds of training time under a time budget (`budget_s`: the slowest rank's).
    """

    def __init__(self, total_steps: int, title: str, enabled: bool = True, epochs: int | None = None,
                 budget_s: float | None = None) -> None:
        self.epochs = epochs
        self.budget_s = budget_s
        self.total = float(budget_s) if budget_s else float(epochs) if epochs else float(total_steps)
        self.total_steps = total_steps
        self.title = title
        self.enabled = enabled
        self.interactive = enabled and console.is_terminal
        self._progress: Progress | None = None
        self._task = None
        self._last: tuple[float, float] | None = None

    def __enter__(self) -> "ConsoleProgress":
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=self.total, stats="starting ranks")
        elif self.enabled:
            console.print(f"{self.title}: starting ranks", highlight=False)
        return self

    def done(self, record: dict) -> float:
        """How far the job is, in the unit of `total` (steps, epochs or seconds)."""
        if self.budget_s:
            return float(record.get("time_s") or 0.0)
        if self.epochs:
            return float(record.get("epoch") or 0.0)
        return float(record.get("step") or 0)

    def eta_s(self, record: dict) -> float | None:
        """Seconds left at the pace since the previous record (start-up excluded), from the ranks' clock."""
        done, elapsed = self.done(record), record.get("elapsed_s")
        if not done or elapsed is None:
            return None
        last, self._last = self._last, (done, elapsed)
        if last is not None and done > last[0]:
            pace = (elapsed - last[1]) / (done - last[0])
        else:
            pace = elapsed / done
        return max(0.0, pace * (self.total - done))

    def stats(self, record: dict) -> str:
        where = f"step {record.get('step')}" + ("" if self.epochs or self.budget_s else f"/{self.total_steps}")
        if self.budget_s:
            where += f" (time {_fmt(record.get('time_s'), 3)}/{_fmt(float(self.budget_s), 3)} s)"
        if self.epochs:
            where += f" (epoch {_fmt(record.get('epoch'), 3)}/{self.epochs})"
        return (
            f"{where}  loss {_fmt(record.get('loss'))}  acc {_fmt(record.get('accuracy'), 3)}  "
            f"step {_fmt(record.get('step_time_s'), 3)} s"
        )

    def update(self, record: dict) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done(record), stats=self.stats(record))
        elif self.enabled:
            eta = self.eta_s(record)
            tail = f"  eta {_duration(eta)}" if eta is not None else ""
            console.print(f"  {self.stats(record)}{tail}", highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def figure(summary: dict, key: str, digits: int = 4) -> str:
    """A figure as the tables show it: the value, then its interval when it has one."""
    text = _fmt(summary.get(key), digits)
    bounds = results.INTERVALS.get(key)
    if bounds and summary.get(key) is not None and all(summary.get(b) is not None for b in bounds):
        low, high = (_fmt(summary[b], 3) for b in bounds)
        if low != high:
            text += f" [{low}, {high}]"
    return text


def reference_note(summary: dict) -> str | None:
    """Where the single-rank reference came from: measured in this job, or the cache (taken when, at what load)."""
    ref = summary.get("reference")
    if not isinstance(ref, dict):
        return None
    load = ref.get("load_average_1min")
    at = f" at load {load:.2f}" if isinstance(load, (int, float)) else ""
    if ref.get("source") == "cache":
        text = f"single-rank reference from the cache, measured {ref.get('measured_at')}{at}"
    elif ref.get("source") == "measured":
        text = f"single-rank reference measured in this job{at}"
        if ref.get("refreshed"):
            text += f" ({ref['refreshed']})"
    else:
        return None
    return text


def print_sweep_job(summary: dict, run_dir: str, done: int, total: int, left_s: float | None) -> None:
    """A sweep's job in one line (its table would scroll the sweep away; the sweep's table comes at its end):
    ``job 2/4 completed: dsgd on exp2, 4 ranks (threads): loss 0.67, accuracy 0.666, 1.3 s wall; about
    4 s left; results: DIR``."""
    figures = [f"{label} {figure(summary, key)}" for key, label in
               (("final_loss", "loss"), ("final_accuracy", "accuracy"), ("wall_time_s", "wall (s)"))
               if summary.get(key) is not None]
    what = (f"{summary.get('algorithm')} on {summary.get('topology')}, {summary.get('ranks')} ranks "
            f"({summary.get('engine')})")
    left = f"; about {left_s:.0f} s left" if left_s is not None and done < total else ""
    error = f": {summary['error']}" if summary.get("error") else ""
    console.print(f"job {done}/{total} {summary.get('status')}: {what}: {', '.join(figures) or 'no figures'}{error}"
                  f"{left}; results: {run_dir}", highlight=False, soft_wrap=True)


def print_summary(summary: dict, run_dir: str) -> None:
    title = f"{summary.get('algorithm')} on {summary.get('topology')}, {summary.get('ranks')} ranks ({summary.get('engine')})"
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for f in results.FIELDS:
        if f.job_table and f.key in summary:
            table.add_row(f.label, figure(summary, f.key))
    if summary.get("error"):
        table.add_row("error", str(summary["error"]))
    console.print(table)
    for note in (reference_note(summary), summary.get("contention")):
        if note:
            console.print(f"note: {note}", highlight=False)
    console.print(f"results: {run_dir}", highlight=False)
