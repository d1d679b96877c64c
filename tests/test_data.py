import numpy as np
import pytest
from omegaconf import OmegaConf

from bfexp.data import BatchSampler, load_rank_data, partition


@pytest.mark.parametrize("how", ["iid", "dirichlet", "sorted"])
def test_partition_covers_every_sample_once(how):
    labels = np.random.default_rng(0).integers(0, 10, size=1000)
    shards = partition(labels, 8, how, 0.5, np.random.default_rng(1))
    joined = np.sort(np.concatenate(shards))
    assert np.array_equal(joined, np.arange(1000))


def test_dirichlet_small_alpha_skews_labels():
    labels = np.repeat(np.arange(10), 100)
    def top_class_share(how):
        shards = partition(labels, 4, how, 0.1, np.random.default_rng(0))
        return np.mean([np.bincount(labels[s], minlength=10).max() / len(s) for s in shards])

    # iid shards hold each class at about 1/10; skewed ones are dominated by a few classes.
    assert top_class_share("iid") < 0.15
    assert top_class_share("dirichlet") > 0.3


def test_synthetic_is_heterogeneous_and_deterministic():
    cfg = OmegaConf.create(dict(name="synthetic", partition="iid", alpha=0.5, eval_samples=400,
                                samples_per_rank=300, features=8, classes=2, heterogeneity=1.0, label_noise=0.0))
    a0 = load_rank_data(cfg, 0, 4, seed=3)
    a0_again = load_rank_data(cfg, 0, 4, seed=3)
    a1 = load_rank_data(cfg, 1, 4, seed=3)
    assert np.array_equal(a0.train_x.numpy(), a0_again.train_x.numpy())
    assert np.array_equal(a0.test_x.numpy(), a1.test_x.numpy()), "every rank evaluates on one held-out set"
    # Different ranks draw from different input distributions (non-iid).
    assert np.linalg.norm(a0.train_x.mean(0).numpy() - a1.train_x.mean(0).numpy()) > 0.5


def test_digits_split_by_rank():
    cfg = OmegaConf.create(dict(name="digits", partition="iid", alpha=0.5, eval_samples=0, test_fraction=0.2))
    shards = [load_rank_data(cfg, r, 3, seed=0) for r in range(3)]
    assert sum(len(s.train_y) for s in shards) == shards[0].global_train_size == 1797 - 359
    assert shards[0].in_features == 64 and shards[0].classes == 10


def test_sampler_reshuffles_each_epoch():
    cfg = OmegaConf.create(dict(name="digits", partition="iid", alpha=0.5, eval_samples=0, test_fraction=0.2))
    data = load_rank_data(cfg, 0, 4, seed=0)
    sampler = BatchSampler(data, 32, seed=0, rank=0)
    seen = [sampler.next()[1] for _ in range(sampler.steps_per_epoch)]
    assert sampler.epoch == 0
    sampler.next()
    assert sampler.epoch == 1
    assert sum(len(s) for s in seen) == sampler.steps_per_epoch * 32


def test_mnist_loader_reads_idx_files(tmp_path):
    from tests.conftest import write_mnist

    arrays = write_mnist(tmp_path / "m", train=60, test=20)
    cfg = OmegaConf.create(dict(name="mnist", root=str(tmp_path / "m"), partition="iid", alpha=0.5, eval_samples=0))
    shards = [load_rank_data(cfg, r, 2, seed=0) for r in range(2)]
    x = np.concatenate([s.train_x.numpy() for s in shards])
    assert x.shape == (60, 1, 28, 28) and shards[0].global_train_size == 60
    # Every training image arrives scaled to [0, 1], each exactly once.
    want = np.sort(arrays["train-images-idx3-ubyte"].reshape(60, -1).sum(1) / 255.0)
    np.testing.assert_allclose(np.sort(x.reshape(60, -1).sum(1)), want, rtol=1e-5)
    np.testing.assert_array_equal(shards[0].test_y.numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_cifar10_loader_reads_pickle_batches(tmp_path):
    from tests.conftest import write_cifar10

    batches = write_cifar10(tmp_path / "c", per_batch=10)
    cfg = OmegaConf.create(dict(name="cifar10", root=str(tmp_path / "c"), partition="iid", alpha=0.5, eval_samples=0))
    data = load_rank_data(cfg, 0, 1, seed=0)
    assert data.train_x.shape == (50, 3, 32, 32) and data.test_x.shape == (10, 3, 32, 32)
    raw = batches["test_batch"][b"data"][0].reshape(3, 32, 32) / 255.0
    mean = np.array([0.4914, 0.4822, 0.4465])[:, None, None]
    std = np.array([0.2470, 0.2435, 0.2616])[:, None, None]
    np.testing.assert_allclose(data.test_x[0].numpy(), (raw - mean) / std, rtol=1e-5, atol=1e-5)


def test_missing_dataset_files_exit_2(bfexp, tmp_path):
    proc = bfexp("dataset=mnist", f"dataset.root={tmp_path}/nothing", "hydra.run.dir=run")
    assert proc.returncode == 2
    assert "dataset.root=" in proc.stderr and "train-images-idx3-ubyte" in proc.stderr
