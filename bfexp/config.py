"""The top-level schema, the cross-group checks, and how a config node becomes an object.

Two kinds of config group:

* Components (algorithm, topology, model, dataset, optimizer, engine, logger,
  launcher, heterogeneity, and algorithm/compressor): each option is a YAML with
  ``_target_`` (algorithms and optimizers ``_partial_``), and the target's
  constructor signature is its schema. ``check_node`` checks a node's keys and
  value types against that signature before the object is built (Hydra's struct
  mode already refuses unknown keys at compose time; ``+key=...`` gets here), and
  the constructor checks ranges. A user's own class plugs in with
  ``model._target_=mypkg.Net`` or a YAML in their own config dir. A node may also
  state its class's ``name`` (engine and logger nodes do: summaries and the driver
  read ``cfg.engine.name``); it must then be that name.
* Data-only groups (scaling): dataclasses below, stored in Hydra's ConfigStore
  under ``schema/<group>``; each conf/<group>/<option>.yaml pulls its own in, so a
  misspelt key or a wrong type fails at compose time.

``validate`` checks the top level, the data-only groups and what ties groups
together (ranks per machine against the ranks, the scaling config's machines);
ConfigError (bfexp.errors) is the user's fault: one line, exit 2. This module
imports only the standard library, Hydra and OmegaConf: the CLI needs it for
``--help`` and completion, which must stay instant.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import math
import threading
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Literal, Mapping, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from bfexp.checkpoint import job_folder
from bfexp.errors import ConfigError, number_in
from bfexp.launchers.srun import nodes_for, tasks_per_node

__all__ = ["Config", "ConfigError", "build", "check_node", "compose_shipped", "group_options", "label", "node_options",
           "option_node", "register_configs", "target_of", "validate"]

# What bfexp (or a script) passes when it builds each component: a YAML may not set these.
RUNTIME: dict[str, tuple[str, ...]] = {
    "algorithm": ("optimizer", "engine", "topology", "model"),
    "optimizer": ("params",),
    "topology": ("size", "ranks_per_machine"),
    "model": ("in_shape", "in_features", "classes"),
    "dataset": (),
    "heterogeneity": (),
    "launcher": (),
    # a virtual rank's world and number; an MPI engine's communicator and whether $BFEXP_TIMELINE traces it
    "engine": ("world", "rank", "comm", "timeline_from_env", "size"),
    "logger": (),
}
Dtype = Literal["float32", "float64", "float16", "bfloat16"]
FailMode = Literal["raise", "kill", "freeze", "hang"]


# ------------------------------------------------------------------ components: node -> object


def node_options(node: Any) -> dict[str, Any]:
    """A component node's options: its keys minus Hydra's ``_target_``/``_partial_``/... ."""
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    return {k: v for k, v in data.items() if not (k.startswith("_") and k.endswith("_"))}


def group_options(group: str) -> list[str]:
    """The options shipped in a config group (``engine``, ``algorithm/compressor``, ...): its YAML names, sorted."""
    from bfexp.conf import options

    return options(group)


_compose_lock = threading.Lock()


def compose_shipped(config_name: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose a config of the shipped config module (``config``, ``algorithm/compressor/top_k``) with Hydra,
    one caller at a time (virtual ranks compose from their threads): in bfexp's own Hydra run (the driver and
    its virtual ranks) by that run's Hydra, elsewhere (an MPI rank, a script) by one set up for it."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    with _compose_lock:
        register_configs()
        if GlobalHydra.instance().is_initialized():
            return compose(config_name=config_name, overrides=list(overrides))
        with initialize_config_module(config_module="bfexp.conf", version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))


def option_node(group: str, option: str, hint: str = "") -> dict[str, Any]:
    """A shipped option of a config group as Hydra composes it (``+group=option``): its node as a new plain
    dict, for an option named where a node is expected (``algorithm.compressor=qsgd``). A name that is
    none: ConfigError naming the options (and ``hint``, how else to give one)."""
    allowed = group_options(group)
    if option not in allowed:
        raise ConfigError(f"{group.replace('/', '.')}={option}; allowed: {', '.join(allowed)}{' ' + hint if hint else ''}")
    return copy.deepcopy(_composed_option(group, option))


@functools.lru_cache(maxsize=None)
def _composed_option(group: str, option: str) -> dict[str, Any]:
    """Composed once per process (virtual ranks share it)."""
    node = OmegaConf.to_container(OmegaConf.select(compose_shipped(f"{group}/{option}"), group.replace("/", ".")),
                                  resolve=True)
    assert isinstance(node, dict)
    return node


def target_of(node: Any, key: str) -> Callable[..., Any]:
    """The class or function a node's ``_target_`` names (imported)."""
    path = node.get("_target_") if isinstance(node, (Mapping, DictConfig)) else None
    if not path:
        raise ConfigError(f"{key} has no _target_; allowed: a class path, e.g. {key}._target_=mypkg.MyClass")
    module_name, _, attr = str(path).rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name) if module_name else None
        for part in [attr] if obj is not None else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}._target_={path!r} cannot be imported ({type(e).__name__}: {e}); "
                          "allowed: an importable class or function") from None
    if obj is None or not callable(obj):
        raise ConfigError(f"{key}._target_={path!r} is not callable; allowed: a class or function")
    return obj


