"""Spare a process importing torch._dynamo (about a second of CPU) while nothing compiles.

torch.optim imports it only to mark optimizer code for the compiler; every bfexp
process (the driver's dry build, each MPI rank) would pay that at its first
``optimizer.step()``. ``defer_dynamo`` puts a stand-in in its place until
something really needs it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


class _DeferredDynamo(types.ModuleType):
    """Stands in for ``torch._dynamo`` until something needs it (see ``defer_dynamo``)."""

    def graph_break(self) -> None:  # what torch.optim's step() asks of it: outside compilation, nothing
        return None

    def __getattr__(self, name: str) -> Any:  # anything else (a submodule's import asks for __path__): the real one
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


def defer_dynamo() -> None:
    """Spare this process importing torch._dynamo (about a second of CPU) while nothing compiles.

    torch.optim imports it only to mark optimizer code for the compiler: step() runs
    ``import torch._dynamo; torch._dynamo.graph_break()`` on every call, and
    add_param_group, zero_grad and state_dict are wrapped to import it and exclude
    themselves from compilation. Until something asks for more (torch.compile, any
    other attribute), a stand-in answers graph_break (a no-op outside compilation) and
    those four run as they are; the first other use loads the real module in its place.
    Importing a submodule (``torch._dynamo.x``) loads the real package first.
    Nothing changes where torch._dynamo is already loaded or torch's optimizer code differs.
    """
    import importlib.util

    from torch.optim import optimizer as torch_optimizer

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
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        original = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
        if original is not None and not hasattr(original, "__dynamo_disable"):
            setattr(original, "__dynamo_disable", original)
