"""Every bad input is refused before any rank starts: one line on stderr naming the value and what is
allowed, exit 2, no traceback, and no folder left behind (Hydra makes the run folder before bfexp's
code runs; the CLI removes it again).

The cases cover every config group and every top-level key: wrong types, values out of range,
unknown keys and options, impossible combinations, missing files, an output folder that cannot be
made, more ranks than memory holds, a resume of a folder that is not a run. They run through the
CLI's own entry (`bfexp.cli.command`) one after another in ONE interpreter, each in a fresh
folder with Hydra's state cleared, so 50 cases cost seconds rather than 50 interpreter starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

# (case id, arguments, words the one line must contain)
CASES = [
    # top-level keys
    ("ranks-type", ["ranks=abc"], ["ranks", "abc"]),
    ("ranks-zero", ["ranks=0"], ["ranks=0", ">= 1"]),
    ("ranks-memory", ["ranks=100000", "engine=mpi"], ["ranks=100000", "memory", "engine=threads"]),
    ("seed-negative", ["seed=-1"], ["seed=-1", ">= 0"]),
    ("steps-zero", ["steps=0"], ["steps=0", ">= 1"]),
    ("steps-fraction", ["steps=1.5"], ["steps", "1.5"]),
    ("epochs-zero", ["epochs=0"], ["epochs=0", ">= 1"]),
    ("batch-size-zero", ["batch_size=0"], ["batch_size=0", ">= 1"]),
    ("lr-inf", ["lr=inf"], ["lr=inf", "> 0"]),
    ("lr-nan", ["lr=nan"], ["lr=nan", "> 0"]),
    ("lr-zero", ["lr=0"], ["lr=0", "> 0"]),
    ("lr-list", ["lr=[1,2]"], ["lr"]),
    ("dtype", ["dtype=int8"], ["dtype='int8'", "float32"]),
    ("log-every-zero", ["log_every=0"], ["log_every=0", ">= 1"]),
    ("divergence-loss", ["divergence_loss=-1"], ["divergence_loss=-1", "> 0"]),
    ("timeout-negative", ["timeout_s=-1"], ["timeout_s=-1", ">= 0"]),
    ("checkpoint-every-negative", ["checkpoint_every=-5"], ["checkpoint_every=-5", ">= 0"]),
    ("fail-fast-type", ["fail_fast=maybe"], ["fail_fast", "maybe"]),
    ("fail-rank-negative", ["fail_rank=-1"], ["fail_rank=-1", ">= 0"]),
    ("fail-step-zero", ["fail_step=0"], ["fail_step=0", ">= 1"]),
    ("fail-mode-word", ["fail_mode=explode"], ["fail_mode='explode'", "raise", "hang"]),
    ("fail-mode-threads", ["fail_rank=0", "fail_mode=kill", "engine=threads"], ["fail_mode=kill", "engine=mpi"]),
    ("throughput-only-type", ["throughput_only=sometimes"], ["throughput_only", "sometimes"]),
    ("baseline-steps-negative", ["baseline_steps=-1"], ["baseline_steps=-1", ">= 0"]),
    ("report-type", ["report=perhaps"], ["report", "perhaps"]),
    ("eval-every-zero", ["eval_every=0"], ["eval_every=0", ">= 1"]),
    ("eval-budget-zero", ["eval_budget=0"], ["eval_budget=0", "> 0"]),
    ("eval-subset-zero", ["eval_subset=0"], ["eval_subset=0", ">= 1"]),
    ("target-accuracy-range", ["target_accuracy=1.5"], ["target_accuracy=1.5", "a number in [0, 1]"]),
    ("target-eval-loss-zero", ["target_eval_loss=0"], ["target_eval_loss=0", "> 0"]),
    # heterogeneity (stragglers)
    ("heterogeneity-option", ["heterogeneity=nosuch"], ["heterogeneity=nosuch", "stragglers"]),
    ("heterogeneity-factor", ["heterogeneity=stragglers", "heterogeneity.factor=0.5"], ["heterogeneity.factor=0.5", ">= 1"]),
    ("heterogeneity-delay-word", ["heterogeneity.delay=gaussian"], ["heterogeneity.delay='gaussian'", "exponential"]),
    ("heterogeneity-delay-mean", ["heterogeneity.delay=uniform"], ["heterogeneity.delay_s=0.0", "> 0"]),
    ("heterogeneity-pause", ["heterogeneity.pause_probability=2"], ["heterogeneity.pause_probability=2", "a number in [0, 1]"]),
    ("heterogeneity-rank", ["heterogeneity.slow_ranks=[-1]"], ["heterogeneity.slow_ranks=[-1]", ">= 0"]),
    ("heterogeneity-step-time", ["heterogeneity.step_time_s=0"], ["heterogeneity.step_time_s=0", "> 0"]),
    ("unknown-key", ["stps=3"], ["stps"]),
    ("resume-missing", ["resume=no/such/run"], ["resume=no/such/run", "not a bfexp run"]),
    ("output-folder", ["hydra.run.dir=afile/run"], ["output folder", "afile"]),
    # algorithm
    ("algorithm-option", ["algorithm=nosuch"], ["algorithm=nosuch", "dsgd"]),
    ("algorithm-word", ["algorithm.style=zzz"], ["algorithm.style='zzz'", "atc"]),
    ("algorithm-unknown-key", ["algorithm.stlye=atc"], ["algorithm.stlye"]),
    ("algorithm-period", ["algorithm.communication_period=0"], ["algorithm.communication_period=0", ">= 1"]),
    ("algorithm-bucket", ["algorithm.bucket_mb=-1"], ["algorithm.bucket_mb=-1", "> 0"]),
    ("algorithm-ddp-threads", ["algorithm=ddp", "engine=threads"], ["ddp", "threads"]),
    ("algorithm-topology", ["algorithm=exact_diffusion", "topology=ring", "topology.directed=true"],
     ["exact_diffusion", "ring"]),
    # topology
    ("topology-option", ["topology=nosuch"], ["topology=nosuch", "exp2"]),
    ("topology-base", ["topology.base=1"], ["topology.base=1"]),
    ("topology-hypercube-ranks", ["topology=hypercube", "ranks=6"], ["hypercube", "6"]),
    ("topology-degree", ["topology=random_regular", "topology.degree=0"], ["degree=0"]),
    ("topology-seed", ["topology=random_regular", "topology.seed=-3"], ["topology.seed=-3", ">= 0"]),
    ("topology-center", ["topology=star", "topology.center=9"], ["topology.center=9"]),
    # model
    ("model-option", ["model=nosuch"], ["model=nosuch", "mlp"]),
    ("model-hidden", ["model=mlp", "model.hidden=[0]"], ["model.hidden"]),
    ("model-activation", ["model=mlp", "model.activation=zzz"], ["model.activation", "relu"]),
    ("model-channels", ["model=cnn", "model.channels=[]"], ["model.channels"]),
    # dataset
    ("dataset-alpha-negative", ["dataset.alpha=-1"], ["dataset.alpha=-1", "> 0"]),
    ("dataset-alpha-zero", ["dataset.alpha=0"], ["dataset.alpha=0", "> 0"]),
    ("dataset-noise", ["dataset.label_noise=2"], ["dataset.label_noise=2"]),
    ("dataset-samples", ["dataset.samples_per_rank=0"], ["dataset.samples_per_rank=0", ">= 1"]),
    ("dataset-eval", ["dataset.eval_samples=-1"], ["dataset.eval_samples=-1", ">= 0"]),
    ("dataset-missing-files", ["dataset=mnist", "dataset.root=no/such/folder"], ["dataset.root", "no/such/folder"]),
    ("dataset-fraction", ["dataset=digits", "dataset.test_fraction=1.5"], ["dataset.test_fraction=1.5"]),
    # optimizer
    ("optimizer-momentum-negative", ["optimizer.momentum=-0.5"], ["optimizer.momentum=-0.5", "a number in [0, 1)"]),
    ("optimizer-momentum-one", ["optimizer.momentum=1.5"], ["optimizer.momentum=1.5", "a number in [0, 1)"]),
    ("optimizer-weight-decay", ["optimizer.weight_decay=-0.1"], ["optimizer.weight_decay=-0.1", ">= 0"]),
    ("optimizer-betas", ["optimizer=adam", "optimizer.betas=[1.5,0.9]"], ["optimizer.betas[0]=1.5", "a number in [0, 1)"]),
    ("optimizer-eps", ["optimizer=adam", "optimizer.eps=0"], ["optimizer.eps=0", "> 0"]),
    ("optimizer-option", ["optimizer=nosuch"], ["optimizer=nosuch", "sgd"]),
    # engine, scaling, logger, launcher
    ("engine-option", ["engine=nosuch"], ["engine=nosuch", "threads"]),
    ("engine-rpm", ["engine.ranks_per_machine=3"], ["engine.ranks_per_machine=3", "divisor"]),
    ("engine-slots", ["engine.slots_factor=0"], ["engine.slots_factor=0", "> 0"]),
    ("engine-mpi-unknown-key", ["engine=mpi", "+engine.foo=1"], ["unknown key 'engine.foo'", "allowed: ranks_per_machine"]),
    ("scaling-fraction", ["scaling.backward_fraction=2"], ["scaling.backward_fraction=2", "a number in [0, 1]"]),
    ("scaling-steps", ["scaling.reference_steps=0"], ["scaling.reference_steps=0", ">= 1"]),
    ("scaling-bandwidth", ["scaling.intra_bandwidth_gbyte_per_s=0"], ["scaling.intra_bandwidth_gbyte_per_s=0"]),
    ("logger-option", ["logger=nosuch"], ["logger=nosuch", "console"]),
    ("logger-type", ["logger.progress=loud"], ["logger.progress", "loud"]),
    ("launcher-option", ["launcher=nosuch"], ["launcher=nosuch", "local"]),
    ("launcher-no-hosts", ["launcher=mpirun"], ["launcher=mpirun", "hosts"]),
    # a sweep whose second job cannot be composed: no sweep folder either
    ("sweep-option", ["-m", "algorithm=dsgd,nosuch"], ["algorithm=nosuch"]),
]

RUNNER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from tests.cli_in_process import call

    out = {}
    for case in json.loads(sys.argv[1]):
        folder = Path(case["folder"])
        folder.mkdir(parents=True)
        (folder / "afile").write_text("a file, not a folder")
        os.chdir(folder)
        got = call(case["args"])
        left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != "afile")
        out[case["id"]] = {"code": got["code"], "stderr": got["stderr"], "escaped": got["escaped"], "left": left}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Every case through the CLI, in one interpreter: {case id: exit code, stderr, escaped traceback, files left}."""
    root = tmp_path_factory.mktemp("bad_input")
    cases = [{"id": cid, "args": args, "folder": str(root / cid)} for cid, args, _ in CASES]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_at_least_forty_cases_cover_every_group_and_top_level_key():
    from bfexp.cli import GROUPS
    from bfexp.config import Config

    text = " ".join(" ".join(args) for _, args, _ in CASES)
    keys = [f for f in Config.__dataclass_fields__ if f not in GROUPS]
    assert len(CASES) >= 40
    assert [g for g in GROUPS if f"{g}" not in text] == []
    assert [k for k in keys if f"{k}=" not in text] == [], "a top-level key without a bad-input case"


