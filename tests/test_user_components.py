"""A user's own model and data set plug in with no edit to bfexp.

The user's code lives in their own module (here written into the job's
working folder, as a user's package would be on their path): the model by
`model._target_=...` on the command line, the data set by a YAML in the
user's own config dir (`--config-dir`), exactly as docs/how-to/own-components.md
shows. Both run on real MPI ranks and on virtual ranks.
"""

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.cli_in_process import ran

USER_MODULE = '''
import numpy as np
import torch
from torch import nn

from bfexp.data import Dataset


class TwoLayer(nn.Module):
    """A user's model: it takes only what it needs from bfexp (in_features, classes) plus its own option."""

    def __init__(self, in_features: int, classes: int, width: int = 8) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be positive, got {width}")
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, classes))

    def forward(self, x):
        return self.body(x)


class Blobs(Dataset):
    """A user's data set: Gaussian blobs around `centers` points in `dim` dimensions."""

    name = "blobs"

    def __init__(self, dim: int = 5, centers: int = 3, samples: int = 600, **base) -> None:
        super().__init__(**base)
        self.dim, self.centers, self.samples = dim, centers, samples

    def arrays(self, seed):
        rng = np.random.default_rng(seed)
        means = rng.normal(scale=4.0, size=(self.centers, self.dim))
        y = rng.integers(0, self.centers, size=self.samples)
        x = (means[y] + rng.normal(size=(self.samples, self.dim))).astype(np.float32)
        cut = self.samples * 3 // 4
        return x[:cut], y[:cut], x[cut:], y[cut:], self.centers


from bfexp.algorithms import DecentralizedOptimizer, Requirements


class PlainATC(DecentralizedOptimizer):
    """A user's algorithm: adapt, then combine, after backward: X+ = W (X - a F(X))."""

    name = "plain_atc"
    requires = Requirements(row_stochastic=True)

    def update(self, communicate):
        self.local_step()
        if communicate:
            self.wait(self.start_mix(self.flat, self.mixing_weights()))
'''

ALGORITHM_YAML = """\
# The user's algorithm, from their own config dir.
_target_: mylab.PlainATC
_partial_: true
communication_period: 1
overlap: false
bucket_mb: 25.0
"""

USER_YAML = """\
# The user's data set, from their own config dir.
_target_: mylab.Blobs
dim: 5
centers: 3
samples: 600
partition: iid
alpha: 0.5
eval_samples: 0
"""


LAUNCHER_MODULE = '''
from pathlib import Path

from bfexp.errors import ConfigError
from bfexp.launchers import Launcher, find_mpiexec


class Site(Launcher):
    """A user's launcher (a site's wrapper around mpiexec): it notes each command it gives."""

    name = "site"
    on_this_machine = True

    def __init__(self, queue: str = "batch", note: str = "launched.txt") -> None:
        if queue not in ("batch", "debug"):
            raise ConfigError(f"launcher.queue={queue}; allowed: batch, debug")
        self.queue, self.note = queue, note

    def command(self, ranks, program, mpiexec_args=()):
        line = [find_mpiexec(), "--oversubscribe", "-n", str(ranks), *mpiexec_args, *program]
        Path(self.note).write_text(self.queue + " " + " ".join(line))
        return line

    def environment(self, ranks, env):
        env["SITE_QUEUE"] = self.queue
        return env
'''

LAUNCHER_YAML = """\
# The user's launcher, from their own config dir.
_target_: mysite.Site
queue: batch
note: launched.txt
"""




def write_project(cwd: Path) -> Path:
    """The user's project in ``cwd``: their module and config dir (data set, algorithm, launcher)."""
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "mylab.py").write_text(textwrap.dedent(USER_MODULE))
    (cwd / "mysite.py").write_text(textwrap.dedent(LAUNCHER_MODULE))
    for group, name, text in (("dataset", "blobs", USER_YAML), ("algorithm", "plain_atc", ALGORITHM_YAML),
                              ("launcher", "site", LAUNCHER_YAML)):
        (cwd / "myconf" / group).mkdir(parents=True, exist_ok=True)
        (cwd / "myconf" / group / f"{name}.yaml").write_text(text)
    return cwd


MODEL = ["--config-dir", "myconf", "dataset=blobs", "model._target_=mylab.TwoLayer"]
BAD_COMPONENT = [
    (["+model.width=0"], ["model._target_=mylab.TwoLayer", "width must be positive"]),
    (["+model.depth=2"], ["unknown key 'model.depth'", "width"]),
    (["+model.width=wide"], ["model.width='wide'", "an integer"]),
    (["dataset.centers=many"], ["dataset.centers='many'", "an integer"]),
]
ALGORITHM = ["--config-dir", "myconf", "engine=threads", "ranks=4", "steps=30", "log_every=10", "baseline_steps=0",
             "scaling.reference_cache=null"]
