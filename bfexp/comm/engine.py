"""The Engine contract, and its semantics written once: engines supply only transport.

Engines move torch tensors between ranks. A *list* of tensors always travels
as ONE fused message per peer (one flat buffer), because per-tensor messages
are latency-bound for models with hundreds of small parameters.

Weights (shared by every engine and by the topology package):

* ``X+ = W X``: row i of X is rank i's tensor, ``W[i, j]`` the weight that
  receiver i gives to the value it gets from sender j.
* ``neighbor_allreduce`` on rank i returns
  ``self_weight * x_i + sum_j src_weights[j] * (dst_weight_{j->i} * x_j)``
  where ``dst_weight_{j->i}`` is the scale the *sender* j applied to what it
  sent to i (1 when the sender gave a plain list of destinations). Receivers
  weigh for row-stochastic mixing; senders scale for column-stochastic
  (push-sum) mixing. Both are per call, so dynamic topologies work; left out,
  they come from the static topology (``set_topology``). The combine has one
  order, ``weighted_combine_``: ``x * self_weight``, then ``add_`` of each
  source in ``src_weights`` order, so engines agree to the bit where their
  inputs do.

Operations (tensor or list of tensors in, new tensor(s) out):

==============================  ==============================================
allreduce(t, op)                sum or average ('sum', 'avg') over all ranks;
                                half precision is reduced in float32
allgather(t)                    every rank's t concatenated along dim 0 in
                                rank order; dim 0 may differ across ranks
broadcast(t, root)              root's value on every rank
barrier()                       every rank reached it
neighbor_allreduce(t, ...)      the weighted combination above
neighbor_allgather(t, src, dst) in-neighbors' t concatenated along dim 0 in
                                ascending source rank (dim 0 may differ)
hierarchical_neighbor_allreduce average inside each machine, then the
  (t, ...)                      weighted combination above among machines
                                (weights keyed by *machine*), on every rank
==============================  ==============================================

Every op ``op`` has a nonblocking twin ``iop`` returning a Handle (the
caller must leave its input tensors alone until ``wait()``); the blocking
form waits on it. ``allreduce_``, ``broadcast_``, ``neighbor_allreduce_``
and ``hierarchical_neighbor_allreduce_`` (and their ``i`` twins) write the
result into the given tensors instead: no output allocation, which for
tensors of tens of MB costs more than the communication (fresh pages fault).

Mismatched declarations (rank 3 expects from 1, but 1 does not send to 3;
or peers that disagree on sizes or dtypes) raise CommError on *every* rank,
naming the ranks, instead of hanging (bfexp.comm.declarations judges them,
for every engine). A single rank works: every op is then local (a neighbor
op returns ``self_weight * x``).

One-sided windows, for asynchronous algorithms (push-sum, gossip):

* ``win_create(t, name, src_ranks, dst_ranks, zero_init, weight)``
  (collective) gives the window a copy of ``t`` as this rank's *own value*,
  one *slot* per in-neighbor (src) for it to write into, and a push-sum
  weight ``p`` (a float64 scalar, start ``weight``) for the own value and
  each slot. Returns the own value as a live tensor (views window memory:
  local changes are what neighbors read).
* ``win_put(t, name, self_weight, dst_weights)``: for each out-neighbor k,
  k's slot for this rank := ``w_k * (t, p)``. ``t`` defaults to the own
  value. With ``self_weight`` the own value then becomes
  ``self_weight * (t, p)``.
* ``win_accumulate(...)``: the same, but adds ``w_k * (t, p)`` to the slot
  (half precision is added in float32).
* ``win_get(name, src_weights)``: for each in-neighbor j, this rank's slot
  for j := ``w_j * (own value of j, p_j)``.
* ``win_update(name, self_weight, src_weights, reset)``: own value :=
  ``self_weight * own + sum_j w_j * slot_j``, and the same for p; ``reset``
  zeroes the slots it used. Weights left out average self and all slots.
* ``win_weight(name)`` is p; ``own / p`` is the de-biased (push-sum) value.
* ``win_slots(name)``: copies of this rank's slots (what has arrived and is
  not yet updated in, one row per in-neighbor in ascending rank) and their
  weights; ``win_set_slots(name, data, weights)`` writes them back: a
  checkpoint keeps a window whole, so a resumed rank folds in what arrived
  before the checkpoint exactly when (and in the order) it would have.
* ``win_lock(name)``: a context manager holding this rank's window memory
  exclusively (no peer's op touches it meanwhile): for a local
  read-modify-write of the own value that peers also change.
* ``win_exchange(name, peer, combine)``: an atomic pair-wise transaction:
  ``combine(mine, theirs)`` runs while both ranks' window memory is held,
  ``mine`` this rank's own value (live), ``theirs`` a copy of the peer's;
  what ``combine`` leaves in ``theirs`` is written back to the peer (weights
  stay). Locks are taken in ascending rank order, so concurrent exchanges
  never deadlock (pair-wise gossip, AD-PSGD's atomic averaging).
* ``win_free(name)`` (collective).

A window's in- and out-neighbors are fixed when it is created (left out:
the static topology's); put/accumulate default to every out-neighbor with
weight 1, get to every in-neighbor with weight 1. Each put/accumulate/get/
update is atomic with respect to the others on the same window: a reader
never sees half of a put, and the weight always moves with its data.
Put/accumulate/get/update have nonblocking ``i`` twins; create and free are
collective set-up calls and block. After a put and a barrier the target's
slot holds the value; a get sees whatever the source's own value is then.

How an engine plugs in: the Engine class below defines every public form
once (checks, defaults from the topology, single-rank ops, the combine, the
window arithmetic, timing) and calls the engine's transport hooks, which
return ``(wait, done)`` for work they posted:

* ``_post_allreduce(call, op, blocking)``, ``_post_broadcast(call, root)``,
  ``_post_allgather(call)``, ``_post_barrier(blocking)``,
  ``_post_neighbor_allreduce(call, spec, declaration, blocking)``,
  ``_post_neighbor_allgather(call, declaration, srcs, dsts)``,
  ``_post_hierarchical(call, spec, declaration)``: ``call`` (a Call) holds
  the caller's tensors fused and hands the result back (``deliver``,
  ``combine``); ``blocking`` says the caller waits at once (an engine may
  then pick another algorithm: MPI's blocking collectives add in their own
  order);
* ``_declare_all(declaration)``: every rank's declaration, blocking;
* windows: ``_win_allocate``, ``_win_release``, ``_win_send`` (write or add
  one slot of a peer), ``_win_fetch`` (read a peer's own value), ``_win_swap``
  (read a peer's own value and write it back, holding the peer) and
  ``_run_window_op`` (run now, or on a helper thread); a Window's
  ``exclusive()`` guards this rank's own window memory.

Engine facts are class attributes: ``name`` ("mpi", "nccl", "threads",
"stacked", or a user's engine's own), ``virtual`` (ranks are threads of one
process), ``processes`` (one OS process per rank, started by mpiexec),
``device_type`` ("cpu", "cuda") and ``stacked`` (one engine object holds
every rank: each tensor's LAST dimension is the rank dimension,
bfexp.comm.stacked); ``available`` says whether ranks can run here. They are
all bfexp knows of an engine: everything asks the class its config node names
(bfexp.comm.engine_facts, engine_class). Stated as plain literals in a class
body, the driver reads them from the source before torch is imported.
"""

