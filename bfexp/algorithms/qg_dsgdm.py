"""QG-DSGDm: decentralized SGD with quasi-global momentum.

Lin, Karimireddy, Stich, Jaggi, "Quasi-Global Momentum: Accelerating
Decentralized Deep Learning on Heterogeneous Data", ICML 2021 (Algorithm 1).
Local heavy-ball momentum on non-iid data follows each rank's own gradients
away from the others; here the momentum buffer m_hat_i tracks the *global*
direction instead: how far the model moved in a whole step, gossip included.

    m_i      = beta m_hat_i + g_i                    (Nesterov: g_i + beta (beta m_hat_i + g_i))
    x_half_i = x_i - a m_i
    x_i+     = sum_j W_ij x_half_j                   (DSGD, adapt then combine)
    d_i      = (x_i - x_i+) / a
    m_hat_i  = mu m_hat_i + (1 - mu) d_i             (mu = beta, as in the paper)

The step x - a m_i is the local optimizer's, given m_i as its gradient:
``optimizer=sgd`` with ``optimizer.momentum=0`` is the paper's rule (the
momentum is the algorithm's; local momentum would apply twice), and its
learning rate is a. With W = I the update is heavy-ball SGD with a damped
buffer; on a fully connected W every rank holds the global momentum.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements, flat_grad
from bfexp.comm.engine import Engine
from bfexp.errors import number_in
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class QGDSGDm(DecentralizedOptimizer):
    name: ClassVar[str] = "qg_dsgdm"
    stackable: ClassVar[bool] = True  # elementwise plus engine operations (engine=stacked)
    requires: ClassVar[Requirements] = Requirements(row_stochastic=True)
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=1)  # the model; m_hat stays local
    overlaps: ClassVar[bool] = False  # the exchange sends the finished step's x_half

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        momentum: float = 0.9,
        nesterov: bool = False,
        overlap: bool = False,
        **options: Any,
    ) -> None:
        """``momentum`` beta in [0, 1) (also the buffer's decay mu); ``nesterov``: QG-DSGDm-N."""
        self.check_options(momentum=momentum)
        super().__init__(optimizer, engine, topology, overlap=overlap, **options)
        self.momentum = momentum
        self.nesterov = nesterov
        self.m_hat = torch.zeros_like(self.flat)  # the quasi-global momentum
        self.start = torch.empty_like(self.flat)  # x_i at the start of the step
        self.direction = torch.empty_like(self.flat)
        self.grad = torch.empty_like(self.flat) if nesterov else None  # g_i again (its buffer's layout: stacked too)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "momentum" in options:
            number_in("algorithm.momentum", options["momentum"], low=0, high=1, high_open=True)

    def update(self, communicate: bool) -> None:
        beta = self.momentum
        g = flat_grad(self.params, out=self.direction)
        m = g.add_(self.m_hat, alpha=beta)  # m_i = beta m_hat_i + g_i
        if self.nesterov:
            m.mul_(beta).add_(flat_grad(self.params, out=self.grad))  # g_i + beta m_i
        self.start.copy_(self.flat)
        self.flat.add_(self.local_update(m))  # x_half = x - a m_i
        if communicate:
            self.wait(self.start_mix(self.flat, self.mixing_weights()))  # x+ = W x_half
        lr = float(self.optimizer.param_groups[0]["lr"])
        d = self.start.sub_(self.flat).div_(lr)  # d_i = (x_i - x_i+) / a
        self.m_hat.mul_(beta).add_(d, alpha=1.0 - beta)  # m_hat = mu m_hat + (1 - mu) d, mu = beta

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"m_hat": self.m_hat}
