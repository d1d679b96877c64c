import numpy as np
import pytest
import torch

from bfexp.data import CIFAR10, MNIST, BatchSampler, Dataset, Digits, Synthetic, digits_table, partition
from bfexp.errors import ConfigError, DatasetError


@pytest.mark.parametrize("how", ["iid", "dirichlet", "sorted"])
def test_partition_covers_every_sample_once(how):
    labels = np.random.default_rng(0).integers(0, 10, size=1000)
    shards = partition(labels, 8, how, 0.5, np.random.default_rng(1))
    joined = np.sort(np.concatenate(shards))
    assert np.array_equal(joined, np.arange(1000))


def test_shared_partition_gives_every_rank_the_whole_set_beyond_the_sample_count():
    """partition=shared: every rank holds all of the training set (so more ranks than samples run), one
    copy for all, and draws its own batches; the other splits refuse that many ranks, naming it."""
    assert all(np.array_equal(s, np.arange(3)) for s in partition(np.zeros(3), 5, "shared", 0.5, None))
    tiny = Digits(partition="shared", test_fraction=0.99)  # 18 training images, 40 ranks
    ranks = tiny.load_ranks(40, seed=0)
    whole = Digits(partition="iid", test_fraction=0.99).load(0, 1, seed=0)  # one rank's split is everything
    assert len(ranks) == 40 and all(r.train_x is ranks[0].train_x for r in ranks)
    assert torch.equal(ranks[0].train_x, whole.train_x) and torch.equal(ranks[0].train_y, whole.train_y)
    assert torch.equal(tiny.load(39, 40, seed=0).train_x, whole.train_x)
    assert not torch.equal(BatchSampler(ranks[0], 4, 0, 0).next()[0], BatchSampler(ranks[1], 4, 0, 1).next()[0])
    with pytest.raises(DatasetError, match="allowed: at most 18, or dataset.partition=shared"):
        Digits(partition="iid", test_fraction=0.99).load(0, 40, seed=0)


def test_dirichlet_small_alpha_skews_labels():
    labels = np.repeat(np.arange(10), 100)
    def top_class_share(how):
        shards = partition(labels, 4, how, 0.1, np.random.default_rng(0))
        return np.mean([np.bincount(labels[s], minlength=10).max() / len(s) for s in shards])

    # iid shards hold each class at about 1/10; skewed ones are dominated by a few classes.
    assert top_class_share("iid") < 0.15
    assert top_class_share("dirichlet") > 0.3


def test_synthetic_is_heterogeneous_and_deterministic():
    ds = Synthetic(partition="iid", alpha=0.5, eval_samples=400,
                   samples_per_rank=300, features=8, classes=2, heterogeneity=1.0, label_noise=0.0)
    a0 = ds.load(0, 4, seed=3)
    a0_again = ds.load(0, 4, seed=3)
    a1 = ds.load(1, 4, seed=3)
    assert np.array_equal(a0.train_x.numpy(), a0_again.train_x.numpy())
    assert np.array_equal(a0.test_x.numpy(), a1.test_x.numpy()), "every rank evaluates on one held-out set"
    # Different ranks draw from different input distributions (non-iid).
    assert np.linalg.norm(a0.train_x.mean(0).numpy() - a1.train_x.mean(0).numpy()) > 0.5


def test_digits_split_by_rank():
    ds = Digits(partition="iid", alpha=0.5, eval_samples=0, test_fraction=0.2)
    shards = [ds.load(r, 3, seed=0) for r in range(3)]
    assert sum(len(s.train_y) for s in shards) == shards[0].global_train_size == 1797 - 359
    assert shards[0].in_features == 64 and shards[0].classes == 10


def test_sampler_reshuffles_each_epoch():
    data = Digits(partition="iid", alpha=0.5, eval_samples=0, test_fraction=0.2).load(0, 4, seed=0)
    sampler = BatchSampler(data, 32, seed=0, rank=0)
    seen = [sampler.next()[1] for _ in range(sampler.steps_per_epoch)]
    assert sampler.epoch == 0
    sampler.next()
    assert sampler.epoch == 1
    assert sum(len(s) for s in seen) == sampler.steps_per_epoch * 32


def test_mnist_loader_reads_idx_files(tmp_path):
    from tests.conftest import write_mnist

    arrays = write_mnist(tmp_path / "m", train=60, test=20)
    ds = MNIST(root=str(tmp_path / "m"), partition="iid", alpha=0.5, eval_samples=0)
    shards = [ds.load(r, 2, seed=0) for r in range(2)]
    x = np.concatenate([s.train_x.numpy() for s in shards])
    assert x.shape == (60, 1, 28, 28) and shards[0].global_train_size == 60
    # Every training image arrives scaled to [0, 1], each exactly once.
    want = np.sort(arrays["train-images-idx3-ubyte"].reshape(60, -1).sum(1) / 255.0)
    np.testing.assert_allclose(np.sort(x.reshape(60, -1).sum(1)), want, rtol=1e-5)
    np.testing.assert_array_equal(shards[0].test_y.numpy(), arrays["t10k-labels-idx1-ubyte"])
    # Laid out channels-last (the channel's stride is 1), which CPU convolutions run faster on.
    assert shards[0].train_x.stride() == (784, 1, 28, 1) and shards[0].test_x.stride() == (784, 1, 28, 1)


