"""Training for a time budget (``budget_s``), and asynchronous ranks that never wait for one another.

A synchronous run meets at every logging step anyway (bfexp.worker's ``log``), so its
ranks agree there on where the budget ends. An asynchronous one (async_push_sum, gossip,
ad_psgd under ``budget_s``) must not meet during training, or the slowest rank bounds
everyone. So each of its ranks

* trains until ITS clock reaches the budget (simulated: a step runs only if it ends
  within the budget; measured: steps start while the clock is below it);
* writes its own records, ``metrics/rank<N>.jsonl``: a ``train`` record every
  ``log_every`` of its own steps (its step, its clock, its loss) and an ``eval`` record
  at every ``eval_every_s`` of its clock (its model's held-out accuracy), with no
  collective (``RankRecords``);
* keeps a copy of its parameters at each of those times, so that after training, in
  one allreduce, every scheduled time's average model is formed and evaluated
  (``average_models``: where the copies fit in AVERAGE_BYTES);
* learns of a stop request from the run folder's ``stop`` file, which the driver
  writes, without a barrier (``Cut``).

The driver merges the ranks' records by time (``merge``): for progress while the job
runs (``MergedTail``), and into ``metrics.jsonl`` for the report, one record per
scheduled evaluation time with the mean and the worst rank's accuracy and the average
model's.

Stopping virtual ranks where a checkpoint can resume them bit for bit (``Cut``): the
ranks run one at a time in simulated-clock order (bfexp.comm.rendezvous), and a rank's
step takes effect at the time its clock reaches once it has paid the step's cost. The
first rank to see the stop file, running at time T, writes T into ``stop_at``; every
rank then runs the steps that take effect at times <= T and none after (it un-pays the
one it had paid for). Every event up to T has then happened and none after: a
consistent cut. The order in which ranks stop is their order at equal clocks, which a
resumed run restores (``rejoin``) before its first step.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bfexp import checkpoint, results

if TYPE_CHECKING:  # the driver imports this module too, and does without torch
    import torch

__all__ = ["AVERAGE_BYTES", "END", "Cut", "MergedTail", "RankRecords", "average_models", "eval_times", "logged",
           "merge", "rejoin", "RECORDS_DIR"]

RECORDS_DIR = "metrics"  # <run dir>/metrics/rank<N>.jsonl, average.jsonl
AVERAGE = "average.jsonl"
# The average model at every scheduled time is formed only where the ranks' copies of their parameters
# fit in this many bytes per rank (a small model's: the MLP's 20 copies are 0.4 MB).
AVERAGE_BYTES = 256 * 2**20
END = -1.0  # the scheduled time of the evaluation at the end of training (each rank's final model)


def eval_times(budget_s: float, every_s: float | None) -> list[float]:
    """The scheduled evaluation times: multiples of ``every_s`` (default budget_s / 20) below the budget
    (the end of training is evaluated anyway)."""
    every = float(every_s) if every_s else budget_s / 20.0
    count = math.ceil(budget_s / every - 1e-9) - 1
    return [every * (k + 1) for k in range(max(0, count))]


class RankRecords:
    """One rank's own records (module doc), appended to ``metrics/rank<N>.jsonl`` as they happen."""

    def __init__(self, run_dir: Path, rank: int, kept_step: int | None = None) -> None:
        self.path = Path(run_dir) / RECORDS_DIR / f"rank{rank}.jsonl"
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if kept_step is None:  # a fresh run starts a fresh file
            self.path.unlink(missing_ok=True)
        elif self.path.exists():  # a resumed run keeps what happened up to its checkpoint
            kept = [r for r in results.read_jsonl(self.path) if int(r.get("step", 0)) <= kept_step]
            results.write_text_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def write(self, kind: str, **fields: Any) -> None:
        results.append_jsonl(self.path, {"kind": kind, "rank": self.rank, **fields})


