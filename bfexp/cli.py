"""`bfexp`: compose an experiment with Hydra, validate it, hand it to the launcher.

This module imports nothing heavy (no torch, no mpi4py): `--help`,
`--cfg job` and shell completion stay instant. Bad input ends here with one
line on stderr and exit code 2, before any rank starts.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from bfexp import checkpoint, results
from bfexp.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_JOB_FAILED

GROUPS = ("algorithm", "topology", "model", "dataset", "optimizer", "engine", "scaling", "logger", "launcher",
          "heterogeneity")

# Status of every job this process ran (a multirun runs several).
_job_statuses: list[str] = []
# The job under way (its folder, config, resume command) and whether a sweep stopped (fail_fast).
_current: dict[str, Any] = {}
# Where the driver's wall time went (`bfexp --verbose` prints it beside rank 0's, slowest first).
PHASES = results.Phases("driver", results.process_started_at())


def group_options(group: str) -> list[str]:
    """Options of a config group (bfexp.conf.options: the standard library only, so the CLI starts light)."""
    from bfexp.conf import options

    return options(group)


HELP = """\
bfexp: declarative experiments for decentralized deep learning.

Usage: bfexp [KEY=VALUE ...]            one run
       bfexp -m KEY=V1,V2 [...]         a sweep (Hydra multirun)
       bfexp --cfg job [KEY=VALUE ...]  print the composed config, run nothing
       bfexp --verbose [KEY=VALUE ...]  also print where the wall time went (start-up parts)

Config groups (pick one option each, e.g. topology=ring):
{groups}

Top-level keys: ranks, seed, steps, epochs, budget_s, batch_size, lr, dtype, log_every,
  eval_every, eval_every_s, eval_budget, eval_subset, timeout_s, checkpoint_every, fail_fast,
  throughput_only, baseline_steps, report
Options have their own keys, e.g. algorithm.style=awc, topology.base=3,
optimizer.momentum=0.9; `bfexp --cfg job algorithm=dsgd` shows them all.
Your own class: model._target_=mypkg.Net (or a YAML in --config-dir).
Named studies (conf/experiment/, each with recipes/NAME/README.md):
  bfexp -m +experiment=NAME      NAME: {experiments}

Examples:
  bfexp                                             DSGD on exp2, 4 MPI ranks
  bfexp algorithm=allreduce model=mlp dataset=digits
  bfexp -m ranks=2,4 topology=ring,exp2             four jobs, one folder each

Results land in outputs/<date>/<time>/ (multirun/... for sweeps):
  config.yaml, metrics.jsonl, summary.json, logs/rank<N>.log, .hydra/
Interrupted or failed: bfexp resume=<run or sweep folder> continues it
  (a run from its checkpoint; a sweep skips its finished jobs).
