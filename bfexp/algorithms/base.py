"""What every decentralized optimizer shares.

A DecentralizedOptimizer wraps a local torch optimizer: a plain training
loop (zero_grad, forward, backward, step) becomes decentralized by wrapping
its optimizer. The model's parameters are re-pointed into ONE flat buffer,
so a neighbor exchange of the whole model is a single zero-copy message.

One iteration has three moments where an update rule can act:

* ``begin_iteration``: before the forward pass. Runs from ``zero_grad()``,
  or from a forward pre-hook when the wrapper was given the model. Rules
  that combine first (DSGD cta) mix here; rules whose exchange does not
  need this step's gradient (DSGD awc, DIGing) start it here, so it runs
  while the gradient is computed.
* ``bucket_ready``: during backward, as soon as the gradients of one bucket
  (a contiguous slice of the flat buffer) are complete. Rules that adapt
  before they combine (DSGD atc, exact diffusion, push-sum) update the
  bucket and start its exchange here, while backward continues.
* ``update``: in ``step()``, the rest of the rule.

Communication rounds: with ``communication_period`` H (local SGD), ranks
communicate on iterations k with (k + 1) % H == 0, and round r = k // H
uses the topology's W(r), so a dynamic graph cycles through all its W(t)
whatever H is. On the other iterations W = I (a purely local step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch

from bfexp.algorithms.buckets import Bucket, GradBuckets
from bfexp.comm.engine import Engine, Handle
from bfexp.topology import RankWeights, Topology

# Defaults of the options every algorithm takes (conf/algorithm/*.yaml may override).
COMMON_OPTIONS: dict[str, Any] = {"communication_period": 1, "overlap": True, "bucket_mb": 25.0}


@dataclass(frozen=True)
class Requirements:
    """What an update rule's theory needs from the mixing matrices."""

    doubly_stochastic: bool = False
    symmetric: bool = False
    column_stochastic: bool = False
    row_stochastic: bool = False
    static: bool = False


class TopologyMismatch(ValueError):
    """A topology the algorithm's theory does not cover; the message says why."""


