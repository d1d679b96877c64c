"""Named studies: every conf/experiment/NAME.yaml runs through the real CLI as
`bfexp -m +experiment=NAME`, its sweep comes from the YAML's hydra.sweeper.params,
and the claim its recipe (recipes/NAME/README.md) states holds in what the jobs report.

Most studies are throughput-only on modeled clusters (no rank starts), so a whole
sweep takes seconds; SMALL trims one that would not (one that trains), with
command-line values.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.cli_in_process import calls
from tests.conftest import REPO, run_bfexp

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
# Command-line sweep values that keep a study cheap here (each replaces the YAML's value for its key).
SMALL: dict[str, list[str]] = {
    # 20 of its 400 steps: still 16 virtual ranks, so its bytes per step are the full study's.
    "comm_efficient": ["steps=20", "log_every=10"],
    # Virtual ranks (the study's sweep), a 0.8 s budget of its 8; still 8 ranks and the 4x straggler.
    "async_stragglers": ["budget_s=0.8", "eval_every_s=0.1", "engine=threads", "scaling.reference_steps=2"],
    # 50 of its 300 steps (one DiLoCo round) on virtual ranks: still 8 ranks and the study's model, so its bytes
    # per step are the full study's.
    "lm_diloco": ["steps=50", "log_every=50", "eval_every=50", "dataset.eval_samples=8", "engine=threads",
                  "scaling.reference_steps=2"],
    # 4 and 16 of its 16-1024 ranks, 60 of its 200 steps and a target they reach: every method and bandwidth.
    "crossover": ["ranks=4,16", "steps=60", "eval_every=10", "log_every=10", "target_accuracy=0.7"],
}


@dataclass
class Sweep:
    """One finished `bfexp -m` run: the process, its folder and every job's summary."""

    stdout: str
    stderr: str
    returncode: int
    folder: Path
    summaries: list[dict]


def sweep_args(name: str, *overrides: str) -> list[str]:
    return ["-m", f"+experiment={name}", *overrides, "hydra.sweep.dir=sweep"]


def sweep_of(folder: Path, code: int, stdout: str, stderr: str) -> Sweep:
    summaries = [json.loads(p.read_text()) for p in sorted((folder / "sweep").glob("*/summary.json"))]
    return Sweep(stdout, stderr, code, folder / "sweep", summaries)


def run_sweep(cwd: Path, name: str, *overrides: str) -> Sweep:
    proc = run_bfexp(sweep_args(name, *overrides), cwd, timeout=600)
    return sweep_of(cwd, proc.returncode, proc.stdout, proc.stderr)


# Every study make test runs (as SMALL trims it), and the allreduce jobs of
# test_resnet50_scaling_baseline_columns_are_the_allreduce_jobs: one interpreter for them all
# (tests/cli_in_process.py), one after another, each in a folder of its own.
RESNET50_ALLREDUCE = ("algorithm=allreduce", "topology=exp2", "ranks=8,16,128", "batch_size=32", "report=false")


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """Each study run once (as SMALL trims it) and shared by the tests that read it; a study no case lists (a
    ``large`` one) runs alone when a test asks for it."""
    root = tmp_path_factory.mktemp("studies")
    cases = [{"id": name, "folder": str(root / name), "args": sweep_args(name, *SMALL.get(name, []))}
             for name in EXPERIMENTS if name not in LARGE and name not in ELSEWHERE]
    cases.append({"id": "resnet50_allreduce", "folder": str(root / "resnet50_allreduce"),
                  "args": sweep_args("resnet50_scaling", *RESNET50_ALLREDUCE)})
    got = calls(cases, timeout=1200)
    done = {c["id"]: sweep_of(Path(c["folder"]), got[c["id"]]["code"], got[c["id"]]["stdout"],
                              got[c["id"]]["stderr"] + (got[c["id"]]["escaped"] or "")) for c in cases}

    def get(name: str) -> Sweep:
        if name not in done:
            done[name] = run_sweep(tmp_path_factory.mktemp(name), name, *SMALL.get(name, []))
        return done[name]

    return get


