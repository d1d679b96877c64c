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

Simulated time: every rank has a clock (seconds, from 0) that only its own
``advance`` moves forward, and that waiting sets: a collective's members
leave it at the largest of their clocks at posting, an exchange's receiver
at the largest of its own and its senders' clocks at posting (moving data
costs no simulated time). So clocks depend on what ranks do, never on how
the host scheduled their threads. ``start_schedule`` (collective) turns the
world into a discrete-event simulation for asynchronous algorithms: from
then on ONE rank thread runs at a time, the runnable rank with the smallest
clock (equal clocks: first come, first served; rank order at the start),
until its next ``advance`` or wait; so one-sided window operations take
effect in clock order, the same on every run.

At most ``running`` rank threads compute at once (the machine's cores, by
default): a rank gives up its running slot whenever it waits for others and
takes one again, first come first served, once its wait is over. Hundreds
of virtual ranks then take turns on the cores instead of all contending
for them (and for the interpreter: the driver's own thread, which watches
the job and answers signals, is never queued behind hundreds of ranks).
A rank waits for other ranks only through the engine, as MPI ranks,
which share no memory, must (never on a lock or barrier of its own that
another rank releases: it would hold its slot while it waits), and only
for ranks that are posting or waiting, so the slots never deadlock; one that polls a nonblocking op and finds it not done, or
that has run for ``QUANTUM_S`` while others are in line (asynchronous
algorithms seldom wait), hands its slot on to the next in line at its next
engine call, as the operating system would have taken its core: ranks
interleave as threads do, at the cost of a lock per hand-over.

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

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from bfexp.comm.declarations import Declaration
from bfexp.comm.engine import Window, local_size_for
from bfexp.errors import CommError, RankAborted, number_in

__all__ = ["POLL_S", "RankAborted", "Rendezvous"]

# How often a blocked rank re-checks the world (seconds); hangs are found by
# the deadlock check, this only bounds how late a signal-driven abort is seen.
POLL_S = 0.5
# How long a virtual rank runs on while others wait for a running slot (module doc).
QUANTUM_S = 0.005  # the interpreter's own switch interval (sys.getswitchinterval())



@dataclass
class _Collective:
    """One collective call, matched across the members of a group by its sequence number."""

    kind: str
    detail: Any  # what every member must agree on (op, root, ...)
    members: tuple[int, ...]
    inputs: dict[int, Any] = field(default_factory=dict)
    clocks: dict[int, float] = field(default_factory=dict)  # each member's clock when it posted
    lock: threading.Lock = field(default_factory=threading.Lock)
    computed: bool = False
    result: Any = None
    collected: int = 0


@dataclass
class _Exchange:
    """One exchange: every rank's declaration row, and the verdict on them."""

    declaration: Declaration  # the first declarer's: what the table is judged by
    rows: dict[int, np.ndarray] = field(default_factory=dict)
    clocks: dict[int, float] = field(default_factory=dict)  # each rank's clock when it posted
    checked: bool = False
    problems: list[str] = field(default_factory=list)
    received: int = 0

    def judge(self, size: int) -> None:
        """All declared: judge the table (one row per rank) once."""
        self.problems = self.declaration.verdict(np.stack([self.rows[r] for r in range(size)]))
        self.checked = True


