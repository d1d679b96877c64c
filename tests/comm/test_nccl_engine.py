"""engine=nccl: refused with the missing piece named where it cannot run; real NCCL where it can.

The first tests run everywhere (they check what this machine lacks, the way
the CLI does). The rest need CuPy, NCCL and GPUs, skip elsewhere with the
reason, and check results against numpy references of the mixing matrix.
The contract suite (tests/comm/engines.py) runs against nccl as well; the
host-side parts NCCL shares with every engine (declarations, gathered
buffers) are tested in test_declarations.py.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from bfexp.comm.nccl import nccl_available
from bfexp.topology import Exp2
from tests.mpi_helpers import run_ranks

GPU_OK, GPU_REASON = nccl_available(1)
GPUS = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs a GPU with CuPy and NCCL: {GPU_REASON}")
needs_2_gpus = pytest.mark.skipif(GPUS < 2 or not GPU_OK, reason=f"needs 2 GPUs with CuPy and NCCL (this machine: {GPUS}; {GPU_REASON or 'ok'})")

MISSING = ("no cupy", "no NCCL", "no GPU", "fewer GPUs than local ranks")


def test_nccl_available_names_what_is_missing():
    ok, reason = nccl_available(1)
    if importlib.util.find_spec("cupy") is None:
        assert not ok and reason.startswith("no cupy"), reason
        assert "bfexp[cuda12]" in reason and "\n" not in reason
        return
    if GPUS == 0:  # CuPy is here but torch sees no GPU: something below the GPU is missing
        assert not ok and reason.startswith(MISSING), reason
        return
    assert ok and reason == ""
    ok, reason = nccl_available(GPUS + 1)
    assert not ok and reason.startswith("fewer GPUs than local ranks") and f"{GPUS} GPU(s)" in reason
    # The same ranks spread over machines of GPUS ranks each fit.
    assert nccl_available(2 * GPUS, ranks_per_machine=GPUS) == (True, "")


def test_cli_refuses_nccl_where_it_cannot_run(bfexp):
    ranks = GPUS + 1  # more ranks than GPUs: refused on a GPU machine too
    expected = nccl_available(ranks)[1]
    assert expected.startswith(MISSING)
    proc = bfexp("engine=nccl", f"ranks={ranks}", "steps=2", "hydra.run.dir=run")
    assert proc.returncode == 3, proc.stderr  # this machine's fault, not the input's (bfexp.errors.EXIT_ENVIRONMENT)
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"bfexp: error: engine=nccl cannot run here: {expected}"]
    run = bfexp.cwd / "run"
    assert not (run / "logs").exists() and not (run / "metrics.jsonl").exists(), "no rank may start"


# ------------------------------------------------------------------ on GPUs
ONE_RANK = """
import torch
from bfexp.comm.nccl import NCCLEngine, as_cupy
e = NCCLEngine()
r = {}
x = torch.arange(6, dtype=torch.float32, device=e.device) + 1
lst = [x[:2].clone().reshape(2, 1), x[2:].clone()]
out = e.neighbor_allreduce(x, 0.25, {}, [])
r["self_only"] = out.tolist()
r["same_device"] = out.device == x.device
fused = e.neighbor_allreduce(lst, 0.5, {}, [])
r["fused_shapes"] = [list(t.shape) for t in fused]
r["fused"] = torch.cat([t.reshape(-1) for t in fused]).tolist()
r["sum"] = e.allreduce(x, op="sum").tolist()
cpu = torch.tensor([1.0, 2.0], dtype=torch.float64)
avg = e.allreduce(cpu, op="avg")
r["cpu_back_on_cpu"] = avg.device.type == "cpu"
r["cpu_avg"] = avg.tolist()
r["bcast"] = e.broadcast(torch.full((3,), 7, dtype=torch.int64, device=e.device)).tolist()
for dtype in (torch.float16, torch.bfloat16, torch.float64):
    r[str(dtype)] = e.allreduce(torch.ones(5, dtype=dtype, device=e.device), op="avg").tolist()
