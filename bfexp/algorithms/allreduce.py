"""The Horovod-style baseline (Sergeev & Del Balso, "Horovod: fast and easy
distributed deep learning in TensorFlow", 2018): every rank applies the
global average gradient, so all ranks hold the same model and the run is
centralized mini-batch SGD on the union of the ranks' batches.

    g = (1/n) sum_i F_i(x);   x+ = x - a g

Gradients are averaged by fused allreduce: they are packed into buckets of
at most ``bucket_mb`` (cut from the end of the model, where backward starts)
and each bucket's allreduce starts from a backward hook the moment its
gradients are complete, so communication overlaps the rest of backward.
``overlap=false`` sends one message after backward instead.

communication_period H > 1 is local SGD with periodic model averaging
(Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019):
H local optimizer steps, then the parameters are averaged.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, flat_grad, set_flat_grad_
from bfexp.algorithms.buckets import Bucket
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class Allreduce(DecentralizedOptimizer):
    name: ClassVar[str] = "allreduce"
    uses_topology: ClassVar[bool] = False
    bucketed: ClassVar[bool] = True
    traffic: ClassVar[Traffic] = Traffic("allreduce")  # the gradient (local SGD: the model)
    stackable: ClassVar[bool] = True  # elementwise plus engine operations (engine=stacked)

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None = None, **options: Any
    ) -> None:
        super().__init__(optimizer, engine, topology, **options)
        self.grad = torch.zeros_like(self.flat)

    def begin_iteration(self) -> None:
        if self.communication_period == 1:
            super().begin_iteration()  # watch backward for gradient buckets

    def begins_before_forward(self) -> bool:
        return self.begins_its_own_way(Allreduce) or self.watches_backward()

    def bucket_ready(self, bucket: Bucket) -> Handle:
        part = self.grad[bucket.start : bucket.stop]
        flat_grad(list(bucket.params), out=part)
        return self.engine.iallreduce_(part, op="avg")  # in place

    def update(self, communicate: bool) -> None:
        if self.communication_period == 1:
            for _, handle in self.buckets.collect():  # type: ignore[union-attr]
                self.wait(handle)
            set_flat_grad_(self.params, self.grad)  # the average gradient
            self.local_step()
            return
        self.local_step()
        if communicate:  # local SGD: average the models every H steps
            self.wait(self.engine.iallreduce_(self.flat, op="avg"))
