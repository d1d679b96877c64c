"""Scaling figures: definitions, intervals, the timing split, the single-rank reference and
its cache, the cluster configs, and whole jobs through the real CLI (ResNet-50's size:
tests/test_models.py)."""

import json
import math
import re
import statistics
import threading
from pathlib import Path

import pytest
import torch

from bfexp import probes, results, scaling
from bfexp.cli import group_options
from bfexp.scaling import Spread
from tests.cli_in_process import call, calls, ran

REPO = Path(__file__).resolve().parent.parent
FIGURES = (
    "throughput_samples_per_s", "scaling_efficiency", "baseline_throughput_samples_per_s",
    "baseline_scaling_efficiency", "speedup_vs_baseline", "comm_time_s", "compute_time_s",
    "wait_time_s", "step_time_s", "single_rank_throughput_samples_per_s",
)


def test_definitions():
    assert scaling.throughput(4, 32, 0.5) == 256.0
    assert scaling.efficiency(256.0, 4, 80.0) == 0.8
    assert scaling.speedup(256.0, 128.0) == 2.0
    assert scaling.throughput(4, 32, float("nan")) is None and scaling.speedup(None, 1.0) is None


def test_split_timing_by_hand():
    # rank 0 blocked least (0.01 s): that is the communication; the rest waited
    steps, blocked = [0.10, 0.12, 0.11], [0.01, 0.04, 0.02]
    got = scaling.split_timing(steps, blocked)
    assert got["comm_time_s"] == pytest.approx(0.01)
    assert got["compute_time_s"] == pytest.approx((0.09 + 0.08 + 0.09) / 3)
    assert got["wait_time_s"] == pytest.approx((0.0 + 0.03 + 0.01) / 3)
    assert got["step_time_s"] == pytest.approx(0.11)
    assert got["compute_time_s"] + got["comm_time_s"] + got["wait_time_s"] == pytest.approx(got["step_time_s"])


def test_a_rule_that_communicates_every_h_steps_is_timed_over_whole_cycles():
    # local SGD with H = 3: two quiet steps of 10 ms, then one of 40 ms that communicates (blocked 30 ms)
    steps = [0.01, 0.01, 0.04] * 4 + [0.01]
    blocked = [0.0, 0.0, 0.03] * 4 + [0.0]
    assert scaling.cycle_means(steps, 3) == pytest.approx([0.02] * 4)  # the trailing partial cycle is left out
    step, block = scaling.rank_timing(steps, blocked, cycle=3)[:2]
    assert step == pytest.approx(0.02) and block == pytest.approx(0.01)
    # a median of single steps would have said 10 ms and nothing blocked
    assert scaling.rank_timing(steps, blocked)[:2] == [0.01, 0.0]


def test_split_timing_intervals_by_hand():
    # two ranks: (median, low, high) of step and of blocked time
    got = scaling.split_timing([0.10, 0.12], [0.01, 0.03], [0.09, 0.11], [0.12, 0.15], [0.005, 0.02], [0.02, 0.04])
    assert got["step_time_s"] == pytest.approx(0.11)
    assert (got["step_time_s_low"], got["step_time_s_high"]) == pytest.approx((0.10, 0.135))
    assert (got["comm_time_s"], got["comm_time_s_low"], got["comm_time_s_high"]) == pytest.approx((0.01, 0.005, 0.02))
    # compute = mean(step - blocked) = 0.09; ends: mean(step_low - blocked_high), mean(step_high - blocked_low)
    assert got["compute_time_s"] == pytest.approx(0.09)
    assert (got["compute_time_s_low"], got["compute_time_s_high"]) == pytest.approx((0.07, 0.1225))
    # wait = mean(blocked) - comm = 0.01; ends: mean(blocked_low) - comm_high (at least 0), mean(blocked_high) - comm_low
    assert got["wait_time_s"] == pytest.approx(0.01)
    assert (got["wait_time_s_low"], got["wait_time_s_high"]) == pytest.approx((0.0, 0.025))


def test_order_statistic_interval_by_hand():
    # P(Binomial(10, 1/2) <= 1) = 11/1024: the 2nd smallest and 2nd largest of 10 hold the median with
    # 1 - 22/1024 = 97.9% >= 95%; the 3rd would give 1 - 2 * 56/1024 = 89% < 95%.
    assert scaling.order_interval(10) == 2
    assert scaling.order_interval(5) == 1  # 1 - 2/32 = 93.75%: nothing reaches 95%, the range it is
    # 20 samples: P(Bin(20, 1/2) <= 5) = 21700/1048576 -> 95.9% with the 6th; the 7th gives 88.5%
    assert scaling.order_interval(20) == 6


