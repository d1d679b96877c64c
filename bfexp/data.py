"""Datasets: classes that own their options, files, shapes and split across ranks.

A dataset option is a YAML whose ``_target_`` names a subclass of
``Dataset``; the constructor's keyword parameters (with its bases') are the
options. Constructing one is cheap: the driver does it before any rank
starts, to check the options and that the files are there. On every rank,
``load(rank, size, seed)`` returns that rank's ``RankData``, and
``sample_shape()`` says (one sample's shape, classes) without training data.

Every rank builds the same global data from the seed and keeps its own
shard, so no rank needs another's files and every engine sees the same
numbers. Nothing is downloaded: MNIST and CIFAR-10 load from a local folder.
"""

from __future__ import annotations

import gzip
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch

from bfexp.errors import ConfigError, DatasetError, number_in

__all__ = ["CIFAR10", "MNIST", "BatchSampler", "Dataset", "Digits", "RankData", "Synthetic", "partition"]

Partition = Literal["iid", "dirichlet", "sorted", "shared"]
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


@dataclass
class RankData:
    """One rank's training shard and the held-out set every rank evaluates on."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int
    global_train_size: int
    tokens: bool = False  # samples are token ids and targets one per position (a language model's data)

    @property
    def in_shape(self) -> tuple[int, ...]:
        """One sample's shape, what bfexp.models.build_model sizes a model from."""
        return tuple(self.train_x.shape[1:])

    @property
    def in_features(self) -> int:
        return int(np.prod(self.train_x.shape[1:]))


# ------------------------------------------------------------------ partitioning


