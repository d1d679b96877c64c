"""Engine.bytes_sent: what each op puts on the wire per rank, the same on every engine, counted
from the tensors handed to the engine (so a packed payload counts as packed)."""

from __future__ import annotations

from bfexp.comm.threads import run_threads
from tests.comm.engines import REPO
from tests.mpi_helpers import run_ranks

N = 4

OPS = """
import torch

def ops(engine):
    rank, n = engine.rank, engine.size
    right, left = (rank + 1) % n, (rank - 1) % n
    out = {}

    def delta(name, call):
        before = engine.bytes_sent
        call()
        out[name] = engine.bytes_sent - before

    delta("allreduce", lambda: engine.allreduce(torch.ones(100)))            # 400 bytes
    delta("iallreduce_", lambda: engine.iallreduce_(torch.ones(100)).wait())
    delta("allgather", lambda: engine.allgather(torch.zeros(1, 10, dtype=torch.uint8)))
    delta("broadcast", lambda: engine.broadcast(torch.zeros(4), 0))           # 16 bytes
    delta("barrier", engine.barrier)
    delta("neighbor_allreduce", lambda: engine.neighbor_allreduce(            # 50 float64 to 2 peers
        torch.ones(50, dtype=torch.float64), 0.5, {left: 0.25, right: 0.25}, [left, right]))
    delta("neighbor_allgather", lambda: engine.neighbor_allgather(            # a 7-byte payload to 1 peer
        torch.zeros(1, 7, dtype=torch.uint8), [left], [right]))
    out["total"] = engine.bytes_sent
    return out
"""

EXPECTED = {
    "allreduce": 2 * (N - 1) * 400 // N,  # the ring's volume
    "iallreduce_": 2 * (N - 1) * 400 // N,
    "allgather": (N - 1) * 10,  # each rank's piece goes round
    "broadcast": (N - 1) * 16 // N,
    "barrier": 0,
    "neighbor_allreduce": 2 * 50 * 8,  # the message times its destinations
    "neighbor_allgather": 7,
}


def check(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert {k: v for k, v in got.items() if k != "total"} == EXPECTED, rank
        assert got["total"] == sum(EXPECTED.values())


def ops_from(source: str):
    namespace: dict = {}
    exec(source, namespace)
    return namespace["ops"]


def test_threads_engine_counts_bytes_sent():
    check(run_threads(N, ops_from(OPS), timeout=60))


def test_mpi_engine_counts_bytes_sent(tmp_path):
    code = OPS + "\nfrom bfexp.comm.mpi import MPIEngine\nengine = MPIEngine()\nemit(ops(engine))\nengine.close()\n"
    check(run_ranks(N, code, tmp_path, timeout=120, env={"PYTHONPATH": str(REPO)}))


def test_a_single_rank_sends_nothing():
    alone = OPS.replace("[left, right]", "[]").replace("{left: 0.25, right: 0.25}", "{}").replace("[left], [right]", "[], []")
    [got] = run_threads(1, ops_from(alone), timeout=60)
    assert got["total"] == 0
