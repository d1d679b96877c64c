"""Your own graph (issue 20): files, networkx graphs and generators become W(t) under one convention.

The convention: an edge u -> v means u sends to v, i.e. W[v, u] != 0. Every
expected W below is written by hand or with numpy from that sentence, never
read back from the library. The round trip writes every built-in topology's
W(t) to files with numpy and plain text, reads them back through the
``file`` option, and checks the same W(t) for every t and the same training
iterates on virtual ranks.
"""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import scipy.sparse
import torch

from bfexp.algorithms import DSGD
from bfexp.comm.threads import run_threads
from bfexp.errors import TopologyError
from bfexp.topology import (
    AdjacencyTopology,
    CustomTopology,
    EdgeList,
    FileTopology,
    GeneratedTopology,
    MatrixTopology,
    build_topology,
)
from bfexp.topology.cli import option_names, option_node
from tests.algorithms import lsq

# A directed 4-cycle with a chord, as edges u -> v (u sends to v).
EDGES = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)]


def w_from_edges(n: int, edges, scheme: str) -> np.ndarray:
    """W by the textbook formulas, from the sentence 'u -> v is W[v, u]'."""
    a = np.zeros((n, n))
    for u, v in edges:
        a[v, u] = 1.0  # receiver row, sender column
    if scheme == "uniform":  # rows: 1 / (in-degree + 1)
        w = a + np.eye(n)
        return w / w.sum(axis=1, keepdims=True)
    if scheme == "column":  # columns: 1 / (out-degree + 1)
        w = a + np.eye(n)
        return w / w.sum(axis=0, keepdims=True)
    raise ValueError(scheme)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "allowed" in message, message
    return message


# ------------------------------------------------------------------ the convention, in every form
def test_edge_u_v_means_u_sends_to_v_in_every_form(tmp_path):
    expected = w_from_edges(4, EDGES, "uniform")
    (tmp_path / "out.edges").write_text("".join(f"{u} {v}\n" for u, v in EDGES))
    (tmp_path / "in.edges").write_text("".join(f"{v}, {u}\n" for u, v in EDGES))  # commas, receiver first
    (tmp_path / "header.edges").write_text("# a comment\n# direction: out\n\n" + "".join(f"{u} {v}\n" for u, v in EDGES))
    np.save(tmp_path / "w.npy", expected)
    a_out = np.zeros((4, 4))
    for u, v in EDGES:
        a_out[u, v] = 1  # networkx's adjacency: A[u, v] for u -> v
    built = [
        FileTopology(4, path=str(tmp_path / "out.edges"), direction="out", weights="uniform"),
        FileTopology(4, path=str(tmp_path / "in.edges"), direction="in", weights="uniform"),
        FileTopology(4, path=str(tmp_path / "header.edges"), weights="uniform"),
        # a file that states its direction is read its way: one option serves a sweep over mixed files
        FileTopology(4, path=str(tmp_path / "header.edges"), direction="in", weights="uniform"),
        FileTopology(4, path=[str(tmp_path / "header.edges"), str(tmp_path / "w.npy")], direction="in",
                     weights="uniform"),
        AdjacencyTopology(a_out, direction="out"),
        AdjacencyTopology(a_out.T, direction="in"),
        CustomTopology(nx.DiGraph(EDGES), weights="uniform"),
        CustomTopology(EdgeList(EDGES), direction="out", weights="uniform"),
    ]
    for topo in built:
        for t in range(topo.period):
            np.testing.assert_array_equal(topo.mixing_matrix(t), expected, err_msg=topo.label)
        assert topo.out_neighbors(0) == [1, 2] and topo.in_neighbors(0) == [3]


def test_a_transposed_matrix_cannot_be_passed_by_accident(tmp_path):
    a = np.zeros((4, 4))
    for u, v in EDGES:
        a[u, v] = 1
    with pytest.raises(TypeError, match="direction"):
        AdjacencyTopology(a)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="direction"):
        MatrixTopology(w_from_edges(4, EDGES, "uniform"))  # type: ignore[call-arg]
    np.save(tmp_path / "a.npy", a)
    for make in (lambda: CustomTopology(a, weights="uniform"),
                 lambda: FileTopology(4, path=str(tmp_path / "a.npy"), weights="uniform")):
        with pytest.raises(TopologyError) as exc:
            make()
        message = one_line(exc)
        assert "topology.direction=null" in message and "not symmetric" in message and "direction=out" in message
    # A symmetric input reads the same both ways, so it needs no direction.
    ring = np.roll(np.eye(5), 1, axis=1) + np.roll(np.eye(5), -1, axis=1)
    np.save(tmp_path / "ring.npy", ring)
    topo = FileTopology(5, path=str(tmp_path / "ring.npy"), weights="metropolis")
    np.testing.assert_allclose(topo.mixing_matrix(), (ring + np.eye(5)) / 3, rtol=0, atol=1e-15)


