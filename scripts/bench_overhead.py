"""Where a researcher feels bfexp's overhead: small models and short runs, against hand-written references.

    python scripts/bench_overhead.py [--ranks 4] [--repeats 7] [--parts step,ops,wall] [--sizes 1K,16K,256K]

Everything is measured in one run, each bfexp figure beside its reference,
call by call in alternating order (bfexp then reference, then reference then
bfexp, ...), so load that comes and goes on a shared machine hits both sides
of a ratio alike.
Read the ratios, not the absolute times.

* step: the training step of the default experiment (DSGD atc on static
  exp2, synthetic logistic regression, batch 32, lr 0.2, ``bfexp``'s
  defaults): bfexp's ``worker.train_step`` on the job ``worker.build``
  makes, against a hand-written mpi4py loop doing the same work (forward,
  backward, torch.optim.SGD step, then the exp2 neighbor average of the flat
  parameters by Isend/Irecv and an in-place weighted combine). Both take
  the same mini-batches.                                       target <= 1.2
* ops: each engine operation at small sizes (float32 elements) on the MPI
  engine against mpi4py doing the same work: neighbor_allreduce_ (exp2,
  Isend/Irecv + combine), allreduce_ (Allreduce IN_PLACE + divide),
  broadcast_ (Bcast), win_put / win_accumulate / win_get (a lock, Put /
  Accumulate / Get of data and weight, unlock, per peer), win_update (own
  := weighted combine of the slots under an exclusive lock). Printed: the
  median time per call of each, their ratio and the difference (bfexp's
  per-call overhead).            neighbor_allreduce_ overhead at 1K <= 0.1 ms
* wall: whole-job wall of ``bfexp steps=1`` and of the default ``bfexp``
  (200 steps) against a bare ``mpiexec -n R python`` that imports torch
  and mpi4py and meets at a barrier; the default job's ratio is taken
  against bare + its training time (steps x its median step time, from its
  summary).                                                    target <= 1.5

A time per call is, per repeat, the slowest rank's mean over a block of calls
(a barrier before each block); medians are over repeats. On a loaded machine
times are bimodal (a rank waits for a scheduler slice), so the ratios of the
minimums are printed beside the medians: they show the intrinsic overhead.

To compare with another checkout (e.g. the last commit, unpacked with git
archive, its conf/ copied to bfexp/conf), run this script from there: it
imports the bfexp beside it, and the `bfexp` it times follows PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = {"step": 1.2, "wall_default": 1.5, "nar_overhead_ms_1K": 0.1}
BARE = "import torch\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    return int(text.rstrip("KM")) * scale


def label(numel: int) -> str:
    return f"{numel >> 20}M" if numel >= 1 << 20 and numel % (1 << 20) == 0 else f"{numel >> 10}K"


# ---------------------------------------------------------------- rank part (under mpiexec)


class Timer:
    """Blocks of calls, each the slowest rank's mean per call; the same count on every rank."""

    def __init__(self, comm: Any, block_s: float) -> None:
        self.comm, self.block_s = comm, block_s

    def calls_for(self, fn: Callable[[], Any]) -> int:
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        per = (time.perf_counter() - t0) / 3
        per = self.comm.allreduce(per, op=_mpi().MAX)
        return max(5, min(400, int(self.block_s / max(per, 1e-6))))

    def block(self, fn: Callable[[], Any], calls: int) -> float:
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per = (time.perf_counter() - t0) / calls
        return self.comm.allreduce(per, op=_mpi().MAX)

    def pair(self, ours: Callable[[], Any], ref: Callable[[], Any], repeats: int) -> tuple[list[float], list[float]]:
        """Both sides call by call, in alternating order (ours, ref, ref, ours, ...), each call timed:
        load that comes and goes hits both alike. Per repeat, each side's per-call mean (slowest rank)."""
        calls = self.calls_for(ref)
        MPI = _mpi()
        for _ in range(2):  # warm both
            ours()
            ref()
        a, b = [], []
        for _ in range(repeats):
            self.comm.Barrier()
            t_ours = t_ref = 0.0
            for i in range(calls):
                first, second = (ours, ref) if i % 2 == 0 else (ref, ours)
                t0 = time.perf_counter()
                first()
                t1 = time.perf_counter()
                second()
                t2 = time.perf_counter()
                if i % 2 == 0:
                    t_ours, t_ref = t_ours + (t1 - t0), t_ref + (t2 - t1)
                else:
                    t_ref, t_ours = t_ref + (t1 - t0), t_ours + (t2 - t1)
            a.append(self.comm.allreduce(t_ours / calls, op=MPI.MAX))
            b.append(self.comm.allreduce(t_ref / calls, op=MPI.MAX))
        return a, b


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def exp2_weights(rank: int, size: int) -> tuple[float, dict[int, float], list[int]]:
    """Static exp2 (base 2), uniform weights: what bfexp.topology.Exp2 gives, written out."""
    hops = []
    h = 1
    while h < size:
        hops.append(h)
        h *= 2
    srcs = sorted({(rank - h) % size for h in hops})
    dsts = sorted({(rank + h) % size for h in hops})
    w = 1.0 / (1 + len(srcs))
    return w, {s: w for s in srcs}, dsts


