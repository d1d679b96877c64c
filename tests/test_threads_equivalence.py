"""Same seed, same config: virtual ranks (threads) give the MPI engine's numbers.

One spawn of 5 real MPI ranks runs, and 5 threads run the very same code:

* the worker's real `train` for 50 steps of every algorithm: each rank's
  last mini-batch loss and final parameters must agree to 1e-6 (they agree
  to the bit);
* a battery of engine operations on data whose sums depend on the order of
  additions (every dtype, blocking and nonblocking, in place, fused lists,
  per-call and push weights, hierarchical over 5 emulated machines, windows,
  a mismatched declaration): equal bit for bit.

Five ranks is not a power of two, so Open MPI's two allreduce orders differ
and are really tested. The contract suite checks each engine against numpy;
this checks that the engines agree with each other.
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

# Both engines run this: `train_cases(engine, cases)` and `battery(engine)`.
SHARED = '''
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bfexp.comm.engine import CommError
from bfexp.topology import Exp2, OnePeerExp2
from bfexp.worker import run


def train_case(engine, config, run_dir):
    trained = run(OmegaConf.load(config), engine, Path(run_dir))  # a rank's entry: the worker's train
    return {"loss": trained.loss, "parameters": trained.parameters.tolist()}


def bits(t):
    t = t.detach().reshape(-1)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()


def order_input(r):
    g = torch.Generator().manual_seed(11 + r)
    return torch.randn(1000, generator=g) * 10.0 ** (r % 4)


def battery(e):
    r, n = e.rank, e.size
    x = order_input(r)[:300]
    out = {"blocking_sum": bits(e.allreduce(order_input(r), op="sum")),
           "nonblocking_sum": bits(e.iallreduce(order_input(r), op="sum").wait())}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        out[f"allreduce_avg_{dt}"] = bits(e.allreduce(x.to(dt)))
        out[f"iallreduce_sum_{dt}"] = bits(e.iallreduce(x.to(dt), op="sum").wait())
    z = x.clone()
    e.allreduce_(z, op="sum")
    out["allreduce_"] = bits(z)
    z = x.clone()
    e.iallreduce_([z[:100], z[100:]], op="avg").wait()
    out["iallreduce_list"] = bits(z)
    out["allgather"] = bits(e.allgather(x[: r + 1].reshape(-1, 1).repeat(1, 2)))
    out["broadcast"] = bits(e.broadcast(x, root=n - 1))
    e.set_topology(Exp2(n))
    out["nar_static"] = bits(e.neighbor_allreduce(x))
    dyn = OnePeerExp2(n).weights(r, 1)
    out["nar_dynamic"] = bits(e.neighbor_allreduce(x, dyn.self_weight, dyn.src_weights, list(dyn.dst_weights)))
    push = Exp2(n).weights(r)
    dst = {k: 1.0 / (len(push.dst_weights) + 1) for k in push.dst_weights}
    h = e.ineighbor_allreduce([x[:10].clone(), x[10:].clone()], 1.0 / (len(dst) + 1), {j: 1.0 for j in push.src_weights}, dst)
    out["nar_push_list"] = [bits(t) for t in h.wait()]
    z = x.to(torch.bfloat16)
    e.neighbor_allreduce_(z)
    out["nar_inplace_bf16"] = bits(z)
    out["nag"] = bits(e.neighbor_allgather(x[: r + 1]))
    m, M = e.machine, e.machines
    out["hier"] = bits(e.hierarchical_neighbor_allreduce(x, 0.5, {(m - 1) % M: 0.5}, [(m + 1) % M]))
    try:
        e.neighbor_allreduce(x, 1.0, {}, [(r + 1) % n] if r == 0 else [])
    except CommError as exc:
        out["mismatch"] = str(exc)
    out["after_mismatch"] = bits(e.allreduce(x))
    e.win_create(x[:50], "w", src_ranks=list(push.src_weights), dst_ranks=list(push.dst_weights))
    e.win_put(None, "w", 0.5, {k: 0.5 / len(push.dst_weights) for k in push.dst_weights})
    e.barrier()
    e.win_accumulate(x[50:100], "w", None, list(push.dst_weights))
    e.barrier()
    upd = e.win_update("w", 0.25, {j: 0.75 / len(push.src_weights) for j in push.src_weights}, reset=True)
    out["win_update"] = bits(upd) + [e.win_weight("w")]
    e.barrier()
    e.win_get("w", {j: 0.5 for j in push.src_weights})
    e.barrier()  # every rank read its neighbors before any changes its own value
    out["win_get_update"] = bits(e.win_update("w")) + [e.win_weight("w")]
    e.barrier()
    e.win_free("w")
    return out
'''

MPI_CODE = SHARED + '''
import sys
from bfexp.comm.mpi import MPIEngine

cases = json.loads(Path(sys.argv[0]).with_name("cases.json").read_text())
out = {case: train_case(MPIEngine(), path, Path(path).parent / "mpi") for case, path in cases.items()}
out["battery"] = battery(MPIEngine(ranks_per_machine=1))
emit(out)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"mpi": [per rank], "threads": [per rank], "dir": tmp}: every case and the battery, MPI in one spawn."""
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

    shared: dict = {}
    exec(SHARED, shared)  # the very code the MPI ranks ran
    threads: list[dict] = [{} for _ in range(RANKS)]
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # what each MPI rank had
    try:
        for case, path in paths.items():
            def rank_main(engine, case=case, path=path):
                threads[engine.rank][case] = shared["train_case"](engine, path, tmp / case / "threads")

            run_threads(RANKS, rank_main)
        for rank, result in enumerate(run_threads(RANKS, shared["battery"], ranks_per_machine=1)):
            threads[rank]["battery"] = result
    finally:
        torch.set_num_threads(saved)
    return {"mpi": mpi, "threads": threads, "dir": tmp, "shared": shared}