def test_cifar10_loader_reads_pickle_batches(tmp_path):
    from tests.conftest import write_cifar10

    batches = write_cifar10(tmp_path / "c", per_batch=10)
    data = CIFAR10(root=str(tmp_path / "c"), partition="iid", alpha=0.5, eval_samples=0).load(0, 1, seed=0)
    assert data.train_x.shape == (50, 3, 32, 32) and data.test_x.shape == (10, 3, 32, 32)
    raw = batches["test_batch"][b"data"][0].reshape(3, 32, 32) / 255.0
    mean = np.array([0.4914, 0.4822, 0.4465])[:, None, None]
    std = np.array([0.2470, 0.2435, 0.2616])[:, None, None]
    np.testing.assert_allclose(data.test_x[0].numpy(), (raw - mean) / std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(data.test_x[3].numpy(), (batches["test_batch"][b"data"][3].reshape(3, 32, 32) / 255.0
                                                        - mean) / std, rtol=1e-5, atol=1e-5)
    assert data.train_x.is_contiguous(memory_format=torch.channels_last) and data.train_x.stride()[1] == 1


def test_missing_dataset_files_exit_2(bfexp, tmp_path):
    proc = bfexp("dataset=mnist", f"dataset.root={tmp_path}/nothing", "hydra.run.dir=run")
    assert proc.returncode == 2
    assert "dataset.root=" in proc.stderr and "train-images-idx3-ubyte" in proc.stderr


def test_missing_files_are_found_when_the_dataset_is_built(tmp_path):
    """The driver builds the dataset before any rank starts: the check costs no load."""
    with pytest.raises(DatasetError, match=r"dataset\.root=.* lacks train-images-idx3-ubyte, .*t10k-labels-idx1-ubyte"):
        MNIST(root=str(tmp_path / "nothing"))
    with pytest.raises(DatasetError, match="lacks data_batch_1, .*test_batch"):
        CIFAR10(root=str(tmp_path / "nothing"))


@pytest.mark.parametrize("build, key", [
    (lambda: Digits(alpha=0.0), "dataset.alpha=0.0"),
    (lambda: Digits(alpha=float("inf")), "dataset.alpha=inf"),
    (lambda: Digits(partition="random"), "dataset.partition='random'"),
    (lambda: Digits(eval_samples=-1), "dataset.eval_samples=-1"),
    (lambda: Digits(test_fraction=1.0), "dataset.test_fraction=1.0"),
    (lambda: Synthetic(classes=1), "dataset.classes=1"),
    (lambda: Synthetic(features=0), "dataset.features=0"),
    (lambda: Synthetic(samples_per_rank=0), "dataset.samples_per_rank=0"),
    (lambda: Synthetic(label_noise=1.5), "dataset.label_noise=1.5"),
    (lambda: Synthetic(heterogeneity=-1.0), "dataset.heterogeneity=-1.0"),
])
def test_out_of_range_options_name_the_key_and_what_is_allowed(build, key):
    with pytest.raises(ConfigError) as err:
        build()
    message = str(err.value)
    assert message.startswith(key + ";") and "allowed:" in message and "\n" not in message


def test_more_ranks_than_samples_or_empty_dirichlet_shards_are_dataset_errors():
    tiny = Digits(partition="iid", test_fraction=0.99)  # 18 training images
    with pytest.raises(DatasetError, match="ranks=19 exceeds the 18 training samples; allowed: at most 18"):
        tiny.load(0, 19, seed=0)
    with pytest.raises(DatasetError, match=r"dataset\.alpha=0\.001 leaves some of 16 ranks"):
        Digits(partition="dirichlet", alpha=0.001).load(0, 16, seed=0)


class Blobs(Dataset):
    """A user's own data set: only `arrays`; the base partitions and sizes it."""

    def __init__(self, centers: int = 3, **options):
        super().__init__(**options)
        self.centers = centers

    def arrays(self, seed):
        rng = np.random.default_rng(seed)
        y = np.arange(120) % self.centers
        x = rng.normal(size=(120, 2, 3)) + y[:, None, None]
        return x[:100], y[:100], x[100:], y[100:], self.centers


def test_user_dataset_gets_partitioning_and_shape_from_the_base():
    ds = Blobs(centers=4, partition="sorted", eval_samples=5)
    shards = [ds.load(r, 4, seed=1) for r in range(4)]
    assert ds.sample_shape() == ((2, 3), 4)
    assert sum(len(s.train_y) for s in shards) == shards[0].global_train_size == 100
    # sorted: each rank holds one contiguous run of labels (25 of each of 4 classes -> one class per rank)
    assert [sorted(set(s.train_y.tolist())) for s in shards] == [[0], [1], [2], [3]]
    assert shards[0].test_x.shape == (5, 2, 3) and shards[0].in_shape == (2, 3)


def test_loaders_and_package_need_no_torchvision():
    """The data sets read their own files, and no extra asks for torchvision (which would let pip replace the
    pinned torch, docs/reference/dependencies.md): bfexp.data imports no torchvision, pyproject names none."""
    import ast
    import tomllib

    from tests.conftest import REPO

    tree = ast.parse((REPO / "bfexp" / "data.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "torchvision" not in imported
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert not [r for r in requirements if r.startswith("torchvision")], requirements


def test_digits_read_from_the_shipped_file_are_scikit_learns_and_import_no_scikit_learn():
    """The table read from the file scikit-learn ships is what load_digits gives, and reading it imports nothing
    of scikit-learn (checked in a fresh interpreter: this one may have imported it already)."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    pixels, labels = digits_table()
    bunch = load_digits()
    assert pixels.shape == (1797, 64) and np.array_equal(pixels, bunch.data)
    assert labels.dtype == np.int64 and np.array_equal(labels, bunch.target)
    probe = ("import sys; from bfexp.data import Digits; Digits().arrays(0); "
             "print(sorted(m for m in sys.modules if m == 'sklearn' or m.startswith('sklearn.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
