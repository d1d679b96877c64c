"""A user's own compressor and engine plug in with no edit to bfexp (issue 31).

As in tests/test_user_components.py, the user's code is a module of their own in the job's
working folder and their YAMLs sit in their own config dir (`--config-dir myconf`): one class
and one YAML each, the constructor the option's schema, built by Hydra from `_target_`. The
compressor runs CHOCO-SGD on virtual ranks and its bad options exit 2 with one line; the engine
(the MPI engine with one option more) carries a real job's MPI ranks.
"""

import math
import textwrap

import pytest

from tests.cli_in_process import ran

D = 4810  # parameters of the MLP on digits (64 -> 64 -> 10), float32

COMPRESSOR_MODULE = '''
import math

import torch

from bfexp.compression import Compressor, as_bytes, from_bytes
from bfexp.errors import number_in


class Strided(Compressor):
    """A user's compressor: every `stride`-th entry of the vector, zeros elsewhere."""

    name = "strided"

    def __init__(self, stride: int = 2) -> None:
        self.stride = number_in("algorithm.compressor.stride", stride, low=1, integer=True)

    def payload_bytes(self, numel, dtype):
        return math.ceil(numel / self.stride) * dtype.itemsize

    def encode(self, v, generator=None):
        return as_bytes(v[:: self.stride].clone())

    def decode(self, payload, numel, dtype):
        out = torch.zeros(numel, dtype=dtype, device=payload.device)
        out[:: self.stride] = from_bytes(payload, dtype)
        return out
'''

COMPRESSOR_YAML = """\
# The user's compressor, from their own config dir.
_target_: mycompress.Strided
stride: 2
"""

ENGINE_MODULE = '''
from pathlib import Path

from bfexp.comm.mpi import MPIEngine
from bfexp.comm.threads import ThreadsEngine


class NotingMPI(MPIEngine):
    """A user's engine: the MPI engine, leaving a note of each rank's sent bytes when it closes."""

    def __init__(self, note: str = "engine", **options) -> None:
        super().__init__(**options)
        self.note = note

    def close(self) -> None:
        Path(f"{self.note}.rank{self.rank}").write_text(f"{type(self).__name__} {self.bytes_sent}")
        super().close()


class NotingThreads(ThreadsEngine):
    """The same for virtual ranks: a subclass of the threads engine, built once per rank thread."""

    def __init__(self, world, rank, note: str = "engine", **options) -> None:
        super().__init__(world, rank, **options)
        self.note = note

    def close(self) -> None:
        Path(f"{self.note}.rank{self.rank}").write_text(f"{type(self).__name__} {self.bytes_sent}")
        super().close()
'''

# The shipped MPI option underneath (Hydra's defaults list), the user's class and option on top.
ENGINE_YAML = """\
# The user's engine, from their own config dir.
defaults:
  - mpi
  - _self_

_target_: mycomm.NotingMPI
note: engine
"""

THREADS_ENGINE_YAML = """\
defaults:
  - threads
  - _self_

_target_: mycomm.NotingThreads
note: engine
"""

SMALL = ["--config-dir", "myconf", "engine=threads", "ranks=4", "steps=6", "log_every=3", "model=mlp",
         "dataset=digits", "baseline_steps=0", "report=false"]


BAD_OPTIONS = [
    (["algorithm.compressor.stride=0"], ["algorithm.compressor.stride=0", "an integer >= 1"]),
    (["algorithm.compressor.stride=wide"], ["algorithm.compressor.stride='wide'", "an integer"]),
    (["+algorithm.compressor.strid=3"], ["unknown key 'algorithm.compressor.strid'", "allowed: stride"]),
]
ENGINES = [
    ("noting_mpi", "mpi", 2, "NotingMPI"),  # the user's subclass of the MPI engine, on real MPI ranks
    ("noting_threads", "threads", 3, "NotingThreads"),  # of the threads engine: every virtual rank runs on it
]


