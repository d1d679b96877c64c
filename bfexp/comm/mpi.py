"""mpi4py engine: one MPI process per rank, torch CPU tensors (transport only; the contract is engine.py's).

Speed comes from moving nothing twice:

* tensors reach MPI as numpy views of their own memory (no staging copies);
  half precision travels as its raw 16-bit patterns and is reduced in float32;
* a list of tensors is one message per peer: no copy at all when the tensors
  already lie back to back (parameters re-pointed into one flat buffer);
* receive and scaling buffers come from a pool kept between calls, because
  fresh memory of tens of MB costs a page fault per 4 KiB on first touch
  (more than the transfer itself); the ``*_`` forms write the result into
  the caller's tensors, so the hot path allocates nothing;
* the weighted combine runs in place on the caller's or the fused buffer;
* allreduce of 8 MiB and more runs our own ring (reduce-scatter, then
  allgather, over point to point): on shared memory it moves and adds less
  than Open MPI's default algorithm and beats it, and gloo, about twice
  (scripts/bench_comm.py); smaller buffers use MPI_Allreduce (latency).

Mismatched neighbor declarations: each neighbor op gathers every rank's
declaration (bfexp.comm.declarations: a few integers and two bit maps)
with a nonblocking Allgather that runs alongside the data, so a correct
program pays no extra round trip. When the declarations disagree, every
rank sees the same table, drains or cancels what it posted (so the engine
stays usable) and raises the same CommError.

Windows are MPI-3 RMA windows (``MPI_Win_allocate``; on one host Open MPI's
shared-memory ``osc/sm``) under passive-target locks: put/accumulate/get
take a shared lock on the target, a rank changing its own window memory
takes an exclusive lock on itself, so a put (data and push-sum weight
together) is never seen half done. MPI cannot add half precision, so
accumulate of float16/bfloat16 reads the slot, adds in float32 and writes
it back under an exclusive lock. An exchange (``win_exchange``) holds the
peer's memory under an exclusive lock while it reads, changes and writes
back its own value; one epoch on this rank's own memory at a time per
process (a thread lock), since the caller's thread (``win_lock``) and the
helper thread may both ask for it. Nonblocking window ops run on one helper
thread per engine (the MPI library is initialized with MPI_THREAD_MULTIPLE
by mpi4py); without that thread level they run inline and their handles
come back completed. ``MPIHost`` is this host part alone: the NCCL engine
keeps its windows the same way.

Importing this module does not initialize MPI (only ``from mpi4py import
MPI`` does, and that happens in the constructor): the driver process
imports engine classes and must never initialize MPI.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import torch

from bfexp.comm.declarations import HEADER, Declaration, GatherDeclaration, MachineDeclaration, Table
from bfexp.comm.declarations import allgather_problems, header, mismatch_error, shape_signature
from bfexp.comm.engine import HALF_DTYPES, Call, Engine, NeighborSpec, Pending, Window, accumulate_, first_dims
from bfexp.comm.engine import local_size_for, rows_shape, ungather, weighted_combine_, work_dtype
from bfexp.errors import CommError


def load_mpi() -> Any:
    """The MPI module of mpi4py; importing it initializes MPI, so only ranks call this."""
    from mpi4py import MPI

    return MPI


def as_buffer(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory, for MPI to move (not reduce).

    Half precision (which MPI cannot name) and bool travel as raw bits.
    """
    if t.dtype in HALF_DTYPES:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    return t.numpy()


# Buffers from this size on (bytes, in the dtype reduced in) are allreduced by our ring.
RING_MIN_BYTES = 8 << 20


