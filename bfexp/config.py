"""The job-level rules: the top level, the data-only groups and what ties groups together, checked.

``validate`` checks the top level, the data-only groups and what ties groups
together (ranks per machine against the ranks, the scaling config's machines);
the job-level facts the driver and the ranks read of a config (``job_kind``,
``total_steps``, ``launcher_of``, ...) are here too, with the resolvers bfexp's
configs name (``register_configs``). How any ``_target_`` node is checked and
built is bfexp.components (which the components themselves use); the schema
(the top level's dataclass and the data-only groups') is bfexp.schema. Both are
re-exported here for the driver and the worker. ConfigError (bfexp.errors) is
the user's fault: one line, exit 2. This module imports only the standard
library, Hydra and OmegaConf (and the launchers, light classes): the CLI needs
it for ``--help`` and completion, which must stay instant.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Callable, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf

from bfexp.checkpoint import job_folder
# The component builder and the schema, as the upper layers (cli, launch, worker, summary, ...) reach them.
from bfexp.components import (KINDS, OPTIMIZER_RANGES, RUNTIME, SEED_MAX, build, check_kind, check_node,
                              check_optimizer_options, check_seed, compose_shipped, describe, group_options, label,
                              node_options, option_node, signature_schema, target_of, type_ok)
from bfexp.errors import ConfigError, number_in
from bfexp.schema import (DATA_GROUPS, Config, Dtype, EmulatedScalingConfig, Ethernet10GConfig, FailMode,
                          H100ClusterConfig, LocalScalingConfig, ScalingConfig, Settings, V100ClusterConfig,
                          register_schema)

__all__ = ["DATA_GROUPS", "KINDS", "OPTIMIZER_RANGES", "RESOLVERS", "RUNTIME", "SEED_MAX", "Config", "ConfigError",
           "Dtype", "EmulatedScalingConfig", "Ethernet10GConfig", "FailMode", "H100ClusterConfig",
           "LocalScalingConfig", "ScalingConfig", "V100ClusterConfig", "asynchronous", "build", "check_closed",
           "check_fail_step", "check_kind", "check_node", "check_optimizer_options", "check_reach", "check_seed",
           "compose_shipped", "describe", "engine_config", "group_options", "job_kind", "label", "launcher_of",
           "no_lockstep", "node_options", "option_node", "register_configs", "register_resolvers",
           "signature_schema", "target_of", "total_steps", "type_ok", "validate"]

# Interpolation resolvers of bfexp's own configs that are no launcher's (the launchers register theirs:
# bfexp.launchers.register_resolvers): a sweep job's folder, keyed by its overrides (resumable sweeps).
RESOLVERS: dict[str, Callable[..., Any]] = {"bfexp_job": job_folder}


def register_resolvers() -> None:
    """Make RESOLVERS and the launchers' resolvers known to OmegaConf (idempotent). Done on import too: a
    Slurm job resolves its folder's name (hydra.sweep.subdir) from the composed config without composing
    anything."""
    from bfexp.launchers import register_resolvers as register_launchers

    register_launchers()
    for name, resolver in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


register_resolvers()


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (bfexp.schema) and the resolvers into OmegaConf (idempotent)."""
    register_resolvers()
    register_schema()


def engine_config(engine: Any, name: str) -> Any:
    """engine=auto's choice ``name`` as a config node: the chosen engine's class with auto's settings that it
    takes (bfexp.comm.Auto.choice). ``engine``: the job's engine node (engine=auto's)."""
    return OmegaConf.create(build(engine, "engine").choice(name))


# ------------------------------------------------------------------ validation of the top level, the data groups, across groups
ALLOWED = {
    "dtype": typing.get_args(Dtype),
    "fail_mode": typing.get_args(FailMode),
    "scaling.allreduce": ("ring", "hierarchical"),
    "scaling.reference": ("cached", "fresh"),
}


def _get(node: Any, dotted: str) -> Any:
    """``node``'s value at the dotted key, or None where any part is missing."""
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_engine(engine: Any, ranks: int) -> None:
    """What the driver reads of the engine node (its name, its machines against the ranks), and the node
    against its class where that costs no early start: engine=auto's chooser (bfexp.comm.Auto) is light and
    built here; virtual ranks' engine is checked (they are threads of this process, which imports their class
    anyway). A process engine's class imports torch, which the driver leaves until the ranks it may start
    early have started: its ranks check it, building it. ``engine``: the engine node; ``ranks``: the job's."""
    from bfexp.comm import PROCESS_ENGINES

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
            ranks % rpm == 0,
            f"engine.ranks_per_machine={rpm} does not divide ranks={ranks}; allowed: a divisor of ranks",
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


