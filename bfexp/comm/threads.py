"""Virtual ranks: every rank is a thread of one process; tensors move in memory.

128 MPI processes that each import torch do not fit a laptop; 128 threads
sharing one torch do. Each thread runs the very same worker, algorithm and
topology code through a ThreadsEngine, and the same seed gives the same
numbers as on MPI, to the bit where MPI's order is known:

* neighbor ops scale what a sender sends and combine what a receiver got
  exactly as the MPI engine does (``x * self_weight``, then ``add_`` of each
  source in ``src_weights`` order);
* allreduce adds in Open MPI's orders: recursive doubling for the blocking
  form (the MPI engine calls the tuned ``Allreduce``), the binomial tree for
  the nonblocking one (libnbc's in-place ``Iallreduce``); half precision is
  reduced in float32 as there.

Coordination is one lock and one condition variable per rank. Every rank
numbers its collectives and its exchanges; all ranks issue operations in
the same order (the MPI contract), so the numbers pair the calls up. Sends
are snapshots taken at the call. Like the MPI engine, every exchange
gathers every rank's declaration (sources, destinations, sizes, dtype) and
checks the whole table with the contract's own check before any receive
completes, so where MPI would hang this engine raises:

* a declaration mismatch (rank 3 expects from 1, 1 does not send to 3)
  raises the same CommError, with the same words, on every rank, and the
  engine stays usable;
* when every live rank waits and none can proceed (operations called in
  different orders), or a rank waits for a rank that has already returned,
  every rank raises CommError saying who waits for whom;
* a rank thread that raises aborts the world: every rank blocked in (or
  later entering) the engine raises RankAborted naming the failed rank, so
  no thread is left running.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO

import numpy as np
import torch

from bfexp.comm.engine import (
    DTYPE_CODES,
    HALF_DTYPES,
    CommError,
    DstWeights,
    Engine,
    Handle,
    TensorOrList,
    Weights,
    as_list,
    check_float,
    copy_back,
    dtype_name,
    first_dims,
    fuse,
    is_view_of,
    machine_problems,
    mismatch_error,
    normalize_dst,
    pattern_problems,
    restore,
    rows_shape,
    shape_signature,
    weighted_combine_,
)

# How often a blocked rank re-checks the world (seconds); hangs are found by
# the deadlock check, this only bounds how late a signal-driven abort is seen.
POLL_S = 0.5

_current = threading.local()


def current_rank() -> int | None:
    """The virtual rank this thread runs, or None outside rank threads."""
    return getattr(_current, "rank", None)


class RankAborted(RuntimeError):
    """Raised in a rank thread because another rank failed or the job was stopped."""


# ------------------------------------------------------------------ summation orders


def binomial_tree_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in the order of Open MPI's binomial-tree allreduce (libnbc's in-place Iallreduce).

    Ranks pair up (0+1, 2+3, ...), then pairs of pairs; an unpaired partial
    waits for a later round. IEEE addition is commutative, so this is MPI's
    result to the bit. Always a new tensor.
    """
    level = list(values)
    if len(level) == 1:
        return level[0].clone()
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def recursive_doubling_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in the order of Open MPI's recursive-doubling allreduce (the tuned blocking Allreduce).

    With p the largest power of two <= n, ranks 2k and 2k+1 (k < n - p) fold
    first; the p partials are then summed as a balanced binary tree.
    """
    n = len(values)
    if n == 1:
        return values[0].clone()
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    level = [values[2 * k] + values[2 * k + 1] for k in range(extra)] + list(values[2 * extra :])
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision is reduced in float32, as the MPI engine does."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


# ------------------------------------------------------------------ shared state


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
    """One exchange: every rank's declaration (as the MPI engine gathers them) and the verdict."""

    op: str
    units: int  # ranks, or machines for hierarchical ops
    check: Callable[[np.ndarray, np.ndarray, np.ndarray], list[str]]  # (headers, expects, sends) -> problems
    declared: dict[int, tuple[list[int], list[int], tuple[int, ...]]] = field(default_factory=dict)
    checked: bool = False
    problems: list[str] = field(default_factory=list)
    table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    received: int = 0

    def verdict(self, size: int) -> None:
        """All declared: build the table (one row per rank) and run the op's check once."""
        headers = np.array([self.declared[r][2] for r in range(size)], np.int64)
        expects = np.zeros((size, self.units), bool)
        sends = np.zeros((size, self.units), bool)
        for r in range(size):
            srcs, dsts, _ = self.declared[r]
            expects[r, srcs] = True
            sends[r, dsts] = True
        self.table = (headers, expects, sends)
        self.problems = self.check(headers, expects, sends)
        self.checked = True


