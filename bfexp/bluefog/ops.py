"""BlueFog's basic and communication functions (``bluefog.torch.mpi_ops``) on bfexp's engine.

Every function keeps BlueFog's name, arguments and return values: blocking
ops return the result tensor; ``*_nonblocking`` ops return an integer
handle for ``poll``/``synchronize``/``wait`` (windows: ``win_poll``/
``win_wait``). The work is done by the current bfexp engine
(``bfexp.api.engine()``: MPI ranks under a launcher, virtual ranks as
threads), so the same program runs on either.

Per-rank BlueFog state (the networkx topology and whether its weights are
used, the machine topology, handles, windows, the associated-p switch)
lives beside the engine, so every virtual rank has its own.

Differences that a program can notice (README "Coming from BlueFog"):

* Ops are matched across ranks by call order, not by ``name``; ``name`` is
  accepted and ignored. Every rank must issue its collective and neighbor
  ops in the same order (a mismatch raises CommError instead of hanging).
* Neighbor declarations are always checked (``enable_topo_check`` is
  accepted; ``set_skip_negotiate_stage(True)`` turns the check off).
* A window's own value *is* the tensor given to ``win_create``: the tensor
  is re-pointed at window memory (and back at ``win_free``), so in-place
  changes are what neighbors read, as in BlueFog.
* Each window op is atomic on its own; ``win_mutex`` covers one window op
  (BlueFog's documented pattern) and raises NotImplementedError for more.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import networkx as nx
import torch

from bfexp import api
from bfexp.bluefog import topology_util
from bfexp.comm.engine import Engine, Handle

logger = logging.getLogger("bfexp.bluefog")

Weights = Mapping[int, float]
DstWeights = Union[Mapping[int, float], Sequence[int]]


# ------------------------------------------------------------------ per-rank state


@dataclass
class _RankState:
    topology: nx.DiGraph | None = None
    weighted: bool = False
    machine_topology: nx.DiGraph | None = None
    machine_weighted: bool = False
    handles: dict[int, Handle] = field(default_factory=dict)
    win_handles: dict[int, Handle] = field(default_factory=dict)
    next_handle: int = 0
    windows: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> the tensor given to win_create
    associated_p: bool = False
    mutex_ops: dict[str, int] = field(default_factory=dict)  # window -> ops run inside win_mutex
    activities: dict[str, tuple[str, float]] = field(default_factory=dict)  # timeline: tensor -> (activity, t0)

    def new_handle(self, table: dict[int, Handle], handle: Handle) -> int:
        self.next_handle += 1
        table[self.next_handle] = handle
        return self.next_handle


_states: "weakref.WeakKeyDictionary[Engine, _RankState]" = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def initialized_engine() -> Engine:
    """The current bfexp engine (this virtual rank's, or the process's), once bf.init() has run here."""
    engine = api.engine() if api.is_initialized() else None
    if engine is None or engine not in _states:
        raise ValueError("BlueFog has not been initialized; use bf.init()")
    return engine


def _state(engine: Engine | None = None) -> _RankState:
    return _states[initialized_engine() if engine is None else engine]


# ------------------------------------------------------------------ basics


def init(topology_fn: Callable[[int], nx.DiGraph] | None = None, is_weighted: bool = False) -> None:
    """Start this rank (engine from the environment, see bfexp.api.init) and set the topology.

    ``topology_fn(size)`` builds the topology; default: ExponentialGraph(size).
    """
    engine = api.init()
    with _states_lock:
        _states.setdefault(engine, _RankState())  # init again keeps the windows and handles
    topo = topology_fn(size()) if topology_fn is not None else topology_util.ExponentialGraph(size())
    set_topology(topo, is_weighted)


def shutdown() -> None:
    """Stop this rank's BlueFog state and its engine (bfexp.api.shutdown)."""
    if not api.is_initialized():
        return
    engine = api.engine()
    with _states_lock:
        _states.pop(engine, None)
    api.shutdown()


