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

import abc
import importlib.util
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from bfexp.comm.engine import (
    CommError,
    DstWeights,
    Engine,
    Handle,
    TensorOrList,
    Weights,
    as_list,
    check_float,
    fuse,
    normalize_dst,
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


# ------------------------------------------------------------------ pattern checks (host side, MPI)
def pattern_problem(
    sends: Sequence[Sequence[int]],
    expects: Sequence[Sequence[int]],
    signatures: Sequence[Any] | None = None,
    unit: str = "rank",
) -> str | None:
    """The first way a send/receive pattern does not match, or None.

    ``sends[q]`` are the peers q sends to, ``expects[r]`` the peers r
    receives from; with ``signatures``, both ends of an edge must agree
    (e.g. element count and dtype). Deterministic, so every rank that
    checks the same table reports the same problem.
    """
    send_sets = [set(map(int, d)) for d in sends]
    for r, sources in enumerate(expects):
        for q in sorted(map(int, sources)):
            if r not in send_sets[q]:
                return f"{unit} {r} expects a message from {unit} {q}, but {unit} {q} does not send to {unit} {r}"
            if signatures is not None and signatures[q] != signatures[r]:
                return f"{unit} {q} sends {signatures[q]} to {unit} {r}, which expects {signatures[r]}"
    expect_sets = [set(map(int, s)) for s in expects]
    for q, targets in enumerate(sends):
        for r in sorted(targets):
            if q not in expect_sets[r]:
                return f"{unit} {q} sends to {unit} {r}, but {unit} {r} does not expect a message from {unit} {q}"
    return None


def check_pattern(
    comm: Any,
    op: str,
    dsts: Any,
    srcs: Any,
    signature: Any,
    same_signature: bool = True,
    unit: str = "rank",
) -> list[Any]:
    """Share every rank's (destinations, sources, signature) over MPI; raise CommError on every rank on a mismatch.

    Returns every rank's signature (receivers learn what they will get).
    NCCL would wait forever instead: a receive nobody sends never ends.
    """
    table = comm.allgather((sorted(int(d) for d in dsts), sorted(int(s) for s in srcs), signature))
    signatures = [sig for _, _, sig in table]
    problem = pattern_problem([d for d, _, _ in table], [s for _, s, _ in table], signatures if same_signature else None, unit)
    if problem:
        raise CommError(f"{op}: {problem}")
    return signatures


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_gather_shapes(op: str, everyone: Sequence[tuple[tuple, str]]) -> None:
    """Gathered tensors may differ in their first dimension only; every rank checks the same table."""
    shapes0, dtype0 = everyone[0]
    for r, (shapes, dtype) in enumerate(everyone):
        if dtype != dtype0 or len(shapes) != len(shapes0):
            raise CommError(f"{op}: rank {r} gives {len(shapes)} x {dtype}, rank 0 gives {len(shapes0)} x {dtype0}")
        for i, (a, b) in enumerate(zip(shapes, shapes0)):
            if len(a) == 0 or tuple(a[1:]) != tuple(b[1:]):
                raise CommError(
                    f"{op}: tensor {i} is {tuple(a)} on rank {r} and {tuple(b)} on rank 0; "
                    "allowed: the same shape except the first dimension (at least 1-d)"
                )


def split_gathered(rows: Sequence[torch.Tensor], shapes: Sequence[Sequence[tuple]]) -> list[torch.Tensor]:
    """Cut each source's fused row into its tensors and concatenate them per tensor, source by source."""
    per_tensor: list[list[torch.Tensor]] = [[] for _ in shapes[0]]
    for row, row_shapes in zip(rows, shapes):
        offset = 0
        for i, shape in enumerate(row_shapes):
            n = _numel(shape)
            per_tensor[i].append(row[offset : offset + n].view(shape))
            offset += n
    return [torch.cat(parts) for parts in per_tensor]


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
WINDOW_PREFIXES = ("win_", "iwin_")


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

    def __init__(
        self, comm: Any = None, ranks_per_machine: int = 0, gpu: int | None = None, check_neighbors: bool = True
    ) -> None:
        super().__init__()
        # NCCL waits forever on a receive nobody sends: check each exchange's pattern over MPI first.
        self.check_neighbors = check_neighbors
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
        # Host-side partner on the same communicator: windows are host-staged MPI.
        self.host = MPIEngine(self.comm, ranks_per_machine)
        self._windows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

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
        return self._deliver([result], lambda outs: restore(outs[0], like, single), to_cpu)

    def _deliver(self, results: list[torch.Tensor], build: Callable[[list[torch.Tensor]], Any], to_cpu: bool) -> Handle:
        """Record the end of the enqueued work; ``wait`` passes the results (on the caller's device) to ``build``."""
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

    def iallgather(self, tensors: TensorOrList) -> Handle:
        """Every rank's tensor(s) concatenated along the first dimension in rank order (first dims may differ).

        Shapes are exchanged over MPI first; NCCL then gathers one fused,
        padded buffer per rank.
        """
        tensors, single = as_list(tensors)
        mine = (tuple(tuple(t.shape) for t in tensors), str(tensors[0].dtype))
        everyone = self.comm.allgather(mine)
        check_gather_shapes("allgather", everyone)
        counts = [sum(_numel(s) for s in shapes) for shapes, _ in everyone]
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
                self._nccl_api.NCCL_UINT8, self._stream_ptr,
            )
            pieces = split_gathered(list(gathered), [shapes for shapes, _ in everyone])
            return self._deliver(pieces, lambda outs: outs[0] if single else outs, to_cpu)

    def allgather(self, tensors: TensorOrList) -> TensorOrList:
        return self._timed_wait(self.iallgather(tensors))

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
        if self.check_neighbors:
            signature = (sum(t.numel() for t in tensors), str(tensors[0].dtype))
            check_pattern(self.comm, "neighbor_allreduce", spec.dst_weights, spec.src_weights, signature)
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            received = self._exchange(flat, spec.dst_weights, list(spec.src_weights))
            out = self._combine(flat, spec.self_weight, received, list(spec.src_weights.values()))
            return self._handle(out, tensors, single, to_cpu)

    def _exchange(
        self, flat: torch.Tensor, dst_weights: dict[int, float], sources: list[int], comm: Any = None
    ) -> list[torch.Tensor]:
        """Grouped NCCL sends (scaled per destination) and receives; on the communication stream."""
        payloads = [flat if w == 1.0 else flat * w for w in dst_weights.values()]
        # One allocation; rows start on 16-byte boundaries so the kernel can use vector loads.
        n = flat.numel()
        per_16 = max(1, 16 // flat.element_size())
        inbox = torch.empty((len(sources), -(-n // per_16) * per_16), dtype=flat.dtype, device=self.device)
        rows = [inbox[i, :n] for i in range(len(sources))]
        self._send_recv(list(zip(payloads, dst_weights)), list(zip(rows, sources)), comm)
        return rows

    def _send_recv(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], comm: Any = None
    ) -> None:
        """Enqueue sends and receives of raw bytes as one NCCL group, so they progress together."""
        if not sends and not recvs:
            return
        comm = comm or self._nccl
        uint8 = self._nccl_api.NCCL_UINT8
        self._nccl_api.groupStart()
        try:
            for buf, peer in sends:
                comm.send(as_bytes(buf).data_ptr(), buf.numel() * buf.element_size(), uint8, peer, self._stream_ptr)
            for buf, peer in recvs:
                comm.recv(as_bytes(buf).data_ptr(), buf.numel() * buf.element_size(), uint8, peer, self._stream_ptr)
        finally:
            self._nccl_api.groupEnd()

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

    def ineighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> Handle:
        """In-neighbors' tensor(s) concatenated along the first dimension, in ascending rank order."""
        tensors, single = as_list(tensors)
        if src_ranks is None or dst_ranks is None:
            spec = self.neighbor_spec(None, None, None)
            src_ranks = sorted(spec.src_weights) if src_ranks is None else src_ranks
            dst_ranks = list(spec.dst_weights) if dst_ranks is None else dst_ranks
        srcs = sorted(int(r) for r in src_ranks)
        dsts = [int(r) for r in dst_ranks]
        for r in srcs + dsts:
            if not 0 <= r < self.size or r == self.rank:
                raise ValueError(f"rank {self.rank}: bad neighbor rank {r}; allowed 0..{self.size - 1} except self")
        # The pattern exchange also tells each receiver the shapes it will get.
        mine = (tuple(tuple(t.shape) for t in tensors), str(tensors[0].dtype))
        everyone = check_pattern(self.comm, "neighbor_allgather", dsts, srcs, mine, same_signature=False)
        check_gather_shapes("neighbor_allgather", everyone)
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            inbox = [
                torch.empty(sum(_numel(s) for s in everyone[r][0]), dtype=flat.dtype, device=self.device) for r in srcs
            ]
            self._send_recv([(flat, d) for d in dsts], list(zip(inbox, srcs)))
            if srcs:
                pieces = split_gathered(inbox, [everyone[r][0] for r in srcs])
            else:  # nobody sends here: empty tensors of the right trailing shape
                pieces = [torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in tensors]
            return self._deliver(pieces, lambda outs: outs[0] if single else outs, to_cpu)

    def neighbor_allgather(
        self,
        tensors: TensorOrList,
        src_ranks: Sequence[int] | None = None,
        dst_ranks: Sequence[int] | None = None,
    ) -> TensorOrList:
        return self._timed_wait(self.ineighbor_allgather(tensors, src_ranks, dst_ranks))

    # hierarchical -------------------------------------------------------
    def _machine_communicators(self) -> tuple[Any, Any, Any]:
        """(NCCL over this machine's ranks, NCCL over the ranks with this local rank, its MPI twin); opened once."""
        if "local" not in self._sub:
            local = self.comm.Split(color=self.machine, key=self.local_rank)
            cross = self.comm.Split(color=self.local_rank, key=self.machine)
            self._sub["local"] = self._open_communicator(local)
            self._sub["cross"] = self._open_communicator(cross)
            self._cross_mpi = cross
            local.Free()
        return self._sub["local"], self._sub["cross"], self._cross_mpi

    def ihierarchical_neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> Handle:
        """Average inside each machine, mix the machine averages among machines, spread back.

        Weights are per machine (as neighbor_allreduce's are per rank). Every
        local rank carries 1/local_size of the machine average to the same
        local rank of the neighbor machines (reduce-scatter inside the
        machine, exchange, fused combine, allgather inside the machine), so
        all of a machine's links share the traffic.
        """
        if self_weight is None or src_machine_weights is None or dst_machine_weights is None:
            raise ValueError("hierarchical_neighbor_allreduce needs self_weight, src_machine_weights and dst_machine_weights")
        src = {int(k): float(v) for k, v in src_machine_weights.items()}
        dst = normalize_dst(dst_machine_weights) or {}
        for m in list(src) + list(dst):
            if not 0 <= m < self.machines or m == self.machine:
                raise ValueError(
                    f"rank {self.rank}: bad neighbor machine {m}; allowed 0..{self.machines - 1} except own machine {self.machine}"
                )
        tensors, single = as_list(tensors)
        check_float(tensors, "hierarchical_neighbor_allreduce")
        local, cross, cross_mpi = self._machine_communicators()
        L = self.local_size
        if self.check_neighbors:
            signature = (sum(t.numel() for t in tensors), str(tensors[0].dtype))
            check_pattern(cross_mpi, "hierarchical_neighbor_allreduce (machines)", dst, src, signature, unit="machine")
        with self._on_stream():
            flat, to_cpu = self._stage(tensors)
            work_dtype = torch.float32 if flat.dtype in HALF_TYPES else flat.dtype
            chunk = -(-flat.numel() // L)
            padded = torch.zeros(chunk * L, dtype=work_dtype, device=self.device)
            padded[: flat.numel()] = flat
            mine = torch.empty(chunk, dtype=work_dtype, device=self.device)
            nccl_type = self._type(work_dtype)
            local.reduceScatter(
                padded.data_ptr(), mine.data_ptr(), chunk, nccl_type, self._nccl_api.NCCL_SUM, self._stream_ptr
            )
            mine.div_(L)  # this rank's slice of the machine average
            received = self._exchange(mine, dst, list(src), comm=cross)
            mixed = self._combine(mine, float(self_weight), received, list(src.values()))
            local.allGather(mixed.data_ptr(), padded.data_ptr(), chunk, nccl_type, self._stream_ptr)
            out = padded[: flat.numel()].to(flat.dtype)
            return self._handle(out, tensors, single, to_cpu)

    def hierarchical_neighbor_allreduce(
        self,
        tensors: TensorOrList,
        self_weight: float | None = None,
        src_machine_weights: Weights | None = None,
        dst_machine_weights: DstWeights | None = None,
    ) -> TensorOrList:
        return self._timed_wait(
            self.ihierarchical_neighbor_allreduce(tensors, self_weight, src_machine_weights, dst_machine_weights)
        )

    # windows: host-staged MPI -------------------------------------------
    def _to_host(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu() if value.is_cuda else value
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._to_host(v) for v in value)
        return value

    def _to_device(self, value: Any, device: torch.device) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._to_device(v, device) for v in value)
        return value

    def _host_window_call(self, op: str, args: tuple, kwargs: dict) -> Any:
        """Run the MPI engine's window op on host copies; results and the window's own tensor come back."""
        values = [*args, *kwargs.values()]
        names = [v for v in values if isinstance(v, str)]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        name = names[0] if names else None
        host_args = tuple(self._to_host(a) for a in args)
        host_kwargs = {k: self._to_host(v) for k, v in kwargs.items()}
        if op == "win_create" and name is not None and tensors:
            # Keep the host copy MPI updates in place, and the GPU tensor it mirrors.
            self._windows[name] = (tensors[0], next(a for a in (*host_args, *host_kwargs.values()) if isinstance(a, torch.Tensor)))
        device = self._windows[name][0].device if name in self._windows else (tensors[0].device if tensors else self.device)
        result = getattr(self.host, op)(*host_args, **host_kwargs)

        def back(value: Any) -> Any:
            if op.endswith("win_free"):
                self._windows.pop(name, None)
            if name in self._windows and isinstance(value, torch.Tensor):
                mirror, host = self._windows[name]
                if value.data_ptr() == host.data_ptr():  # MPI updated the window's own tensor in place
                    mirror.copy_(value)
                    return mirror
            return self._to_device(value, device)

        if isinstance(result, Handle):
            return Handle(lambda: back(result.wait()), result.done)
        return back(result)

    # lifecycle ----------------------------------------------------------
    def close(self) -> None:
        comms = [self.__dict__.pop("_nccl", None), *self.__dict__.get("_sub", {}).values()]
        self._sub = {}
        if comms and comms[0] is not None:
            self._cupy_stream.synchronize()
        for c in comms:
            if c is not None:
                c.destroy()


def _window_method(op: str) -> Callable[..., Any]:
    def method(self: NCCLEngine, *args: Any, **kwargs: Any) -> Any:
        return self._host_window_call(op, args, kwargs)

    method.__name__ = op
    method.__qualname__ = f"NCCLEngine.{op}"
    method.__doc__ = f"Host-staged MPI: ``MPIEngine.{op}`` on host copies; tensors come back to the GPU."
    return method


def _install_window_methods() -> None:
    """Every window op of the MPI engine, host-staged (NCCL has no one-sided transfers)."""
    from bfexp.comm.mpi import MPIEngine

    for op in dir(MPIEngine):
        if op.startswith(WINDOW_PREFIXES) and callable(getattr(MPIEngine, op)):
            setattr(NCCLEngine, op, _window_method(op))
    abc.update_abstractmethods(NCCLEngine)


_install_window_methods()
