"""CuPy-NCCL engine: the Engine contract on GPUs, one MPI rank per GPU.

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
the device its inputs came from.

Declarations: NCCL waits forever on a receive nobody sends, so before a
neighbor exchange every rank's sources, destinations, size and dtype are
gathered over MPI (one small allgather); a mismatch raises the contract's
CommError on every rank before anything reaches NCCL. Gathers use the same
exchange to learn the shapes they will receive.

Windows (one-sided ops for asynchronous algorithms) are host-staged MPI:
NCCL has only two-sided transfers, which need the target's participation,
while a window's put/get/accumulate must complete without it. The engine
keeps an MPIEngine on the same communicator and runs its MPI-3 windows; a
window lives in host memory (``win_create`` returns its live own value as a
CPU tensor), and GPU tensors handed to put/accumulate are copied to the host.

CuPy is imported lazily: ``nccl_available`` is the cheap probe the CLI runs
before any rank starts.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from bfexp.comm.engine import (
    CODE_DTYPES,
    DTYPE_CODES,
    HALF_DTYPES,
    DstWeights,
    Engine,
    Handle,
    NeighborSpec,
    TensorOrList,
    Weights,
    as_list,
    check_float,
    first_dims,
    fuse,
    mismatch_error,
    payload_bytes,
    pattern_problems,
    restore,
    rows_shape,
    shape_signature,
)

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


def _mpi():
    from mpi4py import MPI

    return MPI


# ------------------------------------------------------------------ declarations (host side, MPI)
def declare(comm: Any, units: int, srcs: Sequence[int], dsts: Sequence[int], info: tuple) -> tuple[list, np.ndarray, np.ndarray]:
    """Every rank's (sources, destinations, info) of one exchange, gathered over MPI.

    Returns (infos by rank, expects[r, u]: r receives from u, sends[r, u]:
    r sends to u); ``units`` are ranks, or machines for hierarchical ops.
    Every rank gets the same table, so every rank finds the same problems.
    """
    table = comm.allgather((sorted(int(u) for u in srcs), sorted(int(u) for u in dsts), info))
    expects = np.zeros((len(table), units), bool)
    sends = np.zeros((len(table), units), bool)
    for r, (s, d, _) in enumerate(table):
        expects[r, s] = True
        sends[r, d] = True
    return [i for _, _, i in table], expects, sends


def gather_info(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a receiver of gathered tensors must know: dtype, count, trailing shapes, first dims."""
    return (DTYPE_CODES.get(tensors[0].dtype, 0), len(tensors), shape_signature(tensors), tuple(first_dims(tensors)))


def gather_problems(infos: Sequence[tuple], pairs: Sequence[tuple[int, int]]) -> list[str]:
    """Gathered tensors may differ in their first dimension only, between the ranks of each pair."""
    problems = []
    for j, i in pairs:
        if infos[j][:3] != infos[i][:3]:
            problems.append(
                f"rank {j} gives {infos[j][1]} tensor(s) of another dtype or trailing shape than rank {i} "
                "(only the first dimension may differ)"
            )
    return problems


def row_numel(t: torch.Tensor) -> int:
    """Elements in one row (dim 0 slice) of ``t``; a 0-d tensor is one row of one."""
    n = 1
    for d in t.shape[1:]:
        n *= int(d)
    return n