def test_undirected_reads_every_entry_both_ways(tmp_path):
    (tmp_path / "path.edges").write_text("0 1\n1 2\n2 3\n")
    topo = FileTopology(4, path=str(tmp_path / "path.edges"), direction="undirected", weights="metropolis")
    # Metropolis on a path 0-1-2-3: degrees 1, 2, 2, 1 -> 1/3 on every edge.
    w = np.zeros((4, 4))
    for i in range(3):
        w[i, i + 1] = w[i + 1, i] = 1 / 3
    np.fill_diagonal(w, 1 - w.sum(axis=1))
    np.testing.assert_allclose(topo.mixing_matrix(), w, rtol=0, atol=1e-15)
    assert topo.is_symmetric() and not topo.directed


def test_given_weights_with_self_loops_are_w(tmp_path):
    w = np.array([[0.5, 0.0, 0.5], [0.25, 0.75, 0.0], [0.0, 0.4, 0.6]])  # row stochastic, W[i, j]: i hears j
    lines = ["# direction: in"] + [f"{i} {j} {float(w[i, j])!r}" for i in range(3) for j in range(3) if w[i, j]]
    (tmp_path / "w.txt").write_text("\n".join(lines) + "\n")
    topo = FileTopology(3, path=str(tmp_path / "w.txt"))
    np.testing.assert_array_equal(topo.mixing_matrix(), w)
    assert topo.weight_scheme == "given" and topo.label == "file(" + str(tmp_path / "w.txt") + ")"


@pytest.mark.parametrize("kind", ["npy", "npz_sparse", "npz_arrays", "csv"])
def test_matrix_files(tmp_path, kind):
    rng = np.random.default_rng(1)
    w = rng.random((5, 5)) * (rng.random((5, 5)) < 0.5) + np.roll(np.eye(5), 1, axis=1)
    w /= w.sum(axis=1, keepdims=True)  # row stochastic, W[i, j]: i receives from j
    path = tmp_path / f"w.{kind.split('_')[0]}"
    if kind == "npy":
        np.save(path, w)
    elif kind == "npz_sparse":
        scipy.sparse.save_npz(path, scipy.sparse.csr_matrix(w))
    elif kind == "npz_arrays":
        np.savez(path, w, w.T.copy())  # two arrays: W(0), W(1)
    else:
        np.savetxt(path, w, delimiter=",")
    topo = FileTopology(5, path=str(path), direction="in", weights="given" if kind != "npz_arrays" else "uniform")
    if kind == "npz_arrays":
        assert topo.period == 2
        # uniform: 1 / (in-degree + 1) on every in-neighbor and on the rank itself
        pattern = [((m != 0) | np.eye(5, dtype=bool)).astype(float) for m in (w, w.T)]
        for t in range(2):
            np.testing.assert_allclose(topo.mixing_matrix(t), pattern[t] / pattern[t].sum(axis=1, keepdims=True),
                                       rtol=0, atol=1e-15)
    else:
        np.testing.assert_array_equal(topo.mixing_matrix(), w)


def test_a_sequence_is_a_time_varying_graph_in_natural_order(tmp_path):
    mats = [np.roll(np.eye(6), k, axis=1) * 0.5 + np.eye(6) * 0.5 for k in (1, 2, 3)]
    folder = tmp_path / "seq"
    folder.mkdir()
    for k, name in enumerate(["w2.npy", "w10.npy", "w11.npy"]):  # natural order: 2, 10, 11
        np.save(folder / name, mats[k])
    by_folder = FileTopology(6, path=str(folder), direction="in")
    by_list = FileTopology(6, path=[str(folder / "w2.npy"), str(folder / "w10.npy"), str(folder / "w11.npy")],
                           direction="in")
    stacked = tmp_path / "all.npy"
    np.save(stacked, np.stack(mats))
    by_stack = FileTopology(6, path=str(stacked), direction="in")
    for topo in (by_folder, by_list, by_stack):
        assert topo.period == 3 and topo.is_dynamic
        for t in range(9):
            np.testing.assert_array_equal(topo.mixing_matrix(t), mats[t % 3])


def test_a_yaml_topology_node_is_a_graph_file(tmp_path):
    (tmp_path / "rgg.yaml").write_text(
        "_target_: bfexp.topology.GeneratedTopology\ngraph:\n  _target_: networkx.random_geometric_graph\n"
        "  radius: 0.6\n  seed: 3\n"
    )
    topo = FileTopology(8, path=str(tmp_path / "rgg.yaml"))
    g = nx.random_geometric_graph(8, 0.6, seed=3)
    np.testing.assert_allclose(topo.mixing_matrix(), metropolis(nx.to_numpy_array(g, nodelist=range(8))),
                               rtol=0, atol=1e-15)


