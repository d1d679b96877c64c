"""The engine contract, for every engine in ENGINE_RUNNERS and every size in contract.SIZES.

Each (engine, size) spawns its ranks once; every check then compares each
rank's result with a numpy reference computed here from the same inputs
(mixing-matrix products, means, concatenations, matrix powers).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from bfexp.topology import Exp2, OnePeerExp2
from tests.comm import contract as C
from tests.comm.engines import ENGINE_RUNNERS

# Absolute tolerance per dtype (inputs and results are of order 1; half
# precision rounds after each multiply and add of the combine).
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 8e-2}

_results: dict[tuple[str, int], tuple[str, Any]] = {}


@pytest.fixture(scope="module")
def contract_results(tmp_path_factory) -> Callable[[str, int], list]:
    """Results per rank of one (engine, size), from a single spawn shared by every check."""

    def get(engine: str, size: int) -> list:
        key = (engine, size)
        if key not in _results:
            try:
                _results[key] = ("ok", ENGINE_RUNNERS[engine](size, tmp_path_factory.mktemp(f"{engine}-{size}")))
            except pytest.skip.Exception as skip:
                _results[key] = ("skip", str(skip))
            except Exception as exc:  # noqa: BLE001 - every check of this spawn reports it
                _results[key] = ("error", f"{type(exc).__name__}: {exc}")
        status, value = _results[key]
        if status == "skip":
            pytest.skip(value)
        if status == "error":
            pytest.fail(f"engine={engine} size={size}: ranks failed: {value}", pytrace=False)
        return value

    return get


# ------------------------------------------------------------------ helpers


def X(n: int, numel: int = 7, salt: int = 0) -> np.ndarray:
    """Row r = rank r's input."""
    return np.stack([C.rank_input(r, numel, salt).numpy() for r in range(n)])


def vals(res: Any) -> np.ndarray:
    return np.asarray(res["values"], dtype=np.float64)


def close(res: Any, expected: Any, dtype: str = "float64", shape: tuple | None = None) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    if shape is not None:
        assert tuple(res["shape"]) == tuple(shape), f"shape {res['shape']} != {shape}"
    np.testing.assert_allclose(vals(res), expected.reshape(-1), rtol=0, atol=TOL[dtype])


def close_list(res: list, expected: list, dtype: str = "float64") -> None:
    assert len(res) == len(expected)
    for got, want in zip(res, expected):
        close(got, want, dtype, np.shape(want))


def rpm(n: int) -> int:
    return C.ranks_per_machine(n)


