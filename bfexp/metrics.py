"""Figures every job logs: global loss, accuracy, consensus distance, step timing.

Each is computed on every rank and combined with the engine's own
allreduce, so all ranks agree on it (and on when a run has diverged).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from bfexp.comm.engine import Engine


def consensus_distance(engine: Engine, flat: torch.Tensor) -> float:
    """(1/n) sum_i ||x_i - x_mean||^2: how far the ranks' models are from agreeing (a stacked flat buffer,
    bfexp.comm.stacked, holds every rank's model along its last dimension: the sum runs down dim 0)."""
    x = flat.detach().to(torch.float64)
    if getattr(engine, "stacked", False):  # the variance over ranks of each element, summed: one pass over the
        return float(x.var(1, correction=0).sum())  # stack, not two allreduces' copies (0.3 s at 4096 mlp ranks)
    mean = engine.allreduce(x, op="avg")
    local = torch.sum((x - mean) ** 2, dim=0, keepdim=True)
    return float(engine.allreduce(local, op="avg").reshape(-1)[0])


def rank_value(value: torch.Tensor) -> float | torch.Tensor:
    """A rank's figure as the metrics below take it: a float, or on a stacked engine (a tensor of one
    value per rank) every rank's, as float64."""
    value = value.detach()
    return float(value) if value.dim() == 0 else value.to(torch.float64)


def model_input(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Samples as the model takes them: features cast to the run's dtype; token ids (integers) as they are."""
    return x.to(dtype) if x.dtype is not dtype and x.is_floating_point() else x


def cross_entropy(scores: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of scores (batch, ..., classes) against labels (batch, ...): a classifier's one label per
    sample, or a language model's one per position (the mean over every token, whose exp is the perplexity).
    For (batch, classes) scores it is F.cross_entropy itself, bit for bit."""
    if scores.dim() == 2 and y.dim() == 1 and scores.dtype is torch.float32:  # a classifier's float32 scores: as they are
        return F.cross_entropy(scores, y, reduction=reduction)
    return F.cross_entropy(scores.flatten(0, -2).float(), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> tuple[Any, Any]:
    """(mean loss, accuracy) of one rank's model on the held-out set, ``batch`` samples at a time
    (a chunk whose activations stay in cache: the cnn's 2000-sample evaluation takes 0.10 s in
    chunks of 256 and 0.25 s in one of 4096 here, 2 threads; an MLP's is the same either way).
    A language model's are per token: the mean token cross-entropy and next-token accuracy.
    A stacked model (bfexp.comm.stacked) gives every rank's, as tensors over ranks."""
    if hasattr(model, "forward_shared"):
        return model.evaluate(x, y, batch)
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    dtype = next(model.parameters()).dtype
    for i in range(0, len(y), batch):
        out = model(model_input(x[i : i + batch], dtype))
        loss += float(cross_entropy(out, y[i : i + batch], reduction="sum"))
        correct += int((out.argmax(-1) == y[i : i + batch]).sum())
    model.train(was_training)
    return loss / max(1, y.numel()), correct / max(1, y.numel())


def perplexity(loss: float) -> float:
    """exp(mean token cross-entropy): the vocabulary size a uniform guess would need to score as well
    (inf past float range, nan for nan)."""
    return math.exp(loss) if loss < 709.0 else (math.inf if loss == loss else math.nan)


def gather_floats(engine: Engine, *values: float) -> list[list[float]]:
    """Every rank's values, on every rank: result[k][r] is value k of rank r (one allreduce).

    Non-finite values travel as a separate mask, so a NaN on one rank stays that rank's.
    """
    import math

    n, k = engine.size, len(values)
    if getattr(engine, "stacked", False):  # one engine holds every rank: a value is every rank's (a tensor) or the same on all
        return [torch.as_tensor(v, dtype=torch.float64).expand(n).tolist() for v in values]
    table = torch.zeros(k, n, dtype=torch.float64)
    finite = torch.zeros(k, n, dtype=torch.float64)
    table[:, engine.rank] = torch.tensor([v if math.isfinite(v) else 0.0 for v in values], dtype=torch.float64)
    finite[:, engine.rank] = torch.tensor([1.0 if math.isfinite(v) else 0.0 for v in values], dtype=torch.float64)
    table, finite = engine.allreduce([table, finite], op="sum")
    # Read as whole tables (two tolist calls), not element by element: k * n tensor indexings per
    # rank would make the job's work grow with ranks squared (128 virtual ranks: minutes).
    return [[v if ok else float("nan") for v, ok in zip(row, oks)] for row, oks in zip(table.tolist(), finite.tolist())]


def global_mean(engine: Engine, *values: float) -> list[float]:
    """Average of each value over ranks, in one message (stacked: a value per rank as a tensor over ranks,
    or a float that every rank has)."""
    if getattr(engine, "stacked", False):
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).expand(engine.size) for v in values])
        return engine.allreduce(t, op="avg")[:, 0].tolist()
    t = torch.tensor(values, dtype=torch.float64)
    return engine.allreduce(t, op="avg").tolist()


