"""Where virtual ranks meet: the state the threads of one job share, and waiting without hanging.

The threads engine (bfexp.comm.threads) moves tensors in memory; this is
the meeting point it moves them through. Every rank numbers its
collectives (per group) and its exchanges; all ranks issue operations in
the same order (the MPI contract), so the numbers pair the calls up:

* a *collective* gathers one input per member and computes the result once
  (the first member to finish waiting computes, the others reuse it);
* an *exchange* gathers every rank's declaration (bfexp.comm.declarations),
  judges the table once, when the last rank declares, and holds the
  messages senders left for their receivers (snapshots taken at the call);
* *windows* are registered per name and rank, for peers to reach into.

Coordination is one lock and one condition variable per rank. Where MPI
would hang, waiting raises instead:

* when every live rank waits and none can proceed (operations called in
  different orders), or a rank waits for a rank that has already returned,
  every rank raises CommError saying who waits for whom;
* after ``abort`` (a rank failed, or the job was stopped) every rank blocked
  in, or later entering, a wait raises RankAborted (CommError stays a
  CommError), so no thread is left running.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from bfexp.comm.declarations import Declaration
from bfexp.comm.engine import Window, local_size_for
from bfexp.errors import CommError, ConfigError

__all__ = ["POLL_S", "RankAborted", "Rendezvous"]

# How often a blocked rank re-checks the world (seconds); hangs are found by
# the deadlock check, this only bounds how late a signal-driven abort is seen.
POLL_S = 0.5


class RankAborted(RuntimeError):
    """Raised in a rank thread because another rank failed or the job was stopped."""


@dataclass
class _Collective:
    """One collective call, matched across the members of a group by its sequence number."""

    kind: str
    detail: Any  # what every member must agree on (op, root, ...)
    members: tuple[int, ...]
    inputs: dict[int, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    computed: bool = False
    result: Any = None
    collected: int = 0


@dataclass
class _Exchange:
    """One exchange: every rank's declaration row, and the verdict on them."""

    declaration: Declaration  # the first declarer's: what the table is judged by
    rows: dict[int, np.ndarray] = field(default_factory=dict)
    checked: bool = False
    problems: list[str] = field(default_factory=list)
    received: int = 0

    def judge(self, size: int) -> None:
        """All declared: judge the table (one row per rank) once."""
        self.problems = self.declaration.verdict(np.stack([self.rows[r] for r in range(size)]))
        self.checked = True


