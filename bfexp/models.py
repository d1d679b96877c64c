"""The model zoo, and how a model config becomes an initialized nn.Module.

A model option is a YAML whose ``_target_`` names a callable returning an
nn.Module: a class below, or a user's own (``model._target_=mypkg.Net``, or a
YAML in their own config dir). Its keyword parameters are the options. bfexp
adds what only the data knows, and only those the signature names (a class's
``**kwargs`` forwarded to its base count the base's names; all three if the
chain ends open):

* ``in_shape``: one sample's shape, e.g. (1, 28, 28) or (32,);
* ``in_features``: the product of ``in_shape``;
* ``classes``: the number of labels.

``build_model`` materializes lazily sized layers on a zero batch, then draws
every weight from one explicit torch.Generator seeded with the run's seed, so
no weight depends on torch's global RNG (which virtual ranks in threads
share): every rank and every engine starts from the same numbers.

Throughput-only jobs size a model without loading data (``sample_shape``): a
model class may declare ``input_spec(**options) -> (in_shape, classes)``
(ResNet-50 declares ImageNet's); otherwise the dataset's ``sample_shape()``
says. ``parameter_count`` builds on torch's meta device: shapes, no memory.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Literal, Sequence, get_args

import torch
from torch import nn

from bfexp import config
from bfexp.data import Dataset
from bfexp.errors import ConfigError, number_in

__all__ = ["CNN", "LogReg", "MLP", "ResNet50", "build_model", "check_fits", "initialize", "parameter_count",
           "sample_shape"]

Activation = Literal["relu", "tanh", "gelu"]
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def _widths(key: str, values: Sequence[int], nonempty: bool = False) -> list[int]:
    """Layer widths from config, each an integer >= 1 (ConfigError otherwise)."""
    widths = list(values)
    if (nonempty and not widths) or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ConfigError(f"{key}={widths}; allowed: a {'non-empty ' if nonempty else ''}list of integers >= 1")
    return widths


# ------------------------------------------------------------------ models
# Each is an nn.Sequential of the same modules, in the same order, as the
# builders they replace, so one seed draws the same weights as before.


class LogReg(nn.Sequential):
    """Multinomial logistic regression: one linear layer on flattened inputs."""

    name: ClassVar[str] = "logreg"

    def __init__(self, in_shape: tuple[int, ...], classes: int) -> None:
        super().__init__(nn.Flatten(), nn.Linear(math.prod(in_shape), classes))


class MLP(nn.Sequential):
    """Multi-layer perceptron on flattened inputs: Linear + activation per hidden width, then a linear head."""

    name: ClassVar[str] = "mlp"

    def __init__(
        self, in_shape: tuple[int, ...], classes: int, hidden: tuple[int, ...] = (64,), activation: Activation = "relu"
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ConfigError(f"model.activation={activation!r}; allowed: {', '.join(get_args(Activation))}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(in_shape)
        for out in _widths("model.hidden", hidden):
            layers += [nn.Linear(width, out), ACTIVATIONS[activation]()]
            width = out
        layers.append(nn.Linear(width, classes))
        super().__init__(*layers)


class CNN(nn.Sequential):
    """LeNet-style: conv-relu-pool blocks, then two linear layers. Needs image input
    (N, C, H, W); flat inputs of a square size (e.g. digits' 64) are viewed as one channel."""

    name: ClassVar[str] = "cnn"

    def __init__(
        self, in_shape: tuple[int, ...], classes: int, channels: tuple[int, ...] = (16, 32), hidden: int = 128
    ) -> None:
        widths = _widths("model.channels", channels, nonempty=True)
        number_in("model.hidden", hidden, low=1, integer=True)
        layers: list[nn.Module] = []
        # Sized from in_shape where it says (C, H, W) or a flat square: no lazy layers, so sizing the model
        # (the driver's dry build, on torch's meta device) runs no forward pass; else by the first batch.
        image = _image_shape(in_shape)
        in_ch = image[0] if image else None
        for out_ch in widths:
            conv = nn.LazyConv2d(out_ch, 3, padding=1) if in_ch is None else nn.Conv2d(in_ch, out_ch, 3, padding=1)
            layers += [conv, nn.ReLU(), nn.MaxPool2d(2)]  # 3x3 padded: H, W kept; the pool halves them
            in_ch = out_ch
        side = (image[1] >> len(widths)) * (image[2] >> len(widths)) if image else 0
        first = nn.Linear(widths[-1] * side, hidden) if side else nn.LazyLinear(hidden)
        super().__init__(_AsImage(math.prod(in_shape)), *layers, nn.Flatten(), first, nn.ReLU(),
                         nn.Linear(hidden, classes))


def _image_shape(in_shape: Sequence[int]) -> tuple[int, int, int] | None:
    """(C, H, W) of a sample shaped (C, H, W), or (1, s, s) of a flat one of s * s features; None otherwise."""
    if len(in_shape) == 3:
        return int(in_shape[0]), int(in_shape[1]), int(in_shape[2])
    side = int(round(math.sqrt(math.prod(in_shape))))
    return (1, side, side) if len(in_shape) == 1 and side * side == in_shape[0] else None


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


class ResNet50(nn.Sequential):
    """ResNet-50 (He et al. 2016): torchvision's when it imports (it does not with
    the CPU torch pinned here, hence the lazy import), the built-in copy otherwise.

    Training uses the data's classes and views flat inputs as square images of
    `channels` channels. `image_size` (and ImageNet's 1000 classes) is what a
    throughput-only job, which loads no data, sizes the model for (`input_spec`).
    """

    name: ClassVar[str] = "resnet50"
    imagenet_classes: ClassVar[int] = 1000

    def __init__(
        self, in_shape: tuple[int, ...], classes: int = 1000, channels: int = 3, image_size: int = 224
    ) -> None:
        number_in("model.channels", channels, low=1, integer=True)
        number_in("model.image_size", image_size, low=1, integer=True)
        in_features = math.prod(in_shape)
        side = math.isqrt(max(1, in_features // channels))
        if channels * side * side != in_features:
            raise ConfigError(
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
        super().__init__(_AsImages(channels), net)

    @classmethod
    def input_spec(cls, channels: int = 3, image_size: int = 224) -> tuple[tuple[int, ...], int]:
        """ImageNet-sized input: what throughput-only sizes ResNet-50 for, with no data loaded."""
        return (channels, image_size, image_size), cls.imagenet_classes


# ------------------------------------------------------------------ config -> model


def _accepted(target: Callable[..., Any]) -> set[str] | None:
    """Keyword names a target takes (through ``**kwargs`` chains to its bases, as the
    driver's check reads them); None when it takes any."""
    params, _, open_ended = config.signature_schema(target)
    return None if open_ended else set(params)


def _construct(node: Any, in_shape: Sequence[int], classes: int) -> nn.Module:
    """Build the node's target (checked against its signature) with the run-time arguments it takes."""
    shape = tuple(int(d) for d in in_shape)
    offered = {"in_shape": shape, "in_features": math.prod(shape), "classes": int(classes)}
    accepted = _accepted(config.target_of(node, "model"))
    if accepted is not None:
        offered = {k: v for k, v in offered.items() if k in accepted}
    model = config.build(node, "model", **offered)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={node['_target_']!r} returned {type(model).__name__}; "
            "allowed: a class or function that returns a torch.nn.Module"
        )
    return model


def _materialize(model: nn.Module, in_shape: Sequence[int]) -> None:
    """Size lazy layers with one zero sample, in eval mode: batch norm accepts a batch
    of one and keeps no statistics of the dummy batch."""
    if not any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules()):
        return
    training = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, *in_shape))
    model.train(training)


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
    node: Any, in_shape: tuple[int, ...], classes: int, seed: int, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The model a config node names (a mapping with `_target_`), identical on every rank for the same seed."""
    model = _construct(node, in_shape, classes)
    _materialize(model, in_shape)
    initialize(model, torch.Generator().manual_seed(seed))
    return model.to(dtype)


def on_meta(node: Any, in_shape: tuple[int, ...], classes: int) -> nn.Module:
    """The model a node names, built on torch's meta device: its layers and shapes, no memory, no compute
    (what the driver inspects before any rank starts)."""
    with torch.device("meta"):
        return _construct(node, in_shape, classes)


def parameter_count(node: Any, in_shape: tuple[int, ...], classes: int) -> int:
    """Parameters of the model a node names, built on torch's meta device: shapes only,
    no memory and no compute, so sizing a 128-rank ResNet-50 study costs nothing."""
    with torch.device("meta"):
        model = _construct(node, in_shape, classes)
        _materialize(model, in_shape)
    return sum(p.numel() for p in model.parameters())


# Up to this many parameters (64 MB in float32) the driver checks a model on the CPU; larger ones on torch's
# meta device. A first forward on the meta device imports torch's decompositions and sympy (about a
# second of CPU, 800 modules) that a small model's forward on two real samples never needs.
CPU_CHECK_PARAMETERS = 16_000_000


@torch.no_grad()
def check_fits(node: Any, in_shape: tuple[int, ...], classes: int, data: str = "the data set") -> int:
    """The driver's check of a model against its data: it has parameters to train, takes a batch of
    ``in_shape`` samples, and gives one score per class. A small model is built and run on two zero
    samples on the CPU; a large one on torch's meta device (shapes, no memory, no compute). Returns its
    parameter count; ConfigError (one line) otherwise, where every rank would raise."""
    what = f"model._target_={node.get('_target_')!r}"
    with torch.device("meta"):  # its size, before anything is allocated (lazy layers are sized below)
        sized = sum(p.numel() for p in _construct(node, in_shape, classes).parameters()
                    if not isinstance(p, nn.parameter.UninitializedParameter))
    with torch.device("cpu" if sized <= CPU_CHECK_PARAMETERS else "meta"):
        model = _construct(node, in_shape, classes)
        try:
            _materialize(model, in_shape)
            out = model(torch.zeros(2, *in_shape))
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{what} cannot take {data}'s samples of shape {tuple(in_shape)}: {first}; "
                              "allowed: a model and data set whose shapes fit") from None
    count = sum(p.numel() for p in model.parameters())
    if count == 0:
        raise ConfigError(f"{what} has no parameters to train; allowed: a model with parameters")
    shape = tuple(getattr(out, "shape", ()))
    if shape != (2, classes):
        raise ConfigError(f"{what} gives outputs of shape {shape} for a batch of 2 samples of {data} "
                          f"({classes} classes); allowed: (batch, classes) = (2, {classes})")
    return count


def sample_shape(model_node: Any, dataset: Dataset) -> tuple[tuple[int, ...], int]:
    """(one sample's shape, classes) to size a model when no data is loaded (throughput-only).

    The model's own `input_spec(**options)` when its class declares one (ResNet-50:
    ImageNet's; it gets the node's options its signature names), else the dataset's
    `sample_shape()`.
    """
    spec = getattr(config.target_of(model_node, "model"), "input_spec", None)
    if spec is not None:
        accepted = _accepted(spec)  # a subclass's own options need not reach its base's input_spec
        options = config.node_options(model_node)
        shape, classes = spec(**{k: v for k, v in options.items() if accepted is None or k in accepted})
        return tuple(int(d) for d in shape), int(classes)
    return dataset.sample_shape()