def test_spread_of_by_hand():
    assert scaling.spread_of([5.0]) == (5.0, 5.0, 5.0)
    assert scaling.spread_of([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # few samples: their range
    # 30 samples = 10 runs of 3; run 4 was disturbed (another process took the cores)
    runs = [[10.0 + i] * 3 for i in range(10)]
    runs[4] = [1000.0] * 3
    got = scaling.spread_of([x for run in runs for x in run])
    # run medians 10..13, 15..19 and 1000: the 2nd smallest (11) to the 2nd largest (19); the median of
    # all 30 is between the 15th (15) and 16th (16) values
    assert got == (15.5, 11.0, 19.0)
    assert all(math.isnan(v) for v in scaling.spread_of([float("nan")] * 2))  # no finite sample: no figure


def test_a_reference_keeps_its_step_times_distribution():
    assert scaling.order_statistics([0.3, 0.1, float("nan"), 0.2]) == [0.1, 0.2, 0.3]
    many = [i / 1000 for i in range(1000, 0, -1)]  # 0.001 .. 1.000, reversed
    kept = scaling.order_statistics(many, most=5)
    # the least, the greatest and three evenly spaced between (sorted positions 0, 250 (249.75), 500 (499.5), 749, 999)
    assert kept == [0.001, 0.251, 0.501, 0.75, 1.0]
    record = scaling.reference_figures([0.2, 0.1, 0.3], [0.05, 0.05, 0.05])
    assert record["step_times_s"] == [0.1, 0.2, 0.3]


def test_measured_figures_carry_intervals_by_hand():
    timing = {"step_time_s": 0.1, "step_time_s_low": 0.08, "step_time_s_high": 0.125}
    base = {"step_time_s": 0.2, "step_time_s_low": 0.16, "step_time_s_high": 0.25}
    got = scaling.measured_figures(2, 32, timing, Spread(0.05, 0.04, 0.0625), base, own_baseline=False,
                                   source="measured")
    # throughput = 2 x 32 / step: 640 from [512, 800]; single rank: 32 / 0.05 = 640 from [512, 800]
    assert (got["throughput_samples_per_s"], got["throughput_samples_per_s_low"],
            got["throughput_samples_per_s_high"]) == pytest.approx((640, 512, 800))
    # efficiency = 640 / (2 x 640); the ends take the widest combination: 512 / 1600 and 800 / 1024
    assert (got["scaling_efficiency"], got["scaling_efficiency_low"], got["scaling_efficiency_high"]) == \
        pytest.approx((0.5, 0.32, 0.78125))
    # speedup = 640 / 320 from [512 / 400, 800 / 256]
    assert (got["speedup_vs_baseline"], got["speedup_vs_baseline_low"], got["speedup_vs_baseline_high"]) == \
        pytest.approx((2.0, 1.28, 3.125))
    own = scaling.measured_figures(2, 32, timing, Spread(0.05, 0.04, 0.0625), timing, own_baseline=True,
                                   source="measured")
    assert (own["speedup_vs_baseline"], own["speedup_vs_baseline_low"], own["speedup_vs_baseline_high"]) == (1, 1, 1)
    assert got["time_source"] == "measured"


def test_within_noise():
    a = Spread(1.0, 0.9, 1.1)
    assert scaling.within_noise(a, Spread(1.15, 1.05, 1.3))  # 0.15 apart, spreads facing each other 0.1 + 0.1
    assert not scaling.within_noise(a, Spread(1.2, 1.12, 1.3))  # 0.2 apart, 0.1 + 0.08
    assert scaling.within_noise(Spread(0.93, 0.8, 1.02), Spread.exact(1.0))


def test_reference_threads_are_a_one_rank_jobs():
    """The reference runs with what a 1-rank job gets (every core), whatever the job's ranks."""
    assert scaling.reference_threads(None, 8) == 8 and scaling.reference_threads(2, 8) == 2
    assert scaling.load_moved(1.0, 2.5, 1.0) and not scaling.load_moved(1.0, 1.8, 1.0)
    assert scaling.load_moved(None, 1.0, 1.0)


def test_contention_note():
    assert scaling.contention_note(4, 2, on_cpu=True) and "4 ranks share 2 cores" in scaling.contention_note(4, 2, True)
    assert scaling.contention_note(2, 2, on_cpu=True) is None
    assert scaling.contention_note(8, 2, on_cpu=False) is None  # GPU ranks do not share cores for compute


def test_reference_cache_survives_concurrent_writers(tmp_path):
    key = {"model": {"_target_": "bfexp.models.LogReg"}, "batch_size": 32, "device": "cpu:test"}
    errors = []

    def writer(value):
        try:
            for _ in range(50):
                probes.store_reference(tmp_path, key, {"step_time_s": value})
                got = probes.load_reference(tmp_path, key)
                assert got is not None and got["step_time_s"] in (0.001, 0.002)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in (0.001, 0.002)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(list(tmp_path.glob("*.json"))) == 1 and not list(tmp_path.glob(".*.tmp"))
    assert probes.load_reference(tmp_path, {**key, "batch_size": 64}) is None
    assert probes.cache_dir(None) is None and probes.cache_dir(str(tmp_path)) == tmp_path


def one_rank_reference(directory, policy="cached", margin=1.0, rounds=4, steps=10, own_steps=False):
    """A SingleRankReference of a small linear model on a real 1-rank engine (virtual ranks)."""
    from bfexp.algorithms import DSGD
    from bfexp.comm.threads import ThreadsEngine, ThreadWorld
    from bfexp.topology import FullyConnected
    from bfexp.worker import train_step

    engine = ThreadsEngine(ThreadWorld(1), 0)
    g = torch.Generator().manual_seed(0)

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 3)

    def alone():
        net = model()
        return net, DSGD(torch.optim.SGD(net.parameters(), lr=0.1), engine, FullyConnected(1), model=net)

    def plain():
        net = model()
        return net, torch.optim.SGD(net.parameters(), lr=0.1)

    key = probes.reference_key(model={"_target_": "Linear"}, optimizer={"lr": 0.1}, wrapper={"_target_": "DSGD"},
                               sample_shape=(8,), classes=3, batch=4, dtype="float32", device="cpu:test", threads=1)
    return probes.SingleRankReference(
        engine, train_step, alone=alone, plain=plain,
        next_batch=lambda: (torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)),
        key=key, directory=directory, policy=policy, margin=margin, rounds=rounds, threads=torch.get_num_threads() if own_steps else 1,
        steps=steps, first=2, own_steps=own_steps)


