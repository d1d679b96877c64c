"""Stacked virtual ranks (engine=stacked): every rank is one slice of one batched tensor program.

Virtual ranks as threads (bfexp.comm.threads) run each rank's forward,
backward, optimizer step and engine calls in Python, one rank at a time:
about 2 ms per rank-step whatever the model. Here ONE engine object holds
every rank, and every tensor it is given has the ranks as its LAST
dimension: rank r's value of a tensor ``t`` is ``t[..., r]``. Then

* the model (``StackedModel``) keeps every rank's parameters as one
  ``(numel per rank, n)`` parameter whose memory is ranks-first (rank r's
  model lies together), so each layer's weights are a ``(n, *shape)``
  view that batched kernels read without a copy; forward and backward run
  for every rank at once (batched kernels for a plain stack of layers,
  else ``torch.func``: functional_call, vmapped over the rank dimension
  and each rank's own mini-batch);
* the local optimizer is the user's torch.optim class over the stacked
  parameters: SGD (momentum, Nesterov, weight decay), Adam, AdamW, Adagrad,
  RMSprop, Adamax and NAdam are elementwise, so one of them over the stack
  is n independent ones (``ELEMENTWISE_OPTIMIZERS``);
* the algorithms run unchanged (bfexp.algorithms): their update is
  elementwise plus engine operations, and their flat buffers are
  ``(numel per rank, n)`` (``flatten_parameters_``), so their slices cut the
  same elements as on one rank; the engine reads such a slice in its own
  (ranks-first, strided) memory, without fusing it. A rule states ``stackable``; the others
  (asynchronous window rules, ddp, compressed messages) are refused before
  the run, naming why and what to use instead;
* the engine's operations act on the rank dimension: ``neighbor_allreduce``
  of round t is the sparse product ``X W(t)^T`` (``imix_``, which the
  algorithms' ``start_mix``/``start_push`` call with the round's number),
  allreduce the mean (or sum) over ranks, broadcast and allgather read the
  ranks' slices, hierarchical_neighbor_allreduce averages each machine's
  slices and mixes the machines. Per-rank weights (a neighbor op given one
  rank's weights) and one-sided windows have no stacked form: ValueError.

The contract's front halves (bfexp.comm.engine) are reused as they are:
fusing, in-place delivery, timing, bytes. ``bytes_sent`` counts one rank's
bytes (the mean over ranks), as a rank of another engine counts its own.

Evaluation: every rank's model on the held-out set, in blocks of ranks x samples through the same
vmapped forward; above ``EVAL_RANKS`` ranks, that many evenly spaced ranks stand for all (the summary's
``eval_ranks`` says how many).

Time: the stack has one clock (every rank steps in lock step); ``advance``
moves it by a rank's share of the stack's compute time (``seconds / n``),
so ``time_source`` is "simulated" as on threads.

Numerics: float64 runs equal engine=threads (and so MPI) to rounding
(summation orders differ: 1e-12 over 50 steps in tests/test_stacked.py).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from bfexp.comm.declarations import Declaration, GatherDeclaration, MachineDeclaration, Table
from bfexp.comm.engine import Call, Engine, Handle, NeighborSpec, Pending, TensorOrList, Window
from bfexp.comm.engine import check_float, local_size_for, recorded, work_dtype
from bfexp.errors import ConfigError, RankAborted, number_in

if TYPE_CHECKING:
    from bfexp.schema import Settings

__all__ = ["ELEMENTWISE_OPTIMIZERS", "STACKABLE_ALGORITHMS", "StackedData", "StackedEngine", "StackedModel",
           "StackedSampler", "check_job", "check_stackable_model", "freed_memory_kept", "job_refusal"]

# The shipped rules whose update is elementwise plus engine operations (each class states ``stackable``).
STACKABLE_ALGORITHMS = ("dsgd", "exact_diffusion", "gradient_tracking", "push_sum", "push_diging", "allreduce",
                        "choco_sgd", "diloco", "slowmo", "qg_dsgdm")
# torch optimizers whose step is elementwise given the step count (one over the stack = n independent ones).
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam")
# Layers that couple the samples of a batch in train mode: one rank's batch statistics are not a slice.
BATCH_COUPLED = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
                 torch.nn.LazyBatchNorm1d, torch.nn.LazyBatchNorm2d, torch.nn.LazyBatchNorm3d)
# Input values one evaluation block forwards at once, over its ranks and samples (StackedModel.evaluate):
# 65536 (rank, sample) pairs of 32 features, 2675 of MNIST's 784 (whose first conv makes 16x as many).
EVAL_BLOCK = 1 << 21
# Most ranks whose models an evaluation forwards: above it, this many evenly spaced ranks (rank 0 and rank
# n - 1 among them) stand for all, and the summary's ``eval_ranks`` says so. Every rank on the held-out set
# costs n x samples forwards: 4096 mlp ranks on 2000 samples took 12-22 s an evaluation here, loaded.
EVAL_RANKS = 512
# Values a band of the mixing moves at once (``StackedEngine._mixed``): what stays in cache while the
# sparse product reads each rank's neighbors.
BLOCK = 1 << 18
# Input values of the ranks a convolutional program forwards at once (LayerProgram): the convolutions'
# activations of a few ranks stay in cache between the layers, where every rank's at once stream through
# memory (128 cnn ranks on MNIST, 2 at a time: 2.5 -> 1.1 s a training step here).
CONV_BLOCK = 1 << 16


@contextmanager
def freed_memory_kept() -> Iterator[None]:
    """While a stacked job runs, glibc's malloc keeps the memory that tensors free for the next ones
    (``mallopt``: no mmap per large block, no trimming), then hands it back (``malloc_trim``). Each
    step's tensors are tens of MB at thousands of ranks; each came from a fresh mmap, whose every
    4 KiB page the kernel faulted in and zeroed: 4096 ranks of mlp spent 37 s of 89 in the kernel
    here, 17 s of 69 with this, at 1.6 rather than 1.2 GiB peak. Elsewhere than glibc: nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    kept = mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # a C int: trim above 2 GiB free
    try:
        yield
    finally:
        if kept:  # glibc's defaults: 65536 mmapped blocks, trim above 128 KiB
            mallopt(M_MMAP_MAX, 65536)
            mallopt(M_TRIM_THRESHOLD, 128 * 1024)
            trim(0)


