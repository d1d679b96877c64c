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

from typing import ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements, flat_grad, set_flat_grad_
from bfexp.algorithms.buckets import Bucket
from bfexp.comm.engine import Handle

FORMS = ("diging", "atc")


class GradientTracking(DecentralizedOptimizer):
    name: ClassVar[str] = "gradient_tracking"
    requires: ClassVar[Requirements] = Requirements(doubly_stochastic=True)
    bucketed: ClassVar[bool] = True  # the atc form mixes its tracker bucket by bucket

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.form = self.cfg.get("form", "diging")
        if self.form not in FORMS:
            raise ValueError(f"algorithm.form={self.form!r}; allowed: {', '.join(FORMS)}")
        if self.form == "diging" and self.buckets is not None:  # only the atc form mixes by bucket
            self.buckets.remove()
            self.buckets = None
        # y_{-1} = 0 and grad_{-1} = 0 make the first update give y_0 = grad f(x_0).
        self.y = torch.zeros_like(self.flat)
        self.grad_prev = torch.zeros_like(self.flat)
        self.grad = torch.zeros_like(self.flat)
        self.y_half = torch.zeros_like(self.flat)
        # DIGing: x and y share one message when every iteration mixes with the same W.
        assert self.topology is not None
        self.fused = not self.topology.is_dynamic and self.communication_period == 1
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
        elif not self.communicates_now():
            return
        elif self.fused:
            self._x_exchange = self.start_mix([self.flat.clone(), self.y.clone()], self.mixing_weights())
        else:
            self._x_exchange = self.start_mix(self.flat.clone(), self.mixing_weights())

    def _update_diging(self) -> None:
        k = self.iteration
        flat_grad(self.params, out=self.grad)
        wx, wy = self.flat.clone(), self.y
        if self.fused:
            handle = self._x_exchange or self.start_mix([self.flat, self.y], self.mixing_weights())
            wx, wy = self.wait(handle)
        else:
            if k > 0 and self.communicates_now(k - 1):
                wy = self.wait(self._y_exchange or self.start_mix(self.y, self.mixing_weights(k - 1)))
            if self.communicates_now():
                wx = self.wait(self._x_exchange or self.start_mix(self.flat, self.mixing_weights()))
        self._x_exchange = self._y_exchange = None
        self.y.copy_(wy).add_(self.grad).sub_(self.grad_prev)  # y_k = W(k-1) y_{k-1} + grad_k - grad_{k-1}
        step = self.local_update(grad=self.y)  # -a y_k, as the local optimizer shapes it
        self.flat.copy_(wx).add_(step)  # x_{k+1} = W(k) x_k - a y_k
        if not self.fused and self.overlap and self.communicates_now():
            self._y_exchange = self.start_mix(self.y.clone(), self.mixing_weights())  # W(k) y_k, for step k+1

    # atc -----------------------------------------------------------------
    def bucket_ready(self, bucket: Bucket) -> Handle:
        # y_k = W(k-1) (y_{k-1} + grad_k - grad_{k-1}), this slice
        s = slice(bucket.start, bucket.stop)
        flat_grad(list(bucket.params), out=self.grad[s])
        torch.add(self.y[s], self.grad[s], out=self.y_half[s]).sub_(self.grad_prev[s])
        return self.start_mix(self.y_half[s], self.mixing_weights(self.iteration - 1))

    def _update_atc(self, communicate: bool) -> None:
        k = self.iteration
        if k == 0:
            flat_grad(self.params, out=self.grad)
            self.y.copy_(self.grad)  # y_0 = grad f(x_0)
        elif self.communicates_now(k - 1):
            for bucket, handle in self.buckets.collect():  # type: ignore[union-attr]
                self.y[bucket.start : bucket.stop].copy_(self.wait(handle))
        else:
            flat_grad(self.params, out=self.grad)
            self.y.add_(self.grad).sub_(self.grad_prev)
        set_flat_grad_(self.params, self.y)
        self.local_step()  # x_k - a y_k, as the local optimizer shapes it
        if communicate:
            self.flat.copy_(self.wait(self.start_mix(self.flat, self.mixing_weights())))  # W(k) (...)

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
