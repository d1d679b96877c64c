"""The engine contract as checks every rank runs: ``run_contract(engine) -> {check: result}``.

This module is what the ranks of *any* engine execute (see engines.py for how
each engine runs it). It uses only the Engine API, torch and the topology
package, and returns plain JSON-able results; test_contract.py compares them
with numpy references in the test process. Inputs come from ``rank_input``,
which the references call too: values are multiples of 1/8 in [-2.5, 2.5],
exact in every dtype, so the only error is the op's own rounding.

A check that raises on a rank records ``{"error": ...}`` and the suite goes
on (engines in progress still get every other check); every rank raises the
same way for a missing op, so the ranks stay in step.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import torch

from bfexp.topology import Exp2, OnePeerExp2

SIZES = (1, 2, 3, 4, 8)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
PUSH_SUM_ROUNDS = 40

CHECKS: dict[str, Callable[[Any], Any]] = {}


def check(name: str) -> Callable:
    def register(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        CHECKS[name] = fn
        return fn

    return register


def ranks_per_machine(size: int) -> int:
    """Machines emulated for hierarchical checks: 2 ranks each where the size allows more than one machine."""
    return 2 if size >= 4 else 1


def rank_input(rank: int, numel: int = 7, salt: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank ``rank``'s input: multiples of 1/8 in [-2.5, 2.5] (exact in bfloat16)."""
    i = torch.arange(numel, dtype=torch.float64)
    v = torch.remainder(i * 3 + rank * 5 + salt * 7, 41) / 8 - 2.5
    return v.to(dtype)


def push_out_neighbors(rank: int, size: int) -> list[int]:
    """A directed, strongly connected graph whose out-degrees differ (push-sum weights then matter)."""
    out = {(rank + 1) % size}
    if rank % 2 == 0:
        out.add((rank + 2) % size)
    out.discard(rank)
    return sorted(out)


def push_in_neighbors(rank: int, size: int) -> list[int]:
    return sorted(j for j in range(size) if rank in push_out_neighbors(j, size))


def machine_ring(machine: int, machines: int) -> tuple[float, dict[int, float], list[int]]:
    """Machine-level weights: half own, half from the previous machine; one machine keeps its average."""
    if machines == 1:
        return 1.0, {}, []
    return 0.5, {(machine - 1) % machines: 0.5}, [(machine + 1) % machines]


def ring_peers(rank: int, size: int) -> tuple[list[int], list[int]]:
    """(sources, destinations) of a one-way ring."""
    if size == 1:
        return [], []
    return [(rank - 1) % size], [(rank + 1) % size]


def dump(x: Any) -> Any:
    """Tensors (or lists of them) as {"shape", "values"} in float64."""
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""), "values": x.detach().double().reshape(-1).tolist()}
    if isinstance(x, (list, tuple)):
        return [dump(t) for t in x]
    return x


# ------------------------------------------------------------------ identity and collectives


@check("identity")
def _identity(e) -> Any:
    return {
        "rank": e.rank,
        "size": e.size,
        "local_rank": e.local_rank,
        "local_size": e.local_size,
        "machine": e.machine,
        "machines": e.machines,
    }


@check("allreduce")
def _allreduce(e) -> Any:
    r = e.rank
    res = {}
    for name, dtype in DTYPES.items():
        x = rank_input(r, dtype=dtype)
        before = x.clone()
        res[f"avg_{name}"] = dump(e.allreduce(x, op="avg"))
        res[f"untouched_{name}"] = bool(torch.equal(x, before))
    for name in ("float32", "float64"):
        res[f"sum_{name}"] = dump(e.allreduce(rank_input(r, dtype=DTYPES[name]), op="sum"))
    res["sum_int64"] = dump(e.allreduce(torch.arange(5, dtype=torch.int64) * (r + 1), op="sum"))
    return res


@check("allreduce_list")
def _allreduce_list(e) -> Any:
    x = rank_input(e.rank, numel=11, salt=1)
    parts = [x[:6].clone().view(2, 3), x[6:10].clone(), x[10:].clone().view(1, 1, 1)]
    return dump(e.allreduce(parts, op="avg"))


