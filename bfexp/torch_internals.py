"""Every use bfexp makes of torch's private names, and why: the only module allowed to touch one.

torch may rename or drop a name starting with ``_`` in any release, so each use
here is one a public API cannot do, and tests/test_torch_internals.py fails
naming the torch attribute when one is gone or no longer means what bfexp
reads it for (its behaviour checked through torch's public API).
tests/test_architecture.py keeps every other module of bfexp off them.

* The step-hook tables (``Optimizer._optimizer_*_hooks``, and
  ``torch.optim.optimizer._global_optimizer_{pre,post}_hooks``):
  a DecentralizedOptimizer is a torch Optimizer (LR schedulers, step hooks)
  but keeps its parameters in one flat buffer, so it does not run
  ``Optimizer.__init__``, which makes the tables that the public
  ``register_*_hook`` methods fill; and its own ``step()`` runs the hooks
  that torch's step wrapper would (``add_hook_tables``, ``step_pre_hooks``,
  ``step_post_hooks``).
* ``torch._dynamo``: torch.optim imports it (about a second of CPU) only to
  mark optimizer code for the compiler; ``defer_dynamo`` puts a stand-in in
  its place until something really needs it. It reads
  ``torch.optim.optimizer._use_grad_for_differentiable`` to see that torch's
  optimizer code is the one it knows, and sets ``__dynamo_disable`` (the
  cache of torch's ``_disable_dynamo`` wrapper) on the wrapped optimizer
  methods so they do not import the real module either.
"""

from __future__ import annotations

import collections
import sys
import types
from typing import Any, Callable

import torch
import torch.optim.optimizer as torch_optimizer

__all__ = ["HOOK_TABLES", "add_hook_tables", "defer_dynamo", "step_post_hooks", "step_pre_hooks"]

# What torch.optim.Optimizer.__init__ makes (its register_*_hook methods fill them).
HOOK_TABLES = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)


def add_hook_tables(optimizer: torch.optim.Optimizer) -> None:
    """Give an Optimizer whose ``__init__`` does not run the (empty) hook tables that one would make, so
    ``register_step_pre_hook`` and the other ``register_*_hook`` methods work on it."""
    for table in HOOK_TABLES:
        object.__setattr__(optimizer, table, collections.OrderedDict())


def step_pre_hooks(optimizer: torch.optim.Optimizer) -> tuple[Callable[..., Any], ...]:
    """The hooks to call before ``optimizer``'s step, in torch's order (global ones first), each as
    ``hook(optimizer, args, kwargs)``; ``()`` when none (the usual case: two dictionary reads)."""
    own = optimizer._optimizer_step_pre_hooks
    every = torch_optimizer._global_optimizer_pre_hooks
    if not (own or every):
        return ()
    return (*every.values(), *own.values())


def step_post_hooks(optimizer: torch.optim.Optimizer) -> tuple[Callable[..., Any], ...]:
    """The hooks to call after ``optimizer``'s step, in torch's order (its own first), each as
    ``hook(optimizer, args, kwargs)``; ``()`` when none."""
    own = optimizer._optimizer_step_post_hooks
    every = torch_optimizer._global_optimizer_post_hooks
    if not (own or every):
        return ()
    return (*own.values(), *every.values())


# ---------------------------------------------------------------- torch._dynamo, deferred


class _DeferredDynamo(types.ModuleType):
    """Stands in for ``torch._dynamo`` until something needs it (see ``defer_dynamo``)."""

    def graph_break(self) -> None:  # what torch.optim's step() asks of it: outside compilation, nothing
        return None

    def __getattr__(self, name: str) -> Any:  # anything else (a submodule's import asks for __path__): the real one
        if name.startswith("__") and name.endswith("__") and name != "__path__":
            # a module's dunders that it lacks (inspect.getmodule asks every module in sys.modules for __file__):
            # importing torch._dynamo for those, in the middle of another import, made circular imports
            raise AttributeError(name)
        return getattr(_real_dynamo(self), name)