@pytest.mark.parametrize("case, args, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(refusals, case, args, words):
    got = refusals[case]
    assert got["escaped"] is None, got["escaped"]
    lines = got["stderr"].strip().splitlines()
    assert got["code"] == 2, got
    assert len(lines) == 1 and lines[0].startswith("bfexp: error: "), got["stderr"]
    assert "Traceback" not in got["stderr"]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert got["left"] == [], f"left behind: {got['left']}"


def test_number_in_says_the_value_and_the_range_in_one_line():
    """errors.number_in: the one range check every component uses; its message by hand."""
    import numpy as np
    import pytest

    from bfexp.errors import ConfigError, TopologyError, number_in

    cases = [
        (dict(low=0, high=1, low_open=True), 0, "x=0; allowed: a number in (0, 1]"),
        (dict(low=0, high=1, high_open=True), 1.0, "x=1.0; allowed: a number in [0, 1)"),
        (dict(low=1, integer=True), 2.0, "x=2.0; allowed: an integer >= 1"),
        (dict(low=1, integer=True), True, "x=True; allowed: an integer >= 1"),
        (dict(low=0, note="(0 = off)"), "a", "x='a'; allowed: a number >= 0 (0 = off)"),
        (dict(high=5, high_open=True), float("nan"), "x=nan; allowed: a number < 5"),
        (dict(low=0), float("inf"), "x=inf; allowed: a number >= 0"),
    ]
    for bounds, value, message in cases:
        with pytest.raises(ConfigError) as caught:
            number_in("x", value, **bounds)
        assert str(caught.value) == message
    assert number_in("x", np.int64(3), low=1, integer=True) == 3  # numpy's integers are integers
    assert number_in("x", 0.5, low=0, high=1, low_open=True, high_open=True) == 0.5
    with pytest.raises(TopologyError):
        number_in("topology.k", 0, low=1, integer=True, error=TopologyError)
