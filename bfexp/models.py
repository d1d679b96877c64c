"""A small model zoo. Every model is initialized from an explicit torch.Generator,
never the global RNG, so virtual ranks in threads get the same numbers as MPI ranks."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def logreg(in_features: int, classes: int, cfg: Any) -> nn.Module:
    """Multinomial logistic regression: one linear layer on flattened inputs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, classes))


def mlp(in_features: int, classes: int, cfg: Any) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for hidden in cfg.hidden:
        layers += [nn.Linear(width, hidden), ACTIVATIONS[cfg.activation]()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


MODEL_BUILDERS: dict[str, Callable[[int, int, Any], nn.Module]] = {"logreg": logreg, "mlp": mlp}


@torch.no_grad()
def initialize(model: nn.Module, generator: torch.Generator) -> None:
    """PyTorch's default layer init, drawn from `generator` (same seed -> same model on every engine)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
            if module.bias is not None:
                fan_in = module.weight[0].numel()
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
                nn.init.uniform_(module.bias, -bound, bound, generator=generator)
        elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def build_model(cfg: Any, in_features: int, classes: int, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model a config names, identical on every rank for the same seed."""
    try:
        builder = MODEL_BUILDERS[cfg.name]
    except KeyError:
        raise ValueError(f"model={cfg.name!r}; allowed: {', '.join(MODEL_BUILDERS)}") from None
    model = builder(in_features, classes, cfg)
    initialize(model, torch.Generator().manual_seed(seed))
    return model.to(dtype)
