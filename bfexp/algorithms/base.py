"""What every decentralized optimizer shares.

A DecentralizedOptimizer wraps a local torch optimizer: a plain training
loop (zero_grad, forward, backward, step) becomes decentralized by wrapping
its optimizer. The model's parameters are re-pointed into ONE flat buffer,
so a neighbor exchange of the whole model is a single zero-copy message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from bfexp.comm.engine import Engine
from bfexp.topology import Topology


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
        out = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
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
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)
        offset += n


class DecentralizedOptimizer:
    """step() = the local update plus the communication the rule needs."""

    name: ClassVar[str] = "abstract"
    requires: ClassVar[Requirements] = Requirements()

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine, topology: Topology | None, cfg: Any) -> None:
        self.optimizer = optimizer
        self.engine = engine
        self.topology = topology
        self.cfg = cfg
        self.communication_period = int(cfg.get("communication_period", 1))
        self.params: list[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.flat = flatten_parameters_(self.params)
        self.iteration = 0
        if topology is not None:
            self.check_topology(topology)

    # torch.optim.Optimizer look-alike ---------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = state["iteration"]

    def step(self) -> None:
        raise NotImplementedError

    # shared pieces -------------------------------------------------------
    def communicates_now(self) -> bool:
        """Local SGD: exchange only on every `communication_period`-th step."""
        return (self.iteration + 1) % self.communication_period == 0

    def mixing_weights(self):
        """This rank's row and column of W(t) at the current iteration."""
        return self.topology.weights(self.engine.rank, self.iteration)

    def mix_(self, tensor: torch.Tensor) -> None:
        """tensor <- (W(t) X)_i, in place."""
        w = self.mixing_weights()
        tensor.copy_(self.engine.neighbor_allreduce(tensor, w.self_weight, w.src_weights, list(w.dst_weights)))

    def evaluation_parameters(self) -> torch.Tensor:
        """The flat parameters that represent this rank's model (push-sum overrides: x / w)."""
        return self.flat

    def finish(self) -> None:
        """Complete any communication still in flight."""

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
                raise TopologyMismatch(f"algorithm={cls.name} needs {what}; topology={topology.name} does not give one")

