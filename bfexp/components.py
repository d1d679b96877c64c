"""How a config node becomes an object: any component's ``_target_`` node checked and built.

Components (algorithm, topology, model, dataset, optimizer, engine, logger,
launcher, heterogeneity, and algorithm/compressor) are config nodes: each option
is a YAML with ``_target_`` (algorithms and optimizers ``_partial_``), and the
target's constructor signature is its schema. ``check_node`` checks a node's keys
and value types against that signature before the object is built (Hydra's struct
mode already refuses unknown keys at compose time; ``+key=...`` gets here), and
the constructor checks ranges. A user's own class plugs in with
``model._target_=mypkg.Net`` or a YAML in their own config dir. A node may also
state its class's ``name`` (engine and logger nodes do: summaries and the driver
read ``cfg.engine.name``); it must then be that name. ``option_node`` is a shipped
option's node as Hydra composes it.

The components themselves (bfexp.comm, bfexp.topology, bfexp.algorithms,
bfexp.models, bfexp.compression) build their parts through this module; the
job-level rules are bfexp.config's. Bad input is a ConfigError (bfexp.errors):
one line, exit 2. This module imports only the standard library, Hydra and
OmegaConf (and bfexp.errors, bfexp.schema).
"""

from __future__ import annotations

import collections.abc
import copy
import functools
import importlib
import inspect
import sys
import threading
import types
import typing
from typing import Any, Callable, Iterable, Literal, Mapping

from omegaconf import DictConfig, OmegaConf

from bfexp.errors import ConfigError, number_in

__all__ = ["KINDS", "OPTIMIZER_RANGES", "RUNTIME", "SEED_MAX", "build", "check_kind", "check_node", "check_optimizer_options",
           "check_seed", "compose_shipped", "describe", "group_options", "label", "node_options", "option_node",
           "signature_schema", "target_of", "type_ok"]

# What bfexp (or a script) passes when it builds each component: a YAML may not set these.
RUNTIME: dict[str, tuple[str, ...]] = {
    "algorithm": ("optimizer", "engine", "topology", "model"),
    "optimizer": ("params",),
    "topology": ("size", "ranks_per_machine"),
    "model": ("in_shape", "in_features", "classes"),
    "dataset": (),
    "heterogeneity": (),
    "launcher": (),
    # a virtual rank's world and number; an MPI engine's communicator and whether $BFEXP_TIMELINE traces it
    "engine": ("world", "rank", "comm", "timeline_from_env", "size"),
    "logger": (),
}


# ------------------------------------------------------------------ components: node -> object


def node_options(node: Any) -> dict[str, Any]:
    """A component node's options: its keys minus Hydra's ``_target_``/``_partial_``/... ."""
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    return {k: v for k, v in data.items() if not (k.startswith("_") and k.endswith("_"))}


def group_options(group: str) -> list[str]:
    """The options shipped in a config group (``engine``, ``algorithm/compressor``, ...): its YAML names, sorted."""
    from bfexp.conf import options

    return options(group)


_compose_lock = threading.Lock()


def compose_shipped(config_name: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose a config of the shipped config module (``config``, ``algorithm/compressor/top_k``) with Hydra,
    one caller at a time (virtual ranks compose from their threads): in bfexp's own Hydra run (the driver and
    its virtual ranks) by that run's Hydra, elsewhere (an MPI rank, a script) by one set up for it. The schema
    (bfexp.schema) is stored first; bfexp.config's resolvers are known wherever bfexp.config was imported."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from bfexp.schema import register_schema

    with _compose_lock:
        register_schema()
        if GlobalHydra.instance().is_initialized():
            return compose(config_name=config_name, overrides=list(overrides))
        with initialize_config_module(config_module="bfexp.conf", version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))


def option_node(group: str, option: str, hint: str = "") -> dict[str, Any]:
    """A shipped option of a config group as Hydra composes it (``+group=option``): its node as a new plain
    dict, for an option named where a node is expected (``algorithm.compressor=qsgd``). A name that is
    none: ConfigError naming the options (and ``hint``, how else to give one)."""
    allowed = group_options(group)
    if option not in allowed:
        raise ConfigError(f"{group.replace('/', '.')}={option}; allowed: {', '.join(allowed)}{' ' + hint if hint else ''}")
    return copy.deepcopy(_composed_option(group, option))


@functools.lru_cache(maxsize=None)
def _composed_option(group: str, option: str) -> dict[str, Any]:
    """Composed once per process (virtual ranks share it)."""
    node = OmegaConf.to_container(OmegaConf.select(compose_shipped(f"{group}/{option}"), group.replace("/", ".")),
                                  resolve=True)
    assert isinstance(node, dict)
    return node


