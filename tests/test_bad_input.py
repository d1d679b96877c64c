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
import re
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
    ("steps-zero", ["steps=0"], ["steps=0", "an integer in [1, 1e+09]"]),
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
    ("skip-invalid-type", ["skip_invalid=sometimes"], ["skip_invalid", "sometimes"]),
    ("fail-rank-negative", ["fail_rank=-1"], ["fail_rank=-1", ">= 0"]),
    ("fail-step-zero", ["fail_step=0"], ["fail_step=0", ">= 1"]),
    ("fail-mode-word", ["fail_mode=explode"], ["fail_mode='explode'", "raise", "hang"]),
    ("fail-mode-threads", ["fail_rank=0", "fail_mode=kill", "engine=threads"], ["fail_mode=kill", "engine=mpi"]),
    ("throughput-only-type", ["throughput_only=sometimes"], ["throughput_only", "sometimes"]),
    ("baseline-steps-negative", ["baseline_steps=-1"], ["baseline_steps=-1", ">= 0"]),
    ("report-type", ["report=perhaps"], ["report", "perhaps"]),
    ("eval-every-zero", ["eval_every=0"], ["eval_every=0", ">= 1"]),
    ("eval-budget-zero", ["eval_budget=0"], ["eval_budget=0", "> 0"]),
    ("eval-points-negative", ["eval_points=-1"], ["eval_points=-1", ">= 0"]),
    ("budget-s-zero", ["budget_s=0"], ["budget_s=0", "> 0"]),
    ("budget-s-word", ["budget_s=soon"], ["budget_s", "soon"]),
    ("eval-every-s-negative", ["eval_every_s=-1"], ["eval_every_s=-1", "> 0"]),
    ("budget-s-checkpoint-every-async", ["budget_s=1", "algorithm=gossip", "checkpoint_every=5"],
     ["checkpoint_every=5", "budget_s", "gossip", "allowed: 0"]),
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
    ("heterogeneity-cpu-quota", ["heterogeneity.cpu_quota=0"], ["heterogeneity.cpu_quota=0", ">= 0.01"]),
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

