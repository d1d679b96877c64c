"""PyTorch DistributedDataParallel (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020), run the
same way as our own baseline, so a user can check that `allreduce` is not a
strawman.

DDP needs torch.distributed: gloo for CPU tensors, nccl for GPU tensors.
Rank 0 picks the rendezvous address and a free port and broadcasts them
over our engine (MPI), so no environment has to be set up by hand; a
MASTER_ADDR / MASTER_PORT already in the environment wins.

The model must be called through ``self.module`` (the DDP wrapper): DDP
averages gradients in backward hooks and overlaps that with backward.
``overlap=false`` puts every gradient in one bucket, so the allreduce only
starts once backward is done. DDP averages every step: communication_period
is 1 (algorithm=allreduce runs local SGD).
"""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer
from bfexp.comm.engine import Engine
from bfexp.costmodel import Traffic
from bfexp.errors import ConfigError
from bfexp.topology import Topology

ADDRESS_BYTES = 256
NO_OVERLAP_BUCKET_MB = 1 << 20  # one bucket for any model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rendezvous_address(engine: Engine) -> str:
    """'host:port' chosen by rank 0, the same on every rank."""
    buf = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8)
    if engine.rank == 0:
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if engine.machines == 1 else socket.gethostname())
        port = os.environ.get("MASTER_PORT") or str(free_port())
        raw = f"{host}:{port}".encode()
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    buf = engine.broadcast(buf, root=0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()


def init_torch_distributed(engine: Engine, backend: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    address = rendezvous_address(engine)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=engine.rank, world_size=engine.size)


class DDP(DecentralizedOptimizer):
    name: ClassVar[str] = "ddp"
    uses_topology: ClassVar[bool] = False
    traffic: ClassVar[Traffic] = Traffic("allreduce")  # the gradient, as our allreduce baseline

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        if "communication_period" in options and options["communication_period"] != 1:
            raise ConfigError(
                f"algorithm.communication_period={options['communication_period']}; allowed: 1 "
                "(algorithm=ddp averages gradients every step; algorithm=allreduce runs local SGD with a period)"
            )

    @classmethod
    def check_run(cls, engine: type[Engine], *, throughput_only: bool, modeled: bool) -> None:
        if modeled:  # a modeled cluster starts no rank
            return
        if not engine.processes:
            raise ConfigError(
                f"engine={engine.name}; allowed: an engine with one process per rank (engine=mpi or engine=nccl): "
                "algorithm=ddp runs torch.distributed, which needs one"
            )
        if throughput_only:  # throughput-only on ranks times step() alone
            raise ConfigError(
                "throughput_only=true times step() alone on these ranks, but algorithm=ddp communicates inside "
                "backward; allowed: algorithm=allreduce (the same gradient averaging), a modeled scaling config, "
                "or throughput_only=false"
            )

    def __init__(
        self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None = None, **options: Any
    ) -> None:
        if options.get("model") is None:
            raise TypeError("algorithm=ddp wraps the model: pass model=...")
        super().__init__(optimizer, engine, topology, **options)
        from torch.nn.parallel import DistributedDataParallel

        on_gpu = self.flat.is_cuda
        init_torch_distributed(self.engine, "nccl" if on_gpu else "gloo")
        bucket_mb = self.bucket_mb if self.overlap else NO_OVERLAP_BUCKET_MB
        self.module = DistributedDataParallel(
            self.module,
            device_ids=[self.flat.device.index] if on_gpu else None,
            bucket_cap_mb=bucket_mb,
        )

    def update(self, communicate: bool) -> None:
        self.local_step()  # DDP averaged the gradients during backward

    def close(self) -> None:
        """Unwrap the model and end torch.distributed with no gloo/nccl thread left running.

        The DDP wrapper's reducer holds the process group: left alive, its
        worker threads outlive the interpreter's finalization and abort the
        process ("terminate called without an active exception"). So every
        rank meets, drops the wrapper, and the group is destroyed while
        Python still runs.
        """
        super().close()
        import gc

        import torch.distributed as dist

        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            self.module = self.module.module
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        gc.collect()
