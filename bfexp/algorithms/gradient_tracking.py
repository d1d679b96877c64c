"""Gradient tracking: each rank keeps y_i, a running estimate of the average
gradient, and steps along it instead of its own gradient, which removes
DSGD's heterogeneity bias (exact convergence with a constant step).

form=diging — Nedic, Olshevsky, Shi, "Achieving Geometric Convergence for
Distributed Optimization over Time-Varying Graphs", SIAM J. Optim. 2017:

    x_{k+1} = W(k) x_k - a y_k
    y_{k+1} = W(k) y_k + grad f(x_{k+1}) - grad f(x_k)

form=atc — the adapt-then-combine form (Aug-DGM: Xu, Zhu, Soh, Xie, CDC
2015; NEXT: Di Lorenzo, Scutari, IEEE TSIPN 2016; ATC-DIGing for
time-varying graphs: Nedic, Olshevsky, Shi, Uribe, ACC 2017):

    x_{k+1} = W(k) (x_k - a y_k)
    y_{k+1} = W(k) (y_k + grad f(x_{k+1}) - grad f(x_k))

Both start the tracker at the local gradient, y_0 = grad f(x_0), and need
a doubly stochastic W (time-varying is fine: these papers are about
time-varying graphs; local SGD is W(k) = I between rounds). With doubly
stochastic W the mean of the y_i equals the mean of the current gradients
at every step.

Communication: in iteration k DIGing needs W(k) x_k (known before the
forward pass, so it is started then and runs during forward/backward) and
W(k-1) y_{k-1} (known at the end of the previous step, started there).
When W does not change (a static graph, every step a round) both are the
same matrix and travel in ONE message started before the forward pass.
The atc form mixes its tracker bucket by bucket during backward, then the model.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements, flat_grad, set_flat_grad_
from bfexp.algorithms.buckets import Bucket
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class GradientTracking(DecentralizedOptimizer):
    name: ClassVar[str] = "gradient_tracking"
    requires: ClassVar[Requirements] = Requirements(doubly_stochastic=True)
    bucketed: ClassVar[bool] = True  # the atc form mixes its tracker bucket by bucket
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=2)  # x and y
    stackable: ClassVar[bool] = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        form: Literal["diging", "atc"] = "diging",
        **options: Any,
    ) -> None:
        self.check_options(form=form)
        self.form = form
        super().__init__(optimizer, engine, topology, **options)
        if self.form == "diging" and self.buckets is not None:  # only the atc form mixes by bucket
            self.buckets.remove()
            self.buckets = None
        n = len(self.flat)  # elements of one rank's model (rows of a stacked buffer)
        # y_{-1} = 0 and grad_{-1} = 0 make the first update give y_0 = grad f(x_0).
        self.y = torch.zeros_like(self.flat)
        self.grad_prev = torch.zeros_like(self.flat)
        self.grad = torch.zeros_like(self.flat)
        # DIGing: x and y share one message when every iteration mixes with the same W
        # (not with Gossip-PGA, whose averaging rounds use J).
        assert self.topology is not None
        self.fused = not self.topology.is_dynamic and self.communication_period == 1 and not self.global_average_every
        # DIGing mixes copies in place: [x | y] in one buffer (fused), else one each.
        self.mixed = self.flat.new_zeros((2 * n, *self.flat.shape[1:])) if self.form == "diging" else None
        self._x_exchange: Handle | None = None  # W(k) x_k (fused: [W x_k, W y_{k-1}])
        self._y_exchange: Handle | None = None  # W(k-1) y_{k-1}

    # DIGing --------------------------------------------------------------
    def begin_iteration(self) -> None:
        k = self.iteration
        if not self.overlap:
            return
        if self.form == "atc":
            if k > 0 and self.communicates_now(k - 1):  # the tracker mixes with W(k-1)
                self.buckets.arm()  # type: ignore[union-attr]
        elif self.communicates_now():
            self._x_exchange = self._start_x_exchange()

    def _start_x_exchange(self) -> Handle:
        n = len(self.flat)
        assert self.mixed is not None
        self.mixed[:n].copy_(self.flat)
        if self.fused:
            self.mixed[n:].copy_(self.y)
            return self.start_mix(self.mixed, self.mixing_weights())
        return self.start_mix(self.mixed[:n], self.mixing_weights())

    def _start_y_exchange(self, iteration: int) -> Handle:
        assert self.mixed is not None
        wy = self.mixed[len(self.flat) :]
        wy.copy_(self.y)
        return self.start_mix(wy, self.mixing_weights(iteration))

    def _update_diging(self) -> None:
        k = self.iteration
        n = len(self.flat)
        assert self.mixed is not None
        wx, wy = self.mixed[:n], self.mixed[n:]
        flat_grad(self.params, out=self.grad)
        communicate = self.communicates_now()
        if self.fused:
            self.wait(self._x_exchange or self._start_x_exchange())
        else:
            if k > 0 and self.communicates_now(k - 1):
                self.wait(self._y_exchange or self._start_y_exchange(k - 1))
            else:
                wy.copy_(self.y)
            if communicate:
                self.wait(self._x_exchange or self._start_x_exchange())
        self._x_exchange = self._y_exchange = None
        torch.add(wy, self.grad, out=self.y).sub_(self.grad_prev)  # y_k = W(k-1) y_{k-1} + grad_k - grad_{k-1}
        set_flat_grad_(self.params, self.y)
        if communicate:
            wx.sub_(self.flat)  # W(k) x_k - x_k
            self.local_step()  # x_k - a y_k, as the local optimizer shapes it
            self.flat.add_(wx)  # x_{k+1} = W(k) x_k - a y_k
        else:
            self.local_step()
        if not self.fused and self.overlap and communicate:
            self._y_exchange = self._start_y_exchange(k)  # W(k) y_k, for step k+1

    # atc -----------------------------------------------------------------
    def bucket_ready(self, bucket: Bucket) -> Handle:
        # y_k = W(k-1) (y_{k-1} + grad_k - grad_{k-1}), this slice, in place
        s = slice(bucket.start, bucket.stop)
        flat_grad(list(bucket.params), out=self.grad[s])
        self.y[s].add_(self.grad[s]).sub_(self.grad_prev[s])
        return self.start_mix(self.y[s], self.mixing_weights(self.iteration - 1))

    def _update_atc(self, communicate: bool) -> None:
        k = self.iteration
        if k == 0:
            flat_grad(self.params, out=self.grad)
            self.y.copy_(self.grad)  # y_0 = grad f(x_0)
        elif self.communicates_now(k - 1):
            for _, handle in self.buckets.collect():  # type: ignore[union-attr]
                self.wait(handle)
        else:
            flat_grad(self.params, out=self.grad)
            self.y.add_(self.grad).sub_(self.grad_prev)
        set_flat_grad_(self.params, self.y)
        self.local_step()  # x_k - a y_k, as the local optimizer shapes it
        if communicate:
            self.wait(self.start_mix(self.flat, self.mixing_weights()))  # x_{k+1} = W(k) (...), in place

    # ---------------------------------------------------------------------
    def update(self, communicate: bool) -> None:
        if self.form == "diging":
            self._update_diging()
        else:
            self._update_atc(communicate)
        self.grad_prev.copy_(self.grad)

    def finish(self) -> None:
        for handle in (self._x_exchange, self._y_exchange):
            if handle is not None:
                self.wait(handle)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"y": self.y, "grad_prev": self.grad_prev}
