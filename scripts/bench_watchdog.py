"""What the hang watchdog costs the driver per check, with hundreds of virtual ranks running.

    python scripts/bench_watchdog.py [--ranks 256] [--seconds 10] [--checks 200]

R virtual ranks (threads of this process, as ``bfexp engine=threads`` runs
them) each keep a Heartbeat and loop: a small matrix product (the compute
of a step) and a neighbor_allreduce_ on exp2. Meanwhile this process's main
thread, as the driver's watch loop does, reads every rank's heartbeat and
judges the job (``Watchdog.check``), ``--checks`` times, timing each.

Printed: the median and 90th percentile of a check (ms), and, as the
reference measured in the same run under the same load, the main thread's
cost of one trip through the interpreter lock (``time.sleep(0)``): their
ratio says how many such trips a check costs. To compare with another
checkout, run this script with that checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # a checkout put first on PYTHONPATH wins

import torch  # noqa: E402

from bfexp import watchdog  # noqa: E402
from bfexp.comm.threads import ThreadWorld  # noqa: E402
from bfexp.topology import Exp2  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the ranks run at most")
    parser.add_argument("--checks", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="bfexp-watchdog-") as tmp:
        run_dir = Path(tmp)
        def rank_main(engine):
            engine.set_topology(Exp2(engine.size))
            beat = watchdog.Heartbeat(engine, run_dir)
            x = torch.randn(64, 64)
            params = torch.zeros(1024)
            engine.barrier()
            step = 0
            while True:
                params.add_((x @ x).flatten()[:1024], alpha=1e-6)
                engine.neighbor_allreduce_(params)
                step += 1
                beat.step = step
                if step % 10 == 0 and engine.allreduce(torch.tensor([float(stop.is_set())]), op="sum").item():
                    break  # every rank decides at the same step
            beat.close()

        world = ThreadWorld(args.ranks)
        world.start(rank_main)
        while len(watchdog.live_heartbeats(run_dir)) < args.ranks:  # every rank is running
            time.sleep(0.05)
        watch = watchdog.Watchdog(60.0, args.ranks, lambda: watchdog.live_heartbeats(run_dir), processes=False)
        checks, trips = [], []
        deadline = time.monotonic() + args.seconds
        while len(checks) < args.checks and time.monotonic() < deadline:
            t0 = time.perf_counter()
            time.sleep(0)
            t1 = time.perf_counter()
            watch.check(now=time.monotonic() + 1e6 + len(checks))  # past the next check's time: it reads
            t2 = time.perf_counter()
            trips.append(t1 - t0)
            checks.append(t2 - t1)
        stop.set()
        world.join(60)
    med, trip = statistics.median(checks), statistics.median(trips)
    p90 = sorted(checks)[int(0.9 * (len(checks) - 1))]
    print(f"ranks={args.ranks} checks={len(checks)} (each reads {args.ranks} heartbeats)")
    print(f"  watchdog check: median {med * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms")
    print(f"  reference, one trip through the interpreter lock (time.sleep(0)): median {trip * 1e3:.3f} ms")
    print(f"  check / trip: {med / trip:.1f}")


if __name__ == "__main__":
    main()