Hydra's own options: bfexp --hydra-help
"""


def reset_state() -> None:
    """Forget the jobs this process ran (a caller that runs ``command`` again in one interpreter)."""
    _current.clear()
    _job_statuses.clear()


def print_help() -> None:
    rows = [f"  {g:<10} {', '.join(group_options(g))}" for g in GROUPS]
    print(HELP.format(groups="\n".join(rows), experiments=", ".join(group_options("experiment"))))


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """One line on stderr and the exit code of whose fault it is (bfexp.errors): bad input 2, environment 3."""
    print(f"bfexp: error: {message}", file=sys.stderr)
    sys.exit(code)


def one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf explain errors over many lines; keep what names the value."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, MissingConfigException):
            m = re.search(r"Could not find '([^'/]+)/([^']+)'", str(e))
            if m and m.group(1) in GROUPS:
                group, option = m.groups()
                return f"{group}={option} is not an option; allowed: {', '.join(group_options(group))}"
    for e in chain:
        m = re.search(r"Key '([^']+)' (?:is )?not in (?:struct|'([^']+)')", str(e))
        if m:
            key = getattr(e, "full_key", None) or m.group(1)
            return f"unknown key '{key}'; `bfexp --cfg job` lists the keys this config has"
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            first = str(e).strip().splitlines()[0]
            return f"{e.full_key}: {first}"
    text = str(exc).strip().splitlines()
    m = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", text[0] if text else "")
    if m:  # key=a,b outside a sweep: Hydra cannot tell a list from a sweep over two values
        key, value = m.groups()
        return (f"{key}={value} is ambiguous (commas make a sweep); allowed: a list {key}=[{value}], one "
                f"string {key}='\"{value}\"', or a sweep over its values with -m")
    return text[0] if text else type(exc).__name__


def foreign(target: Any) -> bool:
    """A target from outside bfexp (torch, the user's package): its ValueErrors are about its arguments."""
    return not str(getattr(target, "__module__", "")).startswith("bfexp.")


class DryBuild(NamedTuple):
    notes: list[str]  # for the user, e.g. a substituted topology
    steps: int | None  # the steps the job runs (``epochs``: from its data set; None: the data set cannot say)


def dry_build(cfg: Any, launcher: Any = None, here: bool = True) -> DryBuild:
    """Build, before any rank starts, everything the ranks will build, as cheaply as possible:
    the topology, the algorithm's options, requirements and engine, the data set (its files),
    the model on the meta device and the optimizer on one dummy parameter. Raises
    ConfigError (one line) for what cannot run. ``here``: the ranks run on this machine (its memory is
    checked)."""
    import torch

    from bfexp.assembly import resolve
    from bfexp.comm import engine_class
    from bfexp.config import RUNTIME, ConfigError, build, check_node, check_optimizer_options, label, launcher_of
    from bfexp.preflight import check_memory
    from bfexp.errors import number_in
    from bfexp.models import check_fits, sample_shape
    from bfexp.watchdog import PROCESS_ONLY_MODES
    from bfexp.scaling import declared_speed, missing_speed_message
    from bfexp.topology import build_topology
    from bfexp.torch_internals import defer_dynamo
    from bfexp.config import job_kind
    from bfexp.summary import topology_ranks_per_machine

    defer_dynamo()  # torch.optim would import torch._dynamo (a second) only to mark code for a compiler

    def guarded(group: str, target: Any, call: Any) -> Any:
        try:
            return call()
        except (ValueError, TypeError) as e:
            if isinstance(e, ConfigError) or not foreign(target):
                raise
            raise ConfigError(f"{group}._target_={target.__module__}.{target.__qualname__} refused its options: "
                              f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None

    notes, steps = [], (int(cfg.steps) if cfg.get("epochs") is None else None)  # epochs: the data set counts them
    modeled = job_kind(cfg) == "modeled"
    topology = build_topology(cfg.topology, cfg.ranks, topology_ranks_per_machine(cfg))
    algorithm, options = check_node(cfg.algorithm, "algorithm", runtime=("optimizer", "engine", "topology", "model"))
    algorithm.check_options(**options)
    if not modeled:
        check_node(cfg.engine, "engine", runtime=RUNTIME["engine"])  # mpi, nccl: their class, now torch is here
        engine = engine_class(cfg.engine.name)
        algorithm.check_run(engine, throughput_only=bool(cfg.throughput_only), modeled=modeled)
        if cfg.fail_rank is not None and cfg.fail_mode in PROCESS_ONLY_MODES and engine.virtual:
            raise ConfigError(f"fail_mode={cfg.fail_mode} needs a process per rank (engine={cfg.engine.name} runs "
                              "ranks as threads of this process); allowed: engine=mpi, or fail_mode=raise or hang")
    if algorithm.uses_topology:  # e.g. exact diffusion on exp2's undirected form; diloco averaging by allreduce
        notes.extend(resolve(algorithm, topology, options)[1])  # reads no graph: any graph serves
    dataset_target, _ = check_node(cfg.dataset, "dataset")
    dataset = guarded("dataset", dataset_target, lambda: build(cfg.dataset, "dataset"))
    if not cfg.throughput_only:  # batches and held-out samples against what the data set holds
        more, steps = check_data(cfg, dataset)
        notes.extend(more)
    model_target, _ = check_node(cfg.model, "model", runtime=("in_shape", "in_features", "classes"))
    in_shape, classes = guarded("model", model_target, lambda: sample_shape(cfg.model, dataset))
    fed = (in_shape, classes) if cfg.throughput_only else dataset.sample_shape()  # training: the data's samples
    parameters = guarded("model", model_target,
                         lambda: check_fits(cfg.model, *fed, data=f"dataset={label(cfg.dataset)}",
                                            tokens=bool(getattr(dataset, "tokens", False))))
    finfo = torch.finfo(getattr(torch, cfg.dtype))  # e.g. lr=1e308: not a float32, inf on every rank
    number_in("lr", cfg.lr, low=0, low_open=True, high=finfo.max, note=f"(the largest {cfg.dtype})")
    if not modeled and here:  # e.g. ranks=100000 engine=mpi: refused here, not by the machine running out of memory
        check_memory(cfg, launcher or launcher_of(cfg), int(parameters), getattr(torch, cfg.dtype).itemsize)
    optimizer_target, optimizer_options = check_node(cfg.optimizer, "optimizer", runtime=("params",))
    check_optimizer_options(optimizer_options)
    guarded("optimizer", optimizer_target,
            lambda: build(cfg.optimizer, "optimizer")([torch.zeros(1, requires_grad=True)]))
    if not modeled and engine.stacked:  # what one batched program cannot hold: its optimizer, model, options
        from bfexp.comm.stacked import check_job

        check_job(cfg, fed[0], fed[1])
    if cfg.get("heterogeneity") is not None:  # stragglers: the constructor checks the ranges
        build(cfg.heterogeneity, "heterogeneity")
    if modeled and not declared_speed(cfg.scaling, label(cfg.model)):
        raise ConfigError(missing_speed_message(cfg.scaling, label(cfg.model)))
    return DryBuild(notes, steps)


def check_data(cfg: Any, dataset: Any) -> tuple[list[str], int | None]:
    """batch_size and eval_subset against the data set's split at this job's ranks (``Dataset.sizes``; its
    files are read here, so a malformed one is named before any rank starts). A batch larger than every
    rank's shard is refused: no rank could draw it, and the run would not be the one asked for (torch's
    DataLoader silently shortens it). Larger than some shards only (an uneven split): those ranks draw their
    whole shard per step, and a note says so. Returns the notes and the steps the job runs (``epochs``
    counts them from the split; None: a data set that cannot say before its ranks load it)."""
    from bfexp.config import label, total_steps
    from bfexp.errors import ConfigError

    try:
        shards, held_out = dataset.sizes(int(cfg.ranks), int(cfg.seed))
    except NotImplementedError:  # a user's data set that overrides load() only: its ranks say
        return [], None if cfg.get("epochs") is not None else int(cfg.steps)
    steps = total_steps(cfg, sum(shards), int(cfg.ranks))
    where = f"dataset={label(cfg.dataset)} at ranks={cfg.ranks}"
    if cfg.batch_size > max(shards):
        raise ConfigError(f"batch_size={cfg.batch_size} exceeds every rank's shard ({max(shards)} samples at most "
                          f"with {where}); allowed: an integer in [1, {max(shards)}]")
    short = [r for r, n in enumerate(shards) if n < cfg.batch_size]
    if cfg.get("eval_subset") is not None and cfg.eval_subset > held_out:
        raise ConfigError(f"eval_subset={cfg.eval_subset} exceeds the {held_out} held-out samples of {where}; "
                          f"allowed: an integer in [1, {held_out}] or null (all of them)")
    if not short:
        return [], steps
    return [f"batch_size={cfg.batch_size} exceeds the shard of rank(s) {', '.join(map(str, short[:8]))}"
            f"{' ...' if len(short) > 8 else ''} ({min(shards)} samples at least, {where}): they train on their "
            "whole shard each step"], steps


def discard_unused(run_dir: Path, sweep_dir: Path | None = None) -> None:
    """Remove a run folder that holds nothing but what Hydra wrote on its way to our code (.hydra/,
    its job log), and the parents left empty; a sweep folder left with only multirun.yaml too.
    Bad input leaves no folder behind; a folder with anything of a run in it stays."""
    def only_hydra(folder: Path) -> bool:
        return folder.is_dir() and all(p.name in (".hydra", results.LOCK) or (p.is_file() and p.suffix == ".log")
                                       for p in folder.iterdir())

    cwd = Path.cwd().resolve()
    folders = [run_dir] if only_hydra(run_dir) else []
    if sweep_dir is not None and sweep_dir.is_dir():
        others = [p for p in sweep_dir.iterdir() if p != run_dir and p.name != "multirun.yaml"]
        if not others or others == [sweep_dir / checkpoint.SKIPPED]:
            folders.append(sweep_dir)
    for folder in folders:
        results.unlock_folder(folder)
        shutil.rmtree(folder, ignore_errors=True)
        parent = folder.resolve().parent
        while parent != cwd and cwd in parent.parents:
            try:
                parent.rmdir()  # only when empty
            except OSError:
                break
            parent = parent.parent


def override_key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def quote(value: str) -> str:
    """A value for a Hydra override, whatever it holds (a folder name has `=` and `,` in a sweep)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def resume_arguments(args: list[str]) -> list[str]:
    """``resume=DIR``: DIR's own command again, into DIR. A run folder continues from its checkpoint
    (or reruns); a sweep folder (multirun.yaml) skips its finished jobs and reruns the rest.
    Overrides given beside ``resume=`` replace the saved ones with the same key."""
    given = [a for a in args if a.startswith("resume=")]
    if not given:
        return args
    if len(given) > 1:
        fail(f"{' '.join(given)}; allowed: one resume=<run or sweep folder>")
    folder = Path(given[0].partition("=")[2])
    rest = [a for a in args if a not in given and a not in ("-m", "--multirun")
            and override_key(a) not in ("hydra.run.dir", "hydra.sweep.dir")]
    found = busy_job(folder) if (folder / "multirun.yaml").is_file() else None
    holder = found[1] if found else results.folder_holder(folder)
    if holder:
        fail(f"resume={folder} is still running ({holder}); allowed: resume it once it has ended "
             "(a signal stops it at a checkpoint: kill -TERM <pid>)")
    if (folder / "multirun.yaml").is_file():
        saved, mode, key = saved_overrides(folder / "multirun.yaml"), ["-m"], "hydra.sweep.dir"
    elif (folder / ".hydra" / "hydra.yaml").is_file():
        summary = results.read_json(folder / results.SUMMARY)
        if isinstance(summary, dict) and summary.get("status") in results.FINISHED:
            print(f"bfexp: {folder} already {summary['status']}; nothing to resume")
            sys.exit(0)
        saved, mode, key = saved_overrides(folder / ".hydra" / "hydra.yaml"), [], "hydra.run.dir"
    else:
        fail(f"resume={folder} is not a bfexp run or sweep folder (no .hydra/hydra.yaml, no multirun.yaml); "
             "allowed: a folder a bfexp run or sweep wrote")
    own = {override_key(a) for a in rest}
    kept = [str(o) for o in list(saved.hydra) + list(saved.task)
            if override_key(str(o)) not in own | {"hydra.run.dir", "hydra.sweep.dir", "hydra.mode"}]
    return [*mode, *rest, *kept, f"{key}={quote(str(folder))}"]


def saved_overrides(path: Path) -> Any:
    """The overrides Hydra saved in a run's hydra.yaml or a sweep's multirun.yaml (``hydra.overrides``, with
    its ``hydra`` and ``task`` lists); ConfigError naming the file when it cannot be read as one."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    from bfexp.errors import ConfigError

    try:
        saved = OmegaConf.load(path)
        overrides = saved.hydra.overrides if isinstance(saved, DictConfig) else None
        ok = isinstance(overrides, DictConfig) and all(isinstance(overrides.get(k), ListConfig)
                                                       for k in ("hydra", "task"))
    except Exception as e:  # yaml's errors, undecodable bytes, OmegaConf's: the file is damaged
        ok, why = False, f" ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
    else:
        why = " (no hydra.overrides.task and hydra.overrides.hydra lists)"
    if not ok:
        raise ConfigError(f"resume: {path} cannot be read{why}; allowed: the file as Hydra wrote it")
    return overrides


def hydra_argument_order(args: list[str]) -> list[str]:
    """The arguments in the one order Hydra's command line accepts: the overrides first, then the
    flags, each with its own value(s), e.g. ``a=1 -m b=1,2`` becomes ``a=1 b=1,2 -m``.

    Hydra 1.3's parser takes the overrides as one argparse positional (``nargs="*"``) that ends at
    the first flag, so overrides on both sides of ``-m``, ``--cfg job`` or ``-cd DIR`` are refused
    ("unrecognized arguments"; Hydra issue #3053). How many values a flag takes is read from
    Hydra's own parser: an option with a value takes the next token unless it has one attached
    (``--config-dir=DIR``, ``-cjob``), a switch takes none, ``--info [what]`` the next token only
    when it is one of its choices (``--info a=1``: a=1 is an override). An unknown flag goes with
    the flags, where argparse names it; after ``--`` every token is an override.
    """
    from hydra._internal.utils import get_args_parser

    options = get_args_parser()._option_string_actions
    overrides: list[str] = []
    flags: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            overrides += args[i:]
            break
        if not token.startswith("-") or token == "-":
            overrides.append(token)
            continue
        flags.append(token)
        action, attached = _hydra_option(token, options)
        if action is None or attached:
            continue
        if action.nargs == "?":
            count = int(i < len(args) and args[i] in (action.choices or ()))
        elif action.nargs in ("*", "+"):  # none in Hydra 1.3: its values run to the next flag
            count = next((j for j in range(i, len(args)) if args[j].startswith("-")), len(args)) - i
        else:
            count = 1 if action.nargs is None else int(action.nargs)
        flags += args[i:i + count]
        i += count
    return overrides + flags


def _hydra_option(token: str, options: dict[str, argparse.Action]) -> tuple[argparse.Action | None, bool]:
    """The action of Hydra's parser that a flag names, as argparse finds it (exact, ``--flag=value``,
    a short flag with its value attached, an unambiguous prefix of a long flag), and whether the
    token carries its value. (None, False) for a flag Hydra does not know."""
    if token in options:
        return options[token], False
    name, equals, _ = token.partition("=")
    if equals and name in options:
        return options[name], True
    if not token.startswith("--") and token[:2] in options:  # -cjob
        return options[token[:2]], True
    if token.startswith("--"):
        matches = {options[o] for o in options if o.startswith(name)}
        if len(matches) == 1:
            return matches.pop(), bool(equals)
    return None, False


def refuse_bad_flags(args: list[str]) -> None:
    """What Hydra's parser refuses (a flag it does not know, a value outside a flag's choices) ends
    here in one line, exit 2, instead of Hydra's usage over ten lines; ``args`` as Hydra gets them."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.error = lambda message: fail(f"{message}; Hydra's flags: bfexp --hydra-help")  # type: ignore[method-assign]
    parser.parse_args(args)


def resume_command(run_dir: Path) -> str:
    """What continues this job: its run folder, or in a sweep the sweep folder (finished jobs are skipped)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    folder = run_dir
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        folder = Path(str(HydraConfig.get().sweep.dir))
    try:
        folder = folder.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return f"bfexp resume={folder}"


def busy(key: str, folder: Path, holder: str) -> NoReturn:
    """A folder where another live driver runs a job: one line, exit 2, nothing of it touched."""
    fail(f"{key}={folder} is in use by a running bfexp ({holder}); allowed: a folder no running bfexp "
         "writes to, or this one once that run has ended")


def busy_job(sweep_dir: Path) -> tuple[Path, str] | None:
    """A job folder of ``sweep_dir`` that a live driver holds, and who holds it."""
    for lock in sorted(sweep_dir.glob(f"*/{results.LOCK}")):
        holder = results.folder_holder(lock.parent)
        if holder:
            return lock.parent, holder
    return None


def run_job(cfg: Any) -> str:
    """One job: validate, dry-build, launch, report. Returns the job's status.

    Bad input ends the driver here (one line, exit 2, no folder left); a
    failed job is announced at once; in a sweep, a finished job's folder is
    skipped untouched, and fail_fast=true skips the jobs after a failed one.
    The driver holds the job's folder (results.lock_folder) while it runs the job.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    PHASES.mark("start: python, Hydra, compose")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    sweep_dir = Path(str(HydraConfig.get().sweep.dir)) if HydraConfig.get().mode == RunMode.MULTIRUN else None
    _current.update(run_dir=run_dir, cfg=cfg, resume=resume_command(run_dir))
    passed = not_run(run_dir)
    if passed:
        _job_statuses.append(passed)
        return passed
    holder = results.lock_folder(run_dir)  # a single run's is held since on_run_start
    if holder:
        busy("hydra.sweep.dir" if sweep_dir else "hydra.run.dir", run_dir, holder)
    try:
        return checked_job(cfg, run_dir, sweep_dir)
    finally:
        results.unlock_folder(run_dir)


def checked_job(cfg: Any, run_dir: Path, sweep_dir: Path | None) -> str:
    """``run_job``'s job in its held folder: validate, dry-build, launch, report."""
    from bfexp.config import build, check_fail_step, job_kind, label, validate
    from bfexp.errors import ConfigError, LaunchError

    # SystemExit passes through Hydra untouched: one line, exit 2, no rank started on its work.
    early = None  # the job's ranks, started while the driver checks it (they wait for the word to go)

    def refuse(e: ConfigError | LaunchError) -> NoReturn:
        if early is not None:
            early.cancel()  # first: the log folder its start made goes, so discard_unused finds Hydra's alone
        discard_unused(run_dir, sweep_dir)
        fail(str(e), EXIT_ENVIRONMENT if isinstance(e, LaunchError) else EXIT_BAD_INPUT)

    try:
        try:
            validate(cfg, reach=sweep_dir is None)  # a sweep's jobs: against each other, before the first (check_sweep)
            from bfexp.config import launcher_of
            from bfexp.launch import launch
            from bfexp.preflight import check_engine, resolve_engine
            from bfexp.sessions import EarlyRanks

            choice = launcher = None
            if job_kind(cfg) != "modeled":
                cfg, choice = resolve_engine(cfg)
                launcher = launcher_of(cfg)  # built once for the job
                if EarlyRanks.wanted(cfg, launcher):  # their start-up overlaps torch's import and the checks below
                    early = EarlyRanks(cfg, run_dir, launcher)
                    PHASES.mark("ranks started early (they wait for the checks)")
                check_engine(cfg, launcher)  # e.g. engine=nccl without a GPU; imports torch
            PHASES.mark("validate, engine choice")
            notes, steps = dry_build(cfg, launcher)
            if sweep_dir is None and cfg.epochs is not None and steps is not None:  # e.g. fail_step=50 epochs=1
                check_fail_step(cfg, steps)
            PHASES.mark("dry build: torch, components")
        except (ConfigError, LaunchError) as e:
            refuse(e)
        for note in notes:
            print(f"note: {note}", flush=True)
        from bfexp.comm import engine_class
        from bfexp.scaling import contention_note, processor_count

        if job_kind(cfg) != "modeled":  # more CPU ranks than cores: measured scaling is contention
            placer = launcher or launcher_of(cfg)
            ranks = int(cfg.ranks)
            machines = 1 if placer.on_this_machine else len(placer.hosts(ranks))
            note = contention_note(placer.ranks_per_host(ranks) if machines > 1 else ranks, processor_count(),
                                   engine_class(cfg.engine.name).device_type == "cpu", placer.cpu_quotas(ranks))
            if note:
                print(f"note: {note}", flush=True)
        title = f"{label(cfg.algorithm)}/{label(cfg.topology)} x{cfg.ranks}"
        from bfexp.progress import ConsoleProgress

        logger = build(cfg.logger, "logger")  # bfexp.loggers (validate built it once already)
        progress = ConsoleProgress(cfg.steps, title, enabled=logger.progress, epochs=cfg.epochs,
                                   budget_s=cfg.get("budget_s"))
        with progress, logger.tracker(cfg, run_dir) as tracker:
            try:
                PHASES.mark("progress display, tracker")
                result = launch(cfg, run_dir, on_record=lambda record: (progress.update(record), tracker.log(record)),
                                engine_choice=choice, early=early, launcher=launcher, checked=True)
                PHASES.mark("launch: the ranks, start to end")
            except (ConfigError, LaunchError) as e:  # e.g. a checkpoint of another experiment in the folder
                refuse(e)
            tracker.finish(result.summary)
    finally:
        if early is not None:
            early.cancel()  # bad input, a signal: the waiting ranks end unseen (no-op once they ran)
    report_job(cfg, result, run_dir, sweep_dir)
    return result.status


def not_run(run_dir: Path) -> str | None:
    """SKIPPED for a sweep job that finished in an earlier run of the sweep (its folder untouched), NOT_RUN
    after fail_fast stopped the sweep; None for a job to run."""
    if run_dir.parent.name == checkpoint.SKIPPED:
        finished = run_dir.parent.parent / run_dir.name
        shutil.rmtree(run_dir.parent, ignore_errors=True)
        status = (results.read_json(finished / results.SUMMARY) or {}).get("status")
        print(f"bfexp: job {finished.name} already {status} in {finished}: skipped, its folder untouched", flush=True)
        return results.SKIPPED
    if _current.get("stopped_sweep"):
        discard_unused(run_dir)
        return results.NOT_RUN
    return None


def report_job(cfg: Any, result: Any, run_dir: Path, sweep_dir: Path | None) -> None:
    """After a job: its summary on the terminal, a failure said at once (fail_fast stops the sweep), and a
    stop signal ends the driver (Interrupted) with the command that resumes."""
    from bfexp.errors import Interrupted
    from bfexp.progress import print_summary
    from bfexp.signals import SIGNALS

    if result.status == results.INTERRUPTED:
        result.summary["resume_command"] = resume_command(run_dir)
        with contextlib.suppress(OSError):
            results.write_json_atomic(run_dir / results.SUMMARY, result.summary)
    print_summary(result.summary, str(run_dir))
    if _current.get("verbose"):
        print_timing(run_dir)
    _job_statuses.append(result.status)
    if result.status == results.FAILED:  # said now, not only at the end of a sweep
        print(f"bfexp: job {run_dir.name} failed: {result.summary.get('error')}", file=sys.stderr, flush=True)
        if sweep_dir is not None and cfg.get("fail_fast"):
            _current["stopped_sweep"] = f"fail_fast=true: job {run_dir.name} failed"
            print("bfexp: fail_fast=true: the sweep's remaining jobs are not run", file=sys.stderr, flush=True)
    if result.status == results.INTERRUPTED or SIGNALS.received:
        signum = SIGNALS.received[0] if SIGNALS.received else signal.SIGTERM
        what = f"job {result.status}" + (" (it had finished training)" if result.status != results.INTERRUPTED else "")
        resume = f"; resume with: {_current['resume']}" if result.status == results.INTERRUPTED or sweep_dir else ""
        print(f"bfexp: {signal.Signals(signum).name}: {what}{resume}", file=sys.stderr, flush=True)
        raise Interrupted(signum)  # a sweep stops here too


def print_timing(run_dir: Path) -> None:
    """`--verbose`: where the job's wall time went, the driver's phases and rank 0's, slowest first."""
    ranks = (results.read_json(run_dir / results.LOGS_DIR / results.TIMING) or {}).get("spans", [])
    spans = PHASES.spans + ranks
    if not spans:
        return
    origin = min(s["start"] for s in spans)
    print("where the wall time went (--verbose), slowest first: seconds, who: phase [from .. to, s after the driver "
          "started]")
    for s in sorted(spans, key=lambda s: -s["seconds"]):
        begin = s["start"] - origin
        print(f"  {s['seconds']:6.2f}  {s['who']}: {s['phase']}  [{begin:.2f} .. {begin + s['seconds']:.2f}]")


def interrupted_early(signum: int) -> None:
    """A stop signal before the job's ranks started: say so in its folder, if it has one (cheaply:
    the driver is ending; the job's identity once torch is imported already)."""
    run_dir, cfg = _current.get("run_dir"), _current.get("cfg")
    if run_dir is None and "planned" in _current:  # Hydra made the folder; bfexp's code had not begun
        run_dir, cfg = _current["planned"]
    if run_dir is None or not run_dir.is_dir() or (run_dir / results.SUMMARY).exists():
        return
    summary: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # whatever of the config can be read cheaply
        summary = {k: cfg[k] for k in ("ranks", "seed", "batch_size", "lr")}
        if "torch" in sys.modules:  # the components' classes import cheaply now
            from bfexp.summary import job_identity

            summary = job_identity(cfg)
    summary.update(status=results.INTERRUPTED, error=f"interrupted by {signal.Signals(signum).name} before any rank started",
                   resume_command=_current.get("resume") or f"bfexp resume={run_dir}")
    with contextlib.suppress(OSError):
        results.write_json_atomic(run_dir / results.SUMMARY, summary)


@contextlib.contextmanager
def refused_here() -> Any:
    """Bad input found in a Hydra callback ends the driver there (one line, exit 2; 3 for the environment):
    Hydra turns a callback's exceptions into warnings and goes on, so they leave it as SystemExit."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from bfexp.errors import ConfigError, LaunchError

    try:
        yield
    except LaunchError as e:
        fail(str(e), EXIT_ENVIRONMENT)
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        fail(one_line(e))


def check_output_folder(config: Any, mode: str) -> None:
    """``hydra.run.dir=`` (or ``hydra.sweep.dir=``) empty: Hydra would write into the current folder."""
    from bfexp.errors import ConfigError

    if not str(config.hydra[mode].dir or "").strip():
        raise ConfigError(f"hydra.{mode}.dir={str(config.hydra[mode].dir or '')!r}; allowed: a folder path "
                          f"(default: {'outputs' if mode == 'run' else 'multirun'}/<date>/<time>)")


def sweep_points(config: Any) -> list[tuple[list[str], Any]]:
    """Every job of a sweep as Hydra's basic sweeper will run it: (its sweep overrides, its composed config
    without the hydra node)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    loader = GlobalHydra.instance().config_loader()
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(config.hydra.overrides.task))
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    points = []
    for batch in BasicSweeper.split_arguments(parsed, None):
        for overrides in batch:
            job = loader.load_sweep_config(config, list(overrides))
            with open_dict(job):
                del job["hydra"]
            points.append(([o for o in overrides if o.partition("=")[0] in swept], job))
    return points


