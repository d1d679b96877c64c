"""Virtual ranks: every rank is a thread of one process; tensors move in memory (transport only).

128 MPI processes that each import torch do not fit a laptop; 128 threads
sharing one torch do. Each thread runs the very same worker, algorithm and
topology code through a ThreadsEngine, and the same seed gives the same
numbers as on MPI, to the bit where MPI's order is known:

* neighbor ops combine in the contract's one order (engine.Call.combine),
  and senders scale what they send as the MPI engine's do;
* allreduce adds in Open MPI's orders: recursive doubling for the blocking
  form (the MPI engine calls the tuned ``Allreduce``), the binomial tree for
  the nonblocking one (libnbc's in-place ``Iallreduce``); half precision is
  reduced in float32 as there.

The ranks meet in a bfexp.comm.rendezvous.Rendezvous: collectives,
exchanges (every rank's declaration judged by bfexp.comm.declarations
before any receive completes, so a mismatch raises the same CommError,
with the same words, on every rank, and the engine stays usable) and
windows. A hang (operations in different orders, a rank waiting for one
that returned) raises CommError on every rank. ThreadWorld adds the rank
threads: a rank thread that raises aborts the world, so every rank blocked
in (or later entering) the engine raises RankAborted naming the failed
rank, and no thread is left running.

A user's own script (bfexp.api.spawn, ``bfexp-run --engine threads``) also
uses process-global state that MPI ranks each have alone: torch's default
generator (``torch.manual_seed``, dropout, a shuffling DataLoader), numpy's
and Python's global RNGs. ``ThreadWorld(one_at_a_time=True)`` runs one
rank thread at a time from the start, and a rank hands its turn on where it
waits for other ranks, moves its simulated clock, or has run a window op,
saving the three RNG states when it hands on and restoring its own when it
gets the turn back. Between two communication calls a rank therefore draws
from its own streams exactly as an MPI process does, whatever the
interleaving, so the same seed gives MPI's numbers where the order of
operations is MPI's (collectives, neighbor ops). Window ops never wait, so
without the hand-over at each of them one rank would run a whole
asynchronous loop (BlueFog's push-sum consensus, its win-put optimizer)
before the next one started: a script's ranks instead take one window op
each in turn (a zero-time ``advance``: clock order, then first come), the
interleaving of MPI ranks that run at one speed. Where a script moves its
clocks (``bfexp.advance``), the earliest clock goes next.

Virtual ranks keep simulated time (bfexp.comm.rendezvous): ``clock_s`` is
the rank's own clock, ``advance(s)`` moves it on instead of sleeping, and
``schedule()`` (collective) runs the ranks one at a time in clock order, so
asynchronous algorithms' window operations happen in the same order on
every run. Both are ONE turn-keeper, the rendezvous' schedule: the rank
with the smallest clock runs (equal clocks, and clocks nobody moves: first
come, first served).
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Sequence, TextIO

import numpy as np
import torch

from bfexp.comm.declarations import Declaration, GatherDeclaration, MachineDeclaration, Table
from bfexp.comm.declarations import allgather_problems, header, mismatch_error, shape_signature
from bfexp.comm.engine import HALF_DTYPES, Call, Engine, NeighborSpec, Pending, Window, accumulate_, recorded
from bfexp.comm.engine import first_dims, local_size_for, ungather, weighted_combine_, work_dtype
from bfexp.comm.rendezvous import POLL_S, Rendezvous
from bfexp.errors import CommError, RankAborted
from bfexp.scaling import processor_count

__all__ = ["RankAborted", "ThreadWorld", "ThreadsEngine", "current_rank", "routed_output", "run_threads"]

_current = threading.local()


def current_rank() -> int | None:
    """The virtual rank this thread runs, or None outside rank threads."""
    return getattr(_current, "rank", None)


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


# ------------------------------------------------------------------ one rank at a time


def _fresh_rng_states() -> tuple[Any, Any, Any]:
    """What a new process starts with: torch's default seed; numpy and Python seeded from the OS."""
    return torch.Generator().get_state(), np.random.RandomState().get_state(), random.Random().getstate()


# ------------------------------------------------------------------ the world and its threads


def running_slots() -> int:
    """How many virtual ranks compute at once (bfexp.comm.rendezvous's running slots): the processors
    this process may use, at least two (a rank that sleeps between engine calls holds its slot)."""
    return max(2, processor_count())


