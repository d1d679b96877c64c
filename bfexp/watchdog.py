"""No job hangs silently: rank heartbeats, the driver's hang watchdog, stack dumps, injected faults.

Every rank has a Heartbeat: the step it is at, the communication call it is
inside (if any) and where that call was made from, as its engine records
them (``Engine.activity``: plain data the rank's own thread sets and clears;
nothing here walks another thread's frames or reads its locals, which is
not safe while that thread runs), and the engine's blocked-time counter,
which moves whenever a call completes. Process ranks
(mpi, nccl) write it to heartbeat/rank<N>.json from a helper thread about
once a second, in place and at a fixed size, so a full disk does not stop
it; that thread also ends the rank when the driver is gone, and when the
rank has waited in one call ORPHAN_GRACE_S longer than the driver's
timeout_s: by then the driver has ended the job, so a rank still waiting
cannot hear it (another machine whose link is down, or whose driver's
machine is gone) and ends itself. The driver reads virtual ranks'
heartbeats directly.

The driver's Watchdog declares a job hung when a rank has sat inside one
communication call, its counter unmoved, for ``timeout_s`` seconds (a rank
stuck in a collective, a deadlocked window, a peer that died without MPI
noticing), or a process rank has not written its heartbeat for that long
(frozen; once its engine runs), or has not started within max(timeout_s, STARTUP_S). Every rank
then dumps its Python stack into its log (process ranks: faulthandler on
SIGUSR2; virtual ranks: faulthandler's text of the driver's threads, once
the job is known to be stuck, cut into each rank's log), and the
summary names the stuck ranks, the call each was in, and on virtual ranks
whom each waited for; with them, the ranks that entered a communication call
since the last check (one whose call completes now and then over a link too
slow for timeout_s: what the stuck ones wait for). Computing for long is not
a hang; only waiting is.

Injected faults test how a job fails: ``fail_rank`` at ``fail_step`` does
``fail_mode``: raise (an exception), kill (SIGKILL itself), freeze (SIGSTOP
itself) or hang (sleep forever inside its next communication call).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bfexp import results

__all__ = ["Heartbeat", "NoEngine", "Watchdog", "at_step", "attach", "enable_stack_dumps", "read_heartbeats"]

HEARTBEAT_DIR = "heartbeat"
RECORD_BYTES = 1024  # one heartbeat, padded: rewritten in place, it never needs a new disk block
# Seconds between two checks: min(0.5, timeout_s / 4) unless this variable says otherwise (tests make
# checks frequent with it; the driver's watch loop comes round every 0.1 s).
CHECK_ENV = "BFEXP_WATCHDOG_CHECK_S"
# A process rank stuck in one communication call this much longer than timeout_s ends itself (see above).
ORPHAN_GRACE_S = 5.0
STARTUP_S = 120.0  # the longest a rank may take to start (imports, data, model) before it counts as hung
SILENT_S = 2.0  # a process rank beats at least every second: silent this long, it is not moving
DUMP_SIGNAL = signal.SIGUSR2
DRIVER_PID = "BFEXP_DRIVER_PID"
DRIVER_HOST = "BFEXP_DRIVER_HOST"
# A folder of the driver's that its ranks remove when it is gone (bfexp-run's temporary run folder).
DRIVER_SCRATCH = "BFEXP_DRIVER_SCRATCH"
PROCESS_ONLY_MODES = ("kill", "freeze")  # a virtual rank is a thread: these would hit the whole driver
# Ranks started while the driver finishes its checks wait for this file to say "go" (or "stop").
GATE = "BFEXP_GATE"

_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep
_local = threading.local()
_live: dict[str, dict[int, "Heartbeat"]] = {}  # run dir -> virtual rank -> its heartbeat
_live_lock = threading.Lock()


# ---------------------------------------------------------------- a rank's heartbeat


class NoEngine:
    """The engine of a rank whose program starts it later (bfexp-run's ranks: the script's first bf call);
    ``attach`` puts the real one in its place."""

    virtual, activity, comm_time_s = False, None, 0.0

    def __init__(self, rank: int) -> None:
        self.rank = rank


class Heartbeat:
    """A rank's progress as the driver sees it (see the module doc). Create it in the rank's own thread.
    ``step``: None for a program with no steps the driver counts (bfexp-run's)."""

    def __init__(self, engine: Any, run_dir: Path, period_s: float = 1.0, step: int | None = 0,
                 timeout_s: float = 0.0) -> None:
        self.engine = engine
        self.orphan_s = timeout_s + ORPHAN_GRACE_S if timeout_s > 0 else 0.0
        self.rank = int(engine.rank)
        self.run_dir = Path(run_dir)
        self.thread_id = threading.get_ident()
        self.step = step
        self.period_s = period_s
        self.host = socket.gethostname()
        self._stop = threading.Event()
        _local.heartbeat = self
        if engine.virtual:
            with _live_lock:
                _live.setdefault(str(self.run_dir), {})[self.rank] = self
        else:
            threading.Thread(target=self._write_loop, name="bfexp-heartbeat", daemon=True).start()

    def snapshot(self) -> dict:
        """The rank's state now, from plain attributes its own thread writes (safe from any thread)."""
        activity = self.engine.activity  # one read: the rank may leave the call meanwhile
        return {"rank": self.rank, "pid": os.getpid(), "host": self.host, "step": self.step,
                "comm_time_s": float(self.engine.comm_time_s), "op": activity.op if activity else None,
                "where": _where(activity) if activity else None, "time": time.time(),
                "engine": not isinstance(self.engine, NoEngine)}

    def _write_loop(self) -> None:
        folder = self.run_dir / HEARTBEAT_DIR
        fd = None
        driver = int(os.environ.get(DRIVER_PID, "0") or 0)
        local_driver = os.environ.get(DRIVER_HOST) == self.host
        first = True
        waiting: tuple[Any, float] = (None, time.monotonic())  # (the call and its counter, since when)
        while first or not self._stop.wait(self.period_s):
            first = False
            if driver and local_driver and not _alive(driver):  # the driver is gone (killed): nobody will
                shutil.rmtree(os.environ.get(DRIVER_SCRATCH) or os.devnull, ignore_errors=True)  # collect this
                os._exit(70)  # job; leave no orphan, nor the driver's scratch folder
            activity = self.engine.activity
            key = (activity.op, self.engine.comm_time_s) if activity is not None else None
            if key != waiting[0]:
                waiting = (key, time.monotonic())
            elif key is not None and self.orphan_s and time.monotonic() - waiting[1] > self.orphan_s:
                self._end_orphan(activity.op, time.monotonic() - waiting[1])
            try:
                if fd is None:
                    folder.mkdir(parents=True, exist_ok=True)
                    fd = os.open(folder / f"rank{self.rank}.json", os.O_RDWR | os.O_CREAT, 0o644)
                data = json.dumps(self.snapshot()).encode()[: RECORD_BYTES - 1]
                os.pwrite(fd, data + b" " * (RECORD_BYTES - 1 - len(data)) + b"\n", 0)
            except OSError:
                continue  # e.g. a full disk: the driver sees the heartbeat age and judges

    def _end_orphan(self, op: str, stalled_s: float) -> None:
        """Waited in ``op`` past the driver's timeout: say so with the stacks into this rank's log, and end."""
        print(f"bfexp: rank {self.rank} on {self.host} waited in {op} for {stalled_s:.0f} s, longer than its driver "
              f"waits (timeout_s + {ORPHAN_GRACE_S:g} s): the job is over or its driver unreachable; this rank ends "
              "itself", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(71)

    def close(self) -> None:
        self._stop.set()
        if getattr(_local, "heartbeat", None) is self:
            _local.heartbeat = None
        with _live_lock:
            _live.get(str(self.run_dir), {}).pop(self.rank, None)


@functools.lru_cache(maxsize=1024)
def _where(activity: Any) -> str:
    """An Engine.activity's call site as text (cached: hundreds of ranks sit at the same few lines)."""
    return activity.where(_ROOT)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def attach(engine: Any) -> None:
    """This thread's process rank started its engine after its heartbeat (a NoEngine): report its calls."""
    hb = getattr(_local, "heartbeat", None)
    if hb is not None and isinstance(hb.engine, NoEngine) and not engine.virtual:
        hb.engine = engine


def wait_at_gate(poll_s: float = 0.02) -> bool:
    """A rank started before the driver's last checks (sessions.EarlyRanks): start MPI, then wait for the
    driver's word. True: go on (the job's config is written); False: the driver refused the job, or is gone
    (killed): leave, having read and written nothing. A rank started without a gate goes on at once."""
    gate = os.environ.get(GATE)
    if not gate:
        return True
    from mpi4py import MPI  # noqa: F401  its start-up (a second for 4 ranks) overlaps the driver's checks

    driver = int(os.environ.get(DRIVER_PID, "0") or 0)
    while True:
        try:
            word = Path(gate).read_text()
        except OSError:  # not written yet
            word = ""
        if word == "go":
            return True
        if word == "stop":
            return False
        if driver and not _alive(driver):  # killed: nobody else will take its gate's folder away
            shutil.rmtree(Path(gate).parent, ignore_errors=True)
            return False
        time.sleep(poll_s)


def beat(step: int) -> None:
    """This thread's rank finished ``step``."""
    hb = getattr(_local, "heartbeat", None)
    if hb is not None:
        hb.step = step


def enable_stack_dumps() -> None:
    """A process rank: Python stacks of every thread into its log (stderr) on SIGUSR2 and on a crash."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)


# ---------------------------------------------------------------- the driver's side


def read_heartbeats(run_dir: Path) -> dict[int, dict]:
    """Process ranks' heartbeats (a record being rewritten is skipped: the next read gets it)."""
    out = {}
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank*.json"):
        try:
            out[int(path.stem[4:])] = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
    return out


def live_heartbeats(run_dir: Path) -> dict[int, dict]:
    """Virtual ranks' heartbeats, read from their threads now."""
    with _live_lock:
        beats = dict(_live.get(str(Path(run_dir)), {}))
    return {r: hb.snapshot() for r, hb in beats.items()}


class Watchdog:
    """Judges from heartbeats whether a job's ranks still make progress (see the module doc).

    ``read`` returns the latest heartbeat of each rank that has one;
    ``check()`` returns the stuck ranks' heartbeats (with ``stalled_s`` and
    ``why``) once the job counts as hung, else None.
    """

    def __init__(self, timeout_s: float, ranks: int, read: Callable[[], dict[int, dict]],
                 startup_s: float = STARTUP_S, processes: bool = True) -> None:
        self.timeout_s = float(timeout_s)
        self.ranks = ranks
        self.read = read
        self.startup_s = max(self.timeout_s, startup_s)
        self.processes = processes
        self.started = time.monotonic()
        self.latest: dict[int, dict] = {}
        self._seen: dict[int, tuple[Any, float]] = {}  # rank -> (the record's time, when it changed)
        self._waiting: dict[int, tuple[Any, float]] = {}  # rank -> ((op, counter), since when)
        self._next = 0.0
        self.check_s = float(os.environ.get(CHECK_ENV) or min(0.5, self.timeout_s / 4))

    def training_started(self) -> bool:
        """Whether some rank has finished a training step (heartbeats read now)."""
        self.latest.update(self.read())
        return any(int(h.get("step") or 0) >= 1 for h in self.latest.values())

    def check(self, now: float | None = None) -> list[dict] | None:
        now = time.monotonic() if now is None else now
        if not self.timeout_s or now < self._next:
            return None
        self._next = now + self.check_s
        self.latest.update(self.read())
        stalled = []  # every rank not moving now; the job is hung once one has not moved for timeout_s
        beside = []  # ranks that entered a communication call since the last check, or are outside one: named
        # beside a hang (the ranks the others wait for are either still moving bytes or have not arrived; a rank
        # held outside the calls bfexp tracks, as by a link that went down under a send being started, too)
        for rank in range(self.ranks):
            hb = self.latest.get(rank)
            if hb is None:
                if now - self.started >= self.startup_s:
                    stalled.append({"rank": rank, "why": f"never started (no heartbeat in {self.startup_s:g} s)",
                                    "stalled_s": now - self.started})
                continue
            stamp, changed = self._seen.get(rank, (None, now))
            if hb.get("time") != stamp:
                self._seen[rank] = (hb.get("time"), now)
                changed = now
            # Silence counts once the rank's engine runs: before, its program may still be importing (torch
            # loads its libraries holding the interpreter for seconds: the heartbeat thread cannot run).
            if self.processes and hb.get("engine", True) and now - changed > SILENT_S:
                stalled.append(dict(hb, why="no heartbeat (the process is frozen or gone)", stalled_s=now - changed))
                continue
            if hb.get("op") is None:
                self._waiting.pop(rank, None)
                beside.append(dict(hb, why="outside communication", stalled_s=0.0))
                continue
            key = (hb["op"], hb.get("where"), hb.get("comm_time_s"))
            since = self._waiting.get(rank, (None, now))
            if since[0] != key:
                self._waiting[rank] = (key, now)
                beside.append(dict(hb, why="in communication", stalled_s=0.0))
            elif now > since[1]:
                stalled.append(dict(hb, why="blocked in communication", stalled_s=now - since[1]))
        if any(s["stalled_s"] >= self.timeout_s for s in stalled):
            # a rank still moving bytes over a slow link, or one that has not arrived, is the one the others
            # wait for: named too
            return sorted(stalled + beside, key=lambda s: s["rank"])
        return None

    def describe(self, stuck: list[dict], waits: dict[int, tuple[str, list[int]]] | None = None,
                 stacks: str | None = "logs/rank<N>.log") -> str:
        """One line: which ranks, in which call, at which step; who waits for whom (virtual ranks); where
        their ``stacks`` went."""
        groups: dict[tuple, list[int]] = {}
        here = socket.gethostname()
        for s in stuck:
            host = s.get("host") if s.get("host") not in (None, here) else None  # another machine: named
            key = (s["why"], s.get("op"), s.get("where"), s.get("step"), host)
            groups.setdefault(key, []).append(s["rank"])
        parts = []
        for (why, op, where, step, host), ranks in sorted(groups.items(), key=lambda kv: (kv[0][3] or 0, kv[1])):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
            text = f"{who}{f' on {host}' if host else ''}: {why}"
            if op:
                text += f" in {op} ({where})"
            if step is not None:
                text += f" at step {step}"
            parts.append(text)
        waits = waits or {}
        waiters: dict[int, list[int]] = {}
        for rank, (_, missing) in sorted(waits.items()):
            for q in missing:
                waiters.setdefault(q, []).append(rank)
        for q, ranks in sorted(waiters.items()):
            if q not in waits:  # the ones everybody waits for, themselves waiting for nobody
                parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranks(ranks)} wait{'s' if len(ranks) == 1 else ''} "
                             f"for rank {q}")
        return f"hung: no progress for timeout_s={self.timeout_s:g} s; " + "; ".join(parts) + \
            (f"; Python stacks in {stacks}" if stacks else "")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def signal_stack_dumps(heartbeats: dict[int, dict]) -> None:
    """Process ranks on this machine: faulthandler dumps every thread's stack into the rank's log."""
    here = socket.gethostname()
    for hb in heartbeats.values():
        if hb.get("host") == here and hb.get("pid"):
            try:
                os.kill(int(hb["pid"]), DUMP_SIGNAL)
            except (ProcessLookupError, PermissionError):
                pass


