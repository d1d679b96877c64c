"""BlueFog's model utilities: broadcast_parameters, allreduce_parameters, broadcast_optimizer_state.

The broadcasts are bfexp's own (bfexp.api), with BlueFog's signatures, so a
BlueFog program and a bfexp script get the same start from the same call.
Tensors of one dtype and device travel as ONE fused message (the engine
fuses a list), so broadcasting a model costs one message per dtype, not
one per parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from bfexp import api
from bfexp.bluefog.ops import initialized_engine


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's tensors with root_rank's, in place (``model.state_dict()``, ``named_parameters()``...)."""
    initialized_engine()  # BlueFog's rule: bf.init() first
    api.broadcast_parameters(params, root=root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state and hyper-parameters root_rank's (bfexp.api.broadcast_optimizer_state:
    root's state_dict as it is; unlike BlueFog, no zero-gradient step first to create state)."""
    initialized_engine()
    api.broadcast_optimizer_state(optimizer, root=root_rank)


def allreduce_parameters(params: Any) -> None:
    """Replace every rank's floating tensors by their average over all ranks, in place."""
    engine = initialized_engine()
    with torch.no_grad():
        for group in api.fused_groups([t for t in api.parameter_tensors(params) if t.is_floating_point()]):
            engine.allreduce_(group, op="avg")
