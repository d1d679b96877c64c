"""Nothing lost, nothing run that was not asked for (issue 44's first class).

bfexp never deletes or overwrites what it did not write, and never runs code named by a data file or a
saved folder. Each case runs the real `bfexp` in a folder of its own and checks three things: one line
on stderr with exit code 2, the foreign files byte for byte as they were, and no marker file that the
named code would have made.

The refusals' command lines all run in one interpreter (tests/cli_in_process.py: `calls`, each in its own
prepared folder): one interpreter and torch start for them all instead of one each. The jobs that run run
on virtual ranks (engine=threads: the same worker code as MPI ranks, tests/test_threads_equivalence.py),
also in one interpreter per phase.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from tests.cli_in_process import calls, ran
from tests.conftest import run_bfexp, write_cifar10

# A program of another lab's, on Hydra as bfexp is: its run and sweep folders look like bfexp's.
OTHER_APP = """\
import hydra


@hydra.main(version_base=None, config_path=None)
def main(cfg):
    print(dict(cfg))


main()
"""


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links as their target's name) and its content's hash."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p.relative_to(folder))] = "dir"
    return out


def refused(proc: Any, *words: str) -> None:
    """``proc`` (a CompletedProcess, or a command line's outcome from ``refusals``) ended in one line and exit 2."""
    assert getattr(proc, "escaped", None) is None, proc.escaped
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("bfexp: error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def bfexp_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    return env


# ---------------------------------------------------------------- the refusals, in one interpreter

# key: (prepare(folder) -> what the test compares against afterwards, the command lines run there in turn)
REFUSALS: dict[str, tuple[Callable[[Path], Any], list[list[str]]]] = {}


def refusal(key: str, *commands: list[str], prepare: Callable[[Path], Any] = lambda folder: None) -> None:
    """A case of ``refusals``: its command lines ("{folder}" in them is its folder's absolute path)."""
    REFUSALS[key] = (prepare, list(commands))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every REFUSALS case prepared in a folder of its own, then all their command lines through the real CLI in
    one interpreter; ``refusals(key)`` gives (folder, what prepare returned, one outcome per command line)."""
    root = tmp_path_factory.mktemp("refusals")
    prepared, cases = {}, []
    for n, (key, (prepare, commands)) in enumerate(REFUSALS.items()):
        folder = root / f"case{n}"
        folder.mkdir()
        prepared[key] = (folder, prepare(folder))
        cases += [{"id": f"{key} #{i}", "folder": str(folder), "args": [a.replace("{folder}", str(folder)) for a in args]}
                  for i, args in enumerate(commands)]
    got = calls(cases, timeout=300, env=bfexp_env())

    def outcome(key: str) -> tuple[Path, Any, list[SimpleNamespace]]:
        folder, state = prepared[key]
        return folder, state, [SimpleNamespace(returncode=r["code"], stderr=r["stderr"], stdout=r["stdout"],
                                               escaped=r["escaped"])
                               for r in (got[f"{key} #{i}"] for i in range(len(REFUSALS[key][1])))]

    return outcome


def other_app(folder: Path, *args: str) -> None:
    """Runs the other program in ``folder``, which it leaves its folders in."""
    (folder / "app.py").write_text(OTHER_APP)
    subprocess.run([sys.executable, "app.py", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def _theirs_run(overrides: list[str]) -> Callable[[Path], dict[str, str]]:
    def prepare(folder: Path) -> dict[str, str]:
        other_app(folder, *overrides, "hydra.run.dir=theirs")
        (folder / "theirs" / "results.csv").write_text("epoch,acc\n1,0.9\n")
        return snapshot(folder / "theirs")

    return prepare


THEIR_RUNS = {"keys-bfexp-refuses": ["+db.user=alice"], "keys-bfexp-knows": ["+lr=0.5", "+steps=3"],
              "no-overrides": []}
for _id, _overrides in THEIR_RUNS.items():
    refusal(f"their-run-{_id}", ["resume=theirs"], prepare=_theirs_run(_overrides))


@pytest.mark.parametrize("case", list(THEIR_RUNS))
def test_resume_of_another_programs_run_folder_touches_nothing(refusals, case):
    """bfexp resume=<another Hydra app's run folder>: refused in one line; the folder (its .hydra/ record, its
    log, a result file of its own) stays as it was: not deleted, not written into, no bfexp job run there."""
    folder, before, [proc] = refusals(f"their-run-{case}")
    refused(proc, "resume:", "another program")
    assert snapshot(folder / "theirs") == before
    assert not (folder / "outputs").exists()


def _their_sweep(folder: Path) -> dict[str, str]:
    other_app(folder, "-m", "+x=1,2", "hydra.sweep.dir=sweep")
    return snapshot(folder / "sweep")


refusal("their-sweep", ["resume=sweep"], prepare=_their_sweep)


def test_resume_of_another_programs_sweep_folder_touches_nothing(refusals):
    folder, before, [proc] = refusals("their-sweep")
    refused(proc, "multirun.yaml", "another program")
    assert snapshot(folder / "sweep") == before


def _their_record(mode: str) -> Callable[[Path], dict[str, str]]:
    def prepare(folder: Path) -> dict[str, str]:
        if mode == "run":
            other_app(folder, "+a=1", "hydra.run.dir=theirs")
        else:
            other_app(folder, "-m", "+a=1,2", "hydra.sweep.dir=theirs")
        return snapshot(folder / "theirs")

    return prepare


refusal("their-record-run", ["hydra.run.dir=theirs", "steps=2"], prepare=_their_record("run"))
refusal("their-record-sweep", ["-m", "hydra.sweep.dir=theirs", "steps=2", "lr=0.1,0.2"],
        prepare=_their_record("sweep"))


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_an_output_folder_holding_another_programs_record_is_refused(refusals, mode):
    """hydra.run.dir= / hydra.sweep.dir= naming another program's folder: refused before Hydra writes its
    record over the other one's."""
    folder, before, [proc] = refusals(f"their-record-{mode}")
    refused(proc, f"hydra.{mode}.dir=theirs", "another program's Hydra record")
    assert snapshot(folder / "theirs") == before


def _my_notes(folder: Path) -> None:
    (folder / "mine").mkdir()
    (folder / "mine" / "notes.log").write_text("my notes\n")


refusal("kept-folder", ["hydra.run.dir=mine", "lr=-1"], prepare=_my_notes)


def test_a_refused_job_keeps_a_folder_that_was_there_before(refusals):
    """Bad input in a folder bfexp did not make in this run (a user named it; it holds only logs): the
    refusal removes nothing of it."""
    folder, _, [proc] = refusals("kept-folder")
    refused(proc, "lr=-1")
    assert (folder / "mine" / "notes.log").read_text() == "my notes\n"


def _foreign_lock(kind: str) -> Callable[[Path], None]:
    def prepare(folder: Path) -> None:
        run = folder / "run"
        run.mkdir()
        target = folder / "precious.txt"
        target.write_text("keep me\n")
        if kind == "symlink":
            (run / ".lock").symlink_to(target)
        elif kind == "folder":
            (run / ".lock").mkdir()
        else:
            os.mkfifo(run / ".lock")

    return prepare


LOCKS = ["symlink", "folder", "fifo"]
for _kind in LOCKS:
    refusal(f"lock-{_kind}", ["hydra.run.dir=run", "steps=2"], ["resume=run"], prepare=_foreign_lock(_kind))


@pytest.mark.parametrize("kind", LOCKS)
def test_a_lock_that_is_not_bfexps_file_is_refused_and_left_alone(refusals, kind):
    """run/.lock as a link to another file (which the lock would have truncated), a folder, a FIFO (which
    would block the open): one line, exit 2, the other file intact."""
    folder, _, [run, resume] = refusals(f"lock-{kind}")
    refused(run, "run/.lock", "folder lock")
    assert (folder / "precious.txt").read_text() == "keep me\n"
    refused(resume, "run/.lock")


GRAPH_FILES = {
    "os-system": {"_target_": "bfexp.topology.GeneratedTopology", "size_arg": None,
                  "graph": {"_target_": "os.system", "command": "touch {marker}"}},
    "subprocess": {"_target_": "bfexp.topology.GeneratedTopology", "size_arg": None,
                   "graph": {"_target_": "subprocess.getoutput", "cmd": "touch {marker}"}},
    "top-level": {"_target_": "os.system", "command": "touch {marker}"},
    "networkx-writer": {"_target_": "bfexp.topology.GeneratedTopology", "size_arg": None,
                        "graph": {"_target_": "networkx.write_edgelist", "G": [], "path": "{marker}"}},
    "user-module": {"_target_": "bfexp.topology.GeneratedTopology",
                    "graph": {"_target_": "mymod.make", "seed": 1}},
}


def _graph_file(case: str) -> Callable[[Path], Path]:
    def prepare(folder: Path) -> Path:
        import yaml

        marker = folder / "MARKER"
        node = yaml.safe_load(yaml.safe_dump(GRAPH_FILES[case]).replace("{marker}", str(marker)))
        (folder / "t.yaml").write_text(yaml.safe_dump(node))
        (folder / "mymod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make(n, seed=0):\n    return None\n")
        return marker

    return prepare


for _case in GRAPH_FILES:
    refusal(f"graph-file-{_case}", ["topology=file", "topology.path=t.yaml", "steps=2"], prepare=_graph_file(_case))


@pytest.mark.parametrize("case", list(GRAPH_FILES))
def test_a_graph_file_chooses_no_code(refusals, case):
    """topology.path=<a YAML topology node>: only bfexp's topologies and networkx's generators may be named
    there; os.system, a networkx function that writes files, or a module of the user's own is refused before
    it is imported or called (the marker it would make is never made; mymod is never imported)."""
    _, marker, [proc] = refusals(f"graph-file-{case}")
    refused(proc, "topology.path=t.yaml", "a graph file may not choose")
    assert not marker.exists()


STDLIB_TARGETS = ["topology.graph._target_=os.system", "topology.graph._target_=builtins.eval",
                  "model._target_=subprocess.getoutput", "dataset._target_=os.getcwd",
                  "optimizer._target_=shutil.rmtree"]
for _override in STDLIB_TARGETS:
    refusal(f"stdlib-{_override}",
            [_override, "steps=2"] + (["topology=generated"] if _override.startswith("topology.") else []))


@pytest.mark.parametrize("override", STDLIB_TARGETS)
def test_pythons_own_functions_build_no_component(refusals, override):
    """A _target_ from Python's standard library builds no component, on the command line either."""
    group = override.partition(".")[0]
    _, _, [proc] = refusals(f"stdlib-{override}")
    refused(proc, "_target_", "builds no" if group != "dataset" else "")


# ---------------------------------------------------------------- jobs that run, and what resumes them

OWN_GRAPH = ["topology=generated", "topology.graph._target_=mymod.ring", "~topology.graph.radius",
             "~topology.graph.seed", "steps=2", "report=false", "hydra.run.dir=run", "baseline_steps=0",
             "engine=threads"]
NAMES_CODE = ["hydra.run.dir=run", "optimizer._target_=torch.optim.SGD", "engine=threads", "steps=3",
              "fail_rank=0", "fail_step=2", "baseline_steps=0", "logger=jsonl"]
CHECKPOINTED = ["hydra.run.dir=run", "engine=threads", "steps=6", "checkpoint_every=3", "baseline_steps=0",
                "logger=jsonl"]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """The jobs of the three tests below, in two interpreters: first the user's graph function's job and the two
    jobs that fail (one saving a _target_ in its overrides, one after a checkpoint at step 3); then, after the
    tests' own steps between (``between(name)``: the refusal, the damaged checkpoint), the two resumes."""
    root = tmp_path_factory.mktemp("saved")
    (root / "own-graph").mkdir()
    (root / "own-graph" / "mymod.py").write_text(
        "import networkx as nx\n\n\ndef ring(n):\n    return nx.cycle_graph(n)\n")
    first = calls([{"id": "own-graph", "folder": str(root / "own-graph"), "args": OWN_GRAPH},
                   {"id": "names-code", "folder": str(root / "names-code"), "args": NAMES_CODE},
                   {"id": "damaged", "folder": str(root / "damaged"),
                    "args": [*CHECKPOINTED, "fail_rank=0", "fail_step=5"]}], timeout=300, env=bfexp_env())
    out: dict[str, Any] = {"root": root, "first": first}
    # names-code: resume without the _target_ given is refused and leaves the folder as it was
    before = snapshot(root / "names-code" / "run")
    out["refusal"] = run_bfexp(["resume=run"], root / "names-code", timeout=120)
    out["untouched"] = snapshot(root / "names-code" / "run") == before
    # damaged: the checkpoint's file replaced by a pickle that names os.system
    (root / "damaged" / "run" / "checkpoint" / "step3" / "rank0.pt").write_bytes(pickle.dumps(_Marker(root / "MARKER")))
    out["resumed"] = calls([{"id": "names-code", "folder": str(root / "names-code"),
                             "args": ["resume=run", "optimizer._target_=torch.optim.SGD", "fail_rank=null"]},
                            {"id": "damaged", "folder": str(root / "damaged"), "args": ["resume=run", "fail_rank=null"]}],
                           timeout=300, env=bfexp_env())
    return out


def test_a_graph_function_of_the_users_own_named_in_the_config_runs(saved_runs):
    """What a user does want: their own graph function, named in the config they compose."""
    got = saved_runs["first"]["own-graph"]
    ran(got)
    assert got["summaries"]["run/summary.json"]["status"] == "completed"


def test_resume_does_not_run_code_a_saved_folder_names(saved_runs):
    """A run folder whose saved overrides name a _target_ (one shared by someone else, or edited): resume
    refuses it and says how to give it; given beside resume=, it runs."""
    assert saved_runs["first"]["names-code"]["code"] == 1  # the injected failure
    refused(saved_runs["refusal"], "optimizer._target_=torch.optim.SGD", "give optimizer._target_ yourself")
    assert saved_runs["untouched"]
    got = saved_runs["resumed"]["names-code"]
    ran(got)


class _Marker:
    """Pickles as a call of os.system, as a tampered data file would."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _tampered_cifar(folder: Path) -> Path:
    """CIFAR-10 batches in folder/c whose data_batch_3 names os.system; the marker it would make."""
    batches = write_cifar10(folder / "c", per_batch=10)
    marker = folder / "MARKER"
    tampered = {**batches["data_batch_3"], b"batch_label": _Marker(marker)}
    (folder / "c" / "data_batch_3").write_bytes(pickle.dumps(tampered))
    return marker


refusal("cifar-driver", ["dataset=cifar10", "dataset.root={folder}/c", "model=cnn", "steps=2"], prepare=_tampered_cifar)


@pytest.mark.parametrize("where", ["driver", "rank"])
def test_a_cifar_batch_that_names_code_is_refused(request, tmp_path, where):
    """dataset=cifar10 reads pickles; one that names a function (os.system) is refused by the driver's check
    before it runs, and by the loader a rank uses."""
    from bfexp.data import CIFAR10, DatasetError

    if where == "driver":
        _, marker, [proc] = request.getfixturevalue("refusals")("cifar-driver")
        refused(proc, "data_batch_3", "os.system" if os.name != "posix" else "system")
    else:
        marker = _tampered_cifar(tmp_path)
        root = tmp_path / "c"
        with pytest.raises(DatasetError, match="data_batch_3 is not a CIFAR-10 batch .*may not run"):
            CIFAR10(root=str(root), partition="iid", alpha=0.5, eval_samples=0).load(0, 1, seed=0)
    assert not marker.exists()


# ---------------------------------------------------------------- memory and time nobody bounded


CORPORA = {"dev-zero": ("/dev/zero", "a character device", lambda folder: None),
           "fifo": ("corpus", "a FIFO", lambda folder: os.mkfifo(folder / "corpus")),
           "link-to-dev-zero": ("corpus.txt", "a character device",
                                lambda folder: os.symlink("/dev/zero", folder / "corpus.txt"))}
for _kind, (_path, _, _prepare) in CORPORA.items():
    refusal(f"corpus-{_kind}", ["dataset=text", f"dataset.path={_path}", "model=gpt", "steps=2"], prepare=_prepare)


@pytest.mark.parametrize("kind", list(CORPORA))
def test_a_corpus_that_never_ends_or_blocks_is_refused(refusals, kind):
    """dataset=text with dataset.path=/dev/zero (read without end) or a FIFO (whose open blocks): one line,
    exit 2, promptly (the fixture's timeout would end a read of /dev/zero or a blocked open)."""
    _, _, [proc] = refusals(f"corpus-{kind}")
    refused(proc, "dataset.path=", CORPORA[kind][1])


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_bfexp_report_names_a_summary_that_is_not_a_file(tmp_path, kind):
    """bfexp-report over a job folder whose summary.json is /dev/zero or a FIFO: the job is listed as damaged,
    naming what the file is, and the report ends (no unbounded read, no blocked open)."""
    job = tmp_path / "sweep" / "0_lr=0.1"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- lr=0.1\n")
    if kind == "dev-zero":
        os.symlink("/dev/zero", job / "summary.json")
    else:
        os.mkfifo(job / "summary.json")
    proc = subprocess.run([sys.executable, "-m", "bfexp.report", str(tmp_path / "sweep")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert "character device" in out if kind == "dev-zero" else "a FIFO" in out, out[-2000:]


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_bfexp_report_reads_no_config_that_is_not_a_file(tmp_path, kind):
    """bfexp-report over a completed job whose config.yaml is /dev/zero or a FIFO (its targets and its scaling
    section come from there): the job is reported without them and the report ends (no unbounded read, no
    blocked open)."""
    job = tmp_path / "sweep" / "0_lr=0.1"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- lr=0.1\n")
    (job / "summary.json").write_text(json.dumps({"status": "completed", "algorithm": "dsgd", "ranks": 2,
                                                  "run_machines": 2, "modeled": {"compute_source": "measured here"}}))
    (job / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "accuracy": 0.5, "time_s": 0.1}) + "\n")
    if kind == "dev-zero":
        os.symlink("/dev/zero", job / "config.yaml")
    else:
        os.mkfifo(job / "config.yaml")
    proc = subprocess.run([sys.executable, "-m", "bfexp.report", str(tmp_path / "sweep"), "--no-plots"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "sweep" / "report.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["status"] == "completed" and not row.get("target_accuracy")
    assert not any(v for k, v in row.items() if "@" in k)  # no cluster read from it to price on


def test_read_file_takes_regular_files_within_their_limit(tmp_path):
    """bfexp.files.read_file: a file's bytes; more than its limit, a FIFO or a device refused before reading."""
    from bfexp.files import NotARegularFile, TooLarge, read_file

    (tmp_path / "small").write_bytes(b"x" * 100)
    assert read_file(tmp_path / "small", 100) == b"x" * 100
    with pytest.raises(TooLarge, match="100 bytes, more than the 99"):
        read_file(tmp_path / "small", 99)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotARegularFile, match="a FIFO"):
        read_file(tmp_path / "fifo", 10)
    with pytest.raises(NotARegularFile, match="a character device"):
        read_file("/dev/zero", 10)
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "none", 10)


TIME_NOBODY_WAITS_FOR = [
    (["steps=9223372036854775808"], "steps=9223372036854775808; allowed: an integer in [1, 1e+09]"),
    (["steps=1000000001"], "allowed: an integer in [1, 1e+09]"),
    (["budget_s=1", "eval_every_s=1e-9"], "schedules 1e+09 evaluations in budget_s=1.0; allowed: eval_every_s >= "),
    (["budget_s=100", "eval_every_s=0.001"], "schedules 1e+05 evaluations"),
    (["eval_every_s=1"], "budget_s is null; allowed: budget_s=<seconds> beside it, or eval_every_s=null"),
    (["-m", "steps=2,9223372036854775807"], "(sweep point steps=9223372036854775807)"),
]
for _args, _ in TIME_NOBODY_WAITS_FOR:
    refusal(f"time-{_args}", _args)


@pytest.mark.parametrize("args, said", TIME_NOBODY_WAITS_FOR)
def test_time_nobody_would_wait_for_is_refused(refusals, args, said):
    """A step count past 1e9 (2**63 trained until killed), evaluations by the billion, eval_every_s that a job
    without a budget would ignore: one line, exit 2, before anything is built."""
    _, _, [proc] = refusals(f"time-{args}")
    refused(proc, said)


# ---------------------------------------------------------------- silently ignored, now refused


WOULD_BE_IGNORED = [
    (["launcher=emulated", "engine=threads"], "launcher=emulated starts process ranks on its machines, and "
                                              "engine=threads runs the ranks as threads"),
    (["launcher=mpirun", "launcher.hosts=[localhost:2]", "engine=stacked"], "launcher=mpirun starts process ranks"),
    (["hydra/launcher=slurm"], "hydra/launcher=slurm submits the jobs of a sweep, and this command is one job"),
    (["launcher=mpirun", "launcher.hosts=[localhost:2]", "launcher.extra_args=--bogus"],
     "launcher.extra_args='--bogus'; allowed: a list of strings"),
    (["launcher=mpirun", "launcher.hosts=[localhost:2]", "launcher.extra_args=5"], "launcher.extra_args=5; allowed"),
    (["launcher=emulated", "launcher.link_rate=0bit"], "launcher.link_rate=0bit; allowed: a rate above 0"),
    (["launcher=emulated", "launcher.link_rate=0.0gbit"], "launcher.link_rate=0.0gbit; allowed: a rate above 0"),
]
for _args, _ in WOULD_BE_IGNORED:
    refusal(f"ignored-{_args}", [*_args, "steps=2"])


@pytest.mark.parametrize("args, said", WOULD_BE_IGNORED)
def test_an_option_that_would_be_ignored_is_refused(refusals, args, said):
    """What ran as something else (virtual ranks under a launcher of machines, a sweep launcher without a
    sweep), a string split into one-character arguments, a link rate of 0 that reached tc: one line, exit 2,
    and no folder."""
    folder, _, [proc] = refusals(f"ignored-{args}")
    refused(proc, said)
    assert not (folder / "outputs").exists()


@pytest.mark.parametrize("args, said", [
    (["--network-interface", "eth0"], "--network-interface eth0 without --hosts, --hostfile or --srun"),
    (["--srun", "--engine", "threads"], "--hosts/--hostfile/--srun with --engine threads"),
])
def test_bfexp_run_refuses_what_it_would_ignore(tmp_path, args, said):
    (tmp_path / "train.py").write_text("print('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "bfexp.run", "-n", "2", *args, "python", "train.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr and "ran" not in proc.stdout, proc.stderr


# ---------------------------------------------------------------- one clear line where a traceback was


refusal("nested", ["lr=" + "[" * 3000 + "]" * 3000])


def test_an_override_nested_thousands_deep_is_one_line(refusals):
    """lr=[[[...]]] 3,000 deep: Hydra's parser recursed into 2,015 lines of traceback; now one line."""
    _, _, [proc] = refusals("nested")
    refused(proc, "nests 3000 levels of brackets")


NULLS = [("checkpoint_every=null", "checkpoint_every=null; allowed: an integer (default 0)"),
         ("steps=null", "steps=null; allowed: an integer (default 200)")]
for _override, _ in NULLS:
    refusal(f"null-{_override}", [_override])


@pytest.mark.parametrize("override, said", NULLS)
def test_null_for_a_key_that_takes_a_value_says_what_it_takes(refusals, override, said):
    _, _, [proc] = refusals(f"null-{override}")
    refused(proc, said)


NOT_GRAPH_FILES = [
    ("", "empty.edges", "names no edge; allowed: lines `src dst [weight]` over ranks 0..3"),
    ("# only a comment\n", "comment.edges", "names no edge"),
    (None, "objects.npy", "it holds Python objects, not numbers"),
    (b"PK\x03\x04 not a zip", "junk.npz", "cannot be read as a matrix"),
]


def _not_a_graph_file(content: str | bytes | None, name: str) -> Callable[[Path], None]:
    def prepare(folder: Path) -> None:
        import numpy as np

        path = folder / name
        if content is None:
            np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return prepare


for _content, _name, _ in NOT_GRAPH_FILES:
    refusal(f"not-a-graph-{_name}", ["topology=file", f"topology.path={_name}", "steps=2"],
            prepare=_not_a_graph_file(_content, _name))


@pytest.mark.parametrize("content, name, said", NOT_GRAPH_FILES)
def test_a_graph_file_that_is_not_one_is_one_line_with_advice_that_runs(refusals, content, name, said):
    """An empty edge list advised ranks=0 (itself refused); an .npy of Python objects quoted numpy's
    allow_pickle (advice to run what the file names); a damaged .npz ended in a traceback."""
    _, _, [proc] = refusals(f"not-a-graph-{name}")
    refused(proc, said)
    assert "allow_pickle" not in proc.stderr and "ranks=0" not in proc.stderr


def test_a_damaged_checkpoint_is_named_without_torchs_advice_to_load_it_unsafely(saved_runs):
    """A checkpoint file replaced by a pickle that names os.system: the resumed job fails naming the file and
    what to do; torch's advice (weights_only=False, which would run it) is not repeated; nothing ran."""
    assert saved_runs["first"]["damaged"]["code"] == 1  # the injected failure, after the checkpoint at step 3
    got = saved_runs["resumed"]["damaged"]
    assert got["code"] == 1 and got["escaped"] is None, got["stderr"][-2000:] + (got["escaped"] or "")
    error = json.loads((saved_runs["root"] / "damaged" / "run" / "summary.json").read_text())["error"]
    assert "checkpoint/step3/rank0.pt cannot be read: it is damaged or not a bfexp checkpoint" in error, error
    assert "weights_only" not in error + got["stderr"] + got["stdout"]
    assert not (saved_runs["root"] / "MARKER").exists()


def test_bfexp_run_log_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "logs").write_text("mine\n")
    (tmp_path / "train.py").write_text("print('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "bfexp.run", "-n", "2", "--log-dir", "logs", "python", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "bfexp-run: --log-dir logs is a file; allowed: a folder (made if missing) for the ranks' logs")
    assert (tmp_path / "logs").read_text() == "mine\n"


@pytest.mark.parametrize("args, said", [
    (["--hosts"], "--hosts needs a value"), (["--rate", "0bit"], "--rate 0bit; allowed: a tc rate above 0"),
    (["--cpu", "1000"], "--cpu 1000; allowed: a number of cores above 0 and at most"),
    (["--cpu", "-1"], "--cpu -1; allowed"), (["--hosts", "9"], "--hosts 9; allowed: 1 to 8"),
])
def test_cluster_local_checks_its_options_before_it_makes_anything(args, said):
    """scripts/cluster_local.sh up with a bad value: exit 2 and one line, before any namespace, sshd or Slurm
    exists (checked here as any user: the checks come before its need for root)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "cluster_local.sh"
    proc = subprocess.run(["bash", str(script), "up", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


HYDRA_RECORDS = [(".hydra/hydra.yaml", "fifo"), (".hydra/config.yaml", "link"), (".hydra/overrides.yaml", "fifo"),
                 ("multirun.yaml", "fifo")]


def _not_a_record(where: str, kind: str) -> Callable[[Path], None]:
    def prepare(folder: Path) -> None:
        (folder / "out" / ".hydra").mkdir(parents=True)
        other = folder / "other.txt"
        other.write_text("keep\n")
        if kind == "fifo":
            os.mkfifo(folder / "out" / where)
        else:
            (folder / "out" / where).symlink_to(other)

    return prepare


for _where, _kind in HYDRA_RECORDS:
    _args = ["-m", "hydra.sweep.dir=out", "lr=0.1,0.2"] if _where == "multirun.yaml" else ["hydra.run.dir=out"]
    refusal(f"record-{_where}", [*_args, "steps=2"], prepare=_not_a_record(_where, _kind))


@pytest.mark.parametrize("where, kind", HYDRA_RECORDS)
def test_a_hydra_record_that_is_not_a_file_is_refused_before_hydra_writes_it(refusals, where, kind):
    """Hydra writes its record into the run (or sweep) folder: into a FIFO it waited forever, through a link it
    overwrote the file linked to. Refused in one line, the linked file untouched, nothing left waiting."""
    folder, _, [proc] = refusals(f"record-{where}")
    refused(proc, f"out/{where} is not a regular file")
    assert (folder / "other.txt").read_text() == "keep\n"


def test_a_plan_json_that_is_not_a_file_is_no_plan(tmp_path):
    """A rank reads the driver's plan bounded: a plan.json linked to /dev/zero (or a FIFO) is no plan."""
    from bfexp.plan import Plan

    os.symlink("/dev/zero", tmp_path / "plan.json")
    assert Plan.read(tmp_path) is None
    (tmp_path / "plan.json").unlink()
    os.mkfifo(tmp_path / "plan.json")
    assert Plan.read(tmp_path) is None
