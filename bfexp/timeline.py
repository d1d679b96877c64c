"""Per-rank timeline: a Chrome-trace JSON (``traceEvents``) that Perfetto opens.

Each rank writes its own file; the process id is the rank, so the files of
one run merge by concatenation (``python -m bfexp.timeline merge DIR``).
What it shows, on the rank's track:

* compute phases (forward, backward, step) as slices on the ``main`` thread,
  recorded by the training loop with ``span(timeline, "forward")``;
* the time the main thread is *blocked* in communication (a blocking call,
  or ``wait <op>`` on a nonblocking handle), nested in those phases;
* every communication op as an async slice (category ``comm``) from the call
  to its completion, with its bytes and peers, so an exchange that runs
  while backward computes shows up beside it: that is overlap.

Timestamps are ``time.perf_counter()`` in microseconds: Linux's monotonic
clock, shared by the processes of one host, so ranks line up.

Scripts turn it on with the environment variable ``BFEXP_TIMELINE=DIR``
(each rank writes DIR/rank<N>.json); bfexp runs with ``engine.timeline=true``
(RUN_DIR/timeline/rank<N>.json).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from bfexp.results import write_text_atomic

ENV_VAR = "BFEXP_TIMELINE"
MAIN_TID = 1
# Beyond this many events a rank stops recording (and says so in the file).
MAX_EVENTS = 2_000_000


def _us(t: float) -> float:
    return round(t * 1e6, 3)


class Timeline:
    """Events of one rank, kept in memory and written by ``save()``."""

    def __init__(self, path: str | os.PathLike, rank: int, label: str | None = None) -> None:
        self.path = Path(path)
        self.rank = int(rank)
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0, "args": {"name": label or f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}},
            {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": MAIN_TID, "args": {"name": "main"}},
        ]
        self.dropped = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # window ops finish on a helper thread

    @classmethod
    def from_env(cls, rank: int) -> "Timeline | None":
        """A timeline writing to $BFEXP_TIMELINE/rank<N>.json, or None when the variable is unset."""
        folder = os.environ.get(ENV_VAR)
        if not folder:
            return None
        return cls(Path(folder) / f"rank{rank}.json", rank)

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            if len(self.events) >= MAX_EVENTS:
                self.dropped += 1
                return
            self.events.append(event)

    # what engines and the training loop call --------------------------------
    def complete(self, name: str, t0: float, t1: float, cat: str = "compute", **args: Any) -> None:
        """A slice on the main thread from t0 to t1 (perf_counter seconds)."""
        event = {"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": MAIN_TID, "ts": _us(t0), "dur": _us(t1 - t0)}
        if args:
            event["args"] = args
        self._add(event)

    def blocked(self, op: str, t0: float, t1: float) -> None:
        """Time the main thread spent blocked in communication."""
        self.complete(op, t0, t1, cat="comm_blocked")

    def begin(self, op: str, t0: float, nbytes: int, **args: Any) -> tuple[int, str]:
        """Start an async comm slice; returns the token ``end`` takes."""
        ident = next(self._ids)
        self._add(
            {
                "ph": "b",
                "name": op,
                "cat": "comm",
                "id": ident,
                "pid": self.rank,
                "tid": MAIN_TID,
                "ts": _us(t0),
                "args": {"bytes": int(nbytes), **{k: _jsonable(v) for k, v in args.items()}},
            }
        )
        return ident, op

    def end(self, token: tuple[int, str], t1: float) -> None:
        ident, op = token
        self._add({"ph": "e", "name": op, "cat": "comm", "id": ident, "pid": self.rank, "tid": MAIN_TID, "ts": _us(t1)})

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute") -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, t0, time.perf_counter(), cat=cat)

    # output ---------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        with self._lock:
            events = list(self.events)
        meta = {"rank": self.rank, "clock": "perf_counter_us"}
        if self.dropped:
            meta["dropped_events"] = self.dropped
        return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta}

    def save(self) -> Path:
        """Write the trace (atomically) and return its path."""
        write_text_atomic(self.path, json.dumps(self.to_json(), separators=(",", ":")))
        return self.path


_NULL = contextlib.nullcontext()


def span(timeline: Timeline | None, name: str) -> contextlib.AbstractContextManager:
    """``with span(engine.timeline, "forward"):`` records a compute phase; no-op without a timeline."""
    return _NULL if timeline is None else timeline.span(name)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x) for x in v]
    return str(v)


def merge(folder: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Concatenate every rank<N>.json in ``folder`` into one trace (all ranks in one Perfetto view)."""
    folder = Path(folder)
    files = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
    if not files:
        raise FileNotFoundError(f"no rank*.json timeline files in {folder}")
    events: list = []
    for f in files:
        events.extend(json.loads(f.read_text())["traceEvents"])
    target = Path(out) if out is not None else folder / "all_ranks.json"
    write_text_atomic(target, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")))
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] != "merge":
        print("usage: python -m bfexp.timeline merge DIR [OUT.json]", file=sys.stderr)
        return 2
    try:
        path = merge(argv[1], argv[2] if len(argv) == 3 else None)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
