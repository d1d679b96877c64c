"""Calibrate the cost model on this machine, then check its predictions.

    python scripts/calibrate_comm.py [--ranks 2,4,8] [--sizes 1M,4M,16M,64M] [--reps 9] [--json PATH]

Starts ``mpiexec -n max(ranks)`` on itself and measures, through the MPI
engine, in rounds (the first one warms up and is dropped):

1. the link, on two ranks: latency (alpha) from a one-float one-peer
   neighbor_allreduce; for each size, the time per byte of the transfer
   (beta) from a one-peer neighbor_allreduce minus its local combine, whose
   speed (gamma) is timed on its own on both ranks at once (and never less
   than one local copy of the message);
2. right after, for each rank count n and size: our allreduce (average) and
   our neighbor_allreduce on the static exp2 graph, one call each, timed as
   the slowest rank's, the ranks outside n sleeping meanwhile.

Calibration and measurement alternate, so on a shared machine both see the
same load. The prediction (bfexp/costmodel.py: ring allreduce, neighbor
exchange, ranks beyond this machine's cores slowing copies by ranks/cores)
uses only the median alpha, beta and gamma over rounds; it is printed
beside the median measured time with their ratio, and the lines for
conf/scaling/local.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a clone without installing
    sys.path.insert(0, str(REPO))


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4,8", help="rank counts to measure (default 2,4,8)")
    p.add_argument("--sizes", default="1M,4M,16M,64M", help="float32 elements per message (default 1M,4M,16M,64M)")
    p.add_argument("--reps", type=int, default=9, help="rounds (calibration, then every op); medians are kept")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rank_counts = sorted({int(r) for r in args.ranks.split(",")})
    args.size_list = [parse_size(s) for s in args.sizes.split(",")]
    if min(args.rank_counts) < 2 or args.reps < 1:
        p.error("--ranks must be >= 2 and --reps >= 1")
    return args


# ---------------------------------------------------------------- on the ranks


def quiet_barrier(comm) -> None:
    """Wait for every rank while sleeping, so idle ranks leave the cores to measuring ones."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def timed_once(comm, fn) -> float:
    """The slowest rank's time for one call (after a barrier)."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


_BUFFERS: dict[tuple[str, int], object] = {}


def buffer(kind: str, size: int):
    """One tensor per (kind, size) on this rank, shared by every group (memory stays flat)."""
    import torch

    if (kind, size) not in _BUFFERS:
        _BUFFERS[(kind, size)] = torch.ones(size)
    return _BUFFERS[(kind, size)]


class Group:
    """The first n ranks of the world, with an engine on its members."""

    def __init__(self, world, n: int) -> None:
        from bfexp.comm.mpi import MPIEngine

        self.world = world
        self.member = world.Get_rank() < n
        self.comm = world.Split(0 if self.member else 1, world.Get_rank())
        if self.member:
            self.engine = MPIEngine(comm=self.comm)

    def run(self, measure) -> dict | None:
        """Members measure, the others sleep; returns the members' result on world rank 0."""
        out = measure(self) if self.member else None
        quiet_barrier(self.world)
        return out


def combine_work(size: int):
    """What neighbor_allreduce does after a one-peer transfer: out = 0.5 x, out += 0.5 received."""
    x, recv = buffer("x", size), buffer("recv", size)

    def run():
        y = x * 0.5
        y.add_(recv, alpha=0.5)

    return run


