"""What a job's training steps sent, step by step, so that any cluster can price them (issue 48).

Rank 0's engine tells the ledger every operation it posts inside a training step (``Engine._track``):
its kind, the bytes of one message and who talks to whom (every rank's edges: a topology's W(t) as the
engine or a stacked mixing used it, or this rank's destinations repeated around the ranks, which is
exact for the circulant graphs of the field: ring, exp2, one-peer exp2, full). Steps that send the same
thing share one *signature*; the ledger keeps the signatures, the graphs they name and the steps' order
(run-length coded), and the run folder keeps it as ``operations.json``.

``Prices`` turns a ledger into modeled time on a cluster with bfexp.costmodel: a step costs its compute
plus the communication backward does not hide (costmodel.step_estimate), its communication being the sum
of its operations' prices (costmodel.operation_s). The training loop prices as it goes (metrics.jsonl's
``modeled_time_s``), and ``bfexp-report --cluster`` prices a recorded folder on another cluster with the
same function, in the same order: the same numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from bfexp import costmodel

__all__ = ["FILE", "Ledger", "Prices"]

FILE = "operations.json"
FORMAT = 1


@dataclass
class Ledger:
    """Rank 0's record of its training steps' operations (module doc). ``size``: the job's ranks;
    ``rank``: the recording rank (its destinations name the edges of an exchange without a graph)."""

    size: int
    rank: int = 0
    signatures: list[tuple] = field(default_factory=list)  # each: ((op, message bytes, graph index or -1), ...)
    graphs: list = field(default_factory=list)  # (sender, receiver) pairs of every rank, or {"machine_offsets": ...}
    runs: list[list[int]] = field(default_factory=list)  # [signature index, steps in a row]
    facts: dict = field(default_factory=dict)  # what pricing needs besides the cluster (summary.pricing_facts)
    _signature_ids: dict = field(default_factory=dict, repr=False)
    _graph_ids: dict = field(default_factory=dict, repr=False)
    _step: list | None = field(default=None, repr=False)

    # recording -----------------------------------------------------------
    def begin(self) -> None:
        """A training step starts: what the engine posts from now on is this step's."""
        self._step = []

    def add(self, op: str, nbytes: float, peers: Any = None) -> None:
        """An operation posted (Engine._track): ``nbytes`` what this rank sent (a collective: its vector;
        stacked ranks: the mean over ranks). ``peers``: ("graph", topology, t, stacked) for an exchange by
        W(t) of a topology, ("dst", ranks) or ("src", ranks) for one by this rank's own peers, ("machines",
        machine destinations[, the degree stacked bytes were multiplied by]) for a hierarchical one, None for
        a collective (ranks: any iterable of them, a weights dict's keys too; read at once, not kept).
        Outside a step: ignored."""
        if self._step is None:
            return
        graph, message = -1, float(nbytes)
        if peers is not None:
            graph, degree = self._graph(peers)
            if degree == 0:
                return  # nobody to talk to: nothing was sent
            if peers[0] != "machines":  # a hierarchical op counts its one message (stacked: times the degree)
                message = float(nbytes) / degree
            elif len(peers) > 2:
                message = float(nbytes) / float(peers[2])
        self._step.append((op, message, graph))

    def end(self) -> int:
        """The step is over: its signature joins the run (returns the signature's index)."""
        step, self._step = tuple(self._step or ()), None
        index = self._signature_ids.get(step)
        if index is None:
            index = self._signature_ids[step] = len(self.signatures)
            self.signatures.append(step)
        if self.runs and self.runs[-1][0] == index:
            self.runs[-1][1] += 1
        else:
            self.runs.append([index, 1])
        return index

    def _graph(self, peers: tuple) -> tuple[int, float]:
        """The index of the edge set ``peers`` names, and the messages per sender it carries (this rank's
        out-degree; stacked ranks': the mean). A hierarchical exchange keeps its machine offsets (every
        machine sends as rank 0's does), which a cluster of any machine count turns into edges."""
        kind = peers[0]
        if kind == "graph":
            _, topology, t, stacked = peers
            key: Any = ("graph", id(topology), int(t) % max(1, int(getattr(topology, "period", 1))))
        else:
            key = (kind, tuple(sorted(int(r) for r in peers[1])))
        hit = self._graph_ids.get(key)
        if hit is not None:
            return hit
        graph: Any
        if kind == "graph":
            graph = [(int(s), int(r)) for s, r in costmodel.topology_edges(topology, t)]
            degree = len(graph) / self.size if stacked else sum(1 for s, _ in graph if s == self.rank)
        elif kind == "machines":
            graph, degree = {"machine_offsets": list(key[1])}, len(key[1])
        else:  # this rank's own peers, every rank's at the same offsets
            n = self.size
            offsets = sorted({(r - self.rank) % n for r in key[1]})
            graph = ([(i, (i + o) % n) for o in offsets for i in range(n)] if kind == "dst" else
                     [((i + o) % n, i) for o in offsets for i in range(n)])
            degree = len(key[1])
        # one index per edge set, also across a resume (a restored ledger knows its graphs, not their keys)
        index = next((i for i, known in enumerate(self.graphs) if known == graph), len(self.graphs))
        if index == len(self.graphs):
            self.graphs.append(graph)
        hit = self._graph_ids[key] = (index, degree)
        return hit

    # the run folder ---------------------------------------------------------
    @property
    def steps(self) -> int:
        return sum(count for _, count in self.runs)

    def to_json(self) -> dict:
        """Plain data (lists, numbers, strings): a checkpoint's and operations.json's form."""
        return {"format": FORMAT, "ranks": self.size, "recorded_by_rank": self.rank, "facts": dict(self.facts),
                "signatures": [[list(op) for op in sig] for sig in self.signatures],
                "graphs": [g if isinstance(g, dict) else [list(e) for e in g] for g in self.graphs],
                "runs": [list(r) for r in self.runs]}

    @classmethod
    def from_json(cls, data: dict) -> "Ledger":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"operation ledger format {data.get('format') if isinstance(data, dict) else data!r}; "
                             f"allowed: {FORMAT}")
        ledger = cls(int(data["ranks"]), int(data.get("recorded_by_rank", 0)))
        ledger.signatures = [tuple((str(op), float(b), int(g)) for op, b, g in sig) for sig in data["signatures"]]
        ledger.graphs = [{"machine_offsets": [int(o) for o in g["machine_offsets"]]} if isinstance(g, dict)
                         else [(int(a), int(b)) for a, b in g] for g in data["graphs"]]
        ledger.runs = [[int(i), int(c)] for i, c in data["runs"]]
        ledger.facts = dict(data.get("facts") or {})
        ledger._signature_ids = {sig: i for i, sig in enumerate(ledger.signatures)}
        ledger.check()
        return ledger

    def check(self) -> None:
        """ValueError for a ledger read from a file that names what it does not hold: a signature's graph, a
        run's signature, an edge's rank out of range, a run of no steps, a message of no finite size."""
        n, graphs = self.size, len(self.graphs)
        if n < 1:
            raise ValueError(f"operation ledger of ranks={n}; allowed: ranks >= 1")
        for g in self.graphs:
            if not isinstance(g, dict) and any(not 0 <= r < n for edge in g for r in edge):
                raise ValueError(f"operation ledger edge outside ranks 0..{n - 1}")
        for sig in self.signatures:
            for _, message, graph in sig:
                if not -1 <= graph < graphs or not math.isfinite(message) or message < 0:
                    raise ValueError(f"operation ledger entry (graph {graph}, {message} bytes); allowed: a graph "
                                     f"-1..{graphs - 1} and a finite size")
        for index, count in self.runs:
            if not 0 <= index < len(self.signatures) or count < 1:
                raise ValueError(f"operation ledger run [{index}, {count}]; allowed: a signature "
                                 f"0..{len(self.signatures) - 1} and at least one step")

    def save(self, run_dir: Path) -> Path:
        """operations.json in the run folder, atomically; one line (a 1024-rank graph is 10,000 pairs)."""
        from bfexp import results

        path = Path(run_dir) / FILE
        results.write_text_atomic(path, json.dumps(self.to_json(), separators=(",", ":")) + "\n")
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "Ledger | None":
        """A run folder's ledger; None where it has none (a job from before ledgers, or one that failed)."""
        from bfexp import results

        data = results.read_json(Path(run_dir) / FILE)
        return cls.from_json(data) if data is not None else None

    def sequence(self) -> Iterator[int]:
        """Every step's signature index, in order."""
        for index, count in self.runs:
            for _ in range(count):
                yield index


