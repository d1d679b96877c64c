"""Push-DIGing: gradient tracking on directed, time-varying graphs.
Nedic, Olshevsky, Shi, "Achieving Geometric Convergence for Distributed
Optimization over Time-Varying Graphs", SIAM J. Optim. 2017, Algorithm 2.

C_k column stochastic; u (numerator), v (scalar weight, v_0 = 1), y (tracker):

    u_{k+1} = C_k (u_k - a y_k)
    v_{k+1} = C_k v_k
    x_{k+1} = u_{k+1} / v_{k+1}
    y_{k+1} = C_k y_k + grad f(x_{k+1}) - grad f(x_k)

with y_0 = grad f(x_0). The model's parameters hold x = u / v. Everything
a round pushes (u - a y, v, y) goes out in ONE message per out-neighbor;
it needs this step's gradient, so it is sent in step().
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements, flat_grad
from bfexp.comm.engine import Engine
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class PushDIGing(DecentralizedOptimizer):
    name: ClassVar[str] = "push_diging"
    requires: ClassVar[Requirements] = Requirements(column_stochastic=True)
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=2, scalars=1)  # [u | v | y] in one message
    stackable: ClassVar[bool] = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None = None, **options: Any
    ) -> None:
        super().__init__(optimizer, engine, topology, **options)
        n = len(self.flat)  # elements of one rank's model (rows of a stacked buffer)
        # What a round pushes, in one buffer mixed in place: [u | v | y].
        self.pushed = self.flat.new_zeros((2 * n + 1, *self.flat.shape[1:]))
        self.u, self.v, self.pushed_y = self.pushed[:n], self.pushed[n : n + 1], self.pushed[n + 1 :]
        self.u.copy_(self.flat)  # u_0 = x_0
        self.v.fill_(1.0)  # v_0 = 1
        # pushed_y holds C_{k-1} y_{k-1} between steps: 0 before the first
        # (with grad_{-1} = 0 the first update gives y_0 = grad f(x_0)).
        self.y = torch.zeros_like(self.flat)  # the tracker y_k
        self.grad = torch.zeros_like(self.flat)
        self.grad_prev = torch.zeros_like(self.flat)

    def update(self, communicate: bool) -> None:
        flat_grad(self.params, out=self.grad)
        self.pushed_y.add_(self.grad).sub_(self.grad_prev)  # y_k = C_{k-1} y_{k-1} + grad_k - grad_{k-1}
        self.y.copy_(self.pushed_y)
        self.u.add_(self.local_update(grad=self.y))  # u_k - a y_k, as the local optimizer shapes it
        if communicate:
            self.wait(self.start_push(self.pushed, self.mixing_weights()))  # C u, C v, C y in place
        torch.div(self.u, self.v, out=self.flat)  # x_{k+1} = u_{k+1} / v_{k+1}
        self.grad_prev.copy_(self.grad)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"pushed": self.pushed, "y": self.y, "grad_prev": self.grad_prev}
