"""BlueFog's distributed optimizer wrappers, on bfexp's update rules.

As in BlueFog, ``DistributedXOptimizer(optimizer, model, ...)`` returns an
instance of a subclass of the given optimizer's class (``isinstance(opt,
torch.optim.SGD)`` holds, LR schedulers and ``state_dict`` work) whose
``step()`` also communicates. The returned optimizer shares the given one's
parameter groups and state. Its per-step knobs are attributes, read when the
iteration's communication starts (set them before ``zero_grad()``/forward):

* ``self_weight``, ``src_weights``, ``dst_weights`` (neighbor allreduce;
  left None: the topology's weights), ``src_machine_weights``,
  ``dst_machine_weights`` (hierarchical), ``enable_topo_check``,
  ``communication_type`` (a CommunicationType), ``num_steps_per_communication``;
* win-put: ``dst_weights``, ``force_barrier``.

Assigning any other public attribute raises AttributeError (a misspelt knob
would otherwise be ignored silently).

The rules are bfexp's (bfexp/algorithms): adapt-with-combine is DSGD's
``awc`` (X+ = W X - a F(X)), adapt-then-combine DSGD's ``atc`` (X+ = W (X -
a F(X))), gradient allreduce the Allreduce baseline; W is this step's
neighbor allreduce, hierarchical neighbor allreduce, global average or the
identity, per ``communication_type``. Differences from BlueFog: the
optimizer's own ``step`` is the local update for every optimizer class (no
per-parameter step functions needed); ``num_steps_per_communication`` J > 1
counts ``step()`` calls (J - 1 local steps, then one that communicates);
adapt-with-combine takes the local update (weight decay included) at x and
adds it to W x (BlueFog steps from W x); several forward passes per step
with J > 1 (BlueFog's gradient accumulation scenario) raise
NotImplementedError, as do ``synchronize()`` and ``skip_synchronize()``.

Every wrapper's rule is built by bfexp's one assembly (bfexp.assembly), as
the runner and ``bfexp.DistributedOptimizer`` build theirs. bfexp's extension
``DistributedOptimizer(optimizer, model, algorithm=..., topology=...)`` wraps
any bfexp algorithm the same way, on the topology set with ``set_topology``
or one given.
"""

from __future__ import annotations

import warnings
from enum import Enum
from typing import Any, Callable, ClassVar

import torch

from bfexp.algorithms import DSGD, Allreduce
from bfexp.assembly import Assembly, assemble
from bfexp.bluefog import ops
from bfexp.comm.engine import Handle
from bfexp.errors import number_in
from bfexp.topology import RankWeights

__all__ = [
    "CommunicationType",
    "DistributedOptimizer",
    "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer",
    "DistributedAllreduceOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "DistributedWinPutOptimizer",
]


class CommunicationType(Enum):
    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


def _models(model: Any) -> list[torch.nn.Module]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not all(isinstance(m, torch.nn.Module) for m in models):
        raise ValueError("model must be a torch.nn.Module or a list of them")
    return models


def _named_parameters(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module]) -> dict[int, str]:
    """{id(parameter): its name in the model}; every parameter the optimizer updates must have one."""
    names: dict[int, str] = {}
    for m in models:
        for n, p in m.named_parameters():
            names.setdefault(id(p), n)
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if missing:
        raise ValueError(f"{len(missing)} parameter(s) of the optimizer are not parameters of the model")
    return names