def split_counts(total: int, parts: int) -> list[int]:
    """``total`` elements in ``parts`` nearly equal pieces, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class BufferPool:
    """Scratch tensors kept between calls, by (dtype, numel), least recently used dropped first."""

    def __init__(self, max_bytes: int = 1 << 30, per_key: int = 8) -> None:
        self.max_bytes = max_bytes
        self.per_key = per_key
        self._free: OrderedDict[tuple[torch.dtype, int], list[torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, int(numel))
        stack = self._free.get(key)
        if stack:
            self._free.move_to_end(key)
            t = stack.pop()
            self._bytes -= t.numel() * t.element_size()
            return t
        return torch.empty(int(numel), dtype=dtype)

    def give(self, t: torch.Tensor) -> None:
        key = (t.dtype, t.numel())
        stack = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(stack) >= self.per_key:
            return
        stack.append(t)
        self._bytes += t.numel() * t.element_size()
        while self._bytes > self.max_bytes and self._free:
            old_key, old = next(iter(self._free.items()))
            while old and self._bytes > self.max_bytes:
                gone = old.pop(0)
                self._bytes -= gone.numel() * gone.element_size()
            if not old:
                del self._free[old_key]

    def clear(self) -> None:
        self._free.clear()
        self._bytes = 0


# ------------------------------------------------------------------ repeated exchanges

# A repeated exchange of a tensor up to this size keeps its own receive buffers (REPEAT_PLANS of them at most).
REPEAT_MAX_BYTES = 256 << 10
REPEAT_PLANS = 32


class _Repeat:
    """One tensor memory's exchange in one checked topology round, set up once: peers, weights, buffers.

    Holding the tensor keeps its storage alive, so no other tensor can take its address while the
    set-up is kept. ``busy`` while posted: a second exchange of the same memory before the first is
    waited (outside the contract) takes the general path. A topology's round sends unscaled (the
    receiver weighs), so the tensor's own memory is what goes out.
    """

    def __init__(self, tensor: torch.Tensor, spec: NeighborSpec) -> None:
        assert all(w == 1.0 for w in spec.dst_weights.values()), "a topology round's senders do not weigh"
        self.tensor = tensor.detach()
        self.send = self.tensor.numpy()
        self.dsts = list(spec.dst_weights)
        inbox = {src: torch.empty_like(self.tensor) for src in spec.src_weights}
        self.recvs = [(src, buf.numpy()) for src, buf in inbox.items()]
        self.self_weight = spec.self_weight
        self.pairs = [(inbox[src], w) for src, w in spec.src_weights.items()]  # the contract's order
        self.nbytes = self.tensor.numel() * self.tensor.element_size() * len(self.dsts)  # what this rank sends
        self.busy = False
        self.MPI = load_mpi()

    def post(self, comm: Any, tag: int, given: torch.Tensor) -> Pending:
        MPI = self.MPI
        self.busy = True
        requests = [comm.Isend(self.send, dest=dst, tag=tag) for dst in self.dsts]
        requests += [comm.Irecv(buf, source=src, tag=tag) for src, buf in self.recvs]

        def wait() -> torch.Tensor:
            MPI.Request.Waitall(requests)
            weighted_combine_(self.tensor, self.self_weight, self.pairs)
            self.busy = False
            return given

        return wait, lambda: MPI.Request.Testall(requests)


# ------------------------------------------------------------------ declarations


def gather_declarations(comm: Any, declaration: Declaration) -> np.ndarray:
    """Every rank's declaration row, in rank order (a blocking Allgather)."""
    rows = np.empty((comm.Get_size(), declaration.row.size), np.uint8)
    comm.Allgather(declaration.row, rows)
    return rows


class _Gathering:
    """Every rank's declaration of one exchange, gathered by a nonblocking Allgather
    (``post=False``: by a blocking one later, ``gather()``)."""

    def __init__(self, comm: Any, declaration: Declaration, post: bool = True) -> None:
        self.comm = comm
        self.declaration = declaration
        self.rows = np.empty((comm.Get_size(), declaration.row.size), np.uint8)
        self.request = comm.Iallgather(declaration.row, self.rows) if post else None

    def gather(self) -> None:
        self.comm.Allgather(self.declaration.row, self.rows)


# ------------------------------------------------------------------ staged handles


class _Stages:
    """Drives a plan: a generator that posts MPI requests and yields them; it resumes once they
    complete, and ``finish`` runs when it is exhausted.

    The code before the plan's first yield runs at once, when the op is
    called (every rank calls ops in one order, so tags and collectives
    posted there pair up). ``done()`` advances the plan as far as it can
    without blocking; an error the plan raises is kept and raised again by
    ``wait()``.
    """

    def __init__(self, plan: Iterator[list], finish: Callable[[], Any]) -> None:
        self._plan = plan
        self._finish = finish
        self._error: BaseException | None = None
        self._requests: list | None = self._advance()

    def _advance(self) -> list | None:
        try:
            return next(self._plan)
        except StopIteration:
            return None

    def test(self) -> bool:
        MPI = load_mpi()
        try:
            while self._requests is not None:
                if self._requests and not MPI.Request.Testall(self._requests):
                    return False
                self._requests = self._advance()
            return True
        except BaseException as exc:  # kept for wait()
            self._error, self._requests = exc, None
            return True

    def wait_requests(self) -> None:
        """Run the plan to its end (without ``finish``)."""
        MPI = load_mpi()
        if self._error is not None:
            raise self._error
        while self._requests is not None:
            if self._requests:
                MPI.Request.Waitall(self._requests)
            self._requests = self._advance()

    def wait(self) -> Any:
        self.wait_requests()
        return self._finish()

    def pending(self) -> Pending:
        return self.wait, self.test