from __future__ import annotations

import abc
import atexit
import functools
import inspect
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Sequence, Union

import numpy as np
import torch

from bfexp.comm.declarations import Declaration, GatherDeclaration, MachineDeclaration, Table, TopologyPatterns
from bfexp.comm.declarations import WindowDeclaration
from bfexp.errors import CommError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.timeline import Timeline
    from bfexp.topology import Topology

__all__ = [
    "Activity",
    "Call",
    "CommError",
    "DstWeights",
    "Engine",
    "Handle",
    "forwards",
    "NeighborSpec",
    "Pending",
    "TensorOrList",
    "Weights",
    "Window",
    "weighted_combine_",
]

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
Weights = Mapping[int, float]
DstWeights = Union[Mapping[int, float], Sequence[int]]
# What a transport hook returns for work it posted: wait() -> result, and done() (None: nothing in flight).
Pending = tuple[Callable[[], Any], Union[Callable[[], bool], None]]

AVERAGING_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)


class Activity(tuple):
    """The communication call a rank is inside, as plain data: the op's name and the call site
    (code object and line) of the code that called it. The rank's own thread sets it on entry and
    clears it on exit (``Engine.activity``); the hang watchdog reads it from another thread. Nothing
    here is a frame: a running thread's frames are not safe to walk from another thread."""

    __slots__ = ()

    def __new__(cls, op: str, code: Any, line: int) -> "Activity":
        return tuple.__new__(cls, (op, code, line))

    @property
    def op(self) -> str:
        return self[0]

    def where(self, root: str = "") -> str:
        """``path:line in function`` of the call site (``root`` cut from the path's front)."""
        code, line = self[1], self[2]
        path = code.co_filename
        return f"{path[len(root):] if root and path.startswith(root) else path}:{line} in {code.co_name}"


_FORWARDERS: set[Any] = set()  # code of functions that only pass an operation on (``forwards``)