def flatten_parameters_(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Move the parameters' storage into one flat buffer; each becomes a view of it."""
    if not params:
        raise ValueError("the optimizer has no parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    return flat


def flat_grad(params: list[torch.nn.Parameter], out: torch.Tensor | None = None) -> torch.Tensor:
    """All gradients as one flat buffer (zeros where a parameter got none)."""
    if out is None:
        out = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            out[offset : offset + n].zero_()
        else:
            out[offset : offset + n].copy_(p.grad.reshape(-1))
        offset += n
    return out


def set_flat_grad_(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat buffer into the parameters' .grad (allocating where a grad is None)."""
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)
        offset += n


def merge_options(cfg: Mapping[str, Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """COMMON_OPTIONS, then the config node, then keyword arguments."""
    merged = dict(COMMON_OPTIONS)
    if cfg is not None:
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(cfg, DictConfig):
                cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        except ImportError:  # pragma: no cover
            pass
        merged.update(dict(cfg))  # type: ignore[arg-type]
    merged.update(options)
    return merged


class DecentralizedOptimizer:
    """step() = the local update plus the communication the rule needs.

    ``optimizer`` is the local torch optimizer (SGD, momentum SGD, Adam...):
    whatever it would do with a gradient is the "adapt" part of each rule.
    ``cfg`` is the ``algorithm`` config node (or a dict); keyword arguments
    override it, so ``DSGD(opt, engine, topology, style="awc")`` works
    without a config. Give ``model`` so the start-of-iteration work runs
    from a forward pre-hook; without it, call ``zero_grad()`` before each
    forward pass (the usual loop does).
    """

    name: ClassVar[str] = "abstract"
    requires: ClassVar[Requirements] = Requirements()
    # False for the allreduce baselines: they never read the topology.
    uses_topology: ClassVar[bool] = True
    # True when the rule adapts per bucket during backward (see module doc).
    bucketed: ClassVar[bool] = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        cfg: Mapping[str, Any] | None = None,
        *,
        model: torch.nn.Module | None = None,
        **options: Any,
    ) -> None:
        self.optimizer = optimizer
        self.engine = engine
        self.topology = topology
        self.cfg = merge_options(cfg, options)
        self.communication_period = int(self.cfg["communication_period"])
        if self.communication_period < 1:
            raise ValueError(f"algorithm.communication_period={self.communication_period}; allowed: an integer >= 1")
        self.overlap = bool(self.cfg["overlap"])
        self.params: list[torch.nn.Parameter] = _unique([p for g in optimizer.param_groups for p in g["params"]])
        self.flat = flatten_parameters_(self.params)
        self.iteration = 0
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # local_update's buffers
        self.module: torch.nn.Module | None = model  # what the training loop calls forward on
        self._begun_iteration = -1
        if self.uses_topology:
            if topology is None:
                raise ValueError(f"algorithm={self.name} needs a topology")
            self.check_topology(topology)
        self.buckets: GradBuckets | None = None
        if self.bucketed:
            bucket_bytes = int(float(self.cfg["bucket_mb"]) * 2**20) if self.overlap else None
            self.buckets = GradBuckets(self.params, bucket_bytes, self.bucket_ready)
        self._pre_hook = model.register_forward_pre_hook(_BeginHook(self)) if model is not None else None

    # torch.optim.Optimizer look-alike ---------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._begin()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._begun_iteration != self.iteration:
            self.late_begin()
        self.update(self.communicates_now())
        self.iteration += 1
        return loss

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "iteration": self.iteration, "buffers": self.buffers()}

    def load_state_dict(self, state: dict) -> None:
        self.finish()
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = state["iteration"]
        for key, value in state.get("buffers", {}).items():
            getattr(self, key).copy_(value)

    # what a rule provides ------------------------------------------------
    def begin_iteration(self) -> None:
        """Start-of-iteration work (before forward). Default: watch backward for buckets."""
        if self.buckets is not None and self.overlap and self.communicates_now():
            self.buckets.arm()

    def late_begin(self) -> None:
        """step() came without zero_grad() or a hooked forward: do the start-of-iteration work now."""
        self._begin()

    def bucket_ready(self, bucket: Bucket) -> Handle | None:
        """A bucket's gradients are complete: adapt it and start its exchange (bucketed rules)."""
        raise NotImplementedError

    def update(self, communicate: bool) -> None:
        """The rest of the update rule, in step()."""
        raise NotImplementedError

    def buffers(self) -> dict[str, torch.Tensor]:
        """Per-rank state beyond the parameters and the local optimizer (for state_dict)."""
        return {}

    # shared pieces -------------------------------------------------------
    def communicates_now(self, iteration: int | None = None) -> bool:
        """Local SGD: exchange only on every `communication_period`-th iteration."""
        k = self.iteration if iteration is None else iteration
        return (k + 1) % self.communication_period == 0

    def mixing_weights(self, iteration: int | None = None) -> RankWeights:
        """This rank's row and column of W(r) for the communication round r of an iteration."""
        assert self.topology is not None
        k = self.iteration if iteration is None else iteration
        return self.topology.weights(self.engine.rank, k // self.communication_period)

    def start_mix(self, tensor: torch.Tensor, w: RankWeights, scale: float = 1.0) -> Handle:
        """Start (W X)_i in place for a row-stochastic W; ``scale`` mixes with (1-s) I + s W instead.

        The result is written into ``tensor`` at wait(); leave it alone until then.
        """
        self_weight = 1.0 - scale + scale * w.self_weight
        src = {j: scale * v for j, v in w.src_weights.items()}
        return self.engine.ineighbor_allreduce_(tensor, self_weight, src, list(w.dst_weights))

    def start_push(self, tensor: torch.Tensor, w: RankWeights) -> Handle:
        """Start (A X)_i in place for a column-stochastic A: every sender scales what it sends by A[k, i]."""
        src = {j: 1.0 for j in w.src_weights}
        return self.engine.ineighbor_allreduce_(tensor, w.self_weight, src, dict(w.dst_weights))

    def wait(self, handle: Handle) -> Any:
        """Wait for a handle (engine handles count their own blocked time as communication)."""
        return handle.wait()

    def local_step(self, params: list[torch.nn.Parameter] | None = None) -> None:
        """The local optimizer's step on ``params`` only (all when None).

        Torch optimizers keep state per parameter, so stepping a bucket's
        parameters alone is the same as the full step restricted to them.
        """
        if params is None or len(params) == len(self.params):
            self.optimizer.step()
            return
        keep = {id(p) for p in params}
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in keep]
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps

    def local_update(self, grad: torch.Tensor | None = None) -> torch.Tensor:
        """What the local optimizer would add to the parameters (e.g. -lr * grad for SGD).

        Takes the step and undoes it, so a rule can apply the update to
        another point (a push-sum numerator). ``grad`` replaces the gradients
        first (gradient tracking steps along its tracker). The returned
        buffer is reused by the next call.
        """
        if grad is not None:
            set_flat_grad_(self.params, grad)
        if self._scratch is None:
            self._scratch = (torch.empty_like(self.flat), torch.empty_like(self.flat))
        before, update = self._scratch
        before.copy_(self.flat)
        self.local_step()
        torch.sub(self.flat, before, out=update)
        self.flat.copy_(before)
        return update

    def evaluation_parameters(self) -> torch.Tensor:
        """The flat parameters that represent this rank's model (what the model holds)."""
        return self.flat

    def finish(self) -> None:
        """Complete any communication still in flight (results are kept for the next step)."""

    def close(self) -> None:
        """Finish and release hooks and resources."""
        self.finish()
        if self.buckets is not None:
            self.buckets.remove()
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None

    # topology requirements -------------------------------------------------
    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        req = cls.requires
        checks = [
            (req.static, not topology.is_dynamic, "a static topology"),
            (req.symmetric, topology.is_symmetric(), "a symmetric mixing matrix"),
            (req.doubly_stochastic, topology.is_doubly_stochastic(), "a doubly stochastic mixing matrix"),
            (req.row_stochastic, topology.is_row_stochastic(), "a row stochastic mixing matrix"),
            (req.column_stochastic, topology.is_column_stochastic(), "a column stochastic mixing matrix"),
        ]
        for needed, ok, what in checks:
            if needed and not ok:
                raise TopologyMismatch(
                    f"algorithm={cls.name} needs {what}; topology={topology.label} "
                    f"with weights={topology.weight_scheme} does not give one{cls.topology_hint(what)}"
                )

    @classmethod
    def topology_hint(cls, missing: str) -> str:
        if "column" in missing:
            return "; allowed: topology.weights=column (or a regular graph)"
        if "symmetric" in missing:
            return "; allowed: an undirected graph (e.g. symmetric_exp2, or topology.undirected())"
        if "doubly" in missing:
            return "; allowed: a regular graph, or an undirected one with topology.weights=metropolis"
        if "row" in missing:
            return "; allowed: topology.weights=uniform or metropolis"
        return ""

    @classmethod
    def check_engine(cls, engine: str) -> None:
        """Raise ValueError (one line) when the rule cannot run on this engine."""

    @classmethod
    def check_job(cls, cfg: Any, engine: str) -> None:
        """Raise ValueError (one line) when the job's config cannot run this rule (before any rank starts)."""
        cls.check_engine(engine)

    @classmethod
    def resolve_topology(cls, topology: Topology) -> tuple[Topology, str | None]:
        """The topology this algorithm runs on, and a note when it is not the one asked for.

        Raises TopologyMismatch (one line) when the rule cannot run on it.
        """
        if cls.uses_topology:
            cls.check_topology(topology)
        return topology, None

    # internals -------------------------------------------------------------
    def _begin(self) -> None:
        if self._begun_iteration != self.iteration:
            self._begun_iteration = self.iteration
            self.begin_iteration()

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Evaluation passes (no_grad or eval mode) are not training iterations.
        if torch.is_grad_enabled() and module.training:
            self._begin()


class _BeginHook:
    """Forward pre-hook that begins the owner's iteration.

    Holds the optimizer weakly, and a deep copy of the model (e.g. a probe
    built from it) gets a disabled hook instead of a copy of the optimizer.
    """

    def __init__(self, owner: DecentralizedOptimizer | None) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner._pre_forward(module, args)

    def __deepcopy__(self, memo: dict) -> "_BeginHook":
        return _BeginHook(None)


def _unique(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