@check("allreduce_inplace")
def _allreduce_inplace(e) -> Any:
    res = {}
    for name, dtype in DTYPES.items():
        x = rank_input(e.rank, salt=2, dtype=dtype)
        out = e.allreduce_(x, op="avg")
        res[name] = dump(x)
        res[f"returns_input_{name}"] = out is x
    flat = rank_input(e.rank, numel=10, salt=3)
    views = [flat[:4].view(2, 2), flat[4:]]  # back to back in one buffer: fused with no copy
    e.allreduce_(views, op="sum")
    res["adjacent_views"] = dump(flat)
    separate = [rank_input(e.rank, numel=3, salt=4), rank_input(e.rank, numel=2, salt=5)]
    e.allreduce_(separate, op="avg")
    res["separate"] = dump(separate)
    return res


LARGE = (1 << 21) + 5  # 8 MiB of float32 and a little more, split unevenly over ranks
LARGE_SAMPLE = list(range(0, LARGE, 4099)) + [LARGE - 1]


def sample(t: Any) -> dict:
    """A large result by a strided sample of its elements and its float64 sum."""
    flat = t.detach().reshape(-1).double()
    return {"sample": flat[LARGE_SAMPLE].tolist(), "sum": float(flat.sum()), "shape": list(t.shape), "dtype": str(t.dtype)}


@check("allreduce_large")
def _allreduce_large(e) -> Any:
    """Buffers large enough for engines' bandwidth algorithms (e.g. a ring), blocking and not."""
    r = e.rank
    res = {
        "avg_float32": sample(e.allreduce(rank_input(r, LARGE, 40, torch.float32), op="avg")),
        "sum_float64": sample(e.allreduce(rank_input(r, LARGE, 41), op="sum")),
        "avg_bfloat16": sample(e.allreduce(rank_input(r, LARGE, 42, torch.bfloat16), op="avg")),
    }
    x = rank_input(r, LARGE, 43, torch.float32)
    h = e.iallreduce_(x, op="avg")
    h.wait()
    res["nonblocking_inplace"] = sample(x)
    return res


@check("allgather")
def _allgather(e) -> Any:
    r = e.rank
    rows = rank_input(r, numel=2 * (r + 1), salt=6).view(r + 1, 2)  # first dim differs per rank
    res = {"rows": dump(e.allgather(rows))}
    res["bfloat16"] = dump(e.allgather(rows.to(torch.bfloat16)))
    res["list"] = dump(e.allgather([rows, rank_input(r, numel=6, salt=7).view(2, 3)]))
    res["scalar_rows"] = dump(e.allgather(torch.tensor([float(r)])))
    return res


@check("broadcast")
def _broadcast(e) -> Any:
    r, n = e.rank, e.size
    root = n - 1
    x = rank_input(r, salt=8)
    before = x.clone()
    res = {"single": dump(e.broadcast(x, root=root)), "untouched": bool(torch.equal(x, before))}
    res["list"] = dump(e.broadcast([rank_input(r, numel=3, salt=9), rank_input(r, numel=4, salt=10).view(2, 2)], root=0))
    y = rank_input(r, salt=11, dtype=torch.bfloat16)
    e.broadcast_(y, root=root)
    res["inplace_bfloat16"] = dump(y)
    return res


@check("barrier")
def _barrier(e) -> Any:
    e.barrier()
    e.ibarrier().wait()
    return True


# ------------------------------------------------------------------ neighbor ops


@check("neighbor_allreduce_static")
def _nar_static(e) -> Any:
    e.set_topology(Exp2(e.size))
    return {name: dump(e.neighbor_allreduce(rank_input(e.rank, dtype=dtype))) for name, dtype in DTYPES.items()}


