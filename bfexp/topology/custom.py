"""Your own graph: a networkx graph, a matrix, an edge list, graph files, or a function that makes one.

The convention, here as everywhere in bfexp: an edge u -> v means u SENDS
to v. The mixing matrix is indexed receiver first, W[v, u] = the weight v
gives u's value, so one step is X+ = W X. networkx agrees on edges (a
DiGraph's edge (u, v) is u -> v; its adjacency A[u, v] is W's pattern
transposed).

A matrix or an edge list does not say which way its entries point, so the
reader must be told, by ``direction`` (or by the file itself: an edge list
may say ``# direction: out`` in a header line, which wins, so one sweep can
mix files of both kinds):

* ``out``: entry A[u, v] (a line ``u v``) means u sends to v (networkx's adjacency);
* ``in``: entry W[i, j] (a line ``i j``) means i receives from j (the mixing-matrix convention);
* ``undirected``: every entry is an edge both ways.

Left unset, only a symmetric input is taken (both readings agree there), so
a transposed matrix is never read silently. Inputs whose edges already
point are read their own way whatever ``direction`` says: a networkx
Graph's edges go both ways, a DiGraph's u -> v, a topology node's W is W.

Weights (``weights``): ``given`` uses the input's values as W (self weights
are the diagonal, or lines ``i i w``); ``uniform``, ``metropolis`` or
``column`` weigh its edges by that scheme (mixing.py). Every W(t) must be
nonnegative and row or column stochastic; an algorithm then checks what its
rule needs and names the fix when it lacks it.

Several graphs in a row make a time-varying topology: W(t) = W(t mod p).

Config options: ``file`` (FileTopology: edge lists, .npy/.npz/.csv
matrices, a YAML topology node, a folder or list of them) and
``generated`` (GeneratedTopology: any function returning a networkx graph
or a matrix, called with the rank count). Bad input raises TopologyError
in the one-line ``key=value; allowed: ...`` form.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import numpy as np

from bfexp.errors import TopologyError, text_of
from bfexp.topology.base import Topology, check_ranks
from bfexp.topology.mixing import WEIGHT_SCHEMES, NotUndirected, SparseMixing, WeightScheme, weigh

# Which way a matrix's or an edge list's entries point (module doc).
Direction = Literal["out", "in", "undirected"]
# ``given``: the input's own values are W; otherwise a weight scheme weighs its edges.
Weights = Literal["given", "uniform", "metropolis", "column"]

EDGE_LIST_SUFFIXES = (".edges", ".edgelist", ".txt")
MATRIX_SUFFIXES = (".npy", ".npz", ".csv")
NODE_SUFFIXES = (".yaml", ".yml")
FILE_KINDS = (
    f"an edge list ({', '.join(EDGE_LIST_SUFFIXES)}), a matrix ({', '.join(MATRIX_SUFFIXES)}), "
    f"a topology node ({', '.join(NODE_SUFFIXES)}), or a folder or list of them"
)
_DIRECTIONS = ("out", "in", "undirected")
# generated's default: nodes at random in the unit square, linked within distance 0.6
# (seed 3 draws a connected graph for every rank count from 2 to 128). Never mutated.
RANDOM_GEOMETRIC: dict[str, Any] = {"_target_": "networkx.random_geometric_graph", "radius": 0.6, "seed": 3}
_HEADER = re.compile(r"#\s*direction\s*[:=]\s*(\S+)", re.IGNORECASE)


@dataclass(frozen=True)
class EdgeList:
    """Edges as rows ``(a, b)``, or ``(a, b, weight)`` when ``weights`` is given; rows a == b are self weights.

    Which way a row points is the topology's ``direction`` (module doc). ``size``:
    the number of ranks, by default the largest node + 1.
    """

    pairs: Any
    weights: Any = None
    size: int | None = None


@dataclass(frozen=True)
class _Entries:
    """One W(t) as entries (a, b, w) in the source's own orientation, before ``direction`` is applied."""

    size: int
    a: np.ndarray
    b: np.ndarray
    w: np.ndarray | None  # None: an unweighted graph
    where: str  # the source, for messages (a file name, "graph 2", ...)
    oriented: bool = False  # True: a -> b already means a sends to b (networkx, a topology)
    declared: str | None = None  # direction stated by the source itself (an edge list's header)