def _after_init(accessor: Callable[[], int], doc: str | None = None) -> Callable[[], int]:
    """bfexp.api's ``accessor`` under BlueFog's rule that bf.init() comes first (api's would start an engine)."""

    @functools.wraps(accessor)
    def bluefog_accessor() -> int:
        initialized_engine()
        return accessor()

    bluefog_accessor.__module__ = __name__
    if doc is not None:
        bluefog_accessor.__doc__ = doc
    return bluefog_accessor


size = _after_init(api.size)
rank = _after_init(api.rank)
local_size = _after_init(
    api.local_size, "Ranks on this rank's machine (bfexp: ranks per machine, the same on every machine).")
local_rank = _after_init(api.local_rank)
machine_size = _after_init(api.machine_size)
machine_rank = _after_init(api.machine_rank)


def is_homogeneous() -> bool:
    """Always True: bfexp places the same number of ranks on every machine, in rank order."""
    initialized_engine()
    return True


def mpi_threads_supported() -> bool:
    """Whether the transport takes calls from several threads (virtual ranks: yes; MPI: THREAD_MULTIPLE)."""
    return initialized_engine().thread_multiple()


def unified_mpi_window_model_supported() -> bool:
    """True: a window op's effect is visible to the next op on every engine (bfexp synchronizes them)."""
    initialized_engine()
    return True


def nccl_built() -> bool:
    """Whether this job's engine moves tensors between GPUs (bfexp's NCCL engine: its device type is cuda)."""
    return initialized_engine().device_type == "cuda"


def suspend() -> None:
    raise NotImplementedError("bf.suspend(): bfexp runs no background thread to pause (BlueFog's ipython helper)")


def resume() -> None:
    raise NotImplementedError("bf.resume(): bfexp runs no background thread to resume (BlueFog's ipython helper)")


def set_skip_negotiate_stage(value: bool) -> None:
    """True skips the cross-rank check of neighbor declarations (a mismatch then hangs, as raw MPI does)."""
    initialized_engine().check_neighbors = not bool(value)


def get_skip_negotiate_stage() -> bool:
    return not initialized_engine().check_neighbors


# ------------------------------------------------------------------ topology


def _check_graph(topology: Any, n: int, what: str) -> None:
    if not isinstance(topology, nx.DiGraph):
        raise TypeError(f"{what} must be a networkx.DiGraph; got {type(topology).__name__}")
    if topology.number_of_nodes() != n:
        raise TypeError(f"{what} has {topology.number_of_nodes()} nodes; allowed: {n}")


def set_topology(topology: nx.DiGraph | None = None, is_weighted: bool = False) -> bool:
    """Set the static topology (default ExponentialGraph(size)); ``is_weighted`` uses its edge weights.

    Returns False (and logs why) while windows exist: BlueFog fixes a
    window's neighbors when it is created.
    """
    st = _state()
    if topology is None:
        topology = topology_util.ExponentialGraph(size())
    _check_graph(topology, size(), "topology")
    if st.windows and not topology_util.IsTopologyEquivalent(topology, st.topology):
        logger.error("cannot set the topology while windows exist (%s); win_free() them first", sorted(st.windows))
        return False
    st.topology, st.weighted = topology, bool(is_weighted)
    return True


def set_machine_topology(topology: nx.DiGraph | None, is_weighted: bool = False) -> bool:
    """Set the topology among machines, for hierarchical_neighbor_allreduce."""
    if topology is None:
        raise ValueError("machine topology shall not be None")
    _check_graph(topology, machine_size(), "machine topology")
    st = _state()
    st.machine_topology, st.machine_weighted = topology, bool(is_weighted)
    return True


def load_topology() -> nx.DiGraph | None:
    return _state().topology


def load_machine_topology() -> nx.DiGraph | None:
    return _state().machine_topology


def is_topo_weighted() -> bool:
    return _state().weighted


def is_machine_topo_weighted() -> bool:
    return _state().machine_weighted


def _neighbors(graph: nx.DiGraph | None, me: int, incoming: bool) -> list[int]:
    if graph is None:
        return []
    nodes = graph.predecessors(me) if incoming else graph.successors(me)
    return [int(r) for r in nodes if r != me]


def in_neighbor_ranks() -> list[int]:
    """Ranks this rank receives from (self excluded, self loop or not)."""
    return _neighbors(_state().topology, rank(), incoming=True)