@dataclass
class _RankWindow:
    """One rank's part of a window: own value and one slot per in-neighbor, each with a push-sum weight."""

    name: str
    own: torch.Tensor
    weight: float
    srcs: list[int]
    dsts: list[int]
    slots: dict[int, torch.Tensor]
    slot_weights: dict[int, float]
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def numel(self) -> int:
        return self.own.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.own.dtype

    @property
    def row_bytes(self) -> int:
        return self.own.numel() * self.own.element_size()


class ThreadWorld:
    """What the virtual ranks of one job share: collectives, mailboxes, windows, failure."""

    def __init__(
        self, size: int, ranks_per_machine: int = 0, poll_s: float = POLL_S, timeline_dir: Path | None = None
    ) -> None:
        if size < 1:
            raise ValueError(f"ranks={size}; allowed: an integer >= 1")
        if ranks_per_machine and size % ranks_per_machine:
            raise ValueError(f"ranks_per_machine={ranks_per_machine} does not divide {size} ranks")
        self.size = size
        self.local_size = ranks_per_machine or size
        self.poll_s = poll_s
        # Each rank's Chrome trace goes to <timeline_dir>/rank<N>.json (else $BFEXP_TIMELINE, as on MPI).
        self.timeline_dir = timeline_dir
        self.lock = threading.Lock()
        self._wake = [threading.Condition(self.lock) for _ in range(size)]
        self._collectives: dict[tuple, _Collective] = {}
        self._exchanges: dict[int, _Exchange] = {}
        self._mail: dict[tuple[int, int, int], Any] = {}  # (dst, src, exchange number) -> payload
        self._waiting: dict[int, tuple[Callable[[], bool], Callable[[], list], str]] = {}
        self.windows: dict[str, dict[int, _RankWindow]] = {}
        self._failure: BaseException | None = None
        self._returned: set[int] = set()
        # Rank threads (when started through ``start``) and what they left.
        self.threads: list[threading.Thread] = []
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}

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

    def notify(self, ranks: Iterable[int]) -> None:
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
                self.notify(members)
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
    def post_exchange(
        self,
        number: int,
        rank: int,
        op: str,
        units: int,
        declaration: tuple[list[int], list[int], tuple[int, ...]],
        check: Callable[[np.ndarray, np.ndarray, np.ndarray], list[str]],
        sends: dict[int, Any],
    ) -> _Exchange:
        """Declare rank's part of exchange ``number`` and deliver its sends; the last rank to declare checks the table."""
        with self.lock:
            self.raise_if_failed()
            ex = self._exchanges.get(number)
            if ex is None:
                ex = self._exchanges[number] = _Exchange(op, units, check)
            elif ex.op != op:
                other = next(iter(ex.declared), "?")
                raise self._comm_error(
                    f"exchange #{number} does not match: rank {rank} called {op} but rank {other} called {ex.op}"
                )
            ex.declared[rank] = declaration
            for dst, payload in sends.items():
                self._mail[(dst, rank, number)] = payload
            if len(ex.declared) == self.size:
                ex.verdict(self.size)
                self.notify(range(self.size))
            return ex

    def receive(self, rank: int, number: int, ex: _Exchange, srcs: Sequence[int]) -> dict[int, Any]:
        """Wait for the verdict; raise it when the declarations disagree, else take this rank's messages."""
        with self.lock:
            self.wait(
                rank,
                lambda: ex.checked,
                lambda: [r for r in range(self.size) if r not in ex.declared],
                ex.op,
            )
            ex.received += 1
            if ex.received == self.size:
                self._exchanges.pop(number, None)
            if ex.problems:  # drop whatever reached us: the engine stays usable
                for key in [k for k in self._mail if k[0] == rank and k[2] == number]:
                    del self._mail[key]
                raise mismatch_error(ex.op, ex.problems)
            return {s: self._mail.pop((rank, s, number)) for s in srcs}

    def exchange_ready(self, ex: _Exchange) -> bool:
        with self.lock:
            self.raise_if_failed()
            return ex.checked

    # running ranks -----------------------------------------------------------
    def start(
        self,
        target: Callable[["ThreadsEngine"], Any],
        on_error: Callable[[int, BaseException], None] | None = None,
        name: str = "bfexp-rank",
    ) -> None:
        """Run ``target(engine)`` on every rank, one thread each.

        A rank that raises aborts the world (the others raise RankAborted at
        their next engine call); ``on_error(rank, exc)`` runs inside the
        ``except`` block, so ``traceback.format_exc()`` works there.
        """
        for rank in range(self.size):
            t = threading.Thread(target=self._run_rank, args=(rank, target, on_error), name=f"{name}{rank}", daemon=True)
            self.threads.append(t)
        for t in self.threads:
            t.start()

    def _run_rank(self, rank: int, target: Callable, on_error: Callable | None) -> None:
        _current.rank = rank
        engine = ThreadsEngine(self, rank)
        try:
            self.results[rank] = target(engine)
        except BaseException as exc:  # noqa: BLE001 - a rank's failure is the job's, whatever it is
            self.errors[rank] = exc
            if not isinstance(exc, RankAborted):
                self.abort(
                    exc if isinstance(exc, CommError) else RankAborted(f"rank {rank} failed: {type(exc).__name__}: {exc}")
                )
            if on_error is not None:
                try:
                    on_error(rank, exc)
                except Exception:  # noqa: BLE001 - reporting must not mask the failure
                    traceback.print_exc()
        finally:
            engine.close()
            if engine.timeline is not None:
                engine.timeline.save()
            self.rank_returned(rank)
            _current.rank = None

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds in all for every rank thread; True when all have ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False
        return True

    def alive(self) -> list[int]:
        """Ranks whose thread is still running."""
        return [r for r, t in enumerate(self.threads) if t.is_alive()]