class CustomTopology(Topology):
    """W(t) from your own graphs: one, or a sequence (time-varying, cycled over t).

    ``graphs``: a networkx Graph/DiGraph, a square matrix (numpy or scipy
    sparse; a 3-D array is a sequence), an EdgeList, or a list of these.
    A list is always a sequence of graphs, never one matrix: pass a matrix as
    an array. See the module doc for ``direction`` and ``weights``.
    """

    name: ClassVar[str] = "custom"
    weight_choices: ClassVar[tuple[str, ...]] = ("given", *WEIGHT_SCHEMES)

    def __init__(self, graphs: Any, *, direction: Direction | None = None, weights: Weights = "given") -> None:
        self._setup(_read(graphs, "graph"), None, direction, weights)

    def _setup(self, entries: list[_Entries], size: int | None, direction: str | None, weights: str,
               positions: np.ndarray | None = None) -> None:
        """Orient and weigh every W(t), then validate (shared by the constructors)."""
        if direction is not None and direction not in _DIRECTIONS:
            raise TopologyError(f"topology.direction={direction!r}; allowed: {', '.join(_DIRECTIONS)} or null")
        if not entries:
            raise TopologyError("topology has no graph; allowed: at least one graph")
        n = entries[0].size if size is None else size
        for e in entries:
            if e.size != n:
                allowed = f"ranks={e.size}" if size is not None and len(entries) == 1 else f"graphs on {n} ranks each"
                raise TopologyError(f"topology: {e.where} has {e.size} ranks, not {n}; allowed: {allowed}")
        super().__init__(n, weights=weights)  # type: ignore[arg-type]
        self.direction = direction
        self.period = len(entries)
        self._positions = positions
        self._weighed = [_mixing(n, *_orient(e, direction), weights, e.where, t) for t, e in enumerate(entries)]
        # Some input was read the way topology.direction says (so it could have been meant the other way).
        self._read_by_option = direction is not None and any(not e.oriented and e.declared is None for e in entries)
        # A graph whose direction was stated (topology.direction, a file's header) and that has one-way edges
        # is a directed graph the user asked for, as ``ring directed=true`` is: it has no undirected form.
        self.declared_directed = (direction is not None or any(e.declared for e in entries)) and self.directed
        self.validate()

    def _build(self, t: int) -> SparseMixing:
        return self._weighed[t]

    def params(self) -> dict[str, Any]:
        return {"direction": self.direction} if self.direction else {}

    def positions(self) -> np.ndarray:
        return self._positions if self._positions is not None else super().positions()

    def explain(self, need: str) -> tuple[str, str]:
        """As Topology.explain, adding when given weights would fit read the other way round."""
        detail, fix = super().explain(need)
        other = {"row": "columns", "column": "rows"}.get(need)
        if self.weight_scheme == "given" and other and self._read_by_option:
            lo, hi = self.sum_range(other)
            if abs(lo - 1) <= 1e-10 and abs(hi - 1) <= 1e-10:
                flip = "in" if self.direction == "out" else "out"
                detail += (f" while its {other} sum to 1 (read the other way round? "
                           f"topology.direction={flip} reads it transposed)")
        return detail, fix


class MatrixTopology(CustomTopology):
    """Mixing matrices W(0), ..., W(p-1) (numpy or scipy sparse), used as given and cycled over t.

    ``direction`` is required: ``in`` for a mixing matrix (W[i, j]: i receives
    from j), ``out`` for its transpose (A[u, v]: u sends to v), ``undirected``
    for a symmetric one.
    """

    name: ClassVar[str] = "matrix"

    def __init__(self, matrices: Any, *, direction: Direction, weights: Weights = "given") -> None:
        super().__init__(matrices, direction=direction, weights=weights)


class AdjacencyTopology(CustomTopology):
    """A static graph from an adjacency matrix (nonzero = edge), weighed by a weight scheme.

    ``direction`` is required: ``out`` when A[u, v] != 0 means u sends to v
    (networkx's ``to_numpy_array``), ``in`` when it means u receives from v.
    """

    name: ClassVar[str] = "adjacency"

    def __init__(self, adjacency: Any, *, direction: Direction, weights: WeightScheme = "uniform") -> None:
        a = np.asarray(adjacency)
        if a.ndim != 2:
            raise TopologyError(f"topology=adjacency with shape {a.shape}; allowed: a nonempty square matrix")
        super().__init__(a, direction=direction, weights=weights)


