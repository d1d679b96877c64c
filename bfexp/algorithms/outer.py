"""An outer optimizer over local steps, averaged by allreduce or over the topology (DiLoCo, SlowMo).

Each rank runs the local optimizer (the inner one, from the optimizer group)
for H = ``communication_period`` steps from the outer model theta_i, then
takes an outer step along its pseudo-gradient delta_i = theta_i - x_i (where
the H inner steps led):

* ``average=allreduce`` (the papers' form): delta = (1/n) sum_j delta_j by one
  allreduce, and every rank takes the same outer step theta+ = Outer(theta, delta).
* ``average=topology``: each rank takes its own outer step and the results are
  mixed over the topology's W(r) (adapt, then combine, one model-sized message
  per neighbor): Theta+ = W(r) Outer(Theta, Delta). With W = J = 11^T / n and a
  common start this is the allreduce form (the outer step is linear in delta);
  over a sparse graph the ranks' outer models only agree approximately, as DSGD's do.

Then x_i = theta_i+ and the inner optimizer goes on (its state, e.g. AdamW's
moments, is kept across rounds). A subclass states ``outer_step``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements
from bfexp.comm.engine import Engine
from bfexp.costmodel import Traffic
from bfexp.errors import ConfigError
from bfexp.topology import Topology

Average = Literal["topology", "allreduce"]


class OuterOptimizer(DecentralizedOptimizer):
    """H local steps, then an outer step on the pseudo-gradient, averaged as ``average`` says."""

    requires: ClassVar[Requirements] = Requirements(row_stochastic=True)
    traffic: ClassVar[Traffic] = Traffic("neighbor")  # one model every H steps; traffic_of: allreduce if so
    overlaps: ClassVar[bool] = False  # the outer step needs the finished inner steps
    stackable: ClassVar[bool] = True  # elementwise plus engine operations (engine=stacked)

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None = None, *,
        average: Average = "topology", overlap: bool = False, **options: Any,
    ) -> None:
        self.check_options(average=average, **options)
        self.average = average  # before the base's topology check: average=allreduce reads no graph
        super().__init__(optimizer, engine, topology, overlap=overlap, **options)
        self.outer = self.flat.clone()  # theta_i: the outer model at the last round
        self.delta = torch.empty_like(self.flat)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if options.get("average") == "allreduce" and options.get("global_average_every"):
            raise ConfigError(f"algorithm.global_average_every={options['global_average_every']}; allowed: 0, "
                              f"since algorithm={cls.name} with algorithm.average=allreduce averages exactly already")

    @classmethod
    def reads_topology(cls, **options: Any) -> bool:
        """average=allreduce averages delta exactly, by one allreduce: any graph will do, its weights unread."""
        return options.get("average", "topology") != "allreduce"

    def topology_options(self) -> dict[str, Any]:
        return {"average": self.average}

    @classmethod
    def traffic_of(cls, **options: Any) -> Traffic:
        if options.get("average", "topology") == "allreduce":
            return dataclasses.replace(cls.traffic, kind="allreduce")
        return super().traffic_of(**options)

    def outer_step(self, delta: torch.Tensor) -> None:
        """theta_i := Outer(theta_i, delta) in place on ``self.outer``."""
        raise NotImplementedError

    def update(self, communicate: bool) -> None:
        self.local_step()  # an inner step
        if not communicate:
            return
        torch.sub(self.outer, self.flat, out=self.delta)  # delta_i = theta_i - x_i
        if self.average == "allreduce":
            self.wait(self.engine.iallreduce_(self.delta, op="avg"))
            self.outer_step(self.delta)
        else:
            self.outer_step(self.delta)
            self.wait(self.start_mix(self.outer, self.mixing_weights()))  # Theta+ = W(r) Outer(Theta, Delta)
        self.flat.copy_(self.outer)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"outer": self.outer}
