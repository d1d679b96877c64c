"""Virtual ranks: every rank is a thread of one process; tensors move in memory.

128 MPI processes that each import torch do not fit a laptop; 128 threads
sharing one torch do. Each thread runs the very same worker, algorithm and
topology code through a ThreadsEngine, so the same seed gives the same
numbers as on MPI:

* neighbor ops combine in exactly the MPI engine's order
  (``x * self_weight``, then ``add_`` of each source in ``src_weights``
  order), and a sender scales what it sends exactly as MPI's sender does,
  so the results are bit-identical;
* allreduce sums in the order of Open MPI's binomial tree (ranks in pairs,
  then pairs of pairs), the algorithm behind the MPI engine's in-place
  Iallreduce; half precision is summed in float32 as the MPI engine does.

Coordination is one lock and one condition variable per rank, so a sender
wakes only the ranks it wrote to. Every rank numbers its collectives and its
point-to-point exchanges; all ranks issue operations in the same order (the
MPI contract), so the numbers pair the calls up. What MPI would do on a
broken program, this engine turns into a clear error instead of a hang:

* a neighbor pattern that does not match (rank 3 expects from 1, 1 does not
  send to 3) is found when the second of the two ranks posts, and raises a
  CommError on every rank;
* a rank that waits for a rank that has already returned raises CommError;
* a rank thread that raises aborts the world: every rank blocked in (or
  later entering) the engine raises RankAborted naming the failed rank, so no
  thread is left running.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO

import torch

from bfexp.comm.engine import (
    CommError,
    DstWeights,
    Engine,
    Handle,
    TensorOrList,
    Weights,
    as_list,
    check_float,
    fuse,
    restore,
)

# How often a blocked rank re-checks for ranks that returned without it (seconds).
POLL_S = 0.5

_current = threading.local()


def current_rank() -> int | None:
    """The virtual rank this thread runs, or None outside rank threads."""
    return getattr(_current, "rank", None)


class RankAborted(RuntimeError):
    """Raised in a rank thread because another rank failed or the job was stopped."""


# ------------------------------------------------------------------ reductions


def binomial_tree_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in the order of Open MPI's binomial-tree allreduce (libnbc, which
    serves the MPI engine's in-place Iallreduce at every size).

    Round r adds rank i + 2^(r-1) into rank i for i divisible by 2^r, so
    ranks pair up, then pairs of pairs; an unpaired partial waits for a
    later round. IEEE addition is commutative, so this gives MPI's bits.
    """
    level = list(values)
    if len(level) == 1:
        return level[0].clone()
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision is reduced in float32, as the MPI engine does."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ------------------------------------------------------------------ shared state