class _LocalOptimizer:
    """The wrapped class's own update, as the local optimizer a bfexp rule steps."""

    def __init__(self, owner: "_Wrapper", base: type) -> None:
        self._owner, self._base = owner, base

    @property
    def param_groups(self) -> list[dict]:
        return self._owner.param_groups

    @property
    def state(self) -> Any:
        return self._owner.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        func = self._owner._step_func
        if func is None:
            return self._base.step(self._owner, closure)
        for group in self._owner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    func(p, p.grad, group)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._base.zero_grad(self._owner, set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self._base.state_dict(self._owner)

    def load_state_dict(self, state: dict) -> None:
        self._base.load_state_dict(self._owner, state)


class _Wrapper:
    """What every wrapper adds in front of the user's optimizer class."""

    _knobs: ClassVar[frozenset[str]] = frozenset()

    def _setup(self, optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int) -> None:
        self._base = type(optimizer)
        self._engine = ops.initialized_engine()
        self._models = _models(model)
        self._names = _named_parameters(optimizer, self._models)
        self._step_func: Callable | None = None
        self._forwards = 0
        self._J = 1
        self._hooks = [m.register_forward_pre_hook(self._count_forward) for m in self._models]
        self._set_steps(num_steps_per_communication)

    def __setattr__(self, name: str, value: Any) -> None:
        known = name.startswith("_") or name in self._knobs or hasattr(type(self), name) or name in self.__dict__
        if not known:
            raise AttributeError(
                f"{type(self).__name__} (BlueFog wrapper) has no attribute {name!r} to set; "
                f"allowed: {', '.join(sorted(self._knobs))}")
        object.__setattr__(self, name, value)

    @property
    def num_steps_per_communication(self) -> int:
        return self._J

    @num_steps_per_communication.setter
    def num_steps_per_communication(self, value: int) -> None:
        self._set_steps(value)

    def _set_steps(self, value: int) -> None:
        number_in("num_steps_per_communication", value, low=1, integer=True, error=ValueError)
        self._J = value

    def _count_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and module.training:
            self._forwards += 1

    def _check_forwards(self) -> None:
        forwards, self._forwards = self._forwards, 0
        if self._J > 1 and forwards > len(self._models):
            raise NotImplementedError(
                "num_steps_per_communication > 1 with several forward passes per step() (BlueFog's gradient "
                "accumulation scenario): bfexp counts step() calls; accumulate with num_steps_per_communication=1")

    def register_step_function(self, step_func: Callable) -> None:
        """Use ``step_func(self, parameter, gradient, parameter_group)`` as the local update, per parameter."""
        self._step_func = lambda p, g, group: step_func(self, p, g, group)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("add_param_group after wrapping with a BlueFog optimizer: add it before")

    def synchronize(self) -> None:
        raise NotImplementedError("optimizer.synchronize(): bfexp's step() always communicates and updates at once")

    def skip_synchronize(self) -> Any:
        raise NotImplementedError("optimizer.skip_synchronize(): bfexp's step() always communicates and updates")

    def turn_on_timeline(self) -> None:
        raise NotImplementedError("optimizer.turn_on_timeline(): set BFEXP_TIMELINE=DIR; every op is traced")

    def turn_off_timeline(self) -> None:
        raise NotImplementedError("optimizer.turn_off_timeline(): tracing follows BFEXP_TIMELINE")


class _Rule(_Wrapper):
    """A wrapper whose step() and zero_grad() are a bfexp rule's (``self._rule``), built by bfexp's
    one assembly (bfexp.assembly) around the wrapped class's own update: the same checks, refusals
    and notes as ``bfexp.DistributedOptimizer`` and the runner."""

    _knobs = frozenset({"num_steps_per_communication"})

    def _build_rule(self, algorithm: Any, topology: Any, options: dict[str, Any],
                    topology_options: dict[str, Any] | None = None) -> Assembly:
        made = assemble(algorithm, _LocalOptimizer(self, self._base), self._engine, topology, options=options,
                        topology_options=topology_options)
        self._rule = made.optimizer
        self._hooks += [m.register_forward_pre_hook(self._rule._pre_forward) for m in self._models]
        return made

    def _set_steps(self, value: int) -> None:
        super()._set_steps(value)
        if "_rule" in self.__dict__:
            self._rule.communication_period = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._rule.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_forwards()
        return self._rule.step(closure)


def _make(mixin: type, optimizer: torch.optim.Optimizer) -> Any:
    """An instance of ``optimizer``'s class with ``mixin`` in front, sharing its groups and state."""
    if isinstance(optimizer, _Wrapper):
        raise ValueError("the optimizer is already a BlueFog wrapper")
    base = type(optimizer)
    cls = type(base.__name__, (mixin, base), {"__module__": __name__})
    obj = cls.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    return obj


# ------------------------------------------------------------------ neighbor / hierarchical / allreduce


class _CombineDSGD(DSGD):
    """DSGD whose W comes from the BlueFog wrapper's knobs at each exchange."""

    uses_topology: ClassVar[bool] = False
    _combine: Callable[[torch.Tensor], Handle]

    def mixing_weights(self, iteration: int | None = None) -> RankWeights:
        return RankWeights(1.0, {}, {})  # unused: start_mix asks the wrapper

    def start_mix(self, tensor: torch.Tensor, w: RankWeights, scale: float = 1.0) -> Handle:
        return self._combine(tensor)


class _Reduce(_Rule):
    _knobs = frozenset({
        "self_weight", "src_weights", "dst_weights", "src_machine_weights", "dst_machine_weights",
        "enable_topo_check", "communication_type", "num_steps_per_communication",
    })
    _style: ClassVar[str] = "awc"

    def _setup_rule(self, communication_type: CommunicationType, num_steps_per_communication: int) -> None:
        self.self_weight = None
        self.src_weights = None
        self.dst_weights = None
        self.src_machine_weights = None
        self.dst_machine_weights = None
        self.enable_topo_check = False
        self.communication_type = communication_type
        self._build_rule(_CombineDSGD, None,
                         {"style": self._style, "communication_period": num_steps_per_communication})
        self._rule._combine = self._combine

    @property
    def communication_type(self) -> CommunicationType:
        return self._communication_type

    @communication_type.setter
    def communication_type(self, value: CommunicationType) -> None:
        if not isinstance(value, CommunicationType):
            raise ValueError(f"communication_type={value!r}; allowed: {', '.join(c.name for c in CommunicationType)}")
        self._communication_type = value

    def _combine(self, tensor: torch.Tensor) -> Handle:
        """Start this step's W X into ``tensor`` (in place), W per communication_type and the knobs."""
        kind = self._communication_type
        if kind is CommunicationType.neighbor_allreduce:
            args = ops.neighbor_args(self.self_weight, self.src_weights, self.dst_weights)
            return self._engine.ineighbor_allreduce_(tensor, *args)
        if kind is CommunicationType.hierarchical_neighbor_allreduce:
            args = ops.machine_args(self.self_weight, self.src_machine_weights, self.dst_machine_weights)
            return self._engine.ihierarchical_neighbor_allreduce_(tensor, *args)
        if kind is CommunicationType.allreduce:
            return self._engine.iallreduce_(tensor, op="avg")
        return Handle(lambda: tensor, lambda: True)  # empty: W = I


class _AdaptWithCombine(_Reduce):
    _style = "awc"


class _AdaptThenCombine(_Reduce):
    _style = "atc"


def _reduce(mixin: type, optimizer: torch.optim.Optimizer, model: Any, communication_type: CommunicationType,
            num_steps_per_communication: int) -> Any:
    obj = _make(mixin, optimizer)
    obj._setup(optimizer, model, num_steps_per_communication)
    obj._setup_rule(communication_type, num_steps_per_communication)
    return obj


def DistributedAdaptWithCombineOptimizer(  # noqa: N802 - BlueFog's name
    optimizer: torch.optim.Optimizer, model: Any,
    communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
    num_steps_per_communication: int = 1,
) -> Any:
    """x+ = W x - lr * grad(x): the exchange of x overlaps forward and backward (bfexp DSGD awc)."""
    return _reduce(_AdaptWithCombine, optimizer, model, communication_type, num_steps_per_communication)


def DistributedAdaptThenCombineOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any,
    communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
    num_steps_per_communication: int = 1,
) -> Any:
    """x+ = W (x - lr * grad(x)): buckets are updated and sent as backward produces them (bfexp DSGD atc)."""
    return _reduce(_AdaptThenCombine, optimizer, model, communication_type, num_steps_per_communication)


