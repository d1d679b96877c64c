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
Gossip-PGA (Chen et al., "Accelerating Gossip SGD with Periodic Global
Averaging", ICML 2021): with ``global_average_every`` G, every G-th round
uses J = 11^T / n in place of W(r), an exact average that ``start_mix`` and
``start_push`` run as one allreduce; G = 1 averages every round.

The constructor is the algorithm's config schema: every option is a keyword
with a type annotation and a default (words are ``typing.Literal``), and
conf/algorithm/<name>.yaml builds it with Hydra (``_target_``, ``_partial_:
true``) given the local optimizer, engine, topology and model. What a class
states about itself, each read before any rank starts:

* ``check_options(**options)``: the options' ranges (ConfigError, one line);
* ``check_run(engine class, throughput_only=, modeled=)``: the kind of job;
* ``resolve_topology(topology)``: the topology its rule runs on (or
  TopologyMismatch); the constructor refuses one that breaks ``requires``;
* ``traffic``: what one communicating step sends, for the cost model.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

import torch

from bfexp import torch_internals
from bfexp.algorithms.buckets import Bucket, GradBuckets
from bfexp.comm.engine import Engine, Handle
from bfexp.costmodel import Traffic
from bfexp.errors import ConfigError, TopologyMismatch, number_in
from bfexp.topology import RankWeights, Topology


@dataclass(frozen=True)
class Requirements:
    """What an update rule's theory needs from the mixing matrices."""

    doubly_stochastic: bool = False
    symmetric: bool = False
    column_stochastic: bool = False
    row_stochastic: bool = False
    static: bool = False


def flatten_parameters_(params: list[torch.nn.Parameter], ranks: int = 0) -> torch.Tensor:
    """Move the parameters' storage into one flat buffer; each becomes a view of it.

    ``ranks`` > 0: the parameters are stacked (bfexp.comm.stacked: the last dimension is the rank), and
    the buffer is ``(numel per rank, ranks)``: row k is element k of every rank's flat model, so the
    rules' slices of ``flat`` (``flat[a:b]``, a bucket) cut the same elements as on one rank. Its memory
    is ranks-first (``flat.t()`` is contiguous), as StackedModel's: each rank's model lies together, so
    the model's batched kernels and the mixing read it without a transpose, and the buffers a rule makes
    with ``*_like(flat)`` (which keep its strides) are laid out alike.
    """
    if not params:
        raise ValueError("the optimizer has no parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
    if ranks:
        memory = torch.empty(ranks, sum(p.numel() for p in params) // ranks, dtype=params[0].dtype,
                             device=params[0].device)
        flat = memory.t()
        offset = 0
        for p in params:
            n = p.numel() // ranks
            flat[offset : offset + n].copy_(p.detach().reshape(n, ranks))
            offset += n
    else:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        n = _rows(p, flat)
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    return flat


def _rows(p: torch.Tensor, flat: torch.Tensor) -> int:
    """How many rows (elements per rank) of ``flat`` parameter ``p`` takes: its numel, or its numel over
    the ranks of a stacked (2-D) buffer."""
    return p.numel() if flat.dim() == 1 else p.numel() // flat.shape[1]


def flat_grad(params: list[torch.nn.Parameter], out: torch.Tensor | None = None) -> torch.Tensor:
    """All gradients as one flat buffer (zeros where a parameter got none)."""
    if out is None:
        out = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = _rows(p, out)
        if p.grad is None:
            out[offset : offset + n].zero_()
        else:
            part = out[offset : offset + n]
            part.copy_(p.grad.reshape(part.shape))
        offset += n
    return out


def set_flat_grad_(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat buffer into the parameters' .grad (allocating where a grad is None)."""
    offset = 0
    for p in params:
        n = _rows(p, flat)
        view = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)
        offset += n


# Set in an optimizer's __dict__ while its constructors run: they may add attributes (see __setattr__).
_BUILDING = "_building_now"


def _building(init: Callable[..., None]) -> Callable[..., None]:
    """A DecentralizedOptimizer constructor that marks the object as being built while the outermost one
    runs (a subclass's __init__ calling its parents' is one construction)."""

    @functools.wraps(init)
    def __init__(self: "DecentralizedOptimizer", *args: Any, **kwargs: Any) -> None:
        if _BUILDING in self.__dict__:
            return init(self, *args, **kwargs)
        self.__dict__[_BUILDING] = True
        try:
            return init(self, *args, **kwargs)
        finally:
            del self.__dict__[_BUILDING]

    return __init__


# Gradient buckets of bucketed rules: at most this many MiB each (the default of every rule's bucket_mb).
BUCKET_MB = 25.0


class DecentralizedOptimizer(torch.optim.Optimizer):
    """step() = the local update plus the communication the rule needs.

    ``optimizer`` is the local torch optimizer (SGD, momentum SGD, Adam...):
    whatever it would do with a gradient is the "adapt" part of each rule.
    ``topology`` must meet the rule's ``requires`` (TopologyMismatch
    otherwise): pass it through ``resolve_topology`` first. Give ``model``
    so the start-of-iteration work runs from a forward pre-hook; without it,
    call ``zero_grad()`` before each forward pass (the usual loop does).

    Options every rule takes: ``communication_period`` H (local SGD:
    communicate every H-th iteration), ``overlap`` (start communication from
    hooks so it overlaps computation; false: after backward) and
    ``bucket_mb`` (messages started during backward carry buckets of at
    most this many MiB); gossip rules also take ``global_average_every`` G
    (Gossip-PGA: every G-th round averages exactly; 0 = never). A subclass
    adds its own as keywords and forwards the rest:
    ``DSGD(opt, engine, topology, style="awc", overlap=False)``.

    To torch it is an Optimizer (``isinstance``, LR schedulers, step hooks):
    ``param_groups``, ``state`` and ``defaults`` are the local optimizer's own
    (a scheduler that sets the learning rate sets the local optimizer's).
    Once built, assigning an attribute it does not have raises
    AttributeError naming it (an option of another rule would otherwise be
    ignored); its constructors (a subclass's included) may add attributes
    freely, and so may any code to names starting with ``_``.
    """

    # Its label in summaries and messages: the config option's name. A subclass
    # that states none (a user's own rule) is labelled by its class name.
    name: ClassVar[str] = "DecentralizedOptimizer"
    requires: ClassVar[Requirements] = Requirements()
    # False for the allreduce baselines: they never read the topology.
    uses_topology: ClassVar[bool] = True

    @property
    def models_agree(self) -> bool:
        """Whether every rank's model is the same by construction: the allreduce baselines (every rank
        applies the same averaged update to the same start). Their consensus distance is 0 without
        the model-sized allreduce that measures it."""
        return not self.uses_topology
    # True when the rule adapts per bucket during backward (see module doc).
    bucketed: ClassVar[bool] = False
    # False when the rule's exchange needs the finished step, so nothing can overlap it
    # (its class then defaults overlap to false and refuses true, which the cost model would believe).
    overlaps: ClassVar[bool] = True
    # What one communicating step sends (the cost model prices it). The default,
    # one model-sized neighbor exchange, is DSGD's; a user's rule without one is priced so.
    traffic: ClassVar[Traffic] = Traffic("neighbor")
    # True when ranks never wait for one another inside step() (one-sided window ops only):
    # async_push_sum, gossip, ad_psgd. Their finish() is collective: it drains what is in flight.
    asynchronous: ClassVar[bool] = False
    # True when the rule's update is elementwise plus engine operations, so that it runs unchanged on
    # engine=stacked (every rank one slice of the buffers' last dimension). A user's own rule says so
    # itself: the default refuses the stacked engine (check_run) rather than guess.
    stackable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in vars(cls):
            cls.name = cls.__name__
        if "__init__" in vars(cls):
            cls.__init__ = _building(vars(cls)["__init__"])  # type: ignore[method-assign]

    def __new__(cls, *args: Any, **options: Any) -> "DecentralizedOptimizer":
        # A misspelt option (stlye="awc") must not run the default: Python's own TypeError
        # names the key but not the allowed ones, so say them here, before any __init__ runs.
        from bfexp.components import signature_schema  # the one reader of a constructor's keywords

        params, _, open_ended = signature_schema(cls)
        unknown = sorted(set(options) - set(params))
        if unknown and not open_ended:
            raise TypeError(f"{cls.__name__}() got unknown option(s) {', '.join(unknown)}; "
                            f"allowed: {', '.join(params)}")
        return super().__new__(cls)

    @_building
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        topology: Topology | None = None,
        *,
        model: torch.nn.Module | None = None,
        communication_period: int = 1,
        overlap: bool = True,
        bucket_mb: float = BUCKET_MB,
        global_average_every: int = 0,
    ) -> None:
        """Wrap ``optimizer``; the model's parameters become views of one flat buffer (``self.flat``).

        The parameters stay the same objects, so ``model.parameters()`` and
        tensors taken from it, before or after wrapping, stay live; only a
        ``p.data`` taken before wrapping points at the old storage. When the
        rule runs on another graph than ``topology`` (exact diffusion on a
        directed graph's undirected form) a UserWarning names both, and
        ``self.topology`` is the one it runs on.
        """
        self.check_options(communication_period=communication_period, overlap=overlap, bucket_mb=bucket_mb,
                           global_average_every=global_average_every)
        # torch.optim.Optimizer's hook tables (its __init__ would re-group the parameters: not called).
        torch_internals.add_hook_tables(self)
        self.optimizer = optimizer
        self.engine = engine
        if self.uses_topology:
            if topology is None:
                raise TypeError(f"algorithm={self.name} needs a topology")
            # refuses (TopologyMismatch) what the rule cannot run on, with the options that decide it
            used, note = self.resolve_topology(topology, **self.topology_options())
            if used is not topology:
                warnings.warn(note or f"algorithm={self.name} runs on {used.label}, not {topology.label}",
                              UserWarning, stacklevel=3)
            topology = used
        self.topology = topology
        self.communication_period = communication_period
        self.overlap = overlap
        self.bucket_mb = bucket_mb
        self.global_average_every = global_average_every
        self._average: GlobalAverage | None = None  # this rank's row of J, built on first use
        self._rounds: tuple[Any, dict[int, TopologyRound]] = (None, {})  # (topology, its rounds' weights)
        self.params: list[torch.nn.Parameter] = _unique([p for g in optimizer.param_groups for p in g["params"]])
        self.flat = flatten_parameters_(self.params, engine.size if engine.stacked else 0)
        self.iteration = 0
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # local_update's buffers
        self.module: torch.nn.Module | None = model  # what the training loop calls forward on
        self._begun_iteration = -1
        self.buckets: GradBuckets | None = None
        if self.bucketed:
            bucket_bytes = int(self.bucket_mb * 2**20) if self.overlap else None
            self.buckets = GradBuckets(self.params, bucket_bytes, self.bucket_ready,
                                       ranks=engine.size if engine.stacked else 1)
        self._pre_hook = (model.register_forward_pre_hook(_BeginHook(self))
                          if model is not None and self.begins_before_forward() else None)

    # torch.optim.Optimizer: the local optimizer's groups, state and defaults -------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps its parameters in one flat buffer made when it was "
                                  "built; add the group to the local optimizer before wrapping it")

    def __getstate__(self) -> dict[str, Any]:  # a plain object's, not torch.optim.Optimizer's three keys
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __setattr__(self, name: str, value: Any) -> None:
        # opt.self_weight = 0.5 on a rule without one must fail, not be ignored; private names, existing
        # attributes, and whatever its constructors set, pass.
        if not (name.startswith("_") or name in self.__dict__ or _BUILDING in self.__dict__
                or hasattr(type(self), name)):
            from bfexp.components import RUNTIME, signature_schema

            options = [k for k in signature_schema(type(self))[0]
                       if k in self.__dict__ and k not in RUNTIME["algorithm"]]
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}, so setting it would change "
                                 f"nothing; allowed: its options {', '.join(options)} or another attribute it has")
        object.__setattr__(self, name, value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._begin()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for pre in torch_internals.step_pre_hooks(self):
            pre(self, (closure,), {})
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._begun_iteration != self.iteration:
            self.late_begin()
        self.update(self.communicates_now())
        self.iteration += 1
        for post in torch_internals.step_post_hooks(self):
            post(self, (closure,), {})
        return loss

    def state_dict(self) -> dict:
        # A rule's random generators (a compressor's random_k / qsgd draws) resume where they stopped.
        generators = {k: v.get_state() for k, v in vars(self).items() if isinstance(v, torch.Generator)}
        return {"optimizer": self.optimizer.state_dict(), "iteration": self.iteration, "buffers": self.buffers(),
                "generators": generators}

    def load_state_dict(self, state: dict) -> None:
        self.finish()
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = state["iteration"]
        for key, value in state.get("buffers", {}).items():
            getattr(self, key).copy_(value)
        for key, value in state.get("generators", {}).items():
            getattr(self, key).set_state(value)

    # what a rule provides ------------------------------------------------
    def begin_iteration(self) -> None:
        """Start-of-iteration work (before forward). Default: watch backward for buckets."""
        if self.buckets is not None and self.overlap and self.communicates_now():
            self.buckets.arm()

    def begins_before_forward(self) -> bool:
        """Whether begin_iteration has work that must come before the forward pass (a forward pre-hook on
        the model runs it there; zero_grad() does too). A hook sends every forward call down torch's slow
        path (about 9 us a call here), so a rule whose start-of-iteration work is only arming the buckets'
        backward hooks, with none to arm (the model fits one bucket), has none: step() starts the buckets."""
        return self.begins_its_own_way(DecentralizedOptimizer) or self.watches_backward()

    def begins_its_own_way(self, rule: type) -> bool:
        """Whether this object's class has a begin_iteration other than ``rule``'s (a subclass's own work,
        which begins_before_forward cannot see into: it gets the hook)."""
        return type(self).begin_iteration is not rule.begin_iteration

    def watches_backward(self) -> bool:
        """Buckets whose gradients are watched during backward (overlap, more than one bucket)."""
        return self.buckets is not None and self.buckets.watches

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

    def observe_loss(self, loss: torch.Tensor) -> None:
        """This rank's mini-batch loss of the iteration, a detached scalar tensor (the training loop
        reports it after backward). Rules that weigh models by their loss (gossip) keep it; the rest
        ignore it (and so never wait for a GPU to produce it)."""

    # shared pieces -------------------------------------------------------
    @property
    def step_cycle(self) -> int:
        """Steps after which the pattern of communication repeats (H local steps; H x G with Gossip-PGA's
        global averages): a step time that stands for the job is a mean over whole cycles."""
        return self.communication_period * max(1, self.global_average_every)

    def communicates_now(self, iteration: int | None = None) -> bool:
        """Local SGD: exchange only on every `communication_period`-th iteration."""
        k = self.iteration if iteration is None else iteration
        return (k + 1) % self.communication_period == 0

    def mixing_weights(self, iteration: int | None = None) -> RankWeights:
        """This rank's row and column of W(r) for the communication round r of an iteration
        (of J = 11^T / n, a GlobalAverage, on Gossip-PGA's rounds)."""
        assert self.topology is not None
        k = self.iteration if iteration is None else iteration
        r = k // self.communication_period
        if self.global_average_every and (r + 1) % self.global_average_every == 0:
            if self._average is None:
                self._average = GlobalAverage.of(self.engine.rank, self.engine.size)
            return self._average
        # W(r) repeats with the topology's period: each round's weights are made once (read-only, like J's).
        topology, rounds = self._rounds
        if topology is not self.topology:
            topology, rounds = self._rounds = (self.topology, {})
        key = r % topology.period
        w = rounds.get(key)
        if w is None:
            w = rounds[key] = TopologyRound.of(topology.weights(self.engine.rank, key), key)
        return w

    def start_mix(self, tensor: torch.Tensor, w: RankWeights, scale: float = 1.0) -> Handle:
        """Start (W X)_i in place for a row-stochastic W; ``scale`` mixes with (1-s) I + s W instead.

        The result is written into ``tensor`` at wait(); leave it alone until then.
        W = J (a GlobalAverage) runs as one allreduce, not n - 1 messages.
        """
        if isinstance(w, GlobalAverage):
            return self.start_average(tensor, scale)
        if self.engine.stacked:  # every rank at once: the round's W, by number
            return self.engine.imix_(tensor, self.topology, w.round, scale)
        if scale == 1.0 and isinstance(w, TopologyRound) and self.topology is self.engine.topology:
            # W(r) as the engine's topology gives it: checked at its first use, then no declaration round trip.
            return self.engine.ineighbor_allreduce_(tensor, t=w.round)
        self_weight = 1.0 - scale + scale * w.self_weight
        src = {j: scale * v for j, v in w.src_weights.items()}
        return self.engine.ineighbor_allreduce_(tensor, self_weight, src, list(w.dst_weights))

    def start_push(self, tensor: torch.Tensor, w: RankWeights) -> Handle:
        """Start (A X)_i in place for a column-stochastic A: every sender scales what it sends by A[k, i]."""
        if isinstance(w, GlobalAverage):
            return self.start_average(tensor)
        if self.engine.stacked:  # A X for every rank at once: the same product as the senders' scaling
            return self.engine.imix_(tensor, self.topology, w.round)
        src = {j: 1.0 for j in w.src_weights}
        return self.engine.ineighbor_allreduce_(tensor, w.self_weight, src, dict(w.dst_weights))

    def start_average(self, tensor: torch.Tensor, scale: float = 1.0) -> Handle:
        """Start ((1-s) I + s J) X in place (J = 11^T / n): an allreduce, then the blend at wait()."""
        if scale == 1.0:
            return self.engine.iallreduce_(tensor, op="avg")
        mean = tensor.clone()
        pending = self.engine.iallreduce_(mean, op="avg")

        def blend() -> torch.Tensor:
            pending.wait()
            return tensor.mul_(1.0 - scale).add_(mean, alpha=scale)

        return Handle(blend, pending.done)

    def wait(self, handle: Handle) -> Any:
        """Wait for a handle (engine handles count their own blocked time as communication)."""
        return handle.wait()

    def local_step(self, params: typing.Sequence[torch.nn.Parameter] | None = None) -> None:
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

    # what a class checks before any rank starts ------------------------------
    @classmethod
    def check_options(cls, **options: Any) -> None:
        """Raise ConfigError (``algorithm.<key>=<value>; allowed: ...``) for an option out of its range.

        Checks the options given, any subset of the constructor's keywords:
        the driver passes a YAML's options before any rank starts, and the
        constructor its own. Which keys exist and their types are the
        signature's to say. Words are checked against the ``Literal`` of
        their annotation, so a subclass states its words once.
        """
        for key, words in _word_options(cls).items():
            if key in options and options[key] not in words:
                raise ConfigError(f"algorithm.{key}={options[key]!r}; allowed: {', '.join(map(str, words))}")
        if "communication_period" in options:
            number_in("algorithm.communication_period", options["communication_period"], low=1, integer=True)
        if "bucket_mb" in options:
            number_in("algorithm.bucket_mb", options["bucket_mb"], low=0, low_open=True)
        if options.get("overlap") and not cls.overlaps:
            raise ConfigError(f"algorithm.overlap=true; allowed: false (algorithm={cls.name} sends what the "
                              "finished step made, so nothing overlaps it)")
        every = number_in("algorithm.global_average_every", options.get("global_average_every", 0), low=0,
                          integer=True, note="(0 = never)")
        if every and not cls.uses_topology:
            raise ConfigError(f"algorithm.global_average_every={every}; allowed: 0, since algorithm={cls.name} "
                              "averages exactly already")

    @classmethod
    def traffic_of(cls, **options: Any) -> Traffic:
        """What one communicating step sends with these options (the cost model prices it).

        ``traffic`` refined by the options: with ``global_average_every`` G, every
        G-th exchange is an allreduce (Gossip-PGA). Rules whose messages depend on
        other options (a compressor, where the outer average runs) refine it further.
        """
        every = int(options.get("global_average_every", 0) or 0)
        return dataclasses.replace(cls.traffic, global_every=every) if every else cls.traffic

    @classmethod
    def check_run(cls, engine: type[Engine], *, throughput_only: bool, modeled: bool) -> None:
        """Raise a ConfigError-family error (one line) when this rule cannot run such a job.

        ``engine`` is the engine class the ranks will run on (its class facts:
        ``processes``, ``virtual``, ``device_type``); ``throughput_only``: the
        job times step() alone on its ranks; ``modeled``: no rank runs, the
        cost model prices the step. Every rule here runs anywhere unless it
        says otherwise; on engine=stacked only the rules that state ``stackable``.
        """
        if getattr(engine, "stacked", False) and not cls.stackable:
            from bfexp.comm.stacked import STACKABLE_ALGORITHMS

            why = ("its ranks exchange asynchronously through one-sided windows, which one batched program has "
                   "no order for" if cls.asynchronous else "its update is not stated elementwise (stackable)")
            raise ConfigError(f"engine=stacked cannot run algorithm={cls.name}: {why}; allowed: engine=threads "
                              f"or engine=mpi, or on engine=stacked algorithm={'|'.join(STACKABLE_ALGORITHMS)}")

    # topology requirements -------------------------------------------------
    @classmethod
    def check_topology(cls, topology: Topology) -> None:
        """Raise TopologyMismatch (one line: what the rule needs, how far W is from it, the fix) unless W fits."""
        req = cls.requires
        if req.static and topology.is_dynamic:
            raise TopologyMismatch(
                f"algorithm={cls.name} needs a static topology; topology={topology.label} changes every iteration "
                f"(period {topology.period}); allowed: a static graph"
            )
        checks = [
            (req.symmetric, topology.is_symmetric, "symmetric", "a symmetric mixing matrix"),
            (req.doubly_stochastic, topology.is_doubly_stochastic, "doubly", "a doubly stochastic mixing matrix"),
            (req.row_stochastic, topology.is_row_stochastic, "row", "a row stochastic mixing matrix (row sums 1)"),
            (req.column_stochastic, topology.is_column_stochastic, "column",
             "a column stochastic mixing matrix (column sums 1)"),
        ]
        for needed, ok, need, what in checks:
            if needed and not ok():
                detail, fix = topology.explain(need)
                raise TopologyMismatch(
                    f"algorithm={cls.name} needs {what}; topology={topology.label} "
                    f"with weights={topology.weight_scheme}: {detail}; allowed: {fix}"
                )

    @classmethod
    def reads_topology(cls, **options: Any) -> bool:
        """Whether the rule, with these options (any of its constructor's), mixes with the topology's
        weights, so that the topology must meet ``requires``. A rule that averages by allreduce
        (the baselines; diloco/slowmo with average=allreduce) never reads them."""
        return cls.uses_topology

    @classmethod
    def resolve_topology(cls, topology: Topology, **options: Any) -> tuple[Topology, str | None]:
        """The topology this algorithm runs on, and a note when it is not the one asked for.

        ``options`` (any of the constructor's) say whether it reads the graph at all
        (``reads_topology``). Raises TopologyMismatch (one line) when the rule cannot run on it.
        """
        if cls.reads_topology(**options):
            cls.check_topology(topology)
        return topology, None

    def topology_options(self) -> dict[str, Any]:
        """The options, set before the base constructor runs, that change what the rule needs of the
        topology (``resolve_topology``'s ``options``): none here."""
        return {}

    # internals -------------------------------------------------------------
    def _begin(self) -> None:
        if self._begun_iteration != self.iteration:
            self._begun_iteration = self.iteration
            self.begin_iteration()

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Evaluation passes (no_grad or eval mode) are not training iterations.
        if torch.is_grad_enabled() and module.training:
            self._begin()


@dataclass(frozen=True)
class TopologyRound(RankWeights):
    """This rank's row and column of the topology's W(r), and r: the engine can take them from its own topology."""

    round: int = 0

    @classmethod
    def of(cls, w: RankWeights, r: int) -> "TopologyRound":
        """Round r's weights, read-only: one object serves every repeat of the round."""
        return cls(w.self_weight, types.MappingProxyType(dict(w.src_weights)),
                   types.MappingProxyType(dict(w.dst_weights)), r)


@dataclass(frozen=True)
class GlobalAverage(RankWeights):
    """One rank's row and column of J = 11^T / n: every weight 1/n (Gossip-PGA's exact average)."""

    @classmethod
    def of(cls, rank: int, size: int) -> "GlobalAverage":
        others = {j: 1.0 / size for j in range(size) if j != rank}
        return cls(1.0 / size, others, dict(others))


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


def neighbors_over_period(topology: Topology, rank: int) -> tuple[list[int], list[int]]:
    """(in-neighbors, out-neighbors) of ``rank`` in the union of W(t) over one period: the neighbors
    a window must be created with for a rule that follows a dynamic graph."""
    srcs: set[int] = set()
    dsts: set[int] = set()
    for t in range(topology.period):
        w = topology.weights(rank, t)
        srcs.update(w.src_weights)
        dsts.update(w.dst_weights)
    return sorted(srcs), sorted(dsts)


def window_name(engine: Engine, label: str) -> str:
    """A window name every rank derives alike: ``label`` and how many this engine has named so far."""
    count = engine.__dict__.setdefault("_bfexp_windows_named", [0])
    count[0] += 1
    return f"bfexp.{label}.{count[0]}"


@functools.cache
def _word_options(cls: type[DecentralizedOptimizer]) -> dict[str, tuple[Any, ...]]:
    """{option: its allowed words} for every keyword of cls's constructors annotated with a Literal."""
    words: dict[str, tuple[Any, ...]] = {}
    inits = [vars(k)["__init__"] for k in cls.__mro__[: cls.__mro__.index(DecentralizedOptimizer) + 1]
             if "__init__" in vars(k)]
    for init in inits:
        try:
            hints = typing.get_type_hints(init)
        except NameError:  # an annotation only a type checker can resolve: no words to check there
            continue
        for key, hint in hints.items():
            if typing.get_origin(hint) is Literal:
                words.setdefault(key, typing.get_args(hint))
    return words


def _unique(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
