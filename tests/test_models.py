"""Models built from `_target_` nodes: the runtime-argument contract, seeded init, meta-device sizing."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from bfexp.data import Digits, Synthetic
from bfexp.errors import ConfigError
from bfexp.models import MLP, ResNet50, build_model, parameter_count, sample_shape

RESNET50 = {"_target_": "bfexp.models.ResNet50", "channels": 3, "image_size": 224}


class TakesClasses(nn.Module):
    """A user's model that names only `classes` (its input is sized lazily)."""

    def __init__(self, classes: int, width: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.LazyLinear(width), nn.BatchNorm1d(width), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class TakesEverything(nn.Module):
    """A user's model with **kwargs: it is handed every runtime argument."""

    def __init__(self, scale: float = 1.0, **runtime) -> None:
        super().__init__()
        self.runtime = runtime
        self.linear = nn.Linear(runtime["in_features"], runtime["classes"])


class WiderMLP(MLP):
    """A user's subclass of a built-in model: one option of its own, the rest forwarded."""

    def __init__(self, extra: int = 2, **options) -> None:
        super().__init__(**options, hidden=(extra,))


class ResNet50WithDropout(ResNet50):
    """A user's ResNet-50 variant: its own option must not reach the inherited input_spec."""

    def __init__(self, dropout: float = 0.0, **options) -> None:
        super().__init__(**options)


def not_a_module(classes: int) -> int:
    return classes


def test_default_init_drawn_from_the_seeded_generator():
    """Weights are PyTorch's default Linear init, drawn in module order from Generator(seed)."""
    model = build_model({"_target_": "bfexp.models.MLP", "hidden": [6]}, (2, 2), 3, seed=11, dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    want = []
    for fan_out, fan_in in [(6, 4), (3, 6)]:
        w = torch.empty(fan_out, fan_in)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
        b = torch.empty(fan_out).uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in), generator=g)
        want += [w, b]
    got = list(model.parameters())
    assert all(p.dtype == torch.float64 for p in got)
    for p, w in zip(got, want, strict=True):
        assert torch.equal(p, w.to(torch.float64))


