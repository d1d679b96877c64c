"""The plan of one job: what runs where, decided once, by one function.

``make_plan(cfg)`` is the driver's whole check of a job before any rank starts,
and the one place its job-level facts are decided: the kind of job, the engine
(engine=auto's choice and why), the launcher and the machines, the graph the
rule runs on, the data set's split and sample shape, the model's size, the
steps the job runs, the notes for the user. It builds dry: the topology, the
data set's sizes (its files are read, no sample is loaded into a tensor), the
model on the meta device, the optimizer on one dummy parameter. A job that
cannot run is refused here, in one line (ConfigError exit 2, LaunchError exit 3).

The driver writes the plan's facts beside the job's config (``plan.json``);
every rank reads them (``Plan.read``) and its build (``bfexp.worker.build``)
must come out the same: the same sample shape, classes and parameters per
rank. A data set whose files changed between the plan and the ranks, or a
build that differs from its dry form, ends the job with the difference named
instead of training something nobody planned.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from bfexp.schema import Settings

__all__ = ["Plan", "PlanMismatch", "make_plan"]

PLAN = "plan.json"  # in the run folder, beside config.yaml


class PlanMismatch(RuntimeError):
    """A rank built something other than what the driver planned (a bug, or files changed under the job)."""


@dataclass(frozen=True)
class Plan:
    """One job's facts, decided by ``make_plan``. ``cfg`` (engine=auto resolved) and ``launcher`` serve the
    driver; the rest is plain data that the ranks read back from ``plan.json``."""

    kind: str  # train | throughput | modeled (bfexp.config.job_kind)
    ranks: int
    steps: int | None  # None: a data set that cannot say before its ranks load it (epochs)
    engine: str | None  # the engine's name; None for a modeled cluster (no rank starts)
    engine_choice: str | None  # engine=auto's sentence
    machines: int
    algorithm: str
    topology: str
    in_shape: tuple[int, ...]
    classes: int
    parameters: int  # of one rank's model
    notes: tuple[str, ...] = ()
    # One sample's forward pass through one rank's model, in FLOP (a multiply-add counts 2: torch's
    # FlopCounterMode), counted by the dry build; 0 in a plan.json written before it was.
    forward_flop_per_sample: int = 0
    cfg: Any = field(default=None, compare=False, repr=False)
    launcher: Any = field(default=None, compare=False, repr=False)

    FACTS = ("kind", "ranks", "steps", "engine", "engine_choice", "machines", "algorithm", "topology", "in_shape",
             "classes", "parameters", "notes", "forward_flop_per_sample")

    def facts(self) -> dict[str, Any]:
        """The plan as plain JSON data (what the ranks read)."""
        out = {k: v for k, v in asdict(replace(self, cfg=None, launcher=None)).items() if k in self.FACTS}
        out["in_shape"], out["notes"] = list(self.in_shape), list(self.notes)
        return out

    def write(self, run_dir: Path) -> None:
        from bfexp import results

        results.write_text_atomic(Path(run_dir) / PLAN, json.dumps(self.facts(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> "Plan | None":
        """The plan the driver wrote for this run folder; None where no driver planned it (a job started by
        hand, an older folder)."""
        from bfexp.files import MiB, read_file

        try:  # bounded: a plan.json that is a link to /dev/zero or a FIFO is no plan
            facts = json.loads(read_file(Path(run_dir) / PLAN, MiB))
        except (OSError, ValueError):
            return None
        facts["in_shape"], facts["notes"] = tuple(facts["in_shape"]), tuple(facts["notes"])
        return cls(**{k: facts[k] for k in cls.FACTS if k in facts})

    def confirm(self, in_shape: tuple[int, ...], classes: int, parameters: int) -> None:
        """A rank's build against the plan: PlanMismatch naming what differs."""
        built = {"in_shape": tuple(in_shape), "classes": int(classes), "parameters": int(parameters)}
        planned = {"in_shape": self.in_shape, "classes": self.classes, "parameters": self.parameters}
        wrong = [f"{k} {planned[k]} planned, {built[k]} built" for k in built if built[k] != planned[k]]
        if wrong:
            raise PlanMismatch(f"this rank's build differs from the driver's plan: {'; '.join(wrong)} (did the data "
                               "set's files change after the job was checked?)")