def test_reference_rounds_go_between_training_steps_and_are_cached(tmp_path):
    ref = one_rank_reference(tmp_path)
    ref.start()
    assert ref.measuring  # nothing cached yet
    for step in range(1, 11):
        ref.after_step(step)
    # every round went between steps 2..10, none was left for finish
    assert ref.taken.count("wrapper") == ref.taken.count("plain") == 4 and not ref.schedule
    first = ref.finish()
    assert len(ref.samples["wrapper"]) == len(ref.samples["plain"]) == 4 and first["ranks"] == [0]
    assert first["source"] == "measured" and first["refreshed"] is None and first["rounds"] == 4
    assert first["step_time_s_low"] <= first["step_time_s"] <= first["step_time_s_high"]
    assert first["framework_overhead_fraction_low"] <= first["framework_overhead_fraction"]
    assert Path(first["cache_file"]).is_file()

    # the same key at (nearly) the same load: the cache, which says when it was measured
    again = one_rank_reference(tmp_path, margin=1e6)
    again.start()
    assert not again.measuring
    cached = again.finish()
    assert cached["source"] == "cache" and cached["measured_at"] == first["measured_at"]
    assert cached["step_time_s"] == first["step_time_s"]

    # asked for: measured again
    fresh = one_rank_reference(tmp_path, policy="fresh", steps=0)  # no training steps: all rounds in finish
    fresh.start()
    record = fresh.finish()
    assert record["source"] == "measured" and record["refreshed"] == "scaling.reference=fresh" and record["rounds"] == 4


def test_a_one_rank_job_is_its_own_reference(tmp_path):
    """own_steps: the job's timed steps are the wrapper's samples (the reference step time is their
    median); rounds time plain steps only, each paired with the training step it followed."""
    ref = one_rank_reference(tmp_path, rounds=3, steps=10, own_steps=True)
    ref.start()
    assert ref.measuring and sorted(w for turn in ref.schedule.values() for w in turn) == ["plain"] * 3
    job_steps = {step: 0.001 * step for step in range(1, 11)}  # the training steps' times, made up
    after = [step for step in range(1, 11) if ref.schedule.get(step)]
    for step in range(1, 11):
        ref.after_step(step, job_steps[step])
    assert ref.samples["wrapper"] == [job_steps[s] for s in after] and ref.taken == ["plain"] * 3
    own = [job_steps[s] for s in range(2, 11)]
    record = ref.finish(own)
    assert len(ref.samples["plain"]) == 3
    assert record["wrapper_steps"] == "the job's own training steps" and record["steps"] == 9 and record["rounds"] == 3
    assert record["step_time_s"] == statistics.median(own)
    overhead = statistics.median(w / p - 1 for w, p in zip(ref.samples["wrapper"], ref.samples["plain"]))
    assert record["framework_overhead_fraction"] == pytest.approx(overhead, rel=1e-12)
    assert record["plain_step_time_s"] == statistics.median(ref.samples["plain"])

    # a run that timed fewer steps than rounds after all (stopped early): the wrapper is timed in rounds,
    # as for a larger job
    short = one_rank_reference(tmp_path, policy="fresh", rounds=2, steps=10, own_steps=True)
    short.start()
    record = short.finish([0.001])
    assert record["wrapper_steps"] == "timed rounds" and len(short.samples["wrapper"]) == len(short.samples["plain"]) == 2

    # a job whose timed steps are fewer than the rounds asked for (steps 2..10: 9 < 12) times rounds from the start
    few = one_rank_reference(tmp_path, policy="fresh", rounds=12, steps=10, own_steps=True)
    few.start()
    assert not few.own and "wrapper" in [w for turn in few.schedule.values() for w in turn]
    for step in range(1, 11):
        few.after_step(step, 0.001)
    record = few.finish([0.001] * 9)
    assert record["wrapper_steps"] == "timed rounds" and record["rounds"] == 12 and 0.001 not in few.samples["wrapper"]


def test_reference_cached_at_another_load_is_measured_again(tmp_path):
    ref = one_rank_reference(tmp_path)
    ref.start()
    path = Path(ref.finish()["cache_file"])
    entry = json.loads(path.read_text())
    busier = probes.load_average() + 50.0
    path.write_text(json.dumps({**entry, "load_average_1min": busier}))  # taken on a much busier machine
    again = one_rank_reference(tmp_path, margin=1.0, steps=0)
    again.start()
    assert again.measuring
    record = again.finish()
    assert record["source"] == "measured"
    assert f"taken at load {busier:.2f}" in record["refreshed"] and "scaling.reference_load_margin=1" in record["refreshed"]
    assert abs(json.loads(path.read_text())["load_average_1min"] - busier) > 40  # the cache holds the new one


def test_every_declared_cluster_figure_cites_a_source():
    """Each number a scaling config declares is preceded by a comment saying where it comes from."""
    for option in group_options("scaling"):
        lines = (REPO / "conf" / "scaling" / f"{option}.yaml").read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^\s*[a-z_0-9]+:\s*[-+.0-9]", line):
                above = lines[i - 1].strip() if i else ""
                assert above.startswith("#"), f"{option}.yaml: '{line.strip()}' has no source comment above it"



