"""Nothing lost, nothing run that was not asked for (issue 44's first class).

bfexp never deletes or overwrites what it did not write, and never runs code named by a data file or a
saved folder. Each case runs the real `bfexp` in a folder of its own and checks three things: one line
on stderr with exit code 2, the foreign files byte for byte as they were, and no marker file that the
named code would have made.
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

import pytest

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


def refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("bfexp: error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture
def other_app(tmp_path):
    """Runs the other program in tmp_path: other_app(*overrides) leaves its folders there."""
    (tmp_path / "app.py").write_text(OTHER_APP)

    def run(*args: str) -> None:
        subprocess.run([sys.executable, "app.py", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    return run


@pytest.mark.parametrize("overrides", [["+db.user=alice"], ["+lr=0.5", "+steps=3"], []],
                         ids=["keys-bfexp-refuses", "keys-bfexp-knows", "no-overrides"])
def test_resume_of_another_programs_run_folder_touches_nothing(tmp_path, other_app, overrides):
    """bfexp resume=<another Hydra app's run folder>: refused in one line; the folder (its .hydra/ record, its
    log, a result file of its own) stays as it was: not deleted, not written into, no bfexp job run there."""
    other_app(*overrides, "hydra.run.dir=theirs")
    (tmp_path / "theirs" / "results.csv").write_text("epoch,acc\n1,0.9\n")
    before = snapshot(tmp_path / "theirs")
    refused(run_bfexp(["resume=theirs"], tmp_path, timeout=120), "resume:", "another program")
    assert snapshot(tmp_path / "theirs") == before
    assert not (tmp_path / "outputs").exists()


def test_resume_of_another_programs_sweep_folder_touches_nothing(tmp_path, other_app):
    other_app("-m", "+x=1,2", "hydra.sweep.dir=sweep")
    before = snapshot(tmp_path / "sweep")
    refused(run_bfexp(["resume=sweep"], tmp_path, timeout=120), "multirun.yaml", "another program")
    assert snapshot(tmp_path / "sweep") == before


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_an_output_folder_holding_another_programs_record_is_refused(tmp_path, other_app, mode):
    """hydra.run.dir= / hydra.sweep.dir= naming another program's folder: refused before Hydra writes its
    record over the other one's."""
    if mode == "run":
        other_app("+a=1", "hydra.run.dir=theirs")
        args = ["hydra.run.dir=theirs", "steps=2"]
    else:
        other_app("-m", "+a=1,2", "hydra.sweep.dir=theirs")
        args = ["-m", "hydra.sweep.dir=theirs", "steps=2", "lr=0.1,0.2"]
    before = snapshot(tmp_path / "theirs")
    refused(run_bfexp(args, tmp_path, timeout=120), f"hydra.{mode}.dir=theirs", "another program's Hydra record")
    assert snapshot(tmp_path / "theirs") == before


