"""Virtual ranks pushed where users push them: hundreds of rank threads, a loaded machine, signals.

    python scripts/soak_threads.py [--parts completes,sweep,signals] [--runs 10] [--ranks 128]
                                   [--steps 200] [--load 1] [--sweeps 3] [--trials 4]
                                   [--signal-ranks 128,256] [--signal-steps 200]

* completes: ``bfexp engine=threads ranks=R steps=S`` ``--runs`` times in a row
  while ``--load`` CPU-bound processes run beside it; each run must end with
  exit 0 and a summary.json saying completed. Prints every run and the count.
* sweep: the README's headline command exactly as written,
  ``bfexp algorithm=exact_diffusion topology=exp2 -m ranks=8,32,128``,
  ``--sweeps`` times (same load); counts the jobs that completed.
* signals: for each rank count in ``--signal-ranks``, ``--trials`` jobs get
  a SIGTERM at a random moment of the job's length (measured first, once
  per rank count), one moment drawn in each of ``--trials`` equal slices of
  it, so start-up, training, the figures after training and writing
  results all get hit; every other job gets a second SIGTERM 0.2-1 s later. The job must end within 10 s of the first signal with a
  valid summary.json (and within 2 s of the second), leaving no process.

Each line is one job; the last lines are the counts. The exit status is 0
when every job met its bound. Timings printed are wall seconds on this
machine; the bounds are the project's (issue: "The headline command fails").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
HEADLINE = ["algorithm=exact_diffusion", "topology=exp2", "-m", "ranks=8,32,128"]
FIRST_SIGNAL_S = 10.0  # a first SIGTERM ends the job within this
SECOND_SIGNAL_S = 2.0  # a second one within this


def bfexp_command() -> list[str]:
    """The installed ``bfexp`` beside this interpreter, else the module (a checkout on PYTHONPATH)."""
    exe = Path(sys.executable).with_name("bfexp")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "bfexp.cli"]


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """``processes`` CPU-bound Python processes (busy loops) for the block's length."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


@dataclass
class Outcome:
    """One job as a user sees it: exit status, wall seconds, and what its summary.json says."""

    rc: int | None
    wall_s: float
    status: str | None
    error: str | None
    stderr: str

    def line(self) -> str:
        err = f" error={self.error[:100]!r}" if self.error else ""
        return f"rc={self.rc} wall={self.wall_s:.1f}s status={self.status}{err}"


def summary_of(run_dir: Path) -> tuple[str | None, str | None]:
    """(status, error) from a run folder's summary.json; status None when missing or not valid JSON."""
    try:
        data = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None, None
    return data.get("status"), data.get("error")