class FileTopology(CustomTopology):
    """conf/topology/file.yaml: W(t) read from graph files (module doc for the conventions).

    ``path``: an edge list (lines ``src dst [weight]``, ``#`` comments, an
    optional ``# direction: out`` header), a matrix (.npy, 3-D for a
    sequence; .npz, scipy sparse or numpy arrays in order; .csv), a YAML
    topology node (``_target_`` + options, built for this rank count), or a
    folder of such files (natural order: w2 before w10) or a list of paths:
    W(0), W(1), ... in that order. Relative paths are read from where bfexp runs.
    """

    name: ClassVar[str] = "file"

    def __init__(
        self,
        size: int,
        *,
        path: str | list[str],
        direction: Direction | None = None,
        weights: Weights = "given",
    ) -> None:
        check_ranks(size)
        if path == "???":  # Hydra's mark for a value the YAML leaves to the user
            raise TopologyError(f"topology.path is not set; allowed: {FILE_KINDS}, e.g. topology.path=graph.edges")
        if isinstance(path, str):
            paths = [path]
        elif isinstance(path, (list, tuple)) and path and all(isinstance(p, str) for p in path):
            paths = list(path)
        else:
            raise TopologyError(f"topology.path={path!r}; allowed: {FILE_KINDS}")
        self.path = path if isinstance(path, str) else list(paths)
        entries: list[_Entries] = []
        for p in paths:
            for f in _expand(p):
                entries.extend(_load(f, int(size)))
        self._setup(entries, int(size), direction, weights)

    @property
    def label(self) -> str:
        """``file(<path as given>)``, e.g. ``file(a.edges)``; its direction and weights are in ``params``."""
        return f"file({self.path if isinstance(self.path, str) else ','.join(self.path)})"

    def params(self) -> dict[str, Any]:
        return {"path": self.path, **super().params()}


class GeneratedTopology(CustomTopology):
    """conf/topology/generated.yaml: a graph made by any function, e.g. networkx.random_geometric_graph.

    ``graph``: ``_target_`` (the function's import path) and its keyword
    arguments; the rank count is passed as the keyword ``size_arg`` (networkx
    generators call it ``n``; null passes none, and the graph must then have
    ``ranks`` nodes). The function returns a networkx (Di)Graph (nodes
    0..n-1 are ranks; other labels take ranks in the graph's node order), a
    matrix (then ``direction`` is needed unless it is symmetric), or a list
    of them (time-varying). Node positions (a ``pos`` attribute) are used
    to draw it.
    """

    name: ClassVar[str] = "generated"
    connect_hint = " (try another topology.graph.seed, or parameters that give a denser graph)"

    def __init__(
        self,
        size: int,
        *,
        graph: dict[str, Any] = RANDOM_GEOMETRIC,
        size_arg: str | None = "n",
        direction: Direction | None = None,
        weights: Weights = "metropolis",
    ) -> None:
        check_ranks(size)
        from bfexp.components import check_kind, target_of  # lazy: OmegaConf, which a script's Exp2(n) need not

        if not isinstance(graph, Mapping) or not graph.get("_target_"):
            raise TopologyError(
                f"topology.graph={graph!r}; allowed: a mapping with _target_ (a function returning a networkx "
                "graph or a matrix) and its arguments, e.g. {_target_: networkx.random_geometric_graph, radius: 0.5}"
            )
        fn = target_of(graph, "topology.graph")
        check_kind(fn, "topology.graph")  # e.g. os.system: it builds no graph, and would run its arguments
        self.graph = dict(graph)
        kwargs = {k: v for k, v in graph.items() if k != "_target_"}
        if size_arg:
            if size_arg in kwargs:
                raise TopologyError(
                    f"topology.graph.{size_arg}={kwargs[size_arg]}; allowed: no topology.graph.{size_arg}, since "
                    f"topology.size_arg={size_arg} passes the rank count (ranks={size}); or topology.size_arg=null"
                )
            kwargs[size_arg] = int(size)
        import networkx as nx  # its generators refuse arguments with NetworkXError

        try:
            made = fn(**kwargs)
        except (TypeError, ValueError, nx.NetworkXException) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise TopologyError(
                f"topology.graph._target_={graph['_target_']} refused its arguments ({type(e).__name__}: {first}); "
                f"allowed: its own keyword arguments{f', with {size_arg} = the rank count' if size_arg else ''}"
            ) from None
        where = f"topology.graph._target_={graph['_target_']}"
        self._setup(_read(made, where), int(size), direction, weights, _positions(made, int(size)))

    @property
    def label(self) -> str:
        """``generated(<function>, <its arguments>)``, e.g. ``generated(random_geometric_graph, radius=0.6, seed=3)``."""
        fn = str(self.graph["_target_"]).rpartition(".")[2]
        args = [f"{k}={v}" for k, v in self.graph.items() if k != "_target_"]
        return f"generated({', '.join([fn, *args])})"

    def params(self) -> dict[str, Any]:
        return {**self.graph, **super().params()}