def forwards(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as one that only passes an operation on (``bf.allreduce`` calls the engine's): the call
    site an activity names is its caller's (the user's script), not its own line."""
    _FORWARDERS.add(function.__code__)
    return function


def _call_site(depth: int) -> Any:
    """The frame ``depth`` levels above the caller, past wrappers named ``wait`` (an algorithm's own
    wait(handle) helper) and ``forwards`` functions. The calling thread's own frames only."""
    frame: Any = inspect.currentframe()
    for _ in range(depth + 1):
        frame = frame.f_back
    while (frame.f_code.co_name == "wait" or frame.f_code in _FORWARDERS) and frame.f_back is not None:
        frame = frame.f_back
    return frame


def recorded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A public engine operation: while it runs, ``engine.activity`` names it and its call site (the
    outermost call only: a blocking form that calls its nonblocking twin stays one activity). In the
    contract's operations (those defined here) an injected ``engine.fault`` runs first, inside the call;
    an engine's own recorded methods (virtual ranks' clock: ``advance``, ``schedule``) communicate nothing."""
    name = method.__name__
    communicates = method.__module__ == __name__  # decided once: the normal path reads one attribute

    @functools.wraps(method)
    def call(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        if self.activity is not None:
            return method(self, *args, **kwargs)
        site: Any = inspect.currentframe().f_back  # type: ignore[union-attr]
        while site.f_code in _FORWARDERS and site.f_back is not None:  # bf.allreduce: its caller's line
            site = site.f_back
        self.activity = Activity(name, site.f_code, site.f_lineno)
        try:
            if communicates and self.fault is not None:
                self.fault()
            return method(self, *args, **kwargs)
        finally:
            self.activity = None

    return call


class Handle:
    """A pending nonblocking operation.

    ``wait()`` blocks until the result is ready and returns it (a tensor, a
    list of tensors, or None); ``done()`` polls without blocking. ``wait`` may
    be called more than once and returns the same result. ``on_finish`` is
    told when the wait began and ended, for timing. ``owner`` (the engine)
    and ``op`` make a wait show as the owner's activity ``wait(op)``.
    """

    def __init__(
        self,
        wait_fn: Callable[[], Any],
        test_fn: Callable[[], bool] | None = None,
        on_finish: Callable[[float, float], None] | None = None,
        owner: "Engine | None" = None,
        op: str = "",
    ) -> None:
        self._wait_fn = wait_fn
        self._test_fn = test_fn
        self._on_finish = on_finish
        self._owner = owner
        self._op = op
        self._finished = False
        self._result: Any = None

    def wait(self) -> Any:
        if not self._finished:
            owner = self._owner
            mark = owner is not None and owner.activity is None
            if mark:
                site = _call_site(1)
                owner.activity = Activity(f"wait({self._op})", site.f_code, site.f_lineno)
            try:
                t0 = time.perf_counter()
                self._result = self._wait_fn()
                self._finished = True
                if self._on_finish is not None:
                    self._on_finish(t0, time.perf_counter())
            finally:
                if mark:
                    owner.activity = None
        return self._result

    def done(self) -> bool:
        if self._finished:
            return True
        if self._test_fn is None:
            return False
        return bool(self._test_fn())


# ---------------------------------------------------------------- fusion


def as_list(tensors: TensorOrList) -> tuple[list[torch.Tensor], bool]:
    """Normalize to a list; the flag says whether the caller passed one tensor."""
    if isinstance(tensors, torch.Tensor):
        return [tensors], True
    out = list(tensors)
    if not out:
        raise ValueError("empty tensor list")
    return out, False


def adjacent_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat view over tensors that already lie back to back in one storage, else None.

    Parameters re-pointed into one flat buffer are such a list: fusing them
    then costs no copy.
    """
    first = tensors[0]
    dtype, device = first.dtype, first.device
    try:
        storage = first.untyped_storage().data_ptr()
    except RuntimeError:  # pragma: no cover - tensors without storage
        return None
    item = first.element_size()
    expected = first.data_ptr()
    total = 0
    for t in tensors:
        if (
            t.dtype != dtype
            or t.device != device
            or not t.is_contiguous()
            or t.data_ptr() != expected
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        expected += t.numel() * item
        total += t.numel()
    return torch.as_strided(first.detach(), (total,), (1,), first.storage_offset())


def fuse(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous flat buffer holding every tensor.

    No copy when the tensors already lie back to back (one contiguous tensor,
    or views of one flat buffer in order): the result is then a *view* of the
    caller's memory (``flat.data_ptr() == tensors[0].data_ptr()``).
    """
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"a fused list needs one dtype, got {sorted(map(str, dtypes))}")
    if len(tensors) == 1:
        return tensors[0].detach().contiguous().view(-1)
    view = adjacent_view(tensors)
    if view is not None:
        return view
    with torch.no_grad():  # cheaper than a detach per tensor
        if all(t.dim() == 1 for t in tensors):
            return torch.cat(tensors)
        return torch.cat([t.reshape(-1) for t in tensors])


def is_view_of(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``fuse`` returned the caller's own memory (so it must not be written)."""
    return flat.data_ptr() == tensors[0].data_ptr() and flat.numel() > 0


def unfuse(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a flat buffer back into tensors shaped like ``like`` (views, no copy)."""
    if len(like) == 1:
        return [flat.view(like[0].shape)]
    parts = torch.split(flat, [t.numel() for t in like])
    return [p if t.dim() == 1 else p.view(t.shape) for p, t in zip(parts, like)]


def first_dims(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's first dimension (a 0-d tensor counts as one row)."""
    return [t.shape[0] if t.dim() else 1 for t in tensors]


def rows_shape(t: torch.Tensor, rows: int) -> tuple[int, ...]:
    """The shape of ``rows`` rows shaped like ``t``'s (0-d gathers into 1-d)."""
    return (rows, *t.shape[1:]) if t.dim() else (rows,)


def row_numel(t: torch.Tensor) -> int:
    """Elements in one row (dim 0 slice) of ``t``; a 0-d tensor is one row of one."""
    n = 1
    for d in t.shape[1:]:
        n *= int(d)
    return n


def ungather(
    buffers: Sequence[torch.Tensor], rows: Sequence[Sequence[int]], like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Per tensor of ``like``, every source's rows concatenated along dim 0 (new tensors).

    ``buffers[i]`` is source i's fused list (it may be longer: padding is
    ignored) and ``rows[i]`` its first dimensions, one per tensor.
    """
    if not buffers:
        return [torch.empty(rows_shape(t, 0), dtype=t.dtype, device=t.device) for t in like]
    per_tensor: list[list[torch.Tensor]] = [[] for _ in like]
    for buffer, counts in zip(buffers, rows):
        offset = 0
        for parts, t, count in zip(per_tensor, like, counts):
            n = int(count) * row_numel(t)
            parts.append(buffer[offset : offset + n].view(rows_shape(t, int(count))))
            offset += n
    return [torch.cat(parts) for parts in per_tensor]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are taken in: float32 for half precision, else the dtype itself."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def weighted_combine_(out: torch.Tensor, self_weight: float, received: Sequence[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """``out = self_weight * out + sum w * r`` in place, in the contract's one order."""
    if self_weight != 1.0:
        out.mul_(self_weight)
    for r, w in received:
        out.add_(r, alpha=w)
    return out


def accumulate_(slot: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """``slot += payload`` as windows add: half precision in float32 (MPI cannot add it)."""
    if slot.dtype in HALF_DTYPES:
        return slot.copy_((slot.float() + payload.float()).to(slot.dtype))
    return slot.add_(payload)


class Call:
    """One call's tensors, fused into one flat buffer, and how its result goes back to the caller.

    ``flat`` is fused on first use (an engine may need to fuse on its own
    stream). ``inplace``: the result is written into the caller's tensors,
    which are returned; otherwise new tensors shaped like them.
    """

    def __init__(self, tensors: TensorOrList, inplace: bool = False) -> None:
        self.tensors, self.single = as_list(tensors)
        self.inplace = inplace
        self.meta: dict[str, Any] = {}  # what the timeline records with the op
        self._flat: torch.Tensor | None = None

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = fuse(self.tensors)
        return self._flat

    @property
    def view(self) -> bool:
        """Whether ``flat`` is the caller's own memory (then it must not be written unless in place)."""
        return is_view_of(self.flat, self.tensors)

    @functools.cached_property
    def numel(self) -> int:
        return self._flat.numel() if self._flat is not None else sum(t.numel() for t in self.tensors)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.tensors[0].element_size()  # a fused list has one dtype

    def out_buffer(self) -> torch.Tensor:
        """A flat buffer the result may be written into: ``flat`` unless that is the caller's memory
        and the caller wants new tensors."""
        return self.flat if (self.inplace or not self.view) else torch.empty_like(self.flat)

    def writable(self) -> torch.Tensor:
        """``out_buffer()`` holding the input."""
        return self.flat if (self.inplace or not self.view) else self.flat.clone()

    def snapshot(self) -> torch.Tensor:
        """The input as a buffer the caller cannot change any more (sends read later)."""
        return self.flat.clone() if self.view else self.flat

    def deliver(self, out: torch.Tensor) -> TensorOrList:
        """The flat result, as the caller asked for it: written into its tensors, or new ones shaped like them."""
        if self.inplace:
            if not is_view_of(out, self.tensors):
                for t, part in zip(self.tensors, unfuse(out, self.tensors)):
                    t.detach().copy_(part)
            return self.tensors[0] if self.single else list(self.tensors)
        parts = unfuse(out, self.tensors)
        return parts[0] if self.single else parts

    def as_given(self, outs: list[torch.Tensor]) -> TensorOrList:
        """One tensor or a list, as the caller passed."""
        return outs[0] if self.single else outs

    def combine(self, spec: NeighborSpec, received: Mapping[int, torch.Tensor]) -> TensorOrList:
        """The neighbor combine of this call's tensors with what arrived, delivered."""
        pairs = [(received[s], w) for s, w in spec.src_weights.items()]
        if self.view and not self.inplace:  # the caller's memory: combine into a new tensor
            out = weighted_combine_(self.flat * spec.self_weight, 1.0, pairs)
        else:  # our fused copy, or the caller asked for in place
            out = weighted_combine_(self.flat, spec.self_weight, pairs)
        return self.deliver(out)


def normalize_dst(dst_weights: DstWeights | None) -> dict[int, float] | None:
    """A list of destination ranks means 'send unscaled' (weight 1)."""
    if dst_weights is None:
        return None
    if isinstance(dst_weights, Mapping):
        return {int(k): float(v) for k, v in dst_weights.items()}
    return {int(k): 1.0 for k in dst_weights}


@dataclass
class NeighborSpec:
    """One rank's part of a neighbor exchange: who to hear from, who to tell."""

    self_weight: float
    src_weights: dict[int, float]
    dst_weights: dict[int, float]


def local_size_for(size: int, ranks_per_machine: int) -> int:
    """Ranks per machine (0: all on one), which must divide the ranks."""
    if ranks_per_machine < 0 or (ranks_per_machine and size % ranks_per_machine):
        raise ConfigError(
            f"engine.ranks_per_machine={ranks_per_machine}; allowed: 0 (one machine) or a divisor of ranks={size}"
        )
    return ranks_per_machine or size


# ---------------------------------------------------------------- windows


class Window(abc.ABC):
    """One rank's part of a window: its own value and one slot per in-neighbor, each with a push-sum weight.

    ``data`` is ``(1 + len(srcs), numel)``: row 0 the own value, row ``1 + i``
    the slot of ``srcs[i]`` (ascending rank); ``weights`` (float64) holds
    their weights in the same order. Engines keep them where peers reach them.
    """

    def __init__(self, name: str, srcs: list[int], dsts: list[int], data: torch.Tensor, weights: np.ndarray) -> None:
        self.name = name
        self.srcs = srcs
        self.dsts = dsts
        self.data = data
        self.weights = weights
        self.own = data[0]

    @abc.abstractmethod
    def exclusive(self) -> AbstractContextManager:
        """Hold this rank's window memory: no put, get or update of a peer touches it meanwhile."""

    @property
    def weight(self) -> float:
        return float(self.weights[0])

    @property
    def numel(self) -> int:
        return self.own.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.own.dtype

    @property
    def row_bytes(self) -> int:
        return self.own.numel() * self.own.element_size()

    def slot_of(self, src: int) -> int:
        return 1 + self.srcs.index(src)


# ---------------------------------------------------------------- contract


class Engine(abc.ABC):
    """Collective and neighbor communication among ``size`` ranks.

    ``local_rank``/``local_size`` describe the machine this rank sits on
    (ranks per machine); hierarchical ops use them, and ``machines`` can be
    emulated on one host by setting ranks per machine.

    ``comm_time_s`` accumulates the wall time this rank spent blocked in
    communication: whole blocking calls, plus posting and waiting for
    nonblocking ones; ``bytes_sent`` the bytes it sent (``sent_bytes``).
    ``timeline`` (a bfexp.timeline.Timeline), when set, records every op
    (name, bytes, peers, start, end) and the time blocked. ``fault`` (a
    callable, None but in fault injection) runs at the start of every
    communication operation, inside it: bfexp.watchdog's ``fail_mode=hang``
    sets one that never returns, so the rank hangs where the hang watchdog
    looks (its ``activity`` names the op).
    """

    name: ClassVar[str]
    virtual: ClassVar[bool]  # ranks are threads of one process
    processes: ClassVar[bool]  # one OS process per rank, started by mpiexec
    device_type: ClassVar[str]  # where its tensors live: "cpu" or "cuda"
    # One engine object runs every rank as one batched tensor program (bfexp.comm.stacked): every
    # tensor's last dimension is the rank dimension, and the algorithms mix by the topology's round.
    stacked: ClassVar[bool] = False
    # What clock_s is: wall-clock "measured" on real ranks; "simulated" on virtual ranks (bfexp.comm.threads).
    time_source: ClassVar[str] = "measured"
    # False skips the declaration check of neighbor_allreduce and hierarchical_neighbor_allreduce
    # (one tiny Allgather per call): a mismatch then hangs, as raw MPI does.
    check_neighbors: bool = True

    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.machine_topology: Topology | None = None
        self.timeline: Timeline | None = None
        self.comm_time_s = 0.0  # wall time spent inside blocking comm calls / waits
        # The public call this rank is inside now (None between calls): the hang watchdog reads it.
        self.activity: Activity | None = None
        self.fault: Callable[[], Any] | None = None  # an injected fault (see the class doc)
        self.bytes_sent = 0  # bytes this rank has put on the wire, as ``sent_bytes`` counts them
        self.ledger: Any = None  # a bfexp.ledger.Ledger told of every op posted (rank 0 of a training job)
        self._blocking_depth = 0
        self._windows: dict[str, Window] = {}
        # Exchanges the static topology gives (weights left out) whose declarations were found consistent.
        self._patterns = TopologyPatterns()
        self._clock_origin = time.perf_counter()

    @classmethod
    def available(cls, ranks: int, ranks_per_machine: int | None = None) -> tuple[bool, str]:
        """Can ``ranks`` ranks of this engine run here? ``(True, '')`` or ``(False, what is missing)``."""
        return True, ""

    @classmethod
    def thread_multiple(cls) -> bool:
        """Whether its transport takes calls from several threads at once (BlueFog's mpi_threads_supported):
        in memory, yes; MPI answers for itself (MPIEngine)."""
        return True

    # time ---------------------------------------------------------------
    @property
    def clock_s(self) -> float:
        """This rank's time (s): wall-clock since the engine started (virtual ranks: their simulated clock)."""
        return time.perf_counter() - self._clock_origin

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` of this rank's time pass: a real sleep here (virtual ranks move their clock)."""
        if seconds > 0:
            time.sleep(seconds)

    def schedule(self) -> None:
        """Collective: run the ranks in clock order (virtual ranks); real ranks run in real time: nothing to do."""

    # identity -----------------------------------------------------------
    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def local_size(self) -> int:
        return self._local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def machine(self) -> int:
        return self.rank // self.local_size

    @property
    def machines(self) -> int:
        return self.size // self.local_size

    def attach_timeline_from_env(self, rank: int) -> None:
        """Trace into $BFEXP_TIMELINE/rank<N>.json when scripts set it, saved when the process exits."""
        from bfexp.timeline import Timeline

        self.timeline = Timeline.from_env(rank)
        if self.timeline is not None:
            atexit.register(self.timeline.save)

    def set_topology(self, topology: "Topology | None") -> None:
        """Static topology used by neighbor ops called without weights."""
        if topology is not None and topology.size != self.size:
            raise ValueError(f"topology has {topology.size} ranks, engine has {self.size}")
        self.topology = topology
        self._patterns = TopologyPatterns()  # a new graph: its exchanges are checked afresh

    def set_machine_topology(self, topology: "Topology | None") -> None:
        """Static topology among machines, for hierarchical ops called without weights."""
        if topology is not None and topology.size != self.machines:
            raise ValueError(f"machine topology has {topology.size} ranks, engine has {self.machines} machines")
        self.machine_topology = topology

    def neighbor_spec(
        self, self_weight: float | None, src_weights: Weights | None, dst_weights: DstWeights | None, t: int = 0
    ) -> NeighborSpec:
        """Fill weights left out of a call from the static topology (iteration ``t``).

        ``self_weight`` and ``src_weights`` come together or not at all;
        destinations left out are the topology's out-neighbors.
        """
        return _spec(self_weight, src_weights, dst_weights, self.topology, self.rank, self.size, t, "rank")

    def machine_spec(
        self, self_weight: float | None, src_weights: Weights | None, dst_weights: DstWeights | None
    ) -> NeighborSpec:
        """Like neighbor_spec, among machines (weights keyed by machine index)."""
        return _spec(
            self_weight, src_weights, dst_weights, self.machine_topology, self.machine, self.machines, 0, "machine"
        )

    def neighbor_ranks(
        self, src_ranks: Sequence[int] | None, dst_ranks: Sequence[int] | None
    ) -> tuple[list[int], list[int]]:
        """Sources (ascending) and destinations of a neighbor_allgather, filled from the topology."""
        if src_ranks is None or dst_ranks is None:
            spec = self.neighbor_spec(None, None, None)
            src_ranks = list(spec.src_weights) if src_ranks is None else src_ranks
            dst_ranks = list(spec.dst_weights) if dst_ranks is None else dst_ranks
        srcs = sorted({int(r) for r in src_ranks})
        dsts = sorted({int(r) for r in dst_ranks})
        for r in srcs + dsts:
            _check_peer(r, self.rank, self.size, "rank")
        return srcs, dsts

    # collectives: the public forms --------------------------------------
    @recorded
    def allreduce(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        """Sum or average (``op`` in {'sum', 'avg'}) across all ranks; new tensor(s)."""
        return self._blocking("allreduce", lambda: self._allreduce(tensors, op, inplace=False, blocking=True).wait())

    @recorded
    def allreduce_(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        """allreduce written into ``tensors`` (returned)."""
        return self._blocking("allreduce_", lambda: self._allreduce(tensors, op, inplace=True, blocking=True).wait())

    @recorded
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        return self._allreduce(tensors, op, inplace=False, blocking=False)

    @recorded
    def iallreduce_(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        return self._allreduce(tensors, op, inplace=True, blocking=False)

    @recorded
    def allgather(self, tensors: TensorOrList) -> TensorOrList:
        """Every rank's tensor(s) concatenated along dim 0 in rank order (dim 0 may differ)."""
        return self._blocking("allgather", lambda: self.iallgather(tensors).wait())

    @recorded
    def iallgather(self, tensors: TensorOrList) -> Handle:
        started = time.perf_counter()
        call = Call(tensors)
        if self.size == 1:
            rows = [t.detach().reshape(rows_shape(t, d)).clone() for t, d in zip(call.tensors, first_dims(call.tensors))]
            return self._track("allgather", call.nbytes, started, lambda: call.as_given(rows), None)
        return self._track("allgather", call.nbytes, started, *self._post_allgather(call))

    @recorded
    def broadcast(self, tensors: TensorOrList, root: int = 0) -> TensorOrList:
        """Root's value(s) on every rank; new tensor(s)."""
        return self._blocking("broadcast", lambda: self._broadcast(tensors, root, inplace=False).wait())

    @recorded
    def broadcast_(self, tensors: TensorOrList, root: int = 0) -> TensorOrList:
        """broadcast written into ``tensors`` (returned)."""
        return self._blocking("broadcast_", lambda: self._broadcast(tensors, root, inplace=True).wait())

    @recorded
    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        return self._broadcast(tensors, root, inplace=False)

    @recorded
    def ibroadcast_(self, tensors: TensorOrList, root: int = 0) -> Handle:
        return self._broadcast(tensors, root, inplace=True)

    @recorded
    def barrier(self) -> None:
        """Every rank reached it."""
        self._blocking("barrier", lambda: self._barrier(blocking=True).wait())

    @recorded
    def ibarrier(self) -> Handle:
        return self._barrier(blocking=False)

    # neighbor ops: the public forms -------------------------------------
    @recorded
    def neighbor_allreduce(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_weights: Weights | None = None, dst_weights: DstWeights | None = None, *, t: int = 0,
    ) -> TensorOrList:
        """Weighted combination of own and in-neighbors' values (see module doc); new tensor(s).

        Weights left out are the static topology's W(``t``) (``set_topology``); such an exchange's
        declarations are checked the first time each (t, size, dtype) comes, then trusted: every
        rank takes its weights from the same topology, so the pattern agrees by construction.
        """
        start = self._neighbor_allreduce
        return self._blocking(
            "neighbor_allreduce", lambda: start(tensors, self_weight, src_weights, dst_weights, False, True, t).wait()
        )

    @recorded
    def neighbor_allreduce_(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_weights: Weights | None = None, dst_weights: DstWeights | None = None, *, t: int = 0,
    ) -> TensorOrList:
        """neighbor_allreduce written into ``tensors`` (returned)."""
        return self._blocking(
            "neighbor_allreduce_",
            lambda: self._neighbor_allreduce(tensors, self_weight, src_weights, dst_weights, True, True, t).wait(),
        )

    @recorded
    def ineighbor_allreduce(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_weights: Weights | None = None, dst_weights: DstWeights | None = None, *, t: int = 0,
    ) -> Handle:
        return self._neighbor_allreduce(tensors, self_weight, src_weights, dst_weights, False, False, t)

    @recorded
    def ineighbor_allreduce_(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_weights: Weights | None = None, dst_weights: DstWeights | None = None, *, t: int = 0,
    ) -> Handle:
        """In place: leave ``tensors`` alone until wait."""
        return self._neighbor_allreduce(tensors, self_weight, src_weights, dst_weights, True, False, t)

    @recorded
    def neighbor_allgather(
        self, tensors: TensorOrList, src_ranks: Sequence[int] | None = None, dst_ranks: Sequence[int] | None = None
    ) -> TensorOrList:
        """In-neighbors' tensor(s) concatenated along dim 0 in ascending source rank (dim 0 may differ)."""
        return self._blocking("neighbor_allgather", lambda: self.ineighbor_allgather(tensors, src_ranks, dst_ranks).wait())

    @recorded
    def ineighbor_allgather(
        self, tensors: TensorOrList, src_ranks: Sequence[int] | None = None, dst_ranks: Sequence[int] | None = None
    ) -> Handle:
        started = time.perf_counter()
        srcs, dsts = self.neighbor_ranks(src_ranks, dst_ranks)
        call = Call(tensors)
        nbytes = call.nbytes * len(dsts)
        if self.size == 1:  # no peers
            return self._track("neighbor_allgather", nbytes, started, lambda: call.as_given(ungather([], [], call.tensors)))
        pending = self._post_neighbor_allgather(call, GatherDeclaration(self.size, srcs, dsts, call.tensors), srcs, dsts)
        return self._track("neighbor_allgather", nbytes, started, *pending, src=srcs, dst=dsts)

    @recorded
    def hierarchical_neighbor_allreduce(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_machine_weights: Weights | None = None, dst_machine_weights: DstWeights | None = None,
    ) -> TensorOrList:
        """Machine average, then neighbor_allreduce among machines (weights keyed by machine).

        Weights left out come from ``set_machine_topology``.
        """
        return self._blocking(
            "hierarchical_neighbor_allreduce",
            lambda: self._hierarchical(tensors, self_weight, src_machine_weights, dst_machine_weights, inplace=False).wait(),
        )

    @recorded
    def hierarchical_neighbor_allreduce_(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_machine_weights: Weights | None = None, dst_machine_weights: DstWeights | None = None,
    ) -> TensorOrList:
        """hierarchical_neighbor_allreduce written into ``tensors`` (returned)."""
        weights = (self_weight, src_machine_weights, dst_machine_weights)
        return self._blocking(
            "hierarchical_neighbor_allreduce_", lambda: self._hierarchical(tensors, *weights, inplace=True).wait()
        )

    @recorded
    def ihierarchical_neighbor_allreduce(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_machine_weights: Weights | None = None, dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        return self._hierarchical(tensors, self_weight, src_machine_weights, dst_machine_weights, inplace=False)

    @recorded
    def ihierarchical_neighbor_allreduce_(
        self, tensors: TensorOrList, self_weight: float | None = None,
        src_machine_weights: Weights | None = None, dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        return self._hierarchical(tensors, self_weight, src_machine_weights, dst_machine_weights, inplace=True)

    # front halves: checks, defaults, single rank, timing ----------------
    def _allreduce(self, tensors: TensorOrList, op: str, inplace: bool, blocking: bool) -> Handle:
        started = time.perf_counter()
        if op not in ("sum", "avg"):
            raise ValueError(f"op={op!r}; allowed: 'sum', 'avg'")
        call = Call(tensors, inplace)
        if op == "avg":
            check_float(call.tensors, "allreduce(op='avg')")
        if self.timeline is not None:
            call.meta["reduce"] = op
        if self.size == 1:
            return self._track("allreduce", call.nbytes, started, lambda: call.deliver(call.writable()), None, **call.meta)
        pending = self._post_allreduce(call, op, blocking)
        return self._track("allreduce", call.nbytes, started, *pending, **call.meta)

    def _broadcast(self, tensors: TensorOrList, root: int, inplace: bool) -> Handle:
        started = time.perf_counter()
        if not 0 <= root < self.size:
            raise ValueError(f"root={root}; allowed: 0..{self.size - 1}")
        call = Call(tensors, inplace)
        if self.size == 1:
            return self._track("broadcast", call.nbytes, started, lambda: call.deliver(call.writable()), None, root=root)
        return self._track("broadcast", call.nbytes, started, *self._post_broadcast(call, root), root=root)

    def _barrier(self, blocking: bool) -> Handle:
        started = time.perf_counter()
        if self.size == 1:
            return self._track("barrier", 0, started, lambda: None)
        return self._track("barrier", 0, started, *self._post_barrier(blocking))

    def _neighbor_allreduce(
        self, tensors: TensorOrList, self_weight: float | None, src_weights: Weights | None,
        dst_weights: DstWeights | None, inplace: bool, blocking: bool, t: int = 0,
    ) -> Handle:
        started = time.perf_counter()
        op = "neighbor_allreduce"
        given_weights = self_weight is None and src_weights is None and dst_weights is None and self.topology is not None
        if given_weights and inplace and type(tensors) is torch.Tensor and self.timeline is None and self.size > 1:
            # A repeat of a checked exchange of one tensor: the backend's set-up of it, kept, if it has one.
            key = self._patterns.key(self.topology, t, tensors.numel(), tensors.dtype)
            if not self.check_neighbors or key in self._patterns:
                repeat = self._post_repeated_neighbor_allreduce(key, tensors, t)
                if repeat is not None:
                    pending, nbytes = repeat
                    return self._track(op, nbytes, started, *pending, peers=("graph", self.topology, t, False))
        spec = self.topology_spec(t) if given_weights else self.neighbor_spec(self_weight, src_weights, dst_weights, t)
        call = self._weighted_call(op, tensors, inplace, spec, "src", "dst")
        nbytes = call.nbytes * len(spec.dst_weights)  # what this rank sends
        if self.size == 1:
            return self._track(op, nbytes, started, lambda: call.combine(spec, {}), None, **call.meta)
        decl = None
        if self.check_neighbors:
            given = given_weights and not self.virtual
            key = self._patterns.key(self.topology, t, call.numel, call.dtype) if given else None
            if key is None or key not in self._patterns:  # virtual ranks' exchange is their check: always declare
                decl = Declaration(op, self.size, spec.src_weights, spec.dst_weights, call.numel, call.dtype,
                                   learned=self._patterns.learner(key, self.topology))
        pending = self._post_neighbor_allreduce(call, spec, decl, blocking)
        peers = ("graph", self.topology, t, False) if given_weights else ("dst", spec.dst_weights)
        return self._track(op, nbytes, started, *pending, peers=peers, **call.meta)

    def _hierarchical(
        self, tensors: TensorOrList, self_weight: float | None, src_weights: Weights | None,
        dst_weights: DstWeights | None, inplace: bool,
    ) -> Handle:
        started = time.perf_counter()
        op = "hierarchical_neighbor_allreduce"
        spec = self.machine_spec(self_weight, src_weights, dst_weights)
        call = self._weighted_call(op, tensors, inplace, spec, "src_machines", "dst_machines")
        decl = None
        if self.check_neighbors:
            srcs, dsts = spec.src_weights, spec.dst_weights
            decl = MachineDeclaration(self.machines, self.local_size, srcs, dsts, call.numel, call.dtype)
        return self._track(op, call.nbytes, started, *self._post_hierarchical(call, spec, decl),
                           peers=("machines", spec.dst_weights), **call.meta)

    def _weighted_call(self, op: str, tensors: TensorOrList, inplace: bool, spec: NeighborSpec, *peers: str) -> Call:
        """The call of a weighted exchange: floating tensors only; the timeline names its ``peers``."""
        call = Call(tensors, inplace)
        check_float(call.tensors, op)
        if self.timeline is not None:
            call.meta.update(zip(peers, (sorted(spec.src_weights), sorted(spec.dst_weights))))
        return call

    # transport hooks (see the module doc) -------------------------------
    @abc.abstractmethod
    def _post_allreduce(self, call: Call, op: str, blocking: bool) -> Pending:
        """Sum (``op='avg'``: then divide by size) every rank's ``call.flat``; size > 1."""

    @abc.abstractmethod
    def _post_broadcast(self, call: Call, root: int) -> Pending:
        """Root's ``call.flat`` on every rank; size > 1."""

    @abc.abstractmethod
    def _post_allgather(self, call: Call) -> Pending:
        """Every rank's tensors along dim 0 in rank order (check with declarations.allgather_problems); size > 1."""

    @abc.abstractmethod
    def _post_barrier(self, blocking: bool) -> Pending:
        """Every rank reached it; size > 1."""

    def topology_spec(self, t: int) -> NeighborSpec:
        """This rank's part of the engine topology's round ``t`` (made once per round of its period)."""
        return self._patterns.spec(self.topology, t, lambda: self.neighbor_spec(None, None, None, t))

    def _post_repeated_neighbor_allreduce(self, key: tuple, tensor: torch.Tensor, t: int) -> tuple[Pending, int] | None:
        """In place on ``tensor``: an exchange of the engine topology's round ``t`` already found consistent
        (``key``: ``TopologyPatterns.key``), by a set-up the backend keeps per tensor memory, with the bytes
        this rank sends; None: take the general path.

        The per-step exchange of a decentralized step repeats one pattern on one buffer; at small sizes
        the general path's fusing, pooling and staging cost more than the messages. Same messages and tag
        as the general path, so ranks may take either. Default: none.
        """
        return None

    @abc.abstractmethod
    def _post_neighbor_allreduce(
        self, call: Call, spec: NeighborSpec, declaration: Declaration | None, blocking: bool
    ) -> Pending:
        """Send ``call.flat`` (scaled per destination), receive, ``call.combine``; size > 1.

        ``declaration`` (None: unchecked) is to be gathered from every rank and verified before any receive completes.
        """

    @abc.abstractmethod
    def _post_neighbor_allgather(
        self, call: Call, declaration: GatherDeclaration, srcs: list[int], dsts: list[int]
    ) -> Pending:
        """In-neighbors' tensors along dim 0 in ascending source rank (``ungather``); size > 1."""

    @abc.abstractmethod
    def _post_hierarchical(self, call: Call, spec: NeighborSpec, declaration: MachineDeclaration | None) -> Pending:
        """Machine average, then the combine among machines (``weighted_combine_``), delivered on every rank."""

    @abc.abstractmethod
    def _declare_all(self, declaration: Declaration) -> np.ndarray:
        """Every rank's ``declaration.row`` in rank order (blocking, collective)."""

    @abc.abstractmethod
    def _win_allocate(
        self, name: str, flat: torch.Tensor, srcs: list[int], dsts: list[int], declared: Table
    ) -> Window:
        """Collective: window memory shaped like ``flat`` (``declared``: the checked declarations.Table)."""

    @abc.abstractmethod
    def _win_release(self, window: Window) -> None:
        """Collective: free the window's memory."""

    @abc.abstractmethod
    def _win_send(self, window: Window, dst: int, payload: torch.Tensor, weight: float, accumulate: bool) -> None:
        """dst's slot for this rank := (payload, weight), or += with ``accumulate`` (``accumulate_``), atomically."""

    @abc.abstractmethod
    def _win_fetch(self, window: Window, src: int, into: torch.Tensor) -> float:
        """Copy src's own value into ``into`` and return its weight, atomically."""

    @abc.abstractmethod
    def _win_swap(self, window: Window, peer: int, change: Callable[[torch.Tensor], None]) -> None:
        """Holding peer's window memory exclusively: copy its own value out, ``change(copy)`` in place, write it back."""

    def _run_window_op(self, window: Window, work: Callable[[], Any]) -> Pending:
        """Run a window op's work: here, now (engines may hand it to a helper thread)."""
        result = work()
        return (lambda: result), None

    # windows: the public forms (see module doc) --------------------------
    @recorded
    def win_create(
        self,
        tensor: torch.Tensor,
        name: str,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
        zero_init: bool = True,
        weight: float = 1.0,
    ) -> torch.Tensor:
        """Collective: a window named ``name`` holding ``tensor``; returns the live own value."""
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
        decl = WindowDeclaration(self.size, srcs, dsts, flat, name)
        rows = self._declare_all(decl)
        decl.verify(rows)
        w = self._win_allocate(name, flat, srcs, dsts, decl.table(rows))
        with w.exclusive():
            w.own.copy_(flat)
            w.data[1:].zero_()
            w.weights[0] = weight
            w.weights[1:] = 0.0
        self._windows[name] = w
        self.barrier()  # every window initialized before anyone reaches into one
        if not zero_init:
            self._win_get(w, {s: 1.0 for s in srcs})
            self.barrier()
        return w.own

    @recorded
    def win_free(self, name: str | None = None) -> None:
        """Collective: free one window (all when ``name`` is None)."""
        for nm in sorted(self._windows) if name is None else [name]:
            w = self._window(nm)
            del self._windows[nm]
            self._blocking("win_free", lambda: self._win_release(w))

    def win_tensor(self, name: str) -> torch.Tensor:
        """The window's own value (live)."""
        return self._window(name).own

    def win_weight(self, name: str) -> float:
        """The push-sum weight of the own value."""
        return self._window(name).weight

    def win_slots(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of this rank's slots ``(in-neighbors, numel)`` and their weights (float64), read whole."""
        w = self._window(name)
        with w.exclusive():
            return w.data[1:].clone(), torch.from_numpy(w.weights[1:].copy())

    def win_set_slots(self, name: str, data: torch.Tensor, weights: torch.Tensor) -> None:
        """This rank's slots := ``data`` with ``weights`` (what ``win_slots`` gave: a checkpoint's)."""
        w = self._window(name)
        if tuple(data.shape) != tuple(w.data[1:].shape) or tuple(weights.shape) != (len(w.srcs),):
            raise ValueError(f"win_set_slots({name!r}): slots of shape {tuple(data.shape)} and {tuple(weights.shape)} "
                             f"weights for a window with {len(w.srcs)} in-neighbors of {w.numel} elements")
        with w.exclusive():
            w.data[1:].copy_(data)
            w.weights[1:] = weights.to(torch.float64).cpu().numpy()

    @recorded
    def win_put(
        self, tensor: torch.Tensor | None, name: str, self_weight: float | None = None, dst_weights: DstWeights | None = None
    ) -> None:
        self._blocking("win_put", lambda: self._push(tensor, name, self_weight, dst_weights, accumulate=False).wait())

    @recorded
    def iwin_put(
        self, tensor: torch.Tensor | None, name: str, self_weight: float | None = None, dst_weights: DstWeights | None = None
    ) -> Handle:
        return self._push(tensor, name, self_weight, dst_weights, accumulate=False)

    @recorded
    def win_accumulate(
        self, tensor: torch.Tensor | None, name: str, self_weight: float | None = None, dst_weights: DstWeights | None = None
    ) -> None:
        self._blocking("win_accumulate", lambda: self._push(tensor, name, self_weight, dst_weights, True).wait())

    @recorded
    def iwin_accumulate(
        self, tensor: torch.Tensor | None, name: str, self_weight: float | None = None, dst_weights: DstWeights | None = None
    ) -> Handle:
        return self._push(tensor, name, self_weight, dst_weights, accumulate=True)

    @recorded
    def win_get(self, name: str, src_weights: Weights | None = None) -> None:
        self._blocking("win_get", lambda: self.iwin_get(name, src_weights).wait())

    @recorded
    def iwin_get(self, name: str, src_weights: Weights | None = None) -> Handle:
        started = time.perf_counter()
        w = self._window(name)
        src = {s: 1.0 for s in w.srcs} if src_weights is None else {int(k): float(v) for k, v in src_weights.items()}
        self._check_window_targets(w, list(src), w.srcs, "sources", "win_get")
        pending = self._run_window_op(w, lambda: self._win_get(w, src))
        return self._track("win_get", w.row_bytes * len(src), started, *pending, src=sorted(src), window=name)

    @recorded
    def win_update(
        self, name: str, self_weight: float | None = None, src_weights: Weights | None = None, reset: bool = False
    ) -> torch.Tensor:
        return self._blocking("win_update", lambda: self.iwin_update(name, self_weight, src_weights, reset).wait())

    @recorded
    def iwin_update(
        self, name: str, self_weight: float | None = None, src_weights: Weights | None = None, reset: bool = False
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
        pending = self._run_window_op(w, lambda: self._win_update(w, float(self_weight), src, reset))
        return self._track("win_update", 0, started, *pending, window=name)

    def one_turn(self) -> AbstractContextManager:
        """Several window ops as one: where a user's virtual ranks take turns at each window op
        (bfexp.comm.threads), the rank hands its turn on once, at the end; elsewhere nothing."""
        return nullcontext()

    def win_lock(self, name: str) -> AbstractContextManager:
        """Hold this rank's window memory exclusively (peers' ops wait): a local change of the own value."""
        return self._window(name).exclusive()

    @recorded
    def win_exchange(
        self, name: str, peer: int, combine: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> None:
        self._blocking("win_exchange", lambda: self.iwin_exchange(name, peer, combine).wait())

    @recorded
    def iwin_exchange(
        self, name: str, peer: int, combine: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> Handle:
        """Start the atomic pair-wise transaction ``combine(mine, theirs)`` with ``peer`` (see module doc)."""
        started = time.perf_counter()
        w = self._window(name)
        self._check_window_targets(w, [int(peer)], sorted(set(w.srcs) | set(w.dsts)), "neighbors", "win_exchange")
        pending = self._run_window_op(w, lambda: self._win_exchange(w, int(peer), combine))
        return self._track("win_exchange", 2 * w.row_bytes, started, *pending, src=[int(peer)], window=name)

    # windows: checks and push-sum arithmetic ----------------------------
    def _window(self, name: str) -> Window:
        try:
            return self._windows[name]
        except KeyError:
            raise ValueError(f"no window {name!r}; created: {sorted(self._windows) or 'none'}") from None

    def _check_window_targets(self, w: Window, ranks: Sequence[int], allowed: list[int], role: str, op: str) -> None:
        """A window op may only reach the neighbors the window was created with."""
        for r in ranks:
            if r not in allowed:
                raise ValueError(
                    f"rank {self.rank}: {op} on window {w.name!r} with rank {r}, which is not one of its {role} {allowed}"
                )

    def _push(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None,
        dst_weights: DstWeights | None,
        accumulate: bool,
    ) -> Handle:
        """put (accumulate=False) or accumulate into the out-neighbors' slots of window ``name``."""
        started = time.perf_counter()
        op = "win_accumulate" if accumulate else "win_put"
        w = self._window(name)
        dst = normalize_dst(dst_weights)
        dst = {d: 1.0 for d in w.dsts} if dst is None else dst
        self._check_window_targets(w, list(dst), w.dsts, "destinations", op)
        if tensor is None:
            x = w.own
        elif tensor.dtype != w.dtype or tensor.numel() != w.numel:
            raise ValueError(
                f"{op} on window {w.name!r}: got {tensor.numel()} x {tensor.dtype}, the window holds {w.numel} x {w.dtype}"
            )
        else:  # window memory is where the engine keeps it (the host, for NCCL)
            x = tensor.detach().to(w.own.device).contiguous().view(-1)
        pending = self._run_window_op(w, lambda: self._win_push(w, x, dst, self_weight, accumulate))
        return self._track(op, w.row_bytes * len(dst), started, *pending, dst=sorted(dst), window=name)

    def _win_push(
        self, w: Window, x: torch.Tensor, dst: dict[int, float], self_weight: float | None, accumulate: bool
    ) -> None:
        """Each destination's slot gets (or adds) ``w_k * (x, p)``; with ``self_weight`` own := ``self_weight * (x, p)``."""
        p = w.weight
        for d, weight in dst.items():
            self._win_send(w, d, x if weight == 1.0 else x * weight, p * weight, accumulate)
        if self_weight is not None:
            with w.exclusive():
                if x.data_ptr() == w.own.data_ptr():
                    w.own.mul_(self_weight)
                else:
                    torch.mul(x, self_weight, out=w.own)
                w.weights[0] = p * self_weight

    def _win_get(self, w: Window, src: dict[int, float]) -> None:
        """Each source's slot := ``w_j * (own value of j, p_j)``."""
        fetched = getattr(w, "_fetched", None)  # kept with the window: a get allocates nothing after its first
        if fetched is None:
            fetched = w._fetched = torch.empty_like(w.own)  # type: ignore[attr-defined]
        for s, weight in src.items():
            p = self._win_fetch(w, s, fetched)
            row = w.slot_of(s)
            with w.exclusive():
                torch.mul(fetched, weight, out=w.data[row])
                w.weights[row] = p * weight

    def _win_exchange(self, w: Window, peer: int, combine: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Both windows held, the lower rank's first (a global lock order: no deadlock)."""
        if self.rank < peer:
            with w.exclusive():
                self._win_swap(w, peer, lambda theirs: combine(w.own, theirs))
        else:

            def change(theirs: torch.Tensor) -> None:
                with w.exclusive():
                    combine(w.own, theirs)

            self._win_swap(w, peer, change)

    def _win_update(self, w: Window, self_weight: float, src: dict[int, float], reset: bool) -> torch.Tensor:
        """own := ``self_weight * own + sum_j w_j * slot_j``, the same for p; ``reset`` empties the slots used."""
        rows = [(w.slot_of(s), weight) for s, weight in src.items()]
        with w.exclusive():
            weighted_combine_(w.own, self_weight, [(w.data[r], weight) for r, weight in rows])
            w.weights[0] = self_weight * w.weights[0] + sum(weight * w.weights[r] for r, weight in rows)
            if reset:
                for r, _ in rows:
                    w.data[r].zero_()
                    w.weights[r] = 0.0
        return w.own

    # timing -------------------------------------------------------------
    def _blocking(self, op: str, call: Callable[[], Any]) -> Any:
        """Run a blocking call, counting all of it (and nothing twice) as communication time."""
        c0 = self.comm_time_s
        t0 = time.perf_counter()
        self._blocking_depth += 1
        try:
            return call()
        finally:
            self._blocking_depth -= 1
            t1 = time.perf_counter()
            if self._blocking_depth == 0:
                self.comm_time_s = c0 + (t1 - t0)
                if self.timeline is not None:
                    self.timeline.blocked(op, t0, t1)

    def _track(
        self,
        op: str,
        nbytes: int,
        started: float,
        wait_fn: Callable[[], Any],
        test_fn: Callable[[], bool] | None = None,
        peers: Any = None,
        **args: Any,
    ) -> Handle:
        """A Handle that counts posting and waiting as communication time and records the op.

        ``started`` is ``time.perf_counter()`` when the op was called; without
        ``test_fn`` nothing is in flight (``wait`` only finishes local work), so
        ``done()`` is True. ``peers``: who an exchange reaches, for the ledger
        (bfexp.ledger.Ledger.add), where ``args`` (the timeline's) do not say it.
        """
        posted = time.perf_counter()
        self.bytes_sent += sent_bytes(op, nbytes, self.size)
        if self.ledger is not None:
            self.ledger.add(op, nbytes, peers if peers is not None else ledger_peers(op, args))
        if self._blocking_depth == 0:
            self.comm_time_s += posted - started
        token = self.timeline.begin(op, started, nbytes, **args) if self.timeline is not None else None

        def on_finish(t0: float, t1: float) -> None:
            if self._blocking_depth == 0:
                self.comm_time_s += t1 - t0
                if self.timeline is not None:
                    self.timeline.blocked(f"wait {op}", t0, t1)
            if token is not None and self.timeline is not None:
                self.timeline.end(token, t1)

        return Handle(wait_fn, test_fn if test_fn is not None else _nothing_in_flight, on_finish, self, op)

    def close(self) -> None:
        """Release resources (windows, communicators). Safe to call twice."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing_in_flight() -> bool:
    return True


def ledger_peers(op: str, args: dict) -> Any:
    """Who an op's record (``_track``'s ``args``) says it reached, as bfexp.ledger takes it: a neighbor op's
    or a put's destinations, a get's sources, a hierarchical op's machines; None for a collective."""
    if "dst" in args:
        return ("dst", args["dst"])
    if "src" in args and op in ("win_get", "win_exchange"):
        return ("src", args["src"])
    if "dst_machines" in args:
        return ("machines", args["dst_machines"])
    return None


def sent_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes one rank puts on the wire for an op whose ``_track`` record carries ``nbytes``.

    Neighbor ops and window puts/accumulates record what this rank sends (its
    message times its destinations) and a get what it fetches: counted as they
    are. Collectives record one rank's message and are counted at the
    bandwidth-optimal (ring) volume every engine's fast path approaches:
    allreduce 2(n-1)/n of it, allgather n-1 times it (each rank's piece goes
    round), broadcast (n-1)/n of it per rank on average; the hierarchical op
    counts its one message. The bytes are those of
    the tensors handed to the engine, so a packed, compressed payload counts as
    packed.
    """
    if size <= 1:
        return 0
    if op == "allreduce":
        return 2 * (size - 1) * nbytes // size
    if op == "allgather":
        return (size - 1) * nbytes
    if op == "broadcast":
        return (size - 1) * nbytes // size
    return nbytes


def _check_peer(r: int, me: int, size: int, unit: str) -> None:
    if not 0 <= r < size or r == me:
        raise ValueError(f"{unit} {me}: bad neighbor {unit} {r}; allowed 0..{size - 1} except self")


def _spec(
    self_weight: float | None,
    src_weights: Weights | None,
    dst_weights: DstWeights | None,
    topology: "Topology | None",
    me: int,
    size: int,
    t: int,
    unit: str,
) -> NeighborSpec:
    if (self_weight is None) != (src_weights is None):
        raise ValueError("give self_weight and src_weights together, or neither")
    if src_weights is None or dst_weights is None:
        if topology is None:
            setter = "set_topology" if unit == "rank" else "set_machine_topology"
            raise ValueError(f"neighbor op without weights needs engine.{setter}(...)")
        w = topology.weights(me, t)
        if src_weights is None:
            self_weight, src_weights = w.self_weight, w.src_weights
        if dst_weights is None:
            dst_weights = list(w.dst_weights)
    src = {int(k): float(v) for k, v in src_weights.items()}
    dst = normalize_dst(dst_weights) or {}
    for r in list(src) + list(dst):
        _check_peer(r, me, size, unit)
    return NeighborSpec(float(self_weight), src, dst)


def check_float(tensors: Iterable[torch.Tensor], op: str) -> None:
    for t in tensors:
        if t.dtype not in AVERAGING_DTYPES:
            raise TypeError(
                f"{op} averages, so it needs a floating dtype; got {t.dtype} "
                f"(allowed: float32, float64, float16, bfloat16)"
            )
