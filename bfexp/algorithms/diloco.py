"""DiLoCo: local steps with an inner optimizer, outer Nesterov momentum on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023 (Algorithm 1: inner AdamW, H = 500; outer SGD with
Nesterov momentum 0.9, learning rate 0.7). Every H = ``communication_period``
steps, with delta the average over ranks of theta - x_i (where each rank's
H inner steps led from the outer model theta), torch's Nesterov SGD:

    m      = mu m + delta
    theta+ = theta - eta (delta + mu m)        (nesterov=false: theta - eta m)

``average=allreduce`` is the paper's (one allreduce of delta); ``average=topology``
mixes the ranks' outer models over the topology instead (see outer.py), so
``algorithm=diloco topology=one_peer_exp2`` runs DiLoCo over one-peer gossip.
With H = 1, inner SGD and outer SGD with eta = 1, mu = 0 it is allreduce SGD.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.outer import OuterOptimizer
from bfexp.comm.engine import Engine
from bfexp.errors import number_in
from bfexp.topology import Topology


class DiLoCo(OuterOptimizer):
    name: ClassVar[str] = "diloco"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        communication_period: int = 20,
        **options: Any,
    ) -> None:
        """``outer_lr`` eta, ``outer_momentum`` mu in [0, 1), ``nesterov``: the outer SGD's;
        ``average``, ``communication_period`` (H) and the rest: see outer.py and base.py."""
        self.check_options(outer_lr=outer_lr, outer_momentum=outer_momentum)
        super().__init__(optimizer, engine, topology, communication_period=communication_period, **options)
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.momentum = torch.zeros_like(self.flat)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "outer_lr" in options:
            number_in("algorithm.outer_lr", options["outer_lr"], low=0, low_open=True)
        if "outer_momentum" in options:
            number_in("algorithm.outer_momentum", options["outer_momentum"], low=0, high=1, high_open=True)

    def outer_step(self, delta: torch.Tensor) -> None:
        mu = self.outer_momentum
        m = self.momentum.mul_(mu).add_(delta)  # m = mu m + delta
        step = delta.add(m, alpha=mu) if self.nesterov else m
        self.outer.sub_(step, alpha=self.outer_lr)  # theta+ = theta - eta step

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**super().buffers(), "momentum": self.momentum}