def label(node: Any) -> str:
    """What a component is called in summaries: its class's ``name``, else the class name."""
    path = str(node.get("_target_", "")) if node is not None else ""
    try:
        target = target_of(node, "component")
    except ConfigError:
        return path.rpartition(".")[2] or "?"
    return str(getattr(target, "name", None) or getattr(target, "__name__", path))


def signature_schema(target: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], dict[str, Any], bool]:
    """(keyword parameters, their resolved type hints, whether any key is accepted).

    A class whose ``__init__`` forwards ``**kwargs`` to its base shows the base's
    parameters too (walking the MRO), so a subclass need not repeat them.
    """
    functions = [c.__init__ for c in inspect.getmro(target) if "__init__" in vars(c)] if inspect.isclass(target) else [target]
    params: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    open_ended = True
    for fn in functions:
        if fn is object.__init__:
            break
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature
            break
        try:
            hints.update({k: v for k, v in typing.get_type_hints(fn).items() if k not in hints})
        except Exception:  # unresolvable annotations: check names only
            pass
        open_ended = False
        for name, p in sig.parameters.items():
            if name == "self" or p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
                continue
            if p.kind == p.VAR_KEYWORD:
                open_ended = True
                continue
            params.setdefault(name, p)
        if not open_ended:
            break
    return params, hints, open_ended


def describe(annotation: Any) -> str:
    """What a type annotation allows, in the words of an error message."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return f"a list of {describe(args[0]).split(' ', 1)[-1]}s" if args else "a list"
    if origin in (dict, typing.Mapping) or annotation is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(annotation, str(annotation))


def type_ok(value: Any, annotation: Any) -> bool:
    """Whether a config value fits a parameter's annotation (unknown annotations accept anything)."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return isinstance(value, (list, tuple)) and (not args or all(type_ok(v, args[0]) for v in value))
    if origin in (dict, typing.Mapping) or annotation is dict:
        return isinstance(value, dict)
    if inspect.isclass(annotation) and origin is None:  # e.g. torch.Tensor: no config value is one
        return isinstance(value, annotation)
    return True


# What a group's `_target_` must be, checked before it is called: the base classes (by qualified name, so
# nothing is imported for the check) and whether a function (that returns one) may stand in for a class.
KINDS: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "model": (("torch.nn.modules.module.Module",), True, "a torch.nn.Module subclass or a function returning one"),
    "optimizer": (("torch.optim.optimizer.Optimizer",), True,
                  "a torch.optim.Optimizer subclass or a function returning one"),
    "dataset": (("bfexp.data.Dataset",), False, "a subclass of bfexp.data.Dataset"),
    "algorithm": (("bfexp.algorithms.base.DecentralizedOptimizer",), False,
                  "a subclass of bfexp.algorithms.DecentralizedOptimizer"),
    "topology": (("bfexp.topology.base.Topology",), True,
                 "a subclass of bfexp.topology.Topology or a function returning one"),
    "launcher": (("bfexp.launchers.base.Launcher",), False, "a subclass of bfexp.launchers.Launcher"),
    "logger": (("bfexp.loggers.Logger",), False, "a subclass of bfexp.loggers.Logger"),
}


def check_kind(target: Any, key: str) -> None:
    """Refuse, before it is called, a `_target_` that is not the kind of thing its group builds
    (``model._target_=bfexp.data.Digits``, ``dataset._target_=os.getcwd``)."""
    if key not in KINDS:
        return
    bases, functions, allowed = KINDS[key]
    if inspect.isclass(target):
        ok = any(f"{c.__module__}.{c.__qualname__}" in bases for c in inspect.getmro(target))
    else:
        ok = functions and (inspect.isfunction(target) or inspect.ismethod(target))
    if not ok:
        what = f"the class {target.__module__}.{target.__qualname__}" if inspect.isclass(target) else \
            f"{type(target).__name__} {getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"
        raise ConfigError(f"{key}._target_ names {what}, not a {key}; allowed: {allowed}")


# The largest seed: torch's generators take a signed 64-bit seed, and ranks and probes add small offsets to it.
SEED_MAX = 2**62


def check_seed(key: str, value: Any) -> int:
    """A seed: an integer in [0, 2**62] (a larger one overflows torch's generator on every rank)."""
    number_in(key, value, low=0, integer=True)
    if value > SEED_MAX:
        raise ConfigError(f"{key}={value}; allowed: an integer in [0, 2**62] (torch's generators take 64 bits)")
    return int(value)