def make_plan(cfg: Any, *, launcher: Any = None, here: bool = True, preflight: bool = True,
              placed: Callable[[Any, Any], None] | None = None) -> Plan:
    """The job's plan, checked: engine=auto resolved, the launcher built, this machine's preflight (``preflight``:
    the launcher's check, the engine's availability, where the ranks land; a sweep checks its points without it),
    the dry build. ``here``: the ranks run on this machine
    (its memory and cores are checked). ``placed(engine, launcher)`` (the engine's node, the launcher) is called
    as soon as the two are known, before the slow part (torch's import, the dry build): the driver starts its
    ranks there. The entry point of the driver's checks: it makes the run's Settings and hands each check the
    sections it reads."""
    from omegaconf import open_dict

    from bfexp.config import Settings, job_kind, launcher_of
    from bfexp.preflight import AUTO_READS, check_engine, check_memory, resolve_engine

    settings = Settings.of(cfg)
    kind, choice = job_kind(settings.throughput_only, cfg.scaling), None
    if kind != "modeled":
        engine, choice = resolve_engine(cfg.engine, settings, **{k: cfg.get(k) for k in AUTO_READS})
        if choice:  # engine=auto: the job runs on a copy of its config with the engine it chose
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.engine = engine
        launcher = launcher or launcher_of(cfg.get("launcher"))
        check_placement(cfg.engine, launcher, cfg.get("launcher"))
        if here:  # the ranks alone, before their topology or data is built: ranks=10**7 ends here
            check_memory(cfg.engine, int(settings.ranks), launcher)
        if placed is not None:
            placed(cfg.engine, launcher)
        if preflight:
            check_engine(cfg.engine, int(settings.ranks), launcher)  # e.g. engine=nccl without a GPU; imports torch
    plan = dry_build(settings, kind, launcher, here, algorithm=cfg.algorithm, topology=cfg.topology, model=cfg.model,
                     dataset=cfg.dataset, optimizer=cfg.optimizer, engine=cfg.engine, scaling=cfg.scaling,
                     heterogeneity=cfg.get("heterogeneity"), launcher_node=cfg.get("launcher"))
    machines, notes = 1, list(plan.notes)
    if kind != "modeled" and preflight:  # where the ranks land (a sweep's points are checked before they run)
        machines = 1 if launcher.on_this_machine else len(launcher.hosts(int(settings.ranks)))
        notes += contention(cfg.engine, int(settings.ranks), launcher, machines)
    return replace(plan, engine=cfg.engine.name if kind != "modeled" else None, engine_choice=choice,
                   machines=machines, notes=tuple(notes), cfg=cfg, launcher=launcher)


def check_placement(engine: Any, launcher: Any, launcher_node: Any) -> None:
    """A launcher that starts process ranks on other machines with an engine whose ranks are threads of this
    process (launcher=emulated engine=threads ran here and its summary said emulated): ConfigError."""
    from bfexp.comm import engine_facts
    from bfexp.components import label
    from bfexp.errors import ConfigError

    if launcher.on_this_machine or engine_facts(engine).processes:
        return
    name = label(launcher_node) if launcher_node is not None else type(launcher).__name__
    raise ConfigError(f"launcher={name} starts process ranks on its machines, and engine={engine.name} runs the "
                      f"ranks as threads of this process; allowed: engine=mpi (or auto) with launcher={name}, or "
                      f"launcher=local for engine={engine.name}")


def contention(engine: Any, ranks: int, launcher: Any, machines: int) -> list[str]:
    """More CPU ranks than cores: what the job measures is contention (a note). ``engine``: the engine's node."""
    from bfexp.comm import engine_class
    from bfexp.scaling import contention_note, processor_count

    note = contention_note(launcher.ranks_per_host(ranks) if machines > 1 else ranks, processor_count(),
                           engine_class(engine).device_type == "cpu", launcher.cpu_quotas(ranks))
    return [note] if note else []


def _guarded(group: str, target: Any, call: Callable[[], Any]) -> Any:
    """A foreign class's (torch's, the user's) ValueError or TypeError about its arguments: one line."""
    from bfexp.errors import ConfigError

    try:
        return call()
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError) or str(getattr(target, "__module__", "")).startswith("bfexp."):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{group}._target_={target.__module__}.{target.__qualname__} refused its options: "
                          f"{type(e).__name__}: {first}") from None


