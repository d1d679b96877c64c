"""Asynchronous decentralized parallel SGD: AD-PSGD (Lian, Zhang, Zhang &
Liu, "Asynchronous Decentralized Parallel Stochastic Gradient Descent",
ICML 2018, Algorithm 1).

Every rank loops, at its own pace, without waiting for any other:

    x^_i = x_i                                   (read the model)
    g_i  = grad F_i(x^_i; xi)                    (forward, backward)
    x_i, x_j <- (x_i + x_j) / 2                  (atomic, j a random neighbor)
    x_i  <- x_i - a g_i                          (the gradient of the model as read)

Each averaging is a symmetric, doubly stochastic W_k = I - (e_i - e_j)(e_i - e_j)^T / 2
applied to the current models, so sum_i x_i changes only by the gradient
steps; with a diminishing step a_k the iterates reach the optimum at the
rate of decentralized SGD (the paper's Theorem 1: O(1/sqrt(K)) to a
stationary point for a ~ 1/sqrt(K); on a strongly convex problem with
a_k ~ 1/k, error O(1/k)), despite staleness.

Atomicity and no deadlock: x_i is the own value of rank i's window; the
averaging is one ``win_exchange`` transaction that holds both ranks'
windows (MPI: exclusive passive-target locks; virtual ranks: the windows'
locks) while it reads x_j, writes the mean to both, and releases. Locks are
taken in ascending rank order, a global order, so no cycle of ranks can wait
for one another: the role the paper's active/passive bipartite split plays
(its passive workers never initiate), without restricting who may start an
exchange. The gradient step is added under this rank's lock, so an averaging
that lands meanwhile is kept (never overwritten) and never read half done.
With overlap=true the averaging is started at the start of the iteration
(on the engine's window thread) and runs while the gradient is computed, as
in the paper's implementation. ``finish()`` (collective) waits for this
rank's averaging and meets every rank at a barrier; ``close()`` frees the
window.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.asynchronous import AsynchronousOptimizer
from bfexp.algorithms.base import Requirements, neighbors_over_period, window_name
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


def average_pair_(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """Both become (mine + theirs) / 2, bit-identical on both sides."""
    mine.add_(theirs).mul_(0.5)
    theirs.copy_(mine)


class ADPSGD(AsynchronousOptimizer):
    name: ClassVar[str] = "ad_psgd"
    requires: ClassVar[Requirements] = Requirements()  # any graph: its edges say who may pair up
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=2)  # the model each way with one neighbor

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        seed: int = 0,
        **options: Any,
    ) -> None:
        self.check_options(seed=seed)
        super().__init__(optimizer, engine, topology, **options)
        assert self.topology is not None
        srcs, dsts = neighbors_over_period(self.topology, engine.rank)
        self.peers = sorted(set(srcs) | set(dsts))
        self._rng = self.peer_stream(seed)
        self.window = window_name(engine, self.name)
        self.model = engine.win_create(self.flat, self.window, self.peers, self.peers, zero_init=True)
        self._inflight: Handle | None = None
        self.averagings = 0

    def begin_iteration(self) -> None:
        if self.overlap:
            self._start_averaging()

    def _start_averaging(self) -> None:
        if self._inflight is None and self.peers and self.communicates_now():
            peer = self._rng.choice(self.peers)
            self._inflight = self.engine.iwin_exchange(self.window, peer, average_pair_)

    def _averaging_done(self) -> None:
        if self._inflight is not None:
            self.wait(self._inflight)
            self._inflight = None
            self.averagings += 1

    def update(self, communicate: bool) -> None:
        step = self.local_update()  # -a g at x^, the model as read
        if not self.overlap:
            self._start_averaging()
        self._averaging_done()
        with self.engine.win_lock(self.window):
            self.model.add_(step.to(self.model.device))  # window memory: on the host for engine=nccl
            self.flat.copy_(self.model)  # the next x^

    def drain(self) -> None:
        self._averaging_done()

    # checkpoints: drained first (collective: every rank checkpoints at the same step) --------------
    def state_dict(self) -> dict:
        self.finish()
        with self.engine.win_lock(self.window):
            model = self.model.detach().clone()
        return {**super().state_dict(), "ad_psgd": {"model": model, "rng": self._rng.getstate(),
                                                    "averagings": self.averagings}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        own = state["ad_psgd"]
        self._rng.setstate(own["rng"])
        self.averagings = own["averagings"]
        with self.engine.win_lock(self.window):
            self.model.copy_(own["model"])
            self.flat.copy_(self.model)
        self.engine.barrier()  # no averaging reaches a window before every rank has restored its own