def _ring_allreduce(comm: Any, work: torch.Tensor, inbox: torch.Tensor, average: bool, tag: int) -> Iterator[list]:
    """Ring reduce-scatter then ring allgather, in place on ``work``: a plan for _Stages.

    Each rank moves 2 (n-1)/n of the buffer and adds (n-1)/n of it: for
    large buffers on shared memory this beats Open MPI's default allreduce
    and gloo's (scripts/bench_comm.py). Chunk k (``split_counts``) is summed
    along the ring starting at rank k: ``((x_k + x_{k+1}) + x_{k+2}) + ... +
    x_{k-1}``; with ``average`` the rank that completes a chunk divides it by n.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    counts = split_counts(work.numel(), n)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    chunks = [work[starts[i] : starts[i] + counts[i]] for i in range(n)]
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        got = inbox[: counts[recv_i]]
        yield [comm.Isend(chunks[send_i].numpy(), dest=right, tag=tag), comm.Irecv(got.numpy(), source=left, tag=tag)]
        chunks[recv_i].add_(got)
        if average and s == n - 2:
            chunks[recv_i].div_(n)
    for s in range(n - 1):
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        yield [
            comm.Isend(chunks[send_i].numpy(), dest=right, tag=tag),
            comm.Irecv(chunks[recv_i].numpy(), source=left, tag=tag),
        ]


# ------------------------------------------------------------------ neighbor exchange


@dataclass
class _Exchange:
    """One rank's posted part of a neighbor exchange: its sends and receives."""

    comm: Any
    tag: int
    send_requests: list = field(default_factory=list)
    recv_requests: dict = field(default_factory=dict)  # src -> request
    received: dict = field(default_factory=dict)  # src -> tensor
    scratch: list = field(default_factory=list)  # pooled tensors to give back

    def requests(self) -> list:
        return self.send_requests + list(self.recv_requests.values())

    def abandon(self, senders: np.ndarray, aux: Any = None) -> None:
        """Leave nothing behind: match every message actually sent to us, cancel the rest, finish our sends."""
        MPI = load_mpi()
        for src, req in self.recv_requests.items():
            if not senders[src]:
                req.Cancel()
            try:
                req.Wait()
            except MPI.Exception:
                pass  # a message of another size: it is matched, which is all we need
        for src in np.flatnonzero(senders).tolist():
            if src not in self.recv_requests:
                _drain(self.comm, src, self.tag)
                if aux is not None:
                    _drain(aux, src, self.tag)
        for req in self.send_requests:
            try:
                req.Wait()
            except MPI.Exception:
                pass
        self.recv_requests, self.send_requests = {}, []


def _drain(comm: Any, source: int, tag: int) -> None:
    """Receive and drop one message (of any size) from ``source``."""
    MPI = load_mpi()
    status = MPI.Status()
    message = comm.Mprobe(source, tag, status)
    sink = np.empty(max(1, status.Get_count(MPI.BYTE)), np.uint8)
    message.Recv([sink, MPI.BYTE])


# ------------------------------------------------------------------ windows


class _Window(Window):
    """A window part in MPI-3 RMA memory.

    Memory (bytes, disp_unit 1): data ``(1 + k) x numel`` elements (row 0 the
    own value, row s the slot of the s-th source in ascending rank), padded
    to 8, then ``1 + k`` float64 weights in the same order.
    """

    def __init__(
        self,
        name: str,
        srcs: list[int],
        dsts: list[int],
        data: torch.Tensor,
        weights: np.ndarray,
        win: Any,
        rank: int,
        remote_slot: dict[int, int],
        remote_weights_at: list[int],
    ) -> None:
        super().__init__(name, srcs, dsts, data, weights)
        self.win = win
        self.rank = rank
        self.remote_slot = remote_slot  # dst -> row of our slot at dst
        self.remote_weights_at = remote_weights_at  # rank -> byte offset of its weights
        self.pending: list[Future] = []
        # One epoch on our own memory at a time from this process: the caller's thread
        # (Engine.win_lock) and the window helper thread may both ask for it.
        self.local = threading.Lock()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        MPI = load_mpi()
        with self.local:
            self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            try:
                yield
            finally:
                self.win.Unlock(self.rank)


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def machine_local_size(comm: Any, local: Any) -> int:
    """Ranks per machine from a split of ``comm`` by machine (collective over ``comm``).

    The engine numbers machines by ``rank // local_size`` (hierarchical ops, inner-outer
    graphs, the cost model), so every machine must hold the same number of consecutive
    ranks: what mpirun's by-slot and srun's block placement give. Any other placement
    raises the same CommError on every rank, naming it.
    """
    rank = comm.Get_rank()
    first = local.allreduce(rank, op=load_mpi().MIN)
    facts = comm.allgather((first, local.Get_size(), rank == first + local.Get_rank()))
    local_size = facts[0][1]
    if not all(n == local_size and consecutive and f % local_size == 0 for f, n, consecutive in facts):
        machines = sorted({(f, n) for f, n, _ in facts})
        raise CommError(
            f"ranks sit on machines as (first rank, ranks) {machines}; allowed: the same number of consecutive "
            "ranks on every machine (mpirun --map-by slot, srun --distribution=block), or set engine.ranks_per_machine"
        )
    return local_size


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