class EvalSchedule:
    """Which steps evaluate the held-out set (loss, accuracy); the last step always does.

    ``every`` set: its multiples. None: by ``budget``, the share of the training time
    evaluation may take, priced from the work (no clock, so every rank, and a resumed run,
    evaluates at the same steps): one evaluation forwards ``samples`` held-out samples, a
    training step forwards and backwards ``batch`` (about three forward passes' work), so an
    evaluation costs about samples / (3 batch) steps, and evaluations are spaced by that over
    ``budget``, rounded up to a multiple of ``log_every``. The first logged step evaluates
    too, so a curve has its start. For a small model a step is mostly fixed costs, so the
    estimate errs towards fewer evaluations; ``points`` (eval_points) bounds the spacing so a run
    of ``steps`` evaluates at least that many times (in multiples of ``log_every``), and
    ``eval_every`` asks for any spacing. ``time_s`` counts this rank's seconds spent evaluating
    (reported apart from the training time).
    """

    def __init__(self, every: int | None, budget: float, log_every: int, samples: int, batch: int,
                 steps: int = 0, points: int = 0) -> None:
        self.every, self.log_every = every, int(log_every)
        if every:
            self.interval = int(every)
        else:
            per_eval = samples / (3.0 * max(1, batch) * float(budget))  # training steps per evaluation
            self.interval = self.log_every * max(1, math.ceil(per_eval / self.log_every - 1e-9))
            if points and steps:  # a curve of at least `points` evaluations, whatever the budget allows
                self.interval = min(self.interval, self.log_every * max(1, steps // (points * self.log_every)))
        self.time_s = 0.0
        self.count = 0

    def logs(self, step: int, last: int) -> bool:
        """Whether ``step`` writes a record (logged steps and evaluated ones)."""
        return step == last or step % self.log_every == 0 or step % self.interval == 0

    def due(self, step: int, last: int) -> bool:
        """Whether ``step`` evaluates (the same answer on every rank and in a resumed run)."""
        first = not self.every and step == self.log_every
        return step == last or step % self.interval == 0 or first

    def spent(self, seconds: float) -> None:
        """One evaluation took ``seconds`` on this rank."""
        self.time_s += seconds
        self.count += 1


def held_out(x: torch.Tensor, y: torch.Tensor, subset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out samples evaluation runs on: the first ``subset`` of them (a fixed subset), or all."""
    if subset is None or subset >= len(y):
        return x, y
    return x[:subset], y[:subset]


@dataclass
class StepTimer:
    """Wall time of training steps, split into communication (engine-reported) and the rest.

    Keeps every timed step (after ``warmup``) as a sample: bfexp.scaling takes
    the median and its interval from them, which a few preempted steps on a
    busy machine do not move as they move a mean. ``cuda=True`` synchronizes
    the device around each step, so a GPU step is timed to its end.
    """

    warmup: int = 3
    cuda: bool = False
    steps: int = 0
    total_s: float = 0.0
    comm_s: float = 0.0
    window: list = field(default_factory=list)
    step_samples: list = field(default_factory=list)  # seconds per timed step
    blocked_samples: list = field(default_factory=list)  # seconds each timed step was blocked in the engine
    last_s: float | None = None  # the latest step's seconds, warm-up or not
    _t0: float = 0.0
    _c0: float = 0.0

    def start(self, engine: Engine) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        self._c0 = engine.comm_time_s

    def stop(self, engine: Engine) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - self._t0
        self.last_s = dt
        self.window.append(dt)
        self.steps += 1
        if self.steps > self.warmup:
            blocked = engine.comm_time_s - self._c0
            self.total_s += dt
            self.comm_s += blocked
            self.step_samples.append(dt)
            self.blocked_samples.append(blocked)

    def take_window(self) -> float:
        """Mean step time since the last call (for progress records)."""
        w, self.window = self.window, []
        return sum(w) / len(w) if w else float("nan")

    @property
    def timed_steps(self) -> int:
        return max(0, self.steps - self.warmup)

    @property
    def mean_step_s(self) -> float:
        return self.total_s / self.timed_steps if self.timed_steps else float("nan")

    @property
    def mean_blocked_s(self) -> float:
        """Mean seconds per timed step spent blocked in the engine (communication and waiting)."""
        return self.comm_s / self.timed_steps if self.timed_steps else float("nan")
