"""Every option of every config group composes and runs a small job.

Options are discovered from conf/, so a new option is covered the day it
lands. EXTRA gives an option the context it needs to run small here.

Every job goes through bfexp's real command line, all of them in one
interpreter (tests/cli_in_process.py), each in a folder of its own: the
jobs' ranks are the real ones (virtual ranks, or MPI processes started by
mpiexec for the engines, the launchers and ddp), without an interpreter and
torch start per option.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import yaml

from bfexp.cli import GROUPS, group_options
from tests.cli_in_process import calls, ran

# Overrides an option needs to run small on this machine.
EXTRA: dict[tuple[str, str], list[str]] = {
    ("topology", "random_regular"): ["topology.degree=1"],
    ("topology", "inner_outer_exp2"): ["engine.ranks_per_machine=1"],
    ("model", "cnn"): ["dataset=digits"],
    # 25.6M parameters: 16x16 synthetic images, tiny batches, two steps (one log), one-step probes, no
    # reference cache.
    ("model", "resnet50"): ["dataset.features=768", "dataset.eval_samples=8", "batch_size=4", "lr=0.01",
                            "steps=2", "baseline_steps=1", "scaling.reference_steps=1",
                            "scaling.reference_cache=null"],
    # A language model needs text, and text a language model: both tiny.
    ("model", "gpt"): ["dataset=text", "dataset.block_size=16", "dataset.eval_samples=8", "model.n_embd=16",
                       "model.n_layer=1", "batch_size=8"],
    ("dataset", "text"): ["model=gpt", "dataset.block_size=16", "dataset.eval_samples=8", "model.n_embd=16",
                          "model.n_layer=1", "batch_size=8"],
    ("dataset", "mnist"): ["dataset.root=${oc.env:BFEXP_TEST_MNIST}"],
    ("dataset", "cifar10"): ["dataset.root=${oc.env:BFEXP_TEST_CIFAR10}"],
    # A graph file of the tests' own (2 ranks, one edge each way).
    ("topology", "file"): [f"topology.path={Path(__file__).parent / 'topology' / 'data' / 'pair.edges'}"],
    # mpirun over this machine, named as a host of two slots.
    ("launcher", "mpirun"): ["launcher.hosts=localhost:2"],
}
# Options that cannot run here, with the reason (checked at collection time).
UNAVAILABLE: dict[tuple[str, str], str] = {}
if not os.environ.get("SLURM_JOB_ID"):
    UNAVAILABLE[("launcher", "srun")] = "launcher=srun runs inside a Slurm allocation (tests/test_slurm.py runs it)"
# The emulated cluster's: its jobs run in a folder every host sees (not this machine's /tmp) while it is up.
UNAVAILABLE[("launcher", "emulated")] = "launcher=emulated runs on the emulated cluster (tests/test_bandwidth_study.py)"
UNAVAILABLE[("scaling", "emulated")] = "scaling=emulated prices launcher=emulated's jobs (tests/test_bandwidth_study.py)"
if importlib.util.find_spec("wandb") is None:
    UNAVAILABLE[("logger", "wandb")] = "wandb is an optional extra: pip install 'bfexp[wandb]'"
if importlib.util.find_spec("tensorboard") is None:
    UNAVAILABLE[("logger", "tensorboard")] = "tensorboard is an optional extra: pip install 'bfexp[tensorboard]'"


def _nccl_unavailable() -> None:
    from bfexp.comm.nccl import nccl_available

    ok, reason = nccl_available(2)
    if not ok:
        UNAVAILABLE[("engine", "nccl")] = f"engine=nccl needs 2 GPUs with CuPy and NCCL: {reason}"


_nccl_unavailable()

CASES = [(g, o) for g in GROUPS for o in group_options(g)]
# Options of the other groups run on virtual ranks: the same worker, algorithm
# and topology code as MPI ranks (bit for bit, tests/test_threads_equivalence.py)
# without a process launch per job. Engines run themselves; ddp needs processes.
NEEDS_PROCESSES = {("algorithm", "ddp")}


def engine_for(group: str, option: str) -> list[str]:
    if group in ("engine", "launcher") or (group, option) in NEEDS_PROCESSES:
        return []
    return ["engine=threads"]


# What makes a job small beyond its steps: no allreduce baseline and a one-step single-rank reference (tests/
# test_scaling.py runs both at their defaults). A scaling option keeps its reference: it is what it prices.
SMALL = {"baseline_steps": "0", "scaling.reference_steps": "1"}


def args_for(group: str, option: str) -> list[str]:
    extra = EXTRA.get((group, option), [])
    given = {o.partition("=")[0] for o in extra}
    small = [f"{k}={v}" for k, v in SMALL.items() if k not in given and (group != "scaling" or k == "baseline_steps")]
    base = {"ranks": "2", "steps": "4", "log_every": "2", "hydra.run.dir": "run"}
    return [f"{group}={option}", *(f"{k}={v}" for k, v in base.items() if k not in given),
            *engine_for(group, option), *small, *extra]


# The options in conf/config.yaml's defaults: naming one composes the job that leaving it out does.
DEFAULTS: dict[str, str] = {group: option
                            for entry in yaml.safe_load((Path(importlib.util.find_spec("bfexp.conf").origin).parent
                                                         / "config.yaml").read_text())["defaults"]
                            if isinstance(entry, dict) for group, option in entry.items()}
# Options run in the job of another option rather than in one of their own (each of them would be a job of MPI
# processes that starts an interpreter and torch per rank): engine=mpi's job is launcher=mpirun's with engine=mpi
# named; engine=auto's (launcher=local's: the same job) is algorithm=ddp's, which runs on engine=auto's choice
# under the local launcher anyway. The default algorithm on engine=auto under launcher=local is every default job
# of the other tests.
RUN_WITH: dict[tuple[str, str], tuple[str, str]] = {("engine", "mpi"): ("launcher", "mpirun"),
                                                    ("engine", "auto"): ("algorithm", "ddp"),
                                                    ("launcher", "local"): ("algorithm", "ddp")}


def job_args(group: str, option: str) -> list[str]:
    """The command line that runs ``group=option``: its own, with the options that run with it (RUN_WITH), or
    that of the option it runs with."""
    if (group, option) in RUN_WITH:
        return job_args(*RUN_WITH[(group, option)])
    return [*args_for(group, option), *(f"{g}={o}" for (g, o), host in RUN_WITH.items() if host == (group, option))]


def job_key(args: list[str]) -> tuple[str, ...]:
    """What identifies the job a command line composes: its overrides, less any that names a group's default
    option. Options whose command lines compose the same job share it (e.g. engine=auto's job is launcher=local's,
    and every default option on threads is the same small job)."""
    return tuple(sorted(a for a in args if a.partition("=")[0] not in DEFAULTS
                        or DEFAULTS[a.partition("=")[0]] != a.partition("=")[2]))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Every option that can run here, through the CLI in one interpreter: {id: exit code, output, summary}."""
    root = tmp_path_factory.mktemp("options")
    runs: dict[tuple[str, ...], dict] = {}  # one job per distinct job_key, in the folder of its first option
    of_option: dict[str, tuple[str, ...]] = {}
    for g, o in CASES:
        if (g, o) in UNAVAILABLE:
            continue
        args = job_args(g, o)
        key = of_option[f"{g}={o}"] = job_key(args)
        runs.setdefault(key, {"id": f"{g}={o}", "args": args, "folder": str(root / f"{g}-{o}")})
    env = {k: v for k, v in os.environ.items() if k != "BFEXP_DEBUG"}
    got = calls(list(runs.values()), timeout=1200, env=env)
    return {cid: {**got[runs[key]["id"]], "summary": got[runs[key]["id"]]["summaries"].get("run/summary.json")}
            for cid, key in of_option.items()}


@pytest.mark.parametrize("group, option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_and_runs(jobs, group, option):
    if (group, option) in UNAVAILABLE:
        pytest.skip(UNAVAILABLE[(group, option)])
    got = jobs[f"{group}={option}"]
    ran(got)
    summary = got["summary"]
    assert summary is not None and summary["status"] == "completed", got["stderr"] + got["stdout"]
    if group in ("algorithm", "model", "dataset"):
        assert summary[group] == option
