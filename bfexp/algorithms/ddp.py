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
starts once backward is done.
"""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar

import torch

from bfexp.algorithms.base import DecentralizedOptimizer
from bfexp.comm.engine import Engine

ADDRESS_BYTES = 256
ENGINES = ("mpi", "nccl")  # one process per rank
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

    @classmethod
    def check_engine(cls, engine: str) -> None:
        if engine not in ENGINES:
            raise ValueError(
                f"algorithm=ddp needs one process per rank for torch.distributed; engine={engine} cannot give it; "
                f"allowed: engine={' or engine='.join(ENGINES)}"
            )

    @classmethod
    def check_job(cls, cfg: Any, engine: str) -> None:
        super().check_job(cfg, engine)
        # Throughput-only on ranks here times step() alone; a modeled cluster starts no rank.
        if cfg.get("throughput_only", False) and not cfg.scaling.get("modeled", False):
            raise ValueError(
                "throughput_only=true times step() alone on these ranks, but algorithm=ddp communicates inside "
                "backward; allowed: algorithm=allreduce (the same gradient averaging), a modeled scaling config, "
                "or throughput_only=false"
            )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.module is None:
            raise ValueError("algorithm=ddp wraps the model: pass model=...")
        if self.communication_period != 1:
            raise ValueError(
                f"algorithm.communication_period={self.communication_period}; algorithm=ddp allows only 1 "
                "(use algorithm=allreduce for local SGD)"
            )
        from torch.nn.parallel import DistributedDataParallel

        on_gpu = self.flat.is_cuda
        init_torch_distributed(self.engine, "nccl" if on_gpu else "gloo")
        bucket_mb = float(self.cfg["bucket_mb"]) if self.overlap else NO_OVERLAP_BUCKET_MB
        self.module = DistributedDataParallel(
            self.module,
            device_ids=[self.flat.device.index] if on_gpu else None,
            bucket_cap_mb=bucket_mb,
        )

    def update(self, communicate: bool) -> None:
        self.local_step()  # DDP averaged the gradients during backward

    def close(self) -> None:
        super().close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
