"""engine=stacked against engine=threads: whole jobs of the `bfexp` command, measured in one run.

    python scripts/bench_stacked.py [--parts default,cnn,scale,sweep] [--mnist-root DIR] [--scale-dataset synthetic]
                                    [--scale-partition shared]

Every figure is a job's wall time (the command's, start to exit) and the
peak memory of its process (``/usr/bin/time``'s maximum resident set), each
stacked job beside its engine=threads reference measured in the same run, so
load that comes and goes on a shared machine hits both sides of a ratio.
Read the ratios; the targets are issue 28's. Each ratio is printed twice: of
the commands' walls, and of the ranks' own walls (from the ranks' start to
the summary), which leave out the ~2 s of interpreter, torch and Hydra
start-up that both engines pay and that bounds a whole command's ratio:

* default: ``bfexp ranks=128 steps=200`` (dsgd on exp2, logistic regression on
  synthetic data) on threads and on stacked.           threads / stacked >= 50
* cnn: ``model=cnn dataset=mnist ranks=128`` (steps 200; needs --mnist-root,
  a folder with MNIST's files: nothing is downloaded), threads and stacked.
                                                        threads / stacked >= 3
* scale: ``engine=stacked ranks=4096 model=mlp steps=200``: wall and peak
  memory.                                     wall <= 120 s, memory <= 8 GiB
  (--scale-dataset picks the data, synthetic by default; dataset=digits holds
  1438 training samples, so 4096 ranks of it run only with
  dataset.partition=shared, every rank drawing from the whole set:
  --scale-dataset digits --scale-partition shared.)
* sweep: ``bfexp algorithm=exact_diffusion topology=exp2 -m
  ranks=8,32,128,1024`` (engine=auto: 1024 ranks run stacked) against
  ``engine=threads ranks=128`` of the same study alone.   sweep / alone <= 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"default": 50.0, "cnn": 3.0, "scale_wall_s": 120.0, "scale_gib": 8.0, "sweep": 1.0}


def job(args: list[str], folder: Path) -> dict:
    """One `bfexp ARGS` run: its wall seconds, peak memory (GiB), exit code, and (a single job) its ranks'
    own wall seconds, from the start of its ranks to its summary (summary.json's wall_time_s: the command's
    wall less python's, torch's and Hydra's start and the driver's checks, which every engine pays alike)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    stats = folder / "time.txt"
    command = ["/usr/bin/time", "-f", "%M", "-o", str(stats), sys.executable, "-m", "bfexp.cli", *args]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
    kib = int(stats.read_text().strip().splitlines()[-1]) if stats.exists() else 0
    summary = folder / "run" / "summary.json"
    ranks = json.loads(summary.read_text()).get("wall_time_s") if summary.exists() else None
    return {"wall_s": wall, "gib": kib / 2**20, "code": done.returncode, "ranks_wall_s": ranks}


def show(name: str, figures: dict) -> None:
    ranks = f"   ranks {figures['ranks_wall_s']:8.2f} s" if figures.get("ranks_wall_s") is not None else ""
    print(f"{name:<34} wall {figures['wall_s']:8.2f} s{ranks}   peak {figures['gib']:6.2f} GiB   "
          f"exit {figures['code']}", flush=True)


def ratio(name: str, value: float, target: float, higher: bool = True) -> dict:
    ok = value >= target if higher else value <= target
    print(f"  -> {name} = {value:.2f} (target {'>=' if higher else '<='} {target:g}): {'met' if ok else 'NOT met'}",
          flush=True)
    return {"value": value, "target": target, "met": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="default,cnn,scale,sweep")
    parser.add_argument("--mnist-root", default=None, help="a folder holding MNIST's files (cnn part)")
    parser.add_argument("--scale-dataset", default="synthetic")
    parser.add_argument("--scale-partition", default=None, help="dataset.partition of the scale part (shared: digits)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the figures here")
    opts = parser.parse_args()
    parts = opts.parts.split(",")
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_stacked_") as tmp:
        base = Path(tmp)

        def run(name: str, args: list[str]) -> dict:
            folder = base / name
            folder.mkdir(parents=True)
            figures = job(args + [f"hydra.run.dir={folder / 'run'}", f"hydra.sweep.dir={folder / 'sweep'}"], folder)
            show(name, figures)
            out[name] = figures
            return figures

        steps = f"steps={opts.steps}"
        if "default" in parts:  # stacked first, then threads: a ratio of two jobs run back to back
            s = run("default/stacked", ["engine=stacked", "ranks=128", steps])
            t = run("default/threads", ["engine=threads", "ranks=128", steps])
            out["default_ratio"] = ratio("threads / stacked, 128 ranks, command wall", t["wall_s"] / s["wall_s"],
                                         TARGETS["default"])
            out["default_ranks_ratio"] = ratio("threads / stacked, 128 ranks, ranks' wall",
                                               t["ranks_wall_s"] / s["ranks_wall_s"], TARGETS["default"])
        if "cnn" in parts:
            if not opts.mnist_root:
                print("cnn: skipped (give --mnist-root, a folder with MNIST's files)", flush=True)
            else:
                mnist = ["model=cnn", "dataset=mnist", f"dataset.root={opts.mnist_root}", "ranks=128", steps]
                s = run("cnn/stacked", ["engine=stacked", *mnist])
                t = run("cnn/threads", ["engine=threads", *mnist])
                out["cnn_ratio"] = ratio("threads / stacked, cnn 128 ranks, command wall", t["wall_s"] / s["wall_s"],
                                         TARGETS["cnn"])
                out["cnn_ranks_ratio"] = ratio("threads / stacked, cnn 128 ranks, ranks' wall",
                                               t["ranks_wall_s"] / s["ranks_wall_s"], TARGETS["cnn"])
        if "scale" in parts:
            split = [f"dataset.partition={opts.scale_partition}"] if opts.scale_partition else []
            s = run("scale/stacked-4096", ["engine=stacked", "ranks=4096", "model=mlp", f"dataset={opts.scale_dataset}",
                                           *split, steps])
            out["scale_wall"] = ratio("wall of 4096 stacked ranks (s)", s["wall_s"], TARGETS["scale_wall_s"], higher=False)
            out["scale_memory"] = ratio("peak memory (GiB)", s["gib"], TARGETS["scale_gib"], higher=False)
        if "sweep" in parts:
            study = ["algorithm=exact_diffusion", "topology=exp2"]
            s = run("sweep/auto", [*study, "-m", "ranks=8,32,128,1024", steps])
            t = run("sweep/threads-128-alone", [*study, "engine=threads", "ranks=128", steps])
            out["sweep_ratio"] = ratio("sweep 8..1024 / threads 128 alone", s["wall_s"] / t["wall_s"], TARGETS["sweep"],
                                       higher=False)
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