def split_gathered(
    rows: Sequence[torch.Tensor], row_counts: Sequence[Sequence[int]], like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Cut each source's fused buffer into its tensors and concatenate them per tensor, source by source."""
    per_tensor: list[list[torch.Tensor]] = [[] for _ in like]
    for row, counts in zip(rows, row_counts):
        offset = 0
        for i, (t, count) in enumerate(zip(like, counts)):
            shape = rows_shape(t, count)
            n = count * row_numel(t)
            per_tensor[i].append(row[offset : offset + n].view(shape))
            offset += n
    return [torch.cat(parts) for parts in per_tensor]


def machine_problems(
    infos: Sequence[tuple], expects: np.ndarray, sends: np.ndarray, local_size: int
) -> list[str]:
    """A hierarchical op: one size and dtype everywhere, one declaration per machine, consistent among machines."""
    problems = []
    for r, info in enumerate(infos):
        if info != infos[0]:
            problems.append(
                f"rank {r} has {info[0]} x {CODE_DTYPES.get(info[1])}, rank 0 has {infos[0][0]} x {CODE_DTYPES.get(infos[0][1])}"
            )
            break
    for r in range(len(infos)):
        lead = r - r % local_size
        if (expects[r] != expects[lead]).any() or (sends[r] != sends[lead]).any():
            problems.append(f"rank {r} declares other machine weights than rank {lead} of its machine")
    leaders = list(range(0, len(infos), local_size))
    return problems + pattern_problems("hierarchical", sends[leaders], expects[leaders], unit="machine")


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


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.detach().cpu() if t is not None and t.is_cuda else t


# ------------------------------------------------------------------ the engine
class NCCLEngine(Engine):
    """The Engine contract over NCCL (through CuPy) on this rank's GPU; see the module doc."""

    name = "nccl"

    def __init__(
        self,
        comm: Any = None,
        ranks_per_machine: int = 0,
        gpu: int | None = None,
        check_neighbors: bool = True,
        timeline_from_env: bool = True,
    ) -> None:
        super().__init__()
        import cupy
        from cupy.cuda import nccl

        from bfexp.comm.mpi import MPIEngine

        MPI = _mpi()
        self._api = nccl
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self._local_size = ranks_per_machine or size
        if size % self._local_size:
            raise ValueError(f"ranks_per_machine={ranks_per_machine} does not divide {size} ranks")
        # Share each exchange's declarations first: NCCL would wait forever on a mismatch.
        self.check_neighbors = check_neighbors
        # MPI communicators are made here, collectively, so no op makes one half-way.
        self.host = MPIEngine(self.comm, ranks_per_machine, timeline_from_env=False)  # windows
        self._local_mpi = self.comm.Split(rank // self._local_size, rank)
        self._cross_mpi = self.comm.Split(rank % self._local_size, rank)
        if gpu is None:  # the rank's index among the ranks of its physical machine
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
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

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

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

    def _stage(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """One flat GPU buffer of the tensors, and whether they came from the CPU.

        No copy for GPU tensors that lie back to back (``fuse``): NCCL reads
        the caller's memory, so callers leave inputs alone until ``wait``.
        """
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

    def _deliver(
        self,
        op: str,
        nbytes: int,
        started: float,
        results: list[torch.Tensor],
        build: Callable[[list[torch.Tensor]], Any],
        to_cpu: bool,
        **meta: Any,
    ) -> Handle:
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

        return self._track(op, nbytes, started, finish, event.query, **meta)

    def _deliver_like(
        self, op: str, nbytes: int, started: float, out: torch.Tensor, like: list[torch.Tensor], single: bool, to_cpu: bool, **meta: Any
    ) -> Handle:
        return self._deliver(op, nbytes, started, [out], lambda outs: restore(outs[0], like, single), to_cpu, **meta)

    # collectives --------------------------------------------------------
    def iallreduce(self, tensors: TensorOrList, op: str = "avg") -> Handle:
        started = time.perf_counter()
        self.check_op(op)
        tensors, single = as_list(tensors)
        if op == "avg":
            check_float(tensors, "allreduce(op='avg')")
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            # Half precision is summed in float32, as the MPI engine does.
            work = flat.float() if flat.dtype in HALF_DTYPES else flat
            out = torch.empty_like(work)
            self._nccl.allReduce(
                work.data_ptr(), out.data_ptr(), work.numel(), self._type(work.dtype),
                self._api.NCCL_SUM, self._stream_ptr,
            )
            if op == "avg":
                out.div_(self.size)
            out = out.to(flat.dtype)
            return self._deliver_like("allreduce", payload_bytes(tensors), started, out, tensors, single, to_cpu)

    def ibroadcast(self, tensors: TensorOrList, root: int = 0) -> Handle:
        started = time.perf_counter()
        if not 0 <= root < self.size:
            raise ValueError(f"root={root}; allowed: 0..{self.size - 1}")
        tensors, single = as_list(tensors)
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            out = torch.empty_like(flat)
            self._nccl.broadcast(
                as_bytes(flat).data_ptr(), as_bytes(out).data_ptr(), flat.numel() * flat.element_size(),
                self._api.NCCL_UINT8, root, self._stream_ptr,
            )
            return self._deliver_like("broadcast", payload_bytes(tensors), started, out, tensors, single, to_cpu, root=root)

    def ibarrier(self) -> Handle:
        """Every rank has enqueued the barrier: a one-element NCCL allreduce."""
        started = time.perf_counter()
        with self._on_stream():
            token = torch.zeros(1, device=self.device)
            self._nccl.allReduce(
                token.data_ptr(), token.data_ptr(), 1, self._api.NCCL_FLOAT32, self._api.NCCL_SUM, self._stream_ptr
            )
            event = torch.cuda.Event()
            event.record(self.stream)
        return self._track("barrier", 0, started, lambda: event.synchronize(), event.query)

    def iallgather(self, tensors: TensorOrList) -> Handle:
        """Every rank's tensor(s) concatenated along dim 0 in rank order (dim 0 may differ).

        Shapes travel in the MPI declaration exchange; NCCL then gathers one
        fused buffer per rank, padded to the longest.
        """
        started = time.perf_counter()
        tensors, single = as_list(tensors)
        infos = self.comm.allgather(gather_info(tensors))
        problems = gather_problems(infos, [(j, 0) for j in range(1, self.size)])
        if problems:
            raise mismatch_error("allgather", problems)
        counts = [sum(c * row_numel(t) for c, t in zip(info[3], tensors)) for info in infos]
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
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
            pieces = split_gathered(list(gathered), [info[3] for info in infos], tensors)
            return self._deliver(
                "allgather", payload_bytes(tensors), started, pieces, lambda outs: outs[0] if single else outs, to_cpu
            )

    # neighbor ops -------------------------------------------------------
    def ineighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        started = time.perf_counter()
        spec = self.neighbor_spec(self_weight, src_weights, dst_weights)
        tensors, single = as_list(tensors)
        check_float(tensors, "neighbor_allreduce")
        if self.check_neighbors:
            numel, code = sum(t.numel() for t in tensors), DTYPE_CODES.get(tensors[0].dtype, 0)
            infos, expects, sends = declare(self.comm, self.size, spec.src_weights, spec.dst_weights, (numel, code))
            problems = pattern_problems(
                "neighbor_allreduce", sends, expects, [i[0] for i in infos], [i[1] for i in infos]
            )
            if problems:
                raise mismatch_error("neighbor_allreduce", problems)
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            out = self._mix(flat, spec, self._nccl)
            return self._deliver_like(
                "neighbor_allreduce", payload_bytes(tensors) * len(spec.dst_weights), started, out, tensors, single,
                to_cpu, src=sorted(spec.src_weights), dst=sorted(spec.dst_weights),
            )

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

    def ineighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> Handle:
        """In-neighbors' tensor(s) concatenated along dim 0 in ascending source rank (dim 0 may differ)."""
        started = time.perf_counter()
        tensors, single = as_list(tensors)
        srcs, dsts = self.neighbor_ranks(src_ranks, dst_ranks)
        # Always declared: receivers learn the shapes they will get.
        infos, expects, sends = declare(self.comm, self.size, srcs, dsts, gather_info(tensors))
        problems = pattern_problems("neighbor_allgather", sends, expects)
        problems += gather_problems(infos, [tuple(e) for e in np.argwhere(sends).tolist()])
        if problems:
            raise mismatch_error("neighbor_allgather", problems)
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            width = [sum(c * row_numel(t) for c, t in zip(infos[r][3], tensors)) for r in srcs]
            inbox = [torch.empty(w, dtype=flat.dtype, device=self.device) for w in width]
            self._send_recv([(flat, d) for d in dsts], list(zip(inbox, srcs)), self._nccl)
            if srcs:
                pieces = split_gathered(inbox, [infos[r][3] for r in srcs], tensors)
            else:  # nobody sends here: no rows
                pieces = [torch.empty(rows_shape(t, 0), dtype=t.dtype, device=self.device) for t in tensors]
            return self._deliver(
                "neighbor_allgather", payload_bytes(tensors) * len(dsts), started, pieces,
                lambda outs: outs[0] if single else outs, to_cpu, src=srcs, dst=dsts,
            )

    def _machine_communicators(self) -> tuple[Any, Any]:
        """NCCL over this machine's ranks and over the ranks with this local rank (one per machine)."""
        if not self._sub:
            self._sub["local"] = self._open_communicator(self._local_mpi)
            self._sub["cross"] = self._open_communicator(self._cross_mpi)
        return self._sub["local"], self._sub["cross"]

    def ihierarchical_neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        """Average inside each machine, mix the machine averages among machines, spread back.

        Every local rank carries 1/local_size of the machine average to the
        same local rank of the neighbor machines (reduce-scatter inside the
        machine, exchange, fused combine, allgather inside the machine), so
        all of a machine's links share the traffic.
        """
        started = time.perf_counter()
        spec = self.machine_spec(self_weight, src_machine_weights, dst_machine_weights)
        tensors, single = as_list(tensors)
        check_float(tensors, "hierarchical_neighbor_allreduce")
        if self.check_neighbors:
            info = (sum(t.numel() for t in tensors), DTYPE_CODES.get(tensors[0].dtype, 0))
            infos, expects, sends = declare(self.comm, self.machines, spec.src_weights, spec.dst_weights, info)
            problems = machine_problems(infos, expects, sends, self.local_size)
            if problems:
                raise mismatch_error("hierarchical_neighbor_allreduce", problems)
        local, cross = self._machine_communicators()
        L = self.local_size
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            work_dtype = torch.float32 if flat.dtype in HALF_DTYPES else flat.dtype
            chunk = -(-flat.numel() // L)
            padded = torch.zeros(chunk * L, dtype=work_dtype, device=self.device)
            padded[: flat.numel()] = flat
            mine = torch.empty(chunk, dtype=work_dtype, device=self.device)
            nccl_type = self._type(work_dtype)
            local.reduceScatter(padded.data_ptr(), mine.data_ptr(), chunk, nccl_type, self._api.NCCL_SUM, self._stream_ptr)
            mine.div_(L)  # this rank's slice of its machine's average
            mixed = self._mix(mine, spec, cross)  # the cross communicator's ranks are the machines
            local.allGather(mixed.data_ptr(), padded.data_ptr(), chunk, nccl_type, self._stream_ptr)
            out = padded[: flat.numel()].to(flat.dtype)
            return self._deliver_like(
                "hierarchical_neighbor_allreduce", payload_bytes(tensors), started, out, tensors, single, to_cpu,
                src_machines=sorted(spec.src_weights), dst_machines=sorted(spec.dst_weights),
            )

    # windows: host-staged MPI (see the module doc) -------------------------
    def win_create(
        self,
        tensor: torch.Tensor,
        name: str,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
        zero_init: bool = True,
        weight: float = 1.0,
    ) -> torch.Tensor:
        """Collective: a window in host memory; returns its live own value (a CPU tensor)."""
        if src_ranks is None or dst_ranks is None:  # the host engine has no topology of its own
            src_ranks, dst_ranks = self.neighbor_ranks(src_ranks, dst_ranks)
        return self._blocking(
            "win_create", lambda: self.host.win_create(_to_host(tensor), name, src_ranks, dst_ranks, zero_init, weight)
        )

    def win_free(self, name: str | None = None) -> None:
        self._blocking("win_free", lambda: self.host.win_free(name))

    def win_tensor(self, name: str) -> torch.Tensor:
        return self.host.win_tensor(name)

    def win_weight(self, name: str) -> float:
        return self.host.win_weight(name)

    def _window_handle(self, op: str, name: str, started: float, peers: int, handle: Handle) -> Handle:
        own = self.host.win_tensor(name)
        return self._track(op, own.numel() * own.element_size() * peers, started, handle.wait, handle.done, window=name)

    def iwin_put(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        started = time.perf_counter()
        handle = self.host.iwin_put(_to_host(tensor), name, self_weight, dst_weights)
        return self._window_handle("win_put", name, started, len(dst_weights or ()), handle)

    def iwin_accumulate(
        self,
        tensor: torch.Tensor | None,
        name: str,
        self_weight: float | None = None,
        dst_weights: DstWeights | None = None,
    ) -> Handle:
        started = time.perf_counter()
        handle = self.host.iwin_accumulate(_to_host(tensor), name, self_weight, dst_weights)
        return self._window_handle("win_accumulate", name, started, len(dst_weights or ()), handle)

    def iwin_get(self, name: str, src_weights: Weights | None = None) -> Handle:
        started = time.perf_counter()
        handle = self.host.iwin_get(name, src_weights)
        return self._window_handle("win_get", name, started, len(src_weights or ()), handle)

    def iwin_update(
        self,
        name: str,
        self_weight: float | None = None,
        src_weights: Weights | None = None,
        reset: bool = False,
    ) -> Handle:
        started = time.perf_counter()
        return self._window_handle("win_update", name, started, 0, self.host.iwin_update(name, self_weight, src_weights, reset))

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
        self.host.close()
        for c in (self._local_mpi, self._cross_mpi):
            c.Free()