def test_a_refused_job_keeps_a_folder_that_was_there_before(tmp_path):
    """Bad input in a folder bfexp did not make in this run (a user named it; it holds only logs): the
    refusal removes nothing of it."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.log").write_text("my notes\n")
    refused(run_bfexp(["hydra.run.dir=mine", "lr=-1"], tmp_path, timeout=120), "lr=-1")
    assert (folder / "notes.log").read_text() == "my notes\n"


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_a_lock_that_is_not_bfexps_file_is_refused_and_left_alone(tmp_path, kind):
    """run/.lock as a link to another file (which the lock would have truncated), a folder, a FIFO (which
    would block the open): one line, exit 2, the other file intact."""
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    if kind == "symlink":
        (run / ".lock").symlink_to(target)
    elif kind == "folder":
        (run / ".lock").mkdir()
    else:
        os.mkfifo(run / ".lock")
    refused(run_bfexp(["hydra.run.dir=run", "steps=2"], tmp_path, timeout=120), "run/.lock", "folder lock")
    assert target.read_text() == "keep me\n"
    refused(run_bfexp(["resume=run"], tmp_path, timeout=120), "run/.lock")


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


@pytest.mark.parametrize("case", list(GRAPH_FILES))
def test_a_graph_file_chooses_no_code(tmp_path, case):
    """topology.path=<a YAML topology node>: only bfexp's topologies and networkx's generators may be named
    there; os.system, a networkx function that writes files, or a module of the user's own is refused before
    it is imported or called (the marker it would make is never made; mymod is never imported)."""
    import yaml

    marker = tmp_path / "MARKER"
    node = yaml.safe_load(yaml.safe_dump(GRAPH_FILES[case]).replace("{marker}", str(marker)))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(node))
    (tmp_path / "mymod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make(n, seed=0):\n    return None\n")
    refused(run_bfexp(["topology=file", "topology.path=t.yaml", "steps=2"], tmp_path, timeout=120),
            "topology.path=t.yaml", "a graph file may not choose")
    assert not marker.exists()


@pytest.mark.parametrize("override", ["topology.graph._target_=os.system", "topology.graph._target_=builtins.eval",
                                      "model._target_=subprocess.getoutput", "dataset._target_=os.getcwd",
                                      "optimizer._target_=shutil.rmtree"])
def test_pythons_own_functions_build_no_component(tmp_path, override):
    """A _target_ from Python's standard library builds no component, on the command line either."""
    group = override.partition(".")[0]
    overrides = [override, "steps=2"] + (["topology=generated"] if group == "topology" else [])
    refused(run_bfexp(overrides, tmp_path, timeout=120), "_target_", "builds no" if group != "dataset" else "")