class ThreadWorld(Rendezvous):
    """The virtual ranks of one job: their meeting point, and their threads; ``running`` of them compute
    at once (default ``running_slots()``)."""

    def __init__(
        self, size: int, ranks_per_machine: int = 0, poll_s: float = POLL_S, timeline_dir: Path | None = None,
        one_at_a_time: bool = False, running: int | None = None,
        engine: Callable[["ThreadWorld", int], "ThreadsEngine"] | None = None,
    ) -> None:
        super().__init__(size, ranks_per_machine, poll_s, running=running_slots() if running is None else running)
        # What each rank's thread runs on: ThreadsEngine, or the job's engine class (a user's subclass) with its options.
        self.make_engine = engine or ThreadsEngine
        # Each rank's Chrome trace goes to <timeline_dir>/rank<N>.json (else $BFEXP_TIMELINE, as on MPI).
        self.timeline_dir = timeline_dir
        # Each rank's torch, numpy and Python global RNG states while another rank has the turn (module doc).
        self._rng_states: dict[int, tuple[Any, Any, Any]] = {}
        # A user's script: every window op hands the turn on (module doc), so ranks interleave as MPI's do.
        self.window_turns = one_at_a_time
        if one_at_a_time:  # a user's script: one rank thread at a time from the start, each with fresh RNGs
            self._rng_states = {r: _fresh_rng_states() for r in range(size)}
            with self.lock:
                self.schedule_now()
        # Rank threads (when started through ``start``) and what they left.
        self.threads: list[threading.Thread] = []
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}

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
        engine = self.make_engine(self, rank)
        try:
            self.start_running(rank)
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

    def _turn_out(self, rank: int) -> None:
        self._rng_states[rank] = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    def _turn_in(self, rank: int) -> None:
        state = self._rng_states.pop(rank, None)
        if state is not None:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])

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


def run_threads(
    size: int,
    target: Callable[["ThreadsEngine"], Any],
    ranks_per_machine: int = 0,
    timeout: float | None = 300.0,
    scheduled: bool = False,
) -> list[Any]:
    """Run ``target(engine)`` on ``size`` virtual ranks; return each rank's result.

    Re-raises the lowest rank's own failure (not the RankAborted of the
    others). For scripts and tests; the launcher adds logs and signals.
    ``scheduled``: every rank first calls ``engine.schedule()`` (clock order).
    """
    world = ThreadWorld(size, ranks_per_machine)

    def scheduled_target(engine: "ThreadsEngine") -> Any:
        engine.schedule()
        return target(engine)

    world.start(scheduled_target if scheduled else target)
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


class _RankWindow(Window):
    """A window part in this process's memory, guarded by a lock (data and weight move together)."""

    def __init__(self, name: str, srcs: list[int], dsts: list[int], data: torch.Tensor, weights: np.ndarray) -> None:
        super().__init__(name, srcs, dsts, data, weights)
        self.lock = threading.Lock()

    def exclusive(self) -> threading.Lock:
        return self.lock