# ------------------------------------------------------------------ reading


def _read(obj: Any, where: str) -> list[_Entries]:
    """The W(t) entries of one graph or a sequence of graphs (module doc for the kinds)."""
    if isinstance(obj, (list, tuple)):
        out: list[_Entries] = []
        for k, item in enumerate(obj):
            out.extend(_read(item, f"{where} {k}"))
        return out
    if isinstance(obj, Topology):
        return [_from_mixing(obj.sparse_matrix(t), f"{where} W({t})") for t in range(obj.period)]
    if isinstance(obj, EdgeList):
        return [_from_edge_list(obj, where)]
    if _is_networkx(obj):
        return [_from_networkx(obj, where)]
    if _is_sparse(obj):
        return [_from_sparse(obj, where)]
    try:
        a = np.asarray(obj, dtype=np.float64)
    except (TypeError, ValueError):
        a = None
    if a is not None and a.ndim == 3 and a.shape[0] > 0:
        return [_from_dense(m, f"{where}[{t}]") for t, m in enumerate(a)]
    if a is not None and a.ndim == 2:
        return [_from_dense(a, where)]
    shape = f" with shape {a.shape}" if a is not None else ""
    raise TopologyError(
        f"topology: {where} is a {type(obj).__name__}{shape}; allowed: a networkx graph, a square matrix "
        "(numpy or scipy sparse), an EdgeList, or a list of them"
    )


def _is_networkx(obj: Any) -> bool:
    return type(obj).__module__.startswith("networkx.") and hasattr(obj, "is_directed") and hasattr(obj, "edges")


def _is_sparse(obj: Any) -> bool:
    return type(obj).__module__.startswith("scipy.sparse") and hasattr(obj, "tocoo")


def _from_dense(m: np.ndarray, where: str) -> _Entries:
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise TopologyError(f"topology: {where} has shape {m.shape}; allowed: a nonempty square matrix")
    if not np.isfinite(m).all():
        raise TopologyError(f"topology: {where} has entries that are not finite numbers; allowed: finite weights")
    rows, cols = np.nonzero(m)
    return _Entries(m.shape[0], rows, cols, m[rows, cols], where)


def _from_sparse(m: Any, where: str) -> _Entries:
    coo = m.tocoo()
    if coo.shape[0] != coo.shape[1] or coo.shape[0] == 0:
        raise TopologyError(f"topology: {where} has shape {coo.shape}; allowed: a nonempty square matrix")
    data = np.asarray(coo.data, dtype=np.float64)
    if not np.isfinite(data).all():
        raise TopologyError(f"topology: {where} has entries that are not finite numbers; allowed: finite weights")
    keep = data != 0
    rows, cols = np.asarray(coo.row, dtype=np.int64)[keep], np.asarray(coo.col, dtype=np.int64)[keep]
    return _Entries(coo.shape[0], rows, cols, data[keep], where)


def _from_mixing(m: SparseMixing, where: str) -> _Entries:
    """A topology's own W(t): its entries already say sender -> receiver."""
    i = np.arange(m.size)
    keep = m.diag != 0
    a = np.concatenate([m.senders, i[keep]])
    b = np.concatenate([m.receivers, i[keep]])
    return _Entries(m.size, a, b, np.concatenate([m.values, m.diag[keep]]), where, oriented=True)


