"""Decentralized SGD (Lian et al., "Can Decentralized Algorithms Outperform
Centralized Algorithms?", NeurIPS 2017; Chen & Sayed 2012 for ATC/CTA diffusion).

X stacks the ranks' parameters, W is the mixing matrix, F the local gradients:

    atc (adapt-then-combine):  X+ = W (X - a F(X))
    awc (adapt-while-combine, the D-PSGD form):  X+ = W X - a F(X)

With heterogeneous data DSGD converges to a neighborhood of the optimum
whose size is O(a): the bias that exact diffusion and gradient tracking remove.
"""

from __future__ import annotations

from typing import ClassVar

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements


class DSGD(DecentralizedOptimizer):
    name: ClassVar[str] = "dsgd"
    requires: ClassVar[Requirements] = Requirements(row_stochastic=True)

    def step(self) -> None:
        style = self.cfg.get("style", "atc")
        communicate = self.communicates_now()
        if style == "atc":
            self.optimizer.step()  # X - a F(X)
            if communicate:
                self.mix_(self.flat)  # W (...)
        elif style == "awc":
            before = self.flat.clone()
            self.optimizer.step()
            update = self.flat - before  # -a F(X) as the local optimizer shapes it
            if communicate:
                self.flat.copy_(before)
                self.mix_(self.flat)  # W X
            self.flat.add_(update)
        else:
            raise ValueError(f"algorithm.style={style!r}; allowed: atc, awc")
        self.iteration += 1
