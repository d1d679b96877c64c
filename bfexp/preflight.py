"""Before any rank starts: the engine a job runs on (engine=auto's choice), whether this machine can run it,
and whether its ranks fit this machine's memory.

A job this machine cannot hold is refused here, in one line, instead of
failing minutes later: more ranks than the memory holds is the user's input
(ConfigError, exit 2); no mpiexec, no GPU, an unreachable host is the
environment's (LaunchError, exit 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bfexp.errors import ConfigError, LaunchError
from bfexp.launchers import Launcher, processor_slots

if TYPE_CHECKING:
    from bfexp.schema import Settings

__all__ = ["AUTO_READS", "available_memory", "check_engine", "check_even", "check_memory", "choose_engine",
           "memory_fits", "preflight", "resolve_engine", "runs_on"]

# The components whose nodes engine=auto's choice reads (``choose_engine``: whether the job stacks).
AUTO_READS = ("algorithm", "scaling", "model", "dataset", "optimizer", "heterogeneity")

# Memory one rank needs besides its model and data, measured here as the growth of a job's peak with its
# ranks (tests/test_memory.py holds the estimate within 2x of it): a process with torch and mpi4py imported
# (about 230 MB resident); a virtual rank's thread, engine and buffers (16 to 256 threads of the default job:
# 0.6 to 0.84 MB a rank, 0.2 of it its data); a stacked rank's slice of the batched program (500 to 8,000
# stacked ranks: 237 to 241 KB a rank, 0.2 of it its data). A rank holds its model about MODEL_COPIES times
# (parameters, gradients, the local optimizer's and the algorithm's buffers) and its data shard about
# DATA_COPIES times (the data set's arrays, the tensors made from them, a batch's copy).
PROCESS_RANK_BYTES = 250 * 2**20
THREAD_RANK_BYTES = 640 * 2**10
STACKED_RANK_BYTES = 96 * 2**10
MODEL_COPIES = 4
DATA_COPIES = 3


def available_memory() -> int | None:
    """Bytes of memory available for new processes here (Linux's MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def check_memory(engine_node: Any, ranks: int, launcher: Launcher, parameters: int = 0, element_bytes: int = 4,
                 data_bytes: int = 0) -> None:
    """The job's memory check (``memory_fits``): its engine node, ranks, launcher, model size and one rank's
    data shard in bytes. With no model and data (the plan's first check, before the topology is built) it
    refuses what the ranks alone cannot fit: ranks=10**7 is refused before anything is built for them."""
    from bfexp.comm import engine_facts

    engine = engine_facts(engine_node)
    ranks = int(ranks)
    here = ranks if not engine.processes else launcher.ranks_per_host(ranks)
    memory_fits(engine, ranks, here, parameters * element_bytes, data_bytes)


def rank_bytes(engine: Any, model_bytes: int = 0, data_bytes: int = 0) -> int:
    """One rank's memory on this machine (the module's figures): its kind's own, MODEL_COPIES of the model in
    host memory (a GPU rank keeps its model on the GPU), DATA_COPIES of its data shard."""
    own = PROCESS_RANK_BYTES if engine.processes else STACKED_RANK_BYTES if engine.stacked else THREAD_RANK_BYTES
    model = 0 if engine.device_type == "cuda" else MODEL_COPIES * model_bytes
    return own + model + DATA_COPIES * data_bytes


def memory_fits(engine: Any, ranks: int, here: int, model_bytes: int, data_bytes: int = 0) -> None:
    """Refuse (ConfigError: one line, exit 2) more ranks on this machine than its memory holds.

    ``here`` of the ``ranks`` ranks of ``engine`` (its class or facts) run on this machine, each about
    ``rank_bytes``; compared with MemAvailable. The refusal names the most ranks that fit.
    """
    per_rank = rank_bytes(engine, model_bytes, data_bytes)
    available = available_memory()
    if available is None or here * per_rank <= available:
        return
    kind = "processes" if engine.processes else "stacked ranks" if engine.stacked else "virtual ranks"
    fit = available // per_rank
    allowed = f"ranks <= {fit}" if fit else "a smaller model"
    if engine.processes:
        allowed += ", or engine=threads (virtual ranks share one process)"
    raise ConfigError(f"ranks={ranks} with engine={engine.name} needs about {_size(here * per_rank)} of memory "
                      f"({here} {kind} of about {_size(per_rank)} here) but {_size(available)} is available; "
                      f"allowed: {allowed}")


def check_engine(engine_node: Any, ranks: int, launcher: Launcher) -> None:
    """The job's preflight (``preflight``) from its engine node, ranks and launcher."""
    preflight(engine_node, int(ranks), launcher, int(engine_node.ranks_per_machine or 0))


def preflight(engine_spec: Any, ranks: int, launcher: Launcher, ranks_per_machine: int = 0) -> None:
    """Before any rank starts: the launcher's preflight (process ranks), and an engine this machine can run
    (LaunchError naming what is missing; a GPU engine needs a GPU per rank of a machine). ``engine_spec``:
    the engine's config node, a shipped option's name or a class path (bfexp.comm.engine_class)."""
    from bfexp.comm import engine_class

    engine = engine_class(engine_spec)
    per_machine: int | None = ranks_per_machine or None
    if engine.processes:
        launcher.check(ranks)
        if not launcher.on_this_machine:
            per_machine = launcher.ranks_per_host(ranks)
            if not ranks_per_machine:
                check_even(ranks, launcher)
    ok, reason = engine.available(ranks, per_machine)
    if not ok:
        raise LaunchError(f"engine={engine.name} cannot run here: {reason}")