def link_round(group: Group, sizes: list[int]) -> dict:
    """One round of the link calibration on two ranks (through the engine)."""
    engine, peer = group.engine, 1 - group.engine.rank
    exchange, combine, copy = {}, {}, {}
    for size in sizes:
        x = buffer("x", size)
        # three calls each, the median kept: the link is the yardstick of every prediction
        combine[size] = statistics.median(timed_once(group.comm, combine_work(size)) for _ in range(3))
        exchange[size] = statistics.median(
            timed_once(group.comm, lambda: engine.neighbor_allreduce(x, 0.5, {peer: 0.5}, [peer])) for _ in range(3)
        )
        copy[size] = statistics.median(timed_once(group.comm, lambda: buffer("copy", size).copy_(x)) for _ in range(3))
    alpha = max(1e-7, exchange[1] - combine[1])
    link = {"alpha_s": alpha, "beta_s_per_byte": {}, "gamma_s_per_byte": {}, "combine_s": {}}
    for s in sizes:
        if s > 1:  # per size: memory effects (caches, fresh pages) change with the size
            link["combine_s"][str(s)] = combine[s]
            link["gamma_s_per_byte"][str(s)] = combine[s] / (2 * 4 * s)  # per byte of each of the 2 vectors
            # a transfer through shared memory costs at least one copy of the message: that floor
            # keeps a noisy subtraction from claiming an infinitely fast link
            link["beta_s_per_byte"][str(s)] = max(copy[s], exchange[s] - alpha - combine[s]) / (4 * s)
    return link


def ops_round(group: Group, sizes: list[int]) -> dict:
    """One timed call of allreduce and of exp2 neighbor_allreduce per size."""
    engine = group.engine
    sw, src, dst = exp2_weights(engine.rank, engine.size)
    out = {}
    for size in sizes:
        x = buffer("x", size)
        out[str(size)] = {
            "allreduce": timed_once(group.comm, lambda: engine.allreduce(x, op="avg")),
            "neighbor_allreduce": timed_once(group.comm, lambda: engine.neighbor_allreduce(x, sw, src, dst)),
        }
    return out


def exp2_weights(rank: int, n: int) -> tuple[float, dict, list]:
    from bfexp.topology import Exp2

    w = Exp2(n).weights(rank, 0)
    return w.self_weight, w.src_weights, list(w.dst_weights)


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); a large number elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def footprint_bytes(n: int, size: int) -> int:
    """What n ranks hold for one op on `size` floats: the input, allreduce's output, one
    receive buffer per exp2 in-neighbor and the combined output, per rank."""
    return n * 4 * size * (3 + (n - 1).bit_length())


