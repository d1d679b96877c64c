"""The library a user's own training script reaches with one import: ``import bfexp as bf``.

A plain PyTorch script becomes decentralized with three changed lines::

    import bfexp as bf                                             # 1
    train_loader = bf.shard(DataLoader(train_set, batch_size=64, shuffle=True))   # 2
    optimizer = bf.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.1), model)  # 3

and runs with ``bfexp-run -n 4 python train.py`` (bfexp.run), or as virtual
ranks in one process with ``bfexp-run -n 8 --engine threads python
train.py`` or, from a notebook, ``bf.spawn(main, size=8)``.

The engine (who the other ranks are) comes from where the code runs; the
first call that needs it (``bf.rank()``, ``bf.shard``, an operation...)
starts it, or ``bf.init()`` does so explicitly:

* under mpiexec / ``bfexp-run`` (``OMPI_COMM_WORLD_SIZE``, ``PMIX_RANK``,
  ``PMI_RANK`` ... in the environment): the MPI engine, one process a rank;
* inside ``bf.spawn`` or ``bfexp-run --engine threads``: the virtual rank
  this thread runs (each thread answers for its own rank: the current
  engine is thread-local there);
* a plain ``python train.py``: one rank (virtual, no MPI started), so the
  same script still runs alone;
* ``bf.init(engine="mpi"|"nccl"|"threads")`` or ``$BFEXP_ENGINE`` choose: a shipped
  engine's name (conf/engine/) or an engine class's path (``mylab.engines.MyEngine``,
  bfexp.comm.engine_class), so a user's own engine runs a script too.

Every Engine operation (bfexp.comm.engine: allreduce, neighbor_allreduce,
win_put ... with their nonblocking ``i`` forms) is a function here that
runs on the current engine. ``bf.shard`` gives a rank its part of a data
set (the runner's partitions: iid, sorted, dirichlet); and
``bf.DistributedOptimizer`` wraps an optimizer with an algorithm and a
topology named as the runner names them (conf/algorithm/*.yaml,
conf/topology/*.yaml, built by the runner's own path) or given as objects.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import io
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TextIO

import numpy as np
import torch

from bfexp.operations import OPERATIONS  # listed apart, so that `import bfexp` needs no torch
from bfexp.comm.engine import Engine, forwards
from bfexp.errors import ConfigError, number_in

if TYPE_CHECKING:  # pragma: no cover
    from bfexp.algorithms import DecentralizedOptimizer
    from bfexp.topology import Topology

__all__ = [
    "OPERATIONS",
    "DistributedOptimizer",
    "advance",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "clock_s",
    "engine",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "machine_rank",
    "machine_size",
    "rank",
    "shard",
    "shutdown",
    "size",
    "spawn",
]

# Environment a launcher gives each MPI process (Open MPI, PMIx, MPICH/Hydra, Intel MPI).
MPI_ENVIRONMENT = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
# Chooses the engine of bf.init() when set (mpi, nccl, threads, or an engine class's path).
ENGINE_VARIABLE = "BFEXP_ENGINE"

_thread = threading.local()  # .engine: the virtual rank a bf.spawn thread runs
_process: Engine | None = None  # the engine of this process (MPI rank, or one rank alone)
_lock = threading.RLock()


# ------------------------------------------------------------------ the current engine


def detect_engine() -> str:
    """The engine the environment asks for: $BFEXP_ENGINE, else under an MPI launcher the shipped engine whose
    ranks are CPU processes (mpi), else the shipped one of virtual ranks as threads (bfexp.comm.shipped_engine)."""
    chosen = os.environ.get(ENGINE_VARIABLE)
    if chosen:
        return chosen
    from bfexp.comm import shipped_engine

    return shipped_engine("processes" if any(k in os.environ for k in MPI_ENVIRONMENT) else "threads") or ""


def init(engine: str | None = None, size: int | None = None) -> Engine:
    """Start (or return) this rank's engine; ``engine`` and ``size`` default to what the environment says.

    Calling it again returns the same engine. ``size`` only checks: the rank
    count is the launcher's (``bfexp-run -n``) or ``bf.spawn``'s; a plain
    process is one rank.
    """
    global _process
    current = getattr(_thread, "engine", None) or _process
    if current is not None:
        _check_matches(current, engine, size)
        return current
    with _lock:
        if _process is not None:
            _check_matches(_process, engine, size)
            return _process
        name = engine or detect_engine()
        from bfexp.comm import engine_class

        cls = engine_class(name)
        if cls.virtual:
            if size not in (None, 1):
                raise ConfigError(
                    f"bf.init(engine={name!r}, size={size}) outside virtual ranks; allowed: size=1 here, or run the "
                    f"ranks with bf.spawn(fn, size={size}) or `bfexp-run -n {size} --engine threads python script.py`"
                )
            from bfexp.comm.threads import ThreadsEngine, ThreadWorld

            # One virtual rank alone: its own class (a user's subclass too); a stacked engine's tensors carry a
            # rank dimension a script does not, so that one runs as plain virtual ranks.
            made: Engine = (ThreadsEngine if cls.stacked else cls)(ThreadWorld(1), 0)
        else:
            from bfexp.watchdog import attach

            made = cls()
            atexit.register(_close_at_exit, made)
            attach(made)  # under bfexp-run: the rank's heartbeat reports this engine's calls to its hang watchdog
        _check_matches(made, None, size)
        _process = made
        return made


def _rank_engine(engine: str | type | None) -> type[Engine] | None:
    """The class of bf.spawn's ``engine`` (None: the threads engine); ConfigError for one whose ranks are not
    threads of this process."""
    if engine is None:
        return None
    from bfexp.comm import engine_class

    cls = engine if isinstance(engine, type) else engine_class(engine)
    if not (isinstance(cls, type) and issubclass(cls, Engine) and cls.virtual and not cls.stacked):
        raise ConfigError(f"bf.spawn(engine={engine!r}): not an engine of virtual ranks as threads; allowed: threads "
                          "or an Engine class of virtual ranks (e.g. a subclass of bfexp.comm.threads.ThreadsEngine)")
    return cls


def _check_matches(current: Engine, engine: str | None, size: int | None) -> None:
    if engine is not None and engine not in (current.name, f"{type(current).__module__}.{type(current).__qualname__}"):
        raise ConfigError(f"bf.init(engine={engine!r}) but this rank runs engine={current.name}; allowed: "
                          f"{current.name} (one engine a process)")
    if size is not None and size != current.size:
        raise ConfigError(f"bf.init(size={size}) but the job has {current.size} ranks; allowed: size={current.size}")


def _close_at_exit(made: Engine) -> None:
    # Windows and communicators go before MPI finalizes (mpi4py's own exit hook runs after this one).
    if _process is made:
        shutdown()


def is_initialized() -> bool:
    """Whether this thread has an engine (a started process engine, or a virtual rank's)."""
    return getattr(_thread, "engine", None) is not None or _process is not None


def engine() -> Engine:
    """The current engine: this virtual rank's inside ``bf.spawn``, else the process's (started on first use)."""
    current = getattr(_thread, "engine", None) or _process
    return current if current is not None else init()


def shutdown() -> None:
    """Close the process's engine (collective on MPI: every rank calls it). A virtual rank's closes with its thread."""
    global _process
    if getattr(_thread, "engine", None) is not None:
        return
    with _lock:
        made, _process = _process, None
    if made is not None:
        made.close()


def rank() -> int:
    return engine().rank


def size() -> int:
    return engine().size


def local_rank() -> int:
    """This rank's index among the ranks of its machine."""
    return engine().local_rank


def local_size() -> int:
    """Ranks on this rank's machine."""
    return engine().local_size


def machine_rank() -> int:
    """Index of this rank's machine."""
    return engine().machine


def machine_size() -> int:
    """Machines in the job."""
    return engine().machines


def advance(seconds: float) -> None:
    """``seconds`` of this rank's time pass: its compute, or a straggler's delay, in a script's own loop.

    On virtual ranks the rank's simulated clock moves on (no sleep) and the
    rank with the earliest clock runs next, so a rank that advances 4x as
    much makes a quarter of the steps of the others by the same clock; on
    process ranks (MPI, NCCL) it sleeps. Window operations of a script on
    virtual ranks hand the turn on too, at no cost in time (docs: "Your own
    script").
    """
    engine().advance(float(number_in("seconds", seconds, low=0, error=ValueError)))


def clock_s() -> float:
    """This rank's time in seconds: simulated on virtual ranks (what ``advance`` and waiting for other
    ranks have moved it to), wall-clock since the engine started on process ranks."""
    return engine().clock_s


# ------------------------------------------------------------------ the engine's operations

# Every Engine operation (bfexp.operations.OPERATIONS), as a function on the current engine (same arguments).


def _operation(name: str) -> Callable[..., Any]:
    method = getattr(Engine, name)

    @forwards  # a hang names the user's line, not this one
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(engine(), name)(*args, **kwargs)

    call.__qualname__ = name
    del call.__wrapped__  # its signature is the method's without self
    return call


for _name in OPERATIONS:
    globals()[_name] = _operation(_name)
__all__ += list(OPERATIONS)


# ------------------------------------------------------------------ virtual ranks in this process


def spawn(
    target: Callable[..., Any] | str | os.PathLike,
    size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    ranks_per_machine: int = 0,
    prefix_output: bool = True,
    timeout: float | None = None,
    supervise: Callable[[Any, str], None] | None = None,
    engine: str | type | None = None,
) -> list[Any]:
    """Run ``target`` on ``size`` virtual ranks (threads of this process); return each rank's result.

    ``target`` is a function, called as ``target(*args, **kwargs)`` on every
    rank, or the path of a script, run as ``__main__`` with ``sys.argv =
    [path, *args]`` (its result: the script's globals). Inside, ``bf.*``
    answers for the calling thread's rank. One rank thread runs at a time,
    each with its own torch, numpy and Python global RNG, handing on only
    while it waits for other ranks (bfexp.comm.threads.Turns): seeding and
    drawing as a script does gives the numbers the same script gets on MPI.
    A rank that raises ends the others (at their next communication) and its
    exception is re-raised here, noting the rank; ``prefix_output`` tags what
    ranks print with ``[rank N]``. ``supervise(world, key)``, when given, waits for the ranks instead
    (bfexp-run's watch loop), their heartbeats under ``key`` (bfexp.watchdog.live_heartbeats).
    ``engine``: the ranks' engine, of virtual ranks as threads (a class, or a name or path:
    bfexp.comm.engine_class; default threads).
    """
    from bfexp.comm.threads import RankAborted, ThreadWorld
    from bfexp.watchdog import Heartbeat

    world = ThreadWorld(int(size), ranks_per_machine, one_at_a_time=True, engine=_rank_engine(engine))
    key = f"bf.spawn-{id(world)}"

    def rank_main(rank_engine: Engine) -> Any:
        _thread.engine = rank_engine
        heartbeat = Heartbeat(rank_engine, Path(key), step=None) if supervise else None
        try:
            return run()
        except SystemExit as stop:  # a script's sys.exit(0) is a normal end
            if stop.code in (None, 0):
                return None
            raise
        finally:
            _thread.engine = None
            if heartbeat is not None:
                heartbeat.close()

    saved_threads, saved_argv, saved_path = torch.get_num_threads(), sys.argv, list(sys.path)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(size))))  # as each MPI rank gets
    streams = _prefixed_output() if prefix_output else _nothing()
    try:
        if isinstance(target, (str, os.PathLike)):
            run = _script_runner(Path(target), list(args))  # sets sys.argv and sys.path[0], as `python script`
        else:
            run = functools.partial(target, *args, **(kwargs or {}))
        with streams:
            world.start(rank_main, name="bfexp-virtual-rank")
            if supervise is not None:
                supervise(world, str(Path(key)))
            elif not world.join(timeout):
                world.abort(RankAborted(f"timed out after {timeout} s"))
                world.join(10.0)
                raise TimeoutError(f"virtual ranks {world.alive()} still running after {timeout} s")
    except KeyboardInterrupt:
        world.abort(RankAborted("stopped by a signal"))
        world.join(5.0)
        raise
    finally:
        torch.set_num_threads(saved_threads)
        sys.argv, sys.path[:] = saved_argv, saved_path
    own = {r: e for r, e in world.errors.items() if not isinstance(e, RankAborted)}
    for errors in (own, world.errors):
        if errors:
            first = min(errors)
            exc = errors[first]
            exc.add_note(f"(raised on virtual rank {first} of {size})")
            exc.bfexp_rank = first  # type: ignore[attr-defined]  # bfexp-run names it
            raise exc
    return [world.results.get(r) for r in range(int(size))]


