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
