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
import time
from pathlib import Path
from typing import Any, NoReturn

from bfexp import checkpoint, results
from bfexp.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_JOB_FAILED
from bfexp.plan import PLAN

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
  eval_every, eval_every_s, eval_budget, eval_points, eval_subset, timeout_s, checkpoint_every, fail_fast,
  skip_invalid, throughput_only, baseline_steps, report
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


def top_level_type(key: str) -> str:
    """What a top-level key takes, from the schema (bfexp.schema.Config), for a message; a value of the key's
    type for any other key."""
    import dataclasses
    import typing

    from bfexp.components import describe
    from bfexp.schema import Config

    found = {f.name: f for f in dataclasses.fields(Config)}.get(key)
    if found is None:
        return "a value (`bfexp --cfg job` shows the key's default)"
    hints = typing.get_type_hints(Config)
    return f"{describe(hints.get(key, found.type))} (default {found.default!r})"


def near_keys(key: str, parent: Any) -> str:
    """`` (did you mean 'steps'?)`` for a misspelt key, from the keys beside it (``parent``: the config node
    it is missing from); nothing when none is close or the node is unknown."""
    import difflib

    try:
        keys = [str(k) for k in parent.keys() if str(k) != "hydra"] if parent is not None else []
    except Exception:  # a node that cannot list its keys
        return ""
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


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
        m = re.search(r"Could not override '([^']+)'\. No match in the defaults list", str(e))
        if m and m.group(1) in ("experiment",):  # a group that adds to the config rather than choosing an option
            return (f"{m.group(1)}=... adds a named study to the config, which Hydra spells with a +; allowed: "
                    f"+{m.group(1)}=NAME, NAME one of {', '.join(group_options(m.group(1)))}")
    for e in chain:
        m = re.search(r"Key '([^']+)' (?:is )?not in (?:struct|'([^']+)')", str(e))
        if m:
            key = getattr(e, "full_key", None) or m.group(1)
            return f"unknown key '{key}'{near_keys(m.group(1), getattr(e, 'parent_node', None))}; " \
                   "`bfexp --cfg job` lists the keys this config has"
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            first = str(e).strip().splitlines()[0]
            if "is not Optional" in first:  # key=null for a key that takes a value
                return f"{e.full_key}=null; allowed: {top_level_type(str(e.full_key))}"
            return f"{e.full_key}: {first}"
    text = str(exc).strip().splitlines()
    m = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", text[0] if text else "")
    if m:  # key=a,b outside a sweep: Hydra cannot tell a list from a sweep over two values
        key, value = m.groups()
        return (f"{key}={value} is ambiguous (commas make a sweep); allowed: a list {key}=[{value}], one "
                f"string {key}='\"{value}\"', or a sweep over its values with -m")
    return text[0] if text else type(exc).__name__


def discard_unused(run_dir: Path, sweep_dir: Path | None = None) -> None:
    """Remove a run folder that holds nothing but what Hydra wrote on its way to our code (.hydra/,
    its job log) and the job's plan (refused after it was written), and the parents left empty; never a folder
    that was there before this driver began (``note_existing``: a resumed folder, or one a user named); a sweep folder left with only multirun.yaml too.
    Bad input leaves no folder behind; a folder with anything of a run in it stays."""
    def only_hydra(folder: Path) -> bool:
        return folder.is_dir() and all(p.name in (".hydra", results.LOCK, PLAN) or (p.is_file() and p.suffix == ".log")
                                       for p in folder.iterdir())

    cwd = Path.cwd().resolve()
    existed = _current.get("existed", set())
    folders = [run_dir] if only_hydra(run_dir) and run_dir.resolve() not in existed else []
    if sweep_dir is not None and sweep_dir.is_dir():
        others = [p for p in sweep_dir.iterdir() if p != run_dir and p.name != "multirun.yaml"]
        if (not others or others == [sweep_dir / checkpoint.SKIPPED]) and sweep_dir.resolve() not in existed:
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


