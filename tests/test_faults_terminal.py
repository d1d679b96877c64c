"""More faults on the runner (issue 29): a run folder in use, signals a terminal sends, a closed stdout.

* a second run into the folder of a running one, and ``resume=`` of a running run or sweep, are refused
  in one line (exit 2, the other driver's pid named) and touch nothing of it; once that driver is
  killed, its stale lock is free to take;
* SIGHUP (a closed terminal) stops the run as SIGTERM does: a summary, no space reserve left;
* ``bfexp ... | head -1`` (stdout closed): the run goes on and writes its summary.

Virtual ranks (engine=threads): the folder lock and the driver's signals are the same for every engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bfexp import results
from tests.cli_in_process import calls
from tests.conftest import BFEXP

LONG = ["engine=threads", "ranks=2", "steps=100000000", "logger=jsonl"]
# A run that goes on, idle: rank 1 sleeps in its step-2 communication call, rank 0 waits for it.
IDLE = ["engine=threads", "ranks=2", "steps=100", "logger=jsonl", "fail_rank=1", "fail_step=2", "fail_mode=hang",
        "timeout_s=600"]


def env() -> dict:
    out = dict(os.environ)
    out.pop("BFEXP_DEBUG", None)
    return out


def as_from_a_terminal() -> None:
    """SIGHUP at its default in the child, as in a shell at a terminal: the suite itself may run under nohup
    (a CI runner's), whose ignored SIGHUP every child would inherit."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    kw.setdefault("stdout", subprocess.DEVNULL)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(BFEXP + args, cwd=cwd, env=env(), text=True, preexec_fn=as_from_a_terminal, **kw)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def snapshot(folder: Path) -> dict[str, bytes]:
    """The files of a run folder that its run does not rewrite while it trains (.hydra/, config.yaml)."""
    names = [folder / "config.yaml", *sorted((folder / ".hydra").iterdir())]
    return {str(p.relative_to(folder)): p.read_bytes() for p in names}


def refused(proc: subprocess.CompletedProcess | SimpleNamespace, pid: int, *words: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert len(err.splitlines()) == 1 and f"pid {pid} " in err, err
    for word in words:
        assert word in err, err


def test_a_busy_run_folder_is_refused_and_left_alone_then_taken_over_once_its_driver_died(tmp_path):
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    first = start(IDLE + [f"hydra.run.dir={run}"], tmp_path)
    swept = start(["-m"] + IDLE + ["lr=0.1,0.2", f"hydra.sweep.dir={sweep}"], tmp_path)
    try:
        wait_for(run / "config.yaml", first)
        wait_for(sweep / "multirun.yaml", swept)
        while not list(sweep.glob("0_*/config.yaml")):
            assert swept.poll() is None, swept.communicate()[1][-2000:]
            time.sleep(0.05)
        job = next(sweep.glob("0_*"))
        before, saved = snapshot(run), (sweep / "multirun.yaml").read_bytes()
        tries = {  # what the other driver is, what is tried, and what the refusal says
            "run": (first, ["engine=threads", "ranks=2", "steps=3", "lr=0.5", f"hydra.run.dir={run}"],
                    [f"hydra.run.dir={run} is in use"]),
            "resume run": (first, [f"resume={run}"], [f"resume={run} is still running"]),
            "resume sweep": (swept, [f"resume={sweep}"], [f"resume={sweep} is still running"]),
            "sweep": (swept, ["-m", "engine=threads", "ranks=2", "steps=3", "lr=0.1,0.3", f"hydra.sweep.dir={sweep}"],
                      [f"hydra.sweep.dir={sweep} is in use", f"job {job.name}"]),
        }
        # The tries, one after another through the CLI in one interpreter (tests/cli_in_process.py), beside the
        # two drivers' processes.
        got = calls([{"id": name, "folder": str(tmp_path / "tries"), "args": args}
                     for name, (_, args, _) in tries.items()], timeout=240, env=env())
        for name, proc in got.items():
            assert proc["escaped"] is None, proc["escaped"]
            refused(SimpleNamespace(returncode=proc["code"], stdout=proc["stdout"], stderr=proc["stderr"]),
                    tries[name][0].pid, *tries[name][2])
        assert first.poll() is None and swept.poll() is None
        assert snapshot(run) == before and (sweep / "multirun.yaml").read_bytes() == saved  # nothing touched
    finally:  # a try that was not refused (today's main) ran in calls' interpreter, which has ended
        for proc in (first, swept):
            proc.kill()
            proc.wait()
    # The killed driver's lock is stale: the next driver takes the folder (the CLI's own call).
    assert results.lock_folder(run) is None and (run / ".lock").read_text().startswith(f"pid {os.getpid()} ")
    results.unlock_folder(run)
    assert not (run / ".lock").exists()


def test_sighup_stops_the_run_like_sigterm_with_a_summary(tmp_path):
    run = tmp_path / "run"
    proc = start(LONG + ["log_every=20", f"hydra.run.dir={run}"], tmp_path)
    try:
        wait_for(run / "metrics.jsonl", proc)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGHUP" in summary["error"], summary
    assert not (run / ".space_reserve").exists() and not (run / ".lock").exists()


def test_a_closed_stdout_does_not_end_the_run(tmp_path):
    """`bfexp ... | head -1`: the driver's next line meets a closed pipe (EPIPE); the run goes on to its summary."""
    run = tmp_path / "run"
    proc = start(["engine=threads", "ranks=2", "steps=40", "log_every=1", "baseline_steps=0", f"hydra.run.dir={run}"],
                 tmp_path, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline()  # head -1
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, err[-2000:]
    finally:
        proc.kill()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert not (run / ".space_reserve").exists()


def test_under_nohup_sighup_stays_ignored():
    """`nohup bfexp ...` asks to outlive the terminal: the driver leaves SIGHUP ignored (and handles it otherwise)."""
    code = ("import signal, sys\nfrom bfexp.signals import Signals\n"
            "if sys.argv[1] == 'nohup':\n    signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "Signals().install()\nprint(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)")
    for mode, ignored in (("nohup", "True"), ("terminal", "False")):
        out = subprocess.run([sys.executable, "-c", code, mode], env=env(), capture_output=True, text=True, timeout=60,
                             preexec_fn=as_from_a_terminal)
        assert out.stdout.strip() == ignored, (mode, out.stdout, out.stderr)


def test_a_stop_signal_whose_exception_was_swallowed_before_the_job_stops_the_job_at_its_start():
    # The driver's own code between Hydra and the job can run a library's bare `except:` (around an optional
    # import, say): the Interrupted a SIGTERM raised there never reaches the CLI. The job must not run anyway
    # (make test once saw such a job train for 145 s after its SIGTERM).
    import pytest

    from bfexp.errors import Interrupted
    from bfexp.signals import Signals

    signals = Signals()
    signals.install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in this frame
        except BaseException:  # noqa: BLE001 - the swallowing library
            pass
        assert signals.received == [signal.SIGTERM]
        with pytest.raises(Interrupted) as raised:
            with signals.job():
                raise AssertionError("the job began")
        assert raised.value.signum == signal.SIGTERM and not signals.in_job
        with signals.job():  # acted on once: the next job begins
            assert signals.in_job and signals.since(signals.job_start) is None
        # a fresh run of the driver (install) forgets what an earlier one acted on
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Interrupted:
            pass
        signals.install()
        with signals.job():
            assert signals.in_job
    finally:
        signals.restore()
