"""SlowMo: slow momentum over periodically averaged local (base-optimizer) steps.

Wang, Tantia, Ballas, Rabbat, "SlowMo: Improving Communication-Efficient
Distributed SGD with Slow Momentum", ICLR 2020 (Algorithm 1). Every
tau = ``communication_period`` base-optimizer steps (learning rate gamma,
read from the local optimizer), with delta the average over ranks of
x_{t,0} - x_{t,tau}:

    u+       = beta u + delta / gamma
    x_{t+1,0} = x_{t,0} - alpha gamma u+

alpha = 1, beta = 0 is local SGD with periodic averaging. The slow momentum
sees the pseudo-gradient in units of the base learning rate, so a schedule of
gamma leaves its scale alone (DiLoCo's outer SGD is the same rule with
gamma folded into eta). ``average=allreduce`` is the paper's exact average;
``average=topology`` mixes the ranks' outer models over the topology (outer.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.outer import OuterOptimizer
from bfexp.comm.engine import Engine
from bfexp.errors import number_in
from bfexp.topology import Topology


class SlowMo(OuterOptimizer):
    name: ClassVar[str] = "slowmo"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        slow_lr: float = 1.0,
        slow_momentum: float = 0.5,
        communication_period: int = 12,
        **options: Any,
    ) -> None:
        """``slow_lr`` alpha, ``slow_momentum`` beta in [0, 1); ``average``,
        ``communication_period`` (tau) and the rest: see outer.py and base.py."""
        self.check_options(slow_lr=slow_lr, slow_momentum=slow_momentum)
        super().__init__(optimizer, engine, topology, communication_period=communication_period, **options)
        self.slow_lr = slow_lr
        self.slow_momentum = slow_momentum
        self.slow = torch.zeros_like(self.flat)  # u

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "slow_lr" in options:
            number_in("algorithm.slow_lr", options["slow_lr"], low=0, low_open=True)
        if "slow_momentum" in options:
            number_in("algorithm.slow_momentum", options["slow_momentum"], low=0, high=1, high_open=True)

    def outer_step(self, delta: torch.Tensor) -> None:
        gamma = float(self.optimizer.param_groups[0]["lr"])  # the base optimizer's learning rate
        u = self.slow.mul_(self.slow_momentum).add_(delta, alpha=1.0 / gamma)  # u+ = beta u + delta / gamma
        self.outer.sub_(u, alpha=self.slow_lr * gamma)  # x+ = x - alpha gamma u+

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**super().buffers(), "slow": self.slow}