# The jobs of this module whose subject is not process ranks (throughput-only jobs that start no rank, and jobs on
# virtual ranks), each in a folder of its own, run once in ONE interpreter (tests/cli_in_process.py) and read by the
# tests below; the jobs whose subject is process ranks (engine=mpi) run as the tests' own `bfexp` processes.
IN_PROCESS: dict[str, list[str]] = {
    "v100": ["-m", "throughput_only=true", "scaling=v100_cluster", "model=resnet50", "ranks=128",
             "engine.ranks_per_machine=8", "batch_size=64", "algorithm=allreduce,dsgd", "topology=inner_outer_exp2",
             "report=false", "hydra.sweep.dir=tp"],
    "ends": ["throughput_only=true", "scaling=v100_cluster", "model=resnet50", "ranks=128",
             "engine.ranks_per_machine=8", "batch_size=64", "algorithm=allreduce",
             "+scaling.calibration_ends.fast.inter_latency_s=1e-5", "+scaling.calibration_ends.fast.reduce_gbyte_per_s=600",
             "+scaling.calibration_ends.slow.inter_latency_s=1e-4", "report=false", "hydra.run.dir=run"],
    "flop": ["throughput_only=true", "scaling=v100_cluster", "model=mlp", "ranks=16", "hydra.run.dir=run"],
    "virtual": ["engine=threads", "ranks=4", "steps=10", "log_every=5", "baseline_steps=3",
                "scaling.reference_cache={folder}/cache", "hydra.run.dir=run"],
    # the same reference twice (the second from the cache the first wrote): straggler_wait on, then off
    "straggler_on": ["engine=threads", "ranks=4", "steps=10", "log_every=5", "baseline_steps=3",
                     "scaling.reference_steps=8", "scaling.reference_cache={root}/straggler_cache",
                     "scaling.straggler_wait=true", "hydra.run.dir=on"],
    "straggler_off": ["engine=threads", "ranks=4", "steps=10", "log_every=5", "baseline_steps=3",
                      "scaling.reference_steps=8", "scaling.reference_cache={root}/straggler_cache",
                      "scaling.reference_load_margin=1000", "hydra.run.dir=off"],
    "rounds_threads": ["model=mlp", "dataset=digits", "ranks=3", "steps=20", "scaling.reference=fresh",
                       "scaling.reference_steps=7", "scaling.reference_cache={folder}/cache", "engine=threads",
                       "hydra.run.dir=threads"],
    # the first of test_a_reference_cached_at_another_load_is_measured_again's two jobs: it fills the cache
    "load_first": ["model=mlp", "dataset=digits", "ranks=2", "steps=20", "scaling.reference_cache={folder}/cache",
                   "engine=threads", "hydra.run.dir=first"],
    "one_rank": ["-m", "algorithm=allreduce,dsgd", "seed=0,1,2", "ranks=1", "engine=threads", "report=false",
                 "hydra.sweep.dir=sweep"],
}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """{name: (its folder, what `calls` gave)} for IN_PROCESS's jobs; $BFEXP_CACHE_DIR a folder of their own."""
    root = tmp_path_factory.mktemp("in_process")
    cases = [{"id": name, "folder": str(root / name), "args": [a.format(folder=root / name, root=root) for a in args]}
             for name, args in IN_PROCESS.items()]
    import os

    got = calls(cases, timeout=900, env={**os.environ, "BFEXP_CACHE_DIR": str(root / "cache")})
    return {name: (root / name, got[name]) for name in IN_PROCESS}


def finished(in_process, name):
    """The folder of IN_PROCESS's job NAME, which exited 0."""
    folder, got = in_process[name]
    ran(got)
    return folder, got


def load(path):
    return json.loads(Path(path).read_text())


def check_intervals(figures, keys=None):
    """Every figure with an interval has both ends, and they hold the point."""
    for key in keys or [k for k in results.INTERVALS if k in figures]:
        low, high = results.INTERVALS[key]
        point, lo, hi = figures[key], figures[low], figures[high]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in (point, lo, hi)), (key, point, lo, hi)
        assert lo <= point <= hi, (key, lo, point, hi)


def check_figures(summary):
    for key in FIGURES:
        assert isinstance(summary[key], (int, float)) and math.isfinite(summary[key]), (key, summary[key])
    check_intervals(summary, [k for k in FIGURES if k in results.INTERVALS])
    assert summary["speedup_vs_baseline"] == pytest.approx(
        summary["throughput_samples_per_s"] / summary["baseline_throughput_samples_per_s"], rel=1e-9)
    single = summary["single_rank_throughput_samples_per_s"]
    assert summary["scaling_efficiency"] == pytest.approx(
        summary["throughput_samples_per_s"] / (summary["ranks"] * single), rel=1e-9)
    assert summary["baseline_scaling_efficiency"] == pytest.approx(
        summary["baseline_throughput_samples_per_s"] / (summary["ranks"] * single), rel=1e-9)
    assert summary["throughput_samples_per_s"] == pytest.approx(
        summary["ranks"] * summary["batch_size"] / summary["step_time_s"], rel=1e-9)
    assert summary["compute_time_s"] + summary["comm_time_s"] + summary["wait_time_s"] == pytest.approx(
        summary["step_time_s"], rel=1e-6)