def out_neighbor_ranks() -> list[int]:
    return _neighbors(_state().topology, rank(), incoming=False)


def in_neighbor_machine_ranks() -> list[int]:
    return _neighbors(_state().machine_topology, machine_rank(), incoming=True)


def out_neighbor_machine_ranks() -> list[int]:
    return _neighbors(_state().machine_topology, machine_rank(), incoming=False)


def _default_recv_weights(graph: nx.DiGraph, weighted: bool, me: int) -> tuple[float, dict[int, float]]:
    """The topology's weights when it is weighted, else a uniform average of self and in-neighbors."""
    if weighted:
        return topology_util.GetRecvWeights(graph, me)
    ins = _neighbors(graph, me, incoming=True)
    w = 1.0 / (len(ins) + 1)
    return w, {r: w for r in ins}


# ------------------------------------------------------------------ handles


def _register(handle: Handle) -> int:
    return _state().new_handle(_state().handles, handle)


def poll(handle: int) -> bool:
    """Whether a nonblocking op has finished (then synchronize returns at once)."""
    try:
        return _state().handles[handle].done()
    except KeyError:
        raise ValueError(f"handle {handle} is not a pending operation of this rank") from None


def synchronize(handle: int) -> Any:
    """Wait for a nonblocking op and return its output."""
    try:
        h = _state().handles.pop(handle)
    except KeyError:
        raise ValueError(f"cannot find handle {handle} to synchronize") from None
    return h.wait()


def wait(handle: int) -> Any:
    """The same as synchronize."""
    return synchronize(handle)


def barrier() -> None:
    """Return when every rank has called it."""
    initialized_engine().barrier()


# ------------------------------------------------------------------ collectives


def _local_allreduce(engine: Engine, tensor: torch.Tensor, average: bool) -> Handle:
    """Allreduce inside this rank's machine (``is_hierarchical_local``)."""
    if tensor.is_floating_point():
        # A machine average with no machine neighbors (self weight 1), scaled back up for a sum.
        h = engine.ihierarchical_neighbor_allreduce(tensor, 1.0, {}, [])
        if average:
            return h
        return Handle(lambda: h.wait().mul_(engine.local_size), h.done)
    if average:
        raise ValueError(f"allreduce(average=True) needs a floating tensor; got {tensor.dtype}")
    h = engine.iallgather(tensor.unsqueeze(0))
    lo = engine.machine * engine.local_size
    return Handle(lambda: h.wait()[lo : lo + engine.local_size].sum(0).to(tensor.dtype), h.done)