def _fmt(detail: Any) -> str:
    if detail is None:
        return "()"
    if isinstance(detail, tuple):
        return "(" + ", ".join(map(str, detail)) + ")"
    return f"({detail})"


def run_threads(
    size: int,
    target: Callable[["ThreadsEngine"], Any],
    ranks_per_machine: int = 0,
    timeout: float | None = 300.0,
) -> list[Any]:
    """Run ``target(engine)`` on ``size`` virtual ranks; return each rank's result.

    Re-raises the lowest rank's own failure (not the RankAborted of the
    others). For scripts and tests; the launcher adds logs and signals.
    """
    world = ThreadWorld(size, ranks_per_machine)
    world.start(target)
    if not world.join(timeout):
        world.abort(RankAborted(f"timed out after {timeout} s"))
        world.join(10.0)
        raise TimeoutError(f"virtual ranks {world.alive()} still running after {timeout} s")
    own = {r: e for r, e in world.errors.items() if not isinstance(e, RankAborted)}
    for errors in (own, world.errors):
        if errors:
            raise errors[min(errors)]
    return [world.results.get(r) for r in range(size)]


# ------------------------------------------------------------------ rank logs


class _RankLogs:
    """logs/rank<N>.log per virtual rank, opened on a rank's first write."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._files: dict[int, TextIO] = {}
        self._lock = threading.Lock()

    def file(self, rank: int) -> TextIO:
        f = self._files.get(rank)
        if f is None:
            with self._lock:
                f = self._files.get(rank)
                if f is None:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
                    f = self._files[rank] = open(self.log_dir / f"rank{rank}.log", "a", buffering=1)
        return f

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


class _RoutedStream:
    """sys.stdout/sys.stderr stand-in: a rank thread's writes go to its log, the driver's pass through."""

    def __init__(self, original: TextIO, logs: _RankLogs) -> None:
        self._original = original
        self._logs = logs

    def write(self, text: str) -> int:
        rank = current_rank()
        if rank is None:
            return self._original.write(text)
        return self._logs.file(rank).write(text)

    def flush(self) -> None:
        if current_rank() is None:
            self._original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


@contextlib.contextmanager
def routed_output(log_dir: Path) -> Iterator[None]:
    """Route what rank threads print to logs/rank<N>.log, as MPI ranks' output is (the driver owns the terminal)."""
    logs = _RankLogs(log_dir)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RoutedStream(saved[0], logs), _RoutedStream(saved[1], logs)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        logs.close()


