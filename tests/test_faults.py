"""Fault injection on real ranks (MPI processes and virtual ranks): nothing hangs, nothing leaks,
nothing is lost.

Each case runs the real CLI on a job and injects one fault: a rank that raises at a random step,
one killed by SIGKILL, one frozen by SIGSTOP, one that sleeps forever inside a communication call,
SIGTERM / SIGINT / SIGUSR1 to the driver at start-up, mid-run and while the results are written, a
second signal, and a run folder whose disk fills up. For every case:

* the job ends within 10 s of the fault (timeout_s + 10 s when the fault is a hang);
* no rank process of the run folder is left in the process table;
* summary.json is valid JSON whose status and error say what happened;
* the metrics logged before the fault are still there.

The cases run three at a time in one module fixture (each is mostly waiting), then one test per
case checks its outcome and the last prints the matrix with its counts.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import BFEXP
from tests.mpi_helpers import live_processes

FAULT_BUDGET_S = 10.0  # a job ends within this of its fault
HANG_TIMEOUT_S = 3.0  # timeout_s of the hang cases: they end within this + FAULT_BUDGET_S
DISK_BYTES = 1024 * 1024  # the small disk of the disk-full cases
DISK_LEFT = 160 * 1024  # room left on it when the job starts
RNG = random.Random(15)  # the "random step" of the raising rank, reproducible


@dataclass
class Case:
    engine: str
    fault: str
    args: list[str]
    trigger: str | None = None  # what the test waits for before it acts: config, metrics, final
    signals: tuple[int, ...] = ()  # sent to the driver at the trigger, 0.3 s apart
    status: tuple[str, ...] = ("failed",)  # the summary's status may be one of these
    words: tuple[str, ...] = ()  # the summary's error contains these
    budget_s: float = FAULT_BUDGET_S
    metrics: bool = True  # metrics were logged before the fault
    disk: bool = False
    large: bool = False  # .ci/run only (test_fault_large): a second signal's form of a case make test runs
    outcome: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.engine}-{self.fault}"


def cases() -> list[Case]:
    long = ["steps=100000000", "log_every=2"]
    out = []
    for engine in ("mpi", "threads"):
        ranks = "ranks=2" if engine == "mpi" else "ranks=4"
        base = [f"engine={engine}", ranks]
        step = RNG.randint(6, 40)
        out.append(Case(engine, "rank-raises", base + long + ["fail_rank=1", f"fail_step={step}"],
                        words=("rank 1: RuntimeError: injected failure",)))
        if engine == "mpi":  # a virtual rank is a thread: these would hit the driver itself
            out.append(Case(engine, "rank-sigkill", base + long + ["fail_rank=1", "fail_step=12", "fail_mode=kill"],
                            words=("rank 1", "SIGKILL")))
            out.append(Case(engine, "rank-frozen", base + long + ["fail_rank=1", "fail_step=12", "fail_mode=freeze",
                                                                   f"timeout_s={HANG_TIMEOUT_S}"],
                            words=("hung", "rank 1", "no heartbeat"), budget_s=HANG_TIMEOUT_S + FAULT_BUDGET_S))
        out.append(Case(engine, "rank-hangs-in-collective",
                        base + long + ["fail_rank=1", "fail_step=12", "fail_mode=hang", f"timeout_s={HANG_TIMEOUT_S}"],
                        words=("hung", "rank 1", "neighbor_allreduce"), budget_s=HANG_TIMEOUT_S + FAULT_BUDGET_S))
        for sig in (signal.SIGTERM, signal.SIGINT):
            name = sig.name
            # MPI: while mpiexec starts 6 ranks; virtual ranks start in a moment: while the driver checks the config
            start, early = ("config", [f"engine={engine}", "ranks=6"]) if engine == "mpi" else ("hydra", base)
            # SIGINT takes SIGTERM's path (bfexp.signals): make test runs it mid-run, .ci/run at every moment
            again = sig == signal.SIGINT
            out.append(Case(engine, f"{name}-at-start-up", early + long, trigger=start, signals=(sig,),
                            status=("interrupted",), words=(name, "before"), metrics=False, large=again))
            out.append(Case(engine, f"{name}-mid-run", base + long, trigger="metrics", signals=(sig,),
                            status=("interrupted",), words=(name, "checkpoint at step")))
            # After the last logging step the ranks finish the job's figures and write the results.
            out.append(Case(engine, f"{name}-writing-results", base + ["steps=40", "log_every=10", "baseline_steps=300"],
                            trigger="final", signals=(sig,), status=("completed",), large=again))
        out.append(Case(engine, "SIGUSR1-mid-run", base + long, trigger="metrics", signals=(signal.SIGUSR1,),
                        status=("interrupted",), words=("SIGUSR1", "checkpoint at step")))
        out.append(Case(engine, "second-SIGTERM", base + ["steps=100000000", "log_every=1000000"], trigger="running",
                        signals=(signal.SIGTERM, signal.SIGTERM), status=("interrupted",), words=("SIGTERM",),
                        metrics=False))
        out.append(Case(engine, "disk-full", base + ["steps=100000000", "log_every=1", "checkpoint_every=100"],
                        disk=True))
    # The disk fills while the ranks write a checkpoint (each rank's file ~1.6 MB > the room left; metrics fit):
    # the error names the checkpoint and the rank, and no partial or uncommitted checkpoint file is left.
    out.append(Case("mpi", "disk-full-at-checkpoint", ["engine=mpi", "ranks=2", "steps=100000000", "log_every=5",
                                                       "checkpoint_every=20", "model=mlp", "model.hidden=[512,512]"],
                    disk=True, words=("checkpoint at step 20 not written on rank(s)", "writing checkpoint/step20")))
    return out


CASES = cases()
SMALL = [c for c in CASES if not c.large]  # make test
LARGE = [c for c in CASES if c.large]  # .ci/run too


# ---------------------------------------------------------------- running one case


def worker_processes(run_dir: Path) -> list[int]:
    """Live processes running a rank (bfexp.worker) of this run folder."""
    return list(live_processes("bfexp.worker", str(run_dir)))


def small_disk(folder: Path) -> str:
    """A 1 MiB tmpfs at ``folder`` with DISK_LEFT bytes free ("tmpfs"), or, where mounting is not
    allowed, "rlimit": the driver and ranks then may not write files beyond DISK_LEFT bytes."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted:
        return "rlimit"
    free = shutil.disk_usage(folder).free
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - DISK_LEFT))
    return "tmpfs"