def partition(labels: np.ndarray, size: int, how: str, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each rank's shard.

    iid: a shuffled even split. sorted: contiguous runs of a label-sorted
    order (each rank sees few classes). dirichlet: per class, shares drawn
    from Dir(alpha) (Hsu et al. 2019): small alpha, strong label skew.
    shared: every rank holds the whole set (one array for all) and draws its
    mini-batches from it with its own sampler's stream: the only split with
    more ranks than samples (4096 ranks on digits' 1438 images).
    """
    n = len(labels)
    if how == "shared":
        return [np.arange(n)] * size
    if size > n:
        raise DatasetError(f"ranks={size} exceeds the {n} training samples; allowed: at most {n}, or "
                           "dataset.partition=shared (every rank draws its batches from the whole set)")
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
        raise DatasetError(
            f"dataset.alpha={alpha} leaves some of {size} ranks under {minimum} samples; "
            "allowed: a larger alpha or fewer ranks"
        )
    raise ValueError(f"partition how={how!r}; expected one of {get_args(Partition)}")


def _subsample(x: np.ndarray, y: np.ndarray, limit: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if limit and len(x) > limit:
        keep = np.sort(rng.choice(len(x), size=limit, replace=False))
        return x[keep], y[keep]
    return x, y


# ------------------------------------------------------------------ the contract


class Dataset:
    """Base of every data set, built-in or a user's own.

    A subclass implements ``arrays(seed)``: the whole data set, the same on
    every rank for one seed. The base splits the training part by rank
    (``partition``, ``alpha``) and subsamples the held-out part every rank
    evaluates on (``eval_samples``). A user's own, with no edit to bfexp::

        # mypkg/moons.py
        from typing import Any, ClassVar
        from bfexp.data import Dataset

        class Moons(Dataset):
            name: ClassVar[str] = "moons"     # its label in summaries

            def __init__(self, samples: int = 2000, noise: float = 0.1, **options: Any) -> None:
                super().__init__(**options)    # partition, alpha, eval_samples
                self.samples, self.noise = samples, noise

            def arrays(self, seed: int):
                from sklearn.datasets import make_moons
                x, y = make_moons(self.samples, noise=self.noise, random_state=seed)
                cut = len(y) * 4 // 5
                return x[:cut], y[:cut], x[cut:], y[cut:], 2

        # myconf/dataset/moons.yaml
        _target_: mypkg.moons.Moons
        samples: 2000
        noise: 0.1

        $ bfexp --config-dir myconf dataset=moons dataset.partition=dirichlet

    The constructor must stay cheap (check options, not load data): the driver
    builds the object before any rank starts. Raise bfexp.errors.ConfigError
    (or DatasetError) with ``dataset.<key>=<value>; allowed: ...`` for bad input.
    """

    name: ClassVar[str]
    # Samples are token ids (integers in [0, classes)) with a target per position: a language model's data
    # (bfexp.text.Text). The driver checks the model on token ids, and the summary reports perplexity.
    tokens: ClassVar[bool] = False

    def __init__(self, partition: Partition = "iid", alpha: float = 0.5, eval_samples: int = 2000) -> None:
        if partition not in get_args(Partition):
            raise ConfigError(f"dataset.partition={partition!r}; allowed: {', '.join(get_args(Partition))}")
        number_in("dataset.alpha", alpha, low=0, low_open=True)
        number_in("dataset.eval_samples", eval_samples, low=0, integer=True, note="(0 = all)")
        # How the training set is split by rank; held-out samples every rank evaluates on.
        self.partition, self.alpha, self.eval_samples = partition, alpha, eval_samples

    def arrays(self, seed: int) -> Arrays:
        """(x_train, y_train, x_test, y_test, classes) as numpy arrays: samples along axis 0, integer labels.
        The samples may be stored as they are on disk (e.g. uint8 pixels): ``inputs`` makes them model inputs."""
        raise NotImplementedError(f"{type(self).__name__} must implement arrays(seed) or override load()")

    def inputs(self, x: np.ndarray) -> np.ndarray:
        """Samples as the model takes them (float32), applied to a rank's shard and the held-out set only:
        converting the whole training set in every rank would cost each rank the full data set in float32."""
        return np.ascontiguousarray(x, dtype=np.float32)

    def load(self, rank: int, size: int, seed: int) -> RankData:
        """Rank `rank`'s shard of `size` and the held-out set; the same numbers on every engine for one seed."""
        return self._shards(size, seed, [rank])[0]

    def load_ranks(self, size: int, seed: int) -> list[RankData]:
        """Every rank's ``load``, the data set read and split once (engine=stacked holds all ranks' shards;
        they share one held-out set). A data set that overrides ``load`` alone is loaded rank by rank."""
        if type(self).load is not Dataset.load:
            return [self.load(r, size, seed) for r in range(size)]
        return self._shards(size, seed, range(size))

    def _shards(self, size: int, seed: int, ranks: Any) -> list[RankData]:
        x_train, y_train, x_test, y_test, classes = self.arrays(seed)
        shards = partition(y_train, size, self.partition, self.alpha, np.random.default_rng([seed, 1]))
        x_test, y_test = _subsample(x_test, y_test, self.eval_samples, np.random.default_rng([seed, 2]))
        test_x, test_y = torch.from_numpy(self.inputs(x_test)), torch.from_numpy(y_test.astype(np.int64))
        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # partition=shared: one copy for every rank

        def train(r: int) -> tuple[torch.Tensor, torch.Tensor]:
            key = id(shards[r])
            if key not in made:
                made[key] = (torch.from_numpy(self.inputs(x_train[shards[r]])),
                             torch.from_numpy(y_train[shards[r]].astype(np.int64)))
            return made[key]

        return [RankData(*train(r), test_x, test_y, int(classes), len(y_train)) for r in ranks]

    def sizes(self, size: int, seed: int) -> tuple[list[int], int]:
        """(each rank's training samples, the held-out samples) at ``size`` ranks, what the driver checks
        batch_size and eval_subset against before any rank starts (a split that leaves a rank too few
        samples, a malformed file: DatasetError here, not on every rank). This default loads the arrays."""
        _, y_train, _, y_test, _ = self.arrays(seed)
        shards = partition(y_train, size, self.partition, self.alpha, np.random.default_rng([seed, 1]))
        held_out = min(len(y_test), self.eval_samples) if self.eval_samples else len(y_test)
        return [len(s) for s in shards], held_out

    def sample_shape(self) -> tuple[tuple[int, ...], int]:
        """(one sample's shape, classes), to size a model. This default loads the arrays once;
        a data set that knows its shape says it without loading."""
        x_train, _, _, _, classes = self.arrays(0)
        return tuple(int(d) for d in x_train.shape[1:]), int(classes)


# ------------------------------------------------------------------ built-in data sets


class Synthetic(Dataset):
    """Logistic regression data where rank r's labels come from its own model
    W_r = W_0 + heterogeneity * E_r and its inputs from its own mean shift, so
    the ranks' local optima differ (non-iid). The test set mixes all ranks'
    distributions equally: the global objective's distribution. Each rank
    draws its own shard, so `partition` and `alpha` do not apply;
    eval_samples=0 means 2000."""

    name: ClassVar[str] = "synthetic"

    def __init__(self, samples_per_rank: int = 512, features: int = 32, classes: int = 2,
                 heterogeneity: float = 0.5, label_noise: float = 0.05, **options: Any) -> None:
        super().__init__(**options)
        number_in("dataset.samples_per_rank", samples_per_rank, low=1, integer=True)
        number_in("dataset.features", features, low=1, integer=True)
        number_in("dataset.classes", classes, low=2, integer=True)
        number_in("dataset.heterogeneity", heterogeneity, low=0, note="(0 = iid)")
        number_in("dataset.label_noise", label_noise, low=0, high=1)
        self.samples_per_rank, self.features, self.classes = samples_per_rank, features, classes
        self.heterogeneity, self.label_noise = heterogeneity, label_noise

    def _shards(self, size: int, seed: int, ranks: Any) -> list[RankData]:
        rng = np.random.default_rng([seed, 0])
        d, c = self.features, self.classes
        shared = rng.normal(size=(d, c))
        scale = 1.0 / np.sqrt(d)

        def draw(r: int, count: int, stream: int) -> tuple[np.ndarray, np.ndarray]:
            own = np.random.default_rng([seed, 100 + r])
            w_r = shared + self.heterogeneity * own.normal(size=(d, c))
            shift = self.heterogeneity * own.normal(size=d) * 0.5
            g = np.random.default_rng([seed, 1000 + r, stream])
            x = g.normal(size=(count, d)) + shift
            logits = (x @ w_r) * scale * 4.0
            y = np.argmax(logits + g.gumbel(size=logits.shape), axis=1)
            flip = g.random(count) < self.label_noise
            y[flip] = g.integers(0, c, size=int(flip.sum()))
            return x.astype(np.float32), y

        per_rank_test = max(1, (self.eval_samples or 2000) // size)
        tests = [draw(r, per_rank_test, 1) for r in range(size)]
        test_x = torch.from_numpy(np.concatenate([t[0] for t in tests]))
        test_y = torch.from_numpy(np.concatenate([t[1] for t in tests]).astype(np.int64))
        out = []
        for r in ranks:
            x_train, y_train = draw(r, self.samples_per_rank, 0)
            out.append(RankData(torch.from_numpy(x_train), torch.from_numpy(y_train.astype(np.int64)), test_x,
                                test_y, c, self.samples_per_rank * size))
        return out

    def sizes(self, size: int, seed: int) -> tuple[list[int], int]:
        return [self.samples_per_rank] * size, max(1, (self.eval_samples or 2000) // size) * size

    def sample_shape(self) -> tuple[tuple[int, ...], int]:
        return (self.features,), self.classes


class Digits(Dataset):
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1]."""

    name: ClassVar[str] = "digits"

    def __init__(self, test_fraction: float = 0.2, partition: Partition = "dirichlet", **options: Any) -> None:
        super().__init__(partition=partition, **options)
        number_in("dataset.test_fraction", test_fraction, low=0, high=1, low_open=True, high_open=True)
        self.test_fraction = test_fraction

    def arrays(self, seed: int) -> Arrays:
        pixels, labels = digits_table()
        x = (pixels / 16.0).astype(np.float32)
        y = labels.astype(np.int64)
        order = np.random.default_rng([seed, 3]).permutation(len(y))
        n_test = int(round(self.test_fraction * len(y)))
        test, train = order[:n_test], order[n_test:]
        return x[train], y[train], x[test], y[test], 10

    def sample_shape(self) -> tuple[tuple[int, ...], int]:
        return (64,), 10


def digits_table() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits`` gives them (pixels 0-16, labels), read from the file the package
    ships without importing it: importing scikit-learn costs every rank (and the driver's check) about 2 s of CPU,
    to read a 60 KB table. Where the file is not where scikit-learn 1.x keeps it, ``load_digits`` answers.
    tests/test_data.py holds the two equal."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package; imports nothing
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    table = Path(folders[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if table is not None and table.is_file():
        raw = np.loadtxt(table, delimiter=",")
        return raw[:, :-1], raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target


class _Folder(Dataset):
    """A data set read from `files` in a local folder; the constructor checks they are all there."""

    files: ClassVar[tuple[str, ...]]
    suffixes: ClassVar[tuple[str, ...]] = ("",)  # each file may be stored under any of these endings
    layout: ClassVar[str]  # what the folder holds, for the error message

    def __init__(self, root: str, **options: Any) -> None:
        super().__init__(**options)
        self.root = Path(root).expanduser()
        missing = [name for name in self.files if not self._path(name).exists()]
        if missing:
            raise DatasetError(f"dataset.root={root!r} lacks {', '.join(missing)}; "
                               f"allowed: a folder holding {self.layout} (nothing is downloaded)")

    def _path(self, name: str) -> Path:
        """Where file `name` is stored: the first ending present, else its plain name."""
        candidates = [self.root / f"{name}{s}" for s in self.suffixes]
        return next((p for p in candidates if p.exists()), candidates[0])


def channels_last(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) images laid out channels-last in memory (NHWC, viewed as NCHW: the channel's stride
    is 1). torch's CPU convolutions take their faster path on such input: the default cnn's step on
    MNIST 5.6 -> 3.3 ms and its evaluation ~2x faster here than on NCHW memory."""
    n, c, h, w = x.shape
    out = np.empty((n, h, w, c), dtype=x.dtype)  # not ascontiguousarray: with C = 1 it would keep x's strides
    out[...] = x.transpose(0, 2, 3, 1)
    return out.transpose(0, 3, 1, 2)


def _read_idx(path: Path) -> np.ndarray:
    """An idx file of unsigned bytes (magic 0x00 0x00 0x08 ndim, then ndim big-endian sizes, then the data);
    DatasetError naming the file for anything else (a truncated download, an HTML page, a wrong file)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"dataset file {path} cannot be read: {e}; allowed: an idx file (optionally .gz)") from None
    ndim = data[3] if len(data) >= 4 else 0
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = 4 + 4 * ndim + math.prod(shape)
    if data[:3] != b"\x00\x00\x08" or ndim == 0 or len(data) != expected:
        raise DatasetError(f"dataset file {path} is not an idx file of bytes ({len(data)} bytes"
                           f"{f', header says {expected}' if ndim and data[:3] == bytes([0, 0, 8]) else ''}); "
                           "allowed: MNIST's idx files as distributed (optionally .gz)")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class MNIST(_Folder):
    """MNIST from the four idx files (as distributed by LeCun et al.; optionally .gz) in `root`."""

    name: ClassVar[str] = "mnist"
    files = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    suffixes = ("", ".gz")
    layout = "MNIST's four idx files, optionally .gz"

    def __init__(self, root: str = "data/mnist", **options: Any) -> None:
        super().__init__(root, **options)

    def arrays(self, seed: int) -> Arrays:
        x_tr, y_tr, x_te, y_te = (_read_idx(self._path(name)) for name in self.files)
        for images, labels, (x, y) in zip(self.files[::2], self.files[1::2], ((x_tr, y_tr), (x_te, y_te))):
            if x.ndim != 3 or x.shape[1:] != (28, 28) or y.ndim != 1 or len(x) != len(y):
                raise DatasetError(f"dataset files {self._path(images)} and {self._path(labels)} hold images of "
                                   f"shape {x.shape} and labels of shape {y.shape}; allowed: N images of 28x28 "
                                   "and N labels (MNIST's idx files as distributed)")
        return x_tr[:, None], y_tr.astype(np.int64), x_te[:, None], y_te.astype(np.int64), 10  # uint8 pixels

    def inputs(self, x: np.ndarray) -> np.ndarray:
        return channels_last(x.astype(np.float32) / np.float32(255.0))

    def sample_shape(self) -> tuple[tuple[int, ...], int]:
        return (1, 28, 28), 10


class ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain data (dicts, lists, bytes, numbers) and nothing else.

    CIFAR-10's batches are pickles, and a pickle may name any function to call while it loads: a file that
    names anything but numpy's array reconstruction is refused (pickle.UnpicklingError) before anything of
    it runs. So a data set folder someone shared, or a file swapped into it, runs no code: not in the
    driver's check of the job (which reads the batches to count them), not on the ranks."""

    ALLOWED = frozenset({
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),  # how Python 3 pickles bytes at protocol 2
    })

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a data file may not run")
        return super().find_class(module, name)


class CIFAR10(_Folder):
    """CIFAR-10 from the python pickle batches (cifar-10-batches-py) in `root`, normalized per channel; read by
    ``ArraysOnly``, which builds arrays and runs nothing a file names."""

    name: ClassVar[str] = "cifar10"
    files = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
    layout = "cifar-10-batches-py's data_batch_1..5 and test_batch"
    mean = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)[None, :, None, None]
    std = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)[None, :, None, None]

    def __init__(self, root: str = "data/cifar-10-batches-py", **options: Any) -> None:
        super().__init__(root, **options)

    def _batch(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                batch = ArraysOnly(f, encoding="bytes").load()
            x, y = np.asarray(batch[b"data"]).reshape(-1, 3, 32, 32), np.array(batch[b"labels"], dtype=np.int64)
        except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, IndexError) as e:
            raise DatasetError(f"dataset file {path} is not a CIFAR-10 batch ({type(e).__name__}: {e}); "
                               "allowed: cifar-10-batches-py's pickled batches as distributed") from None
        if len(x) != len(y):
            raise DatasetError(f"dataset file {path} holds {len(x)} images and {len(y)} labels; "
                               "allowed: cifar-10-batches-py's pickled batches as distributed")
        return x, y

    def arrays(self, seed: int) -> Arrays:
        *train_names, test_name = self.files
        parts = [self._batch(name) for name in train_names]
        x_tr = np.concatenate([p[0] for p in parts])
        y_tr = np.concatenate([p[1] for p in parts])
        x_te, y_te = self._batch(test_name)
        return x_tr, y_tr, x_te, y_te, 10  # uint8 pixels

    def inputs(self, x: np.ndarray) -> np.ndarray:
        return channels_last(((x.astype(np.float32) / 255.0 - self.mean) / self.std).astype(np.float32, copy=False))

    def sample_shape(self) -> tuple[tuple[int, ...], int]:
        return (3, 32, 32), 10