@dataclass
class _Collective:
    """One collective call, matched across the ranks of a group by its sequence number."""

    kind: str
    detail: Any  # what every rank must agree on (op, root, element count ...)
    members: tuple[int, ...]
    inputs: dict[int, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    computed: bool = False
    result: Any = None
    collected: int = 0


@dataclass
class _Exchange:
    """The declarations of one point-to-point exchange, checked pairwise as ranks post."""

    kind: str
    posted: dict[int, tuple[frozenset, frozenset]] = field(default_factory=dict)  # rank -> (srcs, dsts)
    sends_to: dict[int, set] = field(default_factory=dict)  # rank -> posted ranks sending to it
    expects_from: dict[int, set] = field(default_factory=dict)  # rank -> posted ranks expecting from it


class ThreadWorld:
    """What the virtual ranks of one job share: mailboxes, collectives, windows, failure."""

    def __init__(self, size: int, ranks_per_machine: int = 0, poll_s: float = POLL_S) -> None:
        if size < 1:
            raise ValueError(f"ranks={size}; allowed: an integer >= 1")
        if ranks_per_machine and size % ranks_per_machine:
            raise ValueError(f"ranks_per_machine={ranks_per_machine} does not divide {size} ranks")
        self.size = size
        self.local_size = ranks_per_machine or size
        self.poll_s = poll_s
        self.lock = threading.Lock()
        self._wake = [threading.Condition(self.lock) for _ in range(size)]
        self._collectives: dict[tuple, _Collective] = {}
        self._mail: dict[tuple[int, int, int], Any] = {}  # (dst, src, tag) -> payload
        self._exchanges: dict[int, _Exchange] = {}
        self.windows: dict[str, Any] = {}
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

    def _raise_if_failed(self) -> None:
        exc = self._failure
        if exc is None:
            return
        if isinstance(exc, CommError):
            raise CommError(str(exc))
        raise RankAborted(str(exc))

    def _comm_error(self, message: str) -> CommError:
        """Record a broken communication pattern for every rank; return the error to raise here."""
        exc = CommError(message)
        self._fail_locked(exc)
        return CommError(message)

    def rank_returned(self, rank: int) -> None:
        """A rank's code has finished: ranks still waiting for it will never get it."""
        with self.lock:
            self._returned.add(rank)
            for c in self._wake:
                c.notify_all()

    def wait(self, rank: int, ready: Callable[[], bool], missing: Callable[[], Iterable[int]], what: str) -> None:
        """Block rank ``rank`` until ``ready()``; raise instead of hanging. Caller holds ``lock``."""
        while True:
            self._raise_if_failed()
            if ready():
                return
            gone = sorted(q for q in missing() if q in self._returned)
            if gone:
                raise self._comm_error(
                    f"rank {rank}: {what} waits for rank {gone[0]}, which has already returned "
                    f"(the ranks did not call the same operations)"
                )
            self._wake[rank].wait(self.poll_s)

    def notify(self, ranks: Iterable[int]) -> None:
        """Wake the given ranks (caller holds ``lock``)."""
        for r in ranks:
            self._wake[r].notify_all()

    # collectives -----------------------------------------------------------
    def post_collective(self, key: tuple, kind: str, detail: Any, members: tuple[int, ...], rank: int, value: Any) -> _Collective:
        with self.lock:
            self._raise_if_failed()
            slot = self._collectives.get(key)
            if slot is None:
                slot = self._collectives[key] = _Collective(kind, detail, members)
            elif (slot.kind, slot.detail) != (kind, detail):
                other = next(iter(slot.inputs), "?")
                raise self._comm_error(
                    f"collective #{key[-1]} does not match: rank {rank} called {kind}({_fmt(detail)}) "
                    f"but rank {other} called {slot.kind}({_fmt(slot.detail)})"
                )
            slot.inputs[rank] = value
            if len(slot.inputs) == len(members):
                self.notify(members)
            return slot

    def finish_collective(self, key: tuple, slot: _Collective, rank: int, compute: Callable[[dict], Any]) -> Any:
        with self.lock:
            self.wait(
                rank,
                lambda: len(slot.inputs) == len(slot.members),
                lambda: [m for m in slot.members if m not in slot.inputs],
                slot.kind,
            )
        with slot.lock:  # the first rank to finish computes, the others reuse it
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
            self._raise_if_failed()
            return len(slot.inputs) == len(slot.members)

    # point to point ----------------------------------------------------------
    def post_exchange(self, rank: int, tag: int, kind: str, srcs: Iterable[int], sends: dict[int, Any]) -> None:
        """Check rank's declaration against the ranks that already posted this exchange, then deliver its sends."""
        srcs, dsts = frozenset(srcs), frozenset(sends)
        with self.lock:
            self._raise_if_failed()
            ex = self._exchanges.get(tag)
            if ex is None:
                ex = self._exchanges[tag] = _Exchange(kind)
            elif ex.kind != kind:
                other = next(iter(ex.posted), "?")
                raise self._comm_error(
                    f"exchange #{tag} does not match: rank {rank} called {kind} but rank {other} called {ex.kind}"
                )
            problem = self._pattern_problem(ex, rank, srcs, dsts)
            if problem:
                raise self._comm_error(f"neighbor pattern mismatch in {kind}: {problem}")
            ex.posted[rank] = (srcs, dsts)
            for k in dsts:
                ex.sends_to.setdefault(k, set()).add(rank)
            for j in srcs:
                ex.expects_from.setdefault(j, set()).add(rank)
            if len(ex.posted) == self.size:
                del self._exchanges[tag]
            for dst, payload in sends.items():
                self._mail[(dst, rank, tag)] = payload
            self.notify(dsts)

    @staticmethod
    def _pattern_problem(ex: _Exchange, r: int, srcs: frozenset, dsts: frozenset) -> str | None:
        """Whichever of two mismatched ranks posts second finds the mismatch."""
        for q in sorted(srcs):
            if q in ex.posted and r not in ex.posted[q][1]:
                return f"rank {r} expects a message from rank {q}, but rank {q} does not send to rank {r}"
        for q in sorted(dsts):
            if q in ex.posted and r not in ex.posted[q][0]:
                return f"rank {r} sends to rank {q}, but rank {q} does not expect a message from rank {r}"
        for q in sorted(ex.sends_to.get(r, ())):
            if q not in srcs:
                return f"rank {q} sends to rank {r}, but rank {r} does not expect a message from rank {q}"
        for q in sorted(ex.expects_from.get(r, ())):
            if q not in dsts:
                return f"rank {q} expects a message from rank {r}, but rank {r} does not send to rank {q}"
        return None

    def receive(self, rank: int, tag: int, srcs: Sequence[int], what: str) -> dict[int, Any]:
        """Block until every source's message for this exchange arrived; take them out of the mailbox."""
        keys = [(rank, s, tag) for s in srcs]
        with self.lock:
            self.wait(
                rank,
                lambda: all(k in self._mail for k in keys),
                lambda: [k[1] for k in keys if k not in self._mail],
                what,
            )
            return {k[1]: self._mail.pop(k) for k in keys}

    def arrived(self, rank: int, tag: int, srcs: Sequence[int]) -> bool:
        with self.lock:
            self._raise_if_failed()
            return all((rank, s, tag) in self._mail for s in srcs)

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
            self.rank_returned(rank)
            _current.rank = None

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds in all for every rank thread; True when all have ended."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            t.join(remaining)
            if t.is_alive():
                return False
        return True

    def alive(self) -> list[int]:
        """Ranks whose thread is still running."""
        return [r for r, t in enumerate(self.threads) if t.is_alive()]


def _fmt(detail: Any) -> str:
    if isinstance(detail, tuple):
        return ", ".join(map(str, detail))
    return "" if detail is None else str(detail)


def run_threads(
    size: int,
    target: Callable[["ThreadsEngine"], Any],
    ranks_per_machine: int = 0,
    timeout: float | None = 300.0,
) -> list[Any]:
    """Run ``target(engine)`` on ``size`` virtual ranks; return each rank's result.

    Re-raises the first rank's own failure (not the RankAborted of the
    others). For scripts and tests; the launcher adds logs and signals.
    """
    world = ThreadWorld(size, ranks_per_machine)
    world.start(target)
    if not world.join(timeout):
        world.abort(RankAborted(f"timed out after {timeout} s"))
        world.join(10.0)
        raise TimeoutError(f"virtual ranks {world.alive()} still running after {timeout} s")
    own = {r: e for r, e in world.errors.items() if not isinstance(e, RankAborted)}
    if own:
        raise next(iter(sorted(own.items())))[1]
    if world.errors:
        raise next(iter(sorted(world.errors.items())))[1]
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
    """One virtual rank's view of a ThreadWorld."""

    name = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__()
        if not 0 <= rank < world.size:
            raise ValueError(f"rank={rank}; allowed: 0..{world.size - 1}")
        self.world = world
        self._rank = rank
        self._local_size = world.local_size
        self._collective_seq: dict[tuple[int, ...], int] = {}
        self._tags = itertools.count(1)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.world.size

    # plumbing ------------------------------------------------------------
    def _members(self, group: tuple[int, ...] | None) -> tuple[int, ...]:
        return tuple(range(self.size)) if group is None else group

    def _collective(
        self,
        kind: str,
        detail: Any,
        value: Any,
        compute: Callable[[dict], Any],
        deliver: Callable[[Any], Any],
        group: tuple[int, ...] | None = None,
    ) -> Handle:
        """Post this rank's part; the handle waits for every member, computes once, delivers per rank."""
        members = self._members(group)
        seq = self._collective_seq.get(members, 0) + 1
        self._collective_seq[members] = seq
        key = (members, seq) if group is not None else ("world", seq)
        world, rank = self.world, self._rank
        slot = world.post_collective(key, kind, detail, members, rank, value)

        def finish() -> Any:
            return deliver(world.finish_collective(key, slot, rank, compute))

        return Handle(finish, lambda: world.collective_ready(slot))

    def _exchange(self, kind: str, srcs: Sequence[int], sends: dict[int, Any], combine: Callable[[dict], Any]) -> Handle:
        """Post sends (already snapshots: the caller may change its tensors) and return a handle on the receives."""
        tag = next(self._tags)
        world, rank = self.world, self._rank
        srcs = list(srcs)
        world.post_exchange(rank, tag, kind, srcs, sends)
        return Handle(
            lambda: combine(world.receive(rank, tag, srcs, kind)),
            lambda: world.arrived(rank, tag, srcs),
        )

    @staticmethod
    def _own_buffer(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A buffer the caller does not own (fuse returns a view for one contiguous tensor)."""
        return flat.clone() if flat.data_ptr() == tensors[0].data_ptr() else flat

    # collectives --------------------------------------------------------
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        self.check_op(op)
        tensors, single = as_list(tensors)
        if op == "avg":
            check_float(tensors, "allreduce(op='avg')")
        out = self._own_buffer(fuse(tensors), tensors)
        size = self.size

        def compute(inputs: dict) -> torch.Tensor:
            work = _work_dtype(out.dtype)
            total = binomial_tree_sum([inputs[r].to(work) for r in sorted(inputs)])
            if op == "avg":
                total = total.div_(size)
            return total

        def deliver(total: torch.Tensor) -> TensorOrList:
            out.copy_(total)
            return restore(out, tensors, single)

        return self._collective("allreduce", (op, out.numel(), out.dtype), out, compute, deliver)

    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        tensors, single = as_list(tensors)
        self._check_rank(root, "root")
        out = self._own_buffer(fuse(tensors), tensors)
        value = out if self._rank == root else None

        def deliver(source: torch.Tensor) -> TensorOrList:
            if self._rank != root:
                out.copy_(source)
            return restore(out, tensors, single)

        return self._collective(
            "broadcast", (root, out.numel(), out.dtype), value, lambda inputs: inputs[root], deliver
        )

    def ibarrier(self) -> Handle:
        return self._collective("barrier", None, None, lambda inputs: None, lambda _: None)

    def iallgather(self, tensors: TensorOrList) -> Handle:
        """Every rank's tensor(s) concatenated along the first dimension, in rank order (first dims may differ)."""
        tensors, single = as_list(tensors)
        mine = [t.detach().clone() for t in tensors]

        def compute(inputs: dict) -> list[torch.Tensor]:
            return [torch.cat([inputs[r][i] for r in sorted(inputs)]) for i in range(len(mine))]

        def deliver(gathered: list[torch.Tensor]) -> TensorOrList:
            parts = [g.clone() for g in gathered]
            return parts[0] if single else parts

        detail = (len(mine), tuple(str(t.dtype) for t in mine), tuple(tuple(t.shape[1:]) for t in mine))
        return self._collective("allgather", detail, mine, compute, deliver)

    def allgather(self, tensors: TensorOrList) -> TensorOrList:
        return self._timed_wait(self.iallgather(tensors))

    # neighbor exchange --------------------------------------------------
    def ineighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        spec = self.neighbor_spec(self_weight, src_weights, dst_weights)
        tensors, single = as_list(tensors)
        check_float(tensors, "neighbor_allreduce")
        flat = fuse(tensors)
        # Snapshots, scaled like the MPI engine's sends: receivers read them after we return.
        unscaled = None
        sends = {}
        for dst, w in spec.dst_weights.items():
            if w == 1.0:
                unscaled = flat.clone() if unscaled is None else unscaled
                sends[dst] = unscaled
            else:
                sends[dst] = flat * w

        def combine(received: dict) -> TensorOrList:
            out = flat * spec.self_weight
            for src, w in spec.src_weights.items():
                out.add_(received[src], alpha=w)
            return restore(out, tensors, single)

        return self._exchange("neighbor_allreduce", list(spec.src_weights), sends, combine)

    def ineighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> Handle:
        """In-neighbors' tensor(s) concatenated along the first dimension, in ascending rank order."""
        tensors, single = as_list(tensors)
        if src_ranks is None or dst_ranks is None:
            spec = self.neighbor_spec(None, None, None)
            src_ranks = sorted(spec.src_weights) if src_ranks is None else src_ranks
            dst_ranks = list(spec.dst_weights) if dst_ranks is None else dst_ranks
        for r in list(src_ranks) + list(dst_ranks):
            self._check_rank(r, "neighbor rank", allow_self=False)
        snapshot = [t.detach().clone() for t in tensors]
        srcs = sorted(int(s) for s in src_ranks)

        def combine(received: dict) -> TensorOrList:
            parts = [torch.cat([received[s][i] for s in srcs]) for i in range(len(tensors))]
            return parts[0] if single else parts

        return self._exchange("neighbor_allgather", srcs, {int(d): snapshot for d in dst_ranks}, combine)

    def neighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> TensorOrList:
        return self._timed_wait(self.ineighbor_allgather(tensors, src_ranks, dst_ranks))

    # helpers ------------------------------------------------------------
    def _check_rank(self, r: int, what: str, allow_self: bool = True) -> None:
        if not 0 <= r < self.size or (not allow_self and r == self._rank):
            extra = "" if allow_self else " except self"
            raise ValueError(f"rank {self._rank}: bad {what} {r}; allowed 0..{self.size - 1}{extra}")
