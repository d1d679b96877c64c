"""Asynchronous push-sum SGD over one-sided windows: gradient-push without
rounds (Nedic & Olshevsky, "Distributed Optimization over Time-Varying
Directed Graphs", IEEE TAC 2015; Assran, Loizou, Ballas, Rabbat,
"Stochastic Gradient Push for Distributed Deep Learning", ICML 2019, the
overlap/asynchronous variant), in the manner of BlueFog's win-put optimizer.

Each rank i keeps a numerator x_i and a scalar weight w_i (w_0 = 1) in
its window's own value, and one slot per in-neighbor where senders add.
With A(t) column stochastic (a_ki: the share i sends to k), one local
iteration of rank i is

    before forward:  (x_i, w_i) += sum_j slot_i(j); slots <- 0      (win_update, reset)
                     z_i = x_i / w_i                                  (the model)
    in step():       x_i <- x_i - a grad f_i(z_i)
                     slot_k(i) += a_ki (x_i, w_i) for out-neighbors k  (win_accumulate, no waiting)
                     (x_i, w_i) <- a_ii (x_i, w_i)
                     (x_i, w_i) += sum_j slot_i(j); slots <- 0; z_i = x_i / w_i   (the model after step())

whenever it gets there: no rank waits for another, a slow rank's pushes are
simply folded in later (Assran & Rabbat, "Asynchronous Gradient-Push",
IEEE TAC 2021, analyse this setting: a neighborhood of the optimum whose
size depends on the degree of asynchrony, the optimum itself when the
ranks run at one rate; tests/algorithms/test_async.py measures the error of
a diminishing step, in each rank's own iteration count, with stragglers). Every operation moves mass (x, w) without creating
or losing any, so sum_i (w_i + slots) = n, sum_i (x_i + slots) = sum_i
(x_i(0) + u_i) with u_i the sum of the local updates rank i added (kept,
``_applied``: the ledger tests/test_budget.py checks the checkpoint
against), and z_i -> the average of the x_i(0) when no gradient is added,
on directed and time-varying graphs (t = this rank's own round count).

Consistency under concurrency: a peer's accumulate holds the target's window
memory (MPI: a passive-target lock on the target; virtual ranks: the
window's lock), and the fold holds this rank's memory exclusively, so a fold
sees each arrival whole (data and weight together) or not at all. Only this
rank writes its own value. When every rank's pushes of iteration k land
before any rank's fold of iteration k + 1 (equal step times), the iterates
are synchronous push-sum's. A caveat of the rule: a rank that pushes many
times without receiving sees w_i shrink geometrically, and its z_i then
moves by a / w_i per step (with one straggler on one_peer_exp2 and the
ranks meeting at every logging step, w of the straggler fell to 0.014 in 10
steps and its model blew up). So a rank whose weight is below
``min_weight`` holds its push until mass has come back to it (A(t) = I for
that rank: still column stochastic, every sum still invariant, and since
the weights sum to n, ranks at or above the floor always exist and keep
mixing); z_i then moves by at most a / (a_ii min_weight) per step. With equal
step times on a regular graph w stays 1 and the floor never acts.
``min_weight=0`` is the papers' rule (tests/algorithms/test_async.py shows
its 1/sqrt(k) rate with stragglers; holding pushes slows mixing there, the
price of the default's stability: digits/MLP, 8 virtual ranks, one 4x
straggler, 100 steps: consensus distance 0.2-1.5 and accuracy 0.81 with
the default, 14-8728 and 0.78 with 0). Stopping: ``finish()`` (collective) waits for
this rank's pushes, meets every rank at a barrier (so every push has
landed) and folds what arrived; ``close()`` frees the window. A checkpoint
keeps the window whole instead of folding: (x, w) and the slots as they
are, so a resumed rank folds each arrival when the uninterrupted one would
(a fold at the checkpoint adds the same numbers in another order: a run
stopped mid-budget then resumed ends some 1e-7 away from an uninterrupted
one).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.asynchronous import AsynchronousOptimizer
from bfexp.algorithms.base import Requirements, neighbors_over_period, window_name
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.errors import number_in
from bfexp.topology import Topology


class AsyncPushSum(AsynchronousOptimizer):
    name: ClassVar[str] = "async_push_sum"
    requires: ClassVar[Requirements] = Requirements(column_stochastic=True)
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=1, scalars=1)  # w travels with x

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        min_weight: float = 0.5,
        **options: Any,
    ) -> None:
        """``min_weight``: in [0, 1); a rank whose push-sum weight is below it holds its pushes (0: never)."""
        self.check_options(min_weight=min_weight)
        super().__init__(optimizer, engine, topology, **options)
        self.min_weight = float(min_weight)
        assert self.topology is not None
        srcs, dsts = neighbors_over_period(self.topology, engine.rank)
        self.window = window_name(engine, self.name)
        # The own value is the numerator x (x_0 = z_0), its window weight w (w_0 = 1).
        self.x = engine.win_create(self.flat, self.window, srcs, dsts, zero_init=True, weight=1.0)
        self._srcs = {j: 1.0 for j in srcs}
        self._src_list, self._dst_list = srcs, dsts
        self._saved_numerator = torch.empty(0)  # x, kept for state_dict
        self._pending: list[Handle] = []
        self._saved_weight = torch.ones(1, dtype=torch.float64)  # w, kept for state_dict
        # What has arrived and is not yet folded in, and its weights, kept for state_dict (a checkpoint
        # taken where ranks stopped mid-budget holds messages that landed after the rank's last fold).
        self._saved_slots = torch.zeros(len(srcs), self.x.numel(), dtype=self.x.dtype)
        self._saved_slot_weights = torch.zeros(len(srcs), dtype=torch.float64)
        self._applied = torch.zeros_like(self.x)  # u: the local updates this rank added to x (module doc)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "min_weight" in options:
            number_in("algorithm.min_weight", options["min_weight"], low=0, high=1, high_open=True)

    @property
    def weight(self) -> float:
        return self.engine.win_weight(self.window)

    def begin_iteration(self) -> None:
        """Fold in what arrived since the last fold, and de-bias: the forward pass sees z = x / w."""
        self._wait_pending()
        self._fold()

    def _fold(self) -> None:
        """(x, w) += what arrived, slots emptied; the model := z = x / w."""
        self.wait(self.engine.iwin_update(self.window, 1.0, self._srcs, reset=True))
        self._debias()

    def _debias(self) -> None:
        """The model := z = x / w."""
        with self.engine.win_lock(self.window):
            if self.x.device == self.flat.device:
                torch.div(self.x, self.weight, out=self.flat)
            else:  # window memory lives on the host (engine=nccl)
                self.flat.copy_(self.x / self.weight)

    def update(self, communicate: bool) -> None:
        self._wait_pending()
        step = self.local_update().to(self.x.device)  # what the local optimizer would add at z
        with self.engine.win_lock(self.window):
            self.x.add_(step)
        self._applied.add_(step)
        if communicate and self.weight >= self.min_weight:  # below the floor: hold, wait for mass to come back
            a = self.mixing_weights()  # this rank's column of A(t), t = its own round
            self._pending.append(
                self.engine.iwin_accumulate(None, self.window, self_weight=a.self_weight, dst_weights=a.dst_weights))
            if not self.overlap:
                self._wait_pending()
        # A yield point (no time passes): on virtual ranks in simulated time, every rank whose clock is
        # here pushes before any of them folds (equal step times then give synchronous push-sum's iterates).
        self.engine.advance(0.0)
        # After step() the model holds this step's iterate, what has arrived folded in, as every synchronous
        # rule's model does (virtual ranks at equal clocks, or a user's script in turns: synchronous push-sum's).
        self._fold()

    def _wait_pending(self) -> None:
        for handle in self._pending:
            self.wait(handle)
        self._pending = []

    def drain(self) -> None:
        self._wait_pending()

    def settle(self) -> None:
        self.begin_iteration()  # every push has landed: fold them in and de-bias

    # checkpoints: every push landed first (collective, as every rank checkpoints at once), then exact ------
    def state_dict(self) -> dict:
        self.quiesce()  # nothing folded: the slots are kept as they are (module doc)
        with self.engine.win_lock(self.window):
            self._saved_numerator = self.x.detach().clone()
            self._saved_weight.fill_(self.weight)
        self._saved_slots, self._saved_slot_weights = self.engine.win_slots(self.window)
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._saved_numerator = torch.empty_like(self.x)
        super().load_state_dict(state)  # the local optimizer, the iteration, the saved window, the ledger
        # A fresh window holding the saved numerator, weight and slots exactly (collective, as the resume is).
        self.engine.win_free(self.window)
        self.x = self.engine.win_create(self._saved_numerator, self.window, self._src_list, self._dst_list,
                                        zero_init=True, weight=float(self._saved_weight))
        self.engine.win_set_slots(self.window, self._saved_slots, self._saved_slot_weights)
        self._debias()  # z = x / w into the model; the slots are folded in where the rank's next step begins

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"_saved_numerator": self._saved_numerator, "_saved_weight": self._saved_weight,
                "_saved_slots": self._saved_slots, "_saved_slot_weights": self._saved_slot_weights,
                "_applied": self._applied}