@dataclass
class Prices:
    """Modeled time of a ledger's steps on ``cluster``: each step ``compute_s`` (one rank's forward and
    backward on the cluster's device) plus the communication its operations leave exposed."""

    cluster: costmodel.Cluster
    compute_s: float
    backward_fraction: float = 2 / 3
    overlap: bool = True
    buckets: int = 0
    decoded_bytes: float = 0.0  # a compressor's payloads, rebuilt as dense vectors of this size by their receivers
    wait_s: float = 0.0  # each step's mean wait for the slowest rank (costmodel.straggler_wait_s; a measured speed's)
    _cache: dict = field(default_factory=dict, repr=False)

    def communication_s(self, ledger: Ledger, index: int) -> float:
        """The operations of signature ``index``, priced one after another."""
        total = 0.0
        for op, message, graph in ledger.signatures[index]:
            edges: Sequence = ledger.graphs[graph] if graph >= 0 else ()
            if isinstance(edges, dict):  # a hierarchical exchange: every machine sends as machine 0 does
                m = self.cluster.machines(ledger.size)
                offsets = sorted({int(o) % m for o in edges["machine_offsets"]} - {0})
                edges = [(i, (i + o) % m) for o in offsets for i in range(m)]
            total += costmodel.operation_s(self.cluster, ledger.size, op, message, edges, self.decoded_bytes)
        return total

    @classmethod
    def on(cls, scaling_node: Any, facts: dict, measured_samples_per_s: float | None = None,
           measured_wait_s: float = 0.0) -> "Prices | None":
        """Prices on the cluster of a scaling config (its node) for a job of ``facts`` (the ledger's: model,
        batch, FLOP of a sample's forward, overlap, buckets): a rank's compute from the cluster's declared or
        device speed for the model, else ``measured_samples_per_s`` (the job's single-rank reference, with
        ``measured_wait_s``, the wait for the slowest rank its spread prices); None without either."""
        from bfexp import scaling

        speed = scaling.rank_speed(scaling_node, str(facts["model"]), float(facts["forward_flop_per_sample"]))
        samples_per_s = speed[0] if speed else measured_samples_per_s
        if not samples_per_s or not samples_per_s > 0 or not math.isfinite(samples_per_s):
            return None
        wait_s = 0.0 if speed else float(measured_wait_s or 0.0)  # a declared speed has no measured jitter
        return cls(scaling.cluster(scaling_node), int(facts["batch_size"]) / float(samples_per_s),
                   backward_fraction=float(scaling_node["backward_fraction"]), overlap=bool(facts["overlap"]),
                   buckets=int(facts["buckets"]), decoded_bytes=float(facts.get("decoded_bytes") or 0.0),
                   wait_s=wait_s if math.isfinite(wait_s) and wait_s > 0 else 0.0)

    def step_s(self, ledger: Ledger, index: int) -> float:
        """One step of signature ``index``: compute plus its exposed communication (cached per signature)."""
        hit = self._cache.get(index)
        if hit is None:
            comm = self.communication_s(ledger, index)
            hit = self._cache[index] = costmodel.step_estimate(
                self.compute_s, comm, backward_fraction=self.backward_fraction, overlap=self.overlap,
                buckets=self.buckets, wait_s=self.wait_s).step_s
        return hit

    def cumulative(self, ledger: Ledger, steps: int | None = None) -> list[float]:
        """Modeled seconds at the end of each step, summed in step order (as the training loop sums them);
        ``steps``: the first that many only (a recorded folder's records name the steps they need)."""
        out, now = [], 0.0
        for index in ledger.sequence():
            if steps is not None and len(out) >= steps:
                break
            now += self.step_s(ledger, index)
            out.append(now)
        return out
