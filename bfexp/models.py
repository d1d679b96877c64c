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


def cnn(in_features: int, classes: int, cfg: Any) -> nn.Module:
    """LeNet-style: conv-relu-pool blocks, then two linear layers. Needs image input
    (N, C, H, W); flat inputs of a square size (e.g. digits' 64) are viewed as one channel."""
    layers: list[nn.Module] = []
    in_ch = None  # inferred from the first batch (1 for MNIST, 3 for CIFAR-10)
    for out_ch in cfg.channels:
        conv = nn.LazyConv2d(out_ch, 3, padding=1) if in_ch is None else nn.Conv2d(in_ch, out_ch, 3, padding=1)
        layers += [conv, nn.ReLU(), nn.MaxPool2d(2)]
        in_ch = out_ch
    return nn.Sequential(_AsImage(in_features), *layers, nn.Flatten(), nn.LazyLinear(cfg.hidden), nn.ReLU(),
                         nn.Linear(cfg.hidden, classes))


class _AsImage(nn.Module):
    """Pass (N, C, H, W) through; view flat square inputs as (N, 1, s, s)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.side = int(round(math.sqrt(in_features)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.side * self.side == x.shape[1]:
            return x.view(x.shape[0], 1, self.side, self.side)
        return x


MODEL_BUILDERS: dict[str, Callable[[int, int, Any], nn.Module]] = {"logreg": logreg, "mlp": mlp, "cnn": cnn}


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


def build_model(
    cfg: Any,
    in_features: int,
    classes: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    in_shape: tuple[int, ...] | None = None,
) -> nn.Module:
    """The model a config names, identical on every rank for the same seed.

    `in_shape` (one sample's shape) lets models with lazily sized layers
    materialize them before initialization; it defaults to (in_features,).
    """
    try:
        builder = MODEL_BUILDERS[cfg.name]
    except KeyError:
        raise ValueError(f"model={cfg.name!r}; allowed: {', '.join(MODEL_BUILDERS)}") from None
    model = builder(in_features, classes, cfg)
    if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules()):
        with torch.no_grad():
            model(torch.zeros(1, *(in_shape or (in_features,))))
    initialize(model, torch.Generator().manual_seed(seed))
    return model.to(dtype)