def check_node(node: Any, key: str, runtime: Iterable[str] = ()) -> tuple[Callable[..., Any], dict[str, Any]]:
    """Check a component node against its target's signature; returns (target, options).

    ``runtime`` names the arguments bfexp passes when it builds the object (the
    rank count, the model's input shape, ...): a YAML may not set them. Raises
    ConfigError naming ``key.<option>`` for an unknown key or a value of the
    wrong type, with what is allowed.
    """
    target = target_of(node, key)
    check_kind(target, key)
    options = node_options(node)
    params, hints, open_ended = signature_schema(target)
    own = getattr(target, "name", None)
    if "name" in options and "name" not in params and isinstance(own, str) and own:  # what the node is called
        if options.pop("name") != own:
            raise ConfigError(f"{key}.name={node.get('name')!r}; allowed: {own} (the name of {node.get('_target_')})")
    runtime = set(runtime)
    allowed = [n for n in params if n not in runtime]
    for name, value in options.items():
        if name in runtime:
            raise ConfigError(f"{key}.{name} is given by bfexp at run time; allowed keys: {', '.join(allowed) or 'none'}")
        if name not in params:
            if open_ended:
                continue
            raise ConfigError(f"unknown key '{key}.{name}'; allowed: {', '.join(allowed) or 'none'}")
        annotation = hints.get(name, params[name].annotation)
        if not type_ok(value, annotation):
            raise ConfigError(f"{key}.{name}={value!r}; allowed: {describe(annotation)}")
        if name == "seed" and value is not None:  # every component's seed, as the top level's
            check_seed(f"{key}.seed", value)
    return target, options