@check("neighbor_allreduce_dynamic")
def _nar_dynamic(e) -> Any:
    """Per-call weights of a dynamic topology: receivers weigh, senders give plain lists."""
    topo = OnePeerExp2(e.size)
    res = {}
    for t in range(3):
        w = topo.weights(e.rank, t)
        for name, dtype in DTYPES.items():
            x = rank_input(e.rank, salt=12, dtype=dtype)
            res[f"t{t}_{name}"] = dump(e.neighbor_allreduce(x, w.self_weight, w.src_weights, list(w.dst_weights)))
    return res


@check("neighbor_allreduce_push")
def _nar_push(e) -> Any:
    """Column-stochastic (push-sum) weights: senders scale, receivers add with weight 1."""
    out = push_out_neighbors(e.rank, e.size)
    share = 1.0 / (len(out) + 1)
    ins = push_in_neighbors(e.rank, e.size)
    res = {}
    for name, dtype in DTYPES.items():
        x = rank_input(e.rank, salt=13, dtype=dtype)
        res[name] = dump(e.neighbor_allreduce(x, share, {j: 1.0 for j in ins}, {k: share for k in out}))
    return res


@check("neighbor_allreduce_list")
def _nar_list(e) -> Any:
    e.set_topology(Exp2(e.size))
    x = rank_input(e.rank, numel=9, salt=14)
    parts = [x[:4].clone().view(2, 2), x[4:].clone()]
    res = {"list": dump(e.neighbor_allreduce(parts))}
    flat = x.clone()
    views = [flat[:4].view(2, 2), flat[4:]]
    returned = e.neighbor_allreduce_(views)
    res["inplace_views"] = dump(flat)
    res["inplace_returns_inputs"] = all(a is b for a, b in zip(returned, views))
    y = rank_input(e.rank, salt=15, dtype=torch.float16)
    e.neighbor_allreduce_(y)
    res["inplace_float16"] = dump(y)
    return res


@check("neighbor_allgather")
def _nag(e) -> Any:
    r, n = e.rank, e.size
    e.set_topology(Exp2(n))
    rows = rank_input(r, numel=2 * (r + 1), salt=16).view(r + 1, 2)
    res = {"static": dump(e.neighbor_allgather(rows))}
    src, dst = ring_peers(r, n)
    res["ring_bfloat16"] = dump(e.neighbor_allgather(rows.to(torch.bfloat16), src, dst))
    res["ring_list"] = dump(e.neighbor_allgather([rows, rank_input(r, numel=3, salt=17)], src, dst))
    return res


@check("hierarchical_neighbor_allreduce")
def _hier(e) -> Any:
    sw, src, dst = machine_ring(e.machine, e.machines)
    res = {}
    for name, dtype in DTYPES.items():
        x = rank_input(e.rank, salt=18, dtype=dtype)
        res[name] = dump(e.hierarchical_neighbor_allreduce(x, sw, src, dst))
    y = rank_input(e.rank, salt=19)
    e.hierarchical_neighbor_allreduce_(y, sw, src, dst)
    res["inplace"] = dump(y)
    e.set_machine_topology(Exp2(e.machines))
    res["static_machine_topology"] = dump(e.hierarchical_neighbor_allreduce(rank_input(e.rank, salt=20)))
    return res


# ------------------------------------------------------------------ nonblocking handles