def validate_scaling(sc: Any, launcher: Any, engine: Any, ranks: int) -> None:
    """The scaling config's figures, the baseline probe and throughput-only mode. ``sc``: the scaling node;
    ``launcher`` and ``engine``: the launcher's and the engine's nodes (their machines against its);
    ``ranks``: the job's."""
    if sc.name == "emulated":  # first: its figures interpolate the launcher's
        from bfexp.launchers.base import launcher_class

        _require(getattr(launcher_class(launcher), "emulates_cluster", False),  # asked of its class
                 f"scaling=emulated with launcher={label(launcher)}; "
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
    number_in("scaling.device_peak_tflop_per_s", sc.get("device_peak_tflop_per_s", 0.0), low=0, note="(0 = none)")
    number_in("scaling.device_achieved_fraction", sc.get("device_achieved_fraction", 0.0), low=0, high=1,
              note="(0 = none)")
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
    if rpm and ranks > rpm:
        _require(
            ranks % rpm == 0,
            f"ranks={ranks} does not fill machines of scaling.ranks_per_machine={rpm} (scaling={sc.name}); "
            f"allowed: at most {rpm} ranks or a multiple of {rpm}",
        )
        erpm = engine.ranks_per_machine
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


def check_closed(keys: Iterable[str], scaling: Any) -> None:
    """The top level and the data-only groups are closed: Hydra's struct mode refuses ``stps=5`` at compose
    time, but a ``+key=value`` addition (``+stpes=5``) gets in and would be ignored. Refused here, naming
    the near miss. ``keys``: the top level's keys; ``scaling``: the scaling node."""
    from dataclasses import fields

    top = [f.name for f in fields(Config)]
    keys = list(keys)
    for key in keys:
        if key not in top and key != "hydra":
            raise ConfigError(unknown_key(str(key), top))
    gone = [key for key in top if key not in keys]  # ``~ranks`` deletes a key the run needs
    if gone:
        raise ConfigError(f"{gone[0]} was deleted (~{gone[0]}); allowed: a value for every top-level key "
                          f"(set it, e.g. {gone[0]}=..., or leave it out for its default)")
    if isinstance(scaling, DictConfig):
        keys = [f.name for f in fields(ScalingConfig)]
        for key in scaling:
            if key not in keys:
                raise ConfigError(unknown_key(f"scaling.{key}", keys))


def check_reach(settings: Settings, heterogeneity: Any, ranks: int | None = None, steps: int | None = None) -> None:
    """Options that name a rank or a step must name one the command runs: ``fail_rank=7 ranks=2`` or
    ``fail_step=50 steps=5`` would never fire. ``ranks``/``steps``: the most any job of the command runs
    (a sweep over ``ranks=2,4`` may share ``fail_rank=3``: it fires in the 4-rank job); default this job's.
    A job that counts ``epochs`` knows its steps only from its data set: ``check_fail_step`` after the
    dry build. ``heterogeneity``: the heterogeneity node (its slow ranks), or None."""
    ranks = int(settings.ranks if ranks is None else ranks)
    within = f"ranks={ranks}" + (" in the largest job of this sweep" if ranks != settings.ranks else "")
    if settings.fail_rank is not None and settings.fail_rank >= ranks:
        raise ConfigError(f"fail_rank={settings.fail_rank} is no rank of {within}; allowed: an integer in [0, {ranks - 1}]")
    if settings.epochs is None:
        check_fail_step(settings, int(settings.steps if steps is None else steps),
                        sweep=steps not in (None, settings.steps))
    slow = _get(heterogeneity, "slow_ranks") or []
    beyond = [r for r in slow if isinstance(r, int) and r >= ranks]
    if beyond:
        raise ConfigError(f"heterogeneity.slow_ranks={list(slow)} names rank(s) {', '.join(map(str, beyond))}, "
                          f"none of {within}; allowed: ranks in [0, {ranks - 1}]")


def total_steps(settings: Settings, global_train_size: int, size: int) -> int:
    """The steps a job runs: ``steps``, or ``epochs`` over the training set at this batch size and rank
    count. Every rank runs the same number, even when shards differ in size."""
    if settings.epochs is None:
        return int(settings.steps)
    return int(settings.epochs) * max(1, global_train_size // (size * settings.batch_size))


def check_fail_step(settings: Settings, steps: int, sweep: bool = False) -> None:
    """``fail_step`` must be a step the command runs. ``steps``: this job's, or with ``sweep`` the most any
    job of the sweep runs (a shorter job may share a fail_step that the longest reaches)."""
    if settings.fail_step <= steps:
        return
    last = f"steps={steps}" if settings.epochs is None else f"{steps} steps"
    if sweep:
        last += " in the longest job of this sweep"
    elif settings.epochs is not None:  # e.g. epochs=1 over 1,024 samples at batch_size=32, ranks=4: 8 steps
        last += f" from epochs={settings.epochs} at batch_size={settings.batch_size} and ranks={settings.ranks}"
    raise ConfigError(f"fail_step={settings.fail_step} is after the last step ({last}); allowed: an integer in "
                      f"[1, {steps}]")


# The longest run bfexp takes (a step counter beyond it is a typo, not an experiment: 2**63 trained until
# killed) and the most evaluations a time budget schedules (each is a pass over the held-out set).
MAX_STEPS = 10**9
MAX_EVALUATIONS = 10_000


def check_eval_every_s(every_s: float, budget_s: float | None) -> None:
    """eval_every_s spaces evaluations within a time budget: without one it would say nothing (refused, not
    ignored), and more than MAX_EVALUATIONS of them (eval_every_s=1e-9) would be a list nobody can hold."""
    if budget_s is None:
        raise ConfigError(f"eval_every_s={every_s} spaces evaluations within a time budget, and budget_s is null; "
                          "allowed: budget_s=<seconds> beside it, or eval_every_s=null (evaluation by steps: "
                          "eval_every)")
    least = float(budget_s) / MAX_EVALUATIONS
    if float(every_s) < least:
        raise ConfigError(f"eval_every_s={every_s} schedules {float(budget_s) / float(every_s):.3g} evaluations in "
                          f"budget_s={budget_s}; allowed: eval_every_s >= budget_s / {MAX_EVALUATIONS} = {least:g}")


def validate(cfg: Any, reach: bool = False) -> None:
    """Reject what cannot run in the top level, the data-only groups and across groups, naming the value and
    what is allowed. The logger and the launcher are built here (light classes whose constructors check their
    options); the other components (algorithm, topology, model, dataset, optimizer, engine) are checked by
    their own constructors in the driver's dry build (bfexp.cli) or where they are built. ``reach``: the
    options naming a rank or a step against this job's (``check_reach``; a sweep checks them against its
    largest job).
    """
    check_closed(list(cfg), cfg.get("scaling"))
    settings = Settings.of(cfg)
    for key, allowed in ALLOWED.items():
        group, _, leaf = key.rpartition(".")
        value = _get(cfg.get(group), leaf) if group else getattr(settings, key)
        if value is not None:
            _require(value in allowed, f"{key}={value!r}; allowed: {', '.join(allowed)}")
    number_in("ranks", cfg.ranks, low=1, integer=True)
    check_seed("seed", cfg.seed)
    number_in("steps", cfg.steps, low=1, high=MAX_STEPS, integer=True)
    if cfg.epochs is not None:
        number_in("epochs", cfg.epochs, low=1, integer=True)
    number_in("batch_size", cfg.batch_size, low=1, integer=True)
    number_in("lr", cfg.lr, low=0, low_open=True)
    number_in("log_every", cfg.log_every, low=1, integer=True)
    if cfg.get("budget_s") is not None:
        number_in("budget_s", cfg.budget_s, low=0, low_open=True, note="(seconds of training time), or null")
    if cfg.get("eval_every_s") is not None:
        number_in("eval_every_s", cfg.eval_every_s, low=0, low_open=True, note="(seconds), or null")
        check_eval_every_s(cfg.eval_every_s, cfg.get("budget_s"))
    if cfg.get("eval_every") is not None:
        number_in("eval_every", cfg.eval_every, low=1, integer=True)
    number_in("eval_budget", cfg.get("eval_budget", 0.1), low=0, low_open=True)
    number_in("eval_points", cfg.get("eval_points", 10), low=0, integer=True)
    if cfg.get("eval_subset") is not None:
        number_in("eval_subset", cfg.eval_subset, low=1, integer=True)
    number_in("divergence_loss", cfg.divergence_loss, low=0, low_open=True)
    number_in("timeout_s", cfg.timeout_s, low=0)
    number_in("checkpoint_every", cfg.checkpoint_every, low=0, integer=True)
    if cfg.get("budget_s") is not None and cfg.checkpoint_every and asynchronous(cfg.algorithm):
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
        check_reach(settings, cfg.get("heterogeneity"))
    build(cfg.logger, "logger")  # its constructor checks its options (bfexp.loggers), e.g. wandb importable
    build(cfg.launcher, "launcher")  # its constructor checks its options (bfexp.launchers)
    validate_engine(cfg.engine, cfg.ranks)
    validate_scaling(cfg.scaling, cfg.launcher, cfg.engine, cfg.ranks)


def launcher_of(node: Any) -> Any:
    """The job's launcher (bfexp.launchers), built from its node (``cfg.get("launcher")``); None (a config
    from before the launcher group) runs locally."""
    from bfexp.launchers import Local

    return build(node, "launcher") if node is not None and node.get("_target_") else Local()


def asynchronous(algorithm: Any) -> bool:
    """Whether the job's algorithm (its node) never makes ranks wait for one another in a step (its class says so)."""
    try:
        return bool(getattr(target_of(algorithm, "algorithm"), "asynchronous", False))
    except ConfigError:
        return False  # a bad _target_ is reported where the algorithm is built


def no_lockstep(settings: Settings, algorithm: Any) -> bool:
    """A time budget with an asynchronous algorithm (its node): each rank trains and logs on its own
    (bfexp.worker)."""
    return settings.budget_s is not None and asynchronous(algorithm) and not settings.throughput_only


def job_kind(throughput_only: bool, scaling: Any) -> str:
    """train; throughput (throughput-only timed on ranks here); modeled (a cluster that is not here: no ranks).
    ``scaling``: the scaling node (whether its cluster is modeled)."""
    if not throughput_only:
        return "train"
    return "modeled" if scaling.modeled else "throughput"