@pytest.fixture(scope="module")
def user_project(tmp_path_factory) -> dict:
    """The user's project folder (their modules and config dir) and every command line of this file run in it,
    one after another in one interpreter (tests/cli_in_process.py), each into a run folder of its own:
    {"cwd": the folder, case id: exit code, output}."""
    import os

    from tests.cli_in_process import calls

    cwd = tmp_path_factory.mktemp("user_project")
    (cwd / "mycompress.py").write_text(textwrap.dedent(COMPRESSOR_MODULE))
    (cwd / "mycomm.py").write_text(textwrap.dedent(ENGINE_MODULE))
    (cwd / "myconf" / "algorithm" / "compressor").mkdir(parents=True)
    (cwd / "myconf" / "algorithm" / "compressor" / "strided.yaml").write_text(COMPRESSOR_YAML)
    (cwd / "myconf" / "engine").mkdir()
    (cwd / "myconf" / "engine" / "noting_mpi.yaml").write_text(ENGINE_YAML)
    (cwd / "myconf" / "engine" / "noting_threads.yaml").write_text(THREADS_ENGINE_YAML)
    choco = [*SMALL, "algorithm=choco_sgd"]
    cases = [{"id": "strided", "args": [*choco, "+algorithm/compressor=strided", "algorithm.compressor.stride=5",
                                        "hydra.run.dir=strided"]},
             {"id": "by_name", "args": [*choco, "algorithm.compressor=strided", "hydra.run.dir=by_name"]}]
    cases += [{"id": f"bad{i}", "args": [*choco, "+algorithm/compressor=strided", *args, f"hydra.run.dir=bad{i}"]}
              for i, (args, _) in enumerate(BAD_OPTIONS)]
    cases += [{"id": option, "args": ["--config-dir", "myconf", f"engine={option}", f"engine.note={cwd / option}",
                                      f"ranks={ranks}", "steps=6", "log_every=3", "baseline_steps=0",
                                      "scaling.reference_cache=null", f"hydra.run.dir={option}"]}
              for option, _, ranks, _ in ENGINES]
    for case in cases:
        case["folder"] = str(cwd)
    env = {k: v for k, v in os.environ.items() if k != "BFEXP_DEBUG"}
    return {"cwd": cwd, **calls(cases, timeout=600, env=env)}


def completed(got: dict, run: str) -> dict:
    ran(got)
    return got["summaries"][f"{run}/summary.json"]


def test_user_compressor_runs_choco_sgd_and_sends_what_it_packs(user_project):
    summary = completed(user_project["strided"], "strided")
    assert summary["status"] == "completed" and summary["algorithm"] == "choco_sgd"
    # exp2 over 4 ranks: each rank sends its payload, every fifth float32 entry, to 2 peers
    assert summary["bytes_sent_per_step"] == 2 * math.ceil(D / 5) * 4


@pytest.mark.parametrize("case", range(len(BAD_OPTIONS)), ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_user_compressor_bad_options_exit_2(user_project, case):
    got, words = user_project[f"bad{case}"], BAD_OPTIONS[case][1]
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"] + got["stdout"]
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bfexp: error:"), got["stderr"]
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in got["stderr"]
    assert not (user_project["cwd"] / f"bad{case}").exists(), "bad input leaves no folder"


def test_user_compressor_by_name_is_refused_naming_the_way_to_pick_it(user_project):
    """A bare name means a shipped option on every rank; the user's own comes in with its group."""
    got = user_project["by_name"]
    assert got["code"] == 2 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"]
    [line] = got["stderr"].strip().splitlines()
    assert "algorithm.compressor=strided; allowed: cast, identity" in line and "algorithm/compressor=NAME" in line


@pytest.mark.parametrize("option, engine, ranks, cls", ENGINES)
def test_user_engine_carries_the_ranks_of_a_job(user_project, option, engine, ranks, cls):
    """engine=<the user's option>: the user's engine class with an option of its own carries every rank."""
    summary = completed(user_project[option], option)
    assert summary["status"] == "completed" and summary["engine"] == engine and summary["ranks"] == ranks
    for rank in range(ranks):
        made, sent = (user_project["cwd"] / f"{option}.rank{rank}").read_text().split()
        assert made == cls and int(sent) > 0