@pytest.mark.parametrize("case", list(CASES))
def test_threads_train_like_mpi(runs, case):
    if case not in AVAILABLE:
        pytest.skip(f"algorithm={algorithm_of(case)} has no conf/algorithm option yet")
    for rank in range(RANKS):
        m, t = runs["mpi"][rank][case], runs["threads"][rank][case]
        assert np.isfinite(m["loss"])
        assert abs(m["loss"] - t["loss"]) <= TOL, (rank, m["loss"], t["loss"])
        diff = np.abs(np.array(m["parameters"]) - np.array(t["parameters"])).max()
        assert diff <= TOL, f"rank {rank}: parameters differ by {diff:.3g}"
    # The runs are not trivial: the ranks' models differ, and both engines logged the same progress.
    params = [np.array(runs["mpi"][r][case]["parameters"]) for r in range(RANKS)]
    if algorithm_of(case) != "allreduce":
        assert max(np.abs(p - params[0]).max() for p in params) > 1e-4
    mpi_records = (runs["dir"] / case / "mpi" / "metrics.jsonl").read_text().splitlines()
    thread_records = (runs["dir"] / case / "threads" / "metrics.jsonl").read_text().splitlines()
    assert len(mpi_records) == len(thread_records) == STEPS // 10
    for a, b in zip(map(json.loads, mpi_records), map(json.loads, thread_records)):
        assert abs(a["loss"] - b["loss"]) <= TOL and abs(a["consensus_distance"] - b["consensus_distance"]) <= TOL


@pytest.mark.parametrize("rank", range(RANKS))
def test_operations_equal_mpi_bit_for_bit(runs, rank):
    mpi, threads = runs["mpi"][rank]["battery"], runs["threads"][rank]["battery"]
    assert set(mpi) == set(threads) and "mismatch" in mpi, "every op ran, and the mismatch raised"
    different = [k for k in mpi if mpi[k] != threads[k]]
    assert not different, f"rank {rank} differs in {different}"


def test_allreduce_adds_in_mpi_orders(runs):
    """Against hand-written orders for 5 ranks: recursive doubling (blocking), binomial tree (nonblocking)."""
    x = [runs["shared"]["order_input"](r) for r in range(RANKS)]
    doubling = ((x[0] + x[1]) + x[2]) + (x[3] + x[4])  # fold 0+1, then a tree over 4 values
    binomial = ((x[0] + x[1]) + (x[2] + x[3])) + x[4]  # pairs, pairs of pairs, then the odd one
    sequential = (((x[0] + x[1]) + x[2]) + x[3]) + x[4]
    bits = runs["shared"]["bits"]
    assert len({tuple(bits(t)) for t in (doubling, binomial, sequential)}) == 3, "the data must make the order matter"
    for engine in ("mpi", "threads"):
        battery = runs[engine][0]["battery"]
        assert battery["blocking_sum"] == bits(doubling), engine
        assert battery["nonblocking_sum"] == bits(binomial), engine
