"""The Engine contract: every communication backend implements this.

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
  they come from the static topology (``set_topology``). The engine combines
  in one order: ``x * self_weight``, then ``add_`` of each source in
  ``src_weights`` order, so engines agree to the bit where their inputs do.

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
naming the ranks, instead of hanging. A single rank works: every op is then
local (a neighbor op returns ``self_weight * x``).

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
* ``win_accumulate(...)``: the same, but adds ``w_k * (t, p)`` to the slot.
* ``win_get(name, src_weights)``: for each in-neighbor j, this rank's slot
  for j := ``w_j * (own value of j, p_j)``.
* ``win_update(name, self_weight, src_weights, reset)``: own value :=
  ``self_weight * own + sum_j w_j * slot_j``, and the same for p; ``reset``
  zeroes the slots it used. Weights left out average self and all slots.
* ``win_weight(name)`` is p; ``own / p`` is the de-biased (push-sum) value.
* ``win_free(name)`` (collective).

A window's in- and out-neighbors are fixed when it is created (left out:
the static topology's); put/accumulate default to every out-neighbor with
weight 1, get to every in-neighbor with weight 1. Each put/accumulate/get/
update is atomic with respect to the others on the same window: a reader
never sees half of a put, and the weight always moves with its data.
Put/accumulate/get/update have nonblocking ``i`` twins; create and free are
collective set-up calls and block. After a put and a barrier the target's
slot holds the value; a get sees whatever the source's own value is then.
"""

from __future__ import annotations

import abc
import atexit
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, Union

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.timeline import Timeline
    from bfexp.topology import Topology

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
Weights = Mapping[int, float]
DstWeights = Union[Mapping[int, float], Sequence[int]]

AVERAGING_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Small codes so dtypes can be compared across ranks inside integer declarations.
DTYPE_CODES = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class CommError(RuntimeError):
    """A communication pattern that cannot complete (e.g. mismatched neighbors)."""


class Handle:
    """A pending nonblocking operation.

    ``wait()`` blocks until the result is ready and returns it (a tensor, a
    list of tensors, or None); ``done()`` polls without blocking. ``wait`` may
    be called more than once and returns the same result. ``on_finish`` (set
    by engines) is told when the wait began and ended, for timing.
    """

    def __init__(
        self,
        wait_fn: Callable[[], Any],
        test_fn: Callable[[], bool] | None = None,
        on_finish: Callable[[float, float], None] | None = None,
    ) -> None:
        self._wait_fn = wait_fn
        self._test_fn = test_fn
        self._on_finish = on_finish
        self._finished = False
        self._result: Any = None

    @classmethod
    def completed(cls, result: Any) -> "Handle":
        """A handle for work that already finished (e.g. a single-rank op)."""
        handle = cls(lambda: result)
        handle._finished = True
        handle._result = result
        return handle

    def wait(self) -> Any:
        if not self._finished:
            t0 = time.perf_counter()
            self._result = self._wait_fn()
            self._finished = True
            if self._on_finish is not None:
                self._on_finish(t0, time.perf_counter())
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


