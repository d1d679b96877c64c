"""Exact diffusion: Yuan, Ying, Zhao, Sayed, "Exact Diffusion for Distributed
Optimization and Learning", IEEE TSP 2019 (Part I, Algorithm 1).

With W symmetric and doubly stochastic and W_bar = (I + W) / 2:

    psi_{k+1} = x_k - a grad f(x_k)            adapt
    phi_{k+1} = psi_{k+1} + x_k - psi_k         correct
    x_{k+1}   = W_bar phi_{k+1}                 combine

started with psi_0 = x_0. The correction cancels DSGD's O(a) bias: with a
constant step every rank converges to the exact optimum of sum_i f_i.

The theory needs a static, symmetric, doubly stochastic W. A topology that
is not but has an undirected form (exp2 -> symmetric exp2; a star or grid
given uniform weights -> the same graph with Metropolis-Hastings weights)
runs on that form; ``resolve_topology`` says so (the CLI prints it as a
note, constructing ExactDiffusion directly warns with a UserWarning naming
both graphs, and ``.topology`` is the form it runs on). A graph the user
declared directed has none, and is refused.

Local SGD (communication_period H > 1): the H local optimizer steps taken
between two rounds play the part of "adapt" (as in Local Exact-Diffusion),
so x_k and psi_k are the values at the last round; H = 1 is the paper's rule.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, Requirements
from bfexp.algorithms.buckets import Bucket
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.errors import TopologyMismatch
from bfexp.topology import Topology


class ExactDiffusion(DecentralizedOptimizer):
    name: ClassVar[str] = "exact_diffusion"
    requires: ClassVar[Requirements] = Requirements(doubly_stochastic=True, symmetric=True, static=True)
    bucketed: ClassVar[bool] = True
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=1)
    stackable: ClassVar[bool] = True  # elementwise plus engine operations (engine=stacked)

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None = None, **options: Any
    ) -> None:
        super().__init__(optimizer, engine, topology, **options)
        self.x_last = self.flat.clone()  # x_k: the combined model of the last round
        self.psi = self.flat.clone()  # psi_k; psi_0 = x_0
        self.correction = torch.empty_like(self.flat)  # x_k - psi_k

    @classmethod
    def resolve_topology(cls, topology: Topology, **options: Any) -> tuple[Topology, str | None]:
        if topology.is_dynamic:
            raise TopologyMismatch(
                f"algorithm=exact_diffusion needs a static topology; topology={topology.label} changes every "
                "iteration; allowed: a static undirected graph (ring, symmetric_exp2, mesh, hypercube, ...)"
            )
        if topology.is_symmetric() and topology.is_doubly_stochastic():
            return topology, None
        undirected = topology.undirected()
        if undirected is None:
            raise TopologyMismatch(
                f"algorithm=exact_diffusion needs a symmetric doubly stochastic W; topology={topology.label} "
                "is declared directed and has no undirected form; allowed: an undirected graph "
                "(ring, symmetric_exp2, mesh, hypercube, ...)"
            )
        cls.check_topology(undirected)
        note = (
            f"algorithm=exact_diffusion needs a symmetric doubly stochastic W; topology={topology.label} "
            f"with weights={topology.weight_scheme} is not, so it runs on {undirected.label} "
            f"with weights={undirected.weight_scheme} (Metropolis-Hastings)"
        )
        return undirected, note

    def bucket_ready(self, bucket: Bucket) -> Handle:
        s = slice(bucket.start, bucket.stop)
        self.local_step(bucket.params)  # psi_{k+1} = x_k - a grad f(x_k), in the model
        torch.sub(self.x_last[s], self.psi[s], out=self.correction[s])  # x_k - psi_k
        self.psi[s].copy_(self.flat[s])
        self.flat[s].add_(self.correction[s])  # phi_{k+1} = psi_{k+1} + x_k - psi_k
        return self.start_mix(self.flat[s], self.mixing_weights(), scale=0.5)  # x_{k+1} = W_bar phi, in place

    def update(self, communicate: bool) -> None:
        if not communicate:
            self.local_step()  # local SGD: more "adapt" before the next round
            return
        for _, handle in self.buckets.collect():  # type: ignore[union-attr]
            self.wait(handle)
        self.x_last.copy_(self.flat)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"x_last": self.x_last, "psi": self.psi}
