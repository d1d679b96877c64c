"""Stragglers as config (issue 16): conf/heterogeneity/, bfexp.heterogeneity.

A slow rank's step costs compute * factor + delay + pause. On virtual ranks that
cost moves the rank's simulated clock (checked here against hand-computed clocks);
on MPI ranks it is a real sleep (the CLI run below composes and runs it; wall-clock
times are never asserted). Bad values are in tests/test_bad_input.py's table.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from bfexp.comm.threads import run_threads
from bfexp.errors import ConfigError
from bfexp.heterogeneity import Heterogeneity


def clocks_after(heterogeneity: Heterogeneity, ranks: int, steps: int, seed: int = 0) -> list[float]:
    """Each virtual rank paces ``steps`` steps and nothing else (no communication): its clock."""

    def rank(engine):
        pace = heterogeneity.pace(engine, seed)
        for _ in range(steps):
            pace.before_step()
        return engine.clock_s

    return run_threads(ranks, rank)


def test_slow_rank_clock_advances_by_the_factor():
    """step_time_s 0.01 s, rank 1 four times slower plus a constant 5 ms delay and a 0.1 s pause every
    step (probability 1): after 5 steps rank 1's clock is 5 x (0.04 + 0.005 + 0.1), the others' 5 x 0.01."""
    h = Heterogeneity(slow_ranks=[1], factor=4.0, delay="constant", delay_s=0.005, pause_probability=1.0,
                      pause_s=0.1, step_time_s=0.01)
    got = clocks_after(h, 3, 5)
    assert got[0] == pytest.approx(0.05, abs=1e-12)
    assert got[1] == pytest.approx(0.725, abs=1e-12)
    assert got[2] == pytest.approx(0.05, abs=1e-12)
    # Only the factor: exactly 4x the others.
    plain = clocks_after(Heterogeneity(slow_ranks=[1], factor=4.0, step_time_s=0.01), 2, 5)
    assert plain == pytest.approx([0.05, 0.2], abs=1e-12)
    # No stragglers: every clock is steps x step_time_s.
    assert clocks_after(Heterogeneity(step_time_s=0.01), 2, 5) == pytest.approx([0.05, 0.05], abs=1e-12)


def test_random_delays_are_seeded_bounded_and_resume_where_they_left_off():
    uniform = Heterogeneity(slow_ranks=[0], delay="uniform", delay_s=0.01, step_time_s=0.01)
    draws = [uniform.extra_s(0, step, 0.01, seed=7) for step in range(1, 201)]
    assert all(0.0 <= d <= 0.02 for d in draws)
    assert np.mean(draws) == pytest.approx(0.01, abs=0.002)  # mean delay_s (200 draws: sd of the mean ~4e-4)
    assert draws == [uniform.extra_s(0, step, 0.01, seed=7) for step in range(1, 201)]  # same seed, same delays
    assert draws != [uniform.extra_s(0, step, 0.01, seed=8) for step in range(1, 201)]
    assert uniform.extra_s(1, 1, 0.01, seed=7) == 0.0  # not a slow rank
    expo = Heterogeneity(slow_ranks=[0], delay="exponential", delay_s=0.01, pause_probability=0.1, pause_s=1.0,
                         seed=3)
    draws = [expo.extra_s(0, step, 0.0, seed=0) for step in range(1, 401)]
    pauses = sum(d >= 1.0 for d in draws)
    assert 20 <= pauses <= 65  # Binomial(400, 0.1): mean 40, sd 6
    assert np.median([d for d in draws if d < 1.0]) == pytest.approx(0.01 * np.log(2), rel=0.3)
    # The configured seed wins over the run's; a pace resumed at step 6 draws what steps 6.. drew.
    assert draws == [expo.extra_s(0, step, 0.0, seed=99) for step in range(1, 401)]
    full = clocks_after(Heterogeneity(slow_ranks=[0], delay="uniform", delay_s=0.01, step_time_s=0.01), 1, 10)[0]

    def resumed(engine):
        h = Heterogeneity(slow_ranks=[0], delay="uniform", delay_s=0.01, step_time_s=0.01)
        first, second = h.pace(engine, 0), h.pace(engine, 0, first_step=6)
        for _ in range(5):
            first.before_step()
        for _ in range(5):
            second.before_step()
        return engine.clock_s

    assert run_threads(1, resumed)[0] == pytest.approx(full, abs=1e-12)


def test_constructor_refuses_out_of_range_values():
    for kwargs, words in [
        ({"factor": 0.5}, "heterogeneity.factor=0.5"),
        ({"slow_ranks": [1, 1]}, "each rank once"),
        ({"delay": "exponential"}, "heterogeneity.delay_s=0.0"),
        ({"pause_probability": -0.1}, "heterogeneity.pause_probability=-0.1"),
        ({"step_time_s": 0.0}, "heterogeneity.step_time_s=0.0"),
    ]:
        with pytest.raises(ConfigError, match="allowed") as e:
            Heterogeneity(**kwargs)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_every_option_composes_and_runs_on_virtual_ranks(bfexp):
    """Every heterogeneity option and the time-to-accuracy targets through the CLI; allreduce waits for the
    slow rank every step, so each record's simulated time is step x (2 x 0.01 + 0.002 + 0.01)."""
    proc = bfexp("engine=threads", "ranks=3", "steps=6", "log_every=3", "algorithm=allreduce", "baseline_steps=0",
                 "heterogeneity=stragglers", "heterogeneity.slow_ranks=[2]", "heterogeneity.factor=2",
                 "heterogeneity.delay=constant", "heterogeneity.delay_s=0.002", "heterogeneity.pause_probability=1",
                 "heterogeneity.pause_s=0.01", "heterogeneity.step_time_s=0.01", "heterogeneity.seed=5",
                 "target_accuracy=0.5", "target_eval_loss=2.0", "scaling.reference_steps=2", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = bfexp.cwd / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["heterogeneity"] == {"slow_ranks": [2], "factor": 2.0, "delay": "constant", "delay_s": 0.002,
                                        "pause_probability": 1.0, "pause_s": 0.01, "step_time_s": 0.01,
                                        "cpu_quota": None, "active": True}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["time_source"] for r in records] == ["simulated"] * 2
    assert [r["time_s"] for r in records] == pytest.approx([3 * 0.032, 6 * 0.032], abs=1e-12)
    assert summary["train_time_s"] == pytest.approx(6 * 0.032, abs=1e-12)
    assert summary["train_time_source"] == "simulated"


def test_stragglers_run_on_mpi_ranks(bfexp):
    """On MPI ranks the slow rank really sleeps; the records carry measured training time."""
    proc = bfexp("engine=mpi", "ranks=2", "steps=6", "log_every=3", "algorithm=dsgd", "baseline_steps=0",
                 "scaling.reference_steps=2",
                 "heterogeneity=stragglers", "heterogeneity.delay=exponential", "heterogeneity.delay_s=0.001",
                 "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = bfexp.cwd / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["heterogeneity"]["slow_ranks"] == [0]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["time_source"] for r in records] == ["measured"] * 2
    assert 0 < records[0]["time_s"] < records[1]["time_s"] == summary["train_time_s"]