@check("nonblocking")
def _nonblocking(e) -> Any:
    r, n = e.rank, e.size
    e.set_topology(Exp2(n))
    sw, msrc, mdst = machine_ring(e.machine, e.machines)
    src, dst = ring_peers(r, n)
    x = rank_input(r, salt=21)
    inplace = rank_input(r, salt=22)
    handles = {
        "allreduce": e.iallreduce(x, op="avg"),
        "allreduce_": e.iallreduce_(inplace, op="sum"),
        "allgather": e.iallgather(rank_input(r, numel=r + 1, salt=23)),
        "broadcast": e.ibroadcast(x, root=0),
        "barrier": e.ibarrier(),
        "neighbor_allreduce": e.ineighbor_allreduce(x),
        "neighbor_allreduce_ring": e.ineighbor_allreduce(x, 0.5, {s: 0.5 for s in src}, dst),
        "neighbor_allgather": e.ineighbor_allgather(x, src, dst),
        "hierarchical": e.ihierarchical_neighbor_allreduce(x, sw, msrc, mdst),
    }
    deadline = time.monotonic() + 60
    while not all(h.done() for h in handles.values()) and time.monotonic() < deadline:
        time.sleep(0.001)
    res = {"all_done": all(h.done() for h in handles.values())}
    for name, h in handles.items():
        first = h.wait()
        res[f"same_on_second_wait_{name}"] = h.wait() is first
        res[name] = dump(first)
    res["allreduce_inplace_input"] = dump(inplace)
    # Waiting in the reverse order of posting must work too.
    late = [e.ineighbor_allreduce(rank_input(r, salt=24 + i)) for i in range(3)]
    res["reverse_order"] = [dump(h.wait()) for h in reversed(late)]
    return res


# ------------------------------------------------------------------ mismatched declarations


def _expect_comm_error(call: Callable[[], Any]) -> dict:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the type is part of the result
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}


@check("mismatch")
def _mismatch(e) -> Any:
    r, n = e.rank, e.size
    if n == 1:
        return {}
    x = rank_input(r)
    res = {}
    # Rank 0 expects from rank 1, but rank 1 does not send to it.
    src = {1: 0.5} if r == 0 else {}
    res["pattern"] = _expect_comm_error(lambda: e.neighbor_allreduce(x, 0.5, src, []))
    # A ring whose rank 0 holds more elements than its neighbors.
    s, d = ring_peers(r, n)
    y = rank_input(r, numel=9 if r == 0 else 7)
    res["size"] = _expect_comm_error(lambda: e.neighbor_allreduce(y, 0.5, {j: 0.5 for j in s}, d))
    # neighbor_allgather: rank 1 sends to rank 0, which does not expect it.
    res["allgather_pattern"] = _expect_comm_error(lambda: e.neighbor_allgather(x, [], [0] if r == 1 else []))
    if e.machines > 1:
        # Machine 0 expects from machine 1, which does not send.
        src_m = {1: 0.5} if e.machine == 0 else {}
        res["hierarchical_pattern"] = _expect_comm_error(lambda: e.hierarchical_neighbor_allreduce(x, 0.5, src_m, []))
    # The engine still works afterwards.
    e.set_topology(Exp2(n))
    res["after"] = dump(e.neighbor_allreduce(x))
    return res


# ------------------------------------------------------------------ windows


@check("window_put")
def _win_put(e) -> Any:
    r, n = e.rank, e.size
    src, dst = ring_peers(r, n)
    res = {}
    for name, dtype in DTYPES.items():
        x = rank_input(r, salt=30, dtype=dtype)
        own = e.win_create(x, f"put_{name}", src, dst)
        res[f"own_is_copy_{name}"] = bool(torch.equal(own, x)) and own.data_ptr() != x.data_ptr()
        e.win_put(None, f"put_{name}", dst_weights={k: 0.5 for k in dst})
        e.barrier()
        # self_weight 0 and weight 1 on the slot: the own value becomes exactly what arrived.
        got = e.win_update(f"put_{name}", 0.0, {j: 1.0 for j in src})
        res[name] = dump(got)
        res[f"weight_{name}"] = e.win_weight(f"put_{name}")
        e.barrier()
        e.win_free(f"put_{name}")
    return res


@check("window_get")
def _win_get(e) -> Any:
    r, n = e.rank, e.size
    src, dst = ring_peers(r, n)
    x = rank_input(r, salt=31)
    e.win_create(x, "get", src, dst)
    e.win_get("get", {j: 0.25 for j in src})
    e.barrier()  # every get done before anyone changes its own value
    got = e.win_update("get", 0.5, {j: 1.0 for j in src})
    res = {"value": dump(got), "weight": e.win_weight("get")}
    e.barrier()
    e.win_free("get")
    return res