class StackedEngine(Engine):
    """Every rank of a job in one engine object; tensors carry the ranks as their last dimension."""

    name: ClassVar[str] = "stacked"
    time_source: ClassVar[str] = "simulated"
    virtual: ClassVar[bool] = True
    processes: ClassVar[bool] = False
    device_type: ClassVar[str] = "cpu"
    stacked: ClassVar[bool] = True
    check_neighbors = False  # one program: its exchanges cannot disagree

    def __init__(self, world: Any = None, rank: int = 0, *, size: int = 1, ranks_per_machine: int = 0,
                 timeline: bool = False) -> None:
        """``size`` ranks. ``world`` (a bfexp.comm.threads.ThreadWorld of one thread) is the launcher's
        supervision: an abort there (a signal, a hang verdict) raises at the next engine call.
        ``ranks_per_machine`` groups the ranks into machines (0: one) for hierarchical ops;
        ``timeline``: a Chrome trace of the stack's operations into <run dir>/timeline/rank0.json."""
        super().__init__()
        if rank != 0:
            raise ValueError(f"rank={rank}; allowed: 0 (one engine holds every rank)")
        self._size = int(number_in("ranks", size, low=1, integer=True))
        self._local_size = local_size_for(self._size, int(ranks_per_machine))
        self.world = world
        self._clock = 0.0
        self._matrices: dict[tuple, tuple[torch.Tensor, float]] = {}
        if world is not None and getattr(world, "timeline_dir", None) is not None:
            from bfexp.timeline import Timeline

            self.timeline = Timeline(Path(world.timeline_dir) / "rank0.json", 0)

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return self._size

    def coordinator(self) -> Engine:
        """A world of one rank for what the stack decides as one program (the single-rank reference's
        plan, rank 0's choice): its collectives carry plain values, not a value per rank."""
        from bfexp.comm.threads import ThreadsEngine, ThreadWorld

        return ThreadsEngine(ThreadWorld(1), 0)

    # simulated time ------------------------------------------------------
    @property
    def clock_s(self) -> float:
        """Every rank's simulated clock (the ranks step in lock step)."""
        return self._clock

    @recorded
    def advance(self, seconds: float) -> None:
        """``seconds`` of the stack's compute pass: each rank's clock moves by its share, ``seconds / size``."""
        self._clock += float(seconds) / self._size

    # plumbing ------------------------------------------------------------
    def _track(self, op: str, nbytes: int, started: float, wait_fn: Callable[[], Any],
               test_fn: Callable[[], bool] | None = None, **args: Any) -> Handle:
        """Every op: an abort of the job raises here; ``nbytes`` (all ranks' message) counts one rank's."""
        if self.world is not None and self.world.failed:
            raise RankAborted("the job was stopped")
        return super()._track(op, nbytes / self._size, started, wait_fn, test_fn, **args)  # a mean: not floored

    def stack(self, tensors: Sequence[torch.Tensor], call: Call) -> torch.Tensor:
        """The call's input as ``(elements per rank, ranks)``; ValueError for a tensor without the ranks last.
        One tensor is read in its own memory, whatever its layout (a rule's slice of its ranks-first flat
        buffer is a strided view, which fusing would copy, and delivering copy back); a list is fused."""
        for t in tensors:
            if t.dim() == 0 or t.shape[-1] != self._size:
                raise ValueError(f"engine=stacked: a tensor of shape {tuple(t.shape)}; allowed: the {self._size} "
                                 "ranks as its last dimension")
        if len(tensors) == 1:
            try:
                return tensors[0].detach().view(-1, self._size)
            except RuntimeError:  # a layout that does not flatten without a copy: fused
                pass
        return call.flat.view(-1, self._size)

    def result(self, call: Call, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[], TensorOrList]]:
        """Where an op on ``x`` (``stack``'s) writes its result, shaped like ``x``, and how the result then
        reaches the caller: in place, ``x`` itself (the caller's memory, or the fused buffer copied back)."""
        if len(call.tensors) == 1 and x.data_ptr() == call.tensors[0].data_ptr():  # the caller's own memory
            out = x if call.inplace else torch.empty_like(x)
            return out, lambda: call.deliver(out)
        flat = call.out_buffer()
        return flat.view(-1, self._size), lambda: call.deliver(flat)

    def matrix(self, topology: Any, t: int, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        """``(1 - scale) I + scale W(t)`` of ``topology`` as a sparse CSR tensor, and the mean out-degree
        (messages per rank); made once per round, scale and dtype."""
        key = (id(topology), t % topology.period, float(scale), dtype)
        hit = self._matrices.get(key)
        if hit is None:
            m = topology.sparse_matrix(t)
            n = self._size
            diag = np.arange(n)
            rows = np.concatenate([diag, m.receivers])
            cols = np.concatenate([diag, m.senders])
            values = np.concatenate([(1.0 - scale) + scale * m.diag, scale * m.values])
            hit = self._matrices[key] = (sparse_csr(rows, cols, values, n, dtype), len(m.values) / n)
        return hit

    # mixing: every rank's neighbor_allreduce at once ---------------------
    @recorded
    def imix_(self, tensors: TensorOrList, topology: Any, t: int, scale: float = 1.0,
              wire_bytes: int | None = None) -> Handle:
        """Start ``X := X ((1 - scale) I + scale W(t))^T`` in place: for each rank i, ``(1 - scale) x_i +
        scale sum_j W(t)[i, j] x_j``; what neighbor_allreduce of round t gives on each rank of another
        engine (row-stochastic mixing and column-stochastic pushes alike: both are the product W X).
        ``wire_bytes``: one rank's message as it travels when not the tensor itself (a compressed payload,
        which the receivers decode into what is mixed here), counted instead of the tensor's bytes."""
        started = time.perf_counter()
        call = Call(tensors, inplace=True)
        check_float(call.tensors, "neighbor_allreduce")
        x = self.stack(call.tensors, call)
        out, deliver = self.result(call, x)
        degree = self._mixed(x, topology, t, scale, out)
        delivered = deliver()
        message = call.nbytes if wire_bytes is None else int(wire_bytes) * self._size
        return self._track("neighbor_allreduce", int(message * degree), started, lambda: delivered,
                           peers=("graph", topology, t, True))

    def _mixed(self, x: torch.Tensor, topology: Any, t: int, scale: float, out: torch.Tensor) -> float:
        """``x`` (elements, ranks) mixed by round t of ``topology`` into ``out`` (``x`` itself, or a buffer
        shaped like it); returns the mean out-degree. The sparse product runs ranks-first, on ``x.t()``,
        in bands of about ``BLOCK`` values (a band's rows stay in cache while the product reads each
        rank's neighbors): over ranks-first memory (the rules' flat buffers) ``x.t()`` is read as it lies;
        over ranks-last memory each band is turned, mixed and turned back, a third of the time of the
        whole product at once (4096 ranks of mlp: 37 against 107 ms here)."""
        work = work_dtype(x.dtype)
        w, degree = self.matrix(topology, t, scale, work)
        band = max(1, BLOCK // self._size)
        xt, outt = x.t(), out.t()  # (ranks, elements)
        for a in range(0, x.shape[0], band):
            outt[:, a : a + band].copy_(torch.sparse.mm(w, xt[:, a : a + band].to(work).contiguous()))
        return degree

    def _neighbor_allreduce(
        self, tensors: TensorOrList, self_weight: float | None, src_weights: Any, dst_weights: Any,
        inplace: bool, blocking: bool, t: int = 0,
    ) -> Handle:
        """The contract's public neighbor_allreduce forms, by the engine topology's W(t)."""
        if self_weight is not None or src_weights is not None or dst_weights is not None:
            raise ValueError("engine=stacked mixes every rank by the topology's W(t); weights given for one rank "
                             "have no stacked form; allowed: no weights (engine.set_topology), or engine.imix_")
        if self.topology is None:
            raise ValueError("neighbor op without weights needs engine.set_topology(...)")
        started = time.perf_counter()
        call = Call(tensors, inplace)
        check_float(call.tensors, "neighbor_allreduce")
        x = self.stack(call.tensors, call)
        out, deliver = self.result(call, x)
        degree = self._mixed(x, self.topology, t, 1.0, out)
        delivered = deliver()
        return self._track("neighbor_allreduce", int(call.nbytes * degree), started, lambda: delivered,
                           peers=("graph", self.topology, t, True))

    def _hierarchical(self, tensors: TensorOrList, self_weight: float | None, src_weights: Any, dst_weights: Any,
                      inplace: bool) -> Handle:
        """Each machine's average, mixed among machines by the machine topology (``set_machine_topology``)."""
        if self_weight is not None or src_weights is not None or dst_weights is not None:
            raise ValueError("engine=stacked mixes machines by the machine topology; weights given for one machine "
                             "have no stacked form; allowed: no weights (engine.set_machine_topology)")
        if self.machine_topology is None:
            raise ValueError("neighbor op without weights needs engine.set_machine_topology(...)")
        started = time.perf_counter()
        call = Call(tensors, inplace)
        check_float(call.tensors, "hierarchical_neighbor_allreduce")
        x = self.stack(call.tensors, call)
        work = work_dtype(x.dtype)
        machines = x.to(work).view(x.shape[0], self.machines, self.local_size).mean(2)  # (elements, machines)
        w, degree = self._machine_matrix(work)
        mixed = torch.sparse.mm(w, machines.t()).t()  # (elements, machines)
        out, deliver = self.result(call, x)
        out.view(x.shape[0], self.machines, self.local_size).copy_(mixed.unsqueeze(2))
        delivered = deliver()
        peers = None if self.ledger is None else ("machines", self.machine_topology.weights(0, 0).dst_weights, degree)
        return self._track("hierarchical_neighbor_allreduce", int(call.nbytes * degree), started, lambda: delivered,
                           peers=peers)

    def _machine_matrix(self, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        topology = self.machine_topology
        m = topology.sparse_matrix(0)
        n = topology.size
        diag = np.arange(n)
        rows, cols = np.concatenate([diag, m.receivers]), np.concatenate([diag, m.senders])
        return sparse_csr(rows, cols, np.concatenate([m.diag, m.values]), n, dtype), len(m.values) / n

    # collectives ----------------------------------------------------------
    def _post_allreduce(self, call: Call, op: str, blocking: bool) -> Pending:
        x = self.stack(call.tensors, call)
        total = x.to(work_dtype(x.dtype)).sum(1, keepdim=True)
        if op == "avg":
            total.div_(self._size)
        out, deliver = self.result(call, x)
        out.copy_(total.expand(-1, self._size))
        delivered = deliver()
        return (lambda: delivered), None

    def _post_broadcast(self, call: Call, root: int) -> Pending:
        x = self.stack(call.tensors, call)
        source = x[:, root : root + 1].clone()
        out, deliver = self.result(call, x)
        out.copy_(source.expand(-1, self._size))
        delivered = deliver()
        return (lambda: delivered), None

    def _post_allgather(self, call: Call) -> Pending:
        self.stack(call.tensors, call)
        n = self._size
        # rank r's tensor is t[..., r]; every rank gets them concatenated along dim 0 in rank order
        outs = [t.detach().movedim(-1, 0).reshape(n * (t.shape[0] if t.dim() > 1 else 1), *t.shape[1:-1])
                .unsqueeze(-1).expand(*([-1] * (t.dim() - 1 if t.dim() > 1 else 1)), n).clone() for t in call.tensors]
        result = call.as_given(outs)
        return (lambda: result), None

    def _post_barrier(self, blocking: bool) -> Pending:
        return (lambda: None), None

    # what has no stacked form ---------------------------------------------
    def _post_neighbor_allreduce(self, call: Call, spec: NeighborSpec, declaration: Declaration | None,
                                 blocking: bool) -> Pending:  # pragma: no cover - _neighbor_allreduce is overridden
        raise AssertionError("engine=stacked mixes in _neighbor_allreduce")

    def _post_neighbor_allgather(self, call: Call, declaration: GatherDeclaration, srcs: list[int],
                                 dsts: list[int]) -> Pending:
        raise ValueError("engine=stacked: neighbor_allgather gives each rank as many rows as it has in-neighbors, "
                         "which one stacked tensor cannot hold; allowed: engine=threads or engine=mpi")

    def _post_hierarchical(self, call: Call, spec: NeighborSpec,
                           declaration: MachineDeclaration | None) -> Pending:  # pragma: no cover - overridden
        raise AssertionError("engine=stacked mixes machines in _hierarchical")

    def _declare_all(self, declaration: Declaration) -> np.ndarray:
        return np.stack([declaration.row] * self._size)

    def _no_windows(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("engine=stacked has no one-sided windows (asynchronous rules have no batched order); "
                         "allowed: engine=threads or engine=mpi")

    def _win_allocate(self, name: str, flat: torch.Tensor, srcs: list[int], dsts: list[int], declared: Table) -> Window:
        return self._no_windows()

    _win_release = _win_send = _win_fetch = _win_swap = _no_windows  # type: ignore[assignment]

    def win_create(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._no_windows()


def sparse_csr(rows: np.ndarray, cols: np.ndarray, values: np.ndarray, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The (n, n) matrix with ``values`` at (rows, cols) as torch's sparse CSR (torch calls its CSR support
    beta, and warns so once per process: a mixing matrix is the plain case it supports)."""
    import warnings

    index = torch.from_numpy(np.stack([rows, cols]).astype(np.int64))
    coo = torch.sparse_coo_tensor(index, torch.from_numpy(values), (n, n), check_invariants=True).coalesce()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return coo.to(dtype).to_sparse_csr()


# ---------------------------------------------------------------- the model


class StackedModel(torch.nn.Module):
    """``size`` copies of one architecture as one module, every copy starting from the given model's values.

    Its one parameter, ``flat``, is ``(numel per rank, size)``: row k is element k of every rank's flat
    model, the layout the algorithms' flat buffers have (bfexp.algorithms.base.flatten_parameters_), and
    rank r's model is the column ``flat[:, r]``. In memory the ranks come FIRST (``flat.t()`` is
    contiguous: rank r's whole model lies together), so each layer's weights are, without a copy, a
    ``(size, *shape)`` view that batched kernels read as they are (``rank_first``), and backward writes
    the gradient in that layout too. ``forward(x)`` takes each rank's batch, ``x[r]``, and returns
    ``(size, batch, classes)``; ``losses`` each rank's mean loss. The architecture itself is kept apart
    (not a submodule): only the stack is trained."""

    def __init__(self, model: torch.nn.Module, size: int) -> None:
        super().__init__()
        check_stackable_model(model)
        self.size = int(size)
        params = [p for _, p in model.named_parameters()]
        self._names = [name for name, _ in model.named_parameters()]
        self._shapes = [tuple(p.shape) for p in params]
        self._spans = spans(self._shapes)
        memory = torch.empty(self.size, self._spans[-1][1], dtype=params[0].dtype)
        for p, (a, b) in zip(params, self._spans):
            memory[:, a:b] = p.detach().reshape(1, -1)
        self.flat = torch.nn.Parameter(memory.t(), requires_grad=any(p.requires_grad for p in params))
        object.__setattr__(self, "_base", model)

        def one(params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self._base, dict(zip(self._names, params)), (x,))

        # vmapped over the ranks as the FIRST dimension (``rank_first``): over a ranks-last layout every
        # batched matmul and activation ran strided, 1.5x slower per training step and 3-8x per evaluation
        # (4096 ranks of mlp here).
        vmapped_own = torch.func.vmap(one, in_dims=(0, 0))  # each rank its own batch
        vmapped_shared = torch.func.vmap(one, in_dims=(0, None))  # every rank the same samples
        # A plain stack of layers (logreg, mlp, cnn) runs as batched kernels instead (LayerProgram):
        # no vmap or functional_call per step, 2-6x less time per step here.
        program = LayerProgram.of(model, self._names)
        self.program = program
        if program is None:
            self._own, self._shared = vmapped_own, vmapped_shared
        else:
            self._own = program
            self._shared = lambda params, x: program(params, x.unsqueeze(0).expand(len(params[0]), *x.shape))

    @property
    def rank_numel(self) -> int:
        """Parameters of one rank's model."""
        return self.flat.shape[0]

    def per_layer(self, flat: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``flat`` (the parameter's values by default, or a gradient shaped like it) as one view per
        layer parameter, ranks last: ``(*shape, size)``, rank r's value ``[..., r]``."""
        flat = self.flat.detach() if flat is None else flat
        return tuple(flat[a:b].view(*shape, self.size) for shape, (a, b) in zip(self._shapes, self._spans))

    def rank_first(self) -> tuple[torch.Tensor, ...]:
        """Each layer parameter as a ``(size, *shape)`` view of ``flat``'s ranks-first memory (differentiable:
        gradients come back in ``flat``'s layout, RankViews)."""
        return RankViews.apply(self.flat, self._shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._own(self.rank_first(), x)

    def forward_shared(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's model on the same samples ``x``: ``(size, len(x), classes)``."""
        return self._shared(self.rank_first(), x)

    def train(self, mode: bool = True) -> "StackedModel":
        super().train(mode)
        self._base.train(mode)
        return self

    @staticmethod
    def losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each rank's mean cross-entropy over its batch (labels -1: padding, see StackedSampler): ``(size,)``;
        scores in float32, as bfexp.metrics.cross_entropy takes every other engine's."""
        ce = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1), ignore_index=-1,
                             reduction="none")
        counts = (y >= 0).sum(1)
        return ce.view(y.shape).sum(1) / counts

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rank's (mean loss, accuracy) on the held-out set, ``(size,)`` each: what every rank of
        another engine computes of its own model (bfexp.metrics.evaluate); above ``EVAL_RANKS`` ranks, the
        means over that many evenly spaced ranks (``evaluated_ranks``), as 0-dim tensors. Blocks of ``batch`` samples
        times as many ranks as ``EVAL_BLOCK`` input values allow keep a block's activations small (in
        cache): 4096 ranks of mlp on 2000 samples take ~3 s here, against 22 s in blocks of every rank."""
        was_training = self.training
        self.eval()
        chosen = self.evaluated_ranks()
        every = len(chosen) == self.size
        params = tuple(p if every else p[chosen] for p in self.rank_first())
        size = len(chosen)
        chunk = max(1, min(batch, len(y)))
        ranks = max(1, EVAL_BLOCK // (chunk * max(1, x[0].numel())))
        loss = torch.zeros(size, dtype=torch.float64)
        correct = torch.zeros(size, dtype=torch.float64)
        dtype = params[0].dtype
        for r in range(0, size, ranks):
            some = tuple(p[r : r + ranks] for p in params)
            k = len(some[0])
            for i in range(0, len(y), chunk):
                out = self._shared(some, x[i : i + chunk].to(dtype)).float()  # (k, chunk, classes)
                target = y[i : i + chunk]
                ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.repeat(k), reduction="none")
                loss[r : r + k] += ce.view(k, -1).sum(1).double()
                correct[r : r + k] += (out.argmax(2) == target).sum(1).double()
        self.train(was_training)
        n = max(1, len(y))
        if size < self.size:  # a sample of the ranks: its mean stands for every rank's (the same on all)
            return (loss / n).mean(), (correct / n).mean()
        return loss / n, correct / n

    def evaluated_ranks(self) -> torch.Tensor:
        """The ranks an evaluation forwards: all, or ``EVAL_RANKS`` evenly spaced ones above that many."""
        if self.size <= EVAL_RANKS:
            return torch.arange(self.size)
        return torch.linspace(0, self.size - 1, EVAL_RANKS, dtype=torch.float64).round().long()


class RankViews(torch.autograd.Function):
    """A stacked ``flat`` ``(numel, n)`` as one ``(n, *shape)`` view per layer parameter, and their gradients
    back as one ``(numel, n)`` tensor in ``flat``'s layout. Over ranks-first memory (``flat.t()``
    contiguous, as StackedModel and flatten_parameters_ keep it) the views are free and the gradient is
    written a layer's rows at a time; autograd then takes it as ``flat.grad`` without a copy, since its
    strides are the parameter's. (Through ranks-last memory each step moved every parameter and gradient
    through a transpose: 31% of a 4096-rank mlp step here.)"""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        ctx.shapes = shapes
        memory = flat.t()  # (n, numel): rank r's model in row r
        if memory.stride(1) != 1:  # another layout: one copy ranks-first
            memory = memory.contiguous()
        n = memory.shape[0]
        return tuple(memory[:, a:b].view(n, *shape) for shape, (a, b) in zip(shapes, spans(shapes)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        like = next(g for g in grads if g is not None)
        n, where = like.shape[0], spans(ctx.shapes)
        memory = torch.empty(n, where[-1][1], dtype=like.dtype, device=like.device)
        for g, (a, b) in zip(grads, where):
            if g is None:
                memory[:, a:b].zero_()
            else:
                memory[:, a:b].copy_(g.reshape(n, b - a))
        return memory.t(), None


def spans(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int]]:
    """Where each layer parameter of these shapes lies in one rank's flat model: ``(start, stop)``."""
    out, start = [], 0
    for shape in shapes:
        out.append((start, start + math.prod(shape)))
        start = out[-1][1]
    return out


# Layers without parameters that act on each sample alone: the program runs them on (ranks x batch, ...).
PER_SAMPLE = (torch.nn.Flatten, torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU, torch.nn.Sigmoid, torch.nn.SiLU,
              torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Softplus, torch.nn.Identity, torch.nn.MaxPool2d,
              torch.nn.AvgPool2d)


class LayerProgram:
    """A ``torch.nn.Sequential`` of Linear and Conv2d layers and per-sample layers without parameters
    (``PER_SAMPLE``, bfexp.models' image view) run for every rank at once with batched kernels: a Linear
    is one ``baddbmm`` over ranks, a Conv2d one convolution with a group per rank (the ranks' channels
    side by side), the rest on ``(ranks x batch, ...)``. The same arithmetic as each rank's own forward
    (what ``torch.func.vmap`` of the model would run), without vmap's and functional_call's per-call
    cost or its copies; ``of`` gives None for any other model, which then runs vmapped. A program with
    convolutions runs a few ranks at a time (``CONV_BLOCK``), its images channels-last."""

    def __init__(self, steps: list[tuple[str, torch.nn.Module, tuple[int, ...]]]) -> None:
        self.steps = steps
        self.convolutional = any(kind == "conv" for kind, _, _ in steps)

    @classmethod
    def of(cls, model: torch.nn.Module, names: list[str]) -> "LayerProgram | None":
        from bfexp.models import AsImage

        if not isinstance(model, torch.nn.Sequential) or type(model).forward is not torch.nn.Sequential.forward:
            return None
        where = {name: i for i, name in enumerate(names)}
        steps: list[tuple[str, torch.nn.Module, tuple[int, ...]]] = []
        for key, module in model.named_children():
            own = [f"{key}.{n}" for n, _ in module.named_parameters()]
            if type(module) is torch.nn.Linear:
                steps.append(("linear", module, tuple(where[f"{key}.{n}"] for n in ("weight", "bias") if
                                                          f"{key}.{n}" in where)))
            elif type(module) is torch.nn.Conv2d and module.padding_mode == "zeros" and isinstance(module.padding, tuple):
                steps.append(("conv", module, tuple(where[f"{key}.{n}"] for n in ("weight", "bias") if
                                                        f"{key}.{n}" in where)))
            elif type(module) in PER_SAMPLE or type(module) is AsImage:
                steps.append(("sample", module, ()))
            else:
                return None
            if len(own) != len(steps[-1][2]):
                return None
        return cls(steps)

    def __call__(self, params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        """Every rank's forward: ``params`` rank-first (``(ranks, *shape)``), ``x`` ``(ranks, batch, ...)``."""
        step = max(1, CONV_BLOCK // max(1, x[0].numel())) if self.convolutional else x.shape[0]
        if step >= x.shape[0]:
            return self._run(params, x)
        parts = [torch.split(p, step) for p in params]
        xs = torch.split(x, step)
        return torch.cat([self._run(tuple(p[i] for p in parts), xs[i]) for i in range(len(xs))])

    def _run(self, params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        ranks, batch = x.shape[0], x.shape[1]
        h, grouped = x, False  # grouped: (batch, ranks x channels, H, W), the layout of a grouped convolution
        for kind, module, at in self.steps:
            if kind == "conv":
                if not grouped:  # (ranks, batch, C, H, W) -> (batch, ranks x C, H, W), channels last in memory
                    h = h.transpose(0, 1).reshape(batch, ranks * h.shape[2], *h.shape[3:])
                    # as every other engine's images are (bfexp.data.channels_last): the convolution, its
                    # activations and pooling then run channels-last too (pooling ~9x faster than on NCHW)
                    h = torch.empty(h.shape, dtype=h.dtype, device=h.device,
                                    memory_format=torch.channels_last).copy_(h)
                    grouped = True
                weight = params[at[0]]
                bias = params[at[1]].reshape(-1) if len(at) > 1 else None
                h = F.conv2d(h, weight.reshape(-1, *weight.shape[2:]), bias, module.stride, module.padding,
                             module.dilation, module.groups * ranks)
                continue
            if grouped and (kind == "linear" or not isinstance(module, (torch.nn.MaxPool2d, torch.nn.AvgPool2d,
                                                                         *ELEMENTWISE_LAYERS))):
                h = h.reshape(batch, ranks, -1, *h.shape[2:]).transpose(0, 1)  # back to (ranks, batch, C, H, W)
                grouped = False
            if kind == "linear":
                # (ranks, out, in) @ (ranks, in, rows): the output features-first, whose transpose the next
                # layer reads as it is; then the weight's gradient comes back contiguous, as RankViews copies
                # it (the other way round it came transposed: a strided copy more per step).
                weight = params[at[0]]
                rows = h.reshape(ranks, -1, h.shape[-1]).transpose(1, 2)
                if len(at) > 1:
                    out = torch.baddbmm(params[at[1]].unsqueeze(2), weight, rows).transpose(1, 2)
                else:
                    out = torch.bmm(weight, rows).transpose(1, 2)
                h = out.reshape(*h.shape[:-1], out.shape[-1])
            elif grouped or isinstance(module, ELEMENTWISE_LAYERS):
                h = module(h)
            else:
                out = module(h.reshape(ranks * batch, *h.shape[2:]))
                h = out.reshape(ranks, batch, *out.shape[1:])
        if grouped:
            h = h.reshape(batch, ranks, -1, *h.shape[2:]).transpose(0, 1)
        return h


# Elementwise layers: any layout of the ranks' values is theirs alone.
ELEMENTWISE_LAYERS = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU, torch.nn.Sigmoid, torch.nn.SiLU,
                      torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Softplus, torch.nn.Identity)


def check_stackable_model(model: torch.nn.Module) -> None:
    """ConfigError (one line) for a model whose ranks cannot be slices of one batched program."""
    for name, module in model.named_modules():
        if isinstance(module, BATCH_COUPLED):
            raise ConfigError(f"engine=stacked cannot run model {type(model).__name__}: layer {name or 'model'} "
                              f"({type(module).__name__}) couples the samples of a batch in train mode; allowed: "
                              "engine=threads or engine=mpi, or a model without batch norm (mlp, cnn, logreg)")
    if not list(model.parameters()):
        raise ConfigError(f"engine=stacked cannot run model {type(model).__name__}: it has no parameters")
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1:
        raise ConfigError(f"engine=stacked cannot run model {type(model).__name__}: parameters of "
                          f"{len(dtypes)} dtypes; allowed: one dtype")


def check_stackable_forward(model: torch.nn.Module, in_shape: tuple[int, ...]) -> None:
    """Run two ranks' forward on two zero samples: a model with data-dependent control flow (or random
    layers in train mode) fails under vmap; ConfigError (one line) naming the reason."""
    stacked = StackedModel(model, 2)
    dtype = next(model.parameters()).dtype
    try:
        stacked(torch.zeros(2, 2, *in_shape, dtype=dtype))
    except Exception as exc:  # noqa: BLE001 - whatever vmap refuses, the model cannot be stacked
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"engine=stacked cannot run model {type(model).__name__}: its forward does not batch "
                          f"over ranks (torch.func.vmap: {first[:160]}); allowed: engine=threads or engine=mpi") from None


def check_optimizer(optimizer_class: type) -> None:
    """ConfigError unless one optimizer over the stack is n independent ones (an elementwise step)."""
    if optimizer_class.__module__.startswith("torch.optim") and optimizer_class.__name__ in ELEMENTWISE_OPTIMIZERS:
        return
    raise ConfigError(f"engine=stacked cannot run optimizer {optimizer_class.__name__}: only an elementwise step "
                      "over the stacked parameters equals each rank's own; allowed: torch.optim."
                      f"{'|'.join(ELEMENTWISE_OPTIMIZERS)}, or engine=threads")


# ---------------------------------------------------------------- data


@dataclass
class StackedData:
    """Every rank's shard (bfexp.data.RankData, rank order) and the held-out set they share."""

    shards: list[Any]

    @property
    def test_x(self) -> torch.Tensor:
        return self.shards[0].test_x

    @property
    def test_y(self) -> torch.Tensor:
        return self.shards[0].test_y

    @property
    def classes(self) -> int:
        return self.shards[0].classes

    @property
    def global_train_size(self) -> int:
        return self.shards[0].global_train_size

    @property
    def tokens(self) -> bool:
        return bool(getattr(self.shards[0], "tokens", False))

    @property
    def train_x(self) -> torch.Tensor:
        """Rank 0's samples: one sample's shape (``train_x.shape[1:]``) for sizing the model."""
        return self.shards[0].train_x


class StackedSampler:
    """Every rank's mini-batch as one ``(size, batch, ...)`` tensor: rank r's comes from its own
    bfexp.data.BatchSampler (its own generator), so the batches are those of every other engine.
    Ranks whose shard holds fewer samples than the batch are padded, with label -1 (``StackedModel.losses``
    leaves it out)."""

    def __init__(self, data: StackedData, batch_size: int, seed: int) -> None:
        from bfexp.data import BatchSampler, LockstepBatches

        self.samplers = [BatchSampler(shard, batch_size, seed, r) for r, shard in enumerate(data.shards)]
        self.batch_size = self.samplers[0].batch_size  # rank 0's, as other engines report it
        self.width = max(s.batch_size for s in self.samplers)
        sizes = [len(shard.train_y) for shard in data.shards]
        if all(shard.train_x is data.shards[0].train_x for shard in data.shards):  # one set for all (shared)
            self._offsets = torch.zeros(len(sizes), dtype=torch.int64)
            self._x, self._y = data.shards[0].train_x, data.shards[0].train_y
        else:
            self._offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), dtype=torch.int64)
            self._x = torch.cat([shard.train_x for shard in data.shards])
            self._y = torch.cat([shard.train_y for shard in data.shards])
        self._even = all(s.batch_size == self.width for s in self.samplers)
        # Equally long shards (the synthetic data, an even split): every rank's batch in a few tensor ops.
        self._lockstep = LockstepBatches(self.samplers) if len(set(sizes)) == 1 else None

    @property
    def epoch(self) -> int:
        return self.samplers[0].epoch

    def epoch_progress(self) -> float:
        return self.samplers[0].epoch_progress()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._lockstep is not None:
            return self._take(self._lockstep.next_indices() + self._offsets.unsqueeze(1))
        parts = [s.next_indices() for s in self.samplers]
        if self._even:
            return self._take(torch.stack(parts) + self._offsets.unsqueeze(1))
        idx = torch.zeros(len(parts), self.width, dtype=torch.int64)
        valid = torch.zeros(len(parts), self.width, dtype=torch.bool)
        for r, part in enumerate(parts):
            idx[r, : len(part)] = part + self._offsets[r]
            valid[r, : len(part)] = True
        x, y = self._take(idx)
        return x, torch.where(valid, y, torch.full_like(y, -1))

    def _take(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``idx`` (ranks, batch) of the joined shards: index_select on the flat positions
        (a third of advanced indexing's time here, the same values)."""
        flat = idx.reshape(-1)
        x = self._x.index_select(0, flat).view(*idx.shape, *self._x.shape[1:])
        return x, self._y.index_select(0, flat).view(idx.shape)

    def state_dict(self) -> dict:
        if self._lockstep is not None:
            self._lockstep.sync()
        return {"ranks": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        for s, one in zip(self.samplers, state["ranks"]):
            s.load_state_dict(one)
        if self._lockstep is not None:
            self._lockstep.reload()


# ---------------------------------------------------------------- what a job may ask of it


def job_refusal(settings: Settings, dataset: Any, heterogeneity: Any) -> str | None:
    """Why engine=stacked cannot run this job (the run's settings, its dataset and heterogeneity nodes; one
    line, naming what to use instead), or None.

    What it cannot stack: a rule not stated ``stackable`` (checked by the algorithm's own check_run), an
    optimizer that is not elementwise, a model with batch-coupled layers or a forward that does not
    batch over ranks, and the options that need each rank's own code path: stragglers (heterogeneity),
    throughput-only jobs, time budgets, checkpoints, fault injection; language models (a data set of tokens)."""
    from bfexp import components

    if dataset is not None and getattr(components.target_of(dataset, "dataset"), "tokens", False):
        return ("engine=stacked batches classifiers over ranks, not language models (a score per position); "
                "allowed: engine=threads or engine=mpi for a data set of tokens")
    if settings.throughput_only:
        return "engine=stacked times training steps of every rank at once; allowed: throughput_only=false, or engine=threads"
    if heterogeneity is not None and components.build(heterogeneity, "heterogeneity").active:
        return ("engine=stacked steps every rank in lock step, so it has no stragglers; allowed: heterogeneity=none, "
                "or engine=threads")
    if settings.budget_s is not None:
        return "engine=stacked trains for a step count, not a time budget; allowed: budget_s=null, or engine=threads"
    if settings.checkpoint_every:
        return "engine=stacked keeps no checkpoints yet; allowed: checkpoint_every=null, or engine=threads"
    if settings.fail_rank is not None:
        return "engine=stacked has no rank of its own to fail; allowed: fail_rank=null, or engine=threads"
    return None


def threads_as_fast(model: Any, in_shape: tuple[int, ...], classes: int) -> str | None:
    """Why engine=auto leaves a job that stacks to threads, or None: a model (its node) with convolutions, whose
    compute dominates a rank's step either way (the cnn at 128 ranks on MNIST: 1.1-1.5 s of CPU a training
    step stacked, a few ranks at a time, against 0.9 s for its ranks' own steps one after another here)."""
    from bfexp.models import on_meta

    convolutions = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.LazyConv1d, torch.nn.LazyConv2d,
                    torch.nn.LazyConv3d)
    if any(isinstance(m, convolutions) for m in on_meta(model, in_shape, classes).modules()):
        return "a convolutional model runs as fast on threads (its convolutions dominate either way)"
    return None


def check_job(settings: Settings, in_shape: tuple[int, ...], classes: int, *, model: Any, optimizer: Any,
              dataset: Any, heterogeneity: Any) -> None:
    """The driver's check of an engine=stacked job before any rank starts (the algorithm's own check_run
    has refused a rule that is not stackable): ConfigError, one line, for what cannot be stacked. The run's
    settings, the samples' shape and classes, then the components' nodes."""
    from bfexp import components
    from bfexp.models import CPU_CHECK_PARAMETERS, build_model, on_meta

    why = job_refusal(settings, dataset, heterogeneity)
    if why:
        raise ConfigError(why)
    check_optimizer(components.target_of(optimizer, "optimizer"))
    sized = on_meta(model, in_shape, classes)  # its layers and size, nothing allocated
    check_stackable_model(sized)
    if sum(p.numel() for p in sized.parameters() if not isinstance(p, torch.nn.parameter.UninitializedParameter)) \
            <= CPU_CHECK_PARAMETERS:
        check_stackable_forward(build_model(model, in_shape, classes, 0), in_shape)
