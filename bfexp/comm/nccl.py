"""CuPy-NCCL engine: the Engine contract on GPUs, one MPI rank per GPU (transport only; the contract is engine.py's).

MPI only bootstraps and coordinates: rank 0 makes the NCCL unique id and
broadcasts it over mpi4py, every rank opens an ``NcclCommunicator`` on the
GPU whose index is its rank among the ranks of its machine, and from then on
tensors move through NCCL. What this relies on in CuPy's documented
``cupy.cuda.nccl`` API (checked against CuPy 14.2 with NCCL 2.32):

* ``get_unique_id()`` (bytes since CuPy 14, a tuple before; either pickles
  through ``comm.bcast``) and ``NcclCommunicator(ndev, commId, rank)``;
* ``allReduce(sendbuf, recvbuf, count, datatype, op, stream)``,
  ``broadcast(sendbuf, recvbuf, count, datatype, root, stream)``,
  ``allGather(sendbuf, recvbuf, count, datatype, stream)``,
  ``reduceScatter(sendbuf, recvbuf, recvcount, datatype, op, stream)``,
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
code and the contract suite pass them): they are staged to this rank's GPU,
go through NCCL all the same, and come back on the CPU. A result lives on
the device its inputs came from; the ``*_`` forms copy it into the caller's
tensors on the caller's stream.

Declarations: NCCL waits forever on a receive nobody sends, so before a
neighbor exchange every rank's declaration (bfexp.comm.declarations) is
gathered over MPI (one small Allgather) and judged; a mismatch raises the
contract's CommError on every rank before anything reaches NCCL. Gathers
use the same exchange to learn the shapes they will receive.

Windows (one-sided ops for asynchronous algorithms) are host-staged MPI:
NCCL has only two-sided transfers, which need the target's participation,
while a window's put/get/accumulate must complete without it. The engine
keeps its windows as the MPI engine does (bfexp.comm.mpi.MPIHost, on the
same communicator): a window lives in host memory (``win_create`` returns
its live own value as a CPU tensor), and GPU tensors handed to
put/accumulate are copied to the host.

CuPy and MPI are imported lazily (importing this module initializes
neither): ``nccl_available`` is the cheap probe the CLI runs before any
rank starts.
"""

from __future__ import annotations

import importlib.util
import warnings
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import torch

from bfexp.comm.declarations import Declaration, GatherDeclaration, MachineDeclaration
from bfexp.comm.declarations import allgather_problems, header, mismatch_error, shape_signature
from bfexp.comm.engine import Call, Engine, NeighborSpec, Pending, first_dims, row_numel, ungather, work_dtype
from bfexp.comm.mpi import MPIHost, load_mpi

INSTALL_HINT = "install the extra for your CUDA major: pip install 'bfexp[cuda12]' or 'bfexp[cuda13]'"
def nccl_available(ranks: int, ranks_per_machine: int | None = None) -> tuple[bool, str]:
    """Can ``ranks`` NCCL ranks run here, one GPU each? ``(True, '')`` or ``(False, what is missing)``.

    ``ranks_per_machine`` (0 or None: all ranks on this machine) is how many
    ranks share this machine's GPUs. Imports CuPy but creates no CUDA context.
    """
    if importlib.util.find_spec("cupy") is None:
        return False, f"no cupy: CuPy is not installed; {INSTALL_HINT}"
    # CuPy warns over many lines when a library is missing; the reason goes into our one line instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import cupy
            from cupy.cuda import nccl
        except Exception as exc:  # a broken install (e.g. CuPy built for another CUDA)
            return False, f"no cupy: importing CuPy failed ({type(exc).__name__}: {_first_line(exc)}); {INSTALL_HINT}"
    if not getattr(nccl, "available", False):
        why = next((line.strip() for w in caught for line in str(w.message).splitlines() if line.strip().startswith("Reason:")), "")
        why = f" ({why})" if why else ""
        return False, f"no NCCL: CuPy cannot load the NCCL library{why}; {INSTALL_HINT} (it brings nvidia-nccl)"
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


