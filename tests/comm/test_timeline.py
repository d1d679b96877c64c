"""Timeline: per-rank Chrome-trace JSON (Perfetto), from scripts (BFEXP_TIMELINE) and from bfexp runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bfexp.timeline import Timeline, merge, span
from tests.comm.engines import REPO
from tests.mpi_helpers import run_ranks


def load(path) -> list[dict]:
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    return trace["traceEvents"]


def async_pairs(events: list[dict]) -> dict[str, list[tuple[dict, dict]]]:
    """Async comm slices by name: (begin, end) pairs matched by id."""
    begins = {e["id"]: e for e in events if e["ph"] == "b"}
    pairs: dict[str, list] = {}
    for e in events:
        if e["ph"] == "e":
            b = begins.pop(e["id"])
            assert b["name"] == e["name"] and e["ts"] >= b["ts"]
            pairs.setdefault(b["name"], []).append((b, e))
    assert not begins, f"async slices never ended: {list(begins.values())[:3]}"
    return pairs


def test_trace_format_and_merge(tmp_path):
    tl = Timeline(tmp_path / "rank3.json", 3)
    with span(tl, "forward"):
        time.sleep(0.001)
    t0 = time.perf_counter()
    token = tl.begin("neighbor_allreduce", t0, 4096, src=[1, 2], dst=[0])
    tl.blocked("wait neighbor_allreduce", t0, time.perf_counter())
    tl.end(token, time.perf_counter())
    with span(None, "nothing"):  # no timeline: a no-op
        pass
    events = load(tl.save())
    assert all(e["pid"] == 3 for e in events)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 3"}
    forward = [e for e in events if e["ph"] == "X" and e["name"] == "forward"]
    assert len(forward) == 1 and forward[0]["dur"] >= 1000  # microseconds
    ((b, e),) = async_pairs(events)["neighbor_allreduce"]
    assert b["args"] == {"bytes": 4096, "src": [1, 2], "dst": [0]} and b["cat"] == "comm"

    Timeline(tmp_path / "rank0.json", 0).save()
    merged = load(merge(tmp_path))
    assert {e["pid"] for e in merged} == {0, 3}
    cli = subprocess.run([sys.executable, "-m", "bfexp.timeline", "merge", str(tmp_path / "none")], capture_output=True, text=True)
    assert cli.returncode == 2 and "no rank*.json" in cli.stderr


SCRIPT = """
import torch
from bfexp.comm.mpi import MPIEngine
from bfexp.topology import Exp2
e = MPIEngine()
e.set_topology(Exp2(e.size))
x = torch.ones(1000)
e.neighbor_allreduce(x)
h = e.iallreduce(x)
h.wait()
e.win_create(x, "w")
e.win_put(None, "w")
e.barrier()
e.win_free()
emit(e.comm_time_s)
"""


def test_env_var_writes_one_trace_per_rank(tmp_path):
    folder = tmp_path / "trace"
    run_ranks(2, SCRIPT, tmp_path, env={"BFEXP_TIMELINE": str(folder), "PYTHONPATH": str(REPO)})
    for rank in range(2):
        events = load(folder / f"rank{rank}.json")
        assert all(e["pid"] == rank for e in events)
        pairs = async_pairs(events)
        ((b, _),) = pairs["neighbor_allreduce"]
        assert b["args"]["bytes"] == 4000 and b["args"]["src"] == [1 - rank] and b["args"]["dst"] == [1 - rank]
        assert pairs["allreduce"][0][0]["args"]["bytes"] == 4000
        assert "win_put" in pairs
        blocked = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "comm_blocked"}
        assert {"neighbor_allreduce", "wait allreduce", "barrier", "win_put", "win_create"} <= blocked


def test_bfexp_run_traces_compute_phases_and_comm(bfexp):
    proc = bfexp("engine=mpi", "engine.timeline=true", "ranks=2", "steps=8", "log_every=4", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in range(2):
        events = load(bfexp.cwd / "run" / "timeline" / f"rank{rank}.json")
        phases = {}
        for e in events:
            if e["ph"] == "X" and e["cat"] == "compute":
                phases.setdefault(e["name"], []).append(e)
        assert {k: len(v) for k, v in phases.items()} == {"forward": 8, "backward": 8, "step": 8}
        comm = [b for pairs in async_pairs(events).values() for b, _ in pairs]
        assert any(b["name"] == "neighbor_allreduce" for b in comm)
        # Each exchange starts inside a compute phase of its step: overlap is visible on the track.
        spans = [(e["ts"], e["ts"] + e["dur"]) for v in phases.values() for e in v]
        inside = [b for b in comm if b["name"] == "neighbor_allreduce" and any(s <= b["ts"] <= t for s, t in spans)]
        assert len(inside) >= 8