def logged(run_dir: Path) -> bool:
    """Whether some rank has written a record of its own (it has trained: an asynchronous budget run's
    ranks log here, not to metrics.jsonl, and their heartbeats may not say so yet)."""
    for path in (Path(run_dir) / RECORDS_DIR).glob("rank*.jsonl"):
        try:
            if path.stat().st_size > 0:
                return True
        except OSError:  # a fresh run's rank removing a stale file
            continue
    return False


class Cut:
    """Where a virtual rank stops on a stop request (module doc); process ranks stop at their next step."""

    def __init__(self, run_dir: Path, rank: int, simulated: bool) -> None:
        self.run_dir, self.rank, self.simulated = Path(run_dir), rank, simulated
        self.order: int | None = None  # this rank's place among the stopping ranks

    def stops(self, at_s: float, requested: bool) -> bool:
        """Whether a step taking effect at ``at_s`` (this rank's clock) must not run."""
        if not requested:
            return False
        if not self.simulated:
            return True
        path = self.run_dir / checkpoint.STOP_AT
        state = results.read_json(path) if path.exists() else None
        if state is None:  # the first rank to see the request: the cut is at its time, its step still runs
            results.write_json_atomic(path, {"time_s": at_s, "stopped": []})
            return False
        if at_s <= state["time_s"]:
            return False
        self.order = len(state["stopped"])
        state["stopped"].append(self.rank)
        results.write_json_atomic(path, state)
        return True


def rejoin(engine: Any, order: int, time_s: float) -> None:
    """A resumed virtual rank: back to its clock at the cut, in the order the ranks stopped there
    (collective: the ranks meet first, at one clock). ``order`` zero-time yields put the ranks that
    stopped first ahead at equal clocks, as they were."""
    engine.barrier()
    for _ in range(order):
        engine.advance(0.0)
    engine.advance(time_s)