def test_same_seed_same_model_whatever_the_global_rng():
    """Virtual ranks in threads share torch's global RNG: the weights must not depend on it."""
    node = OmegaConf.create({"_target_": "bfexp.models.CNN", "channels": [4, 8], "hidden": 16})
    torch.manual_seed(1)
    a = build_model(node, (1, 8, 8), 10, seed=3)
    torch.manual_seed(2)
    b = build_model(node, (1, 8, 8), 10, seed=3)
    c = build_model(node, (1, 8, 8), 10, seed=4)
    pa, pb, pc = (torch.cat([p.reshape(-1) for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_user_model_gets_only_the_runtime_arguments_it_names():
    model = build_model({"_target_": "tests.test_models.TakesClasses", "width": 6}, (3, 4), 5, seed=0)
    # The lazy layers' dry run (one zero sample) runs in eval mode: batch norm accepts it and
    # keeps no statistics of it, and the model comes back in training mode.
    assert model.training and model.body[2].num_batches_tracked == 0
    assert model(torch.zeros(2, 3, 4)).shape == (2, 5)
    assert model.body[1].weight.shape == (6, 12)
    count = parameter_count({"_target_": "tests.test_models.TakesClasses", "width": 6}, (3, 4), 5)
    assert count == (6 * 12 + 6) + 2 * 6 + (5 * 6 + 5)  # lazy linear, batch norm, head


def test_user_model_with_kwargs_gets_every_runtime_argument():
    model = build_model({"_target_": "tests.test_models.TakesEverything", "scale": 2.0}, (2, 3), 4, seed=0)
    assert model.runtime == {"in_shape": (2, 3), "in_features": 6, "classes": 4}


def test_subclass_forwarding_kwargs_gets_what_its_base_names():
    """**options forwarded to MLP: bfexp passes in_shape and classes (MLP's), not in_features."""
    model = build_model({"_target_": "tests.test_models.WiderMLP", "extra": 3}, (4,), 2, seed=0)
    assert [tuple(p.shape) for p in model.parameters()] == [(3, 4), (3,), (2, 3), (2,)]


def test_a_target_that_returns_no_module_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\._target_='tests\.test_models\.not_a_module' returned int; allowed:"):
        build_model({"_target_": "tests.test_models.not_a_module"}, (3,), 2, seed=0)


@pytest.mark.parametrize("node, message", [
    ({"_target_": "bfexp.models.MLP", "hidden": [8, 0]}, "model.hidden=[8, 0]; allowed: a list of integers >= 1"),
    ({"_target_": "bfexp.models.MLP", "activation": "sigmoid"}, "model.activation='sigmoid'; allowed: relu, tanh, gelu"),
    ({"_target_": "bfexp.models.CNN", "channels": []}, "model.channels=[]; allowed: a non-empty list of integers >= 1"),
    ({"_target_": "bfexp.models.CNN", "hidden": 0}, "model.hidden=0; allowed: an integer >= 1"),
    ({**RESNET50, "channels": 0}, "model.channels=0; allowed: an integer >= 1"),
])
def test_out_of_range_model_options_name_the_key(node, message):
    with pytest.raises(ConfigError) as err:
        build_model(node, (64,), 10, seed=0)
    assert str(err.value) == message


def test_resnet50_size_on_meta_device_and_forward():
    # Throughput-only sizes ResNet-50 for ImageNet whatever the data set (its input_spec) ...
    shape, classes = sample_shape(RESNET50, Synthetic())
    assert (shape, classes) == ((3, 224, 224), 1000)
    variant = {"_target_": "tests.test_models.ResNet50WithDropout", "dropout": 0.1, "image_size": 64}
    assert sample_shape(variant, Synthetic()) == ((3, 64, 64), 1000)
    # ... and torchvision's ResNet-50 has 25,557,032 parameters (its documented size).
    assert parameter_count(RESNET50, shape, classes) == 25_557_032
    model = build_model(RESNET50, (3 * 32 * 32,), 10, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032 - 2048 * 990 - 990
    out = model(torch.zeros(2, 3 * 32 * 32))
    assert out.shape == (2, 10)
    with pytest.raises(ValueError, match="model=resnet50 needs square images"):
        build_model(RESNET50, (10,), 2, seed=0)


def test_models_without_input_spec_are_sized_from_the_dataset():
    mlp = {"_target_": "bfexp.models.MLP", "hidden": [32]}
    shape, classes = sample_shape(mlp, Digits())
    assert (shape, classes) == ((64,), 10)
    assert parameter_count(mlp, shape, classes) == 64 * 32 + 32 + 32 * 10 + 10
    cnn = {"_target_": "bfexp.models.CNN", "channels": [16, 32], "hidden": 128}
    # digits as 1x8x8: conv 1->16 (3x3), pool -> 4x4, conv 16->32, pool -> 2x2, 128 features -> 128 -> 10
    want = (16 * 9 + 16) + (32 * 16 * 9 + 32) + (128 * 128 + 128) + (128 * 10 + 10)
    assert parameter_count(cnn, (64,), 10) == want


@pytest.mark.parametrize("shape, channels, by_hand", [
    # conv 1->16 (3x3+bias), conv 16->32, linear 32*7*7 -> 128, linear 128 -> 10
    ((1, 28, 28), (16, 32), (1 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (32 * 7 * 7 * 128 + 128) + (128 * 10 + 10)),
    # CIFAR-sized: 3 channels in, 8x8 after two pools
    ((3, 32, 32), (16, 32), (3 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (32 * 8 * 8 * 128 + 128) + (128 * 10 + 10)),
    # a flat square sample (digits' 64 features) is one 8x8 channel
    ((64,), (8,), (1 * 8 * 9 + 8) + (8 * 4 * 4 * 128 + 128) + (128 * 10 + 10)),
    # odd sides floor at each pool: 30x17 -> 3x2 after three
    ((3, 30, 17), (4, 8, 16), (3 * 4 * 9 + 4) + (4 * 8 * 9 + 8) + (8 * 16 * 9 + 16) + (16 * 3 * 2 * 128 + 128)
     + (128 * 10 + 10)),
])
def test_cnn_is_sized_from_the_sample_shape_without_lazy_layers(shape, channels, by_hand):
    """The cnn knows its sizes from in_shape: no lazy layer, so the driver sizes it on the meta device
    without a forward pass; the count equals the layers' by hand and a batch runs through."""
    node = OmegaConf.create({"_target_": "bfexp.models.CNN", "channels": list(channels)})
    model = build_model(node, shape, 10, seed=0)
    assert not any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules())
    assert parameter_count(node, shape, 10) == sum(p.numel() for p in model.parameters()) == by_hand
    assert model(torch.rand(2, *shape)).shape == (2, 10)


def test_check_fits_answers_again_from_memory_and_asks_again_for_another_class(tmp_path, monkeypatch):
    """A sweep's jobs share their model: the second check is the first's answer (a count, or the same refusal);
    the same options under a class imported again (a user's module edited between commands) are checked anew."""
    import importlib
    import sys

    from bfexp import models

    def module(width: int) -> None:
        (tmp_path / "fitmod.py").write_text(
            "from torch import nn\n"
            f"class Net(nn.Sequential):\n    def __init__(self, in_features, classes):\n"
            f"        super().__init__(nn.Linear(in_features, {width}), nn.Linear({width}, classes))\n"
            "class Three(nn.Linear):\n    def __init__(self, in_features, classes):\n"
            "        super().__init__(in_features, 3)\n")
        sys.modules.pop("fitmod", None)
        importlib.invalidate_caches()

    monkeypatch.syspath_prepend(str(tmp_path))
    node = OmegaConf.create({"_target_": "fitmod.Net"})
    module(3)
    counted = (4 * 3 + 3) + (3 * 2 + 2)
    assert models.check_fits(node, (4,), 2) == counted
    calls = []
    monkeypatch.setattr(models, "_check_fits", lambda *a: calls.append(a) or 0)
    assert models.check_fits(node, (4,), 2) == counted and calls == []  # from memory
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))
    module(5)
    assert models.check_fits(node, (4,), 2) == (4 * 5 + 5) + (5 * 2 + 2)  # another class: checked again
    refused = OmegaConf.create({"_target_": "fitmod.Three"})
    for _ in range(2):  # 3 scores for 2 classes: the same one line both times
        with pytest.raises(ConfigError, match=r"gives outputs of shape \(2, 3\) .* allowed: \(batch, classes\)"):
            models.check_fits(refused, (4,), 2)


def test_resnet50s_forward_is_counted_within_5_percent_of_its_published_flop():
    """ResNet-50 at 224x224: 4.1 G multiply-adds a sample (He et al. 2016, table 1: 3.8 G; 4.1 G for v1.5,
    NVIDIA DeepLearningExamples), 8.2 GFLOP at 2 FLOP each; counted on torch's meta device in the plan's
    check, so nothing of its 25.6 M parameters is allocated."""
    from bfexp import models

    node = OmegaConf.create({"_target_": "bfexp.models.ResNet50", "channels": 3, "image_size": 224})
    flop = models.forward_flop_per_sample(node, (3, 224, 224), 1000)
    assert abs(flop / 8.2e9 - 1) < 0.05, flop
    assert models.check_fits(node, (3, 224, 224), 1000) == 25_557_032  # torchvision's resnet50: 25,557,032
