"""The model zoo, and how a model config becomes an initialized nn.Module.

A model option is a YAML whose ``_target_`` names a callable returning an
nn.Module: a class below, or a user's own (``model._target_=mypkg.Net``, or a
YAML in their own config dir). Its keyword parameters are the options. bfexp
adds what only the data knows, and only those the signature names (a class's
``**kwargs`` forwarded to its base count the base's names; all three if the
chain ends open):

* ``in_shape``: one sample's shape, e.g. (1, 28, 28) or (32,);
* ``in_features``: the product of ``in_shape``;
* ``classes``: the number of labels (a language model's vocabulary: one label per token).

A data set of tokens (``Dataset.tokens``, e.g. dataset=text) gives samples of
``block_size`` token ids and one target per position; a model for it (GPT
below) returns scores shaped (batch, positions, classes), and the loss is the
mean cross-entropy over every token.

``build_model`` materializes lazily sized layers on a zero batch, then draws
every weight from one explicit torch.Generator seeded with the run's seed, so
no weight depends on torch's global RNG (which virtual ranks in threads
share): every rank and every engine starts from the same numbers. A model
with its own scheme (GPT) draws it in ``init_weights(generator)``.

Throughput-only jobs size a model without loading data (``sample_shape``): a
model class may declare ``input_spec(**options) -> (in_shape, classes)``
(ResNet-50 declares ImageNet's); otherwise the dataset's ``sample_shape()``
says. ``parameter_count`` builds on torch's meta device: shapes, no memory.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Literal, Sequence, get_args

import torch
import torch.nn.functional as F
from torch import nn

from bfexp import components
from bfexp.data import Dataset
from bfexp.errors import ConfigError, number_in

__all__ = ["CNN", "GPT", "LogReg", "MLP", "ResNet50", "build_model", "check_fits", "initialize", "parameter_count",
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
        super().__init__(AsImage(math.prod(in_shape)), *layers, nn.Flatten(), first, nn.ReLU(),
                         nn.Linear(hidden, classes))


def _image_shape(in_shape: Sequence[int]) -> tuple[int, int, int] | None:
    """(C, H, W) of a sample shaped (C, H, W), or (1, s, s) of a flat one of s * s features; None otherwise."""
    if len(in_shape) == 3:
        return int(in_shape[0]), int(in_shape[1]), int(in_shape[2])
    side = int(round(math.sqrt(math.prod(in_shape))))
    return (1, side, side) if len(in_shape) == 1 and side * side == in_shape[0] else None


class AsImage(nn.Module):
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


# ------------------------------------------------------------------ a language model


class _CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t (torch's fused kernel)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # query, key, value in one product
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class _Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small decoder-only transformer in nanoGPT's shape (Radford et al. 2019; Karpathy's nanoGPT): token and
    position embeddings, ``n_layer`` pre-norm blocks of causal self-attention and an MLP, a final norm, and an
    output layer that shares the token embedding's weights (weight tying).

    Takes (batch, T) token ids, T <= ``block_size``; returns scores (batch, T, classes), one next-token
    distribution per position. ``classes`` (the vocabulary) and, unless set, ``block_size`` come from the data
    set (dataset=text: its vocabulary and its samples' length). ``dropout`` > 0 draws from torch's global RNG,
    which virtual ranks share: keep 0 where runs must repeat bit for bit.
    """

    name: ClassVar[str] = "gpt"
    takes_tokens: ClassVar[bool] = True  # its input is token ids: the driver refuses a data set of features

    def __init__(self, in_shape: tuple[int, ...], classes: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64,
                 block_size: int | None = None, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        for key, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            number_in(f"model.{key}", value, low=1, integer=True)
        number_in("model.dropout", dropout, low=0, high=1, high_open=True)
        if n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd} is not a multiple of model.n_head={n_head}; "
                              "allowed: n_embd divisible by n_head (each head gets n_embd / n_head features)")
        if len(in_shape) != 1:
            raise ConfigError(f"model=gpt takes samples of token ids shaped (block_size,); got {tuple(in_shape)}; "
                              "allowed: a data set of tokens (dataset=text)")
        context = int(in_shape[0])
        if block_size is None:
            block_size = context
        number_in("model.block_size", block_size, low=context, integer=True,
                  note=f"(the data's samples hold {context} tokens; null = that)")
        self.block_size, self.n_layer = block_size, n_layer
        self.wte = nn.Embedding(classes, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(_Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, classes, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds tokens and scores them

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens exceeds model.block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """nanoGPT's init, drawn from ``generator``: N(0, 0.02) weights and embeddings, zero biases, and the
        residual projections scaled by 1/sqrt(2 n_layer) (GPT-2) so the residual stream's variance does not
        grow with depth."""
        residual = 0.02 / math.sqrt(2 * self.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02, generator=generator)
            elif isinstance(module, nn.Linear) and module is not self.lm_head:  # lm_head's weight is wte's
                std = residual if name.endswith(("c_proj", "mlp.2")) else 0.02
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)


# ------------------------------------------------------------------ config -> model


def _accepted(target: Callable[..., Any]) -> set[str] | None:
    """Keyword names a target takes (through ``**kwargs`` chains to its bases, as the
    driver's check reads them); None when it takes any."""
    params, _, open_ended = components.signature_schema(target)
    return None if open_ended else set(params)


def _construct(node: Any, in_shape: Sequence[int], classes: int) -> nn.Module:
    """Build the node's target (checked against its signature) with the run-time arguments it takes."""
    shape = tuple(int(d) for d in in_shape)
    offered = {"in_shape": shape, "in_features": math.prod(shape), "classes": int(classes)}
    accepted = _accepted(components.target_of(node, "model"))
    if accepted is not None:
        offered = {k: v for k, v in offered.items() if k in accepted}
    model = components.build(node, "model", **offered)
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
    generator = torch.Generator().manual_seed(seed)
    own = getattr(model, "init_weights", None)  # a model with its own scheme (GPT's) draws it from the generator
    own(generator) if callable(own) else initialize(model, generator)
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


# check_fits's answers in this process: a sweep's jobs mostly share their model and data (ResNet-50's forward
# on the meta device, torch's decompositions of every layer, costs ~2 s of CPU, once per job before this).
# Keyed by the model's class object itself (a user's module imported again is another class) and its resolved
# options; the value is the parameter count or the refusal's line.
_FITS: dict[tuple, tuple[int, int] | str] = {}  # check_fits's answers: (parameters, forward FLOP a sample)


def check_fits(node: Any, in_shape: tuple[int, ...], classes: int, data: str = "the data set",
               tokens: bool = False) -> int:
    """The driver's check of a model against its data: it has parameters to train, takes a batch of
    ``in_shape`` samples, and gives one score per class (``tokens``: samples are token ids, and a score per
    class at every position). A small model is built and run on two zero samples on the CPU; a large one on
    torch's meta device (shapes, no memory, no compute). Returns its parameter count; ConfigError (one line)
    otherwise, where every rank would raise. Asked again in the same process, it answers from memory."""
    return _fitted(node, in_shape, classes, data, tokens)[0]


def forward_flop_per_sample(node: Any, in_shape: tuple[int, ...], classes: int, data: str = "the data set",
                            tokens: bool = False) -> int:
    """Floating-point operations of one sample's forward pass (a multiply-add counts 2), as torch's
    FlopCounterMode counts them in check_fits's forward (matrix products, convolutions and attention;
    elementwise work is not counted, as in the published figures: ResNet-50 at 224x224, 4.1 G multiply-adds
    = 8.2 GFLOP). What a cost model prices a device's compute with (training: about 3x, backward twice the
    forward). ConfigError as check_fits."""
    return _fitted(node, in_shape, classes, data, tokens)[1]


def _fitted(node: Any, in_shape: tuple[int, ...], classes: int, data: str, tokens: bool) -> tuple[int, int]:
    """check_fits's (parameters, forward FLOP a sample), from this process's memory when asked before."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    key = (components.target_of(node, "model"), repr(plain), tuple(in_shape), int(classes), data, bool(tokens))
    if key not in _FITS:
        try:
            _FITS[key] = _check_fits(node, in_shape, classes, data, tokens)
        except ConfigError as e:
            _FITS[key] = str(e)
    got = _FITS[key]
    if isinstance(got, str):
        raise ConfigError(got)
    return got


@torch.no_grad()
def _check_fits(node: Any, in_shape: tuple[int, ...], classes: int, data: str, tokens: bool) -> tuple[int, int]:
    from torch.utils.flop_counter import FlopCounterMode  # the driver's only (its import: a few ms)

    what = f"model._target_={node.get('_target_')!r}"
    if getattr(components.target_of(node, "model"), "takes_tokens", False) and not tokens:
        raise ConfigError(f"{what} takes token ids; {data} gives samples of features shaped {tuple(in_shape)}; "
                          "allowed: a data set of tokens (dataset=text)")
    with torch.device("meta"):  # its size, before anything is allocated (lazy layers are sized below)
        sized = sum(p.numel() for p in _construct(node, in_shape, classes).parameters()
                    if not isinstance(p, nn.parameter.UninitializedParameter))
    with torch.device("cpu" if sized <= CPU_CHECK_PARAMETERS else "meta"):
        model = _construct(node, in_shape, classes)
        try:
            _materialize(model, in_shape)
            with FlopCounterMode(display=False) as counted:
                out = model(torch.zeros(2, *in_shape, dtype=torch.long if tokens else torch.float32))
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            kind = "token ids" if tokens else "samples"
            raise ConfigError(f"{what} cannot take {data}'s {kind} of shape {tuple(in_shape)}: {first}; "
                              "allowed: a model and data set whose shapes fit") from None
    count = sum(p.numel() for p in model.parameters())
    if count == 0:
        raise ConfigError(f"{what} has no parameters to train; allowed: a model with parameters")
    shape = tuple(getattr(out, "shape", ()))
    expected = (2, *in_shape, classes) if tokens else (2, classes)
    if shape != expected:
        axes = "(batch, positions, classes)" if tokens else "(batch, classes)"
        raise ConfigError(f"{what} gives outputs of shape {shape} for a batch of 2 samples of {data} "
                          f"({classes} classes); allowed: {axes} = {expected}")
    return count, counted.get_total_flops() // 2


def sample_shape(model_node: Any, dataset: Dataset) -> tuple[tuple[int, ...], int]:
    """(one sample's shape, classes) to size a model when no data is loaded (throughput-only).

    The model's own `input_spec(**options)` when its class declares one (ResNet-50:
    ImageNet's; it gets the node's options its signature names), else the dataset's
    `sample_shape()`.
    """
    spec = getattr(components.target_of(model_node, "model"), "input_spec", None)
    if spec is not None:
        accepted = _accepted(spec)  # a subclass's own options need not reach its base's input_spec
        options = components.node_options(model_node)
        shape, classes = spec(**{k: v for k, v in options.items() if accepted is None or k in accepted})
        return tuple(int(d) for d in shape), int(classes)
    return dataset.sample_shape()