def build(node: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """Check a component node (``check_node``), then instantiate it the Hydra way with the run-time arguments.

    ``key`` is the group (algorithm, optimizer, ...; RUNTIME says what bfexp passes
    it). ``_partial_`` nodes (algorithms, optimizers) come back as a partial that
    takes the rest. Containers reach the constructor as plain lists and dicts. The
    constructor is called here, not inside Hydra, so its own exceptions (a
    ConfigError naming a bad value) reach the caller as they are.
    """
    import functools

    from hydra.utils import instantiate

    _, options = check_node(node, key, runtime=set(RUNTIME.get(key, ())) | set(kwargs))
    if "name" in node and "name" not in options:  # the class's name, stated by the node: not an argument
        node = {k: v for k, v in node.items() if k != "name"}
    factory = instantiate(node, _partial_=True, _convert_="all")
    if node.get("_partial_", False):
        return functools.partial(factory, *args, **kwargs)
    return factory(*args, **kwargs)


# The domains of the options torch's optimizers share. torch checks some of them (and names no
# key), others not at all (momentum=1.5 runs and diverges); a user's own optimizer with these
# keys means the same by them.
OPTIMIZER_RANGES: dict[str, dict[str, Any]] = {
    "lr": {"low": 0, "low_open": True},
    "momentum": {"low": 0, "high": 1, "high_open": True},
    "dampening": {"low": 0, "high": 1},
    "weight_decay": {"low": 0},
    "eps": {"low": 0, "low_open": True},
    "alpha": {"low": 0, "high": 1},
    "lr_decay": {"low": 0},
    "initial_accumulator_value": {"low": 0},
}


def check_optimizer_options(options: Mapping[str, Any]) -> None:
    """Raise ConfigError (``optimizer.<key>=<value>; allowed: ...``) for a shared optimizer option out of its domain."""
    for key, value in options.items():
        if key in OPTIMIZER_RANGES and value is not None:
            number_in(f"optimizer.{key}", value, **OPTIMIZER_RANGES[key])
        elif key == "betas" and value is not None:
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise ConfigError(f"optimizer.betas={value}; allowed: two numbers in [0, 1)")
            for i, beta in enumerate(value):
                number_in(f"optimizer.betas[{i}]", beta, low=0, high=1, high_open=True)


# ------------------------------------------------------------------ scaling
@dataclass
class ScalingConfig:
    """A cluster the cost model (bfexp/costmodel.py) prices a training step on.

    Each conf/scaling/<option>.yaml cites the source of every figure it declares.
    """

    name: str = MISSING
    # true: this is a cluster that is not here; its modeled figures headline
    # summary.json (time_source=modeled) beside what was measured on this machine.
    modeled: bool = True
    # Ranks (GPUs) per machine; 0 = every rank on one machine.
    ranks_per_machine: int = 0
    # Inside a machine (NVLink, shared memory): seconds per message, GB/s (1e9 bytes/s) per rank.
    intra_latency_s: float = 1e-6
    intra_bandwidth_gbyte_per_s: float = 10.0
    # Between machines (one network card): seconds per message, GB/s per card.
    inter_latency_s: float = 1e-5
    inter_bandwidth_gbyte_per_s: float = 1.0
    # true: a machine's ranks share one card; false: each rank has its own.
    nic_shared: bool = True
    # How fast a rank combines received data with its own (GB/s).
    reduce_gbyte_per_s: float = 10.0
    # Between machines over TCP on CPUs: GB/s at which one core moves bytes through a rank's network stack
    # (the kernel's copies of what it sends and receives), a stage of the same pipeline as the wire and the
    # switch (the slowest paces a transfer); 0: no such cost (RDMA, GPUDirect, or not modeled).
    inter_stack_gbyte_per_s: float = 0.0
    # GB/s the network between machines forwards in all, every machine's flows together (a switch that is
    # not non-blocking: the emulated cluster's hosts share one kernel); 0: no such limit.
    switch_gbyte_per_s: float = 0.0
    # true: ranks are CPU processes sharing this machine's cores (copies slow down past one rank per core).
    shares_cores: bool = False
    # The cores a machine's ranks share (may be a fraction: a CPU quota); null: this machine's processors.
    cores: Optional[float] = None
    # The baseline's allreduce: ring (flat) or hierarchical (inside machines, then across).
    allreduce: str = "ring"
    # Share of a step's compute that is the backward pass, which communication can hide behind.
    backward_fraction: float = 0.667
    # The figures above at the fast and slow ends of their calibration: {fast: {figure: value, ...}, slow: {...}},
    # any of intra_latency_s, intra_bandwidth_gbyte_per_s, inter_latency_s, inter_stack_gbyte_per_s,
    # reduce_gbyte_per_s, switch_gbyte_per_s. The modeled interval then spans the model at both ends as well
    # as at the compute speed's (a calibration measured here, whose exchanges vary from call to call:
    # scripts/check_costmodel.py writes them; on the command line +scaling.calibration_ends.fast.<figure>=...).
    # Empty: the figures are exact.
    calibration_ends: Dict[str, Any] = field(default_factory=dict)  # Any: OmegaConf refuses an int in nested floats
    # true: price the wait for the slowest rank. An exchange that waits on k ranks (an allreduce: all of
    # them; a neighbor exchange: a rank and its in-neighbors) starts after the slowest of k draws of the
    # single-rank reference's step times, not one (costmodel.straggler_wait_s). Only for ranks that run
    # where the reference ran (scaling=emulated): this machine's jitter is not a modeled cluster's.
    straggler_wait: bool = False
    # Training samples per second of ONE rank, by model name (compute only, no
    # communication); models not listed use the measured single-rank reference.
    compute_samples_per_s: Dict[str, float] = field(default_factory=dict)
    # Single-rank reference (the denominator of scaling efficiency): timed rounds of the
    # job's step on ONE rank (its wrapper, communication on the single-rank path), each
    # paired with a plain torch step; measured rounds are interleaved with training.
    reference_steps: int = 30
    # cached: reuse a reference of the same key taken at a load average within
    # reference_load_margin of now (a 1-rank job is its own reference: its own steps,
    # stored for the larger jobs); fresh: measure it in every job.
    reference: str = "cached"
    # Runnable processes (1-minute load average) the load may have moved since a cached reference
    # (on a shared machine the load swings by a few all the time; re-measuring stalls every rank).
    reference_load_margin: float = 4.0
    # torch threads of the reference; null = what a 1-rank job gets here (every core).
    reference_threads: Optional[int] = None
    # Where references are cached (one file per key: model, optimizer, wrapper, batch, dtype,
    # device, threads): "auto" = $BFEXP_CACHE_DIR, else $XDG_CACHE_HOME/bfexp, else ~/.cache/bfexp;
    # null = no cache.
    reference_cache: Optional[str] = "auto"


@dataclass
class LocalScalingConfig(ScalingConfig):
    """This machine, measured; link figures from scripts/calibrate_comm.py."""

    name: str = "local"
    modeled: bool = False
    shares_cores: bool = True


@dataclass
class EmulatedScalingConfig(ScalingConfig):
    """The emulated cluster (launcher=emulated), measured; its links and quota from the launcher."""

    name: str = "emulated"
    modeled: bool = False
    shares_cores: bool = True


@dataclass
class V100ClusterConfig(ScalingConfig):
    name: str = "v100_cluster"


@dataclass
class H100ClusterConfig(ScalingConfig):
    name: str = "h100_cluster"


@dataclass
class Ethernet10GConfig(ScalingConfig):
    name: str = "ethernet_10g"


# ------------------------------------------------------------------ top level
@dataclass
class Config:
    """Top level. conf/config.yaml picks one option per group on top of this."""

    # Components: `_target_` nodes whose constructors are their schema.
    algorithm: Any = MISSING
    topology: Any = MISSING
    model: Any = MISSING
    dataset: Any = MISSING
    optimizer: Any = MISSING
    # How process ranks start (bfexp.launchers): a `_target_` node, conf/launcher/.
    launcher: Any = MISSING
    # The engine its ranks run (bfexp.comm; auto: chosen per job), a `_target_` node, conf/engine/.
    engine: Any = MISSING
    # A data-only group: the dataclasses above.
    scaling: Any = MISSING
    # What the driver does with the metrics stream (bfexp.loggers): a `_target_` node, conf/logger/.
    logger: Any = MISSING
    # Stragglers (bfexp.heterogeneity): a `_target_` node, conf/heterogeneity/.
    heterogeneity: Any = MISSING

    ranks: int = 4
    seed: int = 0
    # Training length: `epochs` (over each rank's shard) wins over `steps` when set.
    steps: int = 200
    epochs: Optional[int] = None
    # Train for a time budget: each rank trains until this many seconds of its training time have passed
    # (measured on process ranks, simulated on virtual ranks); `steps` (or `epochs`) is then an upper
    # bound. Synchronous algorithms stop where the budget ends, agreed collectively; asynchronous ones
    # run as many steps as each rank's speed allows, with no lockstep (docs/how-to/async-and-stragglers.md). null: no budget.
    budget_s: Optional[float] = None
    # Under budget_s, asynchronous runs evaluate each rank's model every this many seconds of its own
    # training time (and the ranks' average model at those times, where it is cheap); null: budget_s / 20.
    eval_every_s: Optional[float] = None
    batch_size: int = 32
    # The local optimizer's learning rate (conf/optimizer/*.yaml read it as ${lr}).
    lr: float = 0.1
    dtype: str = "float32"
    log_every: int = 10
    # Held-out evaluation (loss, accuracy) every this many steps, and at the last step;
    # null = by budget: the first logged step, then in multiples of log_every spaced so evaluation takes
    # about eval_budget of the training time, priced from the work (bfexp.metrics.EvalSchedule).
    eval_every: Optional[int] = None
    eval_budget: float = 0.1
    # Evaluate on the first this many held-out samples (a fixed subset); null = all of them.
    eval_subset: Optional[int] = None
    # A run is stopped as diverged when the loss is not finite or exceeds this.
    divergence_loss: float = 1e6
    # The hang watchdog: seconds a rank may wait inside one communication call (or, as a
    # process, go without a heartbeat) before the job counts as hung and ends (0 = no watchdog).
    timeout_s: float = 300.0
    # Write a checkpoint every this many steps (0: only where a signal stops the job).
    checkpoint_every: int = 0
    # A sweep (-m) stops at its first failed job instead of running the rest.
    fail_fast: bool = False
    # Fault injection, for testing how a job fails: at fail_step, rank fail_rank does fail_mode:
    # raise (an exception), kill (SIGKILL itself), freeze (SIGSTOP itself) or hang (sleep
    # forever inside its next communication call). kill and freeze need a process per rank.
    fail_rank: Optional[int] = None
    fail_step: int = 1
    fail_mode: str = "raise"
    # Skip training: report the step time and throughput the scaling config
    # models (no ranks for a modeled cluster; on scaling=local the ranks also
    # measure the algorithm's communication on buffers of the model's size).
    throughput_only: bool = False
    # Timed steps of the allreduce baseline probe each job runs after training
    # on the same ranks, model and batch (0 = no probe; allreduce jobs are their own baseline).
    baseline_steps: int = 10
    # At the end of a sweep (-m), write report.csv, report.md and plots into its folder.
    report: bool = True
    # Time to accuracy: the report's time to reach this held-out accuracy / loss (null: the final value
    # of the sweep's allreduce job at the same ranks and engine).
    target_accuracy: Optional[float] = None
    target_eval_loss: Optional[float] = None


# The data-only group's options (component groups have no schema here: their targets are it).
DATA_GROUPS: dict[str, dict[str, type]] = {
    "scaling": {
        "local": LocalScalingConfig,
        "emulated": EmulatedScalingConfig,
        "v100_cluster": V100ClusterConfig,
        "h100_cluster": H100ClusterConfig,
        "ethernet_10g": Ethernet10GConfig,
    },
}


def tcp_goodput(rate: str) -> float:
    """A link rate's TCP payload GB/s (launcher=emulated's arithmetic; imported when a config asks)."""
    from bfexp.launchers.emulated import tcp_goodput_gbyte_per_s

    return tcp_goodput_gbyte_per_s(rate)


# Resolvers the hydra/launcher=slurm preset does its arithmetic with (a job's ranks -> its allocation).
RESOLVERS: dict[str, Callable[..., Any]] = {"bfexp_nodes": nodes_for, "bfexp_tasks_per_node": tasks_per_node,
                                             # a sweep job's folder, keyed by its overrides (resumable sweeps)
                                             "bfexp_job": job_folder,
                                             # a shaped link's TCP payload rate (scaling=emulated from launcher.link_rate)
                                             "bfexp_tcp_gbyte_per_s": tcp_goodput}


def register_resolvers() -> None:
    """Make RESOLVERS known to OmegaConf (idempotent). Done on import too: a Slurm job resolves its
    folder's name (hydra.sweep.subdir) from the composed config without composing anything."""
    for name, resolver in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


register_resolvers()


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent).

    Option schemas live in groups ``schema/<group>`` so they never show up
    as selectable options; each conf/<group>/<option>.yaml pulls its own in
    with ``- /schema/<group>/<option>@_here_``.
    """
    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="bfexp_schema", node=Config)
    for group, options in DATA_GROUPS.items():
        for option, node in options.items():
            cs.store(group=f"schema/{group}", name=option, node=node)


def engine_config(cfg: Any, name: str) -> Any:
    """engine=auto's choice ``name`` as a config node: the chosen engine's class with auto's settings that it
    takes (bfexp.comm.Auto.choice)."""
    return OmegaConf.create(build(cfg.engine, "engine").choice(name))


# ------------------------------------------------------------------ validation of the top level, the data groups, across groups
ALLOWED = {
    "dtype": typing.get_args(Dtype),
    "fail_mode": typing.get_args(FailMode),
    "scaling.allreduce": ("ring", "hierarchical"),
    "scaling.reference": ("cached", "fresh"),
}


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_engine(cfg: Any) -> None:
    """What the driver reads of the engine node (its name, its machines against the ranks), and the node
    against its class where that costs no early start: engine=auto's chooser (bfexp.comm.Auto) is light and
    built here; virtual ranks' engine is checked (they are threads of this process, which imports their class
    anyway). A process engine's class imports torch, which the driver leaves until the ranks it may start
    early have started: its ranks check it, building it."""
    from bfexp.comm import PROCESS_ENGINES

    engine = cfg.engine
    for key in ("name", "ranks_per_machine"):
        _require(key in engine, f"engine.{key} is missing; allowed: an engine node with _target_, name and "
                                "ranks_per_machine (see conf/engine/)")
    if engine.name == "auto":
        build(engine, "engine")
    elif engine.name not in PROCESS_ENGINES:
        check_node(engine, "engine", runtime=RUNTIME["engine"])
    rpm = number_in("engine.ranks_per_machine", engine.ranks_per_machine, low=0, integer=True, note="(0: one machine)")
    if rpm:
        _require(
            cfg.ranks % rpm == 0,
            f"engine.ranks_per_machine={rpm} does not divide ranks={cfg.ranks}; allowed: a divisor of ranks",
        )


def check_cache_folder(value: Any) -> None:
    """scaling.reference_cache: a folder this user can make, not a file (nor under one); found only after
    training otherwise, where the reference is stored."""
    import os
    from pathlib import Path

    if value in (None, "auto"):
        return
    folder = Path(os.path.expanduser(str(value)))
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if not str(value).strip() or blocker is not None:
        why = f" ({blocker} is a file)" if blocker is not None else ""
        raise ConfigError(f"scaling.reference_cache={value!r}{why}; allowed: a folder, auto "
                          "($BFEXP_CACHE_DIR or ~/.cache/bfexp) or null (no cache)")


# The ends of a scaling config's calibration (ScalingConfig.calibration_ends), and the figures they may set.
CALIBRATION_ENDS = ("fast", "slow")
CALIBRATED = ("intra_latency_s", "intra_bandwidth_gbyte_per_s", "inter_latency_s", "inter_stack_gbyte_per_s",
              "reduce_gbyte_per_s", "switch_gbyte_per_s")


def validate_scaling(cfg: Any) -> None:
    """The scaling config's figures, the baseline probe and throughput-only mode."""
    sc = cfg.scaling
    if sc.name == "emulated":  # first: its figures interpolate the launcher's
        target = str(cfg.launcher.get("_target_", ""))
        _require(target.endswith(".Emulated"), f"scaling=emulated with launcher={label(cfg.launcher)}; "
                 "allowed: launcher=emulated (the cluster whose links and quota it prices)")
    for key in ("intra_bandwidth_gbyte_per_s", "inter_bandwidth_gbyte_per_s", "reduce_gbyte_per_s"):
        if not (key == "inter_bandwidth_gbyte_per_s" and sc[key] == math.inf):  # inf: an unshaped link
            number_in(f"scaling.{key}", sc[key], low=0, low_open=True)
    for key in ("intra_latency_s", "inter_latency_s", "inter_stack_gbyte_per_s", "switch_gbyte_per_s"):
        number_in(f"scaling.{key}", sc[key], low=0)
    if sc.get("cores") is not None:
        number_in("scaling.cores", sc.cores, low=0, low_open=True)
    number_in("scaling.backward_fraction", sc.backward_fraction, low=0, high=1)
    number_in("scaling.reference_steps", sc.reference_steps, low=1, integer=True)
    number_in("scaling.reference_load_margin", sc.reference_load_margin, low=0)
    if sc.reference_threads is not None:
        number_in("scaling.reference_threads", sc.reference_threads, low=1, integer=True)
    for model, speed in (sc.compute_samples_per_s or {}).items():
        number_in(f"scaling.compute_samples_per_s.{model}", speed, low=0, low_open=True)
    for end, figures in (sc.get("calibration_ends") or {}).items():
        _require(end in CALIBRATION_ENDS, f"scaling.calibration_ends.{end}: no such end; allowed: "
                 + ", ".join(CALIBRATION_ENDS))
        _require(isinstance(figures, Mapping), f"scaling.calibration_ends.{end}={figures!r}; allowed: a mapping of "
                 "calibrated figures to numbers, e.g. {inter_latency_s: 1e-3}")
        for key, value in figures.items():
            _require(key in CALIBRATED, f"scaling.calibration_ends.{end}.{key}: not a calibrated figure; "
                     f"allowed: {', '.join(CALIBRATED)}")
            positive = key.endswith(("bandwidth_gbyte_per_s", "reduce_gbyte_per_s"))
            number_in(f"scaling.calibration_ends.{end}.{key}", value, low=0, low_open=positive)
    check_cache_folder(sc.get("reference_cache"))
    rpm = sc.ranks_per_machine
    _require(rpm >= 0, f"scaling.ranks_per_machine={rpm}; allowed: 0 (one machine) or >= 1")
    if rpm and cfg.ranks > rpm:
        _require(
            cfg.ranks % rpm == 0,
            f"ranks={cfg.ranks} does not fill machines of scaling.ranks_per_machine={rpm} (scaling={sc.name}); "
            f"allowed: at most {rpm} ranks or a multiple of {rpm}",
        )
        erpm = cfg.engine.ranks_per_machine
        _require(
            erpm in (0, rpm),
            f"engine.ranks_per_machine={erpm} differs from scaling.ranks_per_machine={rpm} of scaling={sc.name}; "
            f"allowed: 0 or {rpm} (the model places ranks on the scaling config's machines)",
        )