def note_existing(folder: Path) -> None:
    """Remember that ``folder`` was there before this driver made anything: discard_unused leaves it."""
    if folder.exists():
        _current.setdefault("existed", set()).add(folder.resolve())


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
    code = [o for o in kept if "_target_" in override_key(o).split(".") or "_target_" in o.partition("=")[2]]
    if code:  # a folder's record (one someone shared) chooses no code: the user names it, or it is not run
        keys = " ".join(sorted({override_key(o) for o in code}))
        fail(f"resume={folder}: its saved overrides name code to run ({'; '.join(code[:3])}), which a saved folder "
             f"may not choose; allowed: give {keys} yourself beside resume= (the value you trust replaces the saved one)")
    return [*mode, *rest, *kept, f"{key}={quote(str(folder))}"]


def saved_overrides(path: Path) -> Any:
    """The overrides Hydra saved in a run's hydra.yaml or a sweep's multirun.yaml (``hydra.overrides``, with
    its ``hydra`` and ``task`` lists); ConfigError naming the file when it cannot be read as one, or when
    another Hydra app wrote it (its primary config source is not bfexp's): its folder is not bfexp's to
    run in, overwrite or clean up."""
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
    other = other_program(saved)
    if other:
        raise ConfigError(f"resume: {path} was written by another program (its primary config: {other}; bfexp's "
                          "is pkg://bfexp.conf), and bfexp resumes, writes into or removes only what it wrote; "
                          "allowed: a folder a bfexp run or sweep wrote")
    return overrides


def other_program(saved: Any) -> str | None:
    """The primary config source of another Hydra app that wrote ``saved`` (a hydra.yaml or multirun.yaml as
    loaded), e.g. ``file:///lab/conf`` or "none"; None when bfexp wrote it (its primary source: pkg://bfexp.conf)."""
    from omegaconf import DictConfig, OmegaConf

    sources = OmegaConf.select(saved, "hydra.runtime.config_sources", default=None) if isinstance(saved, DictConfig) \
        else None
    main = [s for s in sources or [] if isinstance(s, DictConfig) and s.get("provider") == "main"]
    if [(s.get("schema"), s.get("path")) for s in main] == [("pkg", "bfexp.conf")]:
        return None
    return f"{main[0].get('schema')}://{main[0].get('path')}" if main else "none"


HYDRA_RECORDS = ("config.yaml", "overrides.yaml")  # what Hydra writes into a run's .hydra/ beside hydra.yaml


def refuse_foreign(key: str, folder: Path, record: Path) -> None:
    """A run or sweep folder another program's Hydra record is in (``record``): refused before Hydra writes
    its own record over it (ConfigError: one line, exit 2, the folder untouched). An unreadable record is
    left to the checks that read it."""
    from omegaconf import OmegaConf

    from bfexp.errors import ConfigError

    from bfexp.files import MiB, read_file

    for path in (record, *[record.parent / n for n in HYDRA_RECORDS if record.parent.name == ".hydra"]):
        if os.path.lexists(path) and not (path.is_file() and not path.is_symlink()):  # Hydra would write into it
            raise ConfigError(f"{key}={folder}: {path} is not a regular file, and Hydra writes its record there "
                              "(into a FIFO it would wait forever, through a link it would overwrite another file); "
                              "allowed: a new folder, or one a bfexp run or sweep wrote")
    try:  # bounded, and a FIFO or device is not read at all (read_file refuses it)
        other = other_program(OmegaConf.create(read_file(record, 64 * MiB).decode())) if record.exists() else None
    except Exception:  # yaml's, OmegaConf's, undecodable bytes, not a file: not a record this check can read
        return
    if other:
        raise ConfigError(f"{key}={folder} holds another program's Hydra record ({record.name}, primary config "
                          f"{other}); allowed: a new folder, or one a bfexp run or sweep wrote")


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
    from bfexp.hydra_internals import flag_actions

    options = flag_actions()
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
    from bfexp.hydra_internals import parse_flags

    for arg in args:  # Hydra's parser recurses once per level: 3,000 brackets end in 2,000 lines of traceback
        depth = deepest(arg)
        if depth > MAX_NESTING:
            key = arg.partition("=")[0]
            fail(f"{key}=... nests {depth} levels of brackets; allowed: at most {MAX_NESTING} (a list or mapping "
                 "of lists, e.g. [[1,2],[3,4]])")
    parse_flags(args, lambda message: fail(f"{message}; Hydra's flags: bfexp --hydra-help"))


