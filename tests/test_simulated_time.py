"""Simulated time on virtual ranks (issue 16): each rank's clock moves by its own steps, waits set it,
and a scheduled world runs ranks one at a time in clock order, so one-sided window operations take
effect in that order whatever the host's threads do.

References are independent of the engine: hand-computed clocks, and a plain numpy replay of the
same push-style window protocol processed in clock order.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bfexp.comm.threads import run_threads
from tests.cli_in_process import calls, ran

RANKS = 64
STEPS = 6
SLOW = 3


def step_time(rank: int) -> float:
    """Dyadic step times (exact in binary; no two clocks tie within STEPS); rank SLOW is 4x slower."""
    return (4.0 if rank == SLOW else 1.0) * (1 + rank / 1024)


def test_ranks_run_in_clock_order_and_collectives_meet_at_the_latest_clock():
    order: list[tuple[float, int]] = []

    def rank(engine):
        for _ in range(STEPS):
            engine.advance(step_time(engine.rank))
            order.append((engine.clock_s, engine.rank))  # only the running rank appends
        engine.allreduce(torch.zeros(1))
        return engine.clock_s

    clocks = run_threads(RANKS, rank, scheduled=True)
    expected = sorted((k * step_time(r), r) for r in range(RANKS) for k in range(1, STEPS + 1))
    assert order == expected
    assert clocks == [STEPS * step_time(SLOW)] * RANKS


def numpy_replay(values: np.ndarray) -> np.ndarray:
    """The window protocol below, replayed in clock order: at rank r's k-th step, r adds half its value to
    its successor's slot, keeps half, then folds in (and empties) its own slot."""
    x, slot = values.copy(), np.zeros_like(values)
    events = sorted((k * step_time(r), r) for r in range(RANKS) for k in range(1, STEPS + 1))
    for _, r in events:
        nxt = (r + 1) % RANKS
        slot[nxt] += 0.5 * x[r]
        x[r] = 0.5 * x[r]
        x[r] = x[r] * 1.0 + slot[r] * 1.0
        slot[r] = 0.0
    return x


def window_protocol(engine) -> float:
    n, r = engine.size, engine.rank
    own = engine.win_create(torch.tensor([float(r * r + 1)], dtype=torch.float64), "w",
                            src_ranks=[(r - 1) % n], dst_ranks=[(r + 1) % n])
    for _ in range(STEPS):
        engine.advance(step_time(r))
        engine.win_accumulate(None, "w", self_weight=0.5, dst_weights={(r + 1) % n: 0.5})
        engine.win_update("w", 1.0, {(r - 1) % n: 1.0}, reset=True)
    value = float(own[0])
    engine.barrier()
    engine.win_free("w")
    return value


def test_window_operations_take_effect_in_clock_order_on_64_ranks():
    """Asynchronous pushes through windows on 64 virtual ranks, one 4x slower: the result is the numpy
    replay's in clock order (to the bit), on every run."""
    expected = numpy_replay(np.array([float(r * r + 1) for r in range(RANKS)]))
    first = run_threads(RANKS, window_protocol, scheduled=True)
    assert first == expected.tolist()
    assert run_threads(RANKS, window_protocol, scheduled=True) == first


def records(run) -> list[dict]:
    """metrics.jsonl without the host's wall-clock figures."""
    wall = {"elapsed_s", "step_time_s", "throughput_samples_per_s"}
    return [{k: v for k, v in json.loads(line).items() if k not in wall}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


ASYNC_RUN = ["engine=threads", "ranks=8", "steps=12", "log_every=4", "eval_every=4", "model=mlp", "dataset=digits",
             "baseline_steps=0", "heterogeneity=stragglers", "heterogeneity.step_time_s=0.01",
             "heterogeneity.delay=exponential", "heterogeneity.delay_s=0.005", "scaling.reference_steps=2"]


# The two sweeps below: each one `bfexp -m` (no report) in a folder of its own, both in one interpreter
# (tests/cli_in_process.py), one after the other.
SWEEPS = {
    "reproducible": ["algorithm=async_push_sum", "topology=one_peer_exp2", *ASYNC_RUN, "scaling.reference=cached,fresh"],
    "equal_delays": ["algorithm=push_sum,async_push_sum", "topology=one_peer_exp2", "engine=threads", "ranks=8",
                     "steps=12", "log_every=4", "eval_every=4", "model=mlp", "dataset=digits", "baseline_steps=0",
                     "scaling.reference_steps=2", "heterogeneity.step_time_s=0.01"],
}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    cases = [{"id": name, "folder": str(root / name),
              "args": ["-m", *args, "report=false", "hydra.sweep.dir=sweep", "hydra.sweep.subdir=${hydra.job.num}"]}
             for name, args in SWEEPS.items()]
    return root, calls(cases, timeout=600)


def sweep(sweeps, name: str) -> list[list[dict]]:
    """SWEEPS's sweep NAME: each job's records, in job order."""
    root, got = sweeps
    ran(got[name])
    folders = sorted((root / name / "sweep").iterdir(), key=lambda p: p.name)
    return [records(f) for f in folders if (f / "metrics.jsonl").is_file()]


def test_async_experiment_on_virtual_ranks_is_reproducible(sweeps):
    """The same asynchronous experiment (async push-sum, a 4x straggler with random delays, 8 virtual
    ranks) twice: identical metrics, simulated time included, whatever the host did meanwhile (the
    second run measures its single-rank reference between training steps, the first may take it from
    the cache)."""
    runs = sweep(sweeps, "reproducible")
    assert len(runs) == 2 and runs[0] == runs[1]
    assert [r["time_source"] for r in runs[0]] == ["simulated"] * 3


def test_async_push_sum_with_equal_delays_is_synchronous_push_sum(sweeps):
    """No stragglers, every step the same simulated time: the asynchronous rule's iterates are the
    synchronous one's (loss, accuracy and consensus distance at every logged step, to rounding)."""
    sync, asyn = sweep(sweeps, "equal_delays")
    assert len(sync) == len(asyn) == 3
    for s, a in zip(sync, asyn):
        for key in ("loss", "eval_loss", "accuracy", "consensus_distance", "time_s"):
            assert a[key] == pytest.approx(s[key], rel=1e-5, abs=1e-9), key