def average_models(engine: Any, copies: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Collective: the ranks' average of each copy (every rank has as many), or None where they do not
    fit in AVERAGE_BYTES (every rank decides alike: same model, same count)."""
    import torch

    if not copies or sum(c.numel() * c.element_size() for c in copies) > AVERAGE_BYTES:
        return None
    stacked = torch.stack([c.to(torch.float64) for c in copies])
    return list(engine.allreduce(stacked, op="avg").unbind(0))


# ---------------------------------------------------------------- the driver's side


# How a rank's train record reads in its file (RankRecords: json.dumps with sorted keys): found without parsing.
TRAIN_MARK = b'"kind": "train"'


class RankFile:
    """One rank's records as the driver needs them at the end: its other records parsed, its train records
    (one every log_every steps: hundreds of thousands in a long run) kept as lines, in the order of its
    clock, and parsed only where a search lands (``loss_at``)."""

    def __init__(self, path: Path) -> None:
        self.train: list[bytes] = []
        self.others: list[dict] = []
        for line in results.JsonlTail(path).new_lines():  # whole lines: a torn last one is still being written
            if TRAIN_MARK in line:
                self.train.append(line)
            else:
                self.others.append(json.loads(line))

    def loss_at(self, at: float) -> float | None:
        """The loss of the rank's last train record at or before time ``at`` (its clock only grows)."""
        found = bisect.bisect_right(self.train, at, key=lambda line: json.loads(line)["time_s"])
        return json.loads(self.train[found - 1])["loss"] if found else None


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def merge(run_dir: Path, ranks: int, time_source: str) -> list[dict]:
    """The ranks' records merged by time: one record per scheduled evaluation time that every rank
    evaluated (``time_s``: when the last of them did, by its clock), and the end of training. Each has
    the ranks' mean and worst accuracy, the average model's (where formed), each rank's step and the
    mean of the ranks' latest training loss."""
    per_rank = [RankFile(Path(run_dir) / RECORDS_DIR / f"rank{r}.jsonl") for r in range(ranks)]
    average = {round(r["scheduled_s"], 9): r for r in results.read_jsonl(Path(run_dir) / RECORDS_DIR / AVERAGE)} \
        if (Path(run_dir) / RECORDS_DIR / AVERAGE).exists() else {}
    evals: dict[float, dict[int, dict]] = {}
    for r, records in enumerate(per_rank):
        for rec in records.others:
            if rec.get("kind") == "eval":
                evals.setdefault(round(rec["scheduled_s"], 9), {})[r] = rec
    merged = []
    for scheduled in sorted(evals, key=lambda t: (t == END, t)):
        got = evals[scheduled]
        if len(got) < ranks:
            continue
        at = max(rec["time_s"] for rec in got.values())
        losses = [records.loss_at(at) for records in per_rank]
        steps = [got[r]["step"] for r in range(ranks)]
        acc = [got[r]["accuracy"] for r in range(ranks)]
        avg = average.get(scheduled, {})
        merged.append({
            "step": round(sum(steps) / ranks),
            "steps_per_rank": steps,
            "loss": _mean(losses),
            "eval_loss": _mean([got[r]["eval_loss"] for r in range(ranks)]),
            "accuracy": _mean(acc),
            "worst_accuracy": min(acc),
            "average_model_accuracy": avg.get("accuracy"),
            "average_model_eval_loss": avg.get("eval_loss"),
            "time_s": at,
            "scheduled_s": scheduled if scheduled >= 0 else None,
            "time_source": time_source,
        })
    return merged


def write_merged(run_dir: Path, ranks: int, time_source: str) -> None:
    """metrics.jsonl from the ranks' records (the report reads it)."""
    records = merge(run_dir, ranks, time_source)
    results.write_text_atomic(Path(run_dir) / results.METRICS,
                              "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


class MergedTail:
    """Progress while an asynchronous budget run trains: a record whenever some rank logged, with the
    ranks' mean step, mean latest loss and the slowest rank's clock (for the progress bar)."""

    def __init__(self, run_dir: Path, ranks: int) -> None:
        folder = Path(run_dir) / RECORDS_DIR
        self.tails = [results.JsonlTail(folder / f"rank{r}.jsonl") for r in range(ranks)]
        self.latest: list[dict | None] = [None] * ranks

    def read_new(self) -> list[dict]:
        fresh = False
        for r, tail in enumerate(self.tails):
            train = [line for line in tail.new_lines() if TRAIN_MARK in line]
            if train:  # only the latest counts: a driver short of CPU keeps up with ranks however fast
                self.latest[r], fresh = json.loads(train[-1]), True
        seen = [rec for rec in self.latest if rec is not None]
        if not fresh or not seen:
            return []
        return [{"step": round(sum(rec["step"] for rec in seen) / len(seen)),
                 "loss": _mean([rec["loss"] for rec in seen]),
                 "time_s": min(rec["time_s"] for rec in seen) if len(seen) == len(self.latest) else 0.0,
                 "step_time_s": _mean([rec.get("step_time_s") for rec in seen]),
                 "elapsed_s": max(rec.get("elapsed_s", 0.0) for rec in seen)}]


def metrics_tail(run_dir: Path, ranks: int, no_lockstep: bool) -> Any:
    """What the driver follows for progress: rank 0's metrics.jsonl, or (``no_lockstep``: an asynchronous
    budget run, whose ``ranks`` log on their own, bfexp.config.no_lockstep) the ranks' records merged by time."""
    if no_lockstep:
        return MergedTail(run_dir, int(ranks))
    return results.JsonlTail(Path(run_dir) / results.METRICS)


def merge_records(run_dir: Path, ranks: int, time_source: str, no_lockstep: bool) -> None:
    """The driver, once the ranks ended (``no_lockstep``: an asynchronous budget run): metrics.jsonl from
    their records."""
    if no_lockstep:
        try:
            write_merged(run_dir, int(ranks), time_source)
        except (OSError, ValueError, KeyError):  # damaged records: the job's outcome stands
            pass