# ------------------------------------------------------------------ the engine


class ThreadsEngine(Engine):
    """One virtual rank's view of a ThreadWorld: the Engine contract, tensors moved in memory."""

    name = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__()
        if not 0 <= rank < world.size:
            raise ValueError(f"rank={rank}; allowed: 0..{world.size - 1}")
        self.world = world
        self._rank = rank
        self._local_size = world.local_size
        # How many collectives (per group) and exchanges this rank has issued:
        # every rank issues operations in one order, so the numbers pair calls up.
        self._collective_seq: dict[Any, int] = {}
        self._exchange_seq = 0
        self._windows: dict[str, _RankWindow] = {}
        from bfexp.timeline import Timeline

        if world.timeline_dir is not None:
            self.timeline = Timeline(Path(world.timeline_dir) / f"rank{rank}.json", rank)
        else:
            self.timeline = Timeline.from_env(rank)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.world.size

    # plumbing ------------------------------------------------------------
    def _collective(
        self,
        kind: str,
        detail: Any,
        value: Any,
        compute: Callable[[dict], Any],
        deliver: Callable[[Any], Any],
        group: tuple[int, ...] | None = None,
    ) -> tuple[Callable[[], Any], Callable[[], bool]]:
        """Post this rank's part; return (wait, ready): wait for every member, compute once, deliver."""
        members = tuple(range(self.size)) if group is None else group
        name = "world" if group is None else group
        seq = self._collective_seq.get(name, 0) + 1
        self._collective_seq[name] = seq
        key = (name, seq)
        world, rank = self.world, self._rank
        slot = world.post_collective(key, kind, detail, members, rank, value)
        return (lambda: deliver(world.finish_collective(key, slot, rank, compute))), (lambda: world.collective_ready(slot))

    def _exchange(
        self,
        op: str,
        units: int,
        srcs: Sequence[int],
        dsts: Sequence[int],
        header: tuple[int, ...],
        check: Callable[[np.ndarray, np.ndarray, np.ndarray], list[str]],
        sends: dict[int, Any],
        recv_from: Sequence[int],
    ) -> tuple[Callable[[], dict], Callable[[], bool], _Exchange]:
        """Declare (srcs, dsts in ``units``; header), deliver ``sends`` (global ranks); return (receive, ready, exchange)."""
        self._exchange_seq += 1
        number = self._exchange_seq
        world, rank = self.world, self._rank
        ex = world.post_exchange(number, rank, op, units, (list(srcs), list(dsts), header), check, sends)
        return (lambda: world.receive(rank, number, ex, recv_from)), (lambda: world.exchange_ready(ex)), ex

    # collectives --------------------------------------------------------
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        return self._allreduce(tensors, op, inplace=False, order=binomial_tree_sum)

    def iallreduce_(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        return self._allreduce(tensors, op, inplace=True, order=binomial_tree_sum)

    def allreduce(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        # MPI's blocking form runs Open MPI's tuned algorithm: recursive doubling here.
        return self._blocking("allreduce", lambda: self._allreduce(tensors, op, False, recursive_doubling_sum).wait())

    def allreduce_(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        return self._blocking("allreduce_", lambda: self._allreduce(tensors, op, True, recursive_doubling_sum).wait())

    def _allreduce(
        self, tensors: TensorOrList, op: str, inplace: bool, order: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    ) -> Handle:
        started = time.perf_counter()
        self.check_op(op)
        tensors, single = as_list(tensors)
        if op == "avg":
            check_float(tensors, "allreduce(op='avg')")
        flat = fuse(tensors)
        view = is_view_of(flat, tensors)
        # What this rank contributes must not change before every rank has read it.
        mine = flat.to(work_dtype(flat.dtype), copy=True) if view or flat.dtype in HALF_DTYPES else flat
        n = self.size

        def compute(inputs: dict) -> torch.Tensor:
            total = order([inputs[r] for r in range(n)])
            return total.div_(n) if op == "avg" and n > 1 else total

        def deliver(total: torch.Tensor) -> TensorOrList:
            out = flat if (inplace or not view) else torch.empty_like(flat)
            out.copy_(total)
            return copy_back(out, tensors, single) if inplace else restore(out, tensors, single)

        wait, ready = self._collective("allreduce", (op, flat.numel(), str(flat.dtype)), mine, compute, deliver)
        return self._track("allreduce", _nbytes(flat), started, wait, ready, reduce=op)

    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        return self._broadcast(tensors, root, inplace=False)

    def ibroadcast_(self, tensors: TensorOrList, root: int = 0) -> Handle:
        return self._broadcast(tensors, root, inplace=True)

    def _broadcast(self, tensors: TensorOrList, root: int, inplace: bool) -> Handle:
        started = time.perf_counter()
        if not 0 <= root < self.size:
            raise ValueError(f"root={root}; allowed 0..{self.size - 1}")
        tensors, single = as_list(tensors)
        flat = fuse(tensors)
        view = is_view_of(flat, tensors)
        value = flat.clone() if self._rank == root else None

        def deliver(source: torch.Tensor) -> TensorOrList:
            out = flat if (inplace or not view) else torch.empty_like(flat)
            out.copy_(source)
            return copy_back(out, tensors, single) if inplace else restore(out, tensors, single)

        wait, ready = self._collective("broadcast", (root, flat.numel(), str(flat.dtype)), value, lambda i: i[root], deliver)
        return self._track("broadcast", _nbytes(flat), started, wait, ready, root=root)

    def ibarrier(self) -> Handle:
        started = time.perf_counter()
        wait, ready = self._collective("barrier", None, None, lambda inputs: None, lambda _: None)
        return self._track("barrier", 0, started, wait, ready)

    def iallgather(self, tensors: TensorOrList) -> Handle:
        """Every rank's tensor(s) along dim 0 in rank order; first dims may differ."""
        started = time.perf_counter()
        tensors, single = as_list(tensors)
        head = (len(tensors), DTYPE_CODES.get(tensors[0].dtype, 0), shape_signature(tensors))
        mine = (head, [t.detach().reshape(rows_shape(t, d)).clone() for t, d in zip(tensors, first_dims(tensors))])
        me = self._rank

        def deliver(inputs: dict) -> TensorOrList:
            for r in range(self.size):
                theirs = inputs[r][0]
                if theirs != head:  # the MPI engine's check and words, raised on every rank
                    raise CommError(
                        f"allgather: rank {r} gives {theirs[0]} tensor(s) of {dtype_name(theirs[1])} "
                        f"(trailing shapes #{theirs[2]}), rank {me} gives {head[0]} of "
                        f"{dtype_name(head[1])} (#{head[2]}); allowed: the same list, only first dims may differ"
                    )
            parts = [torch.cat([inputs[r][1][i] for r in range(self.size)]) for i in range(len(tensors))]
            return parts[0] if single else parts

        wait, ready = self._collective("allgather", None, mine, lambda inputs: inputs, deliver)
        return self._track("allgather", _nbytes_list(tensors), started, wait, ready)

    # neighbor exchange --------------------------------------------------
    def ineighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        return self._neighbor_allreduce(tensors, self_weight, src_weights, dst_weights, inplace=False)

    def ineighbor_allreduce_(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        return self._neighbor_allreduce(tensors, self_weight, src_weights, dst_weights, inplace=True)

    def _neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None,
        src_weights: Weights | None,
        dst_weights: DstWeights | None,
        inplace: bool,
    ) -> Handle:
        started = time.perf_counter()
        op = "neighbor_allreduce"
        spec = self.neighbor_spec(self_weight, src_weights, dst_weights)
        tensors, single = as_list(tensors)
        check_float(tensors, op)
        flat = fuse(tensors)
        view = is_view_of(flat, tensors)
        meta = {"src": sorted(spec.src_weights), "dst": sorted(spec.dst_weights)}

        def combine(received: dict[int, torch.Tensor]) -> TensorOrList:
            pairs = [(received[s], w) for s, w in spec.src_weights.items()]
            if view and not inplace:  # the caller's memory: combine into a new tensor
                out = weighted_combine_(flat * spec.self_weight, 1.0, pairs)
            else:  # our fused copy, or the caller asked for in place
                out = weighted_combine_(flat, spec.self_weight, pairs)
            return copy_back(out, tensors, single) if inplace else restore(out, tensors, single)

        if self.size == 1:
            return self._track(op, _nbytes(flat), started, lambda: combine({}), **meta)
        receive, ready, _ = self._exchange(
            op, self.size, list(spec.src_weights), list(spec.dst_weights),
            (flat.numel(), DTYPE_CODES.get(flat.dtype, 0), 1, 0),
            lambda h, e, s: pattern_problems(op, s, e, h[:, 0], h[:, 1]),
            _scaled_sends(flat, spec.dst_weights), list(spec.src_weights),
        )
        return self._track(op, _nbytes(flat), started, lambda: combine(receive()), ready, **meta)

    def ineighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> Handle:
        started = time.perf_counter()
        op = "neighbor_allgather"
        srcs, dsts = self.neighbor_ranks(src_ranks, dst_ranks)
        tensors, single = as_list(tensors)
        meta = {"src": srcs, "dst": dsts}
        snapshot = [t.detach().reshape(rows_shape(t, d)).clone() for t, d in zip(tensors, first_dims(tensors))]

        def assemble(received: dict[int, list[torch.Tensor]]) -> TensorOrList:
            out = []
            for i, t in enumerate(tensors):
                pieces = [received[s][i] for s in srcs]
                out.append(torch.cat(pieces) if pieces else torch.empty(rows_shape(t, 0), dtype=t.dtype))
            return out[0] if single else out

        if self.size == 1:
            return self._track(op, _nbytes_list(tensors), started, lambda: assemble({}), **meta)
        receive, ready, _ = self._exchange(
            op, self.size, srcs, dsts,
            (sum(t.numel() for t in tensors), DTYPE_CODES.get(tensors[0].dtype, 0), len(tensors), shape_signature(tensors)),
            lambda h, e, s: _gather_problems(op, h, e, s), {d: snapshot for d in dsts}, srcs,
        )
        return self._track(op, _nbytes_list(tensors), started, lambda: assemble(receive()), ready, **meta)

    # hierarchical -------------------------------------------------------
    def ihierarchical_neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        return self._hierarchical(tensors, self_weight, src_machine_weights, dst_machine_weights, inplace=False)

    def ihierarchical_neighbor_allreduce_(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        return self._hierarchical(tensors, self_weight, src_machine_weights, dst_machine_weights, inplace=True)

    def _hierarchical(
        self,
        tensors: TensorOrList,
        self_weight: float | None,
        src_weights: Weights | None,
        dst_weights: DstWeights | None,
        inplace: bool,
    ) -> Handle:
        """The machine average (taken at the call: it needs only this machine's ranks), then
        each local rank mixes it with the same local rank of the neighbor machines."""

        started = time.perf_counter()
        op = "hierarchical_neighbor_allreduce"
        spec = self.machine_spec(self_weight, src_weights, dst_weights)
        tensors, single = as_list(tensors)
        check_float(tensors, op)
        flat = fuse(tensors)
        view = is_view_of(flat, tensors)
        L, lr, machine = self.local_size, self.local_rank, self.machine
        meta = {"src_machines": sorted(spec.src_weights), "dst_machines": sorted(spec.dst_weights)}
        local = tuple(range(machine * L, (machine + 1) * L))
        average = self._collective(
            "machine average", (flat.numel(), str(flat.dtype)), flat.to(work_dtype(flat.dtype), copy=True),
            lambda inputs: binomial_tree_sum([inputs[r] for r in local]).div_(L), lambda total: total.clone(), local,
        )[0]()
        peer = {m: m * L + lr for m in range(self.machines)}  # this local rank on every machine

        def combine(received: dict[int, torch.Tensor]) -> TensorOrList:
            mixed = weighted_combine_(average, spec.self_weight, [(received[peer[m]], w) for m, w in spec.src_weights.items()])
            out = flat if (inplace or not view) else torch.empty_like(flat)
            out.copy_(mixed)
            return copy_back(out, tensors, single) if inplace else restore(out, tensors, single)

        receive, ready, _ = self._exchange(
            op, self.machines, list(spec.src_weights), list(spec.dst_weights),
            (flat.numel(), DTYPE_CODES.get(flat.dtype, 0), 1, 0),
            lambda h, e, s: machine_problems(op, h, e, s, L),
            {peer[m]: payload for m, payload in _scaled_sends(average, spec.dst_weights).items()},
            [peer[m] for m in spec.src_weights],
        )
        return self._track(op, _nbytes(flat), started, lambda: combine(receive()), ready, **meta)

    # windows ------------------------------------------------------------
    def win_create(
        self,
        tensor: torch.Tensor,
        name: str,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
        zero_init: bool = True,
        weight: float = 1.0,
    ) -> torch.Tensor:
        if name in self._windows:
            raise ValueError(f"window {name!r} exists; free it first (win_free)")
        check_float([tensor], "win_create")
        srcs, dsts = self.neighbor_ranks(src_ranks, dst_ranks)
        flat = tensor.detach().contiguous().view(-1)
        return self._blocking("win_create", lambda: self._win_create(name, flat, srcs, dsts, zero_init, weight))

    def _win_create(
        self, name: str, flat: torch.Tensor, srcs: list[int], dsts: list[int], zero_init: bool, weight: float
    ) -> torch.Tensor:
        # Collective check first: both sides of every edge and the window's name must agree.
        signature = zlib.crc32(name.encode())
        receive, _, ex = self._exchange(
            "win_create", self.size, srcs, dsts, (flat.numel(), DTYPE_CODES.get(flat.dtype, 0), 1, signature),
            lambda h, e, s: pattern_problems("win_create", s, e, h[:, 0], h[:, 1]), {}, [],
        )
        with contextlib.suppress(CommError):
            receive()  # waits for every declaration; the problems are reported below, with the name's
        problems = list(ex.problems)
        assert ex.table is not None
        if (ex.table[0][:, 3] != signature).any():
            problems.append(f"ranks disagree on the window name (this rank: {name!r})")
        if problems:
            raise mismatch_error(f"win_create({name!r})", problems)
        w = _RankWindow(
            name, flat.clone(), float(weight), srcs, dsts,
            {s: torch.zeros_like(flat) for s in srcs}, {s: 0.0 for s in srcs},
        )
        with self.world.lock:
            self.world.windows.setdefault(name, {})[self._rank] = w
        self._windows[name] = w
        self.barrier()  # every window made before anyone reaches into one
        if not zero_init:
            self._win_get(w, {s: 1.0 for s in srcs})
            self.barrier()
        return w.own

    def win_free(self, name: str | None = None) -> None:
        names = sorted(self._windows) if name is None else [name]
        for nm in names:
            self._window(nm)
            self._windows.pop(nm)
            self.barrier()  # collective, as MPI's Win_free: nobody reaches into a freed window
            with self.world.lock:
                ranks = self.world.windows.get(nm, {})
                ranks.pop(self._rank, None)
                if not ranks:
                    self.world.windows.pop(nm, None)

    def win_tensor(self, name: str) -> torch.Tensor:
        return self._window(name).own

    def win_weight(self, name: str) -> float:
        return float(self._window(name).weight)

    def _window(self, name: str) -> _RankWindow:
        try:
            return self._windows[name]
        except KeyError:
            raise ValueError(f"no window {name!r}; created: {sorted(self._windows) or 'none'}") from None

    def _peer_window(self, name: str, rank: int) -> _RankWindow:
        with self.world.lock:
            self.world.raise_if_failed()
            return self.world.windows[name][rank]

    def _window_op(self, op: str, nbytes: int, started: float, fn: Callable[[], Any], **meta: Any) -> Handle:
        """Window ops complete at the call (memory is shared); the handle reports them."""
        result = fn()
        return self._track(op, nbytes, started, lambda: result, None, **meta)

    def _push(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None,
        dst_weights: DstWeights | None,
        accumulate: bool,
    ) -> Handle:
        started = time.perf_counter()
        op = "win_accumulate" if accumulate else "win_put"
        w = self._window(name)
        dst = normalize_dst(dst_weights)
        dst = {d: 1.0 for d in w.dsts} if dst is None else dst
        self._check_window_targets(w, list(dst), w.dsts, "destinations", op)
        x = self._window_payload(w, tensor, op)
        return self._window_op(
            op, w.row_bytes * len(dst), started, lambda: self._win_push(w, x, dst, self_weight, accumulate),
            dst=sorted(dst), window=name,
        )

    def _win_push(
        self, w: _RankWindow, x: torch.Tensor, dst: dict[int, float], self_weight: float | None, accumulate: bool
    ) -> None:
        p = w.weight
        for d, weight in dst.items():
            payload = x if weight == 1.0 else x * weight
            target = self._peer_window(w.name, d)
            with target.lock:  # data and weight move together
                slot = target.slots[self._rank]
                if accumulate:
                    if w.dtype in HALF_DTYPES:  # added in float32, as the MPI engine does
                        slot.copy_((slot.float() + payload.float()).to(w.dtype))
                    else:
                        slot.add_(payload)
                    target.slot_weights[self._rank] += p * weight
                else:
                    slot.copy_(payload)
                    target.slot_weights[self._rank] = p * weight
        if self_weight is not None:
            with w.lock:
                if x.data_ptr() == w.own.data_ptr():
                    w.own.mul_(self_weight)
                else:
                    torch.mul(x, self_weight, out=w.own)
                w.weight = p * self_weight

    def iwin_get(self, name: str, src_weights: Weights | None = None) -> Handle:
        started = time.perf_counter()
        w = self._window(name)
        src = {s: 1.0 for s in w.srcs} if src_weights is None else {int(k): float(v) for k, v in src_weights.items()}
        self._check_window_targets(w, list(src), w.srcs, "sources", "win_get")
        return self._window_op(
            "win_get", w.row_bytes * len(src), started, lambda: self._win_get(w, src), src=sorted(src), window=name
        )

    def _win_get(self, w: _RankWindow, src: dict[int, float]) -> None:
        for s, weight in src.items():
            source = self._peer_window(w.name, s)
            with source.lock:
                fetched, fw = source.own.clone(), source.weight
            with w.lock:
                torch.mul(fetched, weight, out=w.slots[s])
                w.slot_weights[s] = fw * weight

    def iwin_update(
        self,
        name: str,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        reset: bool = False,
    ) -> Handle:
        started = time.perf_counter()
        w = self._window(name)
        if (self_weight is None) != (src_weights is None):
            raise ValueError("give self_weight and src_weights together, or neither")
        if src_weights is None:
            uniform = 1.0 / (1 + len(w.srcs))
            self_weight, src_weights = uniform, {s: uniform for s in w.srcs}
        src = {int(k): float(v) for k, v in src_weights.items()}
        self._check_window_targets(w, list(src), w.srcs, "sources", "win_update")
        return self._window_op(
            "win_update", 0, started, lambda: self._win_update(w, float(self_weight), src, reset), window=name
        )

    def _win_update(self, w: _RankWindow, self_weight: float, src: dict[int, float], reset: bool) -> torch.Tensor:
        with w.lock:
            weighted_combine_(w.own, self_weight, [(w.slots[s], weight) for s, weight in src.items()])
            w.weight = self_weight * w.weight + sum(weight * w.slot_weights[s] for s, weight in src.items())
            if reset:
                for s in src:
                    w.slots[s].zero_()
                    w.slot_weights[s] = 0.0
        return w.own

    # lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Drop this rank's windows (not collective: a failing rank thread calls it too)."""
        with self.world.lock:
            for name in self._windows:
                self.world.windows.get(name, {}).pop(self._rank, None)
        self._windows.clear()


# ------------------------------------------------------------------ helpers


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _nbytes_list(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_nbytes(t) for t in tensors)


def _scaled_sends(flat: torch.Tensor, dst_weights: dict[int, float]) -> dict[int, torch.Tensor]:
    """What each destination gets, scaled as the MPI engine's sender scales it.

    Snapshots: receivers read them after the sender's call returned. All
    unscaled destinations share one copy.
    """
    unscaled = None
    sends = {}
    for dst, w in dst_weights.items():
        if w == 1.0:
            unscaled = flat.clone() if unscaled is None else unscaled
            sends[dst] = unscaled
        else:
            sends[dst] = flat * w
    return sends


def _gather_problems(op: str, headers: np.ndarray, expects: np.ndarray, sends: np.ndarray) -> list[str]:
    """neighbor_allgather: the edges, the dtype, and the list shape (only first dims may differ)."""
    problems = pattern_problems(op, sends, expects, None, headers[:, 1])
    for i, j in np.argwhere(sends.T & expects).tolist():
        if (headers[i, 2:] != headers[j, 2:]).any():
            problems.append(
                f"rank {j} sends {headers[j, 2]} tensor(s) of trailing shapes #{headers[j, 3]} to rank {i}, "
                f"which has {headers[i, 2]} of #{headers[i, 3]} (only first dims may differ)"
            )
    return problems
