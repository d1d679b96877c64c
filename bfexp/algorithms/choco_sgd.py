"""CHOCO-SGD: decentralized SGD with compressed gossip.

Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization and Gossip
Algorithms with Compressed Communication", ICML 2019 (Algorithm 2); for deep
learning, Koloskova, Lin, Stich, Jaggi, ICLR 2020.

Every rank i keeps its model x_i and public copies x_hat_j of itself and of
its in-neighbors, which every rank that hears from j updates identically.
X stacks the models, X_hat the public copies, Q the compressor (row by row),
G the local gradients, gamma the consensus step:

    X_half  = X - a G(X)                         local step (the local optimizer's)
    Q_k     = Q(X_half - X_hat)                  what is sent: the compressed change
    X_hat  += Q_k                                every copy of x_hat_j moves by q_j
    X+      = X_half + gamma (W - I) X_hat       consensus on the public copies

started with X_hat = 0. Only q_i travels, packed (top-k: values and int32
indices; QSGD: bits), through ``neighbor_allgather``. A rank keeps two
vectors, not one per neighbor: x_hat_i and s_i = sum_j W_ij x_hat_j (j = i
included), updated by s_i += sum_j W_ij q_j, so (W - I) X_hat's row i is
s_i - x_hat_i. That needs a static W: a graph that changes would leave a
rank's s_i summing copies it no longer hears updates of.

With the identity compressor and gamma = 1, X+ = W (X - a G(X)): DSGD's
adapt-then-combine iterates. The paper assumes W symmetric and doubly
stochastic; any doubly stochastic W keeps the models' mean moving by the
mean local step. Gossip-PGA rounds (``global_average_every``) average the
models exactly, uncompressed, and leave the public copies as they are.

engine=stacked (every rank a column of the flat buffer): each rank's column is
compressed by the compressor itself with that rank's own generator (so its q_i
is the one it would send on any engine), and s += Q W^T is one mixing of the
decoded Q, counted as the packed payloads' bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer, GlobalAverage, Requirements
from bfexp.comm.engine import Engine
from bfexp.compression import Compressor, as_compressor
from bfexp.errors import number_in
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class ChocoSGD(DecentralizedOptimizer):
    name: ClassVar[str] = "choco_sgd"
    requires: ClassVar[Requirements] = Requirements(doubly_stochastic=True, static=True)
    traffic: ClassVar[Traffic] = Traffic("neighbor", vectors=1)  # one compressed vector; traffic_of prices it
    overlaps: ClassVar[bool] = False  # q_i is compressed from the finished local step
    stackable: ClassVar[bool] = True  # a per-rank compression, then elementwise plus one mixing (engine=stacked)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        compressor: Compressor | str | dict[str, Any] = "top_k",
        gamma: float = 0.1,
        overlap: bool = False,
        **options: Any,
    ) -> None:
        """``compressor``: a Compressor, a conf/algorithm/compressor option's name, or its config node;
        ``gamma``: the consensus step (0, 1]."""
        self.check_options(gamma=gamma)
        compressor = as_compressor(compressor)  # checks a name or a config node
        super().__init__(optimizer, engine, topology, overlap=overlap, **options)
        self.compressor = compressor
        self.gamma = gamma
        self.x_hat = torch.zeros_like(self.flat)  # this rank's public copy
        self.s = torch.zeros_like(self.flat)  # sum_j W_ij x_hat_j, j = i included
        self.diff = torch.empty_like(self.flat)
        self.random = self.compressor.generator(engine.rank, self.flat.device)
        # engine=stacked: every rank's own stream, rank r's as it would be on rank r
        self.randoms = [self.compressor.generator(r, self.flat.device) for r in range(engine.size)] \
            if engine.stacked else []

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "gamma" in options:
            number_in("algorithm.gamma", options["gamma"], low=0, low_open=True, high=1)
        if "compressor" in options:
            as_compressor(options["compressor"])  # its keys, types and ranges (ConfigError)

    @classmethod
    def traffic_of(cls, **options: Any) -> Traffic:
        wire = as_compressor(options.get("compressor", "top_k")).wire()
        return dataclasses.replace(super().traffic_of(**options), **wire)

    def update(self, communicate: bool) -> None:
        self.local_step()  # X_half = X - a G(X), as the local optimizer shapes it
        if not communicate:
            return
        w = self.mixing_weights()
        if isinstance(w, GlobalAverage):  # Gossip-PGA: an exact average instead
            self.wait(self.start_average(self.flat))
            return
        if self.engine.stacked:
            self.stacked_exchange(w.round)
            return
        n, dtype = self.flat.numel(), self.flat.dtype
        torch.sub(self.flat, self.x_hat, out=self.diff)
        payload = self.compressor.encode(self.diff, self.random)
        srcs = sorted(w.src_weights)
        handle = self.engine.ineighbor_allgather(payload.unsqueeze(0), srcs, sorted(w.dst_weights))
        q = self.compressor.decode(payload, n, dtype)  # exactly what the receivers rebuild
        self.x_hat.add_(q)
        self.s.add_(q, alpha=w.self_weight)
        received = self.wait(handle)  # (in-neighbors, payload bytes), ascending rank
        for row, j in zip(received, srcs):
            self.s.add_(self.compressor.decode(row, n, dtype), alpha=w.src_weights[j])
        self.flat.add_(self.s - self.x_hat, alpha=self.gamma)  # X+ = X_half + gamma (W - I) X_hat

    def stacked_exchange(self, round_: int) -> None:
        """The exchange above for every rank at once (engine=stacked; columns are ranks): each rank's q_i
        compressed and decoded as it sends it, then s += Q W(round)^T as one mixing."""
        torch.sub(self.flat, self.x_hat, out=self.diff)
        numel, dtype = self.diff.shape[0], self.diff.dtype
        q = torch.empty_like(self.diff)
        for r, random in enumerate(self.randoms):  # per rank: the compressor's own code on rank r's vector
            q[:, r] = self.compressor.decode(self.compressor.encode(self.diff[:, r].contiguous(), random), numel, dtype)
        self.x_hat.add_(q)
        wire = self.compressor.payload_bytes(numel, dtype)
        self.wait(self.engine.imix_(q, self.topology, round_, wire_bytes=wire))  # row i: sum_j W_ij q_j, j = i too
        self.s.add_(q)
        self.flat.add_(self.s - self.x_hat, alpha=self.gamma)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"x_hat": self.x_hat, "s": self.s}