def default_config() -> Any:
    """bfexp's default experiment as the CLI composes it (the MPI engine)."""
    from hydra import compose, initialize_config_module

    from bfexp.config import register_configs

    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        return compose(config_name="config", overrides=["engine=mpi"])


def bench_step(comm: Any, timer: Timer, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from bfexp import worker
    from bfexp.comm.mpi import MPIEngine
    from bfexp.data import BatchSampler
    from bfexp.models import build_model
    from bfexp.schema import Settings

    MPI = _mpi()
    cfg = default_config()
    engine = MPIEngine()
    job = worker.build(Settings.of(cfg), engine, dataset=cfg.dataset, model=cfg.model, optimizer=cfg.optimizer,
                       algorithm=cfg.algorithm, topology=cfg.topology)
    sampler = BatchSampler(job.data, cfg.batch_size, cfg.seed, engine.rank)
    batches = [sampler.next() for _ in range(64)]
    at = [0]

    def batch() -> tuple[Any, Any]:
        at[0] = (at[0] + 1) % len(batches)
        return batches[at[0]]

    def ours() -> None:
        x, y = batch()
        worker.train_step(job.net, job.optimizer, x, y, job.dtype)

    # The hand-written loop: the same model, its parameters in one flat buffer, torch's SGD, exp2 by hand.
    model = build_model(cfg.model, job.in_shape, job.classes, cfg.seed, job.dtype)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    sgd = torch.optim.SGD(params, lr=float(cfg.lr))
    self_w, src_w, dsts = exp2_weights(comm.Get_rank(), comm.Get_size())
    inbox = {s: torch.empty_like(flat) for s in src_w}
    send, recv = flat.numpy(), {s: b.numpy() for s, b in inbox.items()}

    def ref() -> None:
        x, y = batch()
        sgd.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        sgd.step()
        reqs = [comm.Isend(send, dest=d, tag=7) for d in dsts] + [comm.Irecv(recv[s], source=s, tag=7) for s in src_w]
        MPI.Request.Waitall(reqs)
        flat.mul_(self_w)
        for s, w in src_w.items():
            flat.add_(inbox[s], alpha=w)

    a, b = timer.pair(ours, ref, repeats)
    job.optimizer.close()
    engine.close()
    return {"bfexp_s": a, "hand_s": b, "params": int(flat.numel())}


def bench_ops(comm: Any, timer: Timer, repeats: int, sizes: list[int]) -> dict:
    import numpy as np
    import torch

    from bfexp.comm.mpi import MPIEngine
    from bfexp.topology import Exp2

    MPI = _mpi()
    rank, n = comm.Get_rank(), comm.Get_size()
    engine = MPIEngine()
    engine.set_topology(Exp2(n))
    unchecked = MPIEngine(check_neighbors=False)
    unchecked.set_topology(Exp2(n))
    self_w, src_w, dsts = exp2_weights(rank, n)
    srcs = sorted(src_w)
    out: dict[str, dict] = {}
    for numel in sizes:
        x = torch.randn(numel)
        y = x.clone()
        inbox = {s: torch.empty(numel) for s in srcs}
        row = {}

        def nar_raw() -> None:
            reqs = [comm.Isend(y.numpy(), dest=d, tag=9) for d in dsts]
            reqs += [comm.Irecv(inbox[s].numpy(), source=s, tag=9) for s in srcs]
            MPI.Request.Waitall(reqs)
            y.mul_(self_w)
            for s, w in src_w.items():
                y.add_(inbox[s], alpha=w)

        row["neighbor_allreduce_"] = timer.pair(lambda: engine.neighbor_allreduce_(x), nar_raw, repeats)
        # For information: without the declaration check (a mismatch would hang, as raw MPI does).
        row["nar_ unchecked"] = timer.pair(lambda: unchecked.neighbor_allreduce_(x), nar_raw, repeats)

        def allreduce_raw() -> None:
            comm.Allreduce(MPI.IN_PLACE, y.numpy(), op=MPI.SUM)
            y.div_(n)

        row["allreduce_"] = timer.pair(lambda: engine.allreduce_(x), allreduce_raw, repeats)
        row["broadcast_"] = timer.pair(lambda: engine.broadcast_(x, 0), lambda: comm.Bcast(y.numpy(), root=0),
                                       repeats)
        # Windows: bfexp's, and a raw MPI window of the same layout (own value, one slot per source, weights).
        engine.win_create(x, "bench")
        slots = 1 + len(srcs)
        data_bytes = slots * numel * 4
        win = MPI.Win.Allocate(data_bytes + slots * 8, 1, comm=comm)
        mem = np.frombuffer(win.tomemory(), np.uint8)
        data = torch.from_numpy(mem[:data_bytes]).view(torch.float32).view(slots, numel)
        weights = mem[data_bytes:].view(np.float64)
        weights[:] = [1.0] + [0.0] * len(srcs)
        comm.Barrier()
        # Where this rank's slot sits at each destination (sources ascending there).
        slot_at = {d: 1 + sorted(exp2_weights(d, n)[1]).index(rank) for d in dsts}
        pw = np.array([1.0])
        fw = np.empty(1)
        fetched = torch.empty(numel)

        def push_raw(accumulate: bool) -> Callable[[], None]:
            def run() -> None:
                payload = data[0].numpy()
                for d in dsts:
                    r = slot_at[d]
                    win.Lock(d, MPI.LOCK_SHARED)
                    if accumulate:
                        win.Accumulate(payload, d, target=(r * numel * 4, numel, MPI.FLOAT), op=MPI.SUM)
                        win.Accumulate(pw, d, target=(data_bytes + r * 8, 1, MPI.DOUBLE), op=MPI.SUM)
                    else:
                        win.Put(payload, d, target=(r * numel * 4, numel * 4, MPI.BYTE))
                        win.Put(pw, d, target=(data_bytes + r * 8, 8, MPI.BYTE))
                    win.Unlock(d)
            return run

        def get_raw() -> None:
            for i, s in enumerate(srcs):
                win.Lock(s, MPI.LOCK_SHARED)
                win.Get(fetched.numpy(), s, target=(0, numel * 4, MPI.BYTE))
                win.Get(fw, s, target=(data_bytes, 8, MPI.BYTE))
                win.Unlock(s)
                win.Lock(rank, MPI.LOCK_EXCLUSIVE)
                data[1 + i].copy_(fetched)
                weights[1 + i] = fw[0]
                win.Unlock(rank)

        def update_raw() -> None:
            win.Lock(rank, MPI.LOCK_EXCLUSIVE)
            data[0].mul_(self_w)
            for i in range(len(srcs)):
                data[0].add_(data[1 + i], alpha=self_w)
            weights[0] = self_w * weights[0] + sum(self_w * weights[1 + i] for i in range(len(srcs)))
            win.Unlock(rank)

        row["win_put"] = timer.pair(lambda: engine.win_put(None, "bench"), push_raw(False), repeats)
        row["win_accumulate"] = timer.pair(lambda: engine.win_accumulate(None, "bench"), push_raw(True), repeats)
        row["win_get"] = timer.pair(lambda: engine.win_get("bench"), get_raw, repeats)
        row["win_update"] = timer.pair(lambda: engine.win_update("bench"), update_raw, repeats)
        comm.Barrier()
        win.Free()
        engine.win_free("bench")
        out[label(numel)] = {op: {"bfexp_s": a, "raw_s": b} for op, (a, b) in row.items()}
    unchecked.close()
    engine.close()
    return out


def rank_main(args: argparse.Namespace) -> None:
    import torch

    MPI = _mpi()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    timer = Timer(comm, args.block_s)
    result: dict[str, Any] = {}
    parts = args.parts.split(",")
    if "step" in parts:
        result["step"] = bench_step(comm, timer, args.repeats)
    if "ops" in parts:
        result["ops"] = bench_ops(comm, timer, args.repeats, [parse_size(s) for s in args.sizes.split(",")])
    if comm.Get_rank() == 0:
        Path(args.rank_out).write_text(json.dumps(result))


# ---------------------------------------------------------------- driver part


def environment(ranks: int) -> dict[str, str]:
    from bfexp.sessions import rank_environment

    return rank_environment(ranks)


def mpiexec(ranks: int, argv: list[str]) -> list[str]:
    from bfexp.launchers import find_mpiexec

    return [find_mpiexec(), "--oversubscribe", "-n", str(ranks), sys.executable, *argv]


def run_ranks(args: argparse.Namespace, parts: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = mpiexec(args.ranks, ["-m", "mpi4py", __file__, "--rank-part", "--rank-out", str(out),
                                   "--parts", ",".join(parts), "--sizes", args.sizes,
                                   "--repeats", str(args.repeats), "--block-s", str(args.block_s)])
        subprocess.run(cmd, check=True, env=environment(args.ranks), cwd=ROOT)
        return json.loads(out.read_text())


def timed_run(cmd: list[str], env: dict[str, str], cwd: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return wall


def bench_wall(args: argparse.Namespace) -> dict:
    """Interleaved: bare mpiexec start, `bfexp steps=1`, default `bfexp`."""
    bfexp = str(Path(sys.executable).parent / "bfexp")
    env = environment(args.ranks)
    out: dict[str, list[float]] = {"bare_s": [], "steps1_s": [], "default_s": [], "default_train_s": []}
    other = os.environ.copy()
    if args.baseline:  # the same jobs from another checkout, interleaved with ours
        other["PYTHONPATH"] = os.pathsep.join([str(Path(args.baseline).resolve()), other.get("PYTHONPATH", "")])
        out.update({"base_steps1_s": [], "base_default_s": [], "base_default_train_s": []})
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text(BARE)
        runs = {
            "bare_s": lambda k: timed_run(mpiexec(args.ranks, [str(bare)]), env, tmp),
            "steps1_s": lambda k: timed_run([bfexp, "steps=1", f"ranks={args.ranks}", "logger=jsonl",
                                             f"hydra.run.dir={tmp}/s1-{k}"], os.environ.copy(), tmp),
            "default_s": lambda k: timed_run([bfexp, f"ranks={args.ranks}", "logger=jsonl",
                                              f"hydra.run.dir={tmp}/d-{k}"], os.environ.copy(), tmp),
        }
        if args.baseline:
            runs["base_steps1_s"] = lambda k: timed_run([bfexp, "steps=1", f"ranks={args.ranks}", "logger=jsonl",
                                                         f"hydra.run.dir={tmp}/bs1-{k}"], other, tmp)
            runs["base_default_s"] = lambda k: timed_run([bfexp, f"ranks={args.ranks}", "logger=jsonl",
                                                          f"hydra.run.dir={tmp}/bd-{k}"], other, tmp)
        for k in range(args.wall_repeats):
            order = list(runs) if k % 2 == 0 else list(reversed(runs))
            for name in order:
                out[name].append(runs[name](k))
            for prefix, folder in (("", "d"), ("base_", "bd")):
                if f"{prefix}default_s" in out:
                    summary = json.loads((Path(tmp) / f"{folder}-{k}" / "summary.json").read_text())
                    train = summary.get("train_time_s")
                    if train is None:  # before train_time_s existed: steps x the median step
                        train = summary["steps"] * summary["step_time_s"]
                    out[f"{prefix}default_train_s"].append(train)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(result: dict) -> dict:
    """Print the tables; return the headline ratios."""
    head: dict[str, float] = {}
    if "step" in result:
        s = result["step"]
        a, b = med(s["bfexp_s"]), med(s["hand_s"])
        head["step"] = a / b
        print(f"\nDSGD training step, default problem ({s['params']} parameters), ms per step (median of repeats)")
        print(f"  bfexp train_step {a * 1e3:8.3f}   hand-written mpi4py {b * 1e3:8.3f}   "
              f"ratio {a / b:5.2f}  (target <= {TARGETS['step']})")
        print(f"  per repeat ratios: {' '.join(f'{x / y:.2f}' for x, y in zip(s['bfexp_s'], s['hand_s']))}   "
              f"ratio of minimums {min(s['bfexp_s']) / min(s['hand_s']):.2f}")
    if "ops" in result:
        print("\nEngine ops (MPI engine) vs mpi4py doing the same work: ms per call, median of repeats")
        print(f"  {'op':<20} {'size':>6} {'bfexp':>9} {'mpi4py':>9} {'ratio':>6} {'overhead':>9}   "
              f"(minimums: ratio, overhead)")
        for size, ops in result["ops"].items():
            for op, r in ops.items():
                a, b = med(r["bfexp_s"]), med(r["raw_s"])
                lo_a, lo_b = min(r["bfexp_s"]), min(r["raw_s"])
                print(f"  {op:<20} {size:>6} {a * 1e3:9.4f} {b * 1e3:9.4f} {a / b:6.2f} {(a - b) * 1e3:9.4f}   "
                      f"({lo_a / lo_b:.2f}, {(lo_a - lo_b) * 1e3:.4f})")
                if op == "neighbor_allreduce_" and size == "1K":
                    head["nar_overhead_ms_1K"] = (a - b) * 1e3
    if "wall" in result:
        w = result["wall"]
        bare, s1, d, train = (med(w[k]) for k in ("bare_s", "steps1_s", "default_s", "default_train_s"))
        head["wall_steps1"] = s1 / bare
        head["wall_default"] = d / (bare + train)
        print("\nWhole-job wall, s (median of repeats; runs interleaved)")
        print(f"  bare mpiexec (torch + mpi4py + barrier) {bare:7.2f}")
        print(f"  bfexp steps=1                           {s1:7.2f}   / bare          {s1 / bare:5.2f}")
        print(f"  bfexp (default, training {train:.2f} s)      {d:7.2f}   / (bare+train)  {d / (bare + train):5.2f}"
              f"  (target <= {TARGETS['wall_default']})")
        if "base_default_s" in w:
            bs1, bd, btrain = (med(w[k]) for k in ("base_steps1_s", "base_default_s", "base_default_train_s"))
            head["base_wall_steps1"] = bs1 / bare
            head["base_wall_default"] = bd / (bare + btrain)
            print(f"  --baseline steps=1                      {bs1:7.2f}   / bare          {bs1 / bare:5.2f}")
            print(f"  --baseline (default, training {btrain:.2f} s) {bd:7.2f}   / (bare+train)  "
                  f"{bd / (bare + btrain):5.2f}")
        print("  per repeat: " + "  ".join(f"{k}={' '.join(f'{x:.1f}' for x in v)}" for k, v in w.items()))
    print("\nheadline: " + "  ".join(f"{k}={v:.3f}" for k, v in head.items()))
    return head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats of each step/op pair")
    ap.add_argument("--wall-repeats", type=int, default=2, help="interleaved repeats of the whole-job runs")
    ap.add_argument("--parts", default="step,ops,wall", help="any of step, ops, wall (comma separated)")
    ap.add_argument("--sizes", default="1K,16K,256K", help="float32 elements per op, comma separated")
    ap.add_argument("--block-s", type=float, default=0.03, help="seconds per timed block of calls")
    ap.add_argument("--json", help="write the raw figures and the headline here")
    ap.add_argument("--baseline", help="a checkout whose `bfexp` jobs are timed too, interleaved (wall part)")
    ap.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_part:
        rank_main(args)
        return
    parts = args.parts.split(",")
    result: dict[str, Any] = {}
    rank_parts = [p for p in parts if p in ("step", "ops")]
    if rank_parts:
        result.update(run_ranks(args, rank_parts))
    if "wall" in parts:
        result["wall"] = bench_wall(args)
    head = report(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"raw": result, "headline": head}, indent=1))


if __name__ == "__main__":
    main()