def limit_file_size() -> None:  # in the driver, before exec: what it and its ranks may write
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK_LEFT, DISK_LEFT))


def injection_time(run_dir: Path) -> float | None:
    """When a rank ran its injected fault (it says so in its log just before)."""
    for log in (run_dir / "logs").glob("rank*.log"):
        m = re.search(r"injected fault .* \(time ([0-9.]+)\)", log.read_text(errors="replace"))
        if m:
            return float(m.group(1))
    return None


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def run_case(case: Case, root: Path, cache: Path) -> dict:
    folder = root / case.id
    run = folder / "run"
    disk = None
    if case.disk:
        disk = small_disk(run)
    else:
        folder.mkdir(parents=True)
    env = dict(os.environ, BFEXP_CACHE_DIR=str(cache))
    env.pop("BFEXP_DEBUG", None)
    args = BFEXP + case.args + ["logger=jsonl", "hydra.run.dir=" + str(run)]
    fault_at: float | None = None
    with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
        proc = subprocess.Popen(args, cwd=folder, stdout=out, stderr=err, env=env,
                                preexec_fn=limit_file_size if disk == "rlimit" else None)
        started = time.time()
        try:
            while proc.poll() is None and time.time() - started < 150:
                time.sleep(0.05)
                if case.trigger and fault_at is None and triggered(case.trigger, run, started):
                    fault_at = time.time()
                    for i, sig in enumerate(case.signals):
                        if i:
                            time.sleep(0.3)
                        proc.send_signal(sig)
                if case.disk and fault_at is None and disk_is_full(run, disk):
                    fault_at = time.time()
        finally:
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait()
    ended = time.time()
    leftover = worker_processes(run)
    deadline = time.time() + 1.0
    while leftover and time.time() < deadline:
        time.sleep(0.1)
        leftover = worker_processes(run)
    for pid in leftover:  # leave the machine clean for the next test; the case fails on them anyway
        os.kill(pid, signal.SIGKILL)
    if fault_at is None:
        fault_at = injection_time(run)
    if fault_at is None and case.disk and (run / "metrics.jsonl").exists():
        # The disk filled and the job ended between two looks: the last write that fit is when it filled.
        fault_at = (run / "metrics.jsonl").stat().st_mtime
    summary_text = (run / "summary.json").read_text() if (run / "summary.json").exists() else None
    try:
        summary = json.loads(summary_text) if summary_text else None
    except ValueError:
        summary = None
    logs = {p.name: p.read_text(errors="replace") for p in (run / "logs").glob("*.log")} if (run / "logs").exists() else {}
    outcome = {"rc": rc, "fault_at": fault_at, "took_s": None if fault_at is None else ended - fault_at,
               "summary_text": summary_text, "summary": summary, "records": len(records(run)), "leftover": leftover,
               "logs": logs, "stderr": (folder / "stderr").read_text(errors="replace")[-2000:], "disk": disk,
               "checkpoint_files": sorted(str(p.relative_to(run)) for p in (run / "checkpoint").rglob("*")
                                          if p.is_file()) if (run / "checkpoint").exists() else []}
    if disk == "tmpfs":
        subprocess.run(["umount", "-l", str(run)], capture_output=True)
    return outcome