def check_sweep(config: Any) -> None:
    """Every point of a sweep composed and checked as ``run_job`` checks a job, before the first job starts:
    ``-m lr=0.1,-1`` is refused (one line, exit 2) before ``lr=0.1`` trains, and no folder is made. Options
    that name a rank or a step are checked against the largest job (``check_reach``). A Slurm sweep's
    ranks run elsewhere: this machine's memory is not theirs to check."""
    from bfexp.config import check_fail_step, check_reach, job_kind, validate
    from bfexp.errors import ConfigError
    from bfexp.preflight import resolve_engine

    here = "slurm" not in str(config.hydra.launcher.get("_target_", "")).lower()
    points = sweep_points(config)
    ranks = max(int(job.ranks) for _, job in points)
    steps = max(int(job.steps) for _, job in points)
    counted = []  # the jobs that count epochs: their steps are known after their dry build
    for swept, job in points:
        try:
            validate(job)
            check_reach(job, ranks, steps)
            if job_kind(job) != "modeled":
                job, _ = resolve_engine(job)
            built = dry_build(job, here=here)
        except ConfigError as e:
            raise type(e)(f"{e}{sweep_point(points, swept)}") from None
        if job.epochs is not None:
            counted.append((swept, job, built.steps))
    if counted and all(n is not None for _, _, n in counted):
        longest = max([n for _, _, n in counted] + [int(job.steps) for _, job in points if job.epochs is None])
        for swept, job, _ in counted:  # against the longest job: a point is named only where fail_step is swept
            try:
                check_fail_step(job, longest, sweep=len(points) > 1)
            except ConfigError as e:
                named = [o for o in swept if o.startswith("fail_step=")]
                raise type(e)(f"{e}{sweep_point(points, named)}") from None