def _real_dynamo(placeholder: types.ModuleType) -> types.ModuleType:
    import importlib

    if sys.modules.get("torch._dynamo") is placeholder:
        del sys.modules["torch._dynamo"]
    if torch.__dict__.get("_dynamo") is placeholder:
        del torch.__dict__["_dynamo"]
    return importlib.import_module("torch._dynamo")


class _Loaded:
    """A meta path finder for ``torch._dynamo.x`` imported while the stand-in was in place: loading the
    real package (asked for its ``__path__``) has imported x already; Python's import would run it
    again, so this hands the module that exists back instead."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
        import importlib.machinery

        module = sys.modules.get(name) if name.startswith("torch._dynamo.") else None
        if module is None:
            return None
        return importlib.machinery.ModuleSpec(name, _Loaded, origin=getattr(module, "__file__", None))

    @staticmethod
    def create_module(spec: Any) -> Any:
        return sys.modules[spec.name]

    @staticmethod
    def exec_module(module: Any) -> None:
        return None


# The optimizer methods torch wraps (torch._disable_dynamo) to import torch._dynamo and exclude themselves from
# compilation, and where that wrapper caches what it made.
DYNAMO_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
DYNAMO_DISABLE_CACHE = "__dynamo_disable"
# The dispatch modes bfexp runs (a driver counts a model's FLOPs with torch.utils.flop_counter): torch wraps every
# TorchDispatchMode subclass's __torch_dispatch__ the same way (TorchDispatchMode.__init_subclass__), so the first
# counted operation imported torch._dynamo and its decompositions (2.6 s of CPU in every driver, for nothing).
DYNAMO_WRAPPED_MODES = (("torch.utils.flop_counter", "_FlopCounterMode"),)


def defer_dynamo() -> None:
    """Spare this process importing torch._dynamo (about a second of CPU) while nothing compiles.

    torch.optim imports it only to mark optimizer code for the compiler: step() runs
    ``import torch._dynamo; torch._dynamo.graph_break()`` on every call, and
    add_param_group, zero_grad and state_dict are wrapped to import it and exclude
    themselves from compilation. Until something asks for more (torch.compile, any
    other attribute), a stand-in answers graph_break (a no-op outside compilation) and
    those four run as they are; the first other use loads the real module in its place.
    torch's FLOP counter (a dispatch mode, wrapped the same way) runs as it is too.
    Importing a submodule (``torch._dynamo.x``) loads the real package first.
    Nothing changes where torch._dynamo is already loaded or torch's optimizer code differs.
    """
    import importlib.util

    use_grad = getattr(torch_optimizer, "_use_grad_for_differentiable", None)
    if "torch._dynamo" in sys.modules or use_grad is None or "graph_break" not in use_grad.__code__.co_consts + tuple(
            name for c in use_grad.__code__.co_consts if hasattr(c, "co_names") for name in c.co_names):
        return
    spec = importlib.util.find_spec("torch._dynamo")
    if spec is None or not spec.submodule_search_locations:
        return
    placeholder = _DeferredDynamo("torch._dynamo")
    placeholder.__spec__ = spec
    sys.modules["torch._dynamo"] = placeholder
    sys.meta_path.insert(0, _Loaded)
    wrapped = [getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None) for name in DYNAMO_WRAPPED]
    for module_name, class_name in DYNAMO_WRAPPED_MODES:
        mode = getattr(importlib.import_module(module_name), class_name, None)
        wrapped.append(getattr(getattr(mode, "__dict__", {}).get("__torch_dispatch__"), "__wrapped__", None))
    for original in wrapped:  # the wrapper's cache, holding the function itself: it runs as it is
        if original is not None and not hasattr(original, DYNAMO_DISABLE_CACHE):
            setattr(original, DYNAMO_DISABLE_CACHE, original)
