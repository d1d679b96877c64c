"""Pair-wise gossip averaging with interpolation, in the style of the Dpwa
project (distributed pair-wise averaging: each worker fetches a random
peer's parameters in the background and interpolates), with the pair-wise
gossip of Boyd, Ghosh, Prabhakar & Shah, "Randomized Gossip Algorithms",
IEEE Trans. Inf. Theory 2006, for its averaging.

Rank i trains on its own and, with probability p per step, exchanges with a
random neighbor j (picked with probability proportional to j's flow-control
score). The exchange is one atomic transaction on both ranks' windows:

    x_i <- (1 - f_i) x_i + f_i x_j
    x_j <- (1 - f_j) x_j + f_j x_i          (two_way; else x_j is left alone)

    constant:  f_i = f_j = factor
    clock:     f_i = c_j / (c_i + c_j),  f_j = c_i / (c_i + c_j)   (c: local steps trained)
    loss:      f_i = l_i / (l_i + l_j),  f_j = l_j / (l_i + l_j)   (move toward the lower loss)
    divergence_threshold d > 0: f_i <- f_i * min(1, l_i / d) (a model whose loss is already low
    is pulled less), and the same for f_j with l_j.

With factor 1/2 (two-way) both end with (x_i + x_j) / 2: the pair's sum,
hence every rank's sum, is conserved by every exchange. Gradient steps are
x_i <- x_i - a grad f_i(x^_i), with x^_i the model as it was read at the end
of the previous step (peers may have changed x_i since: the step is added).

Consistency: each rank's model x_i lives in its window's own value, with
(c_i, l_i) behind it. The exchange holds both windows (MPI: exclusive
passive-target locks; virtual ranks: the windows' locks), taken in
ascending rank order, so two exchanges never deadlock and a model is never
read half written; the local step is added under this rank's lock.
Background fetch and flow control: with overlap=true the exchange runs on
the engine's window thread while the next step computes; if it has not
finished ``timeout_s`` after it started (the engine's clock: wall time on
MPI ranks, simulated time on virtual ones), its peer's score halves (slow peers
get picked less), and a finished one doubles it back (at most 1). An
exchange is never abandoned (the peer's side is already applied), but no
second one starts while one is in flight. ``finish()`` (collective) waits
for this rank's exchange and meets every rank at a barrier; ``close()``
frees the window.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch

from bfexp.algorithms.asynchronous import AsynchronousOptimizer
from bfexp.algorithms.base import Requirements, neighbors_over_period, window_name
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.errors import ConfigError, number_in
from bfexp.topology import Topology

MIN_SCORE = 1.0 / 64


class Gossip(AsynchronousOptimizer):
    name: ClassVar[str] = "gossip"
    requires: ClassVar[Requirements] = Requirements()  # any graph: its edges say who may pair up
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=2, scalars=2)  # a model each way, with (c, l)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        interpolation: Literal["constant", "clock", "loss"] = "constant",
        factor: float = 0.5,
        fetch_probability: float = 1.0,
        timeout_s: float = 1.0,
        divergence_threshold: float = 0.0,
        two_way: bool = True,
        seed: int = 0,
        **options: Any,
    ) -> None:
        self.check_options(interpolation=interpolation, factor=factor, fetch_probability=fetch_probability,
                           timeout_s=timeout_s, divergence_threshold=divergence_threshold, two_way=two_way,
                           seed=seed)
        super().__init__(optimizer, engine, topology, **options)
        assert self.topology is not None
        self.interpolation = interpolation
        self.factor = float(factor)
        self.fetch_probability = float(fetch_probability)
        self.timeout_s = float(timeout_s)
        self.divergence_threshold = float(divergence_threshold)
        self.two_way = two_way
        srcs, dsts = neighbors_over_period(self.topology, engine.rank)
        self.peers = sorted(set(srcs) | set(dsts))
        self.scores = {j: 1.0 for j in self.peers}
        self._rng = self.peer_stream(seed)
        self.window = window_name(engine, self.name)
        n = self.flat.numel()
        self._n = n
        shared = torch.empty(n + 2, dtype=self.flat.dtype, device=self.flat.device)
        shared[:n] = self.flat
        shared[n] = 0.0  # c: local steps trained
        shared[n + 1] = math.nan if self._uses_loss else 0.0  # l: the last loss (unknown yet; unused: 0)
        # Peers exchange with every neighbor over one period of the graph, in both directions.
        self.shared = engine.win_create(shared, self.window, self.peers, self.peers, zero_init=True)
        self.model = self.shared[:n]
        self._loss: torch.Tensor | None = None
        self._inflight: tuple[Handle, int, float, bool] | None = None  # handle, peer, start, late
        self.exchanges = 0
        self.timeouts = 0
        # Tests set a list here to see every exchange: (mine before, theirs before, mine after, theirs after).
        self.exchange_log: list | None = None

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        ranges = {
            "factor": {"low": 0, "high": 1, "low_open": True},
            "fetch_probability": {"low": 0, "high": 1, "low_open": True},
            "timeout_s": {"low": 0, "low_open": True},
            "divergence_threshold": {"low": 0, "note": "(a loss; 0 = off)"},
        }
        for key, bounds in ranges.items():
            if key in options:
                number_in(f"algorithm.{key}", options[key], **bounds)
        if "two_way" in options and not isinstance(options["two_way"], bool):
            raise ConfigError(f"algorithm.two_way={options['two_way']!r}; allowed: true, false")

    # the rule -------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        self._loss = loss

    def update(self, communicate: bool) -> None:
        step = self.local_update()  # at x^, the model as read at the end of the last step
        loss = (float(self._loss) if self._loss is not None else math.nan) if self._uses_loss else 0.0
        with self.engine.win_lock(self.window):
            self.model.add_(step.to(self.model.device))  # window memory: on the host for engine=nccl
            self.shared[self._n] += 1.0
            self.shared[self._n + 1] = loss
        self._poll()
        if communicate and self.peers and self._inflight is None and self._rng.random() < self.fetch_probability:
            peer = self._pick()
            handle = self.engine.iwin_exchange(self.window, peer, self._combine)
            self._inflight = (handle, peer, self.engine.clock_s, False)
            if not self.overlap:
                self._poll(wait=True)
        with self.engine.win_lock(self.window):
            self.flat.copy_(self.model)

    @property
    def _uses_loss(self) -> bool:
        return self.interpolation == "loss" or self.divergence_threshold > 0

    def _pick(self) -> int:
        """A neighbor, each with probability proportional to its flow-control score."""
        return self._rng.choices(self.peers, weights=[self.scores[j] for j in self.peers])[0]

    def _poll(self, wait: bool = False) -> None:
        """Settle the exchange in flight: finished ones restore their peer's score, late ones cut it."""
        if self._inflight is None:
            return
        handle, peer, started, late = self._inflight
        if not wait and not handle.done():
            if not late and self.engine.clock_s - started > self.timeout_s:
                self.scores[peer] = max(MIN_SCORE, self.scores[peer] / 2)
                self.timeouts += 1
                self._inflight = (handle, peer, started, True)
            return
        self.wait(handle)
        if not late:
            self.scores[peer] = min(1.0, self.scores[peer] * 2)
        self.exchanges += 1
        self._inflight = None

    def fractions(self, mine: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
        """(f_i, f_j) from the two ranks' (clock, loss) (the module doc's table)."""
        c_i, l_i = float(mine[0]), float(mine[1])
        c_j, l_j = float(theirs[0]), float(theirs[1])
        f_i = f_j = self.factor
        if self.interpolation == "clock" and c_i + c_j > 0:
            f_i, f_j = c_j / (c_i + c_j), c_i / (c_i + c_j)
        elif self.interpolation == "loss" and math.isfinite(l_i + l_j) and l_i + l_j > 0:
            f_i, f_j = l_i / (l_i + l_j), l_j / (l_i + l_j)
        d = self.divergence_threshold
        if d > 0:
            f_i *= min(1.0, l_i / d) if math.isfinite(l_i) else 1.0
            f_j *= min(1.0, l_j / d) if math.isfinite(l_j) else 1.0
        return f_i, f_j

    def _combine(self, mine: torch.Tensor, theirs: torch.Tensor) -> None:
        """The exchange, run while both windows are held (see the module doc)."""
        n = self._n
        f_i, f_j = self.fractions(mine[n:], theirs[n:])
        before = (mine.clone(), theirs.clone()) if self.exchange_log is not None else None
        x_i = mine[:n].clone() if self.two_way else None
        mine[:n].mul_(1 - f_i).add_(theirs[:n], alpha=f_i)
        if x_i is not None:
            theirs[:n].mul_(1 - f_j).add_(x_i, alpha=f_j)
        if before is not None:
            self.exchange_log.append((before[0][:n], before[1][:n], mine[:n].clone(), theirs[:n].clone()))

    # stopping -------------------------------------------------------------
    def drain(self) -> None:
        self._poll(wait=True)

    # checkpoints: drained first (collective: every rank checkpoints at the same step) --------------
    def state_dict(self) -> dict:
        self.finish()
        with self.engine.win_lock(self.window):
            shared = self.shared.detach().clone()
        return {**super().state_dict(), "gossip": {"shared": shared, "rng": self._rng.getstate(),
                                                   "scores": dict(self.scores), "exchanges": self.exchanges,
                                                   "timeouts": self.timeouts}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        own = state["gossip"]
        self._rng.setstate(own["rng"])
        self.scores = dict(own["scores"])
        self.exchanges, self.timeouts = own["exchanges"], own["timeouts"]
        with self.engine.win_lock(self.window):
            self.shared.copy_(own["shared"])
            self.flat.copy_(self.model)
        self.engine.barrier()  # no exchange reaches a window before every rank has restored its own
