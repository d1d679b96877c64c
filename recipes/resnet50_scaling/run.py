"""Run the ResNet-50 scaling study (study.yaml) and print its predictions.

    python recipes/resnet50_scaling/run.py [--out DIR]

Each sweep of study.yaml is one `bfexp -m` multirun into DIR/<sweep>/
(throughput-only, so no rank starts and the whole study takes seconds);
the table of modeled throughput, scaling efficiency and speedup over the
allreduce baseline is printed and written to DIR/predictions.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def run_study(out: Path) -> list[dict]:
    study = yaml.safe_load((HERE / "study.yaml").read_text())
    summaries = []
    for name, overrides in study["sweeps"].items():
        folder = out / name
        command = [sys.executable, "-m", "bfexp.cli", "-m", *study["common"], *overrides, f"hydra.sweep.dir={folder}"]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"sweep {name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        for path in sorted(folder.glob("*/summary.json")):
            summary = json.loads(path.read_text())
            summary["sweep"] = name
            summaries.append(summary)
    return summaries


def table(summaries: list[dict]) -> str:
    """One row per (batch, ranks); per sweep: throughput, efficiency, speedup vs allreduce."""
    sweeps = list(dict.fromkeys(s["sweep"] for s in summaries))
    cells = {(s["batch_size"], s["ranks"], s["sweep"]): s for s in summaries}
    header = "| batch | ranks | " + " | ".join(f"{w}: samples/s, efficiency, speedup" for w in sweeps) + " |"
    lines = [header, "|" + "---|" * (2 + len(sweeps))]
    for batch in sorted({s["batch_size"] for s in summaries}, reverse=True):
        for ranks in sorted({s["ranks"] for s in summaries}):
            row = [str(batch), str(ranks)]
            for w in sweeps:
                s = cells.get((batch, ranks, w))
                row.append("n/a" if s is None else
                           f"{s['throughput_samples_per_s']:,.0f}, {s['scaling_efficiency']:.2f}, {s['speedup_vs_baseline']:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("multirun") / f"resnet50_scaling_{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    args = p.parse_args()
    started = time.perf_counter()
    summaries = run_study(args.out)
    text = table(summaries)
    source = {s["time_source"] for s in summaries}
    note = (f"{len(summaries)} jobs, time_source={'/'.join(sorted(source))}, cluster v100_cluster, "
            f"{time.perf_counter() - started:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "predictions.md").write_text(f"{text}\n\n{note}\n")
    print(text)
    print(f"\n{note}; results in {args.out}")


if __name__ == "__main__":
    main()