def dry_build(settings: Settings, kind: str, launcher: Any, here: bool, *, algorithm: Any, topology: Any,
              model: Any, dataset: Any, optimizer: Any, engine: Any, scaling: Any, heterogeneity: Any,
              launcher_node: Any) -> Plan:
    """Everything the ranks will build, as cheaply as possible, each component checked by its own
    constructor from its node: the topology, the algorithm's options, requirements and engine, the data set
    (its files), the model on the meta device, the optimizer on one dummy parameter. ``launcher``: the built
    launcher (None for a modeled cluster); ``launcher_node``: its node (where process ranks land)."""
    import torch

    from bfexp.config import build, check_node, check_optimizer_options, label
    from bfexp.errors import number_in
    from bfexp.models import check_fits, forward_flop_per_sample, sample_shape
    from bfexp.preflight import check_memory
    from bfexp.summary import topology_ranks_per_machine
    from bfexp.torch_internals import defer_dynamo

    defer_dynamo()  # torch.optim would import torch._dynamo (a second) only to mark code for a compiler
    modeled = kind == "modeled"
    placed = topology_ranks_per_machine(engine, int(settings.ranks), modeled=modeled, scaling_node=scaling,
                                        launcher=launcher_node)
    notes, steps = _algorithm(settings, modeled, algorithm=algorithm, topology=topology, engine=engine,
                              ranks_per_machine=placed)
    dataset_target, _ = check_node(dataset, "dataset")
    data = _guarded("dataset", dataset_target, lambda: build(dataset, "dataset"))
    samples = 0.0  # a rank's shard, on average (for the memory check)
    if not settings.throughput_only:  # batches and held-out samples against what the data set holds
        more, steps, samples = check_data(settings, data, label(dataset))
        notes.extend(more)
    model_target, _ = check_node(model, "model", runtime=("in_shape", "in_features", "classes"))
    in_shape, classes = _guarded("model", model_target, lambda: sample_shape(model, data))
    fed = (in_shape, classes) if settings.throughput_only else data.sample_shape()  # training: the data's samples
    fits = dict(data=f"dataset={label(dataset)}", tokens=bool(getattr(data, "tokens", False)))
    parameters = _guarded("model", model_target, lambda: check_fits(model, *fed, **fits))
    flop = forward_flop_per_sample(model, *fed, **fits)  # from check_fits's forward, counted
    finfo = torch.finfo(getattr(torch, settings.dtype))  # e.g. lr=1e308: not a float32, inf on every rank
    number_in("lr", settings.lr, low=0, low_open=True, high=finfo.max, note=f"(the largest {settings.dtype})")
    if not modeled and here:  # e.g. ranks=100000 engine=mpi: refused here, not by the machine running out of memory
        sample_bytes = 4 * math.prod(int(d) for d in fed[0]) + 8  # float32 (or int) features and a label
        check_memory(engine, int(settings.ranks), launcher, int(parameters), getattr(torch, settings.dtype).itemsize,
                     int(samples * sample_bytes))
    optimizer_target, optimizer_options = check_node(optimizer, "optimizer", runtime=("params",))
    check_optimizer_options(optimizer_options)
    _guarded("optimizer", optimizer_target,
             lambda: build(optimizer, "optimizer")([torch.zeros(1, requires_grad=True)]))
    _engine_and_cluster(settings, modeled, tuple(fed[0]), int(fed[1]), flop, engine=engine, model=model,
                        optimizer=optimizer, dataset=dataset, heterogeneity=heterogeneity, scaling=scaling)
    return Plan(kind=kind, ranks=int(settings.ranks), steps=steps, engine=None, engine_choice=None, machines=1,
                algorithm=label(algorithm), topology=label(topology), in_shape=tuple(int(d) for d in fed[0]),
                classes=int(fed[1]), parameters=int(parameters), notes=tuple(notes),
                forward_flop_per_sample=int(flop))


