"""What the driver shows on its terminal: progress while ranks run, a table at the end.

Ranks under mpiexec write to pipes, where progress bars break; the driver
renders progress from rank 0's metrics stream instead.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=False)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


class ConsoleProgress:
    """A rich progress bar on a terminal; one plain line per record elsewhere (CI, pipes)."""

    def __init__(self, total_steps: int, title: str, enabled: bool = True) -> None:
        self.total = total_steps
        self.title = title
        self.enabled = enabled
        self.interactive = enabled and console.is_terminal
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> "ConsoleProgress":
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=self.total, stats="starting ranks")
        elif self.enabled:
            console.print(f"{self.title}: starting ranks", highlight=False)
        return self

    def update(self, record: dict) -> None:
        stats = (
            f"loss {_fmt(record.get('loss'))}  acc {_fmt(record.get('accuracy'), 3)}  "
            f"step {_fmt(record.get('step_time_s'), 3)} s"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=record.get("step", 0), stats=stats)
        elif self.enabled:
            console.print(f"  step {record.get('step')}/{self.total}  {stats}", highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


SUMMARY_ROWS = [
    ("status", "status"),
    ("final_loss", "loss"),
    ("final_accuracy", "accuracy"),
    ("consensus_distance", "consensus distance"),
    ("step_time_s", "step time (s)"),
    ("throughput_samples_per_s", "throughput (samples/s)"),
    ("wall_time_s", "wall time (s)"),
]


def print_summary(summary: dict, run_dir: str) -> None:
    title = f"{summary.get('algorithm')} on {summary.get('topology')}, {summary.get('ranks')} ranks ({summary.get('engine')})"
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, label in SUMMARY_ROWS:
        if key in summary:
            table.add_row(label, _fmt(summary[key]))
    if summary.get("error"):
        table.add_row("error", str(summary["error"]))
    console.print(table)
    console.print(f"results: {run_dir}", highlight=False)


def error(message: str) -> None:
    """The one-line error format for bad input."""
    print(f"bfexp: error: {message}", file=sys.stderr)