def target_of(node: Any, key: str) -> Callable[..., Any]:
    """The class or function a node's ``_target_`` names (imported)."""
    path = node.get("_target_") if isinstance(node, (Mapping, DictConfig)) else None
    if not path:
        raise ConfigError(f"{key} has no _target_; allowed: a class path, e.g. {key}._target_=mypkg.MyClass")
    module_name, _, attr = str(path).rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name) if module_name else None
        for part in [attr] if obj is not None else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}._target_={path!r} cannot be imported ({type(e).__name__}: {e}); "
                          "allowed: an importable class or function") from None
    if obj is None or not callable(obj):
        raise ConfigError(f"{key}._target_={path!r} is not callable; allowed: a class or function")
    return obj


def label(node: Any) -> str:
    """What a component is called in summaries: its class's ``name``, else the class name."""
    path = str(node.get("_target_", "")) if node is not None else ""
    try:
        target = target_of(node, "component")
    except ConfigError:
        return path.rpartition(".")[2] or "?"
    return str(getattr(target, "name", None) or getattr(target, "__name__", path))


def signature_schema(target: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], dict[str, Any], bool]:
    """(keyword parameters, their resolved type hints, whether any key is accepted).

    A class whose ``__init__`` forwards ``**kwargs`` to its base shows the base's
    parameters too (walking the MRO), so a subclass need not repeat them.
    """
    functions = [c.__init__ for c in inspect.getmro(target) if "__init__" in vars(c)] if inspect.isclass(target) else [target]
    params: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    open_ended = True
    for fn in functions:
        if fn is object.__init__:
            break
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature
            break
        try:
            hints.update({k: v for k, v in typing.get_type_hints(fn).items() if k not in hints})
        except Exception:  # unresolvable annotations: check names only
            pass
        open_ended = False
        for name, p in sig.parameters.items():
            if name == "self" or p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
                continue
            if p.kind == p.VAR_KEYWORD:
                open_ended = True
                continue
            params.setdefault(name, p)
        if not open_ended:
            break
    return params, hints, open_ended


def describe(annotation: Any) -> str:
    """What a type annotation allows, in the words of an error message."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin in (list, tuple, typing.Sequence, collections.abc.Sequence) or annotation in (list, tuple):
        return f"a list of {describe(args[0]).split(' ', 1)[-1]}s ([...])" if args else "a list"
    if origin in (dict, typing.Mapping, collections.abc.Mapping) or annotation is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(annotation, str(annotation))


def type_ok(value: Any, annotation: Any) -> bool:
    """Whether a config value fits a parameter's annotation (unknown annotations accept anything)."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    # (Sequence[str]'s origin is collections.abc.Sequence: a string, a sequence of characters, is not one here)
    if origin in (list, tuple, typing.Sequence, collections.abc.Sequence) or annotation in (list, tuple):
        return isinstance(value, (list, tuple)) and (not args or all(type_ok(v, args[0]) for v in value))
    if origin in (dict, typing.Mapping, collections.abc.Mapping) or annotation is dict:
        return isinstance(value, dict)
    if inspect.isclass(annotation) and origin is None:  # e.g. torch.Tensor: no config value is one
        return isinstance(value, annotation)
    return True


# What a group's `_target_` must be, checked before it is called: the base classes (by qualified name, so
# nothing is imported for the check) and whether a function (that returns one) may stand in for a class.
KINDS: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "model": (("torch.nn.modules.module.Module",), True, "a torch.nn.Module subclass or a function returning one"),
    "optimizer": (("torch.optim.optimizer.Optimizer",), True,
                  "a torch.optim.Optimizer subclass or a function returning one"),
    "dataset": (("bfexp.data.Dataset",), False, "a subclass of bfexp.data.Dataset"),
    "algorithm": (("bfexp.algorithms.base.DecentralizedOptimizer",), False,
                  "a subclass of bfexp.algorithms.DecentralizedOptimizer"),
    "topology": (("bfexp.topology.base.Topology",), True,
                 "a subclass of bfexp.topology.Topology or a function returning one"),
    "launcher": (("bfexp.launchers.base.Launcher",), False, "a subclass of bfexp.launchers.Launcher"),
    "logger": (("bfexp.loggers.Logger",), False, "a subclass of bfexp.loggers.Logger"),
    "topology.graph": ((), True, "a function returning a networkx graph or a matrix, e.g. "
                                 "networkx.random_geometric_graph, or one of yours"),
}


def check_kind(target: Any, key: str) -> None:
    """Refuse, before it is called, a `_target_` that is not the kind of thing its group builds
    (``model._target_=bfexp.data.Digits``, ``dataset._target_=os.getcwd``); for every key, one from Python's
    own library (``topology.graph._target_=os.system``, ``subprocess.getoutput``): it builds no component,
    and would run whatever its arguments say."""
    module = str(getattr(target, "__module__", None) or "")
    if inspect.isbuiltin(target) or module.split(".")[0] in sys.stdlib_module_names or not module:
        name = getattr(target, "__qualname__", getattr(target, "__name__", repr(target)))
        raise ConfigError(f"{key}._target_ names Python's own {module or 'builtins'}.{name}, which builds no "
                          f"{key}; allowed: {KINDS[key][2] if key in KINDS else 'a class or function of a library or of yours'}")
    if key not in KINDS:
        return
    bases, functions, allowed = KINDS[key]
    if inspect.isclass(target):
        ok = any(f"{c.__module__}.{c.__qualname__}" in bases for c in inspect.getmro(target))
    else:
        ok = functions and (inspect.isfunction(target) or inspect.ismethod(target))
    if not ok:
        what = f"the class {target.__module__}.{target.__qualname__}" if inspect.isclass(target) else \
            f"{type(target).__name__} {getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"
        raise ConfigError(f"{key}._target_ names {what}, not a {key}; allowed: {allowed}")