def _from_networkx(g: Any, where: str) -> _Entries:
    nodes = list(g.nodes)
    n = len(nodes)
    if n == 0:
        raise TopologyError(f"topology: {where} has no nodes; allowed: a graph with one node per rank")
    index = {v: i for i, v in enumerate(sorted(nodes))} if set(nodes) == set(range(n)) else {
        v: i for i, v in enumerate(nodes)}
    edges = list(g.edges(data=True))
    a = np.array([index[u] for u, _, _ in edges], dtype=np.int64)
    b = np.array([index[v] for _, v, _ in edges], dtype=np.int64)
    weighted = bool(edges) and all("weight" in d for _, _, d in edges)
    w = np.array([float(d["weight"]) for _, _, d in edges]) if weighted else None
    if not g.is_directed():  # an undirected edge goes both ways; a self loop once
        loop = a == b
        a, b = np.concatenate([a, b[~loop]]), np.concatenate([b, a[~loop]])
        w = np.concatenate([w, w[~loop]]) if w is not None else None
    return _Entries(n, a, b, w, where, oriented=True)


def _from_edge_list(e: EdgeList, where: str, declared: str | None = None) -> _Entries:
    pairs = np.asarray(e.pairs)
    if pairs.size == 0:
        pairs = pairs.reshape(0, 2)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or not np.issubdtype(pairs.dtype, np.integer) or (pairs < 0).any():
        raise TopologyError(f"topology: {where} edges have shape {pairs.shape}, type {pairs.dtype}; "
                            "allowed: rows (a, b) of ranks (integers >= 0)")
    w = None if e.weights is None else np.asarray(e.weights, dtype=np.float64).reshape(-1)
    if w is not None and w.size != pairs.shape[0]:
        raise TopologyError(f"topology: {where} has {pairs.shape[0]} edges and {w.size} weights; allowed: one each")
    size = int(pairs.max(initial=-1)) + 1 if e.size is None else int(e.size)
    if pairs.size and pairs.max() >= size:
        raise TopologyError(f"topology: {where} names rank {int(pairs.max())}; allowed: ranks 0..{size - 1}")
    return _Entries(size, pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64), w, where, declared=declared)


def _positions(made: Any, size: int) -> np.ndarray | None:
    """Drawing coordinates from a networkx graph's ``pos`` node attributes (random geometric graphs have them)."""
    g = made[0] if isinstance(made, (list, tuple)) and made else made
    if not _is_networkx(g) or g.number_of_nodes() != size:
        return None
    nodes = sorted(g.nodes) if set(g.nodes) == set(range(size)) else list(g.nodes)
    pos = [g.nodes[v].get("pos") for v in nodes]
    if any(p is None or len(p) != 2 for p in pos):
        return None
    return np.array(pos, dtype=np.float64)


# ------------------------------------------------------------------ direction and weights