class Rendezvous:
    """What the virtual ranks of one job share: collectives, exchanges and their mail, windows, failure."""

    def __init__(self, size: int, ranks_per_machine: int = 0, poll_s: float = POLL_S) -> None:
        if size < 1:
            raise ConfigError(f"ranks={size}; allowed: an integer >= 1")
        self.size = size
        self.local_size = local_size_for(size, ranks_per_machine)
        self.poll_s = poll_s
        self.lock = threading.Lock()
        self._wake = [threading.Condition(self.lock) for _ in range(size)]
        self._collectives: dict[tuple, _Collective] = {}
        self._exchanges: dict[int, _Exchange] = {}
        self._mail: dict[tuple[int, int, int], Any] = {}  # (dst, src, exchange number) -> payload
        self._waiting: dict[int, tuple[Callable[[], bool], Callable[[], list], str]] = {}
        self._windows: dict[str, dict[int, Window]] = {}
        self._failure: BaseException | None = None
        self._returned: set[int] = set()

    # failure ------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self._failure is not None

    def abort(self, exc: BaseException) -> None:
        """Make every rank raise ``exc``'s kind at its next engine call or wait (first failure wins)."""
        with self.lock:
            self._fail_locked(exc)

    def _fail_locked(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        for c in self._wake:
            c.notify_all()

    def raise_if_failed(self) -> None:
        exc = self._failure
        if exc is None:
            return
        if isinstance(exc, CommError):
            raise CommError(str(exc))
        raise RankAborted(str(exc))

    def _comm_error(self, message: str) -> CommError:
        """A hang found: every rank will raise it; return the error to raise here."""
        self._fail_locked(CommError(message))
        return CommError(message)

    def rank_returned(self, rank: int) -> None:
        """A rank's code has finished: ranks still waiting for it will never get it."""
        with self.lock:
            self._returned.add(rank)
            for c in self._wake:
                c.notify_all()

    def wait(self, rank: int, ready: Callable[[], bool], missing: Callable[[], list], what: str) -> None:
        """Block ``rank`` until ``ready()``; raise instead of hanging. Caller holds ``lock``.

        Hangs are found, not timed out: a rank waiting for one that has
        returned, or every live rank waiting with none ready, is a CommError
        for every rank.
        """
        self._waiting[rank] = (ready, missing, what)
        try:
            while True:
                self.raise_if_failed()
                if ready():
                    return
                gone = sorted(q for q in missing() if q in self._returned)
                if gone:
                    raise self._comm_error(
                        f"rank {rank}: {what} waits for rank {gone[0]}, which has already returned "
                        "(the ranks did not call the same operations)"
                    )
                if self._deadlocked():
                    raise self._comm_error(
                        f"deadlock: {self._describe_waits()} (the ranks called operations in different orders)"
                    )
                self._wake[rank].wait(self.poll_s)
        finally:
            del self._waiting[rank]

    def waiting(self) -> list[int]:
        """Ranks blocked in a wait now."""
        with self.lock:
            return sorted(self._waiting)

    def waits(self) -> dict[int, tuple[str, list[int]]]:
        """Each blocked rank: what it waits in and the ranks it waits for (the hang watchdog names them)."""
        with self.lock:
            return {r: (what, sorted(missing())) for r, (_, missing, what) in self._waiting.items()}

    def _deadlocked(self) -> bool:
        if len(self._waiting) + len(self._returned) < self.size:
            return False  # some rank still runs and may post what the others wait for
        return not any(ready() for ready, _, _ in self._waiting.values())

    def _describe_waits(self) -> str:
        parts = []
        for r in sorted(self._waiting)[:4]:
            _, missing, what = self._waiting[r]
            parts.append(f"rank {r} waits in {what} for rank {', '.join(map(str, sorted(missing())[:3]))}")
        more = len(self._waiting) - 4
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")

    def _notify(self, ranks: Iterable[int]) -> None:
        """Wake the given ranks (caller holds ``lock``)."""
        for r in ranks:
            self._wake[r].notify_all()

    # collectives -----------------------------------------------------------
    def post_collective(
        self, key: tuple, kind: str, detail: Any, members: tuple[int, ...], rank: int, value: Any
    ) -> _Collective:
        with self.lock:
            self.raise_if_failed()
            slot = self._collectives.get(key)
            if slot is None:
                slot = self._collectives[key] = _Collective(kind, detail, members)
            elif (slot.kind, slot.detail) != (kind, detail):
                other = next(iter(slot.inputs), "?")
                raise self._comm_error(
                    f"collective #{key[-1]} does not match: rank {rank} called {kind}{_fmt(detail)} "
                    f"but rank {other} called {slot.kind}{_fmt(slot.detail)}"
                )
            slot.inputs[rank] = value
            if len(slot.inputs) == len(members):
                self._notify(members)
            return slot

    def finish_collective(self, key: tuple, slot: _Collective, rank: int, compute: Callable[[dict], Any]) -> Any:
        """Wait for every member; the first to get here computes, the others reuse the result."""
        with self.lock:
            self.wait(
                rank,
                lambda: len(slot.inputs) == len(slot.members),
                lambda: [m for m in slot.members if m not in slot.inputs],
                slot.kind,
            )
        with slot.lock:
            if not slot.computed:
                slot.result = compute(slot.inputs)
                slot.computed = True
        with self.lock:
            slot.collected += 1
            if slot.collected == len(slot.members):
                self._collectives.pop(key, None)
        return slot.result

    def collective_ready(self, slot: _Collective) -> bool:
        with self.lock:
            self.raise_if_failed()
            return len(slot.inputs) == len(slot.members)

    # exchanges -----------------------------------------------------------
    def post_exchange(self, number: int, rank: int, declaration: Declaration, sends: dict[int, Any]) -> _Exchange:
        """Declare rank's part of exchange ``number`` and deliver its sends; the last rank to declare judges the table."""
        with self.lock:
            self.raise_if_failed()
            ex = self._exchanges.get(number)
            if ex is None:
                ex = self._exchanges[number] = _Exchange(declaration)
            elif ex.declaration.op != declaration.op:
                other = next(iter(ex.rows), "?")
                raise self._comm_error(
                    f"exchange #{number} does not match: rank {rank} called {declaration.op} "
                    f"but rank {other} called {ex.declaration.op}"
                )
            ex.rows[rank] = declaration.row
            for dst, payload in sends.items():
                self._mail[(dst, rank, number)] = payload
            if len(ex.rows) == self.size:
                ex.judge(self.size)
                self._notify(range(self.size))
            return ex

    def receive(self, rank: int, number: int, ex: _Exchange, srcs: Sequence[int]) -> dict[int, Any]:
        """Wait for the verdict; raise it when the declarations disagree, else take this rank's messages."""
        with self.lock:
            self.wait(
                rank,
                lambda: ex.checked,
                lambda: [r for r in range(self.size) if r not in ex.rows],
                ex.declaration.op,
            )
            ex.received += 1
            if ex.received == self.size:
                self._exchanges.pop(number, None)
            if ex.problems:  # drop whatever reached us: the engine stays usable
                for key in [k for k in self._mail if k[0] == rank and k[2] == number]:
                    del self._mail[key]
                raise ex.declaration.error(ex.problems)
            return {s: self._mail.pop((rank, s, number)) for s in srcs}

    def exchange_ready(self, ex: _Exchange) -> bool:
        with self.lock:
            self.raise_if_failed()
            return ex.checked

    # windows -------------------------------------------------------------
    def add_window(self, rank: int, window: Window) -> None:
        with self.lock:
            self._windows.setdefault(window.name, {})[rank] = window

    def window(self, name: str, rank: int) -> Window:
        """Rank ``rank``'s part of window ``name``, for a peer to reach into."""
        with self.lock:
            self.raise_if_failed()
            return self._windows[name][rank]

    def drop_window(self, name: str, rank: int) -> None:
        with self.lock:
            ranks = self._windows.get(name, {})
            ranks.pop(rank, None)
            if not ranks:
                self._windows.pop(name, None)


def _fmt(detail: Any) -> str:
    if detail is None:
        return "()"
    if isinstance(detail, tuple):
        return "(" + ", ".join(map(str, detail)) + ")"
    return f"({detail})"