def _script_runner(path: Path, argv: list[str]) -> Callable[[], dict]:
    """Run a script as ``__main__`` in a namespace of its own (per rank), as ``python path args`` would."""
    if not path.is_file():
        raise FileNotFoundError(f"script {path} does not exist")
    code = compile(path.read_text(), str(path), "exec")
    sys.argv = [str(path), *argv]  # process-wide, the same for every rank
    folder = str(path.resolve().parent)
    if not sys.path or sys.path[0] != folder:
        sys.path.insert(0, folder)

    def run() -> dict:
        namespace = {"__name__": "__main__", "__file__": str(path), "__builtins__": builtins, "__spec__": None,
                     "__package__": None, "__loader__": None, "__cached__": None, "__doc__": None}
        exec(code, namespace)
        return namespace

    return run


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _PrefixedStream(io.TextIOBase):
    """sys.stdout/sys.stderr stand-in: each line a virtual rank prints goes out as ``[rank N] line``."""

    def __init__(self, original: TextIO) -> None:
        self._original = original
        self._partial: dict[int, str] = {}
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        from bfexp.comm.threads import current_rank

        r = current_rank()
        if r is None:
            return self._original.write(text)
        with self._lock:
            lines = (self._partial.pop(r, "") + text).split("\n")
            if lines[-1]:
                self._partial[r] = lines[-1]
            for line in lines[:-1]:
                self._original.write(f"[rank {r}] {line}\n")
            self._original.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            for r, rest in sorted(self._partial.items()):
                self._original.write(f"[rank {r}] {rest}\n")
            self._partial.clear()
            self._original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