def grid_size(name: str) -> int:
    """Jobs the study's sweep should make: the product of its swept values' counts,
    worked out from the YAML (and SMALL) here, not by Hydra."""
    params = dict(OmegaConf.load(REPO / "conf" / "experiment" / f"{name}.yaml").hydra.sweeper.params)
    for override in SMALL.get(name, []):
        key, _, value = override.partition("=")
        params[key] = value
    return math.prod(len(str(v).split(",")) for v in params.values())


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_study_has_a_recipe_and_a_sweep():
    assert EXPERIMENTS, "conf/experiment/ holds no study"
    for name in EXPERIMENTS:
        text = (REPO / "conf" / "experiment" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_\n"), name
        assert grid_size(name) > 1, f"{name}: no hydra.sweeper.params sweep"
        assert (REPO / "recipes" / name / "README.md").is_file(), f"{name}: no recipes/{name}/README.md"
        assert f"bfexp -m +experiment={name}" in (REPO / "recipes" / "README.md").read_text(), name


# Studies whose SMALL form still costs more CPU than make test's budget allows (.ci/run runs them).
LARGE = {"lm_diloco"}  # 3 jobs of 8 ranks on a transformer: 17 s of CPU even at 50 steps
# Studies on the emulated cluster: their own test runs them small where it is up.
ELSEWHERE = {"bandwidth_study": "on the emulated cluster: tests/test_bandwidth_study.py runs it small"}


def study_param(name: str) -> Any:
    if name in ELSEWHERE:
        return pytest.param(name, marks=pytest.mark.skip(reason=ELSEWHERE[name]))
    return pytest.param(name, marks=pytest.mark.large) if name in LARGE else name


@pytest.mark.parametrize("name", [study_param(n) for n in EXPERIMENTS])
def test_study_runs_every_job_of_its_sweep(studies, name):
    """One command runs the whole grid; every job completes; the report lands in the sweep folder."""
    sweep = studies(name)
    assert sweep.returncode == 0, sweep.stderr[-3000:] + sweep.stdout[-2000:]
    assert len(sweep.summaries) == grid_size(name)
    assert [s["status"] for s in sweep.summaries] == ["completed"] * len(sweep.summaries)
    rows = read_csv(sweep.folder / "report.csv")
    assert len(rows) == len(sweep.summaries) and {r["status"] for r in rows} == {"completed"}
    assert (sweep.folder / "report.md").is_file()


# ------------------------------------------------------------------ resnet50_scaling
def by_point(summaries: list[dict]) -> dict[tuple[int, int, str], dict]:
    """Summaries keyed by (batch per rank, ranks, topology)."""
    return {(s["batch_size"], s["ranks"], s["topology"]): s for s in summaries}


def test_resnet50_scaling_claim(studies):
    """recipes/resnet50_scaling: on machines sharing one 25 Gb/s card, DSGD over inner-outer
    exp2 beats allreduce 1.45-1.84x from 16 to 128 GPUs, its lead grows with ranks and with
    smaller batches, and one-peer exp2 (machine-blind) loses to allreduce."""
    sweep = studies("resnet50_scaling")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    points = by_point(sweep.summaries)
    batches = sorted({b for b, _, _ in points})
    ranks = sorted({r for _, r, _ in points})
    assert batches == [32, 64] and ranks[0] >= 16 and len(ranks) >= 2
    for s in sweep.summaries:
        assert s["algorithm"] == "dsgd" and s["model"] == "resnet50" and s["time_source"] == "modeled"
    for batch in batches:
        inner_outer = [points[batch, n, "inner_outer_exp2"]["speedup_vs_baseline"] for n in ranks]
        one_peer = [points[batch, n, "one_peer_exp2"]["speedup_vs_baseline"] for n in ranks]
        assert all(1.4 <= x < 1.9 for x in inner_outer), (batch, inner_outer)
        assert all(x < 0.6 for x in one_peer), (batch, one_peer)
        assert inner_outer == sorted(inner_outer) and len(set(inner_outer)) == len(ranks), inner_outer
        for n in ranks:
            io, op = points[batch, n, "inner_outer_exp2"], points[batch, n, "one_peer_exp2"]
            assert io["throughput_samples_per_s"] > io["baseline_throughput_samples_per_s"] > op["throughput_samples_per_s"]
            # at batch 64 the 36 ms backward hides 3 of the 33 ms exchange's 4 buckets: the last one's 8 ms shows
            if batch == 64:
                assert io["scaling_efficiency"] == pytest.approx(53.3 / (53.3 + 33.3 / 4), rel=0.01)
            else:
                assert io["scaling_efficiency"] < 0.7
            # allreduce's efficiency barely moves with n: 0.54-0.6 at batch 64, 0.31-0.35 at 32
            assert (0.5 if batch == 64 else 0.3) < io["baseline_scaling_efficiency"] < (0.65 if batch == 64 else 0.4)
    for n in ranks:  # smaller batches: communication matters more, decentralized exchange pays more
        assert points[32, n, "inner_outer_exp2"]["speedup_vs_baseline"] > points[64, n, "inner_outer_exp2"]["speedup_vs_baseline"]


def readme_table(path: Path) -> dict[tuple[int, int], list[str]]:
    """The recipe's predicted table: (batch, ranks) -> its cells (allreduce, one-peer, inner-outer)."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit() and cells[1].isdigit():
            rows[int(cells[0]), int(cells[1])] = cells[2:]
    return rows


def numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", cell)]


def test_resnet50_scaling_readme_states_what_the_study_prints(studies):
    """The recipe's table is the study's output: each cell within its printed rounding."""
    sweep = studies("resnet50_scaling")
    points = by_point(sweep.summaries)
    table = readme_table(REPO / "recipes" / "resnet50_scaling" / "README.md")
    compared = 0
    for (batch, n), (allreduce, one_peer, inner_outer) in table.items():
        if (batch, n, "inner_outer_exp2") not in points:
            continue  # rows the default sweep does not run (one machine)
        s = points[batch, n, "one_peer_exp2"]
        tput, eff = numbers(allreduce)
        assert tput == pytest.approx(s["baseline_throughput_samples_per_s"], abs=1)
        assert eff == pytest.approx(s["baseline_scaling_efficiency"], abs=0.005)
        for cell, topology in ((one_peer, "one_peer_exp2"), (inner_outer, "inner_outer_exp2")):
            s = points[batch, n, topology]
            tput, eff, speedup = numbers(cell)
            assert tput == pytest.approx(s["throughput_samples_per_s"], abs=1), (batch, n, topology)
            assert eff == pytest.approx(s["scaling_efficiency"], abs=0.005), (batch, n, topology)
            assert speedup == pytest.approx(s["speedup_vs_baseline"], abs=0.005), (batch, n, topology)
        compared += 1
    assert compared == len({(b, n) for b, n, _ in points})


def test_resnet50_scaling_baseline_columns_are_the_allreduce_jobs(studies):
    """The study runs no allreduce jobs: every DSGD job carries allreduce's figures at its
    ranks and batch. Running allreduce itself (the same experiment, algorithm and topology
    replaced on the command line) gives those same figures, and the one-machine point too."""
    points = by_point(studies("resnet50_scaling").summaries)
    sweep = studies("resnet50_allreduce")  # resnet50_scaling with RESNET50_ALLREDUCE's values
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert sorted(s["ranks"] for s in sweep.summaries) == [8, 16, 128]
    for s in sweep.summaries:
        assert s["status"] == "completed" and s["algorithm"] == "allreduce"
        assert s["speedup_vs_baseline"] == pytest.approx(1.0)
        if s["ranks"] == 8:  # one machine: NVLink; the last of 4 buckets shows after backward
            assert 0.98 < s["scaling_efficiency"] < 1.0
            continue
        dsgd = points[32, s["ranks"], "inner_outer_exp2"]
        assert s["throughput_samples_per_s"] == pytest.approx(dsgd["baseline_throughput_samples_per_s"], rel=1e-9)
        assert s["scaling_efficiency"] == pytest.approx(dsgd["baseline_scaling_efficiency"], rel=1e-9)


# ------------------------------------------------------------------ comm_efficient
COMM_EFFICIENT = ("dsgd", "choco_sgd_top_k", "dsgd_pga10", "diloco_allreduce", "diloco_one_peer_exp2", "qg_dsgdm",
                  "allreduce")


def by_method(sweep: Sweep) -> dict[str, dict]:
    """Summaries keyed by the study's method (its +experiment/comm_efficient choice)."""
    out = {}
    for job in sorted(p for p in sweep.folder.iterdir() if (p / "summary.json").is_file()):
        method = re.search(r"\+experiment/comm_efficient=(\w+)", (job / ".hydra" / "overrides.yaml").read_text())
        out[method.group(1)] = json.loads((job / "summary.json").read_text())
    return out


def test_comm_efficient_bytes_claim(studies):
    """recipes/comm_efficient: bytes per step on 16 ranks as the engine counted them: CHOCO's top-k 1%
    sends 2% of DSGD's, DiLoCo a tenth of an allreduce (or of one model) per step, PGA every 10 steps
    (9 gossip + 1 allreduce) / 10, QG-DSGDm what DSGD sends."""
    jobs = by_method(studies("comm_efficient"))
    assert set(jobs) == set(COMM_EFFICIENT)
    for s in jobs.values():
        assert s["status"] == "completed" and s["ranks"] == 16 and s["model"] == "mlp" and s["dataset"] == "digits"
    sent = {m: s["bytes_sent_per_step"] for m, s in jobs.items()}
    model = 4810 * 4
    assert sent["dsgd"] == sent["qg_dsgdm"] == 4 * model  # exp2 over 16 ranks: 4 out-neighbors
    assert sent["allreduce"] == 2 * 15 * model // 16  # the ring's 2(n-1)/n of the gradient
    assert sent["choco_sgd_top_k"] == 4 * 49 * 8 <= 0.025 * sent["dsgd"]  # 49 float32 values + int32 indices
    assert sent["dsgd_pga10"] == (9 * sent["dsgd"] + sent["allreduce"]) / 10
    assert sent["diloco_allreduce"] == sent["allreduce"] / 10
    assert sent["diloco_one_peer_exp2"] == model / 10
    assert jobs["diloco_one_peer_exp2"]["topology_used"] == "one_peer_exp2"


def test_comm_efficient_readme_states_the_bytes_the_study_counts(studies):
    jobs = by_method(studies("comm_efficient"))
    rows = {}
    for line in (REPO / "recipes" / "comm_efficient" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].strip("`") in COMM_EFFICIENT:
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(COMM_EFFICIENT)
    for method, cells in rows.items():
        assert numbers(cells[4])[0] == pytest.approx(jobs[method]["bytes_sent_per_step"], abs=0.5), method
        assert numbers(cells[5])[0] == pytest.approx(
            jobs[method]["bytes_sent_per_step"] / jobs["dsgd"]["bytes_sent_per_step"], abs=0.0005), method


# ------------------------------------------------------------------ async_stragglers
ASYNC_STRAGGLERS = ("allreduce", "dsgd", "async_push_sum", "gossip", "ad_psgd")


def test_async_stragglers_claim(studies):
    """recipes/async_stragglers on virtual ranks under a 0.8 s budget: rank 0 computes 4 x 10 ms of simulated
    time per step. The synchronous methods run the straggler's 0.8 / 0.04 = 20 steps on every rank; the
    asynchronous ones run 0.8 / 0.01 = 80 on every other rank and 20 on the straggler, and reach the
    allreduce job's final accuracy in at most 0.75 of allreduce's time."""
    sweep = studies("async_stragglers")
    rows = {r["algorithm"]: r for r in read_csv(sweep.folder / "report.csv")}
    assert set(rows) == set(ASYNC_STRAGGLERS)
    for s in sweep.summaries:
        assert s["heterogeneity"]["slow_ranks"] == [0] and s["heterogeneity"]["factor"] == 4.0
        assert s["train_time_source"] == "simulated" and s["ended_by"] == "budget"
        assert s["train_time_s"] == pytest.approx(0.8, abs=1e-9), s["algorithm"]
        fast = 20 if s["algorithm"] in ("allreduce", "dsgd") else 80
        assert s["steps_per_rank"] == [20] + [fast] * 7, s["algorithm"]
    base = rows["allreduce"]
    assert float(base["target_accuracy"]) == pytest.approx(float(base["final_accuracy"]))
    allreduce_s = float(base["time_to_target_accuracy_s"])
    assert allreduce_s <= 0.8 + 1e-9
    for method in ("gossip", "async_push_sum"):
        assert float(rows[method]["time_to_target_accuracy_s"]) <= 0.75 * allreduce_s, method
    assert rows["dsgd"]["topology"] == rows["async_push_sum"]["topology"] == "one_peer_exp2"


# ------------------------------------------------------------------ lm_diloco
LM_DILOCO = ("allreduce", "dsgd_one_peer_exp2", "diloco")
# The study's GPT on the generated corpus's 39 characters, by hand: embeddings 39 x 32 + 32 x 32; one block
# (two layer norms 4 x 32, attention 32 x 96 + 96 and 32 x 32 + 32, MLP 32 x 128 + 128 and 128 x 32 + 32);
# the final norm 2 x 32; the output layer is the token embedding.
LM_PARAMETERS = 39 * 32 + 32 * 32 + (4 * 32 + 32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32) + 2 * 32


def lm_jobs(sweep: Sweep) -> dict[str, dict]:
    out = {}
    for job in sorted(p for p in sweep.folder.iterdir() if (p / "summary.json").is_file()):
        method = re.search(r"\+experiment/lm_diloco=(\w+)", (job / ".hydra" / "overrides.yaml").read_text())
        out[method.group(1)] = json.loads((job / "summary.json").read_text())
    return out


@pytest.mark.large
def test_lm_diloco_bytes_claim(studies):
    """recipes/lm_diloco: per rank and step, allreduce sends the ring's 2(n-1)/n of the 15,040 float32
    parameters, DSGD over one-peer exp2 one model, DiLoCo an allreduce every 50 steps; perplexity is reported."""
    jobs = lm_jobs(studies("lm_diloco"))
    assert set(jobs) == set(LM_DILOCO)
    model = LM_PARAMETERS * 4
    sent = {m: s["bytes_sent_per_step"] for m, s in jobs.items()}
    assert sent["allreduce"] == 2 * 7 * model / 8
    assert sent["dsgd_one_peer_exp2"] == model
    assert sent["diloco"] == sent["allreduce"] / 50
    for s in jobs.values():
        assert s["ranks"] == 8 and s["model"] == "gpt" and s["dataset"] == "text"
        assert s["final_perplexity"] == pytest.approx(math.exp(s["final_eval_loss"]))


@pytest.mark.large
def test_lm_diloco_readme_states_the_bytes_the_study_counts(studies):
    jobs = lm_jobs(studies("lm_diloco"))
    rows = {}
    for line in (REPO / "recipes" / "lm_diloco" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].strip("`") in LM_DILOCO:
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(LM_DILOCO)
    for method, cells in rows.items():
        assert numbers(cells[3])[0] == pytest.approx(jobs[method]["bytes_sent_per_step"], abs=0.5), method


@pytest.mark.large
def test_lm_diloco_readme_states_the_perplexities_of_the_full_study(tmp_path):
    """The whole study (300 steps, engine=auto): the README's perplexities are what it prints, to 1%."""
    jobs = lm_jobs(run_sweep(tmp_path, "lm_diloco"))
    for line in (REPO / "recipes" / "lm_diloco" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].strip("`") in LM_DILOCO:
            assert numbers(cells[2])[0] == pytest.approx(jobs[cells[0].strip("`")]["final_perplexity"], rel=0.01)


# ------------------------------------------------------------------ crossover
def test_crossover_names_in_each_cell_the_method_first_to_the_target(studies):
    """crossover.csv: a cell per bandwidth (the YAML's five) and rank count, its winner the method with the least
    modeled time to the target among the times it lists, the margin the runner-up's over the winner's; each
    method's time to the target does not grow with bandwidth (the same steps, each exchange cheaper), and
    report.csv's column for the cell's cluster holds the same times."""
    sweep = studies("crossover")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    cells = read_csv(sweep.folder / "crossover.csv")
    rates = [1, 3, 10, 30, 100]
    assert sorted({(float(c["bandwidth_gbit_per_s"]), int(c["ranks"])) for c in cells}) == \
        sorted((float(b), r) for b in rates for r in (4, 16))
    rows = read_csv(sweep.folder / "report.csv")
    methods = sorted(r["experiment/crossover"] for r in rows if r["ranks"] == "4")
    assert methods == ["allreduce", "choco_sgd", "diloco", "dsgd_exp2", "dsgd_one_peer_exp2"]
    winners = set()
    for c in cells:
        times = {m: float(c[f"time_to_target_s[{m}]"]) for m in methods if c[f"time_to_target_s[{m}]"]}
        label = f"ethernet_10g:{float(c['bandwidth_gbit_per_s']):g}Gbit/s"
        for m, t in times.items():
            [row] = [r for r in rows if r["experiment/crossover"] == m and r["ranks"] == c["ranks"]]
            assert float(row[f"time_to_target_accuracy_s@{label}"]) == pytest.approx(t, rel=1e-3)
        ranked = sorted(times, key=times.get)
        assert ranked and c["first"] == ranked[0], c
        winners.add(c["first"])
        if len(ranked) > 1:
            assert float(c["runner_up_time_over_first"]) == pytest.approx(times[ranked[1]] / times[ranked[0]], rel=1e-3)
    for r in (4, 16):
        for m in methods:
            along = [c[f"time_to_target_s[{m}]"] for b in rates for c in cells
                     if float(c["bandwidth_gbit_per_s"]) == b and int(c["ranks"]) == r]
            if all(along):
                assert all(float(a) >= float(b) for a, b in zip(along, along[1:])), (m, r, along)
    assert (sweep.folder / "crossover_ethernet_10g.png").is_file() and winners
