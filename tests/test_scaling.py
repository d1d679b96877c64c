"""Scaling figures: definitions, the timing split, the reference cache, the
ResNet-50 size, the cluster configs, and whole jobs through the real CLI."""

import json
import math
import re
import threading
from pathlib import Path

import pytest

from bfexp import scaling
from bfexp.cli import group_options

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


def test_contention_note():
    assert scaling.contention_note(4, 2, "mpi") and "4 ranks share 2 cores" in scaling.contention_note(4, 2, "threads")
    assert scaling.contention_note(2, 2, "mpi") is None
    assert scaling.contention_note(8, 2, "nccl") is None  # GPU ranks do not share cores for compute


def test_reference_cache_survives_concurrent_writers(tmp_path):
    key = {"model": {"name": "logreg"}, "batch_size": 32, "device": "cpu:test"}
    errors = []

    def writer(value):
        try:
            for _ in range(50):
                scaling.store_reference(tmp_path, key, value, 10)
                got = scaling.load_reference(tmp_path, key)
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
    assert scaling.load_reference(tmp_path, {**key, "batch_size": 64}) is None
    assert scaling.cache_dir(None) is None and scaling.cache_dir(str(tmp_path)) == tmp_path


def test_resnet50_size_on_meta_device_and_forward():
    import torch
    from omegaconf import OmegaConf

    from bfexp.models import build_model, parameter_count

    rn = OmegaConf.create({"name": "resnet50", "channels": 3, "image_size": 224, "classes": 1000})
    # torchvision's ResNet-50 has 25,557,032 parameters (its documented size)
    assert parameter_count(rn, OmegaConf.create({"name": "synthetic"})) == 25_557_032
    model = build_model(rn, 3 * 32 * 32, 10, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032 - 2048 * 990 - 990
    out = model(torch.zeros(2, 3 * 32 * 32))
    assert out.shape == (2, 10)
    with pytest.raises(ValueError, match="model=resnet50 needs square images"):
        build_model(rn, 10, 2, seed=0)


def test_every_declared_cluster_figure_cites_a_source():
    """Each number a scaling config declares is preceded by a comment saying where it comes from."""
    for option in group_options("scaling"):
        lines = (REPO / "conf" / "scaling" / f"{option}.yaml").read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^\s*[a-z_0-9]+:\s*[-+.0-9]", line):
                above = lines[i - 1].strip() if i else ""
                assert above.startswith("#"), f"{option}.yaml: '{line.strip()}' has no source comment above it"


def load(path):
    return json.loads(Path(path).read_text())


def check_figures(summary):
    for key in FIGURES:
        assert isinstance(summary[key], (int, float)) and math.isfinite(summary[key]), (key, summary[key])
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
    """ranks=2,4 on the default experiment: every job measures every figure, probes the
    baseline, models the same job on this machine, and flags contention past the cores."""
    proc = bfexp("-m", "ranks=2,4", "steps=20", "log_every=10", "baseline_steps=10", "report=false",
                 "scaling.reference_cache=cache", "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    summaries = sorted((load(p) for p in (bfexp.cwd / "sweep").glob("*/summary.json")), key=lambda s: s["ranks"])
    assert [s["ranks"] for s in summaries] == [2, 4]
    cores = scaling.processor_count()
    for s in summaries:
        assert s["status"] == "completed" and s["time_source"] == "measured"
        check_figures(s)
        assert s["measured"]["baseline_steps"] == 10 and s["measured"]["reference_source"] in ("measured", "cache")
        check_figures({**s["modeled"], "ranks": s["ranks"], "batch_size": s["batch_size"]})
        assert s["modeled"]["parameters"] == 33 * 2  # logreg: 32 features + bias, 2 classes
        assert (s["contention"] is not None) == (s["ranks"] > cores)
        if s["contention"]:
            assert f"{s['ranks']} ranks share {cores} cores" in proc.stdout
    # the single-rank reference was measured once and cached for the second job
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


def test_throughput_only_resnet50_on_the_v100_cluster(bfexp):
    """128 ranks, no rank started: the model's figures equal the alpha-beta formulas
    worked out here from the config's declared figures."""
    proc = bfexp("-m", "throughput_only=true", "scaling=v100_cluster", "model=resnet50", "ranks=128",
                 "engine.ranks_per_machine=8", "batch_size=64", "algorithm=allreduce,dsgd",
                 "topology=inner_outer_exp2", "report=false", "hydra.sweep.dir=tp")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    by_algo = {s["algorithm"]: s for s in (load(p) for p in (bfexp.cwd / "tp").glob("*/summary.json"))}
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
        assert s["step_time_s"] == pytest.approx(compute + max(0.0, exchange - backward), rel=1e-9)
        check_figures(s)
    assert by_algo["allreduce"]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert by_algo["dsgd"]["speedup_vs_baseline"] > 1.0


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
    (["throughput_only=true", "scaling=v100_cluster", "model=mlp"],
     "throughput_only=true on scaling=v100_cluster needs the compute speed of model=mlp"),
    (["scaling.allreduce=tree"], "scaling.allreduce='tree'; allowed: ring, hierarchical"),
    (["scaling=v100_cluster", "ranks=12"], "ranks=12 does not fill machines of scaling.ranks_per_machine=8"),
    (["baseline_steps=-1"], "baseline_steps=-1; allowed: an integer >= 0"),
])
def test_bad_scaling_input_exits_2(bfexp, args, message):
    proc = bfexp(*args, "hydra.run.dir=run")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_virtual_ranks_headline_the_model_beside_the_measurement(bfexp, tmp_path):
    proc = bfexp("engine=threads", "ranks=4", "steps=10", "log_every=5", "baseline_steps=3",
                 f"scaling.reference_cache={tmp_path / 'cache'}", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    s = load(bfexp.cwd / "run" / "summary.json")
    assert s["engine"] == "threads" and s["time_source"] == "modeled"
    check_figures(s)
    assert {k: s[k] for k in FIGURES} == {k: s["modeled"][k] for k in FIGURES}
    check_figures({**s["measured"], "ranks": 4, "batch_size": s["batch_size"]})