def metropolis(a: np.ndarray) -> np.ndarray:
    """W[i, j] = 1 / (1 + max(d_i, d_j)) on the edges of an undirected graph; the rest on the diagonal."""
    d = a.sum(axis=1)
    w = np.where(a != 0, 1.0 / (1.0 + np.maximum(d[:, None], d[None, :])), 0.0)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


# ------------------------------------------------------------------ generated graphs
@pytest.mark.parametrize("seed", [3, 7])
def test_generated_graph_is_the_function_s_graph_with_its_weights(seed):
    topo = build_topology({"_target_": "bfexp.topology.GeneratedTopology",
                           "graph": {"_target_": "networkx.random_geometric_graph", "radius": 0.7, "seed": seed}}, 10)
    g = nx.random_geometric_graph(10, 0.7, seed=seed)
    np.testing.assert_allclose(topo.mixing_matrix(), metropolis(nx.to_numpy_array(g, nodelist=range(10))),
                               rtol=0, atol=1e-15)
    assert topo.label == f"generated(random_geometric_graph, radius=0.7, seed={seed})"
    np.testing.assert_array_equal(topo.positions(), np.array([g.nodes[i]["pos"] for i in range(10)]))


def test_generated_directed_graph_and_fixed_size_function():
    topo = GeneratedTopology(6, graph={"_target_": "networkx.cycle_graph", "create_using": None}, weights="uniform")
    np.testing.assert_allclose(topo.mixing_matrix(), (np.eye(6) + np.roll(np.eye(6), 1, 1) + np.roll(np.eye(6), -1, 1)) / 3)
    topo = GeneratedTopology(4, graph={"_target_": f"{__name__}.four_cycle"}, size_arg=None, weights="column")
    np.testing.assert_array_equal(topo.mixing_matrix(), w_from_edges(4, EDGES, "column"))


def four_cycle() -> nx.DiGraph:
    """A user's function returning a fixed graph."""
    return nx.DiGraph(EDGES)