# ------------------------------------------------------------------ tensors
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


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes: moving data needs no dtype."""
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



# ------------------------------------------------------------------ the engine
class NCCLEngine(MPIHost, Engine):
    """The Engine contract over NCCL (through CuPy) on this rank's GPU; see the module doc.

    Declarations and windows go over MPI on the host (MPIHost), as on the MPI engine.
    """

    name: ClassVar[str] = "nccl"
    virtual: ClassVar[bool] = False
    processes: ClassVar[bool] = True
    device_type: ClassVar[str] = "cuda"

    def __init__(
        self,
        *,
        ranks_per_machine: int = 0,
        check_neighbors: bool = True,
        gpu: int | None = None,
        timeline: bool = False,
        mpiexec_args: tuple[str, ...] = (),
        comm: Any = None,
        timeline_from_env: bool = True,
    ) -> None:
        """``ranks_per_machine`` (0: all on one) groups ranks into machines; ``check_neighbors=False``
        skips sharing each neighbor exchange's declarations first (a mismatch then hangs in NCCL);
        ``gpu`` (default: the rank's index among the ranks of its physical machine). ``timeline`` and
        ``mpiexec_args`` are for the job around the engine, as on the MPI engine (MPIEngine)."""
        super().__init__()
        self.mpiexec_args = tuple(mpiexec_args)
        import cupy
        from cupy.cuda import nccl

        self._api = nccl
        self.check_neighbors = check_neighbors
        self._join(comm, ranks_per_machine)
        rank = self.rank
        if gpu is None:  # the rank's index among the ranks of its physical machine
            node = self.comm.Split_type(load_mpi().COMM_TYPE_SHARED, key=rank)
            gpu = node.Get_rank()
            node.Free()
        gpus = cupy.cuda.runtime.getDeviceCount()
        if gpu >= gpus:
            raise RuntimeError(f"rank {rank} needs GPU {gpu}, but its machine has {gpus}: NCCL runs one rank per GPU")
        self.gpu = gpu
        self.device = torch.device("cuda", gpu)
        torch.cuda.set_device(self.device)
        cupy.cuda.Device(gpu).use()
        self._cupy_stream = cupy.cuda.Stream(non_blocking=True)
        self.stream = torch.cuda.ExternalStream(self._cupy_stream.ptr, device=self.device)
        self._nccl = self._open_communicator(self.comm)
        self._sub: dict[str, Any] = {}  # NCCL inside the machine / among machines, opened at first use
        self._closed = False
        if timeline_from_env:
            self.attach_timeline_from_env(rank)

    @classmethod
    def available(cls, ranks: int, ranks_per_machine: int | None = None) -> tuple[bool, str]:
        return nccl_available(ranks, ranks_per_machine)

    def _open_communicator(self, comm: Any) -> Any:
        """An NCCL communicator over the ranks of an MPI communicator (collective over them)."""
        uid = self._api.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        return self._api.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())

    def _type(self, dtype: torch.dtype) -> int:
        if dtype not in NCCL_TYPES:
            allowed = ", ".join(str(d).replace("torch.", "") for d in NCCL_TYPES)
            raise TypeError(f"NCCL cannot reduce {dtype}; allowed: {allowed}")
        return getattr(self._api, NCCL_TYPES[dtype])

    @property
    def _stream_ptr(self) -> int:
        return self._cupy_stream.ptr

    # streams, staging, handles ------------------------------------------
    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Enqueue on the communication stream, after what the caller queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), self._cupy_stream:
            yield

    def _stage(self, call: Call) -> tuple[torch.Tensor, bool]:
        """One flat GPU buffer of the call's tensors (fused on our stream), and whether they came from the CPU.

        No copy for GPU tensors that lie back to back (``fuse``): NCCL reads
        the caller's memory, so callers leave inputs alone until ``wait``.
        """
        devices = {t.device for t in call.tensors}
        if len(devices) != 1:
            raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}; allowed: one")
        device = devices.pop()
        if device.type == "cuda":
            if device != self.device:
                raise ValueError(f"rank {self.rank}: tensor on {device}; this rank's engine uses {self.device}")
            for t in call.tensors:  # read on our stream: keep their memory until we are done
                t.record_stream(self.stream)
            return call.flat, False
        if device.type != "cpu":
            raise ValueError(f"tensor on {device}; allowed: cuda or cpu tensors")
        return call.flat.to(self.device), True

    def _deliver(self, results: list[torch.Tensor], build: Callable[[list[torch.Tensor]], Any], to_cpu: bool) -> Pending:
        """Mark the end of the enqueued work with an event; ``wait`` hands ``build`` the results on the caller's device."""
        event = torch.cuda.Event()
        event.record(self.stream)

        def finish() -> Any:
            event.synchronize()
            caller = torch.cuda.current_stream(self.device)
            caller.wait_event(event)
            outs = []
            for out in results:
                if to_cpu:
                    out = out.cpu()
                else:  # used on the caller's stream from now on
                    out.record_stream(caller)
                outs.append(out)
            return build(outs)

        return finish, event.query

    def _deliver_call(self, call: Call, out: torch.Tensor, to_cpu: bool) -> Pending:
        """The flat result ``out``, delivered as ``call`` asked (new tensors, or written into the caller's)."""
        return self._deliver([out], lambda outs: call.deliver(outs[0]), to_cpu)

    def _check(self, declaration: Declaration | None) -> None:
        """Gather and judge every rank's declaration before anything reaches NCCL (None: unchecked)."""
        if declaration is not None:
            declaration.verify(self._declare_all(declaration))

    # collectives --------------------------------------------------------
    def _post_allreduce(self, call: Call, op: str, blocking: bool) -> Pending:
        with self._on_stream():
            flat, to_cpu = self._stage(call)
            # Half precision is summed in float32, as the MPI engine does.
            work = flat.to(work_dtype(flat.dtype))
            out = torch.empty_like(work)
            self._nccl.allReduce(
                work.data_ptr(), out.data_ptr(), work.numel(), self._type(work.dtype),
                self._api.NCCL_SUM, self._stream_ptr,
            )
            if op == "avg":
                out.div_(self.size)
            return self._deliver_call(call, out.to(flat.dtype), to_cpu)

    def _post_broadcast(self, call: Call, root: int) -> Pending:
        with self._on_stream():
            flat, to_cpu = self._stage(call)
            out = torch.empty_like(flat)
            self._nccl.broadcast(
                as_bytes(flat).data_ptr(), as_bytes(out).data_ptr(), flat.numel() * flat.element_size(),
                self._api.NCCL_UINT8, root, self._stream_ptr,
            )
            return self._deliver_call(call, out, to_cpu)

    def _post_barrier(self, blocking: bool) -> Pending:
        """Every rank has enqueued the barrier: a one-element NCCL allreduce."""
        with self._on_stream():
            token = torch.zeros(1, device=self.device)
            self._nccl.allReduce(
                token.data_ptr(), token.data_ptr(), 1, self._api.NCCL_FLOAT32, self._api.NCCL_SUM, self._stream_ptr
            )
            event = torch.cuda.Event()
            event.record(self.stream)
        return event.synchronize, event.query

    def _post_allgather(self, call: Call) -> Pending:
        """Shapes travel over MPI first; NCCL then gathers one fused buffer per rank, padded to the longest."""
        tensors = call.tensors
        head = header(call.numel, call.dtype, len(tensors), shape_signature(tensors))
        infos = self.comm.allgather((head, first_dims(tensors)))
        problems = allgather_problems(np.stack([h for h, _ in infos]), self.rank)
        if problems:
            raise mismatch_error("allgather", problems)
        counts = [sum(c * row_numel(t) for c, t in zip(dims, tensors)) for _, dims in infos]
        with self._on_stream():
            flat, to_cpu = self._stage(call)
            width = max(counts)
            send = flat
            if flat.numel() < width:
                send = torch.zeros(width, dtype=flat.dtype, device=self.device)
                send[: flat.numel()] = flat
            gathered = torch.empty((self.size, width), dtype=flat.dtype, device=self.device)
            self._nccl.allGather(
                as_bytes(send).data_ptr(), as_bytes(gathered).data_ptr(), width * flat.element_size(),
                self._api.NCCL_UINT8, self._stream_ptr,
            )
            pieces = ungather(list(gathered), [dims for _, dims in infos], tensors)
            return self._deliver(pieces, call.as_given, to_cpu)

    # neighbor ops -------------------------------------------------------
    def _post_neighbor_allreduce(
        self, call: Call, spec: NeighborSpec, declaration: Declaration | None, blocking: bool
    ) -> Pending:
        self._check(declaration)
        with self._on_stream():
            flat, to_cpu = self._stage(call)
            return self._deliver_call(call, self._mix(flat, spec, self._nccl), to_cpu)

    def _mix(self, flat: torch.Tensor, spec: NeighborSpec, comm: Any) -> torch.Tensor:
        """Grouped sends (scaled per destination) and receives, then one fused combine; on our stream."""
        from bfexp.comm.nccl_kernels import weighted_sum

        sources = list(spec.src_weights)
        payloads = [flat if w == 1.0 else flat * w for w in spec.dst_weights.values()]
        # One allocation; rows start on 16-byte boundaries so the kernel can use vector loads.
        n = flat.numel()
        per_16 = max(1, 16 // flat.element_size())
        inbox = torch.empty((len(sources), -(-n // per_16) * per_16), dtype=flat.dtype, device=self.device)
        received = [inbox[i, :n] for i in range(len(sources))]
        self._send_recv(list(zip(payloads, spec.dst_weights)), list(zip(received, sources)), comm)
        out = torch.empty_like(flat)
        weighted_sum(
            [as_cupy(flat), *(as_cupy(r) for r in received)],
            [spec.self_weight, *spec.src_weights.values()],
            out=as_cupy(out),
            kind=str(flat.dtype).replace("torch.", ""),
        )
        return out

    def _send_recv(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], comm: Any
    ) -> None:
        """Enqueue sends and receives of raw bytes as one NCCL group, so they progress together."""
        if not sends and not recvs:
            return
        uint8 = self._api.NCCL_UINT8
        self._api.groupStart()
        try:
            for buf, peer in sends:
                comm.send(as_bytes(buf).data_ptr(), buf.numel() * buf.element_size(), uint8, peer, self._stream_ptr)
            for buf, peer in recvs:
                comm.recv(as_bytes(buf).data_ptr(), buf.numel() * buf.element_size(), uint8, peer, self._stream_ptr)
        finally:
            self._api.groupEnd()

    def _post_neighbor_allgather(
        self, call: Call, declaration: GatherDeclaration, srcs: list[int], dsts: list[int]
    ) -> Pending:
        """Always declared: receivers learn the shapes they will get in the same MPI allgather."""
        tensors = call.tensors
        infos = self.comm.allgather((declaration.row, first_dims(tensors)))
        declaration.verify(np.stack([row for row, _ in infos]))
        with self._on_stream():
            flat, to_cpu = self._stage(call)
            width = [sum(c * row_numel(t) for c, t in zip(infos[r][1], tensors)) for r in srcs]
            inbox = [torch.empty(w, dtype=flat.dtype, device=self.device) for w in width]
            self._send_recv([(flat, d) for d in dsts], list(zip(inbox, srcs)), self._nccl)
            pieces = ungather(inbox, [infos[r][1] for r in srcs], tensors)
            return self._deliver(pieces, call.as_given, to_cpu)

    def _machine_communicators(self) -> tuple[Any, Any]:
        """NCCL over this machine's ranks and over the ranks with this local rank (one per machine)."""
        if not self._sub:
            self._sub["local"] = self._open_communicator(self._local)
            self._sub["cross"] = self._open_communicator(self._cross)
        return self._sub["local"], self._sub["cross"]

    def _post_hierarchical(self, call: Call, spec: NeighborSpec, declaration: MachineDeclaration | None) -> Pending:
        """Average inside each machine, mix the machine averages among machines, spread back.

        Every local rank carries 1/local_size of the machine average to the
        same local rank of the neighbor machines (reduce-scatter inside the
        machine, exchange, fused combine, allgather inside the machine), so
        all of a machine's links share the traffic.
        """
        self._check(declaration)
        local, cross = self._machine_communicators()
        L = self.local_size
        with self._on_stream():
            flat, to_cpu = self._stage(call)
            reduce_in = work_dtype(flat.dtype)
            chunk = -(-flat.numel() // L)
            padded = torch.zeros(chunk * L, dtype=reduce_in, device=self.device)
            padded[: flat.numel()] = flat
            mine = torch.empty(chunk, dtype=reduce_in, device=self.device)
            nccl_type = self._type(reduce_in)
            local.reduceScatter(padded.data_ptr(), mine.data_ptr(), chunk, nccl_type, self._api.NCCL_SUM, self._stream_ptr)
            mine.div_(L)  # this rank's slice of its machine's average
            mixed = self._mix(mine, spec, cross)  # the cross communicator's ranks are the machines
            local.allGather(mixed.data_ptr(), padded.data_ptr(), chunk, nccl_type, self._stream_ptr)
            return self._deliver_call(call, padded[: flat.numel()].to(flat.dtype), to_cpu)

    # lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Free windows and communicators (collective: every rank calls it). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._cupy_stream.synchronize()
        for c in (self._nccl, *self._sub.values()):
            c.destroy()
        self._sub = {}
        self._close_host()