r["gather"] = e.allgather(x.reshape(3, 2)).tolist()
r["no_sources"] = list(e.neighbor_allgather(x.reshape(3, 2), [], []).shape)
r["hier"] = e.hierarchical_neighbor_allreduce(x.cpu(), 1.0, {}, []).tolist()
h = e.ineighbor_allreduce(x, 1.0, {}, [])
r["handle"] = h.wait().tolist() == x.tolist() and h.done()
e.barrier()
r["zero_copy"] = as_cupy(x).data.ptr == x.data_ptr()
r["comm_time_s"] = e.comm_time_s
e.close()
e.timeline.save()
emit(r)
"""


@needs_gpu
def test_one_rank_ops_on_the_gpu(tmp_path):
    (r,) = run_ranks(1, ONE_RANK, tmp_path, env={"BFEXP_TIMELINE": str(tmp_path / "timeline")})
    trace = json.loads((tmp_path / "timeline" / "rank0.json").read_text())["traceEvents"]
    begun = {ev["name"]: ev["args"]["bytes"] for ev in trace if ev.get("ph") == "b"}
    assert begun["neighbor_allreduce"] == 0 and begun["allreduce"] > 0 and "barrier" in begun
    assert r["comm_time_s"] > 0
    np.testing.assert_allclose(r["self_only"], 0.25 * np.arange(1, 7), rtol=1e-6)
    assert r["same_device"] and r["cpu_back_on_cpu"] and r["handle"] and r["zero_copy"]
    assert r["fused_shapes"] == [[2, 1], [4]]
    np.testing.assert_allclose(r["fused"], 0.5 * np.arange(1, 7), rtol=1e-6)
    np.testing.assert_allclose(r["sum"], np.arange(1, 7), rtol=1e-6)
    assert r["cpu_avg"] == [1.0, 2.0]
    assert r["bcast"] == [7, 7, 7]
    assert r["gather"] == np.arange(1, 7).reshape(3, 2).tolist()
    assert r["no_sources"] == [0, 2]
    assert r["hier"] == list(range(1, 7))
    for dtype in ("torch.float16", "torch.bfloat16", "torch.float64"):
        assert r[dtype] == [1.0] * 5


MANY_RANKS = """
import torch
from bfexp.comm.nccl import NCCLEngine
from bfexp.topology import Exp2
from mpi4py import MPI
n = MPI.COMM_WORLD.Get_size()
e = NCCLEngine(ranks_per_machine=2 if n >= 4 else 1)
e.set_topology(Exp2(e.size))
r = e.rank
x = torch.arange(6, dtype=torch.float64, device=e.device) * (r + 1) + r ** 2
one_round = e.neighbor_allreduce(x)
lst = [x[:2].clone().reshape(2, 1), x[2:].clone()]
fused = torch.cat([t.reshape(-1) for t in e.neighbor_allreduce(lst)])
# push-sum style: the sender scales, the receiver adds with weight 1
w = e.topology.weights(r, 0)
push = e.neighbor_allreduce(x, 0.5, {j: 1.0 for j in w.src_weights}, {k: 0.5 / len(w.dst_weights) for k in w.dst_weights})
handles = [e.ineighbor_allreduce(x * (i + 1)) for i in range(3)]  # several in flight at once
many = [h.wait().tolist() for h in handles]
total = e.allreduce(x.cpu(), op="sum")
b = e.broadcast(torch.full((3,), float(r), device=e.device), root=n - 1)
# first dimensions differ across ranks
rows = torch.full((r + 1, 2), float(r), dtype=torch.float64, device=e.device)
gathered = e.allgather([rows, x[:1]])
nbr = e.neighbor_allgather(x.reshape(2, 3))
M, m = e.machines, e.machine
hier = e.hierarchical_neighbor_allreduce(x, 0.6, {(m - 1) % M: 0.4}, [(m + 1) % M]) if M > 1 else None
e.barrier()
e.close()
emit(dict(x=x.tolist(), one_round=one_round.tolist(), fused=fused.tolist(), push=push.tolist(),
          many=many, total=total.tolist(), bcast=b.tolist(), rows=gathered[0].tolist(), firsts=gathered[1].tolist(),
          nbr=nbr.tolist(), srcs=sorted(e.topology.weights(r, 0).src_weights), machines=M, machine=m,
          hier=None if hier is None else hier.tolist()))
"""


@needs_2_gpus
def test_neighbor_allreduce_on_gpus_equals_W_times_X(tmp_path):
    n = min(GPUS, 4)
    out = run_ranks(n, MANY_RANKS, tmp_path)
    X = np.array([o["x"] for o in out])
    topo = Exp2(n)
    W = topo.mixing_matrix()
    np.testing.assert_allclose([o["one_round"] for o in out], W @ X, rtol=1e-12)
    np.testing.assert_allclose([o["fused"] for o in out], W @ X, rtol=1e-12)
    # Column-stochastic push: A[i, j] = 0.5 / outdeg(j) for each edge j -> i, A[i, i] = 0.5.
    A = 0.5 * np.eye(n)
    for j in range(n):
        dsts = list(topo.weights(j, 0).dst_weights)
        for i in dsts:
            A[i, j] = 0.5 / len(dsts)
    np.testing.assert_allclose([o["push"] for o in out], A @ X, rtol=1e-12)
    for i in range(3):
        np.testing.assert_allclose([o["many"][i] for o in out], W @ X * (i + 1), rtol=1e-12)
    for o in out:
        np.testing.assert_allclose(o["total"], X.sum(0), rtol=1e-12)
        assert o["bcast"] == [float(n - 1)] * 3
        assert o["rows"] == [[float(q)] * 2 for q in range(n) for _ in range(q + 1)]
        assert o["firsts"] == X[:, 0].tolist()
        np.testing.assert_allclose(o["nbr"], np.concatenate([X[q].reshape(2, 3) for q in o["srcs"]]))
    M = out[0]["machines"]
    A = np.array([X[[i for i in range(n) if out[i]["machine"] == m]].mean(0) for m in range(M)])
    Wm = 0.6 * np.eye(M)
    for m in range(M):
        Wm[m, (m - 1) % M] += 0.4
    for i, o in enumerate(out):
        np.testing.assert_allclose(o["hier"], (Wm @ A)[o["machine"]], rtol=1e-12)


@needs_gpu
def test_bfexp_runs_end_to_end_on_nccl(bfexp):
    proc = bfexp("engine=nccl", "ranks=1", "steps=6", "log_every=3", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    summary = json.loads((bfexp.cwd / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["engine"] == "nccl"
