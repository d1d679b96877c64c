"""The Horovod-style baseline (Sergeev & Del Balso 2018): every rank applies
the global average gradient, so all ranks hold the same model.

    g = (1/n) sum_i F_i(x);   x+ = x - a g
"""

from __future__ import annotations

from typing import ClassVar

from bfexp.algorithms.base import DecentralizedOptimizer, flat_grad, set_flat_grad_


class Allreduce(DecentralizedOptimizer):
    name: ClassVar[str] = "allreduce"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._grad = None

    def step(self) -> None:
        self._grad = flat_grad(self.params, self._grad)
        averaged = self.engine.allreduce(self._grad, op="avg")
        set_flat_grad_(self.params, averaged)
        self.optimizer.step()
        self.iteration += 1