# ------------------------------------------------------------------ batches


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
        idx = self.next_indices()
        return self.data.train_x[idx], self.data.train_y[idx]

    def next_indices(self) -> torch.Tensor:
        """The next mini-batch's positions in the shard (what ``next`` returns the samples of)."""
        if self._pos + self.batch_size > len(self._order):
            self._reshuffle()
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx

    def _reshuffle(self) -> None:
        """A new epoch: a new order from the rank's generator, from its start."""
        self.epoch += 1
        self._order = torch.randperm(len(self.data.train_y), generator=self.generator)
        self._pos = 0

    def epoch_progress(self) -> float:
        return self.epoch + self._pos / max(1, len(self._order))

    def state_dict(self) -> dict:
        """Where the sampler is (generator, epoch, order, position): a checkpoint resumes the same batches."""
        return {"generator": self.generator.get_state(), "epoch": self.epoch, "order": self._order.clone(),
                "position": self._pos}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.epoch, self._order, self._pos = int(state["epoch"]), state["order"].clone(), int(state["position"])


class LockstepBatches:
    """BatchSamplers of equally long shards, advanced together: each one's batches are its own
    ``next_indices``, but one step costs a few tensor ops, not a Python call per sampler (engine=stacked
    draws 4096 ranks' batches a step: 80 ms rank by rank). Equal shards and batch sizes keep the samplers
    in lock step (each epoch ends at the same step), so the first one's position is every one's; the
    others' are written back when their state is read (``sync``). Reshuffles, once an epoch, run per
    sampler, from its own generator."""

    def __init__(self, samplers: list[BatchSampler]) -> None:
        lengths = {len(s._order) for s in samplers}
        if len(lengths) != 1 or len({s.batch_size for s in samplers}) != 1:
            raise ValueError("LockstepBatches needs shards of one length; allowed: equally long shards")
        self.samplers = samplers
        self._orders = torch.stack([s._order for s in samplers])

    def next_indices(self) -> torch.Tensor:
        """Every sampler's next mini-batch positions in its shard, ``(samplers, batch)``."""
        first = self.samplers[0]
        if first._pos + first.batch_size > len(first._order):
            for s in self.samplers:
                s._reshuffle()
            self._orders = torch.stack([s._order for s in self.samplers])
        idx = self._orders[:, first._pos : first._pos + first.batch_size]
        first._pos += first.batch_size
        return idx

    def sync(self) -> None:
        """Write the shared position into every sampler (before their state is read)."""
        for s in self.samplers[1:]:
            s._pos = self.samplers[0]._pos

    def reload(self) -> None:
        """After the samplers' state was loaded: take their orders again."""
        self._orders = torch.stack([s._order for s in self.samplers])