def worker(args: argparse.Namespace) -> None:
    """Rounds of (link calibration, then every op), so calibration and measurement see the
    same load on a shared machine; the first round warms up and is dropped. Rank counts
    and sizes that would take more than half the available memory are skipped."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    budget = world.bcast(available_bytes() // 2 if world.Get_rank() == 0 else None, root=0)
    link_sizes = [1, *[s for s in args.size_list if s > 1 << 16]] or [1, 1 << 22]
    pair = Group(world, 2)
    groups = {n: Group(world, n) for n in args.rank_counts if n <= world.Get_size()}
    sizes = {n: [s for s in args.size_list if footprint_bytes(n, s) <= budget] for n in groups}
    skipped = [f"{n} ranks x {s >> 20}M floats (~{footprint_bytes(n, s) / 1e9:.1f} GB)"
               for n in groups for s in args.size_list if s not in sizes[n]]
    rounds = []
    for r in range(args.reps + 1):
        link = pair.run(lambda g: link_round(g, link_sizes))
        ops = {str(n): g.run(lambda g, n=n: ops_round(g, sizes[n])) for n, g in groups.items()}
        if r and world.Get_rank() == 0:
            rounds.append({"link": link, "ops": ops})
    if world.Get_rank() == 0:
        report = build_report(rounds)
        report["skipped"] = skipped
        print_report(report)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")


# ---------------------------------------------------------------- predictions


def local_cluster(alpha_s: float, beta_s_per_byte: float, gamma_s_per_byte: float, cores: int):
    """This machine as the cost model sees it: one machine whose ranks share `cores` cores."""
    from bfexp.costmodel import Cluster, Link

    bw = 1.0 / beta_s_per_byte
    return Cluster(
        name="local",
        ranks_per_machine=0,
        intra=Link(alpha_s, bw),
        inter=Link(alpha_s, bw),
        nic_shared=True,
        reduce_bytes_per_s=1.0 / gamma_s_per_byte,
        cores=cores,
        allreduce="ring",
    )


def predict(link: dict, cores: int, op: str, n: int, size: int) -> float:
    """The cost model's time for one of our ops on n ranks, from the pair's link figures at
    that size alone (ranks beyond `cores` slow every copy and reduction by n / cores)."""
    from bfexp import costmodel
    from bfexp.topology import Exp2

    key = str(size)
    cluster = local_cluster(link["alpha_s"], link["beta_s_per_byte"][key], link["gamma_s_per_byte"][key], cores)
    nbytes = 4 * size
    if op == "allreduce":
        # Our out-of-place allreduce copies the input into a buffer of its own (one pass),
        # reduces it with a ring, and averages: large buffers go through the engine's own
        # ring, which divides only the chunk each rank completes (1/n of a pass); smaller
        # ones through MPI's allreduce and one more pass to divide.
        from bfexp.comm import mpi

        own_ring = nbytes >= getattr(mpi, "RING_MIN_BYTES", float("inf"))
        passes = 1 + (1 / n if own_ring else 1)
        return costmodel.ring_allreduce_s(cluster, n, nbytes) + cluster.reduce_s(passes * nbytes, n)
    return costmodel.neighbor_exchange_s(cluster, Exp2(n), nbytes)


def build_report(rounds: list[dict]) -> dict:
    """The link's median over rounds, each op's median time, the model's prediction from
    that link alone, and their ratio (medians resist the odd slow round on a shared machine)."""
    from bfexp.scaling import processor_count

    cores = processor_count()
    med = statistics.median
    link = {"alpha_s": med(r["link"]["alpha_s"] for r in rounds)}
    for k in ("beta_s_per_byte", "gamma_s_per_byte"):
        link[k] = {s: med(r["link"][k][s] for r in rounds) for s in rounds[0]["link"][k]}
    rows = []
    for n, by_size in rounds[0]["ops"].items():
        for size, ops in by_size.items():
            for op in ops:
                measured = med(r["ops"][n][size][op] for r in rounds)
                predicted = predict(link, cores, op, int(n), int(size))
                rows.append({"op": op, "ranks": int(n), "floats": int(size), "measured_s": measured,
                             "predicted_s": predicted, "ratio": measured / predicted})
    return {"cores": cores, "link": link, "rows": rows, "rounds": rounds, "machine_shared": True}


def print_report(report: dict) -> None:
    link = report["link"]
    print(f"link between 2 ranks through the MPI engine ({report['cores']} cores): "
          f"alpha {link['alpha_s'] * 1e6:.1f} us")
    for size in link["beta_s_per_byte"]:
        print(f"  {int(size) >> 20:>4}M floats: bandwidth {1e-9 / link['beta_s_per_byte'][size]:.2f} GB/s, "
              f"combine {1e-9 / link['gamma_s_per_byte'][size]:.2f} GB/s")
    print(f"{len(report['rounds'])} rounds; medians over rounds; predicted from the median link alone")
    print(f"{'op':<20}{'ranks':>6}{'floats':>10}{'measured ms':>13}{'predicted ms':>14}{'ratio':>8}")
    for r in report["rows"]:
        print(f"{r['op']:<20}{r['ranks']:>6}{r['floats'] >> 20:>9}M{r['measured_s'] * 1e3:>13.2f}"
              f"{r['predicted_s'] * 1e3:>14.2f}{r['ratio']:>8.2f}")
    if report.get("skipped"):
        print(f"skipped, over half the available memory: {', '.join(report['skipped'])}")
    largest = max(link["beta_s_per_byte"], key=int)
    print(f"\nconf/scaling/local.yaml (figures at the largest size, {int(largest) >> 20}M floats):")
    print(f"intra_latency_s: {link['alpha_s']:.3g}")
    print(f"intra_bandwidth_gbyte_per_s: {1e-9 / link['beta_s_per_byte'][largest]:.3g}")
    print(f"reduce_gbyte_per_s: {1e-9 / link['gamma_s_per_byte'][largest]:.3g}")


# ---------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    from bfexp.sessions import rank_environment
    from bfexp.launchers import find_mpiexec

    n = max(args.rank_counts)
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    command = [find_mpiexec(), "--oversubscribe", "-n", str(n), sys.executable, "-m", "mpi4py",
               str(Path(__file__).resolve()), "--worker", *forwarded]
    env = rank_environment(n)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    sys.exit(subprocess.call(command, env=env))


if __name__ == "__main__":
    main()