def machine_average(Xs: np.ndarray, n: int) -> np.ndarray:
    L = rpm(n)
    return Xs.reshape(n // L, L, -1).mean(axis=1)


def machine_ring_matrix(M: int) -> np.ndarray:
    W = np.zeros((M, M))
    for m in range(M):
        sw, src, _ = C.machine_ring(m, M)
        W[m, m] = sw
        for j, w in src.items():
            W[m, j] += w
    return W


def push_matrix(n: int) -> np.ndarray:
    """Column-stochastic A: column j splits rank j's value equally among itself and its out-neighbors."""
    A = np.zeros((n, n))
    for j in range(n):
        out = C.push_out_neighbors(j, n)
        share = 1.0 / (len(out) + 1)
        A[j, j] = share
        for k in out:
            A[k, j] = share
    return A


def ring_matrix(n: int) -> np.ndarray:
    R = 0.5 * np.eye(n)
    if n > 1:
        for i in range(n):
            R[i, (i - 1) % n] += 0.5
    return R


def rows_of(r: int, salt: int) -> np.ndarray:
    return C.rank_input(r, 2 * (r + 1), salt).numpy().reshape(r + 1, 2)


# ------------------------------------------------------------------ references, one per check


def ref_identity(out: list, n: int) -> None:
    L = rpm(n)
    for r, o in enumerate(out):
        assert o == {"rank": r, "size": n, "local_rank": r % L, "local_size": L, "machine": r // L, "machines": n // L}


def ref_allreduce(out: list, n: int) -> None:
    Xs = X(n)
    for o in out:
        for name in C.DTYPES:
            close(o[f"avg_{name}"], Xs.mean(0), name, (7,))
            assert o[f"avg_{name}"]["dtype"] == name
            assert o[f"untouched_{name}"], "allreduce must not change its input"
        for name in ("float32", "float64"):
            close(o[f"sum_{name}"], Xs.sum(0), name)
        assert o["sum_int64"]["values"] == (np.arange(5) * sum(r + 1 for r in range(n))).tolist()


def ref_allreduce_list(out: list, n: int) -> None:
    mean = X(n, 11, 1).mean(0)
    for o in out:
        close_list(o, [mean[:6].reshape(2, 3), mean[6:10], mean[10:].reshape(1, 1, 1)])


def ref_allreduce_inplace(out: list, n: int) -> None:
    for o in out:
        for name in C.DTYPES:
            close(o[name], X(n, 7, 2).mean(0), name)
            assert o[f"returns_input_{name}"]
        close(o["adjacent_views"], X(n, 10, 3).sum(0))
        close_list(o["separate"], [X(n, 3, 4).mean(0), X(n, 2, 5).mean(0)])


def ref_allreduce_large(out: list, n: int) -> None:
    idx = C.LARGE_SAMPLE
    for key, salt, dtype, kind in (
        ("avg_float32", 40, "float32", "mean"),
        ("sum_float64", 41, "float64", "sum"),
        ("avg_bfloat16", 42, "bfloat16", "mean"),
        ("nonblocking_inplace", 43, "float32", "mean"),
    ):
        # Every rank's result against one reference per input (n inputs of 2M elements: made once, not per rank).
        Xs = np.stack([C.rank_input(r, C.LARGE, salt).numpy() for r in range(n)])
        expected = Xs.sum(0) if kind == "sum" else Xs.mean(0)
        del Xs
        want_sample, want_sum = expected[idx], expected.sum()
        for o in out:
            got = o[key]
            assert got["shape"] == [C.LARGE] and got["dtype"] == f"torch.{dtype}"
            np.testing.assert_allclose(got["sample"], want_sample, rtol=0, atol=TOL[dtype])
            assert got["sum"] == pytest.approx(want_sum, abs=TOL[dtype] * C.LARGE / 10)


def ref_allgather(out: list, n: int) -> None:
    rows = np.concatenate([rows_of(r, 6) for r in range(n)])
    second = np.concatenate([C.rank_input(r, 6, 7).numpy().reshape(2, 3) for r in range(n)])
    for o in out:
        close(o["rows"], rows, shape=rows.shape)
        close(o["bfloat16"], rows, "bfloat16", rows.shape)
        assert o["bfloat16"]["dtype"] == "bfloat16"
        close_list(o["list"], [rows, second])
        close(o["scalar_rows"], np.arange(n), shape=(n,))


def ref_broadcast(out: list, n: int) -> None:
    for o in out:
        close(o["single"], C.rank_input(n - 1, 7, 8).numpy())
        assert o["untouched"], "broadcast must not change its input"
        close_list(o["list"], [C.rank_input(0, 3, 9).numpy(), C.rank_input(0, 4, 10).numpy().reshape(2, 2)])
        close(o["inplace_bfloat16"], C.rank_input(n - 1, 7, 11).numpy(), "bfloat16")


def ref_barrier(out: list, n: int) -> None:
    assert out == [True] * n


def ref_nar_static(out: list, n: int) -> None:
    expected = Exp2(n).mixing_matrix() @ X(n)
    for r, o in enumerate(out):
        for name in C.DTYPES:
            close(o[name], expected[r], name, (7,))
            assert o[name]["dtype"] == name


def ref_nar_dynamic(out: list, n: int) -> None:
    topo = OnePeerExp2(n)
    for t in range(3):
        expected = topo.mixing_matrix(t) @ X(n, 7, 12)
        for r, o in enumerate(out):
            for name in C.DTYPES:
                close(o[f"t{t}_{name}"], expected[r], name)


def ref_nar_push(out: list, n: int) -> None:
    expected = push_matrix(n) @ X(n, 7, 13)
    for r, o in enumerate(out):
        for name in C.DTYPES:
            close(o[name], expected[r], name)


def ref_nar_list(out: list, n: int) -> None:
    W = Exp2(n).mixing_matrix()
    mixed = W @ X(n, 9, 14)
    half = W @ X(n, 7, 15)
    for r, o in enumerate(out):
        close_list(o["list"], [mixed[r, :4].reshape(2, 2), mixed[r, 4:]])
        close(o["inplace_views"], mixed[r])
        assert o["inplace_returns_inputs"]
        close(o["inplace_float16"], half[r], "float16")


def ref_nag(out: list, n: int) -> None:
    topo = Exp2(n)
    for r, o in enumerate(out):
        srcs = sorted(topo.weights(r).src_weights)
        static = np.concatenate([rows_of(s, 16) for s in srcs]) if srcs else np.zeros((0, 2))
        close(o["static"], static, shape=static.shape)
        ring = [rows_of((r - 1) % n, 16)] if n > 1 else [np.zeros((0, 2))]
        close(o["ring_bfloat16"], ring[0], "bfloat16", ring[0].shape)
        extra = C.rank_input((r - 1) % n, 3, 17).numpy() if n > 1 else np.zeros(0)
        close_list(o["ring_list"], [ring[0], extra])


def ref_hier(out: list, n: int) -> None:
    L, M = rpm(n), n // rpm(n)
    Wm = machine_ring_matrix(M)
    for r, o in enumerate(out):
        m = r // L
        for name in C.DTYPES:
            close(o[name], (Wm @ machine_average(X(n, 7, 18), n))[m], name)
        close(o["inplace"], (Wm @ machine_average(X(n, 7, 19), n))[m])
        close(o["static_machine_topology"], (Exp2(M).mixing_matrix() @ machine_average(X(n, 7, 20), n))[m])


def ref_nonblocking(out: list, n: int) -> None:
    Xs = X(n, 7, 21)
    W = Exp2(n).mixing_matrix()
    L, M = rpm(n), n // rpm(n)
    hier = machine_ring_matrix(M) @ machine_average(Xs, n)
    gathered = np.concatenate([C.rank_input(r, r + 1, 23).numpy() for r in range(n)])
    for r, o in enumerate(out):
        assert o["all_done"], "done() never turned True"
        for key, value in o.items():
            if key.startswith("same_on_second_wait_"):
                assert value, key
        close(o["allreduce"], Xs.mean(0))
        close(o["allreduce_"], X(n, 7, 22).sum(0))
        close(o["allreduce_inplace_input"], X(n, 7, 22).sum(0))
        close(o["allgather"], gathered, shape=gathered.shape)
        close(o["broadcast"], Xs[0])
        assert o["barrier"] is None
        close(o["neighbor_allreduce"], (W @ Xs)[r])
        close(o["neighbor_allreduce_ring"], (ring_matrix(n) @ Xs)[r])
        src = Xs[(r - 1) % n] if n > 1 else np.zeros(0)
        close(o["neighbor_allgather"], src, shape=src.shape)
        close(o["hierarchical"], hier[r // L])
        for got, salt in zip(o["reverse_order"], (26, 25, 24)):
            close(got, (W @ X(n, 7, salt))[r])


def ref_mismatch(out: list, n: int) -> None:
    if n == 1:
        assert out == [{}]
        return
    expected = Exp2(n).mixing_matrix() @ X(n)
    cases = {"pattern": ("rank 0", "rank 1"), "size": ("rank 0",), "allgather_pattern": ("rank 0", "rank 1")}
    if n // rpm(n) > 1:
        cases["hierarchical_pattern"] = ("machine 0", "machine 1")
    for r, o in enumerate(out):
        for case, words in cases.items():
            assert o[case]["raised"] == "CommError", f"rank {r}, {case}: {o[case]}"
            for word in words:  # the error names who disagrees
                assert word in o[case]["message"], f"rank {r}, {case}: {o[case]['message']}"
        close(o["after"], expected[r])


def ref_win_put(out: list, n: int) -> None:
    for r, o in enumerate(out):
        for name in C.DTYPES:
            assert o[f"own_is_copy_{name}"], "win_create returns a copy holding the tensor's value"
            if n == 1:
                close(o[name], np.zeros(7), name)
                assert o[f"weight_{name}"] == 0.0
            else:
                close(o[name], 0.5 * C.rank_input((r - 1) % n, 7, 30).numpy(), name)
                assert o[f"weight_{name}"] == pytest.approx(0.5, abs=1e-15)


def ref_win_get(out: list, n: int) -> None:
    Xs = X(n, 7, 31)
    for r, o in enumerate(out):
        src = 0.25 * Xs[(r - 1) % n] if n > 1 else 0
        close(o["value"], 0.5 * Xs[r] + src)
        assert o["weight"] == pytest.approx(0.75 if n > 1 else 0.5, abs=1e-15)


def ref_win_acc(out: list, n: int) -> None:
    Xs = X(n, 7, 32)
    for r, o in enumerate(out):
        for name in C.DTYPES:
            expected = 0.5 * Xs[r] + (0.75 * Xs[(r - 1) % n] if n > 1 else 0)
            close(o[name], expected, name)
            close(o[f"after_reset_{name}"], expected, name)
            assert o[f"weight_{name}"] == pytest.approx(1.25 if n > 1 else 0.5, abs=1e-15)


def ref_win_push_sum(out: list, n: int) -> None:
    A = np.linalg.matrix_power(push_matrix(n), C.PUSH_SUM_ROUNDS)
    X0 = X(n, 7, 33)
    x, p = A @ X0, A @ np.ones(n)
    got_x = np.stack([vals(o["x"]) for o in out])
    got_p = np.array([o["p"] for o in out])
    np.testing.assert_allclose(got_x, x, rtol=0, atol=1e-10)
    np.testing.assert_allclose(got_p, p, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got_x.sum(0), X0.sum(0), atol=1e-10)  # no mass lost in flight
    assert got_p.sum() == pytest.approx(n, abs=1e-12)
    # x / p is every rank's estimate of the average.
    np.testing.assert_allclose(got_x / got_p[:, None], np.tile(X0.mean(0), (n, 1)), atol=1e-3)


def ref_win_slots(out: list, n: int) -> None:
    Xs = X(n, 7, 35)
    for r, o in enumerate(out):
        arrived = 0.5 * Xs[(r - 1) % n] if n > 1 else np.zeros(0)
        close(o["slots"], arrived)
        assert o["slot_weights"] == ([0.5] if n > 1 else [])
        close(o["value"], Xs[r] + (arrived if n > 1 else 0))
        assert o["weight"] == (1.5 if n > 1 else 1.0)


def ref_win_nonblocking(out: list, n: int) -> None:
    Xs = X(n, 7, 34)
    for r, o in enumerate(out):
        assert o["done"]
        close(o["value"], 0.5 * Xs[r] + (0.5 * Xs[(r - 1) % n] if n > 1 else 0))
        assert o["weight"] == pytest.approx(1.0 if n > 1 else 0.5, abs=1e-15)


def ref_comm_time(out: list, n: int) -> None:
    for o in out:
        assert o == {"grew": True, "non_negative": True}


REFERENCES: dict[str, Callable[[list, int], None]] = {
    "identity": ref_identity,
    "allreduce": ref_allreduce,
    "allreduce_list": ref_allreduce_list,
    "allreduce_inplace": ref_allreduce_inplace,
    "allreduce_large": ref_allreduce_large,
    "allgather": ref_allgather,
    "broadcast": ref_broadcast,
    "barrier": ref_barrier,
    "neighbor_allreduce_static": ref_nar_static,
    "neighbor_allreduce_dynamic": ref_nar_dynamic,
    "neighbor_allreduce_push": ref_nar_push,
    "neighbor_allreduce_list": ref_nar_list,
    "neighbor_allgather": ref_nag,
    "hierarchical_neighbor_allreduce": ref_hier,
    "nonblocking": ref_nonblocking,
    "mismatch": ref_mismatch,
    "window_put": ref_win_put,
    "window_get": ref_win_get,
    "window_accumulate": ref_win_acc,
    "window_push_sum": ref_win_push_sum,
    "window_slots": ref_win_slots,
    "window_nonblocking": ref_win_nonblocking,
    "comm_time": ref_comm_time,
}


def test_every_check_has_a_reference():
    assert list(REFERENCES) == list(C.CHECKS)


@pytest.mark.parametrize("check", list(C.CHECKS))
@pytest.mark.parametrize("size", [s if s < 8 else pytest.param(s, marks=pytest.mark.large) for s in C.SIZES])  # .ci/run: 8
@pytest.mark.parametrize("engine", list(ENGINE_RUNNERS))
def test_contract(engine: str, size: int, check: str, contract_results) -> None:
    per_rank = [rank_results[check] for rank_results in contract_results(engine, size)]
    for r, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"rank {r}: {res['error']}\n{res.get('traceback', '')}", pytrace=False)
    REFERENCES[check](per_rank, size)