# Issue 29: classes of bad input the cases above did not cover, each of which (on the main branch before it)
# trained, ran on the ranks, or ended in a traceback. Files a case needs are in FILES (written into its folder).
TINY = ["steps=2", "engine=threads", "ranks=2", "baseline_steps=0", "scaling.reference_steps=1"]
NEW_CASES = [
    # every point of a sweep is checked before the first job trains
    ("sweep-late-lr", ["-m", "lr=0.1,-1", *TINY], ["lr=-1", "sweep point lr=-1"]),
    ("sweep-late-ranks", ["-m", "ranks=2,0", "steps=2"], ["ranks=0", ">= 1"]),
    ("sweep-late-seed", ["-m", "seed=0,-1", *TINY], ["seed=-1", ">= 0"]),
    ("sweep-late-batch", ["-m", "batch_size=8,100000", *TINY], ["batch_size=100000", "at most"]),
    ("sweep-late-model", ["-m", "model=logreg,cnn", *TINY], ["CNN", "shape"]),
    ("sweep-late-reach", ["-m", "ranks=2,4", "fail_rank=5", "steps=2"], ["fail_rank=5", "largest job"]),
    ("sweep-late-topology", ["-m", "topology=ring,hypercube", "ranks=6", "steps=2"], ["hypercube", "6"]),
    ("sweep-dir-empty", ["-m", "hydra.sweep.dir=", "ranks=2,4"], ["hydra.sweep.dir=''", "folder"]),
    # the top level and the data groups are closed to +key
    ("plus-typo", ["+stpes=5"], ["unknown key 'stpes'", "did you mean 'steps'"]),
    ("plus-typo-case", ["+Ranks=2"], ["unknown key 'Ranks'", "did you mean 'ranks'"]),
    ("plus-new-key", ["+learning_rate=0.1"], ["unknown key 'learning_rate'", "allowed: "]),
    ("plus-scaling", ["+scaling.reference_step=3"], ["unknown key 'scaling.reference_step'",
                                                     "did you mean 'reference_steps'"]),
    ("delete-key", ["~ranks"], ["ranks was deleted", "ranks="]),
    ("delete-dtype", ["~dtype"], ["dtype was deleted"]),
    # ranges that depend on other keys
    ("fail-rank-beyond", ["fail_rank=7", "ranks=2"], ["fail_rank=7", "ranks=2", "[0, 1]"]),
    ("fail-step-beyond", ["fail_rank=0", "fail_step=50", "steps=5"], ["fail_step=50", "steps=5", "[1, 5]"]),
    # epochs=1: 512 samples x 4 ranks / (batch 32 x 4 ranks) = 16 steps
    ("fail-step-beyond-epochs", ["fail_rank=0", "fail_step=17", "epochs=1"],
     ["fail_step=17", "16 steps from epochs=1 at batch_size=32 and ranks=4", "[1, 16]"]),
    # digits: 1,438 training samples / (batch 64 x 2 ranks) = 11 steps an epoch; epochs=2 runs 22
    ("fail-step-beyond-epochs-sweep", ["-m", "epochs=1,2", "dataset=digits", "ranks=2", "batch_size=64",
                                       "fail_rank=0", "fail_step=23"],
     ["fail_step=23", "22 steps in the longest job of this sweep", "[1, 22]"]),
    ("slow-ranks-beyond", ["heterogeneity=stragglers", "heterogeneity.slow_ranks=[0,99]", "ranks=2"],
     ["heterogeneity.slow_ranks=[0, 99]", "99", "[0, 1]"]),
    ("batch-beyond-shard", ["batch_size=100000"], ["batch_size=100000", "512", "[1, 512]"]),
    ("batch-beyond-samples", ["dataset.samples_per_rank=10", "batch_size=11"], ["batch_size=11", "[1, 10]"]),
    ("batch-beyond-digits", ["dataset=digits", "batch_size=5000"], ["batch_size=5000", "dataset=digits"]),
    ("eval-subset-beyond", ["eval_subset=100000000"], ["eval_subset=100000000", "2000 held-out"]),
    ("eval-subset-eval-samples", ["dataset.eval_samples=10", "eval_subset=11"], ["eval_subset=11", "held-out"]),
    ("eval-subset-digits", ["dataset=digits", "eval_subset=5000"], ["eval_subset=5000", "dataset=digits"]),
    ("run-dir-empty", ["hydra.run.dir="], ["hydra.run.dir=''", "folder"]),
    # found only on the ranks before
    ("seed-overflow", ["seed=100000000000000000000000"], ["seed=100000000000000000000000", "2**62"]),
    ("seed-2-64", ["seed=18446744073709551616"], ["seed=18446744073709551616", "2**62"]),
    ("topology-seed-overflow", ["topology=random_regular", "topology.seed=100000000000000000000000"],
     ["topology.seed", "2**62"]),
    ("lr-float32", ["lr=1e308"], ["lr=1e+308", "float32"]),
    ("lr-float16", ["dtype=float16", "lr=100000"], ["lr=100000", "float16"]),
    ("model-no-parameters", ["model._target_=torch.nn.Flatten"], ["torch.nn.Flatten", "no parameters"]),
    ("model-identity", ["model._target_=torch.nn.Identity"], ["no parameters"]),
    ("dirichlet-empty", ["dataset=digits", "ranks=300", "engine=threads", "dataset.alpha=0.0001"],
     ["dataset.alpha=0.0001", "300 ranks"]),
    ("mnist-garbage", ["dataset=mnist", "dataset.root=mn"], ["train-images-idx3-ubyte", "not an idx file"]),
    ("mnist-not-gzip", ["dataset=mnist", "dataset.root=mz"], ["train-images-idx3-ubyte.gz", "cannot be read"]),
    ("mnist-counts", ["dataset=mnist", "dataset.root=mc"], ["train-labels-idx1-ubyte", "N labels"]),
    ("cifar-garbage", ["dataset=cifar10", "dataset.root=cf"], ["data_batch_1", "not a CIFAR-10 batch"]),
    ("reference-cache-file", ["scaling.reference_cache=afile"], ["scaling.reference_cache='afile'", "is a file"]),
    ("reference-cache-under-file", ["scaling.reference_cache=afile/refs"], ["afile is a file"]),
    # file readers: one line naming the file
    ("edges-undecodable", ["topology=file", "topology.path=bin.edges", "ranks=4"], ["bin.edges", "UnicodeDecodeError"]),
    ("topology-yaml-unparsable", ["topology=file", "topology.path=bad.yaml", "ranks=4"], ["bad.yaml", "YAML"]),
    ("topology-yaml-undecodable", ["topology=file", "topology.path=bin.yaml", "ranks=4"], ["bin.yaml"]),
    ("topology-yaml-not-topology", ["topology=file", "topology.path=mlp.yaml", "ranks=4"],
     ["bfexp.models.MLP", "a graph file may not choose"]),
    ("hostfile-undecodable", ["launcher=mpirun", "launcher.hostfile=bin.hosts", "engine=mpi", "ranks=2"],
     ["launcher.hostfile=bin.hosts", "UnicodeDecodeError"]),
    # a _target_ of the wrong kind is refused before it is called
    ("target-dataset-function", ["dataset._target_=builtins.print"], ["builtins.print", "builds no dataset"]),
    ("target-dataset-called", ["dataset._target_=mymod.marker"], ["mymod.marker", "not a dataset"]),
    ("target-model-dataset", ["model._target_=bfexp.data.Digits"], ["bfexp.data.Digits", "not a model"]),
    ("target-model-builtin", ["model._target_=os.getcwd"], ["getcwd", "builds no model"]),
    ("target-optimizer-model", ["optimizer._target_=bfexp.models.MLP"], ["bfexp.models.MLP", "not a optimizer"]),
    ("target-algorithm-sgd", ["algorithm._target_=torch.optim.SGD"], ["torch.optim.sgd.SGD", "not a algorithm"]),
    ("target-topology-model", ["topology._target_=bfexp.models.LogReg"], ["LogReg", "not a topology"]),
    ("target-launcher-logger", ["launcher._target_=bfexp.loggers.Console"], ["Console", "not a launcher"]),
    ("target-logger-function", ["logger._target_=mymod.marker"], ["mymod.marker", "not a logger"]),
    # a model and a data set that do not fit
    ("model-input-shape", ["model=cnn", "dataset=synthetic"], ["CNN", "shape (32,)"]),
    ("model-output-shape", ["model._target_=mymod.ThreeOut"], ["mymod.ThreeOut", "(2, 3)", "(2, 2)"]),
    ("model-resnet-digits", ["model=resnet50", "dataset=digits"], ["resnet50", "64 input features"]),
    # resume of a damaged folder
    ("resume-multirun-unparsable", ["resume=sw"], ["sw/multirun.yaml", "cannot be read"]),
    ("resume-multirun-shape", ["resume=sl"], ["sl/multirun.yaml", "hydra.overrides"]),
    ("resume-hydra-yaml", ["resume=rh"], ["rh/.hydra/hydra.yaml", "cannot be read"]),
    ("resume-latest-corrupt", ["resume=rl"], ["rl/checkpoint/latest.json", "damaged", "truncated"]),
    ("resume-latest-shape", ["resume=rs"], ["rs/checkpoint/latest.json", "a JSON list"]),
    ("resume-latest-format", ["resume=rf"], ["rf/checkpoint/latest.json", "format 99"]),
    # a directed graph from a file, as `ring directed=true` is
    ("algorithm-directed-file", ["algorithm=exact_diffusion", "topology=file", "topology.path=ring.edges",
                                 "topology.direction=out", "topology.weights=uniform", "ranks=4"],
     ["exact_diffusion", "directed"]),
    # the other commands: one line, exit 2
    ("report-out-file", ["bfexp-report", "job", "--out", "afile/report"], ["afile", "--out"]),
    ("topology-cli-undecodable", ["bfexp-topology", "file", "--ranks", "4", "--path", "bin.edges"],
     ["bin.edges", "UnicodeDecodeError"]),
    ("topology-cli-unparsable", ["bfexp-topology", "file", "--ranks", "4", "--path", "bad.yaml"], ["bad.yaml"]),
]
CASES += NEW_CASES


