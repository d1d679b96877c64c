"""Check the cost model against operations measured on the emulated cluster, and calibrate it.

    python scripts/check_costmodel.py [--hosts 2,3,4] [--rates 200mbit,500mbit,1gbit,2gbit] [--cpu 0.4]
                                      [--floats 4M] [--reps 5] [--calibrations 3] [--wait sleep] [--json PATH]

Needs the cluster up with as many hosts as the largest count (``scripts/cluster_local.sh up --hosts 4``,
as root). One rank per host, each host held to ``--cpu`` cores. First, on two hosts with unshaped links,
it calibrates what is not the wire: the fixed cost of one large message and how fast a host's network stack
moves bytes when the link is not the limit (a line through exchanges of --floats/8, /2 and /1 floats, less
their combine), and how fast a host combines (a weighted add of two vectors); per core (divided by --cpu);
each figure the median of --calibrations such runs; the same lines through the ends of each size's interval
(the median's, as the single-rank reference's) give the figures at the calibration's fast and slow ends
(calibration_ends). Then, on the most hosts with unshaped links, how many
bytes a second the emulated network forwards in all (every host's traffic crosses this one machine's
kernel): from one-peer exchanges, 0 where the stack alone explains them, else what they took beyond their
per-message cost and combine (switch_figure). Then, for each link rate (every used host's link shaped to it)
and host count, it times Open MPI's allreduce (its algorithm pinned: launcher=emulated's
allreduce_algorithm), bfexp's allreduce (its own ring from 8 MiB), and neighbor_allreduce over ring, exp2
and one-peer exp2 (one round), medians of --reps calls each as the slowest rank saw it. The ranks run as
launcher=emulated starts them (its wait and TCP transport settings). Beside each, the cost model's price
(bfexp/costmodel.py) on the cluster those figures describe: the link at the rate's TCP payload rate, the
calibrated latency, stack and combine at the quota. It prints measured, modeled (with its interval: the model
at the calibration's ends) and their ratio, the median and worst ratio, and the lines of
conf/scaling/emulated.yaml. Training steps are checked by the bandwidth study
(``bfexp -m +experiment=bandwidth_study``), whose summaries carry measured and modeled step times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (str(REPO), str(REPO / "scripts")):
    if path not in sys.path:  # run from a clone without installing
        sys.path.insert(0, path)

from calibrate_comm import Group, buffer, parse_size, quiet_barrier, timed_once  # noqa: E402

OPS = ("ompi_allreduce", "bfexp_allreduce", "neighbor_ring", "neighbor_exp2", "neighbor_one_peer_exp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2,3,4", help="host counts (one rank each; default 2,3,4)")
    p.add_argument("--rates", default="200mbit,500mbit,1gbit,2gbit", help="link rates (default 200mbit..2gbit)")
    p.add_argument("--cpu", type=float, default=0.4, help="cores per host (default 0.4)")
    p.add_argument("--floats", default="4M", help="float32 elements per message (default 4M: 16.8 MB)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per operation; medians are kept (default 5)")
    p.add_argument("--allreduce-algorithm", default="ring", help="Open MPI's allreduce, pinned (default ring)")
    p.add_argument("--calibrations", type=int, default=3, help="2-host calibrations; each figure is their median "
                   "(default 3)")
    p.add_argument("--wait", default="sleep", help="how a rank waits in MPI: sleep, yield or spin (launcher.wait; "
                   "default sleep)")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--worker", choices=("calibrate", "ops"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.host_counts = sorted({int(h) for h in args.hosts.split(",")})
    args.rate_list = [r.strip() for r in args.rates.split(",")]
    args.size = parse_size(args.floats)
    if min(args.host_counts) < 2 or args.reps < 1 or args.calibrations < 1:
        p.error("--hosts must be >= 2, --reps and --calibrations >= 1")
    return args


# ---------------------------------------------------------------- on the ranks


def timed_spread(group: Group, fn, reps: int) -> dict:
    """``reps`` calls once warmed up: their median and its interval (scaling.spread_of), as ``_low``/``_high``."""
    from bfexp.scaling import spread_of

    fn()  # warm-up: connections, buffers
    spread = spread_of([timed_once(group.comm, fn) for _ in range(reps)])
    return {"": spread.value, "_low": spread.low, "_high": spread.high}


def median_time(group: Group, fn, reps: int) -> float:
    return timed_spread(group, fn, reps)[""]


def calibrate(group: Group, size: int, reps: int) -> dict:
    """Two ranks on unshaped links: per size (size/8, size/2, size), the combine and the exchange, each exchange
    against the combine timed just before it (pairs see the same load); medians and their intervals
    (scaling.spread_of). See calibrated_figures."""
    from bfexp.scaling import spread_of

    engine, peer = group.engine, 1 - group.engine.rank
    one = buffer("one", 1)
    out = {"one_float_s": median_time(group, lambda: engine.neighbor_allreduce(one, 0.5, {peer: 0.5}, [peer]),
                                      4 * reps), "sizes": {}}
    for floats in (size // 8, size // 2, size):
        x, recv = buffer("x", floats), buffer("recv", floats)

        def combine():
            y = x * 0.5
            y.add_(recv, alpha=0.5)

        exchange = lambda: engine.neighbor_allreduce(x, 0.5, {peer: 0.5}, [peer])  # noqa: E731
        combine(), exchange()  # warm-up
        pairs = [(timed_once(group.comm, combine), timed_once(group.comm, exchange)) for _ in range(2 * reps)]
        row = out["sizes"][str(floats)] = {}
        for key, samples in (("combine_s", [c for c, _ in pairs]), ("transfer_s", [e - c for c, e in pairs])):
            spread = spread_of(samples)  # the median and its interval, as the single-rank reference's
            row.update({key: spread.value, f"{key}_low": spread.low, f"{key}_high": spread.high})
    return out


def ops(group: Group, size: int, reps: int) -> dict:
    """Every operation of OPS once warmed up, then medians of ``reps`` calls (one-peer exp2's with its interval,
    whose ends give the switch's at the calibration's ends)."""
    from mpi4py import MPI

    from bfexp.topology import Exp2, OnePeerExp2, Ring

    engine, rank, n = group.engine, group.engine.rank, group.engine.size
    x = buffer("x", size)
    flat = x.numpy().copy()
    out = {"ompi_allreduce": median_time(group, lambda: group.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM), reps),
           "bfexp_allreduce": median_time(group, lambda: engine.allreduce(x, op="avg"), reps)}
    for name, topology in (("neighbor_ring", Ring(n)), ("neighbor_exp2", Exp2(n)),
                           ("neighbor_one_peer_exp2", OnePeerExp2(n))):
        w = topology.weights(rank, 0)
        timed = timed_spread(group, lambda: engine.neighbor_allreduce(x, w.self_weight, w.src_weights,
                                                                      list(w.dst_weights)), reps)
        out.update({name + end: value for end, value in timed.items()} if name == "neighbor_one_peer_exp2"
                   else {name: timed[""]})
    return out


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if args.worker == "calibrate":
        result = Group(world, 2).run(lambda g: calibrate(g, args.size, args.reps))
    else:
        result = {}
        for n in args.host_counts:
            result[str(n)] = Group(world, n).run(lambda g: ops(g, args.size, args.reps))
            quiet_barrier(world)
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the driver


def on_cluster(args: argparse.Namespace, ranks: int, rate: str, what: str) -> dict:
    """One mpirun over the first ``ranks`` hosts, links at ``rate``, running this script's worker ``what``."""
    from bfexp.launchers import Emulated
    from bfexp.sessions import rank_environment

    launcher = Emulated(link_rate=rate, cpu=args.cpu, allreduce_algorithm=args.allreduce_algorithm, wait=args.wait)
    launcher.check(ranks)
    launcher.prepare(ranks)
    forwarded = ["--hosts", ",".join(map(str, args.host_counts)), "--floats", args.floats, "--reps", str(args.reps)]
    program = [sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "--worker", what, *forwarded]
    env = launcher.environment(ranks, rank_environment(ranks))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = str(launcher.threads_per_rank(ranks))
    command = launcher.command(ranks, program, launcher.forward_environment(env))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.exit(f"check_costmodel: the {what} job failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
             f"{done.stderr[-3000:]}")