class _prefixed_output:
    def __enter__(self) -> None:
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _PrefixedStream(sys.stdout), _PrefixedStream(sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = self._saved


# ------------------------------------------------------------------ data: each rank its part


def shard(
    data: Any,
    partition: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    labels: Sequence[int] | np.ndarray | None = None,
) -> Any:
    """This rank's part of a map-style Dataset (a Subset) or of a DataLoader (a DataLoader over its part).

    ``partition`` is the runner's (bfexp.data.partition): ``iid`` a shuffled
    even split; ``sorted`` contiguous runs of the label-sorted order;
    ``dirichlet`` per-class shares drawn from Dir(``alpha``). Every rank
    draws the same split from ``seed``, so the parts never overlap and
    together cover the data set. Labels (for sorted and dirichlet) come from
    ``labels``, else the data set's ``targets`` or ``tensors[1]``, else its
    samples. A loader keeps its batch size, shuffling, workers and collate
    function; one with its own sampler cannot be split here.
    """
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, Subset

    from bfexp.data import partition as split

    loader = data if isinstance(data, DataLoader) else None
    dataset = loader.dataset if loader is not None else data
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"bf.shard needs a map-style Dataset or a DataLoader over one; got {type(data).__name__}")
    if partition not in ("iid", "sorted", "dirichlet"):
        raise ConfigError(f"partition={partition!r}; allowed: iid, sorted, dirichlet")
    e = engine()
    y = np.zeros(len(dataset), dtype=np.int64) if partition == "iid" else _labels_of(dataset, labels)
    # The runner's split and its random stream (bfexp.data.Dataset.load): the same parts for the same seed.
    mine = split(y, e.size, partition, alpha, np.random.default_rng([seed, 1]))[e.rank]
    part = Subset(dataset, mine.tolist())
    if loader is None:
        return part
    if loader.batch_sampler is not None and not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise TypeError(f"bf.shard cannot split a DataLoader with its own sampler ({type(loader.sampler).__name__}); "
                        "allowed: shard the dataset, then make the loader")
    options = dict(batch_size=loader.batch_size, shuffle=isinstance(loader.sampler, RandomSampler),
                   num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                   drop_last=loader.drop_last, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                   generator=loader.generator, persistent_workers=loader.persistent_workers)
    if loader.num_workers:
        options["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(part, **options)


def _labels_of(dataset: Any, labels: Any) -> np.ndarray:
    if labels is None:
        labels = getattr(dataset, "targets", None)
    if labels is None and hasattr(dataset, "tensors"):
        labels = dataset.tensors[-1]
    if labels is None:
        labels = [dataset[i][1] for i in range(len(dataset))]
    out = np.asarray(labels.numpy() if isinstance(labels, torch.Tensor) else labels)
    if out.shape != (len(dataset),):
        raise ValueError(f"labels have shape {out.shape}; allowed: one label per sample ({len(dataset)})")
    return out


# ------------------------------------------------------------------ the optimizer wrapper


def parameter_tensors(params: Any) -> list[torch.Tensor]:
    """The tensors of a module (parameters, then buffers), a state_dict or other dict (sorted by name),
    or a list of tensors or (name, tensor) pairs (``named_parameters()``); other values are skipped."""
    if isinstance(params, torch.nn.Module):
        items: Iterable[Any] = [*params.parameters(), *params.buffers()]
    elif isinstance(params, Mapping):
        items = [v for _, v in sorted(params.items())]
    elif isinstance(params, Iterable) and not isinstance(params, (str, torch.Tensor)):
        items = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}; allowed: a module, a dict or a list")
    return [t for t in items if isinstance(t, torch.Tensor)]