def _older_name(name: str, communication_type: CommunicationType, doc: str) -> Callable[..., Any]:
    """BlueFog's older (deprecated) ``name`` for adapt-with-combine over ``communication_type``."""

    def older(optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1) -> Any:
        warnings.warn(
            "deprecated in BlueFog; use DistributedAdaptWithCombineOptimizer(opt, model, "
            f"CommunicationType.{communication_type.name})", PendingDeprecationWarning, stacklevel=2)
        return DistributedAdaptWithCombineOptimizer(optimizer, model, communication_type, num_steps_per_communication)

    older.__name__ = older.__qualname__ = name
    older.__doc__ = doc
    return older


DistributedNeighborAllreduceOptimizer = _older_name(
    "DistributedNeighborAllreduceOptimizer", CommunicationType.neighbor_allreduce,
    "Adapt-with-combine over neighbor_allreduce (BlueFog's older name).")
DistributedHierarchicalNeighborAllreduceOptimizer = _older_name(
    "DistributedHierarchicalNeighborAllreduceOptimizer", CommunicationType.hierarchical_neighbor_allreduce,
    "Adapt-with-combine over hierarchical_neighbor_allreduce (BlueFog's older name).")
DistributedAllreduceOptimizer = _older_name(
    "DistributedAllreduceOptimizer", CommunicationType.allreduce,
    "Adapt-with-combine over an allreduce of the parameters (BlueFog's older name).")


# ------------------------------------------------------------------ gradient allreduce


class _GradientAllreduce(_Rule):
    def _setup_rule(self) -> None:
        # Every step applies the average gradient; J > 1 accumulates, so the allreduce waits for step().
        self._build_rule(Allreduce, None, {"overlap": self._J == 1})

    def _set_steps(self, value: int) -> None:
        _Wrapper._set_steps(self, value)  # J is not a period here: it says whether to overlap
        if "_rule" in self.__dict__:
            self._rule.overlap = value == 1

    def _check_forwards(self) -> None:
        self._forwards = 0  # several backward passes per step is what J is for here


def DistributedGradientAllreduceOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1
) -> Any:
    """Every step applies the gradient averaged over all ranks (Horovod style; bfexp's Allreduce baseline).

    ``num_steps_per_communication`` J: backward passes accumulated per step;
    J = 1 overlaps the allreduce with backward.
    """
    obj = _make(_GradientAllreduce, optimizer)
    obj._setup(optimizer, model, num_steps_per_communication)
    obj._setup_rule()
    return obj


# ------------------------------------------------------------------ any bfexp algorithm (bfexp's extension)


def DistributedOptimizer(  # noqa: N802 - bfexp.DistributedOptimizer's name and arguments
    optimizer: torch.optim.Optimizer, model: Any, algorithm: Any = "exact_diffusion", topology: Any = None, *,
    topology_options: dict[str, Any] | None = None, **options: Any,
) -> Any:
    """Any bfexp algorithm as a BlueFog wrapper (not in BlueFog): an instance of the optimizer's class.

    ``algorithm``, ``topology``, ``topology_options`` and ``options`` as for
    ``bfexp.DistributedOptimizer``, built by the same assembly, so the same
    refusals and the same UserWarning for a substituted graph; ``topology``
    None is the one set with ``set_topology`` (its edge weights if
    ``is_weighted``, else uniform). As BlueFog's wrappers, nothing is
    broadcast (call ``broadcast_parameters`` first); the knob
    ``num_steps_per_communication`` is the rule's ``communication_period``.
    """
    from bfexp import api

    obj = _make(_Rule, optimizer)
    obj._setup(optimizer, model, 1)
    if topology is None:
        topology = _bluefog_topology()
    made = obj._build_rule(*api.named_nodes(algorithm, topology), options, topology_options)
    obj._J = obj._rule.communication_period
    made.warn(stacklevel=2)
    return obj


def _bluefog_topology() -> Any:
    """The graph set with set_topology as a bfexp Topology (edges u -> v: u sends to v, as networkx's)."""
    from bfexp.topology import CustomTopology

    graph = ops.load_topology()
    if graph is None:
        raise ValueError("no topology is set; use bf.set_topology(...) or pass topology=")
    return CustomTopology(graph, weights="given" if ops.is_topo_weighted() else "uniform")


# ------------------------------------------------------------------ win put


class _WinPut(_Wrapper):
    _knobs = frozenset({"dst_weights", "force_barrier", "window_prefix", "num_steps_per_communication"})

    def _setup_rule(self, window_prefix: str | None) -> None:
        self.dst_weights = None
        self.force_barrier = False
        self.window_prefix = f"{window_prefix}." if window_prefix is not None else ""
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._windows = {id(p): self.window_prefix + self._names[id(p)] for p in self._params}
        self._handles: dict[int, int] = {}
        self._since = 0  # forward passes since the last put
        for p in self._params:  # the parameters now live in window memory
            ops.win_create(p, self._windows[id(p)])
        self._hooks += [m.register_forward_hook(self._after_forward) for m in self._models]

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return
        self._since += 1
        if self._since == self._J:
            with self._engine.one_turn():  # virtual ranks: one turn for all the parameters' puts
                for p in self._params:
                    self._handles[id(p)] = ops.win_put_nonblocking(p.data, self._windows[id(p)],
                                                                   dst_weights=self.dst_weights)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the puts, average with the in-neighbor slots (win_update), then the local step."""
        self._check_forwards()
        if self.force_barrier:
            ops.barrier()
        if self._handles:
            with self._engine.one_turn():
                for p in self._params:
                    ops.win_wait(self._handles.pop(id(p)))
                    ops.win_update(self._windows[id(p)])
            self._since = 0
        return _LocalOptimizer(self, self._base).step(closure)

    def unregister_window(self) -> None:
        """Collective: free this optimizer's windows (parameters keep their values)."""
        for name in self._windows.values():
            if name in ops.get_current_created_window_names():
                ops.win_free(name)


def DistributedWinPutOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1,
    window_prefix: str | None = None,
) -> Any:
    """After a forward pass each parameter is put into the out-neighbors' windows (``dst_weights``);
    step() averages it with the last values the in-neighbors put, then takes the local step.

    Ranks never wait for each other (unless ``force_barrier``): the neighbor
    values may be stale, as in BlueFog. Free the windows with
    ``unregister_window()`` (collective) before shutting down.
    """
    obj = _make(_WinPut, optimizer)
    obj._setup(optimizer, model, num_steps_per_communication)
    obj._setup_rule(window_prefix)
    return obj