def calibrated_figures(cal: dict, cpu: float, end: str = "") -> dict:
    """The scaling config's figures from a calibration, per core (so the quota scales them): a least-squares
    line through each size's transfer time (the exchange less its combine) against the bytes the stack moves
    (sent plus received): its intercept is the cost of one large message (the one-float exchange is cheaper:
    a large one is a rendezvous, whose handshake waits on the other rank), its slope the stack's; the
    combine's speed from the largest size. ``end`` "_low"/"_high": the same through the low/high ends of each
    size's intervals (the fast and slow ends of the calibration: scaling.calibration_ends)."""
    sizes = sorted(cal["sizes"], key=int)
    xs = [2 * 4 * int(s) for s in sizes]
    ys = [cal["sizes"][s]["transfer_s" + end] for s in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    largest = cal["sizes"][sizes[-1]]
    return {
        "inter_latency_s": max(cal["one_float_s"], my - slope * mx),
        "inter_stack_gbyte_per_s": 1 / max(slope, 1e-12) / cpu / 1e9,
        # the combine reads two vectors
        "reduce_gbyte_per_s": 2 * 4 * int(sizes[-1]) / largest["combine_s" + end] / cpu / 1e9,
    }


ENDS = {"fast": "_low", "slow": "_high"}  # scaling.calibration_ends: the calibration's intervals' ends


def switch_figure(figures: dict, measured_s: float, n: int, nbytes: float, cpu: float) -> float:
    """GB/s that the emulated network forwards in all (0: it keeps up), from one-peer exchanges on ``n``
    unshaped hosts (round 0 of one-peer exp2: each rank sends ``nbytes`` to the next and receives as much, so
    n x nbytes cross at once). The stack and the switch are stages of one pipeline (costmodel.Cluster.inter_s):
    when the exchange took longer than its price with the stack as its only stage, the switch is the slowest
    stage, and what the exchange took beyond its per-message cost and its combine is the switch's time. All
    hosts' traffic passes one kernel here, on the cores the hosts' quotas leave: a 2-host calibration cannot
    see it (two flows)."""
    stack_only = modeled(model_cluster({**figures, "switch_gbyte_per_s": 0.0}, "none", cpu),
                         "neighbor_one_peer_exp2", n, nbytes)
    if measured_s <= stack_only:
        return 0.0
    no_stage = model_cluster({**figures, "switch_gbyte_per_s": 0.0, "inter_stack_gbyte_per_s": math.inf}, "none", cpu)
    return n * nbytes / (measured_s - modeled(no_stage, "neighbor_one_peer_exp2", n, nbytes)) / 1e9


def model_cluster(figures: dict, rate: str, cpu: float):
    from bfexp import costmodel
    from bfexp.launchers.emulated import tcp_goodput_gbyte_per_s

    link = costmodel.Link(figures["inter_latency_s"], tcp_goodput_gbyte_per_s(rate) * 1e9)
    return costmodel.Cluster(name="emulated", ranks_per_machine=1, intra=link, inter=link, nic_shared=True,
                             reduce_bytes_per_s=figures["reduce_gbyte_per_s"] * 1e9, cores=cpu, allreduce="ring",
                             stack_bytes_per_s=figures["inter_stack_gbyte_per_s"] * 1e9,
                             switch_bytes_per_s=(figures.get("switch_gbyte_per_s") or math.inf) * 1e9)


def modeled(cluster, op: str, n: int, nbytes: float) -> float:
    """The cost model's price of one operation; bfexp's allreduce (out of place) also copies its input once."""
    from bfexp import costmodel
    from bfexp.topology import Exp2, OnePeerExp2, Ring

    if op == "ompi_allreduce":
        return costmodel.ring_allreduce_s(cluster, n, nbytes)
    if op == "bfexp_allreduce":
        return costmodel.ring_allreduce_s(cluster, n, nbytes) + cluster.reduce_s(nbytes, n)
    topology = {"neighbor_ring": Ring, "neighbor_exp2": Exp2, "neighbor_one_peer_exp2": OnePeerExp2}[op](n)
    return costmodel.exchange_s(cluster, n, costmodel.topology_edges(topology, 0), nbytes)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    from bfexp.launchers import Emulated

    hosts = Emulated.cluster_hosts()
    if len(hosts) < max(args.host_counts):
        sys.exit(f"check_costmodel: the emulated cluster has {len(hosts)} hosts; --hosts needs "
                 f"{max(args.host_counts)}: scripts/cluster_local.sh up --hosts {max(args.host_counts)}")
    started = time.perf_counter()
    cals, runs, end_runs = [], [], {end: [] for end in ENDS}
    for _ in range(args.calibrations):
        cal = on_cluster(args, 2, "none", "calibrate")
        cals.append(cal)
        runs.append(calibrated_figures(cal, args.cpu))
        for end, suffix in ENDS.items():
            end_runs[end].append(calibrated_figures(cal, args.cpu, suffix))
        print(f"calibrated on 2 hosts at {args.cpu:g} cores, unshaped: one large message "
              f"{runs[-1]['inter_latency_s'] * 1e3:.2f} ms (one float {cal['one_float_s'] * 1e3:.2f} ms), "
              f"stack {runs[-1]['inter_stack_gbyte_per_s']:.3g} GB/s per core, "
              f"combine {runs[-1]['reduce_gbyte_per_s']:.3g} GB/s per core", flush=True)
    figures = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    ends = {end: {key: statistics.median(run[key] for run in end_runs[end]) for key in runs[0]} for end in ENDS}
    nbytes = 4 * args.size
    most = max(args.host_counts)
    unshaped = on_cluster(args, most, "none", "ops")
    one_peer = unshaped[str(most)]
    figures["switch_gbyte_per_s"] = switch_figure(figures, one_peer["neighbor_one_peer_exp2"], most, nbytes, args.cpu)
    for end, suffix in ENDS.items():  # the switch at each end: that end's stack, that end of the exchange's interval
        exchange_s = one_peer["neighbor_one_peer_exp2" + suffix]
        ends[end]["switch_gbyte_per_s"] = switch_figure({**figures, **ends[end]}, exchange_s, most, nbytes, args.cpu)
    switch = figures["switch_gbyte_per_s"]
    print(f"calibrated on {most} hosts, unshaped: " + (f"the network forwards {switch:.3g} GB/s in all" if switch
          else "the network keeps up with the hosts' stacks (switch_gbyte_per_s: 0)"), flush=True)
    rows = []
    for rate in args.rate_list:
        measured = unshaped if rate == "none" else on_cluster(args, most, rate, "ops")
        cluster = model_cluster(figures, rate, args.cpu)
        at_ends = [model_cluster({**figures, **ends[end]}, rate, args.cpu) for end in ENDS]
        for n in args.host_counts:
            for op in OPS:
                m, p = measured[str(n)][op], modeled(cluster, op, n, nbytes)
                lo, hi = (f(p, *(modeled(c, op, n, nbytes) for c in at_ends)) for f in (min, max))
                rows.append({"rate": rate, "hosts": n, "op": op, "measured_s": m, "modeled_s": p, "ratio": m / p,
                             "modeled_low_s": lo, "modeled_high_s": hi})
                print(f"{rate:>8} {n} hosts {op:<24} measured {m * 1e3:8.1f} ms  modeled {p * 1e3:8.1f} ms "
                      f"[{lo * 1e3:.1f}, {hi * 1e3:.1f}]  ratio {m / p:5.2f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"\n{len(rows)} points: median measured/modeled {statistics.median(ratios):.3f}, "
          f"range [{min(ratios):.2f}, {max(ratios):.2f}]; worst {worst['op']} at {worst['hosts']} hosts, "
          f"{worst['rate']}: {worst['ratio']:.2f} ({time.perf_counter() - started:.0f} s)")
    print(f"\nconf/scaling/emulated.yaml (Open MPI's allreduce pinned: {args.allreduce_algorithm}; "
          f"launcher.wait={args.wait}):")
    for key, value in figures.items():
        print(f"{key}: {value:.3g}")
    print("calibration_ends:")
    for end, values in ends.items():
        print(f"  {end}: {{" + ", ".join(f"{key}: {value:.3g}" for key, value in values.items()) + "}")
    inside = sum(r["modeled_low_s"] <= r["measured_s"] <= r["modeled_high_s"] for r in rows)
    print(f"{inside} of {len(rows)} measured times inside the interval of the model at the calibration's ends")
    if args.json:
        report = {"cpu": args.cpu, "wait": args.wait, "floats": args.size, "calibrations": cals, "figures": figures,
                  "calibration_ends": ends,
                  "unshaped": unshaped[str(most)], "rows": rows, "median_ratio": statistics.median(ratios),
                  "min_ratio": min(ratios), "max_ratio": max(ratios)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