def _orient(e: _Entries, direction: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(senders, receivers, weights) of one W(t): the entries read the way ``direction`` says, made unique."""
    if e.oriented:  # a networkx graph or a topology: its edges already point
        return _unique(e.size, e.a, e.b, e.w, e.where)
    direction = e.declared or direction  # a file that states its direction is read its way
    if direction == "out":
        return _unique(e.size, e.a, e.b, e.w, e.where)
    if direction == "in":
        return _unique(e.size, e.b, e.a, e.w, e.where)
    if direction == "undirected":
        w = None if e.w is None else np.concatenate([e.w, e.w])
        return _unique(e.size, np.concatenate([e.a, e.b]), np.concatenate([e.b, e.a]), w, e.where)
    lonely = _one_way(e)
    if lonely is not None:
        u, v = lonely
        raise TopologyError(
            f"topology.direction=null but {e.where} is not symmetric (entry {u} {v} has no {v} {u} of the same "
            f"weight), so its direction matters; allowed: topology.direction=out (entry u v: u sends to v), "
            "in (u receives from v) or undirected (both ways)"
        )
    return _unique(e.size, e.a, e.b, e.w, e.where)


def _one_way(e: _Entries) -> tuple[int, int] | None:
    """An entry (u, v) without its mirror (v, u) of the same weight, or None when the input is symmetric."""
    s, r, w = _unique(e.size, e.a, e.b, e.w, e.where)
    weight = dict(zip(zip(s.tolist(), r.tolist()), w.tolist() if w is not None else [None] * s.size))
    for (u, v), x in weight.items():
        if (v, u) not in weight or weight[(v, u)] != x:
            return u, v
    return None


def _unique(size: int, s: np.ndarray, r: np.ndarray, w: np.ndarray | None,
            where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Entries with repeats merged; a repeat with another weight is the user's error."""
    s, r = np.asarray(s, dtype=np.int64), np.asarray(r, dtype=np.int64)
    keys = r * size + s
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if w is not None and uniq.size < keys.size:
        clash = np.nonzero(w != w[first][inverse])[0]
        if clash.size:
            k = clash[0]
            raise TopologyError(f"topology: {where} gives edge {s[k]} -> {r[k]} two weights "
                                f"({w[first][inverse][k]:g} and {w[k]:g}); allowed: one weight per edge")
    return s[first], r[first], (None if w is None else w[first])


def _mixing(size: int, s: np.ndarray, r: np.ndarray, w: np.ndarray | None, scheme: str, where: str,
            t: int) -> SparseMixing:
    """W(t) from oriented edges: the given weights, or the scheme's."""
    if scheme == "given":
        if w is None:
            raise TopologyError(
                f"topology.weights=given but {where} has no weights; allowed: topology.weights=uniform, metropolis "
                "or column (weigh its edges), or weights in the input (a third column 'u v weight')"
            )
        loop = s == r
        diag = np.zeros(size)
        diag[s[loop]] = w[loop]
        off = ~loop & (w != 0)
        return SparseMixing.from_entries(size, diag, r[off], s[off], w[off])
    try:
        return weigh(size, s, r, scheme)
    except NotUndirected:
        raise TopologyError(
            f"topology.weights=metropolis; allowed: uniform or column, since {where} is directed (W({t})), "
            "or topology.direction=undirected to use every edge both ways"
        ) from None


# ------------------------------------------------------------------ files


def _natural(name: str) -> list[Any]:
    """Sort key putting w2 before w10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _expand(path: str) -> list[Path]:
    """A file, or a folder's graph files in natural order."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted((f for f in p.iterdir() if not f.name.startswith(".")), key=lambda f: _natural(f.name))
        odd = [f.name for f in files if f.suffix.lower() not in EDGE_LIST_SUFFIXES + MATRIX_SUFFIXES + NODE_SUFFIXES]
        if odd or not files:
            what = f"holds {odd[0]}" if odd else "is empty"
            raise TopologyError(f"topology.path={path} {what}; allowed: a folder of graph files only ({FILE_KINDS})")
        return files
    if not p.is_file():
        raise TopologyError(f"topology.path={path} does not exist (relative to {Path.cwd()}); allowed: {FILE_KINDS}")
    if p.suffix.lower() not in EDGE_LIST_SUFFIXES + MATRIX_SUFFIXES + NODE_SUFFIXES:
        raise TopologyError(f"topology.path={path}; allowed: {FILE_KINDS}")
    return [p]


def _load(path: Path, size: int) -> list[_Entries]:
    """Every W(t) one file holds."""
    suffix = path.suffix.lower()
    name = path.name
    if suffix in EDGE_LIST_SUFFIXES:
        return [_read_edge_list(path, size)]
    if suffix in NODE_SUFFIXES:
        return _read_node(path, size)
    try:
        if suffix == ".csv":
            mats: list[Any] = [np.loadtxt(path, delimiter=",", ndmin=2, dtype=np.float64)]
        elif suffix == ".npy":
            mats = [np.load(path, allow_pickle=False)]
        else:
            with np.load(path, allow_pickle=False) as z:
                if {"format", "shape", "data"} <= set(z.files):  # scipy.sparse.save_npz
                    import scipy.sparse

                    mats = [scipy.sparse.load_npz(path)]
                else:
                    mats = [z[k] for k in z.files]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        if "allow_pickle" in why:  # numpy's words point at loading it unsafely: bfexp reads numbers only
            why = "it holds Python objects, not numbers, and a graph file runs no code"
        raise TopologyError(f"topology.path={name} cannot be read as a matrix ({why}); allowed: {FILE_KINDS}") from None
    entries = _read(mats, name) if len(mats) > 1 else _read(mats[0], name)
    for e in entries:
        if e.size != size:
            raise TopologyError(f"topology.path={name} is a {e.size} x {e.size} matrix; allowed: ranks={e.size}")
    return entries


def _read_edge_list(path: Path, size: int) -> _Entries:
    """Lines ``src dst [weight]`` (whitespace or commas), ``#`` comments, an optional direction header."""
    rows, weights, declared, columns = [], [], None, None
    text = text_of(path, "topology.path", f"an edge list as UTF-8 text, or {FILE_KINDS}", TopologyError)
    for number, line in enumerate(text.splitlines(), 1):
        text = line.strip()
        if text.startswith("#"):
            m = _HEADER.match(text)
            if m:
                declared = m.group(1).lower()
                if declared not in _DIRECTIONS:
                    raise TopologyError(f"topology.path={path.name} line {number}: direction {m.group(1)!r}; "
                                        f"allowed: {', '.join(_DIRECTIONS)}")
            continue
        if not text:
            continue
        fields = text.replace(",", " ").split()
        try:
            if len(fields) not in (2, 3) or (columns is not None and len(fields) != columns):
                raise ValueError
            u, v = int(fields[0]), int(fields[1])
            w = float(fields[2]) if len(fields) == 3 else None
        except ValueError:
            want = "'src dst'" if columns == 2 else "'src dst weight'" if columns == 3 else "'src dst [weight]'"
            raise TopologyError(f"topology.path={path.name} line {number}: {text!r}; allowed: {want} "
                                "with integer ranks, the same columns on every line") from None
        if not (0 <= u < size and 0 <= v < size):
            bad = min(u, v) if min(u, v) < 0 else max(u, v)
            raise TopologyError(f"topology.path={path.name} line {number} names rank {bad}; "
                                f"allowed: ranks 0..{size - 1} (ranks={size})")
        if w is not None and not np.isfinite(w):
            raise TopologyError(
                f"topology.path={path.name} line {number}: weight {fields[2]}; allowed: a finite number")
        columns = len(fields)
        rows.append((u, v))
        weights.append(w)
    nodes = {x for pair in rows for x in pair}
    if not rows:  # its advice would be ranks=0, itself refused
        raise TopologyError(f"topology.path={path.name} names no edge; allowed: lines `src dst [weight]` over ranks "
                            f"0..{size - 1} (ranks={size}), e.g. `0 1`")
    if max(nodes, default=-1) + 1 != size:
        raise TopologyError(f"topology.path={path.name} names ranks 0..{max(nodes, default=-1)}; "
                            f"allowed: ranks={max(nodes, default=-1) + 1} (or a file over ranks 0..{size - 1})")
    pairs = np.array(rows, dtype=np.int64).reshape(-1, 2)
    w = np.array(weights, dtype=np.float64) if columns == 3 else None
    return _from_edge_list(EdgeList(pairs, w, size), path.name, declared)


def _read_node(path: Path, size: int) -> list[_Entries]:
    """A YAML topology node (``_target_`` + options), built for this rank count: its W(t), one per t."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from bfexp.topology.build import build_topology

    try:
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise TopologyError(f"topology.path={path.name} is not a YAML topology node ({str(e).splitlines()[0]}); "
                            "allowed: a mapping with _target_ and its options") from None
    if not isinstance(node, dict) or "_target_" not in node:
        raise TopologyError(f"topology.path={path.name} has no _target_; allowed: a topology node, e.g. "
                            "_target_: bfexp.topology.GeneratedTopology with its graph")
    check_file_targets(node, f"topology.path={path.name}")
    return _read(build_topology(node, size), path.name)


# What a graph file may name: bfexp's topologies and networkx's graph generators. A data file (one a
# colleague shared, one a script wrote) chooses no other code: a class or function of the user's own is
# named in the config they compose (topology._target_=mylab.Ring, topology.graph._target_=mylab.make).
FILE_TARGETS = ("bfexp.topology.", "networkx.generators.")


def check_file_targets(node: Any, where: str) -> None:
    """Every ``_target_`` in a node read from a data file (nested ones too) names one of bfexp's topologies
    or a networkx generator, checked by the module it is defined in before anything is imported from
    elsewhere: TopologyError naming the one that does not."""
    import importlib

    def visit(value: Any, at: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{at}.{k}" if at else str(k))
            if "_target_" in value:
                path = str(value["_target_"])
                module, _, name = path.rpartition(".")
                defined = ""
                if module.startswith(("bfexp.", "networkx")):  # import only what may be allowed
                    try:
                        defined = str(getattr(getattr(importlib.import_module(module), name), "__module__", ""))
                    except (ImportError, AttributeError):
                        defined = ""
                if not (defined + ".").startswith(FILE_TARGETS):
                    key = f"{at}._target_" if at else "_target_"
                    raise TopologyError(f"{where} names {key}={path}, code a graph file may not choose; allowed in a "
                                        "file: bfexp's topologies and networkx's generators (your own class or "
                                        "function: name it in the config, e.g. topology.graph._target_=mylab.make)")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                visit(v, f"{at}[{i}]")

    visit(node, "")
