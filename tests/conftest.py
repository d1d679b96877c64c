import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BFEXP = [sys.executable, "-m", "bfexp.cli"]

# The suite's processes (three pytest workers, the jobs and ranks they start) outnumber the cores they
# share. torch's OpenMP threads (libgomp) spin while they wait for one another by default, burning the
# core a descheduled peer needs: a 1-rank job's two-thread steps took 40 s instead of 11 s beside two
# busy processes. Passive threads sleep instead. Set here, before this process imports torch; the jobs
# and ranks inherit it. A value the user set stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The longest files first: pytest-xdist (make test: --dist loadfile) hands files out in collection order, so
# a long one collected last runs alone at the end while the other workers wait. Measured on 2 cores, most
# CPU first; the in-process runners (one core each) beside the ones that start ranks.
LONGEST_FIRST = ["test_faults.py", "test_bad_input.py", "test_virtual_ranks_at_scale.py", "test_config_options.py",
                 "test_resume.py", "test_cli_args.py", "test_end_to_end.py", "algorithms/test_least_squares.py",
                 "test_scaling.py", "test_experiments.py", "algorithms/test_efficient_cli.py", "test_cluster.py",
                 "test_user_components.py", "algorithms/test_efficient.py", "test_bfexp_run.py",
                 "topology/test_own_graph_cli.py"]


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file and among the rest stays


def run_bfexp(args: list[str], cwd: Path, timeout: float = 240.0, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in `cwd` (its outputs/ and multirun/ land there)."""
    env = dict(os.environ)
    env.pop("BFEXP_DEBUG", None)
    return subprocess.run(BFEXP + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.fixture
def bfexp(tmp_path):
    def call(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
        return run_bfexp(list(args), tmp_path, timeout=timeout)

    call.cwd = tmp_path
    return call


def write_mnist(root: Path, train: int = 120, test: int = 40, seed: int = 0) -> dict:
    """Tiny MNIST-format idx files (gzipped train, plain test), as LeCun's distribution lays them out."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, size=(train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, size=train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, size=(test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, size=test, dtype=np.uint8),
    }
    for name, a in arrays.items():
        header = bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
        payload = header + a.tobytes()
        if name.startswith("train"):
            with gzip.open(root / f"{name}.gz", "wb") as f:
                f.write(payload)
        else:
            (root / name).write_bytes(payload)
    return arrays


def write_cifar10(root: Path, per_batch: int = 20, seed: int = 0) -> dict:
    """Tiny CIFAR-10 python-format batches (dicts of b'data' uint8 rows and b'labels')."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, size=per_batch).tolist()}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
        batches[name] = batch
    return batches


@pytest.fixture(scope="session", autouse=True)
def reference_cache(tmp_path_factory):
    """Single-rank references cached by the suite's jobs go to a folder of the session's own, not the
    user's ~/.cache/bfexp (a test that needs its own cache sets BFEXP_CACHE_DIR itself)."""
    if "BFEXP_CACHE_DIR" not in os.environ:
        os.environ["BFEXP_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return Path(os.environ["BFEXP_CACHE_DIR"])


@pytest.fixture(scope="session", autouse=True)
def local_image_datasets(tmp_path_factory):
    """Generated MNIST/CIFAR-10 folders, named by env vars the option tests read."""
    base = tmp_path_factory.mktemp("datasets")
    os.environ["BFEXP_TEST_MNIST"] = str(base / "mnist")
    os.environ["BFEXP_TEST_CIFAR10"] = str(base / "cifar10")
    write_mnist(base / "mnist")
    write_cifar10(base / "cifar10")
    return base