def run_job(overrides: list[str], run_dir: Path, timeout_s: float = 900.0, nice: int = 0) -> Outcome:
    """One ``bfexp`` job into ``run_dir``, waited for (killed past ``timeout_s``: never hangs the soak);
    ``nice``: its CPU priority below the caller's (a soak beside other work takes what that leaves)."""
    started = time.monotonic()
    proc = subprocess.Popen(bfexp_command() + overrides + [f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        err = f"killed after {timeout_s:g} s\n{err}"
    status, error = summary_of(run_dir)
    return Outcome(proc.returncode, time.monotonic() - started, status, error, err)


def completes(args: argparse.Namespace, work: Path) -> tuple[int, int]:
    done = 0
    for i in range(args.runs):
        got = run_job(["engine=threads", f"ranks={args.ranks}", f"steps={args.steps}"], work / f"completes{i}")
        ok = got.rc == 0 and got.status == "completed"
        done += ok
        print(f"completes {i + 1}/{args.runs}: ranks={args.ranks} steps={args.steps} {got.line()}"
              + ("" if ok else f"\n  stderr: {got.stderr[-800:]!r}"), flush=True)
    print(f"completed: {done}/{args.runs} (bfexp engine=threads ranks={args.ranks} steps={args.steps}, "
          f"{args.load} CPU-bound process(es) beside it)", flush=True)
    return done, args.runs


def sweep(args: argparse.Namespace, work: Path) -> tuple[int, int]:
    done = total = 0
    for i in range(args.sweeps):
        folder = work / f"sweep{i}"
        folder.mkdir()
        started = time.monotonic()
        proc = subprocess.run(bfexp_command() + HEADLINE + [f"hydra.sweep.dir={folder / 'multirun'}"], cwd=folder,
                              capture_output=True, text=True, timeout=1800)
        jobs = sorted(p.parent for p in (folder / "multirun").glob("*/summary.json"))
        statuses = [summary_of(job)[0] for job in jobs]
        ok = statuses.count("completed")
        done, total = done + ok, total + 3
        print(f"sweep {i + 1}/{args.sweeps}: rc={proc.returncode} wall={time.monotonic() - started:.1f}s "
              f"jobs completed {ok}/3 {statuses}" + ("" if ok == 3 else f"\n  stderr: {proc.stderr[-800:]!r}"),
              flush=True)
    print(f"headline sweep jobs completed: {done}/{total} (bfexp {' '.join(HEADLINE)}, {args.sweeps} times)",
          flush=True)
    return done, total


def leftover(pid: int) -> list[int]:
    """Processes still in the job's session (the driver was started in its own)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if os.getsid(int(entry.name)) == pid:
                    out.append(int(entry.name))
    return out


def signal_trial(overrides: list[str], run_dir: Path, at_s: float, second_after_s: float | None) -> tuple[bool, str]:
    """Start a job, SIGTERM it ``at_s`` seconds in (again ``second_after_s`` later); judge the ending."""
    proc = subprocess.Popen(bfexp_command() + overrides + [f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        proc.wait(timeout=at_s)
        finished_first = True
    except subprocess.TimeoutExpired:
        finished_first = False
    sent = time.monotonic()
    if not finished_first:
        proc.send_signal(signal.SIGTERM)
    bound, second_sent = FIRST_SIGNAL_S, None
    if second_after_s is not None and not finished_first:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=second_after_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            second_sent = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    ended = time.monotonic()
    took = ended - sent
    after_second = ended - second_sent if second_sent is not None else None
    status, error = summary_of(run_dir)
    left = leftover(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    ok = (status is not None and not left and (finished_first or took <= bound)
          and (after_second is None or after_second <= SECOND_SIGNAL_S))
    what = "finished before the signal" if finished_first else (
        f"ended {took:.1f}s after SIGTERM" + (f", {after_second:.1f}s after the second" if after_second is not None else ""))
    detail = f"at {at_s:.1f}s: {what}; rc={proc.returncode} status={status}" + (f" error={error[:90]!r}" if error else "")
    if left:
        detail += f"; processes left: {left}"
    if not ok:
        detail += f"\n  stderr: {err[-800:]!r}"
    return ok, detail


def signal_moments(rng: random.Random, length_s: float, trials: int) -> list[tuple[float, float | None]]:
    """(when the first SIGTERM goes, how long after it a second one does or None): one moment drawn in each
    of ``trials`` equal slices of the job's length (one in the last slice may find the job ended: that
    counts as ended in time), a second signal every other trial."""
    slice_s = length_s / trials
    return [(rng.uniform(i * slice_s, (i + 1) * slice_s), rng.uniform(0.2, 1.0) if i % 2 else None)
            for i in range(trials)]


def signals(args: argparse.Namespace, work: Path) -> tuple[int, int]:
    rng = random.Random(args.seed)
    good = total = 0
    for ranks in args.signal_ranks:
        overrides = ["engine=threads", f"ranks={ranks}", f"steps={args.signal_steps}"]
        whole = run_job(overrides, work / f"length{ranks}")
        print(f"signals: ranks={ranks} steps={args.signal_steps} unsignalled job: {whole.line()}", flush=True)
        for i, (at, second) in enumerate(signal_moments(rng, whole.wall_s, args.trials)):
            ok, detail = signal_trial(overrides, work / f"signal{ranks}-{i}", at, second)
            good, total = good + ok, total + 1
            print(f"signals: ranks={ranks} trial {i + 1}/{args.trials} {'ok' if ok else 'MISSED'}: {detail}", flush=True)
    print(f"signalled jobs ended within bounds ({FIRST_SIGNAL_S:g} s after a first SIGTERM, {SECOND_SIGNAL_S:g} s after "
          f"a second, valid summary.json, no process left): {good}/{total}", flush=True)
    return good, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="completes,sweep,signals")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--load", type=int, default=1, help="CPU-bound processes running beside the jobs")
    parser.add_argument("--sweeps", type=int, default=3)
    parser.add_argument("--trials", type=int, default=4, help="signalled jobs per rank count")
    parser.add_argument("--signal-ranks", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256])
    parser.add_argument("--signal-steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    parts = {"completes": completes, "sweep": sweep, "signals": signals}
    chosen = args.parts.split(",")
    unknown = [p for p in chosen if p not in parts]
    if unknown:
        parser.error(f"--parts {','.join(unknown)}; allowed: {', '.join(parts)}")
    missed = 0
    with tempfile.TemporaryDirectory(prefix="bfexp-soak-") as tmp, cpu_load(args.load):
        for name in chosen:
            (Path(tmp) / name).mkdir()
            good, total = parts[name](args, Path(tmp) / name)
            missed += total - good
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
