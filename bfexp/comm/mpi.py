"""mpi4py engine: one MPI process per rank, torch CPU tensors.

Tensors are handed to MPI as numpy views of their own memory (no staging
copies); a list of tensors is fused into one flat buffer so each peer gets
one message.
"""

from __future__ import annotations

import numpy as np
import torch

from bfexp.comm.engine import (
    DstWeights,
    Engine,
    Handle,
    TensorOrList,
    Weights,
    as_list,
    check_float,
    fuse,
    restore,
)


def _mpi():
    from mpi4py import MPI

    return MPI


def as_buffer(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory, for MPI to read or write."""
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw bits
        return t.view(torch.int16).numpy()
    return t.numpy()


class MPIEngine(Engine):
    name = "mpi"

    def __init__(self, comm=None, ranks_per_machine: int = 0) -> None:
        super().__init__()
        MPI = _mpi()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self._local_size = ranks_per_machine or self.comm.Get_size()
        if self.comm.Get_size() % self._local_size:
            raise ValueError(
                f"ranks_per_machine={ranks_per_machine} does not divide {self.comm.Get_size()} ranks"
            )
        # Tags keep concurrent nonblocking neighbor ops apart; every rank
        # issues ops in the same order, so the counters agree.
        self._op_seq = 0

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def _next_tag(self) -> int:
        self._op_seq = (self._op_seq + 1) % 30000
        return 1000 + self._op_seq

    # collectives --------------------------------------------------------
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        self.check_op(op)
        tensors, single = as_list(tensors)
        if op == "avg":
            check_float(tensors, "allreduce(op='avg')")
        flat = fuse(tensors)
        # Reduce in a buffer of our own: the caller's tensors stay untouched.
        out = flat.clone() if flat.data_ptr() == tensors[0].data_ptr() else flat
        if self.size == 1:
            return Handle.completed(restore(out, tensors, single))
        MPI = _mpi()
        work = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
        req = self.comm.Iallreduce(MPI.IN_PLACE, as_buffer(work), op=MPI.SUM)

        def finish():
            req.Wait()
            result = work
            if op == "avg":
                result = result.div_(self.size)
            if result is not out:
                out.copy_(result)
            return restore(out, tensors, single)

        return Handle(finish, req.Test)

    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        tensors, single = as_list(tensors)
        flat = fuse(tensors)
        out = flat.clone() if flat.data_ptr() == tensors[0].data_ptr() else flat
        if self.size == 1:
            return Handle.completed(restore(out, tensors, single))
        req = self.comm.Ibcast(as_buffer(out), root=root)

        def finish():
            req.Wait()
            return restore(out, tensors, single)

        return Handle(finish, req.Test)

    def ibarrier(self) -> Handle:
        req = self.comm.Ibarrier()
        return Handle(lambda: req.Wait(), req.Test)

    # neighbor exchange --------------------------------------------------
    def ineighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        spec = self.neighbor_spec(self_weight, src_weights, dst_weights)
        tensors, single = as_list(tensors)
        check_float(tensors, "neighbor_allreduce")
        flat = fuse(tensors)
        tag = self._next_tag()
        requests = []
        sends = []
        for dst, w in spec.dst_weights.items():
            payload = flat if w == 1.0 else flat * w
            sends.append(payload)  # keep alive until the send completes
            requests.append(self.comm.Isend(as_buffer(payload), dest=dst, tag=tag))
        received = {}
        for src in spec.src_weights:
            buf = torch.empty_like(flat)
            received[src] = buf
            requests.append(self.comm.Irecv(as_buffer(buf), source=src, tag=tag))
        MPI = _mpi()

        def finish():
            MPI.Request.Waitall(requests)
            out = flat * spec.self_weight
            for src, w in spec.src_weights.items():
                out.add_(received[src], alpha=w)
            return restore(out, tensors, single)

        return Handle(finish, lambda: MPI.Request.Testall(requests))
