"""The cost model, calibrated on two ranks, predicts our allreduce and
neighbor_allreduce on 2 and 4 real ranks within a factor 1.5.

This compares a model with a measurement, not a wall-clock bound. The
machine is shared (2 cores, other jobs running), so scripts/calibrate_comm.py
alternates calibrating the link and timing the ops, in rounds, and the test
compares medians over rounds at a message size where bandwidth, not latency,
dominates (4M floats = 16 MB). The predictions are recomputed here from the
calibrated alpha, beta and gamma with the ring-allreduce and
neighbor-exchange formulas written out.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bfexp.scaling import processor_count

REPO = Path(__file__).resolve().parent.parent
SIZE = 4 << 20  # floats


def ring_allreduce_avg(n, nbytes, alpha, beta, gamma, c):
    # reduce-scatter + all-gather: 2(n-1) steps of nbytes/n; reduce (n-1)/n of it; and, as our
    # out-of-place allreduce of a 16 MB buffer does (the engine's own ring from 8 MiB), copy
    # the input into a buffer of its own (1 pass) and divide the chunk it completes (1/n)
    return 2 * (n - 1) * (alpha + c * nbytes / n * beta) + c * ((n - 1) / n + 1 + 1 / n) * nbytes * gamma


def exp2_exchange(n, nbytes, alpha, beta, gamma, c):
    # static exp2: each rank sends to and receives from log2(n) peers, combines log2(n) + 1 vectors
    degree = (n - 1).bit_length()
    return alpha + c * degree * nbytes * beta + c * (degree + 1) * nbytes * gamma


def calibrate_and_compare(out: Path) -> tuple[dict, str]:
    """Run the calibration; return {(op, n): measured / predicted} and its printed table."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "calibrate_comm.py"), "--ranks", "2,4", "--sizes", "4M",
         "--reps", "15", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    cores = processor_count()
    rounds, med = report["rounds"], statistics.median
    # the link: medians over rounds of the two-rank calibration
    alpha = med(r["link"]["alpha_s"] for r in rounds)
    beta = med(r["link"]["beta_s_per_byte"][str(SIZE)] for r in rounds)
    gamma = med(r["link"]["gamma_s_per_byte"][str(SIZE)] for r in rounds)
    ratios = {}
    for n in (2, 4):
        c = max(1.0, n / cores)  # ranks beyond the cores share them: copies slow down by n / cores
        for op, formula in (("allreduce", ring_allreduce_avg), ("neighbor_allreduce", exp2_exchange)):
            measured = med(r["ops"][str(n)][str(SIZE)][op] for r in rounds)
            ratios[(op, n)] = measured / formula(n, 4 * SIZE, alpha, beta, gamma, c)
    # the script's own table agrees with the formulas above
    for row in report["rows"]:
        assert row["ratio"] == pytest.approx(ratios[(row["op"], row["ranks"])], rel=1e-9)
    return ratios, proc.stdout


def test_model_predicts_our_ops_within_a_factor_1_5(tmp_path):
    # A burst of other jobs on the shared machine can skew one calibration against the
    # measurements that follow it; a second, independent calibration must then pass.
    for attempt in (1, 2):
        ratios, table = calibrate_and_compare(tmp_path / f"calibration{attempt}.json")
        bad = {k: round(v, 2) for k, v in ratios.items() if not 1 / 1.5 <= v <= 1.5}
        if not bad:
            return
    raise AssertionError(f"measured / predicted outside [1/1.5, 1.5] twice: {bad}\n{table}")