MAX_NESTING = 32  # levels of [ and { in one override


def deepest(text: str) -> int:
    """The deepest nesting of brackets in ``text`` (quoted ones too: an estimate that errs toward refusing only
    what no config needs)."""
    depth = most = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            most = max(most, depth)
        elif ch in "]})":
            depth = max(0, depth - 1)
    return most


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


def split_loggers(logger: Any, overrides: Any) -> Any:
    """``logger=[wandb,tensorboard]``: a logger node that holds each named logger's own (bfexp.loggers.several),
    where Hydra merged them into ``logger``; ``logger`` itself for one option."""
    from omegaconf import OmegaConf

    from bfexp.loggers import several

    node = several(list(overrides), OmegaConf.to_container(logger, resolve=False) if logger is not None else {})
    return logger if node is None else node


def run_job(cfg: Any) -> str:
    """One job: validate, dry-build, launch, report. Returns the job's status.

    Bad input ends the driver here (one line, exit 2, no folder left); a
    failed job is announced at once; in a sweep, a finished job's folder is
    skipped untouched, and fail_fast=true skips the jobs after a failed one.
    The driver holds the job's folder (results.lock_folder) while it runs the job.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    PHASES.mark("start: python, Hydra, compose")
    with open_dict(cfg):  # logger=[wandb,tensorboard]: each logger its own node
        cfg.logger = split_loggers(cfg.get("logger"), HydraConfig.get().overrides.task)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    sweep_dir = Path(str(HydraConfig.get().sweep.dir)) if HydraConfig.get().mode == RunMode.MULTIRUN else None
    _current.update(run_dir=run_dir, cfg=cfg, resume=resume_command(run_dir))
    passed = not_run(run_dir)
    refusal = refused_here_point(sweep_dir) if not passed else None
    if refusal is not None:  # the sweep's check refused it (skip_invalid=true): no folder, a line, the report
        print(f"bfexp: job {run_dir.name} skipped: {refusal}", file=sys.stderr, flush=True)
        discard_unused(run_dir)
        passed = results.NOT_RUN
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
    """``run_job``'s job in its held folder, a column: validate -> plan (with the preflight) -> launch -> report.
    Bad input ends the driver here (SystemExit passes through Hydra untouched: one line, exit 2 or 3), before
    any rank starts on its work."""
    from omegaconf import OmegaConf

    from bfexp.config import Settings, check_fail_step, validate
    from bfexp.errors import ConfigError, LaunchError
    from bfexp.launch import launch
    from bfexp.plan import make_plan
    from bfexp.summary import job_identity

    early: list[Any] = []  # the job's ranks, started while the driver checks it (they wait for the word to go)
    try:
        try:
            validate(cfg, reach=sweep_dir is None)  # a sweep's jobs: against each other, before the first (check_sweep)
            settings = Settings.of(cfg)  # the run's own section, for what reads the run's values
            PHASES.mark("validate")
            plan = make_plan(cfg, placed=lambda engine, launcher: early.extend(
                start_early(engine, settings, run_dir, launcher)))
            if sweep_dir is None and settings.epochs is not None and plan.steps is not None:  # fail_step=50 epochs=1
                check_fail_step(settings, plan.steps)
            PHASES.mark("plan: engine choice, preflight, dry build")
        except (ConfigError, LaunchError) as e:
            refuse(e, run_dir, sweep_dir, early)
        for note in plan.notes:
            print(f"note: {note}", flush=True)
        plan.write(run_dir)  # what the ranks build must match (it goes again if the launch refuses the job)
        with job_display(plan, settings, run_dir, logger=plan.cfg.logger, identity=job_identity(plan.cfg),
                         resolved=OmegaConf.to_container(plan.cfg, resolve=True)) as (on_record, ended):
            try:
                result = launch(plan.cfg, run_dir, on_record=on_record, engine_choice=plan.engine_choice,
                                early=early[0] if early else None, launcher=plan.launcher, checked=True)
                PHASES.mark("launch: the ranks, start to end")
            except (ConfigError, LaunchError) as e:  # e.g. a checkpoint of another experiment in the folder
                (run_dir / PLAN).unlink(missing_ok=True)  # nothing of bfexp's left in a folder it did not empty
                refuse(e, run_dir, sweep_dir, early)
            ended.append(result.summary)
    finally:
        for ranks in early:
            ranks.cancel()  # bad input, a signal: the waiting ranks end unseen (no-op once they ran)
    report_job(result, run_dir, sweep_dir, fail_fast=settings.fail_fast)
    return result.status


def start_early(engine: Any, settings: Any, run_dir: Path, launcher: Any) -> list[Any]:
    """The job's ranks started now, where their start-up overlaps torch's import and the driver's checks
    (they wait for the word to go); none where the launcher cannot do so. ``engine``: the engine's node
    (engine=auto's choice), ``settings``: the run's (bfexp.schema.Settings)."""
    from bfexp.sessions import EarlyRanks

    if not EarlyRanks.wanted(engine, int(settings.ranks), launcher):
        return []
    ranks = EarlyRanks(engine, settings, run_dir, launcher)
    PHASES.mark("ranks started early (they wait for the checks)")
    return [ranks]


def refuse(e: Exception, run_dir: Path, sweep_dir: Path | None, early: list[Any]) -> NoReturn:
    """A job refused: its early ranks cancelled first (the log folder their start made goes, so discard_unused
    finds Hydra's alone), its folder discarded, one line and the exit code of whose fault it is."""
    from bfexp.errors import LaunchError

    for ranks in early:
        ranks.cancel()
    discard_unused(run_dir, sweep_dir)
    fail(str(e), EXIT_ENVIRONMENT if isinstance(e, LaunchError) else EXIT_BAD_INPUT)


@contextlib.contextmanager
def job_display(plan: Any, settings: Any, run_dir: Path, *, logger: Any, identity: dict, resolved: dict) -> Any:
    """The terminal's progress line and the logger's tracker while a job runs; yields what each metrics
    record goes to and a list where the caller puts the job's summary (the tracker's last word). ``plan``:
    the job's (its labels, ranks), ``settings``: the run's (steps, epochs, budget), ``logger``: the logger's
    node; the tracker records the job's ``identity`` (summary.job_identity) and its ``resolved`` config."""
    from bfexp.config import build
    from bfexp.progress import ConsoleProgress

    tracking = build(logger, "logger")  # bfexp.loggers (validate built it once already)
    progress = ConsoleProgress(settings.steps, f"{plan.algorithm}/{plan.topology} x{plan.ranks}",
                               enabled=tracking.progress, epochs=settings.epochs, budget_s=settings.budget_s)
    with progress, tracking.tracker(identity, resolved, run_dir) as tracker:
        PHASES.mark("progress display, tracker")
        ended: list[dict] = []
        yield (lambda record: (progress.update(record), tracker.log(record))), ended
        tracker.finish(ended[-1])


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


def report_job(result: Any, run_dir: Path, sweep_dir: Path | None, fail_fast: bool = False) -> None:
    """After a job: its summary on the terminal, a failure said at once (``fail_fast`` stops the sweep), and a
    stop signal ends the driver (Interrupted) with the command that resumes."""
    from bfexp.errors import Interrupted
    from bfexp.progress import print_summary, print_sweep_job
    from bfexp.signals import SIGNALS

    if result.status == results.INTERRUPTED:
        result.summary["resume_command"] = resume_command(run_dir)
        with contextlib.suppress(OSError):
            results.write_json_atomic(run_dir / results.SUMMARY, result.summary)
    sweep = _current.get("sweep")  # (points, when the first job began, jobs done) of the sweep under way here
    if sweep_dir is not None and sweep is not None:  # one line a job, the sweep's table at its end
        sweep["done"] += 1
        per_job = (time.monotonic() - sweep["started"]) / sweep["done"]
        print_sweep_job(result.summary, str(run_dir), sweep["done"], sweep["points"],
                        per_job * (sweep["points"] - sweep["done"]))
    else:
        print_summary(result.summary, str(run_dir))
    if _current.get("verbose"):
        print_timing(run_dir)
    _job_statuses.append(result.status)
    if result.status == results.FAILED:  # said now, not only at the end of a sweep
        print(f"bfexp: job {run_dir.name} failed: {result.summary.get('error')}", file=sys.stderr, flush=True)
        if sweep_dir is not None and fail_fast:
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


def refuse_sweep_launcher_alone(config: Any) -> None:
    """``hydra/launcher=slurm`` without -m: Hydra runs a single job here and never asks the sweep launcher,
    so the job would run on this machine, not where it was sent (ConfigError instead)."""
    from bfexp.errors import ConfigError
    from bfexp.launchers.sweep import runs_here

    if not runs_here(config.hydra.launcher):
        name = config.hydra.runtime.choices.get("hydra/launcher") or config.hydra.launcher.get("_target_")
        raise ConfigError(f"hydra/launcher={name} submits the jobs of a sweep, and this command is one job (no -m), "
                          f"which would run here; allowed: -m with hydra/launcher={name} (a sweep of one point "
                          "is one submitted job), or launcher=srun inside an allocation")


def check_output_folder(config: Any, mode: str) -> None:
    """``hydra.run.dir=`` (or ``hydra.sweep.dir=``) empty: Hydra would write into the current folder."""
    from bfexp.errors import ConfigError

    if not str(config.hydra[mode].dir or "").strip():
        raise ConfigError(f"hydra.{mode}.dir={str(config.hydra[mode].dir or '')!r}; allowed: a folder path "
                          f"(default: {'outputs' if mode == 'run' else 'multirun'}/<date>/<time>)")


def sweep_points(config: Any) -> list[tuple[list[str], Any]]:
    """Every job of a sweep as Hydra's basic sweeper will run it: (its sweep overrides, its composed config
    without the hydra node)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    from bfexp.hydra_internals import sweep_batches

    loader = GlobalHydra.instance().config_loader()
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(config.hydra.overrides.task))
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    points = []
    for batch in sweep_batches(parsed):
        for overrides in batch:
            job = loader.load_sweep_config(config, list(overrides))
            with open_dict(job):  # logger=[wandb,tensorboard]: each logger its own node
                job.logger = split_loggers(job.get("logger"), job.hydra.overrides.task)
            with open_dict(job):
                del job["hydra"]
            points.append(([o for o in overrides if o.partition("=")[0] in swept], job))
    return points


def check_sweep(config: Any) -> list[tuple[list[str], str]]:
    """Every point of a sweep composed and checked as ``run_job`` checks a job, before the first job starts:
    ``-m lr=0.1,-1`` is refused (one line, exit 2) before ``lr=0.1`` trains, and no folder is made. Options
    that name a rank or a step are checked against the largest job (``check_reach``). A sweep launcher whose
    jobs run elsewhere (its class's ``runs_here``: Slurm's) leaves this machine's memory out of the check.
    ``skip_invalid=true``: the refused points are returned (overrides, reason) instead, unless all are."""
    from bfexp.config import Settings, check_fail_step, check_reach, validate
    from bfexp.errors import ConfigError
    from bfexp.launchers.sweep import runs_here
    from bfexp.plan import make_plan

    here = runs_here(config.hydra.launcher)  # the sweep launcher's class says (Slurm's, a PBS one: elsewhere)
    points = sweep_points(config)
    ranks = max(int(job.ranks) for _, job in points)
    steps = max(int(job.steps) for _, job in points)
    counted = []  # the jobs that count epochs: their steps are known after their dry build
    refused: list[tuple[list[str], str]] = []  # skip_invalid=true: the points left out, and why
    for swept, job in points:
        try:
            validate(job)
            check_reach(Settings.of(job), job.get("heterogeneity"), ranks, steps)
            plan = make_plan(job, here=here, preflight=False)
        except ConfigError as e:
            if not job.get("skip_invalid") or len(refused) + 1 == len(points):  # every point refused: the sweep is
                others = "; or skip_invalid=true to run the sweep's other points" \
                    if len(points) > 1 and not job.get("skip_invalid") else ""
                raise type(e)(f"{e}{sweep_point(points, swept)}{others}") from None
            refused.append((swept, str(e)))
            continue
        if job.epochs is not None:
            counted.append((swept, Settings.of(job), plan.steps))
    if counted and all(n is not None for _, _, n in counted):
        longest = max([n for _, _, n in counted] + [int(job.steps) for _, job in points if job.epochs is None])
        for swept, settings, _ in counted:  # against the longest job: a point is named only where fail_step is swept
            try:
                check_fail_step(settings, longest, sweep=len(points) > 1)
            except ConfigError as e:
                named = [o for o in swept if o.startswith("fail_step=")]
                raise type(e)(f"{e}{sweep_point(points, named)}") from None
    return refused


def record_refused(sweep: Path, refused: list[tuple[list[str], str]]) -> None:
    """skip_invalid=true: the refused points in the sweep folder (results.REFUSED, which every job of the sweep
    reads, wherever it runs, and the report lists), each said on stderr now."""
    path = sweep / results.REFUSED
    if not refused:
        if path.is_file():  # a resumed sweep whose points all run now: its old list goes (bfexp wrote it)
            path.unlink()
        return
    for swept, reason in refused:
        print(f"bfexp: sweep point {' '.join(swept)} refused, skipped (skip_invalid=true): {reason}",
              file=sys.stderr, flush=True)
    results.write_json_atomic(path, {"refused": [{"overrides": swept, "reason": reason} for swept, reason in refused]})


def refused_here_point(sweep_dir: Path | None) -> str | None:
    """The reason this sweep job was refused by the sweep's check (skip_invalid=true), None for a job to run."""
    from hydra.core.hydra_config import HydraConfig

    listed = (results.read_json(sweep_dir / results.REFUSED) or {}).get("refused", []) if sweep_dir else []
    task = set(HydraConfig.get().overrides.task)
    for point in listed:
        if set(point.get("overrides", [])) <= task:
            return str(point.get("reason"))
    return None


def sweep_point(points: list, swept: list[str]) -> str:
    """`` (sweep point lr=-1)``: which job of a sweep an error is about; nothing for a one-job sweep."""
    return f" (sweep point {' '.join(swept)})" if len(points) > 1 and swept else ""


class RunFolders:
    """Hydra callback (conf/config.yaml): remembers the folders Hydra makes before bfexp's code runs,
    so a sweep that fails to compose a job leaves no folder behind, and a signal that arrives
    before the job's code runs still leaves a summary saying so. Other moments: nothing."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        note_existing(sweep)
        with refused_here():  # before Hydra makes the sweep folder
            check_output_folder(config, "sweep")
            refuse_foreign("hydra.sweep.dir", sweep, sweep / "multirun.yaml")
            found = busy_job(sweep) if sweep.is_dir() else None
            if found:  # nor writes multirun.yaml there
                busy("hydra.sweep.dir", sweep, f"job {found[0].name}: {found[1]}")
            refused = check_sweep(config)
        sweep.mkdir(parents=True, exist_ok=True)  # Hydra's next step; the refused points' list goes there first
        record_refused(sweep, refused)
        _current["sweep_dir"] = sweep
        _current["sweep"] = {"points": len(sweep_points(config)), "started": time.monotonic(), "done": 0}

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        """The run folder is held from here, before Hydra writes its .hydra/ there."""
        run_dir = Path(str(config.hydra.run.dir))
        with refused_here():  # before Hydra makes the run folder
            check_output_folder(config, "run")
            refuse_foreign("hydra.run.dir", run_dir, run_dir / ".hydra" / "hydra.yaml")
            refuse_sweep_launcher_alone(config)
        note_existing(run_dir)
        try:
            with refused_here():  # e.g. a .lock that is a link or a folder: refused, nothing of it touched
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
    from bfexp.hydra_internals import known_mode, sweep_points_composed_once
    from hydra_plugins.bfexp_slurm_launcher.launcher import register_plugin

    register_configs()
    register_plugin()
    # Hydra would compose the configuration one more time only to learn the mode, and each sweep point three times
    with known_mode(sys.argv[1:]), sweep_points_composed_once():
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
    from bfexp.launchers.sweep import statuses as elsewhere  # jobs a sweep launcher ran elsewhere (Slurm's)

    if any(s == results.FAILED for s in _job_statuses + elsewhere):
        sys.exit(EXIT_JOB_FAILED)


if __name__ == "__main__":
    # `python -m bfexp.cli`: run the imported module, not this __main__ copy of it. Hydra's callback
    # (RunFolders) is bfexp.cli's; with two copies it would note the run folder where a signal
    # before the job's code (interrupted_early) cannot see it, and no summary would be written.
    import bfexp.cli

    bfexp.cli.main()