def test_scaling_sweep_on_the_default_experiment(bfexp, tmp_path):
    """ranks=1,2,4 on the default experiment: every job measures every figure with its interval,
    probes the baseline, models the same job on this machine, flags contention past the cores,
    and all three use ONE single-rank reference (its load margin is wide here: the load of this
    shared machine is not what this test is about)."""
    from bfexp.report import Plotter, collect, swept_keys

    proc = bfexp("-m", "ranks=1,2,4", "steps=20", "log_every=10", "baseline_steps=10",
                 "scaling.reference_cache=cache", "scaling.reference_load_margin=1000", "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    sweep = bfexp.cwd / "sweep"
    summaries = sorted((load(p) for p in sweep.glob("*/summary.json")), key=lambda s: s["ranks"])
    assert [s["ranks"] for s in summaries] == [1, 2, 4]
    cores = scaling.processor_count()
    for s in summaries:
        # ranks past the cores measure contention: their headline is the modeled figure, the measured beside it
        assert s["status"] == "completed" and s["time_source"] == ("modeled" if s["contention"] else "measured")
        assert s["scaling_efficiency"] == s[s["time_source"]]["scaling_efficiency"]
        check_figures(s)
        check_intervals(s)  # every headline figure, and the framework overhead
        check_intervals(s["measured"])
        check_intervals(s["modeled"])
        assert s["measured"]["time_source"] == "measured" and s["modeled"]["time_source"] == "modeled"
        assert s["measured"]["baseline_steps"] == 10
        check_figures({**s["modeled"], "ranks": s["ranks"], "batch_size": s["batch_size"]})
        assert s["modeled"]["parameters"] == 33 * 2  # logreg: 32 features + bias, 2 classes
        assert (s["contention"] is not None) == (s["ranks"] > cores)
        if s["contention"]:
            assert f"{s['ranks']} ranks share {cores} cores" in proc.stdout
    # Jobs that differ only in ranks use the same reference: measured once (with the threads a
    # 1-rank job gets), then read from the cache, and each summary says which.
    refs = [s["reference"] for s in summaries]
    assert [s["reference_source"] for s in summaries] == ["measured", "cache", "cache"]
    assert all(r["key"] == refs[0]["key"] and r["measured_at"] == refs[0]["measured_at"] for r in refs)
    assert len({r["step_time_s"] for r in refs}) == 1 and len({s["single_rank_throughput_samples_per_s"] for s in summaries}) == 1
    assert refs[0]["key"]["threads"] == cores and refs[0]["key"]["wrapper"]["_target_"].endswith("DSGD")
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1

    # report.csv: every figure with its interval, holding the point; the plot draws those intervals
    with open(sweep / "report.csv", newline="") as f:
        import csv

        rows = list(csv.DictReader(f))
    for row in rows:
        figures = {k: float(row[k]) for k in row if k in results.FIELD and row[k] not in ("", None)
                   and (k in results.INTERVALS or results.FIELD[k].bound_of)}
        check_intervals(figures, [k for k in results.INTERVALS if results.FIELD[k].headline])
    jobs = [job for job in collect(sweep) if job.ok]
    plotter = Plotter(tmp_path, jobs, swept_keys(jobs))
    plotter.efficiency_plot([1, 2, 4])
    ax = plotter.figures["scaling_efficiency.png"].axes[0]
    bars = [c for c in ax.containers if c.has_yerr and not str(c.get_label()).startswith("allreduce")]
    assert len(bars) == 1
    drawn = {round(seg[0][0]): (seg[0][1], seg[1][1]) for seg in bars[0].lines[2][0].get_segments()}
    expected = {int(r["ranks"]): (float(r["scaling_efficiency_low"]), float(r["scaling_efficiency_high"])) for r in rows}
    assert drawn.keys() == expected.keys()
    for ranks, (low, high) in expected.items():
        assert drawn[ranks] == pytest.approx((low, high), rel=1e-9)


@pytest.mark.parametrize("which", [
    "dsgd,allreduce",  # make test: a decentralized rule and the baseline
    pytest.param("every", marks=pytest.mark.large),  # .ci/run: all of them (45 jobs, a minute or two)
])
def test_one_rank_jobs_of_every_algorithm_score_one(bfexp, monkeypatch, tmp_path, which, request):
    """ranks=1 at the defaults: a 1-rank job is its own reference (its own training steps, same
    wrapper, same engine), so every algorithm scores 1 with its steps' interval, and its framework
    overhead is measured against plain torch steps timed between its own. Three repeats (seeds)."""
    monkeypatch.setenv("BFEXP_CACHE_DIR", str(tmp_path / "cache"))
    algorithms = sorted(group_options("algorithm")) if which == "every" else sorted(which.split(","))
    # One rank in the driver's process (virtual) for every wrapper that runs there, one MPI process for ddp
    # (torch.distributed needs one): the same step and the same 1-rank reference, without 36 process starts.
    # make test's pair is IN_PROCESS's "one_rank" sweep (this module's one interpreter for its jobs on virtual ranks)
    virtual = [a for a in algorithms if a != "ddp"]
    if which == "every":
        proc = bfexp("-m", f"algorithm={','.join(virtual)}", "seed=0,1,2", "ranks=1", "engine=threads",
                     "report=false", "hydra.sweep.dir=sweep", timeout=900)
        assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
        folder = bfexp.cwd
    else:
        assert IN_PROCESS["one_rank"][1] == f"algorithm={','.join(virtual)}"
        folder = finished(request.getfixturevalue("in_process"), "one_rank")[0]
    if "ddp" in algorithms:
        proc = bfexp("-m", "algorithm=ddp", "seed=0,1,2", "ranks=1", "engine=mpi", "report=false",
                     "hydra.sweep.dir=sweep_ddp", timeout=900)
        assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    by_algorithm: dict[str, list[float]] = {}
    for path in [*(folder / "sweep").glob("*/summary.json"), *(bfexp.cwd / "sweep_ddp").glob("*/summary.json")]:
        s = load(path)
        assert s["status"] == "completed" and s["ranks"] == 1
        assert s["measured"]["time_source"] == ("simulated" if s["engine"] == "threads" else "measured")
        check_intervals(s)
        # the measured figure (on virtual ranks the headline is the cost model's)
        by_algorithm.setdefault(s["algorithm"], []).append(s["measured"]["scaling_efficiency"])
        ref = s["reference"]
        assert ref["source"] == "measured" and ref["wrapper_steps"] == "the job's own training steps"
        assert ref["step_time_s"] == s["measured"]["step_time_s"] and ref["steps"] >= 100
        assert ref["rounds"] == 30 and ref["plain_step_time_s"] > 0
        assert ref["framework_overhead_fraction_low"] <= s["framework_overhead_fraction"] > -0.5
    assert sorted(by_algorithm) == algorithms and all(len(v) == 3 for v in by_algorithm.values())
    medians = {a: statistics.median(v) for a, v in by_algorithm.items()}
    assert all(0.9 <= m <= 1.1 for m in medians.values()), (medians, by_algorithm)


def test_a_reference_cached_at_another_load_is_measured_again(bfexp, in_process):
    """A cache entry written as if taken on a much busier machine: the next job measures its own
    reference, says why in summary.json, and replaces the entry (2 ranks: a 1-rank job would measure
    its own anyway). The entry comes from IN_PROCESS's "load_first", the same job on virtual ranks (a
    reference's key is the one-rank job's, whatever the engine); the job that reads it runs on processes."""
    first = finished(in_process, "load_first")[0]
    args = ("model=mlp", "dataset=digits", "ranks=2", "steps=20", f"scaling.reference_cache={first / 'cache'}")
    assert IN_PROCESS["load_first"][:4] == list(args[:4])
    assert load(first / "first" / "summary.json")["reference_source"] == "measured"
    [path] = (first / "cache").glob("*.json")
    entry = json.loads(path.read_text())
    busier = probes.load_average() + 50.0
    path.write_text(json.dumps({**entry, "load_average_1min": busier}))
    proc = bfexp(*args, "hydra.run.dir=second")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    s = load(bfexp.cwd / "second" / "summary.json")
    ref = s["reference"]
    assert s["reference_source"] == "measured" and ref["source"] == "measured"
    # round k ran on rank k mod 2 (each process's own speed), and rank 0 gathered all 30 rounds in order
    assert ref["ranks"] == [0, 1] and ref["rounds"] == 30 and len(ref["step_times_s"]) > 0
    assert f"taken at load {busier:.2f}" in ref["refreshed"] and ref["measured_at"] != entry["measured_at"]
    assert "single-rank reference measured in this job" in proc.stdout and "taken at load" in proc.stdout
    assert abs(json.loads(path.read_text())["load_average_1min"] - busier) > 40


def test_reference_rounds_run_on_every_process_in_turn(bfexp, tmp_path, in_process):
    """Round k of the single-rank reference runs on rank k mod n where ranks are processes (each
    process's speed comes in stretches of its own), gathered to rank 0 in order; virtual ranks share
    one process and rank 0 times every round."""
    args = ["model=mlp", "dataset=digits", "ranks=3", "steps=20", "scaling.reference=fresh",
            "scaling.reference_steps=7", f"scaling.reference_cache={tmp_path / 'cache'}"]
    assert IN_PROCESS["rounds_threads"][:6] == args[:6]  # the same job on virtual ranks, run in_process
    proc = bfexp(*args, "engine=mpi", "hydra.run.dir=mpi")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    threads = finished(in_process, "rounds_threads")[0]
    for folder, ranks in ((bfexp.cwd / "mpi", [0, 1, 2]), (threads / "threads", [0])):
        ref = load(folder / "summary.json")["reference"]
        assert ref["source"] == "measured" and ref["ranks"] == ranks and ref["rounds"] == 7
        assert len(ref["step_times_s"]) == 7 and ref["wrapper_steps"] == "timed rounds"


def test_throughput_only_resnet50_on_the_v100_cluster(in_process):
    """128 ranks, no rank started: the model's figures equal the alpha-beta formulas
    worked out here from the config's declared figures (IN_PROCESS's "v100" sweep)."""
    folder = finished(in_process, "v100")[0]
    by_algo = {s["algorithm"]: s for s in (load(p) for p in (folder / "tp").glob("*/summary.json"))}
    assert sorted(by_algo) == ["allreduce", "dsgd"]
    params, nbytes = 25_557_032, 25_557_032 * 4
    compute = 64 / 1200.0  # declared V100 samples/s
    backward = 0.667 * compute
    # flat ring over 128 ranks, 16 machines: each step paced by the 25 Gb/s card
    ring = 2 * 127 * (3e-5 + nbytes / 128 / 3.125e9) + (127 / 128) * nbytes / 300e9
    # inner-outer: one model per machine crosses each card; every rank combines 2 vectors
    inner_outer = 3e-5 + nbytes / 3.125e9 + 2 * nbytes / 300e9
    for algo, exchange in (("allreduce", ring), ("dsgd", inner_outer)):
        s = by_algo[algo]
        assert s["status"] == "completed" and s["time_source"] == "modeled" and s["measured"] is None
        m = s["modeled"]
        assert m["parameters"] == params and m["machines"] == 16 and m["compute_source"] == "declared"
        assert m["exchange_time_s"] == pytest.approx(exchange, rel=1e-9)
        # both rules send from backward hooks in 25 MiB buckets: 4 for 102 MB; the last waits for backward's end
        buckets = math.ceil(nbytes / (25 * 2**20))
        assert buckets == 4
        exposed = max(exchange / buckets, exchange - backward * (buckets - 1) / buckets)
        assert s["step_time_s"] == pytest.approx(compute + exposed, rel=1e-9)
        check_figures(s)
    assert by_algo["allreduce"]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert by_algo["dsgd"]["speedup_vs_baseline"] > 1.0


def test_the_modeled_interval_spans_the_model_at_its_calibrations_ends(in_process):
    """scaling.calibration_ends: the model priced at each end's figures too; with a declared (exact) speed the
    interval is theirs alone, worked out here from the alpha-beta formula at each end (IN_PROCESS's "ends": fast
    inter_latency_s=1e-5 and reduce_gbyte_per_s=600, slow inter_latency_s=1e-4)."""
    s = load(finished(in_process, "ends")[0] / "run" / "summary.json")
    nbytes, compute = 25_557_032 * 4, 64 / 1200.0
    backward, buckets = 0.667 * compute, 4

    def step(latency, reduce_bytes_per_s):
        ring = 2 * 127 * (latency + nbytes / 128 / 3.125e9) + (127 / 128) * nbytes / reduce_bytes_per_s
        return compute + max(ring / buckets, ring - backward * (buckets - 1) / buckets)

    point, fast, slow = step(3e-5, 300e9), step(1e-5, 600e9), step(1e-4, 300e9)
    assert (s["step_time_s"], s["step_time_s_low"], s["step_time_s_high"]) == (
        pytest.approx(point, rel=1e-9), pytest.approx(fast, rel=1e-9), pytest.approx(slow, rel=1e-9))
    # efficiency against the declared speed: compute / step, the slow end's the low one
    assert (s["scaling_efficiency_low"], s["scaling_efficiency_high"]) == (
        pytest.approx(compute / slow, rel=1e-9), pytest.approx(compute / fast, rel=1e-9))
    check_figures(s)


def test_a_model_no_cluster_lists_is_priced_from_its_counted_flop_and_the_clusters_device(in_process):
    """A modeled cluster's compute for a model whose speed it does not list: the device's peak x the fraction
    a step achieves over the step's FLOP (3 x the forward the plan counted, backward_fraction 0.667). For the
    default MLP (32-64-2), by hand: 2 x (32 x 64 + 64 x 2) = 4352 FLOP a sample's forward."""
    from bfexp.scaling import device_speed

    run = finished(in_process, "flop")[0] / "run"  # throughput_only=true scaling=v100_cluster model=mlp ranks=16
    s = load(run / "summary.json")
    assert json.loads((run / "plan.json").read_text())["forward_flop_per_sample"] == 4352
    speed = 125e12 * 0.235 * (1 - 0.667) / 4352
    m = s["modeled"]
    assert m["compute_source"] == "device FLOP/s"
    assert m["single_rank_throughput_samples_per_s"] == pytest.approx(speed, rel=1e-9)
    # ResNet-50's published speed is what the device's fraction came from: the two agree within 1%.
    scaling = {"device_peak_tflop_per_s": 125.0, "device_achieved_fraction": 0.235, "backward_fraction": 0.667}
    assert device_speed(scaling, 8.178e9) == pytest.approx(1200, rel=0.01)


def test_throughput_only_on_real_ranks_measures_communication(bfexp, tmp_path):
    proc = bfexp("throughput_only=true", "ranks=2", "model=mlp", "baseline_steps=5",
                 f"scaling.reference_cache={tmp_path / 'cache'}", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    s = load(bfexp.cwd / "run" / "summary.json")
    assert s["status"] == "completed" and s["throughput_only"] and s["time_source"] == "modeled"
    check_figures(s)
    measured = s["measured"]
    assert measured["exchange_time_s"] > 0 and measured["baseline_throughput_samples_per_s"] > 0
    assert s["modeled"]["parameters"] == 32 * 64 + 64 + 64 * 2 + 2


@pytest.mark.parametrize("args, message", [
    (["throughput_only=true", "scaling=v100_cluster", "model=mlp", "scaling.device_peak_tflop_per_s=0"],
     "throughput_only=true on scaling=v100_cluster needs the compute speed of model=mlp"),
    (["scaling.allreduce=tree"], "scaling.allreduce='tree'; allowed: ring, hierarchical"),
    (["scaling=v100_cluster", "ranks=12"], "ranks=12 does not fill machines of scaling.ranks_per_machine=8"),
    (["baseline_steps=-1"], "baseline_steps=-1; allowed: an integer >= 0"),
    (["scaling.reference=sometimes"], "scaling.reference='sometimes'; allowed: cached, fresh"),
    (["scaling.reference_load_margin=-1"], "scaling.reference_load_margin=-1.0; allowed: a number >= 0"),
    (["scaling.reference_threads=0"], "scaling.reference_threads=0; allowed: an integer >= 1"),
    (["scaling=h100_cluster", "scaling.device_peak_tflop_per_s=-1"], "scaling.device_peak_tflop_per_s=-1.0; allowed: "),
    (["scaling=h100_cluster", "scaling.device_achieved_fraction=1.5"],
     "scaling.device_achieved_fraction=1.5; allowed: "),
    (["+scaling.calibration_ends.quick.inter_latency_s=1e-5"],
     "scaling.calibration_ends.quick: no such end; allowed: fast, slow"),
    (["+scaling.calibration_ends.fast.inter_bandwidth_gbyte_per_s=1"],
     "scaling.calibration_ends.fast.inter_bandwidth_gbyte_per_s: not a calibrated figure; allowed: intra_latency_s,"),
    (["+scaling.calibration_ends.fast=3"], "scaling.calibration_ends.fast=3; allowed: a mapping of calibrated"),
    (["+scaling.calibration_ends.slow.reduce_gbyte_per_s=0"],
     "scaling.calibration_ends.slow.reduce_gbyte_per_s=0; allowed: a number > 0"),
])
def test_bad_scaling_input_exits_2(monkeypatch, tmp_path, args, message):
    monkeypatch.chdir(tmp_path)
    got = call([*args, "hydra.run.dir=run"])  # the CLI in this interpreter (tests/cli_in_process.py)
    assert got["escaped"] is None and got["code"] == 2, got
    assert message in got["stderr"] and len(got["stderr"].strip().splitlines()) == 1, got["stderr"]


def test_virtual_ranks_headline_the_model_beside_the_measurement(in_process):
    s = load(finished(in_process, "virtual")[0] / "run" / "summary.json")  # engine=threads ranks=4
    assert s["engine"] == "threads" and s["time_source"] == "modeled"
    check_figures(s)
    assert {k: s[k] for k in FIGURES} == {k: s["modeled"][k] for k in FIGURES}
    check_figures({**s["measured"], "ranks": 4, "batch_size": s["batch_size"]})


def test_straggler_wait_prices_the_slowest_of_the_ranks_an_exchange_waits_on(in_process):
    """scaling.straggler_wait=true: the modeled step adds what waiting for the slowest rank costs, from the
    reference's step times (checked here with numpy's quantiles of them: the median of the slowest of k
    draws is the 0.5^(1/k) quantile); false (the default of a scaling config of this machine) adds nothing."""
    import numpy as np

    # IN_PROCESS's "straggler_on" then "straggler_off": the same job, straggler_wait=true then the default
    assert IN_PROCESS["straggler_on"][:7] == IN_PROCESS["straggler_off"][:7]
    s = load(finished(in_process, "straggler_on")[0] / "on" / "summary.json")
    times, model = s["reference"]["step_times_s"], s["modeled"]
    assert len(times) == 8 and times == sorted(times)

    def slowest(k):
        return float(np.quantile(times, 0.5 ** (1 / k)))

    # DSGD over exp2 on 4 ranks: a rank waits on itself and its 2 in-neighbors; the allreduce on all 4
    assert model["wait_time_s"] == pytest.approx(slowest(3) - slowest(1), rel=1e-9)
    assert model["step_time_s"] == pytest.approx(model["compute_time_s"] + model["comm_time_s"] + model["wait_time_s"])
    o = load(finished(in_process, "straggler_off")[0] / "off" / "summary.json")  # the same reference, cached
    assert o["reference"]["step_times_s"] == times and o["modeled"]["wait_time_s"] == 0.0
    assert model["step_time_s"] == pytest.approx(o["modeled"]["step_time_s"] + model["wait_time_s"])
    assert model["baseline_step_time_s"] == pytest.approx(o["modeled"]["baseline_step_time_s"] + slowest(4) - slowest(1))


def test_a_stop_request_cuts_the_baseline_probe_short():
    """A stop signal while the results are measured: the baseline probe asks every STOP_CHECK_STEPS steps
    (the ranks agree) and stops there, so the job ends promptly; unasked, it runs its steps."""
    import torch

    from bfexp.comm.threads import run_threads
    from bfexp.probes import STOP_CHECK_STEPS, baseline_probe
    from bfexp.worker import train_step

    def rank(engine):
        asked = []

        def stop() -> bool:  # the same answer on every rank: no at the first ask, yes at the second
            asked.append(1)
            return len(asked) >= 2

        def batch():
            return torch.randn(8, 4), torch.randint(0, 2, (8,))

        def model():
            return torch.nn.Linear(4, 2)

        def optimizer(params):
            return torch.optim.SGD(params, lr=0.1)

        cut = baseline_probe(engine, train_step, model, optimizer, batch, 10 * STOP_CHECK_STEPS, stop)[1]
        whole = baseline_probe(engine, train_step, model, optimizer, batch, STOP_CHECK_STEPS + 3)[1]
        return cut, whole, len(asked)

    assert run_threads(2, rank) == [(2 * STOP_CHECK_STEPS, STOP_CHECK_STEPS + 3, 2)] * 2