def triggered(trigger: str, run: Path, started: float) -> bool:
    if trigger == "config":  # the driver has written the job's config: mpiexec / the rank threads start now
        return (run / "config.yaml").exists()
    if trigger == "hydra":  # Hydra has made the run folder: the driver validates and dry-builds the job
        return (run / ".hydra").exists()
    if trigger == "running":
        return (run / "config.yaml").exists() and time.time() - started > 6.0
    rows = records(run)
    if trigger == "metrics":
        return len(rows) >= 2
    return bool(rows) and rows[-1]["step"] == 40  # "final": the last logging step is written


def disk_is_full(run: Path, disk: str | None) -> bool:
    if disk == "tmpfs":
        return shutil.disk_usage(run).free < 8 * 1024
    metrics = run / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > DISK_LEFT - 4 * 1024


def run_matrix(cases: list[Case], root: Path) -> dict[str, Case]:
    cache = root / "reference-cache"
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case.id: pool.submit(run_case, case, root, cache) for case in cases}
        for case in cases:
            case.outcome = futures[case.id].result()
    return {case.id: case for case in cases}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, Case]:
    return run_matrix(SMALL, tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def matrix_large(tmp_path_factory) -> dict[str, Case]:
    return run_matrix(LARGE, tmp_path_factory.mktemp("faults-large"))


# ---------------------------------------------------------------- the checks


@pytest.mark.parametrize("case_id", [c.id for c in SMALL])
def test_fault(matrix, case_id):
    check(matrix[case_id])


@pytest.mark.large
@pytest.mark.parametrize("case_id", [c.id for c in LARGE])
def test_fault_large(matrix_large, case_id):
    check(matrix_large[case_id])


def check(case: Case) -> None:
    case_id = case.id
    got = case.outcome
    context = f"{case_id}: rc={got['rc']} stderr={got['stderr'][-600:]!r} summary={got['summary_text']!r}"
    assert got["fault_at"] is not None, "the fault never happened: " + context
    assert got["took_s"] is not None and got["took_s"] <= case.budget_s, context
    assert got["leftover"] == [], f"rank processes left running: {got['leftover']}"
    assert got["summary"] is not None, "summary.json missing or not valid JSON: " + context
    summary = got["summary"]
    assert summary["status"] in case.status, context
    for word in case.words:
        assert word in (summary.get("error") or ""), (word, context)
    if case.disk:  # a tmpfs says "No space left"; the file-size limit (no mount allowed) "File too large"
        assert re.search(r"space|too large", summary.get("error") or "", re.I), context
        assert not [f for f in got["checkpoint_files"] if f.endswith(".tmp") or "step20" in f], got["checkpoint_files"]
    if case.metrics:
        assert got["records"] >= 1, "the metrics logged before the fault are gone"
    if summary["status"] == "interrupted":
        assert got["rc"] == 128 + case.signals[0], context
        assert summary["resume_command"].startswith("bfexp resume=")
    elif case.signals:  # the job finished before the signal mattered; the driver still ends as asked
        assert got["rc"] == 128 + case.signals[0], context
    else:
        assert got["rc"] == 1, context


@pytest.mark.parametrize("engine", ["mpi", "threads"])
def test_a_hang_names_the_stuck_ranks_and_their_call_and_dumps_every_stack(matrix, engine):
    case = matrix[f"{engine}-rank-hangs-in-collective"]
    summary, logs = case.outcome["summary"], case.outcome["logs"]
    stuck = {s["rank"]: s for s in summary["stuck_ranks"]}
    assert 1 in stuck and stuck[1]["op"], summary
    assert "neighbor_allreduce" in stuck[1]["op"]
    assert summary["error"].startswith("hung: no progress for timeout_s=3 s")
    marker = "most recent call first" if engine == "mpi" else "Stack of rank"
    dumped = sorted(name for name, text in logs.items() if name.startswith("rank") and marker in text)
    assert dumped == [f"rank{r}.log" for r in range(2 if engine == "mpi" else 4)], dumped


def test_a_frozen_rank_is_named(matrix):
    summary = matrix["mpi-rank-frozen"].outcome["summary"]
    assert [s["rank"] for s in summary["stuck_ranks"] if "no heartbeat" in s["why"]] == [1], summary


def test_matrix_counts(matrix):
    """The matrix, with its counts (printed with -s)."""
    rows, ok = [], 0
    for case in SMALL:
        got = case.outcome
        summary = got["summary"] or {}
        good = (got["fault_at"] is not None and got["took_s"] is not None and got["took_s"] <= case.budget_s
                and not got["leftover"] and summary.get("status") in case.status)
        ok += good
        rows.append(f"{case.engine:8} {case.fault:26} {summary.get('status', '-'):12} "
                    f"{(got['took_s'] or 0):5.1f} s  leftover={len(got['leftover'])}  records={got['records']}")
    print("\n" + "\n".join(rows))
    print(f"{len(SMALL)} injections: {ok} ended in budget with a valid summary and no orphan; "
          f"hangs: {len(SMALL) - ok} ({len(LARGE)} more in .ci/run: test_fault_large)")
    assert len(SMALL) >= 20 and ok == len(SMALL)
