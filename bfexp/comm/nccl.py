"""CuPy-NCCL engine: the Engine contract on GPUs, one MPI rank per GPU.

MPI only bootstraps and coordinates: rank 0 makes the NCCL unique id and
broadcasts it over mpi4py, every rank opens an ``NcclCommunicator`` on the
GPU whose index is its rank on its machine, and from then on tensors move
through NCCL. What this relies on in CuPy's documented ``cupy.cuda.nccl``
API (checked against CuPy 14.2 with NCCL 2.32):

* ``get_unique_id()`` (bytes since CuPy 14, a tuple before; either pickles
  through ``comm.bcast``) and ``NcclCommunicator(ndev, commId, rank)``;
* ``allReduce(sendbuf, recvbuf, count, datatype, op, stream)``,
  ``broadcast(sendbuf, recvbuf, count, datatype, root, stream)``,
  ``allGather(sendbuf, recvbuf, count, datatype, stream)``,
  ``send(sendbuf, count, datatype, peer, stream)``,
  ``recv(recvbuf, count, datatype, peer, stream)``: buffers are raw device
  pointers and the stream a raw ``cudaStream_t`` handle, all ints;
* ``groupStart()`` / ``groupEnd()`` around the sends and receives of one
  neighbor exchange, so they progress together (NCCL >= 2.7);
* the ``NCCL_FLOAT32``-style dtype constants and ``NCCL_SUM``.

Streams: every operation runs on one dedicated CUDA stream (created by CuPy,
wrapped for torch with ``torch.cuda.ExternalStream``). It first waits for
the caller's current stream, so it sees finished inputs; its end is marked
with an event, which the handle polls (``done``) and waits on. ``wait()``
blocks the host until the event (so ``comm_time_s`` is honest and the
result is readable) and makes the caller's stream wait on it. Compute the
caller queued before ``wait`` keeps the GPU busy meanwhile: that is the
overlap nonblocking forms buy.

Tensors: torch CUDA tensors reach NCCL as their own device pointers and
reach CuPy (the fused weighted-average kernel of bfexp.comm.nccl_kernels)
through DLPack, without copies. CPU tensors are accepted too (the metrics
code and the contract tests pass them): they are staged to this rank's GPU,
go through NCCL all the same, and come back on the CPU. A result lives on
the device its inputs came from.

Windows (one-sided ops for asynchronous algorithms) are host-staged MPI:
NCCL has only two-sided transfers, which need the target's participation,
while a window's put/get/accumulate must complete without it. The engine
keeps an MPI engine on the same communicator, copies a window's tensor to
the host and runs MPI's one-sided windows on it; ``win_update`` and
``win_get`` bring results back to the GPU.

CuPy is imported lazily (``nccl_available`` is the cheap probe the CLI
runs before any rank starts).
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from typing import Any, Iterator

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

INSTALL_HINT = "install the extra for your CUDA major: pip install 'bfexp[cuda12]' or 'bfexp[cuda13]'"


def nccl_available(ranks: int, ranks_per_machine: int | None = None) -> tuple[bool, str]:
    """Can ``ranks`` NCCL ranks run here, one GPU each? ``(True, '')`` or ``(False, what is missing)``.

    ``ranks_per_machine`` (0 or None: all ranks on this machine) is how many
    ranks share this machine's GPUs. Imports CuPy but creates no CUDA context.
    """
    if importlib.util.find_spec("cupy") is None:
        return False, f"no cupy: CuPy is not installed; {INSTALL_HINT}"
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # a broken install (e.g. CuPy built for another CUDA)
        return False, f"no cupy: importing CuPy failed ({type(exc).__name__}: {_first_line(exc)}); {INSTALL_HINT}"
    if not getattr(nccl, "available", False):
        return False, f"no NCCL: CuPy cannot load the NCCL library; {INSTALL_HINT} (it brings nvidia-nccl)"
    try:
        gpus = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, or a driver older than the CUDA runtime
        return False, f"no GPU: CUDA finds no usable GPU ({_first_line(exc)})"
    if gpus == 0:
        return False, "no GPU: CUDA sees no device"
    if not torch.cuda.is_available():
        return False, f"no GPU for torch: torch {torch.__version__} was built without CUDA; install a CUDA build of torch"
    local = ranks_per_machine or ranks
    if gpus < local:
        return False, (
            f"fewer GPUs than local ranks: {gpus} GPU(s) for {local} rank(s) on this machine "
            "(NCCL needs one GPU per rank; lower ranks or set engine.ranks_per_machine)"
        )
    return True, ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _mpi():
    from mpi4py import MPI

    return MPI


# torch dtype -> name of CuPy's NCCL datatype constant, for reductions.
NCCL_TYPES = {
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
}
HALF_TYPES = (torch.float16, torch.bfloat16)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes: data movement needs no dtype."""
    return t.reshape(-1).view(torch.uint8)