class ThreadsEngine(Engine):
    """One virtual rank's view of a ThreadWorld: the Engine contract, tensors moved in memory."""

    name: ClassVar[str] = "threads"
    time_source: ClassVar[str] = "simulated"
    virtual: ClassVar[bool] = True
    processes: ClassVar[bool] = False
    device_type: ClassVar[str] = "cpu"

    def __init__(self, world: ThreadWorld, rank: int, *, ranks_per_machine: int | None = None,
                 timeline: bool = False) -> None:
        """Rank ``rank`` of ``world``. The settings of conf/engine/threads.yaml are its world's, which the
        driver builds from the job's config: ``ranks_per_machine`` groups the ranks into machines (0: one
        machine; given here, it must be the world's), ``timeline`` has every rank record a Chrome trace
        into <run dir>/timeline/."""
        super().__init__()
        if not 0 <= rank < world.size:
            raise ValueError(f"rank={rank}; allowed: 0..{world.size - 1}")
        if ranks_per_machine is not None and local_size_for(world.size, ranks_per_machine) != world.local_size:
            raise ValueError(f"ranks_per_machine={ranks_per_machine}; allowed: its world's ({world.local_size} ranks "
                             "per machine)")
        self.world = world
        self._rank = rank
        self._one_turn: int | None = None  # inside one_turn(): how many window ops have run (their turn deferred)
        self._local_size = world.local_size
        # How many collectives (per group) and exchanges this rank has issued:
        # every rank issues operations in one order, so the numbers pair calls up.
        self._collective_seq: dict[Any, int] = {}
        self._exchange_seq = 0
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

    # simulated time (bfexp.comm.rendezvous) ------------------------------
    @property
    def clock_s(self) -> float:
        """This virtual rank's simulated clock."""
        return self.world.clock[self._rank]

    @recorded
    def advance(self, seconds: float) -> None:
        """``seconds`` of this rank's time pass: its clock moves on (no sleep); a yield point when scheduled."""
        self.world.take_turns(self._rank)
        if self.size == 1:  # nobody to yield to or to race with: just the clock
            self.world.clock[0] += seconds
            return
        self.world.advance(self._rank, float(seconds))

    @recorded
    def schedule(self) -> None:
        """Collective: from now on the world's ranks run one at a time, earliest clock first.
        One rank has nobody to take turns with: its clock still moves, nothing is scheduled."""
        if self.size > 1:
            self.world.start_schedule(self._rank)

    @property
    def scheduled(self) -> bool:
        """Whether the ranks take turns in clock order (``schedule``)."""
        return self.world.scheduled

    # plumbing ------------------------------------------------------------
    def _track(self, op: str, nbytes: int, started: float, wait_fn: Callable[[], Any],
               test_fn: Callable[[], bool] | None = None, **args: Any) -> Any:
        """Every op, once posted: a rank that has run its quantum hands its running slot on (rendezvous)."""
        self.world.take_turns(self._rank)
        return super()._track(op, nbytes, started, wait_fn, test_fn, **args)

    def _collective(
        self,
        kind: str,
        detail: Any,
        value: Any,
        compute: Callable[[dict], Any],
        deliver: Callable[[Any], Any],
        group: tuple[int, ...] | None = None,
    ) -> Pending:
        """Post this rank's part; return (wait, ready): wait for every member, compute once, deliver."""
        members = tuple(range(self.size)) if group is None else group
        name = "world" if group is None else group
        seq = self._collective_seq.get(name, 0) + 1
        self._collective_seq[name] = seq
        key = (name, seq)
        world, rank = self.world, self._rank
        slot = world.post_collective(key, kind, detail, members, rank, value)
        return (
            (lambda: deliver(world.finish_collective(key, slot, rank, compute))),
            (lambda: world.collective_ready(slot, rank)),
        )

    def _exchange(self, declaration: Declaration, sends: dict[int, Any], recv_from: Sequence[int]) -> Pending:
        """Declare, deliver ``sends`` (by global rank); return (receive, ready)."""
        self._exchange_seq += 1
        number = self._exchange_seq
        world, rank = self.world, self._rank
        ex = world.post_exchange(number, rank, declaration, sends)
        return (lambda: world.receive(rank, number, ex, recv_from)), (lambda: world.exchange_ready(ex, rank))

    def _declare_all(self, declaration: Declaration) -> np.ndarray:
        n = self.size

        def table(rows: dict) -> np.ndarray:
            return np.stack([rows[r] for r in range(n)])

        wait, _ = self._collective(f"declare {declaration.op}", None, declaration.row, table, lambda rows: rows)
        return wait()

    # collectives --------------------------------------------------------
    def _post_allreduce(self, call: Call, op: str, blocking: bool) -> Pending:
        # MPI's blocking form runs Open MPI's tuned algorithm (recursive doubling), its nonblocking one libnbc's tree.
        order = recursive_doubling_sum if blocking else binomial_tree_sum
        flat, n = call.flat, self.size
        # What this rank contributes must not change before every rank has read it.
        mine = flat.to(work_dtype(flat.dtype), copy=True) if call.view or flat.dtype in HALF_DTYPES else flat

        def compute(inputs: dict) -> torch.Tensor:
            total = order([inputs[r] for r in range(n)])
            return total.div_(n) if op == "avg" else total

        def deliver(total: torch.Tensor) -> Any:
            out = call.out_buffer()
            out.copy_(total)
            return call.deliver(out)

        return self._collective("allreduce", (op, flat.numel(), str(flat.dtype)), mine, compute, deliver)

    def _post_broadcast(self, call: Call, root: int) -> Pending:
        flat = call.flat
        value = flat.clone() if self._rank == root else None

        def deliver(source: torch.Tensor) -> Any:
            out = call.out_buffer()
            out.copy_(source)
            return call.deliver(out)

        return self._collective("broadcast", (root, flat.numel(), str(flat.dtype)), value, lambda i: i[root], deliver)

    def _post_barrier(self, blocking: bool) -> Pending:
        return self._collective("barrier", None, None, lambda inputs: None, lambda _: None)

    def _post_allgather(self, call: Call) -> Pending:
        tensors, me = call.tensors, self._rank
        head = header(call.numel, call.dtype, len(tensors), shape_signature(tensors))

        def deliver(inputs: dict) -> Any:
            problems = allgather_problems(np.stack([inputs[r][0] for r in range(self.size)]), me)
            if problems:
                raise mismatch_error("allgather", problems)
            ranks = range(self.size)
            return call.as_given(ungather([inputs[r][2] for r in ranks], [inputs[r][1] for r in ranks], tensors))

        mine = (head, first_dims(tensors), call.snapshot())
        return self._collective("allgather", None, mine, lambda inputs: inputs, deliver)

    # neighbor exchange --------------------------------------------------
    def _post_neighbor_allreduce(
        self, call: Call, spec: NeighborSpec, declaration: Declaration | None, blocking: bool
    ) -> Pending:
        assert declaration is not None, "virtual ranks always declare: their exchange is the check"
        receive, ready = self._exchange(declaration, _scaled_sends(call.flat, spec.dst_weights), list(spec.src_weights))
        return (lambda: call.combine(spec, receive())), ready

    def _post_neighbor_allgather(
        self, call: Call, declaration: GatherDeclaration, srcs: list[int], dsts: list[int]
    ) -> Pending:
        sent = (first_dims(call.tensors), call.snapshot())
        receive, ready = self._exchange(declaration, {d: sent for d in dsts}, srcs)

        def assemble() -> Any:
            got = receive()
            return call.as_given(ungather([got[s][1] for s in srcs], [got[s][0] for s in srcs], call.tensors))

        return assemble, ready

    def _post_hierarchical(self, call: Call, spec: NeighborSpec, declaration: MachineDeclaration | None) -> Pending:
        """The machine average (taken at the call: it needs only this machine's ranks), then
        each local rank mixes it with the same local rank of the neighbor machines."""
        assert declaration is not None, "virtual ranks always declare: their exchange is the check"
        flat = call.flat
        L, lr, machine = self.local_size, self.local_rank, self.machine
        local = tuple(range(machine * L, (machine + 1) * L))
        average = self._collective(
            "machine average", (flat.numel(), str(flat.dtype)), flat.to(work_dtype(flat.dtype), copy=True),
            lambda inputs: binomial_tree_sum([inputs[r] for r in local]).div_(L), lambda total: total.clone(), local,
        )[0]()
        peer = {m: m * L + lr for m in range(self.machines)}  # this local rank on every machine

        def combine(received: dict[int, torch.Tensor]) -> Any:
            pairs = [(received[peer[m]], w) for m, w in spec.src_weights.items()]
            mixed = weighted_combine_(average, spec.self_weight, pairs)
            out = call.out_buffer()
            out.copy_(mixed)
            return call.deliver(out)

        sends = {peer[m]: payload for m, payload in _scaled_sends(average, spec.dst_weights).items()}
        receive, ready = self._exchange(declaration, sends, [peer[m] for m in spec.src_weights])
        return (lambda: combine(receive())), ready

    # windows: this process's memory, reached through the world -----------
    def _win_allocate(self, name: str, flat: torch.Tensor, srcs: list[int], dsts: list[int], declared: Table) -> Window:
        data = torch.zeros((1 + len(srcs), flat.numel()), dtype=flat.dtype)
        w = _RankWindow(name, srcs, dsts, data, np.zeros(1 + len(srcs)))
        self.world.add_window(self._rank, w)
        return w

    def _win_release(self, window: Window) -> None:
        self.barrier()  # collective, as MPI's Win_free: nobody reaches into a freed window
        self.world.drop_window(window.name, self._rank)

    def _win_send(self, window: Window, dst: int, payload: torch.Tensor, weight: float, accumulate: bool) -> None:
        target = self.world.window(window.name, dst)
        with target.exclusive():
            row = target.slot_of(self._rank)
            if accumulate:
                accumulate_(target.data[row], payload)
                target.weights[row] += weight
            else:
                target.data[row].copy_(payload)
                target.weights[row] = weight

    def _win_fetch(self, window: Window, src: int, into: torch.Tensor) -> float:
        source = self.world.window(window.name, src)
        with source.exclusive():
            into.copy_(source.own)
            return source.weight

    def _run_window_op(self, window: Window, work: Callable[[], Any]) -> Pending:
        """Run a window op's work now; in a user's script, then hand the turn on (a zero-time ``advance``:
        the rank with the earliest clock goes next, at equal clocks the one that has waited longest)."""
        result = work()
        if self._one_turn is not None:
            self._one_turn += 1
        elif self.world.window_turns and self.size > 1:
            self.world.advance(self._rank, 0.0)
        return (lambda: result), None

    @contextlib.contextmanager
    def one_turn(self) -> Iterator[None]:
        """The window ops inside hand the turn on once, at the end (an optimizer's ops on each parameter)."""
        if self._one_turn is not None:  # nested: the outer block hands on
            yield
            return
        self._one_turn = 0
        try:
            yield
        finally:
            ops, self._one_turn = self._one_turn, None
        if ops and self.world.window_turns and self.size > 1:
            self.world.advance(self._rank, 0.0)

    def _win_swap(self, window: Window, peer: int, change: Callable[[torch.Tensor], None]) -> None:
        target = self.world.window(window.name, peer)
        with target.exclusive():
            theirs = target.own.clone()
            change(theirs)
            target.own.copy_(theirs)

    # lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Drop this rank's windows (not collective: a failing rank thread calls it too)."""
        for name in self._windows:
            self.world.drop_window(name, self._rank)
        self._windows.clear()


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