@check("window_accumulate")
def _win_acc(e) -> Any:
    r, n = e.rank, e.size
    src, dst = ring_peers(r, n)
    res = {}
    for name, dtype in DTYPES.items():
        x = rank_input(r, salt=32, dtype=dtype)
        e.win_create(x, f"acc_{name}", src, dst)
        e.win_accumulate(x, f"acc_{name}", dst_weights={k: 0.5 for k in dst})
        e.win_accumulate(x, f"acc_{name}", dst_weights={k: 0.25 for k in dst})
        e.barrier()
        got = e.win_update(f"acc_{name}", 0.5, {j: 1.0 for j in src}, reset=True)
        res[name] = dump(got)
        res[f"weight_{name}"] = e.win_weight(f"acc_{name}")
        # reset: a second update sees empty slots
        res[f"after_reset_{name}"] = dump(e.win_update(f"acc_{name}", 1.0, {j: 1.0 for j in src}))
        e.barrier()
        e.win_free(f"acc_{name}")
    return res


@check("window_push_sum")
def _win_push_sum(e) -> Any:
    """Push-sum over a directed graph with uneven out-degrees: x and p move together."""
    r, n = e.rank, e.size
    out, ins = push_out_neighbors(r, n), push_in_neighbors(r, n)
    share = 1.0 / (len(out) + 1)
    e.win_create(rank_input(r, salt=33), "ps", ins, out)
    for _ in range(PUSH_SUM_ROUNDS):
        e.win_accumulate(None, "ps", self_weight=share, dst_weights={k: share for k in out})
        e.barrier()
        e.win_update("ps", 1.0, {j: 1.0 for j in ins}, reset=True)
        e.barrier()
    res = {"x": dump(e.win_tensor("ps")), "p": e.win_weight("ps")}
    e.win_free("ps")
    return res


@check("window_slots")
def _win_slots(e) -> Any:
    """What landed and is not yet updated in, read out and written back into a fresh window (a checkpoint's)."""
    r, n = e.rank, e.size
    src, dst = ring_peers(r, n)
    x = rank_input(r, salt=35)
    e.win_create(x, "sl", src, dst)
    e.win_accumulate(x, "sl", dst_weights={k: 0.5 for k in dst})
    e.barrier()
    data, weights = e.win_slots("sl")
    e.barrier()
    e.win_free("sl")
    e.win_create(x, "sl", src, dst, weight=1.0)
    e.win_set_slots("sl", data, weights)
    res = {"slots": dump(data), "slot_weights": weights.tolist(),
           "value": dump(e.win_update("sl", 1.0, {j: 1.0 for j in src}, reset=True)), "weight": e.win_weight("sl")}
    e.barrier()
    e.win_free("sl")
    return res


@check("window_nonblocking")
def _win_nonblocking(e) -> Any:
    r, n = e.rank, e.size
    src, dst = ring_peers(r, n)
    x = rank_input(r, salt=34)
    e.win_create(x, "nb", src, dst)
    h = e.iwin_put(x, "nb", dst_weights={k: 1.0 for k in dst})
    h.wait()
    e.barrier()
    g = e.iwin_get("nb", {j: 0.5 for j in src})
    g.wait()
    e.barrier()
    u = e.iwin_update("nb", 0.5, {j: 1.0 for j in src})
    res = {"done": g.done() and h.done(), "value": dump(u.wait()), "weight": e.win_weight("nb")}
    e.barrier()
    e.win_free("nb")
    return res


# ------------------------------------------------------------------ bookkeeping


@check("comm_time")
def _comm_time(e) -> Any:
    before = e.comm_time_s
    e.allreduce(rank_input(e.rank), op="avg")
    h = e.iallreduce(rank_input(e.rank), op="sum")
    h.wait()
    return {"grew": e.comm_time_s > before, "non_negative": e.comm_time_s >= 0}


def run_contract(engine: Any) -> dict[str, Any]:
    """Every check on this rank, in one fixed order; a check that raises records its error."""
    results: dict[str, Any] = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = fn(engine)
        except Exception as exc:  # noqa: BLE001 - reported per check by the test
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    return results
