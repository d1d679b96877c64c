"""Datasets and how they are split across ranks.

Every rank builds the same global data from the seed and keeps its own
shard, so no rank needs another's files and every engine sees the same
numbers. Nothing is downloaded: MNIST and CIFAR-10 load from a local folder.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bfexp.config import DATASET_FILES


@dataclass
class RankData:
    """One rank's training shard and the held-out set every rank evaluates on."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int
    global_train_size: int

    @property
    def in_features(self) -> int:
        return int(np.prod(self.train_x.shape[1:]))


# ------------------------------------------------------------------ partitioning


def partition(labels: np.ndarray, size: int, how: str, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each rank's shard.

    iid: a shuffled even split. sorted: contiguous runs of a label-sorted
    order (each rank sees few classes). dirichlet: per class, shares drawn
    from Dir(alpha) (Hsu et al. 2019): small alpha, strong label skew.
    """
    n = len(labels)
    if size > n:
        raise ValueError(f"ranks={size} exceeds the {n} training samples; allowed: at most {n}")
    if how == "iid":
        return [np.sort(s) for s in np.array_split(rng.permutation(n), size)]
    if how == "sorted":
        order = np.argsort(labels, kind="stable")
        return [np.sort(s) for s in np.array_split(order, size)]
    if how == "dirichlet":
        minimum = min(10, n // size)
        for _ in range(100):
            shards: list[list[int]] = [[] for _ in range(size)]
            for c in np.unique(labels):
                idx = rng.permutation(np.flatnonzero(labels == c))
                shares = rng.dirichlet(np.full(size, alpha))
                cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
                for r, part in enumerate(np.split(idx, cuts)):
                    shards[r].extend(part.tolist())
            if min(len(s) for s in shards) >= minimum:
                return [np.sort(np.array(s, dtype=np.int64)) for s in shards]
        raise ValueError(
            f"dataset.alpha={alpha} leaves some of {size} ranks under {minimum} samples; allowed: a larger alpha or fewer ranks"
        )
    raise ValueError(f"dataset.partition={how!r}; allowed: iid, dirichlet, sorted")


def _subsample(x: np.ndarray, y: np.ndarray, limit: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if limit and len(x) > limit:
        keep = np.sort(rng.choice(len(x), size=limit, replace=False))
        return x[keep], y[keep]
    return x, y


def _to_rank_data(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
    classes: int, cfg: Any, rank: int, size: int, seed: int,
) -> RankData:
    rng = np.random.default_rng([seed, 1])
    shards = partition(y_train, size, cfg.partition, cfg.alpha, rng)
    x_test, y_test = _subsample(x_test, y_test, cfg.eval_samples, np.random.default_rng([seed, 2]))
    mine = shards[rank]
    return RankData(
        torch.from_numpy(np.ascontiguousarray(x_train[mine], dtype=np.float32)),
        torch.from_numpy(y_train[mine].astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(x_test, dtype=np.float32)),
        torch.from_numpy(y_test.astype(np.int64)),
        classes,
        len(y_train),
    )


# ------------------------------------------------------------------ datasets


def synthetic(cfg: Any, rank: int, size: int, seed: int) -> RankData:
    """Logistic regression data where rank r's labels come from its own model
    W_r = W_0 + heterogeneity * E_r and its inputs from its own mean shift, so
    the ranks' local optima differ (non-iid). The test set mixes all ranks'
    distributions equally: the global objective's distribution."""
    rng = np.random.default_rng([seed, 0])
    d, c = cfg.features, cfg.classes
    shared = rng.normal(size=(d, c))
    scale = 1.0 / np.sqrt(d)

    def draw(r: int, count: int, stream: int) -> tuple[np.ndarray, np.ndarray]:
        own = np.random.default_rng([seed, 100 + r])
        w_r = shared + cfg.heterogeneity * own.normal(size=(d, c))
        shift = cfg.heterogeneity * own.normal(size=d) * 0.5
        g = np.random.default_rng([seed, 1000 + r, stream])
        x = g.normal(size=(count, d)) + shift
        logits = (x @ w_r) * scale * 4.0
        y = np.argmax(logits + g.gumbel(size=logits.shape), axis=1)
        flip = g.random(count) < cfg.label_noise
        y[flip] = g.integers(0, c, size=int(flip.sum()))
        return x.astype(np.float32), y

    x_train, y_train = draw(rank, cfg.samples_per_rank, 0)
    per_rank_test = max(1, (cfg.eval_samples or 2000) // size)
    tests = [draw(r, per_rank_test, 1) for r in range(size)]
    x_test = np.concatenate([t[0] for t in tests])
    y_test = np.concatenate([t[1] for t in tests])
    return RankData(
        torch.from_numpy(x_train),
        torch.from_numpy(y_train.astype(np.int64)),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test.astype(np.int64)),
        c,
        cfg.samples_per_rank * size,
    )


def digits(cfg: Any, rank: int, size: int, seed: int) -> RankData:
    """scikit-learn's bundled 8x8 digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng([seed, 3]).permutation(len(y))
    n_test = int(round(cfg.test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return _to_rank_data(x[train], y[train], x[test], y[test], 10, cfg, rank, size, seed)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(root: Path, stem: str) -> Path:
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"dataset.root={str(root)!r} has no {stem}[.gz]; place the MNIST idx files there")


def mnist(cfg: Any, rank: int, size: int, seed: int) -> RankData:
    """MNIST from the four idx files (as distributed by LeCun et al.) in `root`."""
    root = Path(cfg.root).expanduser()
    x_tr, y_tr, x_te, y_te = (_read_idx(_find(root, name)) for name in DATASET_FILES["mnist"])
    x_tr, x_te = x_tr.astype(np.float32) / 255.0, x_te.astype(np.float32) / 255.0
    y_tr, y_te = y_tr.astype(np.int64), y_te.astype(np.int64)
    return _to_rank_data(x_tr[:, None], y_tr, x_te[:, None], y_te, 10, cfg, rank, size, seed)


def cifar10(cfg: Any, rank: int, size: int, seed: int) -> RankData:
    """CIFAR-10 from the python pickle batches (cifar-10-batches-py) in `root`."""
    root = Path(cfg.root).expanduser()

    def load(name: str) -> tuple[np.ndarray, np.ndarray]:
        path = root / name
        if not path.exists():
            raise FileNotFoundError(f"dataset.root={str(root)!r} has no {name}; place cifar-10-batches-py there")
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        return batch[b"data"].reshape(-1, 3, 32, 32), np.array(batch[b"labels"], dtype=np.int64)

    *train_names, test_name = DATASET_FILES["cifar10"]
    parts = [load(name) for name in train_names]
    x_tr = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
    y_tr = np.concatenate([p[1] for p in parts])
    x_te, y_te = load(test_name)
    mean = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)[None, :, None, None]
    std = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)[None, :, None, None]
    return _to_rank_data((x_tr - mean) / std, y_tr, (x_te.astype(np.float32) / 255.0 - mean) / std, y_te, 10, cfg, rank, size, seed)


DATASETS = {"synthetic": synthetic, "digits": digits, "mnist": mnist, "cifar10": cifar10}


def load_rank_data(cfg: Any, rank: int, size: int, seed: int) -> RankData:
    try:
        loader = DATASETS[cfg.name]
    except KeyError:
        raise ValueError(f"dataset={cfg.name!r}; allowed: {', '.join(DATASETS)}") from None
    return loader(cfg, rank, size, seed)


class BatchSampler:
    """Mini-batches from one rank's shard, reshuffled every epoch from the rank's own generator."""

    def __init__(self, data: RankData, batch_size: int, seed: int, rank: int) -> None:
        self.data = data
        self.batch_size = min(batch_size, len(data.train_y))
        self.generator = torch.Generator().manual_seed(seed * 100003 + rank)
        self.epoch = 0
        self._order = torch.randperm(len(data.train_y), generator=self.generator)
        self._pos = 0

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.data.train_y) // self.batch_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pos + self.batch_size > len(self._order):
            self.epoch += 1
            self._order = torch.randperm(len(self.data.train_y), generator=self.generator)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return self.data.train_x[idx], self.data.train_y[idx]

    def epoch_progress(self) -> float:
        return self.epoch + self._pos / max(1, len(self._order))