def test_a_graph_function_of_the_users_own_named_in_the_config_runs(tmp_path):
    """What a user does want: their own graph function, named in the config they compose."""
    (tmp_path / "mymod.py").write_text("import networkx as nx\n\n\ndef ring(n):\n    return nx.cycle_graph(n)\n")
    proc = run_bfexp(["topology=generated", "topology.graph._target_=mymod.ring", "~topology.graph.radius",
                      "~topology.graph.seed", "steps=2", "report=false", "hydra.run.dir=run", "baseline_steps=0"],
                     tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_resume_does_not_run_code_a_saved_folder_names(tmp_path):
    """A run folder whose saved overrides name a _target_ (one shared by someone else, or edited): resume
    refuses it and says how to give it; given beside resume=, it runs."""
    args = ["hydra.run.dir=run", "optimizer._target_=torch.optim.SGD", "engine=threads", "steps=3",
            "fail_rank=0", "fail_step=2", "baseline_steps=0", "logger=jsonl"]
    assert run_bfexp(args, tmp_path, timeout=240).returncode == 1  # the injected failure
    before = snapshot(tmp_path / "run")
    refused(run_bfexp(["resume=run"], tmp_path, timeout=120), "optimizer._target_=torch.optim.SGD",
            "give optimizer._target_ yourself")
    assert snapshot(tmp_path / "run") == before
    proc = run_bfexp(["resume=run", "optimizer._target_=torch.optim.SGD", "fail_rank=null"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


class _Marker:
    """Pickles as a call of os.system, as a tampered data file would."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("where", ["driver", "rank"])
def test_a_cifar_batch_that_names_code_is_refused(tmp_path, where):
    """dataset=cifar10 reads pickles; one that names a function (os.system) is refused by the driver's check
    before it runs, and by the loader a rank uses."""
    from bfexp.data import CIFAR10, DatasetError

    root = tmp_path / "c"
    batches = write_cifar10(root, per_batch=10)
    marker = tmp_path / "MARKER"
    tampered = {**batches["data_batch_3"], b"batch_label": _Marker(marker)}
    (root / "data_batch_3").write_bytes(pickle.dumps(tampered))
    if where == "driver":
        refused(run_bfexp(["dataset=cifar10", f"dataset.root={root}", "model=cnn", "steps=2"], tmp_path,
                          timeout=240), "data_batch_3", "os.system" if os.name != "posix" else "system")
    else:
        with pytest.raises(DatasetError, match="data_batch_3 is not a CIFAR-10 batch .*may not run"):
            CIFAR10(root=str(root), partition="iid", alpha=0.5, eval_samples=0).load(0, 1, seed=0)
    assert not marker.exists()


# ---------------------------------------------------------------- memory and time nobody bounded


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "link-to-dev-zero"])
def test_a_corpus_that_never_ends_or_blocks_is_refused(tmp_path, kind):
    """dataset=text with dataset.path=/dev/zero (read without end) or a FIFO (whose open blocks): one line,
    exit 2, promptly (the timeout would end a read of /dev/zero or a blocked open)."""
    if kind == "dev-zero":
        path, what = "/dev/zero", "a character device"
    elif kind == "fifo":
        os.mkfifo(tmp_path / "corpus")
        path, what = "corpus", "a FIFO"
    else:
        os.symlink("/dev/zero", tmp_path / "corpus.txt")
        path, what = "corpus.txt", "a character device"
    refused(run_bfexp(["dataset=text", f"dataset.path={path}", "model=gpt", "steps=2"], tmp_path, timeout=60),
            "dataset.path=", what)


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


@pytest.mark.parametrize("args, said", [
    (["steps=9223372036854775808"], "steps=9223372036854775808; allowed: an integer in [1, 1e+09]"),
    (["steps=1000000001"], "allowed: an integer in [1, 1e+09]"),
    (["budget_s=1", "eval_every_s=1e-9"], "schedules 1e+09 evaluations in budget_s=1.0; allowed: eval_every_s >= "),
    (["budget_s=100", "eval_every_s=0.001"], "schedules 1e+05 evaluations"),
    (["eval_every_s=1"], "budget_s is null; allowed: budget_s=<seconds> beside it, or eval_every_s=null"),
    (["-m", "steps=2,9223372036854775807"], "(sweep point steps=9223372036854775807)"),
])
def test_time_nobody_would_wait_for_is_refused(tmp_path, args, said):
    """A step count past 1e9 (2**63 trained until killed), evaluations by the billion, eval_every_s that a job
    without a budget would ignore: one line, exit 2, before anything is built."""
    refused(run_bfexp(args, tmp_path, timeout=60), said)


# ---------------------------------------------------------------- silently ignored, now refused


@pytest.mark.parametrize("args, said", [
    (["launcher=emulated", "engine=threads"], "launcher=emulated starts process ranks on its machines, and "
                                              "engine=threads runs the ranks as threads"),
    (["launcher=mpirun", "launcher.hosts=[localhost:2]", "engine=stacked"], "launcher=mpirun starts process ranks"),
    (["hydra/launcher=slurm"], "hydra/launcher=slurm submits the jobs of a sweep, and this command is one job"),
    (["launcher=mpirun", "launcher.hosts=[localhost:2]", "launcher.extra_args=--bogus"],
     "launcher.extra_args='--bogus'; allowed: a list of strings"),
    (["launcher=mpirun", "launcher.hosts=[localhost:2]", "launcher.extra_args=5"], "launcher.extra_args=5; allowed"),
    (["launcher=emulated", "launcher.link_rate=0bit"], "launcher.link_rate=0bit; allowed: a rate above 0"),
    (["launcher=emulated", "launcher.link_rate=0.0gbit"], "launcher.link_rate=0.0gbit; allowed: a rate above 0"),
])
def test_an_option_that_would_be_ignored_is_refused(tmp_path, args, said):
    """What ran as something else (virtual ranks under a launcher of machines, a sweep launcher without a
    sweep), a string split into one-character arguments, a link rate of 0 that reached tc: one line, exit 2,
    and no folder."""
    refused(run_bfexp([*args, "steps=2"], tmp_path, timeout=120), said)
    assert not (tmp_path / "outputs").exists()


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


def test_an_override_nested_thousands_deep_is_one_line(tmp_path):
    """lr=[[[...]]] 3,000 deep: Hydra's parser recursed into 2,015 lines of traceback; now one line."""
    refused(run_bfexp(["lr=" + "[" * 3000 + "]" * 3000], tmp_path, timeout=60), "nests 3000 levels of brackets")


@pytest.mark.parametrize("override, said", [
    ("checkpoint_every=null", "checkpoint_every=null; allowed: an integer (default 0)"),
    ("steps=null", "steps=null; allowed: an integer (default 200)"),
])
def test_null_for_a_key_that_takes_a_value_says_what_it_takes(tmp_path, override, said):
    refused(run_bfexp([override], tmp_path, timeout=60), said)


@pytest.mark.parametrize("content, name, said", [
    ("", "empty.edges", "names no edge; allowed: lines `src dst [weight]` over ranks 0..3"),
    ("# only a comment\n", "comment.edges", "names no edge"),
    (None, "objects.npy", "it holds Python objects, not numbers"),
    (b"PK\x03\x04 not a zip", "junk.npz", "cannot be read as a matrix"),
])
def test_a_graph_file_that_is_not_one_is_one_line_with_advice_that_runs(tmp_path, content, name, said):
    """An empty edge list advised ranks=0 (itself refused); an .npy of Python objects quoted numpy's
    allow_pickle (advice to run what the file names); a damaged .npz ended in a traceback."""
    import numpy as np

    path = tmp_path / name
    if content is None:
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    proc = run_bfexp(["topology=file", f"topology.path={name}", "steps=2"], tmp_path, timeout=60)
    refused(proc, said)
    assert "allow_pickle" not in proc.stderr and "ranks=0" not in proc.stderr


def test_a_damaged_checkpoint_is_named_without_torchs_advice_to_load_it_unsafely(tmp_path):
    """A checkpoint file replaced by a pickle that names os.system: the resumed job fails naming the file and
    what to do; torch's advice (weights_only=False, which would run it) is not repeated; nothing ran."""
    import json

    marker = tmp_path / "MARKER"
    args = ["hydra.run.dir=run", "engine=threads", "steps=6", "checkpoint_every=3", "baseline_steps=0",
            "logger=jsonl"]
    assert run_bfexp([*args, "fail_rank=0", "fail_step=5"], tmp_path, timeout=240).returncode == 1
    (tmp_path / "run" / "checkpoint" / "step3" / "rank0.pt").write_bytes(pickle.dumps(_Marker(marker)))
    proc = run_bfexp(["resume=run", "fail_rank=null"], tmp_path, timeout=240)
    assert proc.returncode == 1
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert "checkpoint/step3/rank0.pt cannot be read: it is damaged or not a bfexp checkpoint" in error, error
    assert "weights_only" not in error + proc.stderr and not marker.exists()


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


@pytest.mark.parametrize("where, kind", [(".hydra/hydra.yaml", "fifo"), (".hydra/config.yaml", "link"),
                                         (".hydra/overrides.yaml", "fifo"), ("multirun.yaml", "fifo")])
def test_a_hydra_record_that_is_not_a_file_is_refused_before_hydra_writes_it(tmp_path, where, kind):
    """Hydra writes its record into the run (or sweep) folder: into a FIFO it waited forever, through a link it
    overwrote the file linked to. Refused in one line, the linked file untouched, nothing left waiting."""
    folder = tmp_path / "out"
    (folder / ".hydra").mkdir(parents=True)
    other = tmp_path / "other.txt"
    other.write_text("keep\n")
    if kind == "fifo":
        os.mkfifo(folder / where)
    else:
        (folder / where).symlink_to(other)
    args = ["-m", "hydra.sweep.dir=out", "lr=0.1,0.2"] if where == "multirun.yaml" else ["hydra.run.dir=out"]
    refused(run_bfexp([*args, "steps=2"], tmp_path, timeout=60), f"out/{where} is not a regular file")
    assert other.read_text() == "keep\n"


def test_a_plan_json_that_is_not_a_file_is_no_plan(tmp_path):
    """A rank reads the driver's plan bounded: a plan.json linked to /dev/zero (or a FIFO) is no plan."""
    from bfexp.plan import Plan

    os.symlink("/dev/zero", tmp_path / "plan.json")
    assert Plan.read(tmp_path) is None
    (tmp_path / "plan.json").unlink()
    os.mkfifo(tmp_path / "plan.json")
    assert Plan.read(tmp_path) is None