def _idx(kind: int, shape: tuple[int, ...]) -> bytes:
    """An idx file of unsigned bytes (MNIST's format) with zeros for data."""
    import math

    return bytes([0, 0, kind, len(shape)]) + b"".join(n.to_bytes(4, "big") for n in shape) + bytes(math.prod(shape))


def _mnist(images: int, labels: int) -> dict[str, bytes]:
    return {"train-images-idx3-ubyte": _idx(8, (images, 28, 28)), "train-labels-idx1-ubyte": _idx(8, (labels,)),
            "t10k-images-idx3-ubyte": _idx(8, (2, 28, 28)), "t10k-labels-idx1-ubyte": _idx(8, (2,))}


MYMOD = b"""
from torch import nn

def marker(*args, **kwargs):
    open("called", "w").write("a _target_ was called")

class ThreeOut(nn.Linear):
    def __init__(self, in_features):
        super().__init__(in_features, 3)
"""
# Hydra's record of a bfexp run (its primary config source is bfexp's: resume takes only folders bfexp wrote)
RUN_HYDRA = (b"hydra:\n  overrides:\n    hydra: []\n    task: [engine=threads, ranks=2, steps=4, baseline_steps=0]\n"
             b"  runtime:\n    config_sources:\n    - {path: hydra.conf, schema: pkg, provider: hydra}\n"
             b"    - {path: bfexp.conf, schema: pkg, provider: main}\n")


def _run(latest: bytes) -> dict[str, bytes]:
    """A run folder whose checkpoint's rank files are there but whose latest.json is ``latest``."""
    return {".hydra/hydra.yaml": RUN_HYDRA, ".hydra/config.yaml": b"{}\n", ".hydra/overrides.yaml": b"[]\n", "cli.log": b"",
            "checkpoint/latest.json": latest, "checkpoint/step2/rank0.pt": b"x", "checkpoint/step2/rank1.pt": b"x"}


