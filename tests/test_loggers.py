"""The logger group: console progress, wandb offline runs, the optional-extra check."""

import importlib.util
import io
import os
import struct
import sys

import pytest
from rich.console import Console

from bfexp import progress
from bfexp.cli import group_options
from bfexp.progress import ConsoleProgress
from tests.cli_in_process import call, calls, ran

HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None

# The jobs below that track (each in a folder of its own), one after another in one interpreter
# (tests/cli_in_process.py), $WANDB_MODE unset (the default mode is what they check): {name: (needs, args)}.
JOBS = {
    "wandb_sweep": (HAS_WANDB, ["-m", "ranks=1", "steps=4", "log_every=2", "logger=wandb", "report=false",
                                "engine=threads", "hydra.sweep.dir=sweep"]),
    "tensorboard": (HAS_TENSORBOARD, ["ranks=2", "steps=6", "log_every=2", "logger=tensorboard", "engine=threads",
                                      "hydra.run.dir=run"]),
    # run/tensorboard a file before the job starts (made by the fixture)
    "tensorboard_file": (HAS_TENSORBOARD, ["ranks=2", "steps=4", "logger=tensorboard", "engine=threads",
                                           "baseline_steps=0", "hydra.run.dir=run"]),
    "several": (HAS_WANDB and HAS_TENSORBOARD,
                ["logger=[wandb,tensorboard]", "logger.project=mine", "logger.progress=false", "ranks=2", "steps=4",
                 "log_every=2", "engine=threads", "baseline_steps=0", "hydra.run.dir=run"]),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{JOBS's name: (its folder, what calls gave: exit code, all its stdout, stderr)} for those whose packages
    are installed."""
    root = tmp_path_factory.mktemp("loggers")
    (root / "tensorboard_file" / "run").mkdir(parents=True)
    (root / "tensorboard_file" / "run" / "tensorboard").write_text("mine\n")
    cases = [{"id": name, "folder": str(root / name), "args": args, "whole_stdout": True}
             for name, (needs, args) in JOBS.items() if needs]
    got = calls(cases, timeout=600, env={k: v for k, v in os.environ.items() if k != "WANDB_MODE"})
    return {name: (root / name, got[name]) for name in got}


def finished(jobs, name):
    folder, got = jobs[name]
    ran(got)
    return folder, got


def test_plain_progress_lines_with_eta(monkeypatch):
    """Off a terminal: one line per record; the ETA is the pace since the previous record
    (start-up excluded) times the steps left."""
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=False, width=200))
    with ConsoleProgress(100, "dsgd/exp2 x4") as bar:
        assert not bar.interactive
        bar.update({"step": 10, "loss": 0.5, "accuracy": 0.75, "step_time_s": 0.01, "elapsed_s": 5.0})
        # 10 steps took 2 s since the last record: 80 steps left take 16 s.
        bar.update({"step": 20, "loss": 0.25, "accuracy": 0.8, "step_time_s": 0.01, "elapsed_s": 7.0})
    lines = out.getvalue().splitlines()
    assert lines[0] == "dsgd/exp2 x4: starting ranks"
    assert lines[1].split() == ["step", "10/100", "loss", "0.5", "acc", "0.75", "step", "0.01", "s", "eta", "45", "s"]
    assert lines[2].endswith("eta 16 s")


def test_progress_counts_epochs_when_the_job_has_them(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=False, width=200))
    with ConsoleProgress(200, "x", epochs=4) as bar:
        bar.update({"step": 30, "epoch": 1.0, "elapsed_s": 10.0})
        bar.update({"step": 60, "epoch": 2.0, "elapsed_s": 13.0})
    # 1 epoch per 3 s since the previous record, 2 epochs left.
    assert out.getvalue().splitlines()[-1].endswith("(epoch 2/4)  loss -  acc -  step - s  eta 6 s")


def test_no_progress_when_disabled(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=False))
    with ConsoleProgress(10, "x", enabled=False) as bar:
        bar.update({"step": 5, "loss": 1.0, "elapsed_s": 1.0})
    assert out.getvalue() == ""


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_tracker_missing_exits_2_with_the_install_command(tmp_path, monkeypatch, package):
    """Without the package importable (None in sys.modules hides it; find_spec then says it is absent),
    logger=<package> stops before any rank. The CLI runs in this interpreter (tests/cli_in_process.py)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, package, None)
    proc = call([f"logger={package}", "hydra.run.dir=run"])
    assert proc["code"] == 2 and proc["escaped"] is None, proc
    assert proc["stderr"].strip().splitlines() == [
        f"bfexp: error: logger={package} needs the {package} package; install it with: pip install 'bfexp[{package}]'"]
    assert not (tmp_path / "run" / "logs").exists(), "no rank was started"


def wandb_records(path):
    """Records of an offline run's .wandb file: a 7-byte header, then the LevelDB log
    format (32 KiB blocks of chunks, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk ends a record
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def item_key(item):
    return item.key or "/".join(item.nested_key)


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is an optional extra (pip install 'bfexp[wandb]'); not installed")
def test_wandb_offline_run_per_job_grouped_by_sweep(jobs):
    assert "threads" in group_options("engine")  # JOBS's wandb_sweep: no rank spawn
    job = next((finished(jobs, "wandb_sweep")[0] / "sweep").glob("0_*"))
    runs = list((job / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline run per job, inside the job's folder"
    records = list(wandb_records(next(runs[0].glob("run-*.wandb"))))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group, run.display_name, run.job_type) == ("bfexp", "sweep", job.name, "dsgd")
    config = {item_key(u): u.value_json for u in run.config.update}
    assert config["ranks"] == "1" and config["steps"] == "4" and '"name":"wandb"' in config["logger"]
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in history] == [2, 4]  # every metrics record, at its step
    assert all({"loss", "accuracy", "step_time_s"} <= {item_key(i) for i in h.item} for h in history)
    summary = {item_key(u): u.value_json for r in records if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update}
    assert summary["status"] == '"completed"' and summary["steps"] == "4"
    assert next(r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit") == 0


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is an optional extra (pip install 'bfexp[tensorboard]')")
def test_tensorboard_event_files_hold_every_record_and_the_summary(jobs):
    """Read back with TensorBoard's own reader: each metrics.jsonl record's numbers at its step, the summary's
    numbers under summary/, the config as text."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = finished(jobs, "tensorboard")[0] / "run"  # ranks=2 steps=6 log_every=2 engine=threads
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in records] == [2, 4, 6]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)  # stored as float32
    assert [e.value for e in events.Scalars("bytes_sent")] == pytest.approx([r["bytes_sent"] for r in records])
    final = events.Scalars("summary/final_loss")
    assert [e.step for e in final] == [6] and final[0].value == pytest.approx(summary["final_loss"], rel=1e-6)
    assert events.Scalars("summary/bytes_sent_per_step")[0].value == pytest.approx(summary["bytes_sent_per_step"])
    texts = events.Tensors("config/text_summary")
    assert "name: tensorboard" in texts[0].tensor_proto.string_val[0].decode()
    status = events.Tensors("summary/status/text_summary")[0].tensor_proto.string_val[0].decode()
    assert status == "completed"


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_broken_tracker_install_is_one_line(tmp_path, monkeypatch, package):
    """An installed package whose import raises (a half-upgraded install): one line naming the error and how to
    reinstall, exit 2, no rank started (it was a traceback of 47-62 lines, issue 44). The CLI runs in this
    interpreter (tests/cli_in_process.py), the broken package first on its path and the real one not imported."""
    (tmp_path / "broken" / package).mkdir(parents=True)
    (tmp_path / "broken" / package / "__init__.py").write_text("raise RuntimeError('half of an upgrade')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "broken"))
    monkeypatch.delitem(sys.modules, package, raising=False)
    proc = call([f"logger={package}", "hydra.run.dir=run"])
    assert proc["code"] == 2 and proc["escaped"] is None, proc
    assert proc["stderr"].strip().splitlines() == [
        f"bfexp: error: logger={package}: the {package} package is installed but does not import (RuntimeError: half "
        f"of an upgrade); allowed: reinstall it with: pip install 'bfexp[{package}]', or another logger"]
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is an optional extra (pip install 'bfexp[tensorboard]')")
def test_a_tensorboard_folder_that_is_a_file_costs_the_tracking_not_the_job(jobs):
    """run/tensorboard a file (the writer cannot make its folder): one warning line, the job completes."""
    import json

    folder, proc = finished(jobs, "tensorboard_file")  # JOBS's, its run/tensorboard a file "mine\n" beforehand
    warnings = [l for l in proc["stderr"].splitlines() if "tensorboard did not start" in l]
    assert len(warnings) == 1 and "the job runs without it" in warnings[0] and "Traceback" not in proc["stderr"]
    assert json.loads((folder / "run" / "summary.json").read_text())["status"] == "completed"
    assert (folder / "run" / "tensorboard").read_text() == "mine\n"


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is an optional extra (pip install 'bfexp[wandb]'); not installed")
def test_several_loggers_at_once(jobs):
    """logger=[wandb,tensorboard] (Hydra's list of a group's options): both trackers receive the job, each from its
    own option's node; logger.project=x reaches wandb, logger.progress=false both."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, proc = finished(jobs, "several")  # JOBS's: logger=[wandb,tensorboard] logger.project=mine ...
    run = folder / "run"
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1
    names = {r.run.project for r in wandb_records(offline[0]) if r.HasField("run")}
    assert names == {"mine"}
    from omegaconf import OmegaConf

    logger = OmegaConf.load(run / "config.yaml").logger
    assert list(logger.loggers) == ["wandb", "tensorboard"]
    assert logger.options.wandb == {"project": "mine", "progress": False} and logger.options.tensorboard == {
        "progress": False}
    assert "step 2/4" not in proc["stdout"]  # progress off in both
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
