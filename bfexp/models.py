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


class _Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3 (carrying the stride, as in v1.5), 1x1 expand x4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class _ResNet50(nn.Module):
    """The same modules, names and order as torchvision.models.resnet50, so
    `initialize` draws the same numbers whichever definition is used."""

    def __init__(self, classes: int, channels: int = 3) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._layer(64, 3)
        self.layer2 = self._layer(128, 4, stride=2)
        self.layer3 = self._layer(256, 6, stride=2)
        self.layer4 = self._layer(512, 3, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * _Bottleneck.expansion, classes)

    def _layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        out = planes * _Bottleneck.expansion
        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
        layers = [_Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = out
        layers += [_Bottleneck(out, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _AsImages(nn.Module):
    """View flat inputs as square images of `channels` channels; pass images through."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            side = int(round(math.sqrt(x.shape[1] / self.channels)))
            return x.view(x.shape[0], self.channels, side, side)
        return x


def resnet50(in_features: int, classes: int, cfg: Any) -> nn.Module:
    """ResNet-50: torchvision's when it imports (it does not with the CPU torch
    pinned here, hence the lazy import), the built-in copy otherwise."""
    channels = int(cfg.get("channels", 3))
    side = math.isqrt(max(1, in_features // channels))
    if channels * side * side != in_features:
        raise ValueError(
            f"model=resnet50 needs square images of model.channels={channels} channels; "
            f"got {in_features} input features; allowed: {channels} x s x s (e.g. dataset=cifar10)"
        )
    try:
        from torchvision.models import resnet50 as tv_resnet50

        net = tv_resnet50(weights=None, num_classes=classes)
        if channels != 3:
            net.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    except Exception:  # not installed, or built for another torch
        net = _ResNet50(classes, channels)
    return nn.Sequential(_AsImages(channels), net)


MODEL_BUILDERS: dict[str, Callable[[int, int, Any], nn.Module]] = {
    "logreg": logreg,
    "mlp": mlp,
    "cnn": cnn,
    "resnet50": resnet50,
}


def sample_shape(model_cfg: Any, dataset_cfg: Any) -> tuple[tuple[int, ...], int]:
    """(one sample's shape, classes) without loading data, for sizing a model.

    ResNet-50 declares ImageNet's shape; the built-in data sets have known
    shapes; any other data set is loaded (rank 0 of 1) to find out.
    """
    if model_cfg.name == "resnet50":
        side, channels = int(model_cfg.image_size), int(model_cfg.channels)
        return (channels, side, side), int(model_cfg.classes)
    known = {"digits": ((64,), 10), "mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10)}
    if dataset_cfg.name == "synthetic":
        return (int(dataset_cfg.features),), int(dataset_cfg.classes)
    if dataset_cfg.name in known:
        return known[dataset_cfg.name]
    from bfexp.data import load_rank_data

    data = load_rank_data(dataset_cfg, 0, 1, 0)
    return tuple(data.train_x.shape[1:]), int(data.classes)


def parameter_count(model_cfg: Any, dataset_cfg: Any) -> int:
    """Parameters of the model a config names, built on torch's meta device:
    shapes only, no memory and no compute, so a 128-rank ResNet-50 study costs nothing."""
    shape, classes = sample_shape(model_cfg, dataset_cfg)
    in_features = int(math.prod(shape))
    with torch.device("meta"):
        model = MODEL_BUILDERS[model_cfg.name](in_features, classes, model_cfg)
        if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules()):
            model(torch.zeros(1, *shape))
    return sum(p.numel() for p in model.parameters())


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