FILES: dict[str, dict[str, bytes]] = {
    "mnist-garbage": {f"mn/{name}": b"<html>not found</html>" for name in _mnist(1, 1)},
    "mnist-not-gzip": {f"mz/{name}.gz": b"plain bytes" for name in _mnist(1, 1)},
    "mnist-counts": {f"mc/{name}": data for name, data in _mnist(3, 2).items()},
    "cifar-garbage": {f"cf/{name}": b"\x80\x04garbage" for name in
                      [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]},
    "edges-undecodable": {"bin.edges": b"0 1\n1 2\xff\xfe\n2 3\n3 0\n"},
    "topology-yaml-unparsable": {"bad.yaml": b"_target_: bfexp.topology.Ring\nweights: [1, 2\n"},
    "topology-yaml-undecodable": {"bin.yaml": b"_target_: \xff\xfe\n"},
    "topology-yaml-not-topology": {"mlp.yaml": b"_target_: bfexp.models.MLP\n"},
    "hostfile-undecodable": {"bin.hosts": b"localhost slots=2\xff\n"},
    "target-dataset-called": {"mymod.py": MYMOD},
    "target-logger-function": {"mymod.py": MYMOD},
    "model-output-shape": {"mymod.py": MYMOD},
    "resume-multirun-unparsable": {"sw/multirun.yaml": b"hydra:\n  overrides: [task\n"},
    "resume-multirun-shape": {"sl/multirun.yaml": b"- 1\n- 2\n"},
    "resume-hydra-yaml": {"rh/.hydra/hydra.yaml": b"hydra: {overrides: \xff\n"},
    "resume-latest-corrupt": {f"rl/{k}": v for k, v in _run(b'{"format": 1, "step": 2, "ran').items()},
    "resume-latest-shape": {f"rs/{k}": v for k, v in _run(b"[2, 2]").items()},
    "resume-latest-format": {f"rf/{k}": v for k, v in _run(b'{"format": 99, "step": 2, "ranks": 2, "folder": '
                                                            b'"step2", "experiment": {}}').items()},
    "algorithm-directed-file": {"ring.edges": b"0 1\n1 2\n2 3\n3 0\n"},
    "report-out-file": {"job/summary.json": b'{"status": "completed"}'},
    "topology-cli-undecodable": {"bin.edges": b"0 1\xff\n"},
    "topology-cli-unparsable": {"bad.yaml": b"_target_: [\n"},
}

RUNNER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from tests.cli_in_process import call, call_main

    out = {}
    for case in json.loads(sys.argv[1]):
        folder = Path(case["folder"])
        folder.mkdir(parents=True)
        (folder / "afile").write_text("a file, not a folder")
        for name, data in case.get("files", {}).items():  # the case's own files (latin-1: bytes as text)
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data.encode("latin-1"))
        given = {p for p in folder.rglob("*")}
        os.chdir(folder)
        sys.modules.pop("mymod", None)
        args = case["args"]
        got = call_main(args[0], args[1:]) if args[0].startswith("bfexp-") else call(args)
        left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p not in given)
        out[case["id"]] = {"code": got["code"], "stderr": got["stderr"], "escaped": got["escaped"], "left": left}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Every case through the CLI, in one interpreter: {case id: exit code, stderr, escaped traceback, files left}."""
    root = tmp_path_factory.mktemp("bad_input")
    cases = [{"id": cid, "args": args, "folder": str(root / cid),
              "files": {k: v.decode("latin-1") for k, v in FILES.get(cid, {}).items()}} for cid, args, _ in CASES]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_at_least_forty_cases_cover_every_group_and_top_level_key():
    from bfexp.cli import GROUPS
    from bfexp.config import Config

    text = " ".join(" ".join(args) for _, args, _ in CASES)
    keys = [f for f in Config.__dataclass_fields__ if f not in GROUPS]
    assert len(CASES) >= 40 and len(NEW_CASES) >= 60
    assert set(FILES) <= {c[0] for c in NEW_CASES}
    assert [g for g in GROUPS if f"{g}" not in text] == []
    assert [k for k in keys if f"{k}=" not in text] == [], "a top-level key without a bad-input case"


@pytest.mark.parametrize("case, args, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(refusals, case, args, words):
    got = refusals[case]
    assert got["escaped"] is None, got["escaped"]
    lines = got["stderr"].strip().splitlines()
    assert got["code"] == 2, got
    assert len(lines) == 1 and re.match(r"bfexp(-report|-topology)?: error: ", lines[0]), got["stderr"]
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
