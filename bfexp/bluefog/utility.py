"""BlueFog's model utilities: broadcast_parameters, allreduce_parameters, broadcast_optimizer_state.

Tensors of one dtype and device travel as ONE fused message (the engine
fuses a list), so broadcasting a model costs one message per dtype, not
one per parameter.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

from bfexp.bluefog.ops import _engine


def _tensors(params: Any) -> list[torch.Tensor]:
    """The tensors of a state_dict / dict (sorted by name) or a list of tensors or (name, tensor) pairs."""
    if isinstance(params, dict):
        items: Iterable[Any] = [v for _, v in sorted(params.items())]
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}; allowed: a dict or a list")
    return [t for t in items if isinstance(t, torch.Tensor)]


def _by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    return [groups[k] for k in sorted(groups, key=str)]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's tensors with root_rank's, in place (``model.state_dict()``, ``named_parameters()``...)."""
    engine = _engine()
    with torch.no_grad():
        for group in _by_kind(_tensors(params)):
            engine.broadcast_([t.detach() for t in group], root=root_rank)


def allreduce_parameters(params: Any) -> None:
    """Replace every rank's floating tensors by their average over all ranks, in place."""
    engine = _engine()
    with torch.no_grad():
        for group in _by_kind([t for t in _tensors(params) if t.is_floating_point()]):
            engine.allreduce_([t.detach() for t in group], op="avg")


def _local_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of the optimizer's own update, without communication (a wrapper's base step)."""
    local = getattr(optimizer, "_bluefog_local_step", None)
    (local or optimizer.step)()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state and hyper-parameters root_rank's.

    A fresh optimizer has no state yet: it is created first by one step with
    zero gradients (as BlueFog does), so every rank has the same structure.
    Numbers (lr, momentum, betas, integer steps) travel in one float64
    message and are cast back to their types.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not optimizer.state:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _local_step(optimizer)
    tensors: list[torch.Tensor] = []
    numbers: list[tuple[Any, Any, type, int]] = []  # (container, key, type, index in tuple or -1)
    for group in optimizer.param_groups:
        for key, value in sorted(group.items()):
            if key != "params":
                _collect_number(group, key, value, numbers)
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
                else:
                    _collect_number(optimizer.state[p], key, value, numbers)
    broadcast_parameters(tensors, root_rank)
    if numbers:
        values = torch.tensor([_value_of(c, k, i) for c, k, _, i in numbers], dtype=torch.float64)
        values = _engine().broadcast(values, root=root_rank)
        for (container, key, kind, index), v in zip(numbers, values.tolist()):
            if index < 0:
                container[key] = kind(v)
            else:
                items = list(container[key])
                items[index] = kind(v)
                container[key] = type(container[key])(items)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _collect_number(container: Any, key: Any, value: Any, out: list) -> None:
    if _is_number(value):
        out.append((container, key, type(value), -1))
    elif isinstance(value, tuple) and value and all(_is_number(v) for v in value):
        out.extend((container, key, type(v), i) for i, v in enumerate(value))


def _value_of(container: Any, key: Any, index: int) -> float:
    v = container[key]
    return float(v if index < 0 else v[index])