def dump_thread_stacks(run_dir: Path, heartbeats: dict[int, dict]) -> None:
    """Virtual ranks of a job known to be stuck: every thread of this process into logs/stacks.log, as
    faulthandler writes it (in C, holding the interpreter, never reading a frame's locals), and each
    rank thread's part of that text into its own log."""
    logs = Path(run_dir) / results.LOGS_DIR
    with _live_lock:
        beats = dict(_live.get(str(Path(run_dir)), {}))
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "stacks.log", "w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            stacks = thread_stacks(f.read())
        for rank, hb in beats.items():
            text = stacks.get(hb.thread_id)
            if text is not None:
                with open(logs / f"rank{rank}.log", "a") as f:
                    f.write(f"\nStack of rank {rank} (hang watchdog, most recent call first):\n{text}")
    except OSError:
        pass  # a full disk: the summary still names the ranks


def thread_stacks(dump: str) -> dict[int, str]:
    """faulthandler's all-threads text cut per thread: thread id -> its frames' lines."""
    out: dict[int, str] = {}
    ident, lines = None, []
    for line in dump.splitlines(keepends=True):
        head = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if head:
            if ident is not None:
                out[ident] = "".join(lines)
            ident, lines = int(head.group(1), 16), []
        elif ident is not None:
            lines.append(line)
    if ident is not None:
        out[ident] = "".join(lines)
    return out


# ---------------------------------------------------------------- injected faults


def at_step(engine: Any, step: int, fail_rank: int | None = None, fail_step: int | None = None,
            fail_mode: str = "raise") -> None:
    """Before ``step``: record progress; run the injected fault (``fail_mode``) when this rank and step are the
    chosen ones (``fail_rank``, ``fail_step``)."""
    beat(step - 1)
    if fail_rank == engine.rank and step == fail_step:
        inject(str(fail_mode), engine, step)


def inject(mode: str, engine: Any, step: int) -> None:
    print(f"bfexp: injected fault fail_mode={mode} on rank {engine.rank} at step {step} "
          f"(time {time.time():.3f})", flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "hang":
        # The engine runs its fault inside each communication call (Engine.fault): the next one never returns.
        engine.fault = _sleep_forever(engine)
    else:
        raise RuntimeError(f"injected failure (fail_rank={engine.rank}, fail_step={step})")


def _sleep_forever(engine: Any) -> Callable[[], None]:
    world = getattr(engine, "world", None)  # virtual ranks wake when the job is aborted

    def sleep() -> None:
        while True:
            time.sleep(0.1)
            if world is not None:
                world.raise_if_failed()

    return sleep
