"""The job's plan (bfexp.plan, issue 47): built once, dry, by one function; the driver's checks and the
ranks' build read the same one.

The plan's facts are held against hand-computed values (an MLP's parameter count from its widths, the
synthetic data's shape from its config), then against what real ranks built: the ranks read the driver's
plan.json and confirm it, and a plan the ranks' build differs from ends the job naming the difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_bfexp
from tests.test_resume import CHEAP, compose


def mlp_parameters(widths: list[int]) -> int:
    """Weights and biases of a chain of linear layers (by hand)."""
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def test_a_dry_plan_holds_the_jobs_facts_without_loading_data(monkeypatch):
    """The plan of an MLP on the synthetic data at 4 ranks: sample shape and classes from the data set's config,
    parameters from the widths; no rank's shard is loaded to learn them (Dataset.load would raise here)."""
    from bfexp import data
    from bfexp.plan import make_plan

    def no_load(*args, **kwargs):
        raise AssertionError("a dry plan loaded a shard")

    monkeypatch.setattr(data.Dataset, "load", no_load)
    monkeypatch.setattr(data.Dataset, "load_ranks", no_load)
    monkeypatch.setattr(data.Dataset, "arrays", no_load)
    cfg = compose(["model=mlp", "model.hidden=[16,8]", "dataset.features=12", "dataset.classes=3", "ranks=4",
                   "engine=threads", "steps=7", *CHEAP])
    plan = make_plan(cfg)
    assert (plan.kind, plan.ranks, plan.steps, plan.engine, plan.machines) == ("train", 4, 7, "threads", 1)
    assert (plan.in_shape, plan.classes) == ((12,), 3)
    assert plan.parameters == mlp_parameters([12, 16, 8, 3]) == 371
    # A sample's forward: each layer's multiply-adds, 2 FLOP apiece (FlopCounterMode counts no bias or ReLU).
    assert plan.forward_flop_per_sample == 2 * (12 * 16 + 16 * 8 + 8 * 3) == 688
    assert (plan.algorithm, plan.topology) == ("dsgd", "exp2")
    assert plan.cfg.engine.name == "threads" and plan.engine_choice is None


def test_engine_auto_is_decided_in_the_plan():
    """engine=auto: the plan's config runs the engine it chose, and says why."""
    from bfexp.plan import make_plan

    plan = make_plan(compose(["ranks=2", "engine=auto", *CHEAP]))
    assert plan.engine == plan.cfg.engine.name == "mpi"
    assert plan.engine_choice.startswith("engine=auto chose mpi: ranks=2 fit")


@pytest.mark.parametrize("engine", ["mpi", "threads"])
def test_the_ranks_build_what_the_driver_planned(tmp_path, engine):
    """A job run by the CLI: plan.json holds what an independent dry plan of the same overrides gives, and its
    ranks (MPI processes, or virtual ranks) confirmed it: the job completed."""
    from bfexp.plan import Plan, make_plan

    overrides = ["model=mlp", "model.hidden=[16]", "ranks=2", f"engine={engine}", "steps=4", *CHEAP]
    out = run_bfexp([*overrides, "hydra.run.dir=run", "report=false"], tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    written = Plan.read(tmp_path / "run")
    assert written is not None
    assert written == make_plan(compose(overrides))
    assert written.parameters == mlp_parameters([32, 16, 2])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def test_a_rank_whose_build_differs_from_the_plan_ends_the_job_naming_it(tmp_path, monkeypatch):
    """A plan.json that no longer matches what the ranks build (here: a parameter count changed by hand): the
    job fails with both counts named, before any step trains."""
    from bfexp.launch import launch
    from bfexp.plan import make_plan

    monkeypatch.chdir(tmp_path)
    cfg = compose(["ranks=2", "engine=threads", "steps=4", *CHEAP])
    plan = make_plan(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    facts = plan.facts()
    facts["parameters"] += 1
    (run_dir / "plan.json").write_text(json.dumps(facts))
    result = launch(plan.cfg, run_dir)
    assert result.status == "failed"
    assert f"parameters {plan.parameters + 1} planned, {plan.parameters} built" in result.summary["error"]
    assert not (run_dir / "metrics.jsonl").exists() or not any(
        r.get("step", 0) > 0 for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()))


def test_the_driver_checks_a_job_through_one_function():
    """cli.checked_job and cli.check_sweep both decide a job by bfexp.plan.make_plan; no other dry build."""
    import ast

    source = (Path(__file__).resolve().parent.parent / "bfexp" / "cli.py").read_text()
    tree = ast.parse(source)
    callers = sorted(f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                     for n in ast.walk(f) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "make_plan")
    assert callers == ["check_sweep", "checked_job"]
    assert "dry_build" not in source and "resolve_engine" not in source


def test_settings_hold_every_top_level_value_and_no_component():
    """bfexp.schema.Settings (the run's own section) has exactly the top-level schema's keys less the component
    nodes, with the same defaults, so a function that reads the run's values cannot miss a key nor see a node."""
    from dataclasses import MISSING, fields

    from bfexp.schema import COMPONENTS, Config, Settings

    top = {f.name: f.default for f in fields(Config) if f.name not in COMPONENTS}
    assert {f.name: f.default for f in fields(Settings)} == top
    assert all(f.default is not MISSING for f in fields(Settings))
    cfg = compose(["ranks=3", "steps=9", "lr=0.05", *CHEAP])
    settings = Settings.of(cfg)
    assert (settings.ranks, settings.steps, settings.lr, settings.baseline_steps) == (3, 9, 0.05, 0)
    assert not any(hasattr(settings, c) for c in COMPONENTS)