class MPIHost:
    """What an engine of MPI processes has on the host, written once for MPIEngine and NCCLEngine:
    rank and size of ``self.comm``, its machine communicators, blocking declaration gathers, and
    one-sided windows in host memory (MPI-3 RMA)."""

    comm: Any
    _windows: dict[str, Window]
    _window_thread: ThreadPoolExecutor | None = None

    def _join(self, comm: Any, ranks_per_machine: int) -> None:
        """Use ``comm`` (None: COMM_WORLD) and split it by machine: ``_local`` holds this machine's ranks,
        ``_cross`` the ranks with this local rank (one per machine). Collective, so that no op makes a
        communicator half-way (a rank that raised before it would leave the others hanging).

        ``ranks_per_machine`` > 0 emulates machines of that many consecutive ranks (on one host too);
        0 detects the machines the ranks really run on (``_machine_comm``)."""
        self.comm = comm if comm is not None else load_mpi().COMM_WORLD
        rank = self.comm.Get_rank()
        if ranks_per_machine:
            self._local_size = local_size_for(self.comm.Get_size(), ranks_per_machine)
            self._local = self.comm.Split(rank // self._local_size, rank)
            self.layout_source = "emulated"
        else:
            self._local = self._machine_comm()
            self._local_size = machine_local_size(self.comm, self._local)
            self.layout_source = "detected"
        self._cross = self.comm.Split(rank % self._local_size, rank)

    def _machine_comm(self) -> Any:
        """The ranks sharing this rank's machine: MPI's shared-memory split (one communicator per
        node, as the MPI library sees where its processes run), ordered by rank."""
        return self.comm.Split_type(load_mpi().COMM_TYPE_SHARED, key=self.comm.Get_rank())

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def _declare_all(self, declaration: Declaration) -> np.ndarray:
        return gather_declarations(self.comm, declaration)

    def _win_allocate(self, name: str, flat: torch.Tensor, srcs: list[int], dsts: list[int], declared: Table) -> Window:
        MPI = load_mpi()
        numel, n, me = flat.numel(), self.comm.Get_size(), self.rank
        in_lists = [np.flatnonzero(declared.expects[r]).tolist() for r in range(n)]
        data_bytes = [(1 + len(in_lists[r])) * numel * flat.element_size() for r in range(n)]
        weights_at = [_align8(b) for b in data_bytes]
        total = weights_at[me] + (1 + len(srcs)) * 8
        win = MPI.Win.Allocate(total, 1, comm=self.comm)
        memory = np.frombuffer(win.tomemory(), np.uint8)
        data = torch.from_numpy(memory[: data_bytes[me]]).view(flat.dtype).view(1 + len(srcs), numel)
        weights = memory[weights_at[me] : total].view(np.float64)
        remote_slot = {d: 1 + in_lists[d].index(me) for d in dsts}
        return _Window(name, srcs, dsts, data, weights, win, me, remote_slot, weights_at)

    def _win_release(self, window: Window) -> None:
        assert isinstance(window, _Window)
        for f in window.pending:
            f.exception()  # wait; errors were the caller's to collect from the handle
        window.win.Free()  # collective

    def _win_send(self, window: Window, dst: int, payload: torch.Tensor, weight: float, accumulate: bool) -> None:
        assert isinstance(window, _Window)
        MPI, w = load_mpi(), window
        pw = np.array([weight], np.float64)
        row = w.remote_slot[dst]
        disp = row * w.row_bytes
        wdisp = w.remote_weights_at[dst] + row * 8
        mpi_type = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}.get(w.dtype)
        if accumulate and mpi_type is None:
            # MPI cannot add half precision: read, add in float32, write, under an exclusive lock.
            current = torch.empty(w.numel, dtype=w.dtype)
            cw = np.empty(1, np.float64)
            w.win.Lock(dst, MPI.LOCK_EXCLUSIVE)
            w.win.Get(_raw_bytes(current), dst, target=(disp, w.row_bytes, MPI.BYTE))
            w.win.Get(cw, dst, target=(wdisp, 8, MPI.BYTE))
            w.win.Flush(dst)
            accumulate_(current, payload)
            pw += cw
            w.win.Put(_raw_bytes(current), dst, target=(disp, w.row_bytes, MPI.BYTE))
            w.win.Put(pw, dst, target=(wdisp, 8, MPI.BYTE))
            w.win.Unlock(dst)
            return
        w.win.Lock(dst, MPI.LOCK_SHARED)
        if accumulate:
            w.win.Accumulate(payload.numpy(), dst, target=(disp, w.numel, mpi_type), op=MPI.SUM)
            w.win.Accumulate(pw, dst, target=(wdisp, 1, MPI.DOUBLE), op=MPI.SUM)
        else:
            w.win.Put(_raw_bytes(payload), dst, target=(disp, w.row_bytes, MPI.BYTE))
            w.win.Put(pw, dst, target=(wdisp, 8, MPI.BYTE))
        w.win.Unlock(dst)

    def _win_fetch(self, window: Window, src: int, into: torch.Tensor) -> float:
        assert isinstance(window, _Window)
        MPI, w = load_mpi(), window
        fw = np.empty(1, np.float64)
        w.win.Lock(src, MPI.LOCK_SHARED)
        w.win.Get(_raw_bytes(into), src, target=(0, w.row_bytes, MPI.BYTE))
        w.win.Get(fw, src, target=(w.remote_weights_at[src], 8, MPI.BYTE))
        w.win.Unlock(src)
        return float(fw[0])

    def _win_swap(self, window: Window, peer: int, change: Callable[[torch.Tensor], None]) -> None:
        assert isinstance(window, _Window)
        MPI, w = load_mpi(), window
        theirs = torch.empty(w.numel, dtype=w.dtype)
        w.win.Lock(peer, MPI.LOCK_EXCLUSIVE)
        try:
            w.win.Get(_raw_bytes(theirs), peer, target=(0, w.row_bytes, MPI.BYTE))
            w.win.Flush(peer)
            change(theirs)
            w.win.Put(_raw_bytes(theirs), peer, target=(0, w.row_bytes, MPI.BYTE))
        finally:
            w.win.Unlock(peer)

    def _run_window_op(self, window: Window, work: Callable[[], Any]) -> Pending:
        """On the helper thread (MPI_THREAD_MULTIPLE), else inline; inline also for a blocking form
        (win_put, ...: the caller waits at once) when nothing of this window is in flight, which
        saves the hand-over to the helper thread and back (most of a small op's time)."""
        assert isinstance(window, _Window)
        MPI = load_mpi()
        idle = self._blocking_depth > 0 and all(f.done() for f in window.pending)  # type: ignore[attr-defined]
        if idle or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            result = work()
            return (lambda: result), None
        if self._window_thread is None:
            self._window_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bfexp-window")
        future = self._window_thread.submit(work)
        window.pending = [f for f in window.pending if not f.done()] + [future]
        return future.result, future.done

    def _close_host(self) -> None:
        """Free every window and the machine communicators (collective), stop the helper thread."""
        if self._windows:
            self.win_free()  # type: ignore[attr-defined]
        if self._window_thread is not None:
            self._window_thread.shutdown(wait=True)
        for c in (self._local, self._cross):
            c.Free()


