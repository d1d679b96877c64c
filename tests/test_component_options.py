"""A bad value for any option of any group: one line naming the key and what is allowed, exit 2,
before any rank starts (issue 12). For each group: a wrong type, a value out of range, an unknown key.

Component groups are checked against their class's signature and constructor by
the driver's dry build; data-only groups by their schema and config.validate. The cases run through
the CLI's own entry in one interpreter (tests/test_bad_input.py's runner), so they cost seconds.
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_bad_input import RUNNER

# (group, overrides, words the one line must contain)
CASES = [
    ("algorithm", ["algorithm.communication_period=often"], ["algorithm.communication_period='often'", "an integer"]),
    ("algorithm", ["algorithm.bucket_mb=-1"], ["algorithm.bucket_mb=-1", "> 0"]),
    ("algorithm", ["+algorithm.momentum=0.9"], ["unknown key 'algorithm.momentum'", "style"]),
    ("topology", ["topology.base=two"], ["topology.base='two'", "an integer"]),
    ("topology", ["topology.base=1"], ["topology.base=1", ">= 2"]),
    ("topology", ["+topology.degree=3"], ["unknown key 'topology.degree'", "base"]),
    ("model", ["model=mlp", "model.hidden=wide"], ["model.hidden", "wide"]),
    ("model", ["model=mlp", "model.hidden=[8,0]"], ["model.hidden", "allowed"]),
    ("model", ["+model.depth=3"], ["unknown key 'model.depth'"]),
    ("model", ["model=gpt", "dataset=text", "model.n_head=3"], ["model.n_embd=64 is not a multiple of model.n_head=3"]),
    ("model", ["model=gpt"], ["'bfexp.models.GPT' takes token ids; dataset=synthetic gives samples of features",
                              "allowed: a data set of tokens (dataset=text)"]),
    ("dataset", ["model=gpt", "dataset=text", "dataset.path=/nonexistent/corpus"],
     ["dataset.path='/nonexistent/corpus' does not exist", "UTF-8"]),
    ("dataset", ["model=gpt", "dataset=text", "dataset.tokenizer=words"], ["dataset.tokenizer='words'", "char, bpe"]),
    ("dataset", ["dataset.features=many"], ["dataset.features='many'", "an integer"]),
    ("dataset", ["dataset.alpha=-1"], ["dataset.alpha=-1", "> 0"]),
    ("dataset", ["+dataset.root=/data"], ["unknown key 'dataset.root'", "features"]),
    ("optimizer", ["optimizer.momentum=fast"], ["optimizer.momentum='fast'", "a number"]),
    ("optimizer", ["optimizer.momentum=-0.5"], ["optimizer", "momentum", "-0.5"]),
    ("optimizer", ["+optimizer.betas=[0.9,0.99]"], ["unknown key 'optimizer.betas'", "momentum"]),
    ("engine", ["engine.ranks_per_machine=x"], ["engine.ranks_per_machine", "x"]),
    ("engine", ["engine.slots_factor=0"], ["engine.slots_factor=0", "> 0"]),
    ("engine", ["engine.speed=1"], ["unknown key 'engine.speed'"]),
    ("engine", ["engine=threads", "+engine.speed=1"], ["unknown key 'engine.speed'", "ranks_per_machine, timeline"]),
    ("engine", ["engine=threads", "engine.timeline=maybe"], ["engine.timeline='maybe'", "true or false"]),
    ("engine", ["+engine.speed=1"], ["unknown key 'engine.speed'", "slots_factor"]),
    ("scaling", ["scaling.backward_fraction=half"], ["scaling.backward_fraction", "half"]),
    ("scaling", ["scaling.backward_fraction=2"], ["scaling.backward_fraction=2", "a number in [0, 1]"]),
    ("scaling", ["scaling.bandwidth=1"], ["unknown key 'scaling.bandwidth'"]),
    ("logger", ["logger.progress=sometimes"], ["logger.progress", "sometimes"]),
    ("logger", ["logger=wandb", "logger.mode=loud"], ["logger.mode='loud'", "offline"]),
    ("logger", ["logger.colour=red"], ["unknown key 'logger.colour'"]),
    ("logger", ["+logger.colour=red"], ["unknown key 'logger.colour'", "progress"]),
    ("logger", ["logger=jsonl", "logger.name=console"], ["logger.name='console'", "jsonl"]),
    ("launcher", ["launcher=srun", "launcher.ranks_per_node=many"], ["launcher.ranks_per_node", "many"]),
    ("launcher", ["launcher=srun", "launcher.ranks_per_node=-1"], ["launcher.ranks_per_node=-1", ">= 0"]),
    ("launcher", ["launcher.hosts=n1:8"], ["unknown key 'launcher.hosts'"]),
    ("heterogeneity", ["heterogeneity.factor=fast"], ["heterogeneity.factor='fast'", "a number"]),
    ("heterogeneity", ["heterogeneity.factor=0.5"], ["heterogeneity.factor=0.5", ">= 1"]),
    ("heterogeneity", ["+heterogeneity.speed=2"], ["unknown key 'heterogeneity.speed'", "factor"]),
]


def test_every_group_has_all_three_kinds_of_bad_value():
    from bfexp.cli import GROUPS

    assert {g for g, _, _ in CASES} == set(GROUPS)
    for group in GROUPS:
        assert sum(1 for g, _, _ in CASES if g == group) >= 3, group


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Every case through bfexp.cli.command: {case index: exit code, stderr, escaped traceback, files left}."""
    root = tmp_path_factory.mktemp("component_options")
    cases = [{"id": str(i), "args": [*overrides, "hydra.run.dir=run"], "folder": str(root / str(i))}
             for i, (_, overrides, _) in enumerate(CASES)]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(c[1]) for c in CASES])
def test_bad_option_is_one_line_exit_2(refusals, index):
    _, _, words = CASES[index]
    got = refusals[str(index)]
    assert got["escaped"] is None, got["escaped"]
    assert got["code"] == 2, got
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bfexp: error:"), got["stderr"]
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in got["stderr"]
    assert got["left"] == [], f"no rank may start on bad input; left behind: {got['left']}"
