"""Step time with communication overlapped with computation, against the same
algorithm with overlap off, for DSGD (atc, awc) and the allreduce baseline.

    .venv/bin/python scripts/bench_overlap.py                 # 4 ranks, defaults
    .venv/bin/python scripts/bench_overlap.py --ranks 8 --repeats 7 --hidden 2048,2048

One spawn of MPI ranks times every configuration, interleaved over
``--repeats`` rounds (so drifting machine load hits all alike); each round
times ``--steps`` training steps of an MLP after a warm-up. It prints the
median step time of each configuration and the ratio overlap-on / overlap-off
(below 1: overlap helps). Ranks share the machine's cores: on a machine
with fewer cores than ranks the figures mostly measure contention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (label, algorithm class path, its options); classes are imported on the ranks only.
CONFIGS = [
    ("dsgd/atc", "bfexp.algorithms.DSGD", {"style": "atc"}),
    ("dsgd/awc", "bfexp.algorithms.DSGD", {"style": "awc"}),
    ("allreduce", "bfexp.algorithms.Allreduce", {}),
]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--hidden", default="1024,1024,1024,1024", help="hidden widths of the MLP")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--topology", default="Exp2", help="a class of bfexp.topology, built on the ranks")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from hydra.utils import get_class
    from torch import nn

    import bfexp.topology
    from bfexp.comm.mpi import MPIEngine

    torch.set_num_threads(args.threads)
    engine = MPIEngine()
    topology = getattr(bfexp.topology, args.topology)(engine.size)
    widths = [args.features] + [int(h) for h in args.hidden.split(",")]

    def make_model() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], 10))
        model = nn.Sequential(*layers)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return model

    g = torch.Generator().manual_seed(engine.rank)
    x = torch.randn(args.batch, args.features, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for base, target, options in CONFIGS:
            algorithm = get_class(target)
            used = algorithm.resolve_topology(topology)[0] if algorithm.uses_topology else None
            for overlap in (True, False):
                model = make_model()
                local = torch.optim.SGD(model.parameters(), lr=1e-3)
                opt = algorithm(local, engine, used, model=model, overlap=overlap, bucket_mb=args.bucket_mb, **options)
                for step in range(args.warmup + args.steps):
                    if step == args.warmup:
                        engine.barrier()
                        t0 = time.perf_counter()
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                opt.finish()
                elapsed = (time.perf_counter() - t0) / args.steps
                opt.close()
                mean = engine.allreduce(torch.tensor([elapsed], dtype=torch.float64), op="avg")  # over ranks
                label = f"{base} overlap={'on' if overlap else 'off'}"
                times.setdefault(label, []).append(float(mean))
    if engine.rank == 0:
        params = sum(p.numel() for p in make_model().parameters())
        print("RESULT " + json.dumps({"times": times, "params": params}), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    from bfexp.sessions import rank_environment
    from bfexp.launchers import find_mpiexec

    env = rank_environment(args.ranks)
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [find_mpiexec(), "--oversubscribe", "-n", str(args.ranks), sys.executable, "-m", "mpi4py",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"ranks failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    data = json.loads(line[len("RESULT "):])
    medians = {label: statistics.median(ts) for label, ts in data["times"].items()}
    print(f"{args.ranks} ranks, MLP {args.features}-{args.hidden.replace(',', '-')}-10 ({data['params'] / 1e6:.2f}M float32 params), "
          f"batch {args.batch}, bucket_mb={args.bucket_mb}, topology={args.topology}, cores here: {os.cpu_count()}")
    print(f"median over {args.repeats} rounds of {args.steps} steps:")
    print(f"{'algorithm':<16} {'overlap on (s)':>15} {'overlap off (s)':>16} {'on/off':>8}")
    rows = []
    for base, _, _ in CONFIGS:
        on, off = medians[f"{base} overlap=on"], medians[f"{base} overlap=off"]
        rows.append({"algorithm": base, "step_time_s_overlap_on": on, "step_time_s_overlap_off": off,
                     "ratio_on_off": on / off})
        print(f"{base:<16} {on:>15.5f} {off:>16.5f} {on / off:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "times": data["times"]}, f, indent=2)


if __name__ == "__main__":
    main()
