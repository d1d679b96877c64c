"""Decentralized SGD in its three orderings of "adapt" (local gradient step)
and "combine" (neighbor averaging).

Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?", NeurIPS 2017 (D-PSGD, the awc form); Chen & Sayed, "Diffusion
Adaptation Strategies for Distributed Optimization and Learning over
Networks", IEEE TSP 2012 (ATC and CTA diffusion).

X stacks the ranks' parameters, W is the mixing matrix, F the local gradients:

    atc  (adapt-then-combine):       X+ = W (X - a F(X))
    awc  (adapt-while-combine, D-PSGD): X+ = W X - a F(X)
    cta  (combine-then-adapt):       X+ = W X - a F(W X)

atc mixes the freshly updated model, so its exchange can only overlap the
rest of backward (buckets start as their gradients arrive). awc mixes the
model the gradient is taken at, so the whole exchange runs during forward
and backward. cta mixes before the forward pass, so the gradient really is
taken at the mixed point; its exchange is started at the end of step() and
completed at the start of the next iteration.

With heterogeneous data DSGD converges to a neighborhood of the optimum
whose size is O(a): the bias that exact diffusion and gradient tracking remove.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements
from bfexp.algorithms.buckets import Bucket
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class DSGD(DecentralizedOptimizer):
    name: ClassVar[str] = "dsgd"
    requires: ClassVar[Requirements] = Requirements(row_stochastic=True)
    bucketed: ClassVar[bool] = True  # atc adapts bucket by bucket
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=1)
    stackable: ClassVar[bool] = True  # elementwise plus engine operations (engine=stacked)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        style: Literal["atc", "awc", "cta"] = "atc",
        **options: Any,
    ) -> None:
        self.check_options(style=style)
        self.style = style
        super().__init__(optimizer, engine, topology, **options)
        self._exchange: Handle | None = None  # awc: W X in flight; cta: W X+ in flight
        # awc and cta mix a copy of the model in place (the model itself stays usable meanwhile)
        self.mixed = torch.empty_like(self.flat) if self.style != "atc" else None
        self._backward_at = -1  # cta: the iteration of the last backward pass
        self._backward_hooks = []
        if self.style == "cta":
            self._backward_hooks = [
                p.register_post_accumulate_grad_hook(self._saw_backward) for p in self.params if p.requires_grad
            ]
        if self.style != "atc" and self.buckets is not None:  # only atc adapts bucket by bucket
            self.buckets.remove()
            self.buckets = None

    # begin: before forward ---------------------------------------------------
    def begin_iteration(self) -> None:
        communicate = self.communicates_now()
        if self.style == "atc":
            super().begin_iteration()  # watch backward for buckets
        elif self.style == "awc" and communicate and self.overlap:
            self._start_awc_exchange()
        elif self.style == "cta" and communicate:
            # Combine first: the forward pass must see W X.
            if self._exchange is None:
                self.wait(self.start_mix(self.flat, self.mixing_weights()))
            else:
                self.wait(self._exchange)
                self.flat.copy_(self.mixed)  # type: ignore[arg-type]
            self._exchange = None

    def _start_awc_exchange(self) -> None:
        self.mixed.copy_(self.flat)  # type: ignore[union-attr]
        self._exchange = self.start_mix(self.mixed, self.mixing_weights())  # type: ignore[arg-type]

    def _saw_backward(self, param) -> None:
        self._backward_at = self.iteration

    def begins_before_forward(self) -> bool:
        # awc starts its exchange there, cta combines
        return self.begins_its_own_way(DSGD) or self.style != "atc" or self.watches_backward()

    def late_begin(self) -> None:
        # A backward pass ran before the combine: its gradient is not at W X.
        if self.style == "cta" and self.communicates_now() and self._backward_at == self.iteration:
            raise RuntimeError(
                "dsgd style=cta mixes before the forward pass: call zero_grad() before forward, "
                "or give the optimizer wrapper the model (model=...)"
            )
        super().late_begin()

    # during backward: atc ------------------------------------------------
    def bucket_ready(self, bucket: Bucket) -> Handle:
        self.local_step(bucket.params)  # X - a F(X), this slice
        return self.start_mix(self.flat[bucket.start : bucket.stop], self.mixing_weights())

    # step ----------------------------------------------------------------
    def update(self, communicate: bool) -> None:
        if communicate and self.style == "atc":
            for _, handle in self.buckets.collect():  # type: ignore[union-attr]
                self.wait(handle)  # each slice of the model now holds W (X - a F(X))
        elif communicate and self.style == "awc":
            if self._exchange is None:
                self._start_awc_exchange()
            self.wait(self._exchange)
            self._exchange = None
            wx = self.mixed.sub_(self.flat)  # type: ignore[union-attr]  # W X - X
            self.local_step()  # X - a F(X), as the local optimizer shapes it
            self.flat.add_(wx)  # X+ = W X - a F(X)
        else:  # a local step; for cta the forward pass ran at W X, so X+ = W X - a F(W X)
            self.local_step()
        if self.style == "cta" and self.overlap and self.communicates_now(self.iteration + 1):
            # Start the next combine now; begin_iteration completes it.
            self.mixed.copy_(self.flat)  # type: ignore[union-attr]
            self._exchange = self.start_mix(self.mixed, self.mixing_weights(self.iteration + 1))  # type: ignore[arg-type]

    def finish(self) -> None:
        if self._exchange is not None:
            self.wait(self._exchange)

    def close(self) -> None:
        super().close()
        for h in self._backward_hooks:
            h.remove()
        self._backward_hooks = []