def check_even(ranks: int, launcher: Launcher) -> None:
    """The engine numbers machines by rank // ranks per machine, so each machine must hold as many ranks:
    refuse a placement that gives them unequal shares (ConfigError, before any rank starts)."""
    placed = launcher.hosts(ranks)
    if len({n for _, n in placed}) > 1:
        shares = ", ".join(f"{h}:{n}" for h, n in placed)
        raise ConfigError(f"ranks={ranks} land on machines unequally ({shares}); allowed: the same number on "
                          "each machine (ranks a multiple of the slots per machine, equal slots), or set "
                          "engine.ranks_per_machine to emulate machines")


def choose_engine(engine: Any, settings: Settings, *, algorithm: Any, scaling: Any, model: Any, dataset: Any,
                  optimizer: Any, heterogeneity: Any) -> tuple[str, str]:
    """engine=auto: (engine, why), among the shipped engines by their facts (bfexp.comm.shipped_engine): the GPU one
    (nccl) when every rank has its own GPU; else the CPU one whose ranks are processes (mpi) while ranks <=
    processor slots x slots_factor; else the stacked one when the job stacks (bfexp.comm.stacked.check_job),
    else virtual ranks as threads. ``engine``: auto's node; ``settings``: the run's; then the nodes of the
    components that decide whether the job stacks."""
    import importlib.util

    from bfexp.comm import engine_class, shipped_engine

    ranks = settings.ranks
    parts = dict(algorithm=algorithm, scaling=scaling, model=model, dataset=dataset, optimizer=optimizer,
                 heterogeneity=heterogeneity)
    gpu_note = ""
    gpu, processes = shipped_engine("gpu"), shipped_engine("processes")
    if gpu is not None and importlib.util.find_spec("cupy") is not None:  # no CuPy: no GPU probe, no torch import
        ok, why = engine_class(gpu).available(ranks, engine.ranks_per_machine or None)
        if ok:
            return gpu, f"each of the {ranks} ranks has its own GPU"
        gpu_note = f"; not {gpu}: {why}"
    slots, factor = processor_slots(), float(engine.slots_factor)
    limit = f"{slots} processor slots x engine.slots_factor={factor:g} = {slots * factor:g}"
    if ranks <= slots * factor:
        return processes, f"ranks={ranks} fit {limit}{gpu_note}"
    threads = shipped_engine("threads")
    if threads is None or not runs_on(algorithm, threads, settings.throughput_only, scaling.modeled):
        return processes, f"ranks={ranks} exceed {limit}, but this algorithm needs a process per rank{gpu_note}"
    not_stacked = stacking_refusal(settings, **parts)
    if not_stacked is None:
        return shipped_engine("stacked"), (f"ranks={ranks} exceed {limit}, and the job stacks into one batched "
                                           f"program{gpu_note}")
    return threads, f"ranks={ranks} exceed {limit}; not stacked: {not_stacked}{gpu_note}"


def stacking_refusal(settings: Settings, *, algorithm: Any, scaling: Any, model: Any, dataset: Any, optimizer: Any,
                     heterogeneity: Any) -> str | None:
    """Why engine=stacked cannot run the job (its first refusal, one line), or None: what engine=auto asks
    before it picks virtual ranks as threads. The run's settings, then its components' nodes."""
    from bfexp.comm import engine_class, shipped_engine

    stacked = shipped_engine("stacked")
    if stacked is None:
        return "no stacked engine is shipped"
    if not runs_on(algorithm, stacked, settings.throughput_only, scaling.modeled):
        from bfexp.config import label

        return f"algorithm={label(algorithm)} is not stackable"
    try:
        from bfexp.comm.stacked import check_job
        from bfexp.config import build
        from bfexp.models import sample_shape

        engine_class(stacked)
        in_shape, classes = sample_shape(model, build(dataset, "dataset"))
        check_job(settings, in_shape, classes, model=model, optimizer=optimizer, dataset=dataset,
                  heterogeneity=heterogeneity)
    except ConfigError as e:
        return str(e)
    from bfexp.comm.stacked import threads_as_fast

    return threads_as_fast(model, in_shape, classes)


def runs_on(algorithm: Any, engine: Any, throughput_only: bool = False, modeled: bool = False) -> bool:
    """Whether the job's algorithm (its node) can run on an engine (a name, class path or node:
    bfexp.comm.engine_class; ddp needs one process per rank), in a ``throughput_only`` job on a ``modeled``
    cluster or not."""
    from bfexp.comm import engine_class
    from bfexp.config import target_of

    try:
        target_of(algorithm, "algorithm").check_run(
            engine_class(engine), throughput_only=bool(throughput_only), modeled=bool(modeled))
    except ConfigError:
        return False
    return True


def resolve_engine(engine: Any, settings: Settings, *, algorithm: Any, scaling: Any, model: Any, dataset: Any,
                   optimizer: Any, heterogeneity: Any) -> tuple[Any, str | None]:
    """engine=auto: the node of the engine it chooses (``choose_engine``'s arguments), and the sentence saying
    why; any other engine: its own node, and None. The caller (an entry point) runs the job on a copy of its
    config holding the chosen node. ``AUTO_READS``: the components whose nodes it takes."""
    from bfexp.comm import Auto

    if engine.name != Auto.name:
        return engine, None
    from bfexp.config import engine_config

    name, why = choose_engine(engine, settings, algorithm=algorithm, scaling=scaling, model=model, dataset=dataset,
                              optimizer=optimizer, heterogeneity=heterogeneity)
    return engine_config(engine, name), f"engine=auto chose {name}: {why}"
