"""Same seed, same config: virtual ranks (threads) train exactly like MPI ranks.

Every case runs the worker's real `train` for 50 steps on 5 MPI ranks (one
spawn for all cases) and on 5 threads; each rank's last mini-batch loss and
final parameters must agree to 1e-6. Five ranks is not a power of two, so
the allreduce summation order is really tested.
"""

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from bfexp.cli import group_options
from bfexp.comm.threads import run_threads
from tests.mpi_helpers import run_ranks

RANKS, STEPS, TOL = 5, 50, 1e-6
# case -> overrides; each algorithm on a topology its theory accepts.
CASES = {
    "dsgd": ["algorithm=dsgd", "topology=exp2"],
    "dsgd-dynamic": ["algorithm=dsgd", "topology=one_peer_exp2"],
    "exact_diffusion": ["algorithm=exact_diffusion", "topology=ring"],
    "gradient_tracking": ["algorithm=gradient_tracking", "topology=ring"],
    "push_sum": ["algorithm=push_sum", "topology=exp2", "topology.weights=column"],
    "allreduce": ["algorithm=allreduce"],
}
COMMON = [f"ranks={RANKS}", f"steps={STEPS}", "log_every=10", "optimizer.momentum=0.9"]


def algorithm_of(case: str) -> str:
    return CASES[case][0].split("=")[1]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from bfexp.config import register_configs

    register_configs()
    with initialize_config_module(config_module="bfexp.conf", version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


AVAILABLE = [c for c in CASES if algorithm_of(c) in group_options("algorithm")]

MPI_CODE = """
import json, sys, torch
from pathlib import Path
from omegaconf import OmegaConf
from bfexp.comm.mpi import MPIEngine
from bfexp.worker import train
cases = json.loads(Path(sys.argv[0]).with_name("cases.json").read_text())
out = {}
for case, path in cases.items():
    got = {}
    train(OmegaConf.load(path), MPIEngine(), Path(path).parent / "mpi", inspect=got.update)
    out[case] = {"loss": got["loss"], "parameters": got["parameters"].tolist()}
# Raw allreduce on data whose sum depends on the order of additions.
e = MPIEngine()
g = torch.Generator().manual_seed(11 + e.rank)
x = torch.randn(1000, generator=g) * 10.0 ** (e.rank % 4)
out["blocking_sum_bits"] = e.allreduce(x, op="sum").view(torch.int32).tolist()
out["nonblocking_sum_bits"] = e.iallreduce(x, op="sum").wait().view(torch.int32).tolist()
emit(out)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{engine: [per-rank results]} for every available case, MPI in one spawn."""
    tmp = tmp_path_factory.mktemp("equivalence")
    paths = {}
    for case in AVAILABLE:
        folder = tmp / case
        for engine in ("mpi", "threads"):
            (folder / engine).mkdir(parents=True)
        cfg = compose(CASES[case] + COMMON)
        (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        paths[case] = str(folder / "config.yaml")
    (tmp / "cases.json").write_text(json.dumps(paths))
    # run_ranks writes its script into tmp/, beside cases.json.
    mpi = run_ranks(RANKS, MPI_CODE, tmp, timeout=600, env={"OMP_NUM_THREADS": "1"})

    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # what each MPI rank had
    try:
        threads = [dict() for _ in range(RANKS)]
        for case, path in paths.items():
            def rank_main(engine, case=case, path=path):
                from bfexp.worker import train

                got = {}
                train(OmegaConf.load(path), engine, tmp / case / "threads", inspect=got.update)
                threads[engine.rank][case] = {"loss": got["loss"], "parameters": got["parameters"].tolist()}

            run_threads(RANKS, rank_main)
    finally:
        torch.set_num_threads(saved)
    return {"mpi": mpi, "threads": threads, "dir": tmp}


@pytest.mark.parametrize("case", list(CASES))
def test_threads_train_like_mpi(runs, case):
    if case not in AVAILABLE:
        pytest.skip(f"algorithm={algorithm_of(case)} has no conf/algorithm option yet")
    losses, worst = [], 0.0
    for rank in range(RANKS):
        m, t = runs["mpi"][rank][case], runs["threads"][rank][case]
        assert np.isfinite(m["loss"])
        assert abs(m["loss"] - t["loss"]) <= TOL, (rank, m["loss"], t["loss"])
        diff = np.abs(np.array(m["parameters"]) - np.array(t["parameters"])).max()
        worst = max(worst, diff)
        assert diff <= TOL, f"rank {rank}: parameters differ by {diff:.3g}"
        losses.append(m["loss"])
    # Not vacuous: both engines wrote the same progress records.
    mpi_records = (runs["dir"] / case / "mpi" / "metrics.jsonl").read_text().splitlines()
    thread_records = (runs["dir"] / case / "threads" / "metrics.jsonl").read_text().splitlines()
    assert len(mpi_records) == len(thread_records) == STEPS // 10
    for a, b in zip(map(json.loads, mpi_records), map(json.loads, thread_records)):
        assert abs(a["loss"] - b["loss"]) <= TOL and abs(a["consensus_distance"] - b["consensus_distance"]) <= TOL


def test_allreduce_adds_in_mpi_order(runs):
    """Bit for bit, in Open MPI's orders for 5 ranks: recursive doubling (blocking), binomial tree (nonblocking)."""
    x = []
    for r in range(RANKS):
        g = torch.Generator().manual_seed(11 + r)
        x.append(torch.randn(1000, generator=g) * 10.0 ** (r % 4))
    doubling = ((x[0] + x[1]) + x[2]) + (x[3] + x[4])  # fold 0+1, then a tree over 4 values
    binomial = ((x[0] + x[1]) + (x[2] + x[3])) + x[4]  # pairs, pairs of pairs, then the odd one
    sequential = (((x[0] + x[1]) + x[2]) + x[3]) + x[4]
    assert len({tuple(t.view(torch.int32).tolist()) for t in (doubling, binomial, sequential)}) == 3, \
        "the data must make the order matter"

    def both(engine):
        mine = x[engine.rank].clone()
        return engine.allreduce(mine, op="sum"), engine.iallreduce(mine, op="sum").wait()

    blocking, nonblocking = run_threads(RANKS, both)[0]
    mpi = runs["mpi"][0]
    assert mpi["blocking_sum_bits"] == doubling.view(torch.int32).tolist() == blocking.view(torch.int32).tolist()
    assert mpi["nonblocking_sum_bits"] == binomial.view(torch.int32).tolist() == nonblocking.view(torch.int32).tolist()