def _algorithm(settings: Settings, modeled: bool, *, algorithm: Any, topology: Any, engine: Any,
               ranks_per_machine: int) -> tuple[list[str], int | None]:
    """The topology (its node, on machines of ``ranks_per_machine`` ranks), the algorithm's options (its node)
    and kind of job on the engine (its node), and the graph its rule runs on: the notes (e.g. a substituted
    topology) and the steps as far as the run's settings say (``epochs``: the data set counts)."""
    from bfexp.assembly import resolve
    from bfexp.comm import engine_class
    from bfexp.config import RUNTIME, check_node
    from bfexp.errors import ConfigError
    from bfexp.topology import build_topology
    from bfexp.watchdog import PROCESS_ONLY_MODES

    notes: list[str] = []
    steps = int(settings.steps) if settings.epochs is None else None
    graph = build_topology(topology, settings.ranks, ranks_per_machine)
    rule, options = check_node(algorithm, "algorithm", runtime=("optimizer", "engine", "topology", "model"))
    rule.check_options(**options)
    if not modeled:
        check_node(engine, "engine", runtime=RUNTIME["engine"])  # mpi, nccl: their class, now torch is here
        engine_type = engine_class(engine)
        rule.check_run(engine_type, throughput_only=bool(settings.throughput_only), modeled=modeled)
        if settings.fail_rank is not None and settings.fail_mode in PROCESS_ONLY_MODES and engine_type.virtual:
            raise ConfigError(f"fail_mode={settings.fail_mode} needs a process per rank (engine={engine.name} runs "
                              "ranks as threads of this process); allowed: engine=mpi, or fail_mode=raise or hang")
    if rule.uses_topology:  # e.g. exact diffusion on exp2's undirected form; diloco averaging by allreduce
        notes.extend(resolve(rule, graph, options)[1])  # reads no graph: any graph serves
    return notes, steps


def _engine_and_cluster(settings: Settings, modeled: bool, in_shape: tuple[int, ...], classes: int,
                        forward_flop: int, *, engine: Any, model: Any, optimizer: Any, dataset: Any,
                        heterogeneity: Any, scaling: Any) -> None:
    """What one batched program cannot hold (engine=stacked), stragglers' ranges, a modeled cluster's speed
    (declared, or its device's over ``forward_flop``, a sample's); from the components' nodes."""
    from bfexp.comm import engine_class
    from bfexp.config import build, label
    from bfexp.errors import ConfigError
    from bfexp.scaling import missing_speed_message, rank_speed

    if not modeled and engine_class(engine).stacked:  # its optimizer, model, options
        from bfexp.comm.stacked import check_job

        check_job(settings, in_shape, classes, model=model, optimizer=optimizer, dataset=dataset,
                  heterogeneity=heterogeneity)
    if heterogeneity is not None:  # stragglers: the constructor checks the ranges
        build(heterogeneity, "heterogeneity")
    if modeled and rank_speed(scaling, label(model), forward_flop) is None:
        raise ConfigError(missing_speed_message(scaling, label(model)))


def check_data(settings: Settings, dataset: Any, name: str) -> tuple[list[str], int | None, float]:
    """batch_size and eval_subset against the data set's split at this job's ranks (``Dataset.sizes``; its
    files are read here, so a malformed one is named before any rank starts). A batch larger than every
    rank's shard is refused: no rank could draw it, and the run would not be the one asked for (torch's
    DataLoader silently shortens it). Larger than some shards only (an uneven split): those ranks draw their
    whole shard per step, and a note says so. Returns the notes and the steps the job runs (``epochs``
    counts them from the split; None: a data set that cannot say before its ranks load it) and a rank's
    samples on average (0 where the data set cannot say). ``dataset``: the
    built data set; ``name``: its option's (the messages')."""
    from bfexp.config import total_steps
    from bfexp.errors import ConfigError

    try:
        shards, held_out = dataset.sizes(int(settings.ranks), int(settings.seed))
    except NotImplementedError:  # a user's data set that overrides load() only: its ranks say
        return [], None if settings.epochs is not None else int(settings.steps), 0.0
    steps = total_steps(settings, sum(shards), int(settings.ranks))
    where = f"dataset={name} at ranks={settings.ranks}"
    if settings.batch_size > max(shards):
        raise ConfigError(f"batch_size={settings.batch_size} exceeds every rank's shard ({max(shards)} samples at "
                          f"most with {where}); allowed: an integer in [1, {max(shards)}]")
    short = [r for r, n in enumerate(shards) if n < settings.batch_size]
    if settings.eval_subset is not None and settings.eval_subset > held_out:
        raise ConfigError(f"eval_subset={settings.eval_subset} exceeds the {held_out} held-out samples of {where}; "
                          f"allowed: an integer in [1, {held_out}] or null (all of them)")
    samples = sum(shards) / max(1, len(shards))
    if not short:
        return [], steps, samples
    return [f"batch_size={settings.batch_size} exceeds the shard of rank(s) {', '.join(map(str, short[:8]))}"
            f"{' ...' if len(short) > 8 else ''} ({min(shards)} samples at least, {where}): they train on their "
            "whole shard each step"], steps, samples
