"""Compressed allreduce with error feedback (EF-SGD).

Seide et al., "1-bit SGD", Interspeech 2014; Stich, Cordonnier, Jaggi,
"Sparsified SGD with Memory", NeurIPS 2018; Karimireddy, Rebjock, Stich,
Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019 (Algorithm 2, distributed). With u_i the local
optimizer's step (a g_i for SGD), C the compressor and e_i the memory of
what compression left out:

    p_i  = u_i + e_i
    c_i  = C(p_i);   e_i+ = p_i - c_i
    x+   = x - (1/n) sum_j c_j

Compressed vectors (top-k with different positions, quantized codes) cannot
be summed on the way, so every rank's packed c_j reaches every rank by one
``allgather`` and each rank decodes and averages them; every rank holds the
same model (ranks start from the same one, as bfexp's do). With the
identity compressor this is allreduce SGD. With ``communication_period`` H
the local optimizer takes H steps from x and u_i is where they led,
x - x_i (local SGD with compressed, error-corrected averaging).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer
from bfexp.comm.engine import Engine
from bfexp.compression import Compressor, as_compressor
from bfexp.costmodel import Traffic
from bfexp.topology import Topology


class CompressedAllreduce(DecentralizedOptimizer):
    name: ClassVar[str] = "compressed_allreduce"
    uses_topology: ClassVar[bool] = False
    traffic: ClassVar[Traffic] = Traffic("allgather")  # every rank's compressed step; traffic_of prices it
    overlaps: ClassVar[bool] = False  # c_i is compressed from the finished step

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        compressor: Compressor | str | dict[str, Any] = "top_k",
        overlap: bool = False,
        **options: Any,
    ) -> None:
        """``compressor``: a Compressor, a conf/algorithm/compressor option's name, or its config node."""
        compressor = as_compressor(compressor)
        super().__init__(optimizer, engine, topology, overlap=overlap, **options)
        self.compressor = compressor
        self.error = torch.zeros_like(self.flat)  # e_i: what compression has left out so far
        self.shared = self.flat.clone()  # x: the model every rank agrees on at the last exchange
        self.random = self.compressor.generator(engine.rank, self.flat.device)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "compressor" in options:
            as_compressor(options["compressor"])

    @classmethod
    def traffic_of(cls, **options: Any) -> Traffic:
        wire = as_compressor(options.get("compressor", "top_k")).wire()
        return dataclasses.replace(super().traffic_of(**options), **wire)

    def update(self, communicate: bool) -> None:
        self.local_step()  # local SGD (communication_period > 1) moves the model between exchanges
        if not communicate:
            return
        p = self.error.add_(self.shared).sub_(self.flat)  # p_i = u_i + e_i, u_i = shared - x_i
        payload = self.compressor.encode(p, self.random)
        gathered = self.wait(self.engine.iallgather(payload.unsqueeze(0)))  # (ranks, payload bytes)
        n, dtype = self.flat.numel(), self.flat.dtype
        p.sub_(self.compressor.decode(payload, n, dtype))  # e_i+ = p_i - c_i
        mean = torch.zeros_like(self.flat)
        for row in gathered:
            mean.add_(self.compressor.decode(row, n, dtype))
        self.shared.sub_(mean.div_(self.engine.size))  # x+ = x - (1/n) sum_j c_j
        self.flat.copy_(self.shared)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"error": self.error, "shared": self.shared}