# ------------------------------------------------------------------ what cannot run: one line, the value, what is allowed
def bad_inputs(tmp_path) -> list[tuple]:
    (tmp_path / "ring.edges").write_text("0 1\n1 2\n2 0\n")
    (tmp_path / "bad.edges").write_text("0 1\n1 two\n")
    (tmp_path / "mixed.edges").write_text("0 1\n1 2 0.5\n")
    (tmp_path / "far.edges").write_text("0 1\n1 9\n")
    (tmp_path / "twice.edges").write_text("0 1 0.5\n0 1 0.25\n1 0 1\n0 0 0.5\n")
    (tmp_path / "graph.bin").write_text("")
    np.save(tmp_path / "off.npy", np.array([[0.5, 0.6, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]))
    p = lambda name: str(tmp_path / name)  # noqa: E731
    return [
        (lambda: FileTopology(3, path=p("ring.edges"), direction="out"), "topology.weights=given", "uniform"),
        (lambda: FileTopology(3, path=p("bad.edges"), direction="out", weights="uniform"), "line 2", "src dst"),
        (lambda: FileTopology(3, path=p("mixed.edges"), direction="out", weights="uniform"), "line 2", "same columns"),
        (lambda: FileTopology(3, path=p("far.edges"), direction="out", weights="uniform"), "rank 9", "ranks 0..2"),
        (lambda: FileTopology(4, path=p("ring.edges"), direction="out", weights="uniform"), "ranks 0..2", "ranks=3"),
        (lambda: FileTopology(2, path=p("twice.edges"), direction="out"), "two weights", "one weight per edge"),
        (lambda: FileTopology(3, path=p("ring.edges"), direction="out", weights="metropolis"), "directed", "undirected"),
        (lambda: FileTopology(3, path=p("nothing.edges")), "does not exist", "edge list"),
        (lambda: FileTopology(3, path=p("graph.bin")), "graph.bin", ".npy"),
        (lambda: FileTopology(4, path=p("off.npy"), direction="in"), "3 x 3", "ranks=3"),
        (lambda: FileTopology(3, path=p("off.npy"), direction="in"), "rows of W sum to 1..1.1", "topology.weights"),
        (lambda: FileTopology(3, path="???"), "topology.path is not set", "edge list"),
        (lambda: FileTopology(3, path=p("ring.edges"), direction="sideways"), "sideways", "out, in, undirected"),
        (lambda: GeneratedTopology(4, graph={"_target_": "networkx.random_geometric_graph", "n": 4}), "graph.n=4",
         "size_arg"),
        (lambda: GeneratedTopology(4, graph={"_target_": "networkx.random_geometric_graph", "radius": 0.5,
                                             "wobble": 1}), "refused its arguments", "rank count"),
        (lambda: GeneratedTopology(5, graph={"_target_": "networkx.star_graph"}), "has 6 ranks", "ranks=6"),
        (lambda: GeneratedTopology(12, graph={"_target_": "networkx.random_geometric_graph", "radius": 0.1,
                                              "seed": 0}), "disconnected", "topology.graph.seed"),
    ]


def test_bad_input_is_one_line_naming_the_value_and_what_is_allowed(tmp_path):
    for make, *needles in bad_inputs(tmp_path):
        with pytest.raises(TopologyError) as exc:
            make()
        message = one_line(exc)
        for needle in needles:
            assert needle in message, (needle, message)


# ------------------------------------------------------------------ round trip: every built-in through a file
BUILT_IN = [o for o in option_names() if "???" not in option_node(o).values() and o != "generated"]
N = 8


def built_in(name: str):
    return build_topology(option_node(name), N, 4 if name == "inner_outer_exp2" else 0)


def write_edge_list(path, w: np.ndarray) -> None:
    """W as lines 'u v weight' for u -> v (W[v, u]), self weights as 'i i weight', with its direction header."""
    n = w.shape[0]
    lines = ["# direction: out"] + [f"{u} {v} {float(w[v, u])!r}" for v in range(n) for u in range(n) if w[v, u] != 0]
    path.write_text("\n".join(lines) + "\n")


def written(name: str, folder) -> dict[str, dict]:
    """The built-in's W(t), t in one period, written four ways; the file option's node for each."""
    topo = built_in(name)
    folder.mkdir()
    ws = [np.array(topo.mixing_matrix(t)) for t in range(topo.period)]
    (folder / "npy").mkdir()
    edges, csvs = [], []
    for t, w in enumerate(ws):
        np.save(folder / "npy" / f"W{t}.npy", w)
        write_edge_list(folder / f"W{t}.edges", w)
        np.savetxt(folder / f"W{t}.csv", w, delimiter=",")
        edges.append(str(folder / f"W{t}.edges"))
        csvs.append(str(folder / f"W{t}.csv"))
    np.savez(folder / "all.npz", *ws)
    node = {"_target_": "bfexp.topology.FileTopology"}
    return {
        "npy folder": {**node, "path": str(folder / "npy"), "direction": "in"},
        "edge lists": {**node, "path": edges},
        "csv list": {**node, "path": csvs, "direction": "in"},
        "npz": {**node, "path": str(folder / "all.npz"), "direction": "in"},
    }


@pytest.mark.parametrize("name", BUILT_IN)
def test_round_trip_gives_the_same_w_for_every_t(name, tmp_path):
    topo = built_in(name)
    for form, node in written(name, tmp_path / name).items():
        back = build_topology(node, N)
        assert back.period == topo.period, form
        for t in range(2 * topo.period + 1):
            np.testing.assert_array_equal(back.mixing_matrix(t), topo.mixing_matrix(t), err_msg=f"{form} t={t}")
            for r in range(N):
                assert back.weights(r, t) == topo.weights(r, t), (form, t, r)


STEPS = 6


def dsgd_iterates(node: dict, style: str) -> list:
    """Every rank's x after each of STEPS DSGD steps on its own least-squares f_i, on N virtual ranks."""
    p = lsq.problem(0, N)

    def rank(engine):
        r = engine.rank
        x = torch.nn.Parameter(torch.tensor(p.x0[r], dtype=torch.float64))
        A, b = torch.tensor(p.A[r]), torch.tensor(p.b[r])
        topology = build_topology(node, N, 4 if "InnerOuter" in node["_target_"] else 0)
        opt = DSGD(torch.optim.SGD([x], lr=0.02), engine, topology, style=style)
        trace = []
        for _ in range(STEPS):
            opt.zero_grad()
            (0.5 * ((A @ x - b) ** 2).sum()).backward()
            opt.step()
            trace.append(x.detach().clone())
        opt.close()
        return torch.stack(trace)

    return run_threads(N, rank)


@pytest.mark.parametrize("name", BUILT_IN)
def test_round_trip_gives_the_same_training_iterates(name, tmp_path):
    node = written(name, tmp_path / name)["edge lists"]
    for style in ("atc", "awc"):
        ours = dsgd_iterates(node, style)
        theirs = dsgd_iterates(option_node(name), style)
        for r in range(N):
            assert torch.equal(ours[r], theirs[r]), (name, style, r)
        # and the iterates moved: mixing really happened
        assert not torch.equal(ours[0][0], ours[0][-1])
