"""Every option of every config group composes and runs a small job.

Options are discovered from conf/, so a new option is covered the day it
lands. EXTRA gives an option the context it needs to run small here.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from bfexp.cli import GROUPS, group_options

# Overrides an option needs to run small on this machine.
EXTRA: dict[tuple[str, str], list[str]] = {
    ("topology", "random_regular"): ["topology.degree=1"],
    ("topology", "inner_outer_exp2"): ["engine.ranks_per_machine=1"],
    ("model", "cnn"): ["dataset=digits"],
    # 25.6M parameters: 16x16 synthetic images, tiny batches, one-step probes, no reference cache.
    ("model", "resnet50"): ["dataset.features=768", "dataset.eval_samples=8", "batch_size=4", "lr=0.01",
                            "baseline_steps=1", "scaling.reference_steps=1", "scaling.reference_cache=null"],
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
if importlib.util.find_spec("wandb") is None:
    UNAVAILABLE[("logger", "wandb")] = "wandb is an optional extra: pip install 'bfexp[wandb]'"


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


@pytest.mark.parametrize("group, option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_and_runs(bfexp, group, option):
    if (group, option) in UNAVAILABLE:
        pytest.skip(UNAVAILABLE[(group, option)])
    args = [f"{group}={option}", "ranks=2", "steps=4", "log_every=2", "hydra.run.dir=run",
            *engine_for(group, option), *EXTRA.get((group, option), [])]
    proc = bfexp(*args)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    summary = json.loads((bfexp.cwd / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    if group in ("algorithm", "model", "dataset"):
        assert summary[group] == option
