"""The Engine contract: every communication backend implements this.

Engines move torch tensors between ranks. A *list* of tensors always travels
as ONE fused message per peer (one flat buffer), because per-tensor messages
are latency-bound for models with hundreds of small parameters.

Conventions shared by every engine and by the topology package:

* ``X+ = W X``: row i of X is rank i's tensor, ``W[i, j]`` the weight that
  receiver i gives to the value it gets from sender j.
* ``neighbor_allreduce`` on rank i returns
  ``self_weight * x_i + sum_j src_weights[j] * (dst_weight_{j->i} * x_j)``
  where ``dst_weight_{j->i}`` is the scale the *sender* j applied to what it
  sent to i (1 when the sender gave a plain list of destinations). Receivers
  weigh for row-stochastic mixing; senders scale for column-stochastic
  (push-sum) mixing. Both are per call, so dynamic topologies work.
* Every operation ``op`` has a nonblocking twin ``iop`` returning a Handle;
  the blocking form is ``iop(...).wait()`` unless an engine overrides it.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, Union

import torch

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.timeline import Timeline
    from bfexp.topology import Topology

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
Weights = Mapping[int, float]
DstWeights = Union[Mapping[int, float], Sequence[int]]

AVERAGING_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class CommError(RuntimeError):
    """A communication pattern that cannot complete (e.g. mismatched neighbors)."""


class Handle:
    """A pending nonblocking operation.

    ``wait()`` blocks until the result is ready and returns it (a tensor, a
    list of tensors, or None); ``done()`` polls without blocking. ``wait`` may
    be called more than once and returns the same result.
    """

    def __init__(
        self,
        wait_fn: Callable[[], Any],
        test_fn: Callable[[], bool] | None = None,
    ) -> None:
        self._wait_fn = wait_fn
        self._test_fn = test_fn
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
            self._result = self._wait_fn()
            self._finished = True
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


def fuse(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous flat buffer holding every tensor (no copy for one contiguous tensor)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"a fused list needs one dtype, got {sorted(map(str, dtypes))}")
    if len(tensors) == 1:
        return tensors[0].detach().contiguous().view(-1)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unfuse(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a flat buffer back into tensors shaped like ``like`` (views, no copy)."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape))
        offset += n
    return out


def restore(flat: torch.Tensor, like: Sequence[torch.Tensor], single: bool) -> TensorOrList:
    """Give the caller back the shape it passed: one tensor or a list."""
    parts = unfuse(flat, like)
    return parts[0] if single else parts


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


# ---------------------------------------------------------------- contract


class Engine(abc.ABC):
    """Collective and neighbor communication among ``size`` ranks.

    ``local_rank``/``local_size`` describe the machine this rank sits on
    (ranks per machine); hierarchical ops use them, and ``machines`` can be
    emulated on one host by setting ranks per machine.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.timeline: Timeline | None = None
        self.comm_time_s = 0.0  # wall time spent inside blocking comm calls / waits

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

    def set_topology(self, topology: "Topology | None") -> None:
        """Static topology used by neighbor ops called without weights."""
        if topology is not None and topology.size != self.size:
            raise ValueError(f"topology has {topology.size} ranks, engine has {self.size}")
        self.topology = topology

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
        if (self_weight is None) != (src_weights is None):
            raise ValueError("give self_weight and src_weights together, or neither")
        if src_weights is None or dst_weights is None:
            if self.topology is None:
                raise ValueError(
                    "neighbor op without weights needs engine.set_topology(...)"
                )
            w = self.topology.weights(self.rank, t)
            if src_weights is None:
                self_weight, src_weights = w.self_weight, w.src_weights
            if dst_weights is None:
                dst_weights = list(w.dst_weights)
        src = {int(k): float(v) for k, v in src_weights.items()}
        dst = normalize_dst(dst_weights) or {}
        for r in list(src) + list(dst):
            if not 0 <= r < self.size or r == self.rank:
                raise ValueError(
                    f"rank {self.rank}: bad neighbor rank {r}; allowed 0..{self.size - 1} except self"
                )
        return NeighborSpec(float(self_weight), src, dst)

    # collectives --------------------------------------------------------
    @abc.abstractmethod
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        """Sum or average (``op`` in {'sum', 'avg'}) across all ranks; returns new tensor(s)."""

    def allreduce(self, tensors: TensorOrList, op: str = "avg") -> TensorOrList:
        return self._timed_wait(self.iallreduce(tensors, op))

    @abc.abstractmethod
    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        """Root's value(s) on every rank; returns new tensor(s)."""

    def broadcast(self, tensors: TensorOrList, root: int = 0) -> TensorOrList:
        return self._timed_wait(self.ibroadcast(tensors, root))

    @abc.abstractmethod
    def ibarrier(self) -> Handle: ...

    def barrier(self) -> None:
        self._timed_wait(self.ibarrier())

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
        return self._timed_wait(
            self.ineighbor_allreduce(tensors, self_weight, src_weights, dst_weights)
        )

    # helpers ------------------------------------------------------------
    def _timed_wait(self, handle: Handle) -> Any:
        t0 = time.perf_counter()
        try:
            return handle.wait()
        finally:
            self.comm_time_s += time.perf_counter() - t0

    def check_op(self, op: str) -> None:
        if op not in ("sum", "avg"):
            raise ValueError(f"op={op!r}; allowed: 'sum', 'avg'")

    def close(self) -> None:
        """Release resources (windows, communicators). Safe to call twice."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_float(tensors: Iterable[torch.Tensor], op: str) -> None:
    for t in tensors:
        if t.dtype not in AVERAGING_DTYPES:
            raise TypeError(
                f"{op} averages, so it needs a floating dtype; got {t.dtype} "
                f"(allowed: float32, float64, float16, bfloat16)"
            )