class Rendezvous:
    """What the virtual ranks of one job share: collectives, exchanges and their mail, windows, failure."""

    def __init__(self, size: int, ranks_per_machine: int = 0, poll_s: float = POLL_S,
                 running: int | None = None) -> None:
        number_in("ranks", size, low=1, integer=True)
        self.size = size
        # Running slots (module doc): None lets every rank run at once.
        self.running = None if running is None else number_in("running", running, low=1, integer=True)
        self._free_slots = self.running or 0
        self._holding: dict[int, float] = {}  # ranks holding a running slot -> since when (monotonic)
        self._slot_queue: deque[int] = deque()  # ranks ready to go on, waiting for a slot, in arrival order
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
        # Simulated time (module doc): each rank's clock; in a scheduled world, who runs and who may.
        self.clock = [0.0] * size
        self.scheduled = False
        self._running: int | None = None
        self._queue: dict[int, tuple[float, int]] = {}  # runnable rank -> (clock, arrival number)
        self._arrivals = 0
        self._blocked: dict[int, tuple[Callable[[], bool], Callable[[], float]]] = {}  # rank -> (ready, its clock then)
        self._scheduling: set[int] = set()  # ranks that called start_schedule

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
            self._release_slot(rank)
            if self.scheduled:
                self._queue.pop(rank, None)
                self._blocked.pop(rank, None)
                if self._running == rank:
                    self._dispatch()
            for c in self._wake:
                c.notify_all()

    def wait(self, rank: int, ready: Callable[[], bool], missing: Callable[[], list], what: str,
             resume: Callable[[], float] | None = None) -> None:
        """Block ``rank`` until ``ready()``; raise instead of hanging. Caller holds ``lock``.

        Hangs are found, not timed out: a rank waiting for one that has
        returned, or every live rank waiting with none ready, is a CommError
        for every rank. ``resume()``: the rank's clock once ready (no earlier
        than its own). In a scheduled world the wait also gives up the turn.
        """
        self._waiting[rank] = (ready, missing, what)
        self._release_slot(rank)
        scheduled = self.scheduled
        if scheduled:
            self._blocked[rank] = (ready, resume or (lambda: self.clock[rank]))
            if self._running == rank:
                self._turn_out(rank)
                self._dispatch()
        try:
            while True:
                # What has completed stays completed, as on MPI: a collective every member joined
                # returns on every member even when one of them fails right after it (with no running
                # slot free then: the rank meets the failure at its next engine call).
                if scheduled:
                    if self._running == rank:
                        self._turn_in(rank)
                        return
                elif ready() and (self._take_slot(rank) or self.failed):
                    if resume is not None:
                        self.clock[rank] = max(self.clock[rank], resume())
                    return
                self.raise_if_failed()
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
            if rank in self._slot_queue:  # leaving by an exception: out of the line
                self._slot_queue.remove(rank)

    # running slots (module doc) ------------------------------------------
    def start_running(self, rank: int) -> None:
        """A rank thread's start: wait for a running slot (a scheduled world: for the rank's turn)."""
        with self.lock:
            if self.scheduled:
                self._take_turn(rank)
                self._turn_in(rank)
                return
            self._wait_for_slot(rank)

    def take_turns(self, rank: int) -> None:
        """``rank`` is at an engine call: having run ``QUANTUM_S`` with others in line, it hands on."""
        if self._slot_queue and time.monotonic() - self._holding.get(rank, math.inf) > QUANTUM_S:
            self.yield_slot(rank)

    def yield_slot(self, rank: int) -> None:
        """The next rank in line runs first; ``rank`` goes to the back of the line (e.g. it polled an op
        that is not done: no spinning rank keeps the ranks it waits for from running)."""
        if self.running is None or not self._slot_queue:
            return
        with self.lock:
            if self.scheduled or rank not in self._holding or not self._slot_queue:
                return
            self._release_slot(rank)
            self._wait_for_slot(rank)

    def _wait_for_slot(self, rank: int) -> None:
        """Block until ``rank`` holds a running slot; leave the line if the world fails meanwhile (caller
        holds ``lock``)."""
        try:
            while not self._take_slot(rank):
                self.raise_if_failed()
                self._wake[rank].wait(self.poll_s)
        finally:
            if rank in self._slot_queue:
                self._slot_queue.remove(rank)

    def _take_slot(self, rank: int) -> bool:
        """Take a running slot for ``rank`` if one is free and nobody is ahead in line, else join the line
        (caller holds ``lock``). Always True where slots do not apply (unlimited, or a scheduled world)."""
        if self.running is None or self.scheduled or rank in self._holding:
            return True
        if self._free_slots > 0 and (not self._slot_queue or self._slot_queue[0] == rank):
            if self._slot_queue:
                self._slot_queue.popleft()
            self._free_slots -= 1
            self._holding[rank] = time.monotonic()
            if self._free_slots and self._slot_queue:
                self._wake[self._slot_queue[0]].notify_all()
            return True
        if rank not in self._slot_queue:
            self._slot_queue.append(rank)
        return False

    def _release_slot(self, rank: int) -> None:
        """``rank`` stops running (it waits, or returned): the first in line gets its slot (caller holds ``lock``)."""
        if self._holding.pop(rank, None) is not None:
            self._free_slots += 1
            if self._slot_queue:
                self._wake[self._slot_queue[0]].notify_all()

    # simulated time --------------------------------------------------------
    def advance(self, rank: int, seconds: float) -> None:
        """Move ``rank``'s clock ``seconds`` on; in a scheduled world, give the turn to whoever is earliest."""
        with self.lock:
            self.raise_if_failed()
            self.clock[rank] += seconds
            if self.scheduled:
                self._enqueue(rank)
                self._dispatch()
                if self._running != rank:  # another rank is earlier: hand over (we hold the lock until we wait)
                    self._turn_out(rank)
                    self._take_turn(rank)
                    self._turn_in(rank)

    def start_schedule(self, rank: int) -> None:
        """Collective: from here on one rank runs at a time, earliest clock first (module doc).
        A world scheduled already (from its start: ``schedule_now``) has nothing to do."""
        with self.lock:
            if self.scheduled:
                return
            self._scheduling.add(rank)
            if len(self._scheduling) == self.size:
                self.schedule_now()
            else:
                self.wait(rank, lambda: self.scheduled,
                          lambda: [r for r in range(self.size) if r not in self._scheduling], "start_schedule")
            self._take_turn(rank)
            self._turn_in(rank)

    def schedule_now(self) -> None:
        """Turn the schedule on: every live rank queued in rank order, the first one's turn (caller holds
        ``lock``, or no rank runs yet). A rank thread started in a scheduled world first takes its turn."""
        self.scheduled = True
        self._running = None
        for r in range(self.size):  # rank order at equal clocks
            if r not in self._returned:
                self._enqueue(r)
        self._dispatch()
        self._notify(range(self.size))

    def take_turn(self, rank: int) -> None:
        """Block until it is ``rank``'s turn (a scheduled world; a rank thread's start)."""
        with self.lock:
            self._take_turn(rank)
            self._turn_in(rank)

    def _turn_out(self, rank: int) -> None:
        """``rank`` hands its turn on (caller holds ``lock``): a subclass saves what the rank owns."""

    def _turn_in(self, rank: int) -> None:
        """``rank`` has its turn again (caller holds ``lock``): a subclass puts back what it saved."""

    def _enqueue(self, rank: int) -> None:
        self._queue[rank] = (self.clock[rank], self._arrivals)
        self._arrivals += 1

    def _dispatch(self) -> None:
        """Give the turn to the earliest runnable rank (caller holds ``lock``): first the blocked
        ranks that can go on join the queue (rank order), at the clock their wait gives them."""
        for r in sorted(self._blocked):
            ready, resume = self._blocked[r]
            if ready():
                del self._blocked[r]
                self.clock[r] = max(self.clock[r], resume())
                self._enqueue(r)
        self._running = min(self._queue, key=self._queue.__getitem__) if self._queue else None
        if self._running is not None:
            del self._queue[self._running]
            self._wake[self._running].notify_all()

    def _take_turn(self, rank: int) -> None:
        while self._running != rank:
            self.raise_if_failed()
            self._wake[rank].wait(self.poll_s)

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
            slot.clocks[rank] = self.clock[rank]
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
                lambda: max(slot.clocks.values()),
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

    def collective_ready(self, slot: _Collective, rank: int | None = None) -> bool:
        with self.lock:
            self.raise_if_failed()
            ready = len(slot.inputs) == len(slot.members)
        if not ready and rank is not None:
            self.yield_slot(rank)
        return ready

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
            ex.clocks[rank] = self.clock[rank]
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
                lambda: max([self.clock[rank], *(ex.clocks[s] for s in srcs)]),
            )
            ex.received += 1
            if ex.received == self.size:
                self._exchanges.pop(number, None)
            if ex.problems:  # drop whatever reached us: the engine stays usable
                for key in [k for k in self._mail if k[0] == rank and k[2] == number]:
                    del self._mail[key]
                raise ex.declaration.error(ex.problems)
            return {s: self._mail.pop((rank, s, number)) for s in srcs}

    def exchange_ready(self, ex: _Exchange, rank: int | None = None) -> bool:
        with self.lock:
            self.raise_if_failed()
            ready = ex.checked
        if not ready and rank is not None:
            self.yield_slot(rank)
        return ready

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
