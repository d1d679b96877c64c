"""The threads engine gives the MPI engine's numbers, op by op, to the bit.

One battery of operations (random float data whose sums depend on the order
of additions, every dtype, blocking and nonblocking, in place, fused lists,
per-call and push weights, windows, a mismatched declaration) runs on 6 real
MPI ranks (3 emulated machines) and on 6 threads; every result must be equal
bit for bit. The contract suite checks each engine against numpy; this
checks that they agree with each other, as the equivalence of training runs
needs.
"""

import pytest
import torch

from bfexp.comm.threads import run_threads
from tests.mpi_helpers import run_ranks

N, RPM = 6, 3

BATTERY = '''
import torch
from bfexp.comm.engine import CommError
from bfexp.topology import Exp2, OnePeerExp2

def bits(t):
    t = t.detach().reshape(-1)
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4 else torch.int64).tolist()

def battery(e):
    r, n = e.rank, e.size
    g = torch.Generator().manual_seed(7 + r)
    x = torch.randn(300, generator=g) * 10.0 ** (r % 3)
    out = {}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        y = x.to(dt)
        out[f"allreduce_avg_{dt}"] = bits(e.allreduce(y))
        out[f"iallreduce_sum_{dt}"] = bits(e.iallreduce(y, op="sum").wait())
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
    own = e.win_create(x[:50], "w", src_ranks=list(push.src_weights), dst_ranks=list(push.dst_weights))
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

MPI_CODE = BATTERY + f'''
from bfexp.comm.mpi import MPIEngine
emit(battery(MPIEngine(ranks_per_machine={RPM})))
'''


@pytest.fixture(scope="module")
def mpi_results(tmp_path_factory):
    return run_ranks(N, MPI_CODE, tmp_path_factory.mktemp("battery"), timeout=300)


@pytest.fixture(scope="module")
def thread_results():
    namespace: dict = {}
    exec(BATTERY, namespace)  # the very code the MPI ranks ran
    return run_threads(N, namespace["battery"], ranks_per_machine=RPM)


def test_battery_ran_everything(mpi_results, thread_results):
    assert set(mpi_results[0]) == set(thread_results[0])
    assert "mismatch" in mpi_results[0], "the mismatched declaration must raise on MPI too"


@pytest.mark.parametrize("rank", range(N))
def test_threads_equal_mpi_bit_for_bit(mpi_results, thread_results, rank):
    mpi, threads = mpi_results[rank], thread_results[rank]
    different = [k for k in mpi if mpi[k] != threads[k]]
    assert not different, f"rank {rank} differs in {different}"