def allreduce_nonblocking(
    tensor: torch.Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> int:
    """Start an average (or sum) over all ranks (``is_hierarchical_local``: over this machine's ranks)."""
    engine = initialized_engine()
    if is_hierarchical_local:
        return _register(_local_allreduce(engine, tensor, average))
    return _register(engine.iallreduce(tensor, op="avg" if average else "sum"))


def allreduce(
    tensor: torch.Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> torch.Tensor:
    return synchronize(allreduce_nonblocking(tensor, average, is_hierarchical_local, name))


def allreduce_nonblocking_(
    tensor: torch.Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> int:
    """allreduce_nonblocking written into ``tensor``."""
    engine = initialized_engine()
    if is_hierarchical_local:
        h = _local_allreduce(engine, tensor, average)
        return _register(Handle(lambda: tensor.copy_(h.wait()), h.done))
    return _register(engine.iallreduce_(tensor, op="avg" if average else "sum"))


def allreduce_(
    tensor: torch.Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> torch.Tensor:
    return synchronize(allreduce_nonblocking_(tensor, average, is_hierarchical_local, name))


def broadcast_nonblocking(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    return _register(initialized_engine().ibroadcast(tensor, root=root_rank))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Root's tensor on every rank (a new tensor; the input is left alone)."""
    return synchronize(broadcast_nonblocking(tensor, root_rank, name))


def broadcast_nonblocking_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    return _register(initialized_engine().ibroadcast_(tensor, root=root_rank))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Root's tensor written into ``tensor`` on every rank."""
    return synchronize(broadcast_nonblocking_(tensor, root_rank, name))


def allgather_nonblocking(tensor: torch.Tensor, name: str | None = None) -> int:
    return _register(initialized_engine().iallgather(tensor))


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 in rank order (first dims may differ)."""
    return synchronize(allgather_nonblocking(tensor, name))


# ------------------------------------------------------------------ neighbor ops


def _ordered_gather(engine: Engine, tensor: torch.Tensor, srcs: list[int], dsts: list[int]) -> Handle:
    """neighbor_allgather in the order of ``srcs`` (the engine gathers in ascending rank)."""
    if srcs == sorted(srcs):
        return engine.ineighbor_allgather(tensor, srcs, dsts)
    rows = torch.tensor([float(tensor.shape[0] if tensor.dim() else 1)], dtype=torch.float64)
    counts = engine.ineighbor_allgather(rows, srcs, dsts)
    data = engine.ineighbor_allgather(tensor, srcs, dsts)

    def reorder() -> torch.Tensor:
        n = [int(c) for c in counts.wait().tolist()]
        parts = dict(zip(sorted(srcs), torch.split(data.wait(), n)))
        return torch.cat([parts[s] for s in srcs])

    return Handle(reorder, lambda: counts.done() and data.done())


def neighbor_allgather_nonblocking(
    tensor: torch.Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> int:
    if (src_ranks is None) != (dst_ranks is None):
        raise ValueError("src_ranks and dst_ranks have to be given together")
    if src_ranks is None:
        src_ranks, dst_ranks = in_neighbor_ranks(), out_neighbor_ranks()
    return _register(_ordered_gather(initialized_engine(), tensor, [int(r) for r in src_ranks], [int(r) for r in dst_ranks]))


def neighbor_allgather(
    tensor: torch.Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> torch.Tensor:
    """In-neighbors' tensors (self excluded) along dim 0, in the order of src_ranks (default in_neighbor_ranks)."""
    return synchronize(neighbor_allgather_nonblocking(
        tensor, src_ranks=src_ranks, dst_ranks=dst_ranks, enable_topo_check=enable_topo_check, name=name))


def _as_dst(dst_weights: DstWeights, what: str) -> dict[int, float] | list[int]:
    if isinstance(dst_weights, Mapping):
        return {int(k): float(v) for k, v in dst_weights.items()}
    ranks = [int(r) for r in dst_weights]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} should only contain unique ranks; got {ranks}")
    return ranks


def _subset(keys: Any, allowed: Sequence[int], what: str, role: str) -> None:
    bad = sorted(set(int(k) for k in keys) - set(allowed))
    if bad:
        raise ValueError(f"{what} has ranks {bad} that are not {role} {sorted(allowed)}")


def neighbor_args(
    self_weight: float | None, src_weights: Weights | None, dst_weights: DstWeights | None
) -> tuple[float, dict[int, float], dict[int, float] | list[int]]:
    """(self weight, src weights, destinations) of a neighbor_allreduce, BlueFog's defaults filled in."""
    if (self_weight is None) != (src_weights is None):
        raise ValueError("self_weight and src_weights have to be given together")
    st = _state()
    if dst_weights is None:  # the static topology: send to every out-neighbor
        if self_weight is None:
            if st.topology is None:
                self_weight, src_weights = 1.0, {}
            else:
                self_weight, src_weights = _default_recv_weights(st.topology, st.weighted, rank())
        else:
            _subset(src_weights, in_neighbor_ranks(), "src_weights", "in-neighbors")
        dst: dict[int, float] | list[int] = out_neighbor_ranks()
    else:  # a dynamic topology: this call's senders and receivers
        if self_weight is None:
            raise ValueError("self_weight and src_weights have to be given with dst_weights (dynamic topology)")
        dst = _as_dst(dst_weights, "dst_weights")
    if not isinstance(src_weights, Mapping):
        raise ValueError("src_weights has to be a dict {in-neighbor rank: weight}")
    return float(self_weight), {int(k): float(v) for k, v in src_weights.items()}, dst


def machine_args(
    self_weight: float | None, src_machine_weights: Weights | None, dst_machine_weights: DstWeights | None
) -> tuple[float, dict[int, float], dict[int, float] | list[int]]:
    """(self weight, src machine weights, destination machines) of a hierarchical_neighbor_allreduce."""
    given = [w is not None for w in (self_weight, src_machine_weights, dst_machine_weights)]
    if any(given) and not all(given):
        raise ValueError("self_weight, src_machine_weights and dst_machine_weights have to be given together")
    st = _state()
    if not any(given):  # the static machine topology
        if st.machine_topology is None:
            raise RuntimeError("set_machine_topology(...) before hierarchical_neighbor_allreduce without weights")
        self_weight, src_machine_weights = _default_recv_weights(
            st.machine_topology, st.machine_weighted, machine_rank())
        dst: dict[int, float] | list[int] = out_neighbor_machine_ranks()
    else:
        if not isinstance(src_machine_weights, Mapping):
            raise ValueError("src_machine_weights has to be a dict {machine: weight}")
        dst = _as_dst(dst_machine_weights, "dst_machine_weights")  # type: ignore[arg-type]
    src = {int(k): float(v) for k, v in src_machine_weights.items()}  # type: ignore[union-attr]
    return float(self_weight), src, dst  # type: ignore[arg-type]


def neighbor_allreduce_nonblocking(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Weights | None = None,
    dst_weights: DstWeights | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> int:
    """Start ``self_weight * x + sum_j src_weights[j] * dst_weight(j->i) * x_j`` (see neighbor_allreduce)."""
    return _register(initialized_engine().ineighbor_allreduce(tensor, *neighbor_args(self_weight, src_weights, dst_weights)))


def neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Weights | None = None,
    dst_weights: DstWeights | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> torch.Tensor:
    """Weighted average with in-neighbors; the input is left alone.

    Left out, the weights are the topology's (``is_weighted``) or a uniform
    average of self and in-neighbors, sent to every out-neighbor. With
    ``dst_weights`` (a list of ranks, or {rank: scale} that the sender
    applies) the call describes this iteration's dynamic graph, and
    ``self_weight``/``src_weights`` must be given.
    """
    return synchronize(neighbor_allreduce_nonblocking(
        tensor, self_weight=self_weight, src_weights=src_weights, dst_weights=dst_weights,
        enable_topo_check=enable_topo_check, name=name))


def hierarchical_neighbor_allreduce_nonblocking(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Weights | None = None,
    dst_machine_weights: DstWeights | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
) -> int:
    args = machine_args(self_weight, src_machine_weights, dst_machine_weights)
    return _register(initialized_engine().ihierarchical_neighbor_allreduce(tensor, *args))


def hierarchical_neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Weights | None = None,
    dst_machine_weights: DstWeights | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """Average inside each machine, then neighbor_allreduce among machines (weights keyed by machine)."""
    return synchronize(hierarchical_neighbor_allreduce_nonblocking(
        tensor, self_weight=self_weight, src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights, enable_topo_check=enable_topo_check, name=name))


# ------------------------------------------------------------------ windows


def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False) -> bool:
    """Collective: a window over ``tensor`` with one slot per in-neighbor of the topology.

    Slots start as the neighbors' tensors (``zero_init``: zeros). ``tensor``
    is re-pointed at the window's memory: changing it in place changes what
    neighbors get, and win_update writes into it.
    """
    engine, st = initialized_engine(), _state()
    if name in st.windows:
        raise ValueError(f"window {name!r} exists; win_free it first")
    own = engine.win_create(tensor, name, in_neighbor_ranks(), out_neighbor_ranks(), zero_init=zero_init)
    if own.device != tensor.device:
        engine.win_free(name)
        raise NotImplementedError(f"win_create on a {tensor.device} tensor: the {engine.name} engine keeps "
                                  f"window memory on {own.device}")
    tensor.data = own.view(tensor.shape)
    st.windows[name] = tensor
    return True


def win_free(name: str | None = None) -> bool:
    """Collective: free one window (all when ``name`` is None); its tensor keeps its last value."""
    engine, st = initialized_engine(), _state()
    for nm in sorted(st.windows) if name is None else [name]:
        if nm not in st.windows:
            raise ValueError(f"no window {nm!r}; created: {sorted(st.windows) or 'none'}")
        t = st.windows.pop(nm)
        t.data = t.detach().clone()  # off window memory before it goes
        engine.win_free(nm)
    return True


def get_current_created_window_names() -> list[str]:
    return sorted(_state().windows)


def _window(name: str) -> torch.Tensor:
    st = _state()
    if name not in st.windows:
        raise ValueError(f"no window {name!r}; created: {sorted(st.windows) or 'none'}")
    mutex = st.mutex_ops.get(name)
    if mutex is not None:
        st.mutex_ops[name] = mutex + 1
        if mutex >= 1:
            raise NotImplementedError(
                f"win_mutex({name!r}) around more than one window op: bfexp makes each window op atomic, "
                "not a block of them")
    return st.windows[name]


def _register_win(handle: Handle) -> int:
    st = _state()
    return st.new_handle(st.win_handles, handle)


def _push(tensor: torch.Tensor, name: str, self_weight: float | None, dst_weights: Weights | None,
          accumulate: bool) -> int:
    engine, own = initialized_engine(), _window(name)
    outs = out_neighbor_ranks()
    dst = {r: 1.0 for r in outs} if dst_weights is None else {int(k): float(v) for k, v in dst_weights.items()}
    _subset(dst, outs, "dst_weights", "out-neighbors")
    sw = None if self_weight is None or float(self_weight) == 1.0 else float(self_weight)
    if sw is not None and tensor.data_ptr() != own.data_ptr():
        raise NotImplementedError(
            f"win_put/win_accumulate with self_weight on a tensor other than window {name!r}'s own")
    op = engine.iwin_accumulate if accumulate else engine.iwin_put
    return _register_win(op(tensor.detach().reshape(-1), name, sw, dst))


def win_put_nonblocking(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                        dst_weights: Weights | None = None, require_mutex: bool = False) -> int:
    """Start writing ``w * tensor`` into each out-neighbor's slot for this rank (default: all, w = 1).

    ``self_weight`` then scales the window's own tensor in place (and p).
    """
    return _push(tensor, name, self_weight, dst_weights, accumulate=False)


def win_put(tensor: torch.Tensor, name: str, self_weight: float | None = None,
            dst_weights: Weights | None = None, require_mutex: bool = False) -> bool:
    return win_wait(win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


def win_accumulate_nonblocking(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                               dst_weights: Weights | None = None, require_mutex: bool = False) -> int:
    """Like win_put_nonblocking, but adds into the slots."""
    return _push(tensor, name, self_weight, dst_weights, accumulate=True)


def win_accumulate(tensor: torch.Tensor, name: str, self_weight: float | None = None,
                   dst_weights: Weights | None = None, require_mutex: bool = False) -> bool:
    return win_wait(win_accumulate_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


def win_get_nonblocking(name: str, src_weights: Weights | None = None, require_mutex: bool = False) -> int:
    """Start fetching ``w * (in-neighbor's tensor)`` into this rank's slots (default: all, w = 1)."""
    engine = initialized_engine()
    _window(name)
    ins = in_neighbor_ranks()
    src = {r: 1.0 for r in ins} if src_weights is None else {int(k): float(v) for k, v in src_weights.items()}
    _subset(src, ins, "src_weights", "in-neighbors")
    return _register_win(engine.iwin_get(name, src))


def win_get(name: str, src_weights: Weights | None = None, require_mutex: bool = False) -> bool:
    return win_wait(win_get_nonblocking(name, src_weights, require_mutex))


neighbor_win_put, neighbor_win_put_nonblocking = win_put, win_put_nonblocking
neighbor_win_get, neighbor_win_get_nonblocking = win_get, win_get_nonblocking
neighbor_win_accumulate, neighbor_win_accumulate_nonblocking = win_accumulate, win_accumulate_nonblocking


def win_poll(handle: int) -> bool:
    st = _state()
    if handle not in st.win_handles:
        raise ValueError(f"handle {handle} is not a pending window operation of this rank")
    return st.win_handles[handle].done()


def win_wait(handle: int) -> bool:
    """Wait for a window op; False (with a warning) for an unknown handle, as BlueFog."""
    h = _state().win_handles.pop(handle, None)
    if h is None:
        logger.warning("win_wait: handle %s is not a pending window operation", handle)
        return False
    h.wait()
    return True


def win_update(name: str, self_weight: float | None = None, neighbor_weights: Weights | None = None,
               reset: bool = False, clone: bool = False, require_mutex: bool = False) -> torch.Tensor:
    """own := self_weight * own + sum_j neighbor_weights[j] * slot_j (and the same for p); returns the tensor.

    Weights left out: the topology's (is_weighted) or a uniform average of
    self and every in-neighbor slot. ``reset`` zeroes the slots used;
    ``clone`` returns the result as a new tensor and leaves the window's alone.
    """
    if (self_weight is None) != (neighbor_weights is None):
        raise ValueError("self_weight and neighbor_weights have to be given together")
    engine, st, own = initialized_engine(), _state(), _window(name)
    if self_weight is None:
        self_weight, neighbor_weights = _default_recv_weights(st.topology, st.weighted, rank())
    elif not isinstance(neighbor_weights, Mapping):
        raise ValueError("neighbor_weights has to be a dict {in-neighbor rank: weight}")
    _subset(neighbor_weights, in_neighbor_ranks(), "neighbor_weights", "in-neighbors")  # type: ignore[arg-type]
    src = {int(k): float(v) for k, v in neighbor_weights.items()}  # type: ignore[union-attr]
    before = own.detach().clone() if clone else None
    engine.win_update(name, float(self_weight), src, reset)
    if before is None:
        return own
    result = own.detach().clone()
    own.data.copy_(before)
    return result


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """Add every in-neighbor slot into the own tensor (weights 1) and empty the slots: push-sum's collect."""
    return win_update(name, 1.0, {r: 1.0 for r in in_neighbor_ranks()}, reset=True, require_mutex=require_mutex)


@contextlib.contextmanager
def win_mutex(name: str, for_self: bool = False, ranks: Sequence[int] | None = None) -> Iterator[None]:
    """Hold the window exclusively for ONE window op inside (each bfexp window op is atomic).

    A second window op on ``name`` inside the block raises
    NotImplementedError: bfexp has no lock spanning several ops.
    """
    st = _state()
    if name not in st.windows:
        raise ValueError(f"no window {name!r}; created: {sorted(st.windows) or 'none'}")
    if name in st.mutex_ops:
        raise NotImplementedError(f"nested win_mutex({name!r})")
    st.mutex_ops[name] = 0
    try:
        yield
    finally:
        st.mutex_ops.pop(name, None)


def win_associated_p(name: str) -> float:
    """The push-sum weight p of the window's own tensor (1.0 while associated p is off, as in BlueFog)."""
    engine, st = initialized_engine(), _state()
    if name not in st.windows:
        raise ValueError(f"no window {name!r}; created: {sorted(st.windows) or 'none'}")
    return engine.win_weight(name) if st.associated_p else 1.0


def turn_on_win_ops_with_associated_p() -> None:
    """Report p (win_associated_p): put/accumulate/update move it with the data, as BlueFog's switch does."""
    _state().associated_p = True


def turn_off_win_ops_with_associated_p() -> None:
    _state().associated_p = False


def get_win_version(name: str) -> dict[int, int]:
    raise NotImplementedError("get_win_version: bfexp windows keep no per-slot version counters")


# ------------------------------------------------------------------ timeline


def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    """Open an activity on this rank's bfexp timeline (BFEXP_TIMELINE=DIR); False when tracing is off."""
    engine = initialized_engine()
    if engine.timeline is None:
        return False
    _state(engine).activities[tensor_name] = (activity_name, time.perf_counter())
    return True


def timeline_end_activity(tensor_name: str) -> bool:
    engine = initialized_engine()
    opened = _state(engine).activities.pop(tensor_name, None)
    if engine.timeline is None or opened is None:
        return False
    engine.timeline.complete(opened[0], opened[1], time.perf_counter(), tensor=tensor_name)
    return True


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str) -> Iterator[None]:
    timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        timeline_end_activity(tensor_name)
