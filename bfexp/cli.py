"""`bfexp`: compose an experiment with Hydra, validate it, hand it to the launcher.

This module imports nothing heavy (no torch, no mpi4py): `--help`,
`--cfg job` and shell completion stay instant. Bad input ends here with one
line on stderr and exit code 2, before any rank starts.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import resources
from typing import Any, NoReturn

GROUPS = ("algorithm", "topology", "model", "dataset", "engine", "scaling", "logger")
EXIT_BAD_INPUT = 2
EXIT_JOB_FAILED = 1

# Status of every job this process ran (a multirun runs several).
_job_statuses: list[str] = []


def group_options(group: str) -> list[str]:
    """Options of a config group: the YAML files shipped in bfexp.conf/<group>/."""
    folder = resources.files("bfexp.conf").joinpath(group)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


HELP = """\
bfexp: declarative experiments for decentralized deep learning.

Usage: bfexp [KEY=VALUE ...]            one run
       bfexp -m KEY=V1,V2 [...]         a sweep (Hydra multirun)
       bfexp --cfg job [KEY=VALUE ...]  print the composed config, run nothing

Config groups (pick one option each, e.g. topology=ring):
{groups}

Top-level keys: ranks, seed, steps, epochs, batch_size, lr, dtype, log_every,
  timeout_s, optimizer.{{name,momentum,nesterov,weight_decay,betas}}
Options have their own keys, e.g. algorithm.style=awc, topology.base=3;
`bfexp --cfg job algorithm=dsgd` shows them all with their values.

Examples:
  bfexp                                             DSGD on exp2, 4 MPI ranks
  bfexp algorithm=allreduce model=mlp dataset=digits
  bfexp -m ranks=2,4 topology=ring,exp2             four jobs, one folder each

Results land in outputs/<date>/<time>/ (multirun/... for sweeps):
  config.yaml, metrics.jsonl, summary.json, logs/rank<N>.log, .hydra/
Hydra's own options: bfexp --hydra-help
"""


def print_help() -> None:
    rows = [f"  {g:<10} {', '.join(group_options(g))}" for g in GROUPS]
    print(HELP.format(groups="\n".join(rows)))


def fail(message: str) -> NoReturn:
    print(f"bfexp: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


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
    return text[0] if text else type(exc).__name__


def run_job(cfg: Any) -> str:
    """One job: validate, launch, report. Returns the job's status."""
    from hydra.core.hydra_config import HydraConfig
    from pathlib import Path

    from bfexp.config import validate
    from bfexp.launch import LaunchError, check_engine, job_identity, launch
    from bfexp.progress import ConsoleProgress, print_summary
    from bfexp.topology import build_topology

    # SystemExit passes through Hydra untouched: one line, exit 2, no ranks started.
    try:
        validate(cfg)
        topology = build_topology(cfg.topology, cfg.ranks, cfg.engine.ranks_per_machine)
        check_engine(cfg)  # e.g. engine=nccl without a GPU
        from bfexp.algorithms import resolve_job  # imports torch: only jobs that run get here
        from bfexp.launch import choose_engine

        engine = choose_engine(cfg)[0] if cfg.engine.name == "auto" else cfg.engine.name
        _, algorithm_note = resolve_job(cfg, topology, engine)  # e.g. exact diffusion on exp2's undirected form
    except (ValueError, LaunchError) as e:
        fail(str(e))
    if algorithm_note:
        print(f"note: {algorithm_note}", flush=True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    from bfexp.scaling import job_note

    note = job_note(cfg)  # e.g. more CPU ranks than cores: measured scaling is contention
    if note:
        print(f"note: {note}", flush=True)
    ident = job_identity(cfg)
    title = f"{ident['algorithm']}/{ident['topology']} x{cfg.ranks}"
    from bfexp.loggers import open_tracker

    progress = ConsoleProgress(cfg.steps, title, enabled=cfg.logger.progress, epochs=cfg.epochs)
    with progress, open_tracker(cfg, run_dir) as tracker:
        result = launch(cfg, run_dir, on_record=lambda record: (progress.update(record), tracker.log(record)))
        tracker.finish(result.summary)
    print_summary(result.summary, str(run_dir))
    _job_statuses.append(result.status)
    return result.status


def _hydra_entry() -> None:
    import hydra

    from bfexp.config import register_configs

    register_configs()
    hydra.main(version_base=None, config_path="pkg://bfexp.conf", config_name="config")(run_job)()


def main() -> None:
    args = sys.argv[1:]
    if any(a in ("-h", "--help") for a in args):
        print_help()
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from bfexp.config import ConfigError
    from bfexp.launch import LaunchError

    debug = os.environ.get("BFEXP_DEBUG") == "1"
    # Let Hydra's errors reach us instead of being printed over many lines.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_entry()
    except (ConfigError, LaunchError, HydraException, OmegaConfBaseException) as e:
        if debug:
            raise
        fail(one_line(e))
    except KeyboardInterrupt:
        sys.exit(130)
    if any(s == "failed" for s in _job_statuses):
        sys.exit(EXIT_JOB_FAILED)


if __name__ == "__main__":
    main()