# The largest seed: torch's generators take a signed 64-bit seed, and ranks and probes add small offsets to it.
SEED_MAX = 2**62


def check_seed(key: str, value: Any) -> int:
    """A seed: an integer in [0, 2**62] (a larger one overflows torch's generator on every rank)."""
    number_in(key, value, low=0, integer=True)
    if value > SEED_MAX:
        raise ConfigError(f"{key}={value}; allowed: an integer in [0, 2**62] (torch's generators take 64 bits)")
    return int(value)


def check_node(node: Any, key: str, runtime: Iterable[str] = ()) -> tuple[Callable[..., Any], dict[str, Any]]:
    """Check a component node against its target's signature; returns (target, options).

    ``runtime`` names the arguments bfexp passes when it builds the object (the
    rank count, the model's input shape, ...): a YAML may not set them. Raises
    ConfigError naming ``key.<option>`` for an unknown key or a value of the
    wrong type, with what is allowed.
    """
    target = target_of(node, key)
    check_kind(target, key)
    options = node_options(node)
    params, hints, open_ended = signature_schema(target)
    own = getattr(target, "name", None)
    if "name" in options and "name" not in params and isinstance(own, str) and own:  # what the node is called
        if options.pop("name") != own:
            raise ConfigError(f"{key}.name={node.get('name')!r}; allowed: {own} (the name of {node.get('_target_')})")
    runtime = set(runtime)
    allowed = [n for n in params if n not in runtime]
    for name, value in options.items():
        if name in runtime:
            raise ConfigError(f"{key}.{name} is given by bfexp at run time; allowed keys: {', '.join(allowed) or 'none'}")
        if name not in params:
            if open_ended:
                continue
            raise ConfigError(f"unknown key '{key}.{name}'; allowed: {', '.join(allowed) or 'none'}")
        annotation = hints.get(name, params[name].annotation)
        if not type_ok(value, annotation):
            raise ConfigError(f"{key}.{name}={value!r}; allowed: {describe(annotation)}")
        if name == "seed" and value is not None:  # every component's seed, as the top level's
            check_seed(f"{key}.seed", value)
    return target, options


def build(node: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """Check a component node (``check_node``), then instantiate it the Hydra way with the run-time arguments.

    ``key`` is the group (algorithm, optimizer, ...; RUNTIME says what bfexp passes
    it). ``_partial_`` nodes (algorithms, optimizers) come back as a partial that
    takes the rest. Containers reach the constructor as plain lists and dicts. The
    constructor is called here, not inside Hydra, so its own exceptions (a
    ConfigError naming a bad value) reach the caller as they are.
    """
    from hydra.utils import instantiate

    _, options = check_node(node, key, runtime=set(RUNTIME.get(key, ())) | set(kwargs))
    if "name" in node and "name" not in options:  # the class's name, stated by the node: not an argument
        node = {k: v for k, v in node.items() if k != "name"}
    factory = instantiate(node, _partial_=True, _convert_="all")
    if node.get("_partial_", False):
        return functools.partial(factory, *args, **kwargs)
    return factory(*args, **kwargs)


# The domains of the options torch's optimizers share. torch checks some of them (and names no
# key), others not at all (momentum=1.5 runs and diverges); a user's own optimizer with these
# keys means the same by them.
OPTIMIZER_RANGES: dict[str, dict[str, Any]] = {
    "lr": {"low": 0, "low_open": True},
    "momentum": {"low": 0, "high": 1, "high_open": True},
    "dampening": {"low": 0, "high": 1},
    "weight_decay": {"low": 0},
    "eps": {"low": 0, "low_open": True},
    "alpha": {"low": 0, "high": 1},
    "lr_decay": {"low": 0},
    "initial_accumulator_value": {"low": 0},
}


def check_optimizer_options(options: Mapping[str, Any]) -> None:
    """Raise ConfigError (``optimizer.<key>=<value>; allowed: ...``) for a shared optimizer option out of its domain."""
    for key, value in options.items():
        if key in OPTIMIZER_RANGES and value is not None:
            number_in(f"optimizer.{key}", value, **OPTIMIZER_RANGES[key])
        elif key == "betas" and value is not None:
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise ConfigError(f"optimizer.betas={value}; allowed: two numbers in [0, 1)")
            for i, beta in enumerate(value):
                number_in(f"optimizer.betas[{i}]", beta, low=0, high=1, high_open=True)