def fuse_into(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy the tensors back to back into the flat ``out`` (which may have another dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].view(t.shape).copy_(t.detach())
        offset += n
    return out


def unfuse(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a flat buffer back into tensors shaped like ``like`` (views, no copy)."""
    if len(like) == 1:
        return [flat.view(like[0].shape)]
    parts = torch.split(flat, [t.numel() for t in like])
    return [p if t.dim() == 1 else p.view(t.shape) for p, t in zip(parts, like)]


def restore(flat: torch.Tensor, like: Sequence[torch.Tensor], single: bool) -> TensorOrList:
    """Give the caller back the shape it passed: one tensor or a list."""
    parts = unfuse(flat, like)
    return parts[0] if single else parts


def copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor], single: bool) -> TensorOrList:
    """Write a flat result into the caller's tensors (skipped where it already is them)."""
    if not is_view_of(flat, tensors):
        for t, part in zip(tensors, unfuse(flat, tensors)):
            t.detach().copy_(part)
    return tensors[0] if single else list(tensors)


def weighted_combine_(out: torch.Tensor, self_weight: float, received: Sequence[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """``out = self_weight * out + sum w * r`` in place, in the contract's order."""
    if self_weight != 1.0:
        out.mul_(self_weight)
    for r, w in received:
        out.add_(r, alpha=w)
    return out


def normalize_dst(dst_weights: DstWeights | None) -> dict[int, float] | None:
    """A list of destination ranks means 'send unscaled' (weight 1)."""
    if dst_weights is None:
        return None
    if isinstance(dst_weights, Mapping):
        return {int(k): float(v) for k, v in dst_weights.items()}
    return {int(k): 1.0 for k in dst_weights}


def shape_signature(tensors: Sequence[torch.Tensor]) -> int:
    """A number that is equal on two ranks when their lists agree on count and trailing shapes."""
    text = ";".join(",".join(map(str, t.shape[1:])) for t in tensors)
    return zlib.crc32(f"{len(tensors)}|{text}".encode())


def first_dims(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's first dimension (a 0-d tensor counts as one row)."""
    return [t.shape[0] if t.dim() else 1 for t in tensors]


def rows_shape(t: torch.Tensor, rows: int) -> tuple[int, ...]:
    """The shape of ``rows`` rows shaped like ``t``'s (0-d gathers into 1-d)."""
    return (rows, *t.shape[1:]) if t.dim() else (rows,)


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class NeighborSpec:
    """One rank's part of a neighbor exchange: who to hear from, who to tell."""

    self_weight: float
    src_weights: dict[int, float]
    dst_weights: dict[int, float]


# ---------------------------------------------------------------- declarations


def pattern_problems(
    op: str,
    sends: np.ndarray,
    expects: np.ndarray,
    numels: Sequence[int] | None = None,
    dtypes: Sequence[int] | None = None,
    unit: str = "rank",
) -> list[str]:
    """What is wrong with one exchange, seen from every participant's declaration.

    ``sends[j, i]``: j declared it sends to i; ``expects[i, j]``: i declared
    it receives from j. With ``numels``/``dtypes``, every edge must also move
    as many elements of one dtype as its receiver expects. Every rank that
    computes this from the same gathered declarations gets the same list,
    so every rank can raise the same error.
    """
    problems = []
    mismatch = np.argwhere(sends.T != expects)  # (i, j) pairs
    for i, j in mismatch.tolist():
        if expects[i, j]:
            problems.append(f"{unit} {i} expects to receive from {unit} {j}, but {unit} {j} does not send to {unit} {i}")
        else:
            problems.append(f"{unit} {j} sends to {unit} {i}, but {unit} {i} does not expect to receive from {unit} {j}")
    edges = sends.T & expects  # (i, j): j sends to i and i expects it
    if numels is not None:
        numels = np.asarray(numels)
        for i, j in np.argwhere(edges & (numels[:, None] != numels[None, :])).tolist():
            problems.append(f"{unit} {j} sends {numels[j]} elements to {unit} {i}, which has {numels[i]}")
    if dtypes is not None:
        dtypes = np.asarray(dtypes)
        for i, j in np.argwhere(edges & (dtypes[:, None] != dtypes[None, :])).tolist():
            problems.append(
                f"{unit} {j} sends {CODE_DTYPES.get(int(dtypes[j]))} to {unit} {i}, "
                f"which has {CODE_DTYPES.get(int(dtypes[i]))}"
            )
    return problems


def mismatch_error(op: str, problems: list[str], limit: int = 4) -> CommError:
    """One clear message for a broken exchange (the first few problems, then a count)."""
    shown = "; ".join(problems[:limit])
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return CommError(f"{op}: send/receive declarations do not match: {shown}{more}")


# ---------------------------------------------------------------- contract


class Engine(abc.ABC):
    """Collective and neighbor communication among ``size`` ranks.

    ``local_rank``/``local_size`` describe the machine this rank sits on
    (ranks per machine); hierarchical ops use them, and ``machines`` can be
    emulated on one host by setting ranks per machine.

    ``comm_time_s`` accumulates the wall time this rank spent blocked in
    communication: whole blocking calls, plus posting and waiting for
    nonblocking ones. ``timeline`` (a bfexp.timeline.Timeline), when set,
    records every op (name, bytes, peers, start, end) and the time blocked.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.machine_topology: Topology | None = None
        self.timeline: Timeline | None = None
        self.comm_time_s = 0.0  # wall time spent inside blocking comm calls / waits
        self._blocking_depth = 0

    # identity -----------------------------------------------------------
    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def local_size(self) -> int:
        return getattr(self, "_local_size", self.size)

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

    def set_machine_topology(self, topology: "Topology | None") -> None:
        """Static topology among machines, for hierarchical ops called without weights."""
        if topology is not None and topology.size != self.machines:
            raise ValueError(f"machine topology has {topology.size} ranks, engine has {self.machines} machines")
        self.machine_topology = topology

    def neighbor_spec(
        self,
        self_weight: float | None,
        src_weights: Weights | None,
        dst_weights: DstWeights | None,
        t: int = 0,
    ) -> NeighborSpec:
        """Fill weights left out of a call from the static topology (iteration ``t``).

        ``self_weight`` and ``src_weights`` come together or not at all;
        destinations left out are the topology's out-neighbors.
        """
        return _spec(self_weight, src_weights, dst_weights, self.topology, self.rank, self.size, t, "rank")

    def machine_spec(
        self,
        self_weight: float | None,
        src_weights: Weights | None,
        dst_weights: DstWeights | None,
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

    # collectives --------------------------------------------------------
    @abc.abstractmethod
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        """Sum or average (``op`` in {'sum', 'avg'}) across all ranks; returns new tensor(s)."""

    def allreduce(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        return self._blocking("allreduce", lambda: self.iallreduce(tensors, op).wait())

    def iallreduce_(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        """allreduce written into ``tensors``."""
        return self._into(tensors, self.iallreduce(tensors, op))

    def allreduce_(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        return self._blocking("allreduce_", lambda: self.iallreduce_(tensors, op).wait())

    def iallgather(self, tensors: TensorOrList) -> Handle:
        """Every rank's tensor(s) concatenated along dim 0 in rank order (dim 0 may differ)."""
        raise NotImplementedError(f"engine {self.name} has no allgather")

    def allgather(self, tensors: TensorOrList) -> TensorOrList:
        return self._blocking("allgather", lambda: self.iallgather(tensors).wait())

    @abc.abstractmethod
    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        """Root's value(s) on every rank; returns new tensor(s)."""

    def broadcast(self, tensors: TensorOrList, root: int = 0) -> TensorOrList:
        return self._blocking("broadcast", lambda: self.ibroadcast(tensors, root).wait())

    def ibroadcast_(self, tensors: TensorOrList, root: int = 0) -> Handle:
        """broadcast written into ``tensors``."""
        return self._into(tensors, self.ibroadcast(tensors, root))

    def broadcast_(self, tensors: TensorOrList, root: int = 0) -> TensorOrList:
        return self._blocking("broadcast_", lambda: self.ibroadcast_(tensors, root).wait())

    @abc.abstractmethod
    def ibarrier(self) -> Handle: ...

    def barrier(self) -> None:
        self._blocking("barrier", lambda: self.ibarrier().wait())

    # neighbor ops -------------------------------------------------------
    @abc.abstractmethod
    def ineighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        """Weighted combination of own and in-neighbors' values (see module doc)."""

    def neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> TensorOrList:
        return self._blocking(
            "neighbor_allreduce",
            lambda: self.ineighbor_allreduce(tensors, self_weight, src_weights, dst_weights).wait(),
        )

    def ineighbor_allreduce_(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        """neighbor_allreduce written into ``tensors`` (leave them alone until wait)."""
        return self._into(tensors, self.ineighbor_allreduce(tensors, self_weight, src_weights, dst_weights))

    def neighbor_allreduce_(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> TensorOrList:
        return self._blocking(
            "neighbor_allreduce_",
            lambda: self.ineighbor_allreduce_(tensors, self_weight, src_weights, dst_weights).wait(),
        )

    def ineighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> Handle:
        """In-neighbors' tensor(s) concatenated along dim 0 in ascending source rank."""
        raise NotImplementedError(f"engine {self.name} has no neighbor_allgather")

    def neighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> TensorOrList:
        return self._blocking("neighbor_allgather", lambda: self.ineighbor_allgather(tensors, src_ranks, dst_ranks).wait())

    def ihierarchical_neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        """Machine average, then neighbor_allreduce among machines (weights keyed by machine).

        Weights left out come from ``set_machine_topology``.
        """
        raise NotImplementedError(f"engine {self.name} has no hierarchical_neighbor_allreduce")

    def hierarchical_neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> TensorOrList:
        return self._blocking(
            "hierarchical_neighbor_allreduce",
            lambda: self.ihierarchical_neighbor_allreduce(
                tensors, self_weight, src_machine_weights, dst_machine_weights
            ).wait(),
        )

    def ihierarchical_neighbor_allreduce_(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        return self._into(
            tensors,
            self.ihierarchical_neighbor_allreduce(tensors, self_weight, src_machine_weights, dst_machine_weights),
        )

    def hierarchical_neighbor_allreduce_(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> TensorOrList:
        return self._blocking(
            "hierarchical_neighbor_allreduce_",
            lambda: self.ihierarchical_neighbor_allreduce_(
                tensors, self_weight, src_machine_weights, dst_machine_weights
            ).wait(),
        )

    # one-sided windows (see module doc) ---------------------------------
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
        raise NotImplementedError(f"engine {self.name} has no windows")

    def win_free(self, name: str | None = None) -> None:
        """Collective: free one window (all when ``name`` is None)."""
        raise NotImplementedError(f"engine {self.name} has no windows")

    def win_tensor(self, name: str) -> torch.Tensor:
        """The window's own value (live)."""
        raise NotImplementedError(f"engine {self.name} has no windows")

    def win_weight(self, name: str) -> float:
        """The push-sum weight of the own value."""
        raise NotImplementedError(f"engine {self.name} has no windows")

    def iwin_put(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        return self._push(tensor, name, self_weight, dst_weights, accumulate=False)

    def win_put(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None = None,
        dst_weights: DstWeights | None = None,
    ) -> None:
        self._blocking("win_put", lambda: self.iwin_put(tensor, name, self_weight, dst_weights).wait())

    def iwin_accumulate(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        return self._push(tensor, name, self_weight, dst_weights, accumulate=True)

    def _push(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None,
        dst_weights: DstWeights | None,
        accumulate: bool,
    ) -> Handle:
        """put (accumulate=False) or accumulate into the out-neighbors' slots of window ``name``."""
        raise NotImplementedError(f"engine {self.name} has no windows")

    def _check_window_targets(self, w: Any, ranks: Sequence[int], allowed: list[int], role: str, op: str) -> None:
        """A window op may only reach the neighbors the window was created with."""
        for r in ranks:
            if r not in allowed:
                raise ValueError(
                    f"rank {self.rank}: {op} on window {w.name!r} with rank {r}, which is not one of its {role} {allowed}"
                )

    def _window_payload(self, w: Any, tensor: torch.Tensor | None, op: str) -> torch.Tensor:
        """What a put/accumulate sends: the given tensor (shape and dtype of the window) or the own value."""
        if tensor is None:
            return w.own
        if tensor.dtype != w.dtype or tensor.numel() != w.numel:
            raise ValueError(
                f"{op} on window {w.name!r}: got {tensor.numel()} x {tensor.dtype}, the window holds {w.numel} x {w.dtype}"
            )
        return tensor.detach().contiguous().view(-1)

    def win_accumulate(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None = None,
        dst_weights: DstWeights | None = None,
    ) -> None:
        self._blocking("win_accumulate", lambda: self.iwin_accumulate(tensor, name, self_weight, dst_weights).wait())

    def iwin_get(self, name: str, src_weights: Weights | None = None) -> Handle:
        raise NotImplementedError(f"engine {self.name} has no windows")

    def win_get(self, name: str, src_weights: Weights | None = None) -> None:
        self._blocking("win_get", lambda: self.iwin_get(name, src_weights).wait())

    def iwin_update(
        self,
        name: str,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        reset: bool = False,
    ) -> Handle:
        raise NotImplementedError(f"engine {self.name} has no windows")

    def win_update(
        self,
        name: str,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        reset: bool = False,
    ) -> torch.Tensor:
        return self._blocking("win_update", lambda: self.iwin_update(name, self_weight, src_weights, reset).wait())

    # helpers ------------------------------------------------------------
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

    def _timed_wait(self, handle: Handle) -> Any:
        """Wait on a handle, counting the time as communication (for engines' own blocking forms)."""
        return self._blocking("wait", handle.wait)

    def _track(
        self,
        op: str,
        nbytes: int,
        started: float,
        wait_fn: Callable[[], Any],
        test_fn: Callable[[], bool] | None = None,
        **args: Any,
    ) -> Handle:
        """A Handle that counts posting and waiting as communication time and records the op.

        ``started`` is ``time.perf_counter()`` when the op was called; without
        ``test_fn`` nothing is in flight (``wait`` only finishes local work), so
        ``done()`` is True.
        """
        posted = time.perf_counter()
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

        return Handle(wait_fn, test_fn if test_fn is not None else _nothing_in_flight, on_finish)

    def _into(self, tensors: TensorOrList, handle: Handle) -> Handle:
        """Turn an out-of-place handle into one that writes into ``tensors``."""
        listed, single = as_list(tensors)

        def finish() -> TensorOrList:
            result, _ = as_list(handle.wait())
            for t, r in zip(listed, result):
                if t.data_ptr() != r.data_ptr():
                    t.detach().copy_(r)
            return listed[0] if single else listed

        return Handle(finish, handle.done)

    def check_op(self, op: str) -> None:
        if op not in ("sum", "avg"):
            raise ValueError(f"op={op!r}; allowed: 'sum', 'avg'")

    def close(self) -> None:
        """Release resources (windows, communicators). Safe to call twice."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing_in_flight() -> bool:
    return True


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


def machine_problems(op: str, headers: np.ndarray, expects: np.ndarray, sends: np.ndarray, local_size: int) -> list[str]:
    """Declarations of a hierarchical op: the same on every rank of a machine, consistent among machines."""
    n = headers.shape[0]
    problems = []
    if (headers[:, 0] != headers[0, 0]).any() or (headers[:, 1] != headers[0, 1]).any():
        bad = int(np.flatnonzero((headers[:, 0] != headers[0, 0]) | (headers[:, 1] != headers[0, 1]))[0])
        problems.append(
            f"rank {bad} has {headers[bad, 0]} x {dtype_name(headers[bad, 1])}, "
            f"rank 0 has {headers[0, 0]} x {dtype_name(headers[0, 1])}"
        )
    leaders = list(range(0, n, local_size))
    for r in range(n):
        lead = r - r % local_size
        if (expects[r] != expects[lead]).any() or (sends[r] != sends[lead]).any():
            problems.append(f"rank {r} declares other machine weights than rank {lead} of its machine")
    problems += pattern_problems(op, sends[leaders], expects[leaders], unit="machine")
    return problems


def dtype_name(code: int) -> str:
    return str(CODE_DTYPES.get(int(code), f"dtype#{code}")).replace("torch.", "")