def fused_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by (dtype, device), in one order on every rank: a group travels as one message."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.detach())
    return [groups[k] for k in sorted(groups, key=str)]


def broadcast_parameters(tensors: Any, root: int = 0) -> None:
    """Overwrite tensors (see ``parameter_tensors``: a module, a state_dict, a list) with ``root``'s, in place.

    One fused message per dtype and device. BlueFog's ``broadcast_parameters`` is this one.
    """
    e = engine()
    with torch.no_grad():
        for group in fused_groups(parameter_tensors(tensors)):
            e.broadcast_(group, root=root)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Give every rank ``root``'s optimizer state and hyperparameters: ``root``'s state_dict, loaded.

    Whatever state each rank has: a stateless optimizer (SGD without momentum)
    still takes root's learning rate, a rank that has stepped takes root's
    buffers, and a rank that has when root has none is emptied. Nothing is
    stepped to make state first. Tensors land on the rank's own parameters'
    devices. BlueFog's ``broadcast_optimizer_state`` is this one.
    """
    e = engine()
    buffer = io.BytesIO()
    if e.rank == root:
        torch.save(optimizer.state_dict(), buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue() or b"\0"), dtype=torch.uint8)
    length = e.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), root=root)
    data = payload if e.rank == root else torch.zeros(int(length), dtype=torch.uint8)
    data = e.broadcast(data, root=root)
    if e.rank != root:  # load_state_dict moves each tensor to its parameter's device
        state = torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state)


def DistributedOptimizer(  # noqa: N802 - it stands where a torch optimizer class stood
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module | None = None,
    algorithm: str | Callable[..., Any] = "exact_diffusion",
    topology: "str | Topology | Callable[..., Topology]" = "exp2",
    *,
    broadcast_initial: bool = True,
    topology_options: dict[str, Any] | None = None,
    **options: Any,
) -> "DecentralizedOptimizer":
    """Wrap ``optimizer`` with a decentralized algorithm over a topology; the result is a torch Optimizer.

    ``algorithm``: a name of conf/algorithm (exact_diffusion, dsgd, push_sum,
    ...) built as the runner builds it, with ``options`` over the YAML's; or
    a DecentralizedOptimizer class (``options`` are its keywords). Options
    may be objects where the constructor takes them (``compressor=TopK(0.3)``).
    ``topology``: a name of conf/topology (``topology_options`` over the
    YAML's), a Topology, or a class/function called with the rank count.
    Built by the runner's own assembly (bfexp.assembly): the same checks and
    one-line refusals, and the algorithm runs on the topology its rule
    accepts (exact diffusion on exp2: its undirected form, with a
    UserWarning naming both graphs).

    With ``broadcast_initial`` (default) every rank starts from rank 0's
    parameters, buffers and optimizer state, whatever each seeded; False
    keeps each rank's own start. Give ``model`` so the rule starts its
    communication from the forward pass (and its buffers are broadcast).
    """
    from bfexp.assembly import assemble

    if broadcast_initial:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        broadcast_parameters([*dict.fromkeys([*params, *(model.parameters() if model else [])])]
                             + ([*model.buffers()] if model else []))
        broadcast_optimizer_state(optimizer)
    algorithm, topology = named_nodes(algorithm, topology)
    made = assemble(algorithm, optimizer, engine(), topology, model=model, options=options,
                    topology_options=topology_options)
    made.warn(stacklevel=2)  # at the caller's line, as the algorithm's own constructor warns
    return made.optimizer


def named_nodes(algorithm: Any, topology: Any) -> tuple[Any, Any]:
    """(algorithm, topology) with a name (a conf/algorithm or conf/topology option) replaced by the
    runner's node for it, a plain dict the caller may lay options over (objects included); other
    values (classes, Topology objects, nodes) as they are."""
    import copy

    if not (isinstance(algorithm, str) or isinstance(topology, str)):
        return algorithm, topology
    nodes = copy.deepcopy(_compose_cached(algorithm if isinstance(algorithm, str) else None,
                                          topology if isinstance(topology, str) else None))
    return (nodes["algorithm"] if isinstance(algorithm, str) else algorithm,
            nodes["topology"] if isinstance(topology, str) else topology)


@functools.lru_cache(maxsize=None)
def _compose_cached(algorithm: str | None, topology: str | None) -> dict[str, dict]:
    """Composed once per process (virtual ranks share it) with Hydra, as the runner composes them."""
    from omegaconf import OmegaConf

    from bfexp.config import compose_shipped, group_options

    overrides = []
    for group, name in (("algorithm", algorithm), ("topology", topology)):
        if name is not None:
            allowed = group_options(group)
            if name not in allowed:
                raise ConfigError(f"{group}={name}; allowed: {', '.join(allowed)}")
            overrides.append(f"{group}={name}")
    cfg = compose_shipped("config", overrides)
    return {group: OmegaConf.to_container(cfg[group], resolve=True) for group in ("algorithm", "topology")}