def as_cupy(t: torch.Tensor) -> Any:
    """A CuPy view of a contiguous CUDA tensor, through DLPack (no copy).

    CuPy has no bfloat16, so bfloat16 travels as its 16-bit words (the
    kernel is told the kind).
    """
    import cupy

    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


class NCCLEngine(Engine):
    name = "nccl"

    def __init__(self, comm: Any = None, ranks_per_machine: int = 0, gpu: int | None = None) -> None:
        super().__init__()
        import cupy
        from cupy.cuda import nccl

        from bfexp.comm.mpi import MPIEngine

        MPI = _mpi()
        self._nccl_api = nccl
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self._local_size = ranks_per_machine or self.comm.Get_size()
        if self.comm.Get_size() % self._local_size:
            raise ValueError(
                f"ranks_per_machine={ranks_per_machine} does not divide {self.comm.Get_size()} ranks"
            )
        if gpu is None:  # the rank's index among the ranks on its physical machine
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.comm.Get_rank())
            gpu = node.Get_rank()
            node.Free()
        gpus = cupy.cuda.runtime.getDeviceCount()
        if gpu >= gpus:
            raise RuntimeError(
                f"rank {self.comm.Get_rank()} needs GPU {gpu} but this machine has {gpus}: one rank per GPU"
            )
        self.gpu = gpu
        self.device = torch.device("cuda", gpu)
        torch.cuda.set_device(self.device)
        self._cupy_device = cupy.cuda.Device(gpu)
        self._cupy_device.use()
        self._cupy_stream = cupy.cuda.Stream(non_blocking=True)
        self.stream = torch.cuda.ExternalStream(self._cupy_stream.ptr, device=self.device)
        self._nccl = self._open_communicator(self.comm)
        self._sub: dict[str, Any] = {}  # lazily opened machine-local and cross-machine communicators
        # Host-side partner on the same communicator: windows, pattern checks.
        self.host = MPIEngine(self.comm, ranks_per_machine)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def _open_communicator(self, comm: Any) -> Any:
        """An NCCL communicator over the ranks of an MPI communicator (collective over them)."""
        uid = self._nccl_api.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        return self._nccl_api.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())

    def _type(self, dtype: torch.dtype) -> int:
        if dtype not in NCCL_TYPES:
            allowed = ", ".join(str(d).replace("torch.", "") for d in NCCL_TYPES)
            raise TypeError(f"NCCL cannot reduce {dtype}; allowed: {allowed}")
        return getattr(self._nccl_api, NCCL_TYPES[dtype])

    # streams and staging --------------------------------------------------
    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Enqueue on the communication stream, after what the caller queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), self._cupy_stream:
            yield

    def _stage(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """One flat GPU buffer of the tensors (no copy for one contiguous GPU tensor); and whether they were on the CPU."""
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}; allowed: one")
        device = devices.pop()
        if device.type == "cuda":
            if device != self.device:
                raise ValueError(f"rank {self.rank}: tensor on {device}; this rank's engine uses {self.device}")
            for t in tensors:  # read on our stream: keep their memory until we are done
                t.record_stream(self.stream)
            return fuse(tensors), False
        if device.type != "cpu":
            raise ValueError(f"tensor on {device}; allowed: cuda or cpu tensors")
        return fuse(tensors).to(self.device), True

    def _handle(self, result: torch.Tensor, like: list[torch.Tensor], single: bool, to_cpu: bool) -> Handle:
        """Mark the end of what was enqueued; the handle hands ``result`` back shaped like ``like``."""
        event = torch.cuda.Event()
        event.record(self.stream)

        def finish() -> TensorOrList:
            event.synchronize()
            caller = torch.cuda.current_stream(self.device)
            caller.wait_event(event)
            out = result
            if to_cpu:
                out = out.cpu()
            else:
                out.record_stream(caller)
            return restore(out, like, single)

        return Handle(finish, event.query)

    def _event_handle(self) -> Handle:
        event = torch.cuda.Event()
        event.record(self.stream)
        return Handle(lambda: event.synchronize(), event.query)

    @property
    def _stream_ptr(self) -> int:
        return self._cupy_stream.ptr

    # collectives --------------------------------------------------------
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        self.check_op(op)
        tensors, single = as_list(tensors)
        if op == "avg":
            check_float(tensors, "allreduce(op='avg')")
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            # Half precision is summed in float32, as the MPI engine does.
            work = flat.float() if flat.dtype in HALF_TYPES else flat
            out = torch.empty_like(work)
            self._nccl.allReduce(
                work.data_ptr(), out.data_ptr(), work.numel(), self._type(work.dtype),
                self._nccl_api.NCCL_SUM, self._stream_ptr,
            )
            if op == "avg":
                out.div_(self.size)
            out = out.to(flat.dtype)
            return self._handle(out, tensors, single, to_cpu)

    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        if not 0 <= root < self.size:
            raise ValueError(f"root={root}; allowed: 0..{self.size - 1}")
        tensors, single = as_list(tensors)
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            out = torch.empty_like(flat)
            self._nccl.broadcast(
                as_bytes(flat).data_ptr(), as_bytes(out).data_ptr(), flat.numel() * flat.element_size(),
                self._nccl_api.NCCL_UINT8, root, self._stream_ptr,
            )
            return self._handle(out, tensors, single, to_cpu)

    def ibarrier(self) -> Handle:
        """Every rank has enqueued the barrier: a one-element NCCL allreduce."""
        with self._on_stream():
            token = torch.zeros(1, device=self.device)
            self._nccl.allReduce(
                token.data_ptr(), token.data_ptr(), 1, self._nccl_api.NCCL_FLOAT32,
                self._nccl_api.NCCL_SUM, self._stream_ptr,
            )
            return self._event_handle()

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
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            received = self._exchange(flat, spec.dst_weights, list(spec.src_weights))
            out = self._combine(flat, spec.self_weight, received, list(spec.src_weights.values()))
            return self._handle(out, tensors, single, to_cpu)

    def _exchange(
        self, flat: torch.Tensor, dst_weights: dict[int, float], sources: list[int], comm: Any = None
    ) -> list[torch.Tensor]:
        """Grouped NCCL sends (scaled per destination) and receives; on the communication stream."""
        comm = comm or self._nccl
        nbytes = flat.numel() * flat.element_size()
        uint8 = self._nccl_api.NCCL_UINT8
        payloads = [flat if w == 1.0 else flat * w for w in dst_weights.values()]
        inbox = torch.empty((len(sources), flat.numel()), dtype=flat.dtype, device=self.device)
        self._nccl_api.groupStart()
        try:
            for dst, payload in zip(dst_weights, payloads):
                comm.send(as_bytes(payload).data_ptr(), nbytes, uint8, dst, self._stream_ptr)
            for row, src in enumerate(sources):
                comm.recv(as_bytes(inbox[row]).data_ptr(), nbytes, uint8, src, self._stream_ptr)
        finally:
            self._nccl_api.groupEnd()
        return list(inbox)

    def _combine(
        self, flat: torch.Tensor, self_weight: float, received: list[torch.Tensor], weights: list[float]
    ) -> torch.Tensor:
        """``self_weight * flat + sum_j w_j received_j`` with one fused kernel pass."""
        from bfexp.comm.nccl_kernels import weighted_sum

        out = torch.empty_like(flat)
        kind = str(flat.dtype).replace("torch.", "")
        weighted_sum(
            [as_cupy(flat), *(as_cupy(r) for r in received)],
            [self_weight, *weights],
            out=as_cupy(out),
            kind=kind,
        )
        return out

    # lifecycle ----------------------------------------------------------
    def close(self) -> None:
        comms = [self.__dict__.pop("_nccl", None), *self.__dict__.get("_sub", {}).values()]
        self._sub = {}
        if comms and comms[0] is not None:
            self._cupy_stream.synchronize()
        for c in comms:
            if c is not None:
                c.destroy()
