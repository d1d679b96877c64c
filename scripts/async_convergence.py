"""Error vs iterations of the asynchronous algorithms on least squares, with stragglers.

    python scripts/async_convergence.py [--iterations 1000] [--out async_convergence.png]

8 virtual ranks in simulated time (scheduled: the same numbers every run),
ranks 2 and 5 four times slower than the others, heterogeneous least
squares (tests/algorithms/async_ranks.py, the same case as
tests/algorithms/test_async.py, longer), a diminishing step
a_k = 0.3 / (1 + k / 20). For each algorithm it prints, at each recorded
iteration k (of a rank's own count), the worst rank's relative error
||z_k - x*|| / ||x*|| (x*: numpy lstsq), k * err and sqrt(k) * err (flat:
the 1/k or the 1/sqrt(k) rate), the log-log slope, and writes a log-log
figure of the error with 1/k and 1/sqrt(k) guides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' least-squares ranks

from bfexp.comm.threads import run_threads  # noqa: E402
from tests.algorithms import async_ranks  # noqa: E402

EXP2 = {"_target_": "bfexp.topology.Exp2"}
ALGORITHMS = ["async_push_sum", "ad_psgd", "gossip"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--out", default="async_convergence.png")
    args = parser.parse_args()
    common = dict(lr=0.3, lr_offset=20, iterations=args.iterations, slow=[2, 5], spread=1.0, step_s=0.001,
                  slow_s=0.004)
    cases = [{"key": a, "algorithm": a, "topology": EXP2, **common} for a in ALGORITHMS]
    started = time.perf_counter()
    results = run_threads(args.ranks, lambda engine: async_ranks.run(engine, cases), scheduled=True, timeout=3600)
    print(f"{args.ranks} virtual ranks, ranks 2 and 5 4x slower, a_k = 0.3 / (1 + k / 20); "
          f"{time.perf_counter() - started:.1f} s wall")
    curves = {}
    for a in ALGORITHMS:
        ks = np.array([k for k, _ in results[0][a]["errors"]])
        worst = np.array([[e for _, e in r[a]["errors"]] for r in results]).max(axis=0)
        curves[a] = (ks, worst)
        late = ks >= 32
        slope = np.polyfit(np.log(ks[late]), np.log(worst[late]), 1)[0]
        print(f"\n{a}: log-log slope from k = 32: {slope:.2f}; iterations per rank "
              f"{[r[a]['iterations'] for r in results]}")
        print(f"{'k':>6} {'rel_error':>10} {'k*err':>8} {'sqrt(k)*err':>11}")
        for k, e in zip(ks, worst):
            if k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) or k == ks[-1]:
                print(f"{k:6d} {e:10.3e} {k * e:8.3f} {np.sqrt(k) * e:11.3f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for a, (ks, worst) in curves.items():
        ax.loglog(ks, worst, label=a)
    ks = curves[ALGORITHMS[0]][0]
    ax.loglog(ks, 1.0 / np.sqrt(ks), "k--", lw=0.8, label="1/sqrt(k)")
    ax.loglog(ks, 1.0 / ks, "k:", lw=0.8, label="1/k")
    ax.set_xlabel("iterations of a rank, k")
    ax.set_ylabel("worst rank's ||z_k - x*|| / ||x*||")
    ax.set_title("least squares, 2 of 8 ranks 4x slower, a_k = 0.3/(1+k/20)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nfigure: {args.out}")


if __name__ == "__main__":
    main()