BAD_LAUNCHER = [
    (["launcher.queue=gpu"], ["launcher.queue=gpu", "allowed: batch, debug"]),
    (["+launcher.nodes=2"], ["unknown key 'launcher.nodes'", "queue, note"]),
]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """Every command line of this file through the real CLI, one after another in one interpreter
    (tests/cli_in_process.py), each in a folder of its own holding the user's project: {case id: exit code,
    output, summaries, "cwd": its folder}. The jobs' ranks are the real ones they name (MPI processes for
    engine=mpi and the user's launcher)."""
    import os

    from tests.cli_in_process import calls

    root = tmp_path_factory.mktemp("user_components")
    cases = [{"id": f"train_{engine}",
              "args": [*MODEL, "+model.width=16", f"engine={engine}", "ranks=2", "steps=60", "log_every=20",
                       "lr=0.1", "baseline_steps=2", "scaling.reference_cache=null", "hydra.run.dir=run"]}
             for engine in ("mpi", "threads")]
    cases += [{"id": f"bad_component{i}", "args": [*MODEL, *args, "hydra.run.dir=run"]}
              for i, (args, _) in enumerate(BAD_COMPONENT)]
    # mine and builtin share one folder, one after the other.
    cases += [{"id": "mine", "folder": "algorithm", "args": [*ALGORITHM, "algorithm=plain_atc", "hydra.run.dir=mine"]},
              {"id": "builtin", "folder": "algorithm",
               "args": [*ALGORITHM, "algorithm=dsgd", "algorithm.overlap=false", "hydra.run.dir=builtin"]}]
    cases += [{"id": "launcher", "args": ["--config-dir", "myconf", "launcher=site", "launcher.queue=debug",
                                          "engine=mpi", "ranks=2", "steps=10", "log_every=5", "baseline_steps=0",
                                          "hydra.run.dir=run"]}]
    cases += [{"id": f"bad_launcher{i}", "args": ["--config-dir", "myconf", "launcher=site", *args, "engine=mpi",
                                                  "hydra.run.dir=run"]}
              for i, (args, _) in enumerate(BAD_LAUNCHER)]
    for case in cases:
        case["folder"] = str(write_project(root / case.get("folder", case["id"])))
    env = {k: v for k, v in os.environ.items() if k != "BFEXP_DEBUG"}
    got = calls(cases, timeout=600, env=env)
    return {case["id"]: {**got[case["id"]], "cwd": Path(case["folder"])} for case in cases}


def ok(got: dict) -> dict:
    ran(got)
    return got


def refused(got: dict) -> list[str]:
    """A refusal's stderr lines (exit 2, nothing escaped)."""
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"] + got["stdout"]
    return got["stderr"].strip().splitlines()


@pytest.mark.parametrize("engine", ["mpi", "threads"])
def test_user_model_and_dataset_train(cli, engine):
    got = ok(cli[f"train_{engine}"])
    summary = got["summaries"]["run/summary.json"]
    assert summary["status"] == "completed"
    assert summary["model"] == "TwoLayer" and summary["dataset"] == "blobs"
    records = [json.loads(line) for line in (got["cwd"] / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    # 5 inputs -> 16 -> 3 classes
    assert summary["modeled"]["parameters"] == 5 * 16 + 16 + 16 * 3 + 3


@pytest.mark.parametrize("case", range(len(BAD_COMPONENT)), ids=[" ".join(a) for a, _ in BAD_COMPONENT])
def test_user_component_bad_options_exit_2(cli, case):
    got, words = cli[f"bad_component{case}"], BAD_COMPONENT[case][1]
    lines = refused(got)
    assert len(lines) == 1 and lines[0].startswith("bfexp: error:"), got["stderr"]
    for w in words:
        assert w in lines[0], lines[0]
    assert not (got["cwd"] / "run" / "logs").exists()


def test_blobs_reference_is_what_the_user_wrote(tmp_path):
    """The data the ranks trained on is the user's arrays, split by rank (numpy reference)."""
    import sys

    write_project(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        import mylab
    finally:
        sys.path.pop(0)
    ds = mylab.Blobs(dim=5, centers=3, samples=600, partition="iid", eval_samples=0)
    x_train, y_train, x_test, y_test, classes = ds.arrays(0)
    shards = [ds.load(r, 2, 0) for r in range(2)]
    got = np.concatenate([s.train_x.numpy() for s in shards])
    assert sorted(map(tuple, got.round(5))) == sorted(map(tuple, x_train.round(5)))
    assert shards[0].test_x.shape[0] == len(y_test) == 150 and classes == 3


def test_user_algorithm_is_one_class_and_one_yaml(cli):
    """A user's ATC written in five lines runs as `algorithm=plain_atc` and takes exactly
    the built-in DSGD atc's steps (overlap off: one exchange of the whole model after backward)."""
    a = ok(cli["mine"])["summaries"]["mine/summary.json"]
    b = ok(cli["builtin"])["summaries"]["builtin/summary.json"]
    assert a["algorithm"] == "plain_atc" and b["algorithm"] == "dsgd"
    for key in ("final_loss", "final_eval_loss", "final_accuracy", "consensus_distance"):
        assert a[key] == b[key], key


def test_user_launcher_starts_the_ranks(cli):
    """One class and one YAML of the user's: bfexp starts real MPI ranks through it."""
    got = ok(cli["launcher"])
    assert got["summaries"]["run/summary.json"]["status"] == "completed"
    queue, _, command = (got["cwd"] / "launched.txt").read_text().partition(" ")
    assert queue == "debug" and " -n 2 " in command and command.endswith(f"-m bfexp.worker {got['cwd'] / 'run'}")


@pytest.mark.parametrize("case", range(len(BAD_LAUNCHER)), ids=[" ".join(a) for a, _ in BAD_LAUNCHER])
def test_user_launcher_bad_options_exit_2(cli, case):
    got, words = cli[f"bad_launcher{case}"], BAD_LAUNCHER[case][1]
    lines = refused(got)
    assert len(lines) == 1 and all(w in lines[0] for w in words), got["stderr"]
    assert not (got["cwd"] / "launched.txt").exists()