# ------------------------------------------------------------------ the engine


class MPIEngine(MPIHost, Engine):
    """The Engine contract over mpi4py on CPU tensors (see the module doc)."""

    name: ClassVar[str] = "mpi"
    virtual: ClassVar[bool] = False
    processes: ClassVar[bool] = True
    device_type: ClassVar[str] = "cpu"

    def __init__(
        self, *, ranks_per_machine: int = 0, check_neighbors: bool = True, timeline: bool = False,
        mpiexec_args: tuple[str, ...] = (), comm: Any = None, timeline_from_env: bool = True
    ) -> None:
        """``ranks_per_machine`` (0: all on one) groups ranks into machines for hierarchical ops;
        ``check_neighbors=False`` skips the declaration check of neighbor_allreduce and
        hierarchical_neighbor_allreduce (one tiny Allgather per call): a mismatch then hangs,
        as raw MPI does. ``comm``: the communicator (default COMM_WORLD).

        Two settings of conf/engine/mpi.yaml are for the job around the engine, which reads them from
        its config: ``timeline`` (the worker records each rank's Chrome trace into <run dir>/timeline/)
        and ``mpiexec_args`` (extra arguments of the mpiexec that starts the ranks, e.g.
        ["--bind-to", "none"]; kept as ``self.mpiexec_args``)."""
        super().__init__()
        self.mpiexec_args = tuple(mpiexec_args)
        self.check_neighbors = check_neighbors
        self._join(comm, ranks_per_machine)
        self._aux = self.comm.Dup()  # shape headers of gathers, apart from data tags
        # Tags keep concurrent nonblocking neighbor ops apart; every rank
        # issues ops in the same order, so the counters agree.
        self._op_seq = 0
        self._pool = BufferPool()
        self._repeats: OrderedDict[tuple, _Repeat] = OrderedDict()  # (pattern key, address) -> set-up
        self._closed = False
        if timeline_from_env:
            self.attach_timeline_from_env(self.rank)

    @classmethod
    def available(cls, ranks: int, ranks_per_machine: int | None = None) -> tuple[bool, str]:
        if importlib.util.find_spec("mpi4py") is None:
            return False, "no mpi4py: install it (pip install mpi4py) with an MPI library (Open MPI, MPICH)"
        return True, ""

    @classmethod
    def thread_multiple(cls) -> bool:
        """Whether MPI was initialized with THREAD_MULTIPLE (asked once MPI runs: of a rank's engine)."""
        mpi = load_mpi()
        return mpi.Query_thread() == mpi.THREAD_MULTIPLE

    def _next_tag(self) -> int:
        self._op_seq = (self._op_seq + 1) % 30000
        return 1000 + self._op_seq

    def release_buffers(self) -> None:
        """Drop the scratch buffers kept between calls (memory goes back to the OS)."""
        self._pool.clear()
        self._repeats.clear()

    def set_topology(self, topology: Any) -> None:
        super().set_topology(topology)
        self._repeats.clear()  # set-ups of the old graph's rounds

    def _post_repeated_neighbor_allreduce(self, key: tuple, tensor: torch.Tensor, t: int) -> tuple[Pending, int] | None:
        where = (key, tensor.data_ptr())  # key: the topology's round, numel and dtype
        plan = self._repeats.get(where)
        if plan is None:
            if (tensor.dtype not in (torch.float32, torch.float64) or not tensor.is_contiguous()
                    or tensor.numel() * tensor.element_size() > REPEAT_MAX_BYTES):
                return None
            plan = self._repeats[where] = _Repeat(tensor, self.topology_spec(t))
            if len(self._repeats) > REPEAT_PLANS:
                self._repeats.popitem(last=False)
        elif plan.busy or not tensor.is_contiguous():
            return None
        return plan.post(self.comm, self._next_tag(), tensor), plan.nbytes

    # collectives --------------------------------------------------------
    def _post_allreduce(self, call: Call, op: str, blocking: bool) -> Pending:
        """``blocking``: the tuned blocking collective (Open MPI's algorithms beat a waited Iallreduce)."""
        MPI = load_mpi()
        flat = call.flat
        dtype, numel = flat.dtype, flat.numel()
        reduce_in = work_dtype(dtype)
        out = call.out_buffer()  # the caller's memory (in place), else a buffer of ours
        scratch = []
        if reduce_in != dtype:
            work = self._pool.take(numel, reduce_in)
            scratch.append(work)
            work.copy_(flat)
        else:
            work = out
            if out is not flat:
                out.copy_(flat)
        n = self.size
        ring = numel * work.element_size() >= RING_MIN_BYTES
        average = op == "avg"
        if self.timeline is not None:
            call.meta["algorithm"] = "ring" if ring else "mpi"

        def finish() -> Any:
            if average and not ring:  # the ring divides as it completes each chunk
                work.div_(n)
            if work is not out:
                out.copy_(work)
            for t in scratch:
                self._pool.give(t)
            return call.deliver(out)

        if ring:
            inbox = self._pool.take(split_counts(numel, n)[0], reduce_in)
            scratch.append(inbox)
            stages = _Stages(_ring_allreduce(self.comm, work, inbox, average, self._next_tag()), finish)
            if blocking:
                stages.wait_requests()
            return stages.pending()
        if blocking:
            self.comm.Allreduce(MPI.IN_PLACE, work.numpy(), op=MPI.SUM)
            return finish, None
        req = self.comm.Iallreduce(MPI.IN_PLACE, work.numpy(), op=MPI.SUM)
        return _after(req, finish)

    def _post_broadcast(self, call: Call, root: int) -> Pending:
        out = call.writable()
        if self._blocking_depth > 0:  # the caller waits at once: the blocking collective (no request to drive)
            self.comm.Bcast(as_buffer(out), root=root)
            return (lambda: call.deliver(out)), None
        return _after(self.comm.Ibcast(as_buffer(out), root=root), lambda: call.deliver(out))

    def _post_barrier(self, blocking: bool) -> Pending:
        if blocking:
            self.comm.Barrier()
            return _nothing, None
        return _after(self.comm.Ibarrier(), _nothing)

    def _post_allgather(self, call: Call) -> Pending:
        """The sizes are agreed at call time (one tiny blocking Allgather, two for a list), so only
        the data moves in the background: a collective posted later, from wait(), could be posted
        in another order on another rank."""
        tensors, flat = call.tensors, call.flat
        n, k = self.size, len(tensors)
        dims = first_dims(tensors)
        head = np.concatenate([header(flat.numel(), flat.dtype, k, shape_signature(tensors)), [dims[0]]])
        heads = np.empty((n, head.size), np.int64)
        self.comm.Allgather(head, heads)
        problems = allgather_problems(heads[:, :HEADER], self.rank)
        if problems:
            raise mismatch_error("allgather", problems)
        if k == 1:
            rows = heads[:, HEADER:].copy()
        else:
            rows = np.empty((n, k), np.int64)
            self.comm.Allgather(np.array(dims, np.int64), rows)
        counts = heads[:, 0].tolist()
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        everything = torch.empty(int(sum(counts)), dtype=flat.dtype)
        req = self.comm.Iallgatherv(as_buffer(flat), [as_buffer(everything), (counts, displs)])

        def finish() -> Any:
            if k == 1:  # rank order is tensor order: the buffer as it came
                return call.as_given([everything.view(rows_shape(tensors[0], int(rows[:, 0].sum())))])
            per_rank = [everything[displs[r] : displs[r] + counts[r]] for r in range(n)]
            return call.as_given(ungather(per_rank, rows, tensors))

        return _after(req, finish)

    # neighbor exchange --------------------------------------------------
    def _post_exchange(self, comm: Any, flat: torch.Tensor, spec: NeighborSpec, tag: int) -> _Exchange:
        """Post the sends (scaled where the sender weighs) and receives of one neighbor exchange.

        ``tag`` is taken when the op is *called* (every rank calls ops in one
        order), never when a later stage runs from wait() or done().
        """
        ex = _Exchange(comm, tag)
        for dst, w in spec.dst_weights.items():
            payload = flat
            if w != 1.0:
                payload = self._pool.take(flat.numel(), flat.dtype)
                torch.mul(flat, w, out=payload)
                ex.scratch.append(payload)
            ex.send_requests.append(comm.Isend(as_buffer(payload), dest=dst, tag=tag))
        for src in spec.src_weights:
            buf = self._pool.take(flat.numel(), flat.dtype)
            ex.scratch.append(buf)
            ex.received[src] = buf
            ex.recv_requests[src] = comm.Irecv(as_buffer(buf), source=src, tag=tag)
        return ex

    def _release(self, ex: _Exchange) -> None:
        for t in ex.scratch:
            self._pool.give(t)
        ex.scratch = []

    def _verify(self, ex: _Exchange, gathering: _Gathering, aux: Any = None) -> None:
        """Raise the exchange's CommError on every rank when the declarations disagree (after cleaning up)."""
        declaration = gathering.declaration
        problems = declaration.verdict(gathering.rows)
        if problems:
            ex.abandon(declaration.table(gathering.rows).sends[:, self.rank], aux)
            self._release(ex)
            raise declaration.error(problems)

    def _post_neighbor_allreduce(
        self, call: Call, spec: NeighborSpec, declaration: Declaration | None, blocking: bool
    ) -> Pending:
        """``blocking``: the declarations travel by a blocking Allgather while the data moves
        (the blocking forms wait anyway; this keeps nonblocking-collective progress out of them)."""
        gathering = _Gathering(self.comm, declaration, post=not blocking) if declaration is not None else None
        ex = self._post_exchange(self.comm, call.flat, spec, self._next_tag())
        if gathering is not None and gathering.request is None:
            gathering.gather()

        def plan() -> Iterator[list]:
            if gathering is not None:
                if gathering.request is not None:
                    yield [gathering.request]
                self._verify(ex, gathering)
            yield ex.requests()

        def finish() -> Any:
            try:
                return call.combine(spec, ex.received)
            finally:
                self._release(ex)

        return _Stages(plan(), finish).pending()

    def _post_neighbor_allgather(
        self, call: Call, declaration: GatherDeclaration, srcs: list[int], dsts: list[int]
    ) -> Pending:
        flat, k = call.flat, len(call.tensors)
        dims = np.array(first_dims(call.tensors), np.int64)
        tag = self._next_tag()
        gathering = _Gathering(self.comm, declaration)
        ex = _Exchange(self.comm, tag)
        for d in dsts:  # the shape header on the aux communicator, the data on the main one
            ex.send_requests.append(self._aux.Isend(dims, dest=d, tag=tag))
            ex.send_requests.append(self.comm.Isend(as_buffer(flat), dest=d, tag=tag))
        got: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

        def plan() -> Iterator[list]:
            yield [gathering.request]
            self._verify(ex, gathering, aux=self._aux)
            numels = declaration.table(gathering.rows).numels
            requests = list(ex.send_requests)
            for s in srcs:
                rows = np.empty(k, np.int64)
                data = torch.empty(int(numels[s]), dtype=flat.dtype)
                got[s] = (rows, data)
                requests.append(self._aux.Irecv(rows, source=s, tag=tag))
                requests.append(self.comm.Irecv(as_buffer(data), source=s, tag=tag))
            yield requests

        def assemble() -> Any:
            return call.as_given(ungather([got[s][1] for s in srcs], [got[s][0] for s in srcs], call.tensors))

        return _Stages(plan(), assemble).pending()

    def _post_hierarchical(self, call: Call, spec: NeighborSpec, declaration: MachineDeclaration | None) -> Pending:
        """Reduce-scatter inside the machine, exchange each slice with the same local rank of
        neighbor machines, allgather inside the machine: every byte crosses machines once."""
        MPI = load_mpi()
        flat = call.flat
        dtype, numel = flat.dtype, flat.numel()
        reduce_in = work_dtype(dtype)
        L = self.local_size
        counts = split_counts(numel, L)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        mine = counts[self.local_rank]
        send = flat
        if reduce_in != dtype:
            send = self._pool.take(numel, reduce_in)
            send.copy_(flat)
        piece = self._pool.take(mine, reduce_in)
        scratch = [piece] + ([send] if send is not flat else [])
        # The result: the caller's memory (in place), else a buffer of ours.
        if reduce_in != dtype:
            gathered = self._pool.take(numel, reduce_in)
            scratch.append(gathered)
        else:
            gathered = call.out_buffer()
        tag = self._next_tag()
        first = [self._local.Ireduce_scatter(send.numpy(), piece.numpy(), counts, op=MPI.SUM)]
        gathering = _Gathering(self.comm, declaration) if declaration is not None else None
        if gathering is not None:
            first.insert(0, gathering.request)

        def plan() -> Iterator[list]:
            yield first
            problems = gathering.declaration.verdict(gathering.rows) if gathering is not None else []
            if problems:
                for t in scratch:
                    self._pool.give(t)
                raise gathering.declaration.error(problems)
            piece.div_(L)
            ex = self._post_exchange(self._cross, piece, spec, tag)
            yield ex.requests()
            # Point to point inside the machine (a collective posted from wait()
            # could meet another op's on a rank that waits in another order).
            weighted_combine_(piece, spec.self_weight, [(ex.received[s], w) for s, w in spec.src_weights.items()])
            self._release(ex)
            me = self.local_rank
            gathered[displs[me] : displs[me] + mine].copy_(piece)
            requests = []
            for lr in range(L):
                if lr != me:
                    requests.append(self._local.Isend(piece.numpy(), dest=lr, tag=tag))
                    target = gathered[displs[lr] : displs[lr] + counts[lr]]
                    requests.append(self._local.Irecv(target.numpy(), source=lr, tag=tag))
            yield requests

        def finish() -> Any:
            out = gathered
            if reduce_in != dtype:
                out = call.out_buffer()
                out.copy_(gathered)
            for t in scratch:
                self._pool.give(t)
            return call.deliver(out)

        return _Stages(plan(), finish).pending()

    # lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Free windows and communicators (collective: every rank calls it). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._close_host()
        self._aux.Free()
        self.release_buffers()


def _nothing() -> None:
    return None


def _after(request: Any, finish: Callable[[], Any]) -> Pending:
    """Wait for one MPI request, then ``finish``; done() tests the request."""

    def wait() -> Any:
        request.Wait()
        return finish()

    return wait, request.Test
