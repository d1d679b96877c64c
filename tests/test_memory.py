"""A job this machine cannot hold is refused before anything large is built (issue 44), by an estimate of
each rank's memory held against what jobs measure here.

The estimate (bfexp.preflight.rank_bytes) is held within 2x of the measured growth of a job's peak memory with
its ranks, for stacked and virtual ranks; ranks=10**7 is refused without building its topology, naming the
most ranks that fit.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BFEXP, run_bfexp

SHARD_BYTES = 512 * (32 * 4 + 8)  # the synthetic data's 512 samples a rank: 32 float32 features, an int64 label
MODEL_BYTES = 66 * 4  # logistic regression, 32 features x 2 classes + 2 biases, float32


def peak(tmp_path, engine: str, ranks: int) -> int:
    proc = run_bfexp([f"engine={engine}", f"ranks={ranks}", "steps=5", "baseline_steps=0", "report=false",
                      "logger=jsonl", "scaling.reference_steps=1", f"hydra.run.dir={engine}{ranks}"], tmp_path,
                     timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(json.loads((tmp_path / f"{engine}{ranks}" / "summary.json").read_text())["peak_memory_bytes"])


@pytest.mark.large  # four jobs of up to 8,000 ranks: .ci/run's larger lane
@pytest.mark.parametrize("engine, few, many", [("stacked", 2000, 8000), ("threads", 64, 256)])
def test_a_ranks_estimated_memory_is_within_2x_of_what_a_rank_adds_to_the_peak(tmp_path, engine, few, many):
    from bfexp.comm import engine_facts
    from bfexp.preflight import rank_bytes

    measured = (peak(tmp_path, engine, many) - peak(tmp_path, engine, few)) / (many - few)
    estimated = rank_bytes(engine_facts(engine), MODEL_BYTES, SHARD_BYTES)
    assert measured > 0 and 0.5 <= estimated / measured <= 2.0, (engine, estimated, measured)


REFUSED = {"stacked": ["ranks=10000000"], "threads": ["ranks=10000000", "engine=threads"],
           "sweep": ["-m", "ranks=4,10000000"]}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """REFUSED's command lines (with steps=2) through the CLI one after another in ONE driver interpreter
    (tests/cli_in_process.py): {name: what each gave}, and that interpreter's peak (KiB), which bounds each's."""
    import sys

    folder = tmp_path_factory.mktemp("refused")
    driver = ("import json, sys; from tests.cli_in_process import call; out, cases = sys.argv[1:]; "  # (call sets argv)
              "got = {k: call([*a, 'steps=2']) for k, a in json.loads(cases).items()}; "
              "open(out, 'w').write(json.dumps(got))")
    # The driver is started by a small intermediate process that reports its peak: a child's ru_maxrss starts
    # from the size of the process it was forked from, here a pytest worker that may hold 1 GB (CI, stop 49).
    waiter = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, "
              "cwd=os.environ['DRIVER_CWD']); _, status, usage = os.wait4(p.pid, 0); "
              "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, file=sys.stdout)")
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", waiter, sys.executable, "-c", driver, str(folder / "got.json"),
                           json.dumps(REFUSED)], cwd=repo, env={**os.environ, "DRIVER_CWD": str(repo)},
                          capture_output=True, text=True, timeout=240)
    code, peak_kib = map(int, proc.stdout.split())
    assert code == 0, proc.stderr[-3000:]
    return json.loads((folder / "got.json").read_text()), peak_kib


@pytest.mark.parametrize("name, kind", [("stacked", "stacked ranks"), ("threads", "virtual ranks"),
                                        ("sweep", "stacked ranks")])
def test_ranks_no_machine_holds_are_refused_before_they_are_built(refused, name, kind):
    """Refused in one line naming the largest rank count that fits, by a driver that stayed small (it built no
    topology of 10**7 ranks: before, the kernel killed it with no message). REFUSED's command lines."""
    got, peak_kib = refused
    got = got[name]
    lines = got["stderr"].strip().splitlines()
    assert got["code"] == 2 and got["escaped"] is None and len(lines) == 1, got
    assert "ranks=10000000 with engine=" in lines[0] and kind in lines[0] and "allowed: ranks <= " in lines[0]
    assert peak_kib < 1_000_000, f"the driver's peak: {peak_kib} KiB"


def test_bfexp_run_refuses_virtual_ranks_no_machine_holds(tmp_path):
    import sys

    (tmp_path / "train.py").write_text("print('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "bfexp.run", "-n", "10000000", "--engine", "threads", "python",
                           "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "-n 10000000 with engine=threads needs about" in proc.stderr, proc.stderr
    assert "allowed: -n <= " in proc.stderr and "ran" not in proc.stdout


def test_a_jobs_peak_memory_is_its_own_not_that_of_the_process_that_started_it(tmp_path):
    """A job started by a large process (a notebook, a test runner) reports its own peak: getrusage keeps the
    starting process's high-water mark across fork and exec, which gave two jobs of 64 and 256 virtual ranks
    started by one large pytest worker the same peak (CI, stop 49)."""
    import sys
    import textwrap

    held = 1 << 30  # 1 GiB held, and touched, by the starting process
    script = textwrap.dedent(f"""
        import subprocess, sys
        ballast = bytearray({held})
        ballast[::4096] = b"x" * len(ballast[::4096])
        sys.exit(subprocess.run({[*BFEXP, "engine=threads", "ranks=2", "steps=2", "baseline_steps=0",
                                  "report=false", "logger=jsonl", "hydra.run.dir=job"]!r}).returncode)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = json.loads((tmp_path / "job" / "summary.json").read_text())["peak_memory_bytes"]
    assert 50e6 < peak < 0.75 * held, peak  # a 2-rank job with torch imported: about 300 MB here
