"""Figures every job logs: global loss, accuracy, consensus distance, step timing.

Each is computed on every rank and combined with the engine's own
allreduce, so all ranks agree on it (and on when a run has diverged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bfexp.comm.engine import Engine


def consensus_distance(engine: Engine, flat: torch.Tensor) -> float:
    """(1/n) sum_i ||x_i - x_mean||^2: how far the ranks' models are from agreeing."""
    x = flat.detach().to(torch.float64)
    mean = engine.allreduce(x, op="avg")
    local = torch.sum((x - mean) ** 2).reshape(1)
    return float(engine.allreduce(local, op="avg").item())


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 4096) -> tuple[float, float]:
    """(mean loss, accuracy) of one rank's model on the held-out set."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    dtype = next(model.parameters()).dtype
    for i in range(0, len(y), batch):
        out = model(x[i : i + batch].to(dtype))
        loss += float(F.cross_entropy(out.float(), y[i : i + batch], reduction="sum"))
        correct += int((out.argmax(1) == y[i : i + batch]).sum())
    model.train(was_training)
    return loss / max(1, len(y)), correct / max(1, len(y))


def global_mean(engine: Engine, *values: float) -> list[float]:
    """Average of each value over ranks, in one message."""
    t = torch.tensor(values, dtype=torch.float64)
    return engine.allreduce(t, op="avg").tolist()


@dataclass
class StepTimer:
    """Wall time of training steps, split into communication (engine-reported) and the rest."""

    warmup: int = 3
    steps: int = 0
    total_s: float = 0.0
    comm_s: float = 0.0
    window: list = field(default_factory=list)
    _t0: float = 0.0
    _c0: float = 0.0

    def start(self, engine: Engine) -> None:
        self._t0 = time.perf_counter()
        self._c0 = engine.comm_time_s

    def stop(self, engine: Engine) -> None:
        dt = time.perf_counter() - self._t0
        self.window.append(dt)
        self.steps += 1
        if self.steps > self.warmup:
            self.total_s += dt
            self.comm_s += engine.comm_time_s - self._c0

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