def sweep_point(points: list, swept: list[str]) -> str:
    """`` (sweep point lr=-1)``: which job of a sweep an error is about; nothing for a one-job sweep."""
    return f" (sweep point {' '.join(swept)})" if len(points) > 1 and swept else ""


class RunFolders:
    """Hydra callback (conf/config.yaml): remembers the folders Hydra makes before bfexp's code runs,
    so a sweep that fails to compose a job leaves no folder behind, and a signal that arrives
    before the job's code runs still leaves a summary saying so. Other moments: nothing."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        with refused_here():  # before Hydra makes the sweep folder
            check_output_folder(config, "sweep")
            found = busy_job(sweep) if sweep.is_dir() else None
            if found:  # nor writes multirun.yaml there
                busy("hydra.sweep.dir", sweep, f"job {found[0].name}: {found[1]}")
            check_sweep(config)
        _current["sweep_dir"] = sweep

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        """The run folder is held from here, before Hydra writes its .hydra/ there."""
        with refused_here():  # before Hydra makes the run folder
            check_output_folder(config, "run")
        run_dir = Path(str(config.hydra.run.dir))
        try:
            holder = results.lock_folder(run_dir)
        except OSError:  # a folder that cannot be made: Hydra's attempt says why
            holder = None
        if holder:
            busy("hydra.run.dir", run_dir, holder)
        _current["planned"] = (run_dir, config)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        for key in ("run_dir", "cfg", "resume"):  # the sweep's previous job is over
            _current.pop(key, None)
        _current["planned"] = (Path(str(config.hydra.runtime.output_dir)), config)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda **kwargs: None
        raise AttributeError(name)


def _discard_sweep_folder() -> None:
    """A sweep that failed to compose a job: the sweep folder Hydra made (only multirun.yaml in it) goes."""
    sweep = _current.get("sweep_dir")
    if sweep is not None:
        discard_unused(sweep / checkpoint.SKIPPED, sweep)


def _hydra_entry() -> None:
    import hydra

    from bfexp.config import register_configs
    from bfexp.hydra_internals import known_mode
    from bfexp.launchers.slurm_sweep import register_plugin

    register_configs()
    register_plugin()
    with known_mode(sys.argv[1:]):  # Hydra would compose the configuration one more time only to learn it
        hydra.main(version_base=None, config_path="pkg://bfexp.conf", config_name="config")(run_job)()


def main() -> None:
    """The `bfexp` command (``command``). Once torch is loaded it ends without the interpreter's
    final garbage collection, which then takes seconds (a stopped job must end promptly) and
    frees nothing the operating system does not. A crash of the driver (virtual ranks are its threads)
    prints every thread's Python stack (faulthandler), so it can be told apart from a rank's error.
    Output to a pipe or terminal that closed goes nowhere; the run goes on (bfexp.signals)."""
    from bfexp.signals import tolerate_closed_output

    tolerate_closed_output()  # `bfexp ... | head -1`, a closed terminal: the run goes on, its summary written
    faulthandler.enable(all_threads=True)
    try:
        command(sys.argv[1:])
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    if "torch" not in sys.modules:  # --help, --cfg job, bad input caught early: nothing slow to skip
        sys.exit(code)
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def command(args: list[str]) -> None:
    """bfexp's command line: help, or Hydra composing the jobs (``run_job``); exits 2 on bad input,
    1 when a job failed, 128 + the signal's number when a signal stopped it."""
    if any(a in ("-h", "--help") for a in args):
        print_help()
        return
    if "--verbose" in args:  # bfexp's, not Hydra's: where the wall time went, after each job
        args = [a for a in args if a != "--verbose"]
        _current["verbose"] = True
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from bfexp.errors import ConfigError

    # A user's own `_target_` classes in the working folder import as they would under `python -m`
    # (the ranks, started with `python -m`, see the same folder).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    debug = os.environ.get("BFEXP_DEBUG") == "1"
    # Let Hydra's errors reach us instead of being printed over many lines.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from bfexp.errors import Interrupted, LaunchError
    from bfexp.signals import SIGNALS

    SIGNALS.install()  # SIGINT/SIGTERM/SIGHUP/SIGUSR1: a running job stops at a checkpoint, otherwise we end here
    try:
        sys.argv[1:] = hydra_argument_order(resume_arguments(args))
        refuse_bad_flags(sys.argv[1:])
        _hydra_entry()
    except Interrupted as e:
        interrupted_early(e.signum)
        sys.exit(128 + e.signum)
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        if debug:
            raise
        _discard_sweep_folder()
        fail(one_line(e))
    except LaunchError as e:  # a sweep's Slurm submission, e.g. no sbatch here
        if debug:
            raise
        _discard_sweep_folder()
        fail(str(e), EXIT_ENVIRONMENT)
    except ValueError as e:  # Hydra's checks of its flags before any job, e.g. -m with --cfg
        if debug or "run_dir" in _current or "planned" in _current:
            raise
        fail(one_line(e))
    except OSError as e:
        if debug or "run_dir" in _current:  # a job was under way: not the output folder's fault
            raise
        fail(f"cannot create the output folder: {e.strerror or e}: {e.filename}; "
             "allowed: a folder path where this user can create folders")
    except KeyboardInterrupt:
        sys.exit(130)
    from bfexp.launchers.slurm_sweep import statuses as slurm_statuses  # jobs a Slurm sweep ran

    if any(s == results.FAILED for s in _job_statuses + slurm_statuses):
        sys.exit(EXIT_JOB_FAILED)


if __name__ == "__main__":
    # `python -m bfexp.cli`: run the imported module, not this __main__ copy of it. Hydra's callback
    # (RunFolders) is bfexp.cli's; with two copies it would note the run folder where a signal
    # before the job's code (interrupted_early) cannot see it, and no summary would be written.
    import bfexp.cli

    bfexp.cli.main()