def near_miss(key: str, allowed: Iterable[str]) -> str:
    """`` (did you mean 'steps'?)`` for a misspelt key, or nothing."""
    import difflib

    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_key(key: str, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    return f"unknown key '{key}'{near_miss(key.rpartition('.')[2], allowed)}; allowed: {', '.join(allowed)}"


def check_closed(cfg: Any) -> None:
    """The top level and the data-only groups are closed: Hydra's struct mode refuses ``stps=5`` at compose
    time, but a ``+key=value`` addition (``+stpes=5``) gets in and would be ignored. Refused here, naming
    the near miss."""
    from dataclasses import fields

    top = [f.name for f in fields(Config)]
    for key in cfg:
        if key not in top and key != "hydra":
            raise ConfigError(unknown_key(str(key), top))
    gone = [key for key in top if key not in cfg]  # ``~ranks`` deletes a key the run needs
    if gone:
        raise ConfigError(f"{gone[0]} was deleted (~{gone[0]}); allowed: a value for every top-level key "
                          f"(set it, e.g. {gone[0]}=..., or leave it out for its default)")
    scaling = cfg.get("scaling")
    if isinstance(scaling, DictConfig):
        keys = [f.name for f in fields(ScalingConfig)]
        for key in scaling:
            if key not in keys:
                raise ConfigError(unknown_key(f"scaling.{key}", keys))


def check_reach(cfg: Any, ranks: int | None = None, steps: int | None = None) -> None:
    """Options that name a rank or a step must name one the command runs: ``fail_rank=7 ranks=2`` or
    ``fail_step=50 steps=5`` would never fire. ``ranks``/``steps``: the most any job of the command runs
    (a sweep over ``ranks=2,4`` may share ``fail_rank=3``: it fires in the 4-rank job); default this job's.
    A job that counts ``epochs`` knows its steps only from its data set: ``check_fail_step`` after the
    dry build."""
    ranks = int(cfg.ranks if ranks is None else ranks)
    within = f"ranks={ranks}" + (" in the largest job of this sweep" if ranks != cfg.ranks else "")
    if cfg.get("fail_rank") is not None and cfg.fail_rank >= ranks:
        raise ConfigError(f"fail_rank={cfg.fail_rank} is no rank of {within}; allowed: an integer in [0, {ranks - 1}]")
    if cfg.get("epochs") is None:
        check_fail_step(cfg, int(cfg.steps if steps is None else steps), sweep=steps not in (None, cfg.steps))
    slow = _get(cfg, "heterogeneity.slow_ranks") or []
    beyond = [r for r in slow if isinstance(r, int) and r >= ranks]
    if beyond:
        raise ConfigError(f"heterogeneity.slow_ranks={list(slow)} names rank(s) {', '.join(map(str, beyond))}, "
                          f"none of {within}; allowed: ranks in [0, {ranks - 1}]")


def total_steps(cfg: Any, global_train_size: int, size: int) -> int:
    """The steps a job runs: ``steps``, or ``epochs`` over the training set at this batch size and rank
    count. Every rank runs the same number, even when shards differ in size."""
    if cfg.get("epochs") is None:
        return int(cfg.steps)
    return int(cfg.epochs) * max(1, global_train_size // (size * cfg.batch_size))


def check_fail_step(cfg: Any, steps: int, sweep: bool = False) -> None:
    """``fail_step`` must be a step the command runs. ``steps``: this job's, or with ``sweep`` the most any
    job of the sweep runs (a shorter job may share a fail_step that the longest reaches)."""
    if cfg.fail_step <= steps:
        return
    last = f"steps={steps}" if cfg.get("epochs") is None else f"{steps} steps"
    if sweep:
        last += " in the longest job of this sweep"
    elif cfg.get("epochs") is not None:  # e.g. epochs=1 over 1,024 samples at batch_size=32, ranks=4: 8 steps
        last += f" from epochs={cfg.epochs} at batch_size={cfg.batch_size} and ranks={cfg.ranks}"
    raise ConfigError(f"fail_step={cfg.fail_step} is after the last step ({last}); allowed: an integer in [1, {steps}]")


def validate(cfg: Any, reach: bool = False) -> None:
    """Reject what cannot run in the top level, the data-only groups and across groups, naming the value and
    what is allowed. The logger and the launcher are built here (light classes whose constructors check their
    options); the other components (algorithm, topology, model, dataset, optimizer, engine) are checked by
    their own constructors in the driver's dry build (bfexp.cli) or where they are built. ``reach``: the
    options naming a rank or a step against this job's (``check_reach``; a sweep checks them against its
    largest job).
    """
    check_closed(cfg)
    for key, allowed in ALLOWED.items():
        value = _get(cfg, key)
        if value is not None:
            _require(value in allowed, f"{key}={value!r}; allowed: {', '.join(allowed)}")
    number_in("ranks", cfg.ranks, low=1, integer=True)
    check_seed("seed", cfg.seed)
    number_in("steps", cfg.steps, low=1, integer=True)
    if cfg.epochs is not None:
        number_in("epochs", cfg.epochs, low=1, integer=True)
    number_in("batch_size", cfg.batch_size, low=1, integer=True)
    number_in("lr", cfg.lr, low=0, low_open=True)
    number_in("log_every", cfg.log_every, low=1, integer=True)
    if cfg.get("budget_s") is not None:
        number_in("budget_s", cfg.budget_s, low=0, low_open=True, note="(seconds of training time), or null")
    if cfg.get("eval_every_s") is not None:
        number_in("eval_every_s", cfg.eval_every_s, low=0, low_open=True, note="(seconds), or null")
    if cfg.get("eval_every") is not None:
        number_in("eval_every", cfg.eval_every, low=1, integer=True)
    number_in("eval_budget", cfg.get("eval_budget", 0.1), low=0, low_open=True)
    if cfg.get("eval_subset") is not None:
        number_in("eval_subset", cfg.eval_subset, low=1, integer=True)
    number_in("divergence_loss", cfg.divergence_loss, low=0, low_open=True)
    number_in("timeout_s", cfg.timeout_s, low=0)
    number_in("checkpoint_every", cfg.checkpoint_every, low=0, integer=True)
    if cfg.get("budget_s") is not None and cfg.checkpoint_every and asynchronous(cfg):
        raise ConfigError(f"checkpoint_every={cfg.checkpoint_every} with budget_s and algorithm="
                          f"{label(cfg.algorithm)}, whose ranks never meet during training; allowed: 0 "
                          "(a stop signal still writes a checkpoint)")
    number_in("baseline_steps", cfg.baseline_steps, low=0, integer=True)
    number_in("fail_step", cfg.fail_step, low=1, integer=True)
    if cfg.get("target_accuracy") is not None:
        number_in("target_accuracy", cfg.target_accuracy, low=0, high=1)
    if cfg.get("target_eval_loss") is not None:
        number_in("target_eval_loss", cfg.target_eval_loss, low=0, low_open=True)
    if cfg.fail_rank is not None:
        number_in("fail_rank", cfg.fail_rank, low=0, integer=True)  # against the ranks: check_reach
    if reach:
        check_reach(cfg)
    build(cfg.logger, "logger")  # its constructor checks its options (bfexp.loggers), e.g. wandb importable
    build(cfg.launcher, "launcher")  # its constructor checks its options (bfexp.launchers)
    validate_engine(cfg)
    validate_scaling(cfg)


def launcher_of(cfg: Any) -> Any:
    """The job's launcher (bfexp.launchers), built from its config; a config from before the launcher
    group ran locally."""
    from bfexp.launchers import Local

    node = cfg.get("launcher")
    return build(node, "launcher") if node is not None and node.get("_target_") else Local()


def asynchronous(cfg: Any) -> bool:
    """Whether the job's algorithm never makes ranks wait for one another in a step (its class says so)."""
    try:
        return bool(getattr(target_of(cfg.algorithm, "algorithm"), "asynchronous", False))
    except ConfigError:
        return False  # a bad _target_ is reported where the algorithm is built


def no_lockstep(cfg: Any) -> bool:
    """A time budget with an asynchronous algorithm: each rank trains and logs on its own (bfexp.worker)."""
    return cfg.get("budget_s") is not None and asynchronous(cfg) and job_kind(cfg) == "train"


def job_kind(cfg: Any) -> str:
    """train; throughput (throughput-only timed on ranks here); modeled (a cluster that is not here: no ranks)."""
    if not cfg.throughput_only:
        return "train"
    return "modeled" if cfg.scaling.modeled else "throughput"
