"""Push-sum SGD for directed graphs: Stochastic Gradient Push (Assran,
Loizou, Ballas, Rabbat, ICML 2019, Algorithm 1), the stochastic form of
gradient-push (Nedic & Olshevsky, "Distributed Optimization over
Time-Varying Directed Graphs", IEEE TAC 2015).

A is column stochastic (each sender splits what it has among itself and
its out-neighbors: no rank needs to know who it hears from). Each rank
keeps a numerator x_i and a scalar weight w_i (w_0 = 1) that travels in
the same message; the de-biased z_i = x_i / w_i is the model:

    x_{k+1/2} = x_k - a grad f(z_k)
    x_{k+1}   = A x_{k+1/2},   w_{k+1} = A w_k
    z_{k+1}   = x_{k+1} / w_{k+1}

The model's parameters hold z (gradients and evaluation use it); the
numerator lives in ``numerator`` with w as its last element. Sums of x and
of w over ranks are preserved by every push; on a non-regular graph the
raw x_i stay biased (x_i -> w_i * mean), z_i does not. The exchange of each
bucket starts during backward, once its local step is done; w rides with
the first bucket (the end of the buffer).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements
from bfexp.algorithms.buckets import Bucket
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class PushSum(DecentralizedOptimizer):
    name: ClassVar[str] = "push_sum"
    requires: ClassVar[Requirements] = Requirements(column_stochastic=True)
    bucketed: ClassVar[bool] = True
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=1, scalars=1)  # w travels with x
    stackable: ClassVar[bool] = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None = None, **options: Any
    ) -> None:
        super().__init__(optimizer, engine, topology, **options)
        n = len(self.flat)  # elements of one rank's model (rows of a stacked buffer)
        self.numerator = self.flat.new_empty((n + 1, *self.flat.shape[1:]))
        self.numerator[:n] = self.flat  # x_0 = z_0
        self.numerator[n] = 1.0  # w_0 = 1

    @property
    def x(self) -> torch.Tensor:
        return self.numerator[:-1]

    @property
    def weight(self) -> torch.Tensor:
        return self.numerator[-1:]

    def _span(self, bucket: Bucket) -> slice:
        """The bucket's slice of the numerator; the bucket at the end also carries w."""
        stop = bucket.stop + 1 if bucket.stop == len(self.flat) else bucket.stop
        return slice(bucket.start, stop)

    def bucket_ready(self, bucket: Bucket) -> Handle:
        s = slice(bucket.start, bucket.stop)
        self.numerator[s].sub_(self.flat[s])  # x_k - z_k
        self.local_step(bucket.params)  # z_k - a grad f(z_k)
        self.numerator[s].add_(self.flat[s])  # x_{k+1/2} = x_k - a grad f(z_k)
        return self.start_push(self.numerator[self._span(bucket)], self.mixing_weights())  # in place

    def update(self, communicate: bool) -> None:
        if communicate:
            for _, handle in self.buckets.collect():  # type: ignore[union-attr]
                self.wait(handle)  # the numerator now holds A x and A w
        else:
            self.x.add_(self.local_update())
        torch.div(self.x, self.weight, out=self.flat)  # z = x / w

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"numerator": self.numerator}
