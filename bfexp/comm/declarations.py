"""Who sends what to whom: the one check, for every engine, that turns a mismatched exchange into a CommError.

The contract: before any rank can wait forever on a message nobody sends,
every rank *declares* the exchange, every rank gets every rank's
declaration, and every rank runs the same check on the same table. So
either no rank raises, or every rank raises the same CommError naming the
ranks (or machines) that disagree, instead of hanging. How declarations
travel is the engine's business (an MPI Allgather that runs alongside the
data, the threads rendezvous); what they say and how they are judged is
written here, once.

A declaration is one row of bytes: a header of four int64s (elements,
dtype code, tensor count, shape signature), then two bit maps over the
*units* of the exchange (ranks, or machines for hierarchical ops): whom
this rank receives from, whom it sends to. Bit maps are cached (a topology
repeats a few patterns), and so are tables found consistent: a static or
periodic topology gathers the same few tables over and over, and each is
parsed and checked once per process.

The kinds of exchange and what each requires:

* ``Declaration`` (neighbor_allreduce): both ends declare every edge, and
  every edge moves as many elements of one dtype as its receiver holds;
* ``GatherDeclaration`` (neighbor_allgather): both ends declare every edge,
  and its ends agree on dtype, tensor count and trailing shapes (only first
  dimensions may differ);
* ``MachineDeclaration`` (hierarchical_neighbor_allreduce): one size and
  dtype on every rank, one declaration per machine (every rank of a machine
  declares what its machine does), and the machines' edges agree;
* ``WindowDeclaration`` (win_create): edges, sizes and dtypes as for
  neighbor_allreduce, and one window name on every rank;
* ``allgather_problems`` (the collective allgather): every rank gives the
  same list, but for first dimensions.

``TopologyPatterns``: an exchange whose weights every rank takes from the
engine's own topology (round t) is declared the first time each round, size
and dtype comes; once found consistent it is trusted and repeats skip the
gather (the per-call round trip a small model's step cannot hide).
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np
import torch

from bfexp.errors import CommError

__all__ = [
    "CODE_DTYPES",
    "DTYPE_CODES",
    "Declaration",
    "GatherDeclaration",
    "MachineDeclaration",
    "Table",
    "TopologyPatterns",
    "WindowDeclaration",
    "allgather_problems",
    "dtype_name",
    "header",
    "mismatch_error",
    "pattern_problems",
    "shape_signature",
]

# Small codes so dtypes can be compared across ranks inside integer declarations.
DTYPE_CODES = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
HEADER = 4  # int64s: numel, dtype code, tensor count, shape signature


def dtype_name(code: int) -> str:
    return str(CODE_DTYPES.get(int(code), f"dtype#{code}")).replace("torch.", "")


def shape_signature(tensors: Sequence[torch.Tensor]) -> int:
    """A number that is equal on two ranks when their lists agree on count and trailing shapes."""
    text = ";".join(",".join(map(str, t.shape[1:])) for t in tensors)
    return zlib.crc32(f"{len(tensors)}|{text}".encode())


def header(numel: int, dtype: torch.dtype, count: int = 1, signature: int = 0) -> np.ndarray:
    """The four int64s every declaration starts with."""
    return np.array([numel, DTYPE_CODES.get(dtype, 0), count, signature], np.int64)


@functools.lru_cache(maxsize=256)
def _pattern_bits(units: int, srcs: tuple[int, ...], dsts: tuple[int, ...]) -> np.ndarray:
    """Packed source and destination bit maps (cached: a topology repeats a few patterns)."""
    flags = np.zeros((2, units), bool)
    flags[0, list(srcs)] = True
    flags[1, list(dsts)] = True
    return np.packbits(flags, axis=1).reshape(-1)


class Table:
    """Every rank's declaration of one exchange, one row per rank, parsed."""

    def __init__(self, rows: np.ndarray, units: int) -> None:
        head, nbits = HEADER * 8, (units + 7) // 8
        self.headers = np.ascontiguousarray(rows[:, :head]).view(np.int64)
        self.expects = np.unpackbits(rows[:, head : head + nbits], axis=1, count=units).astype(bool)
        self.sends = np.unpackbits(rows[:, head + nbits :], axis=1, count=units).astype(bool)

    @property
    def numels(self) -> np.ndarray:
        return self.headers[:, 0]

    @property
    def dtypes(self) -> np.ndarray:
        return self.headers[:, 1]


class _KnownGood:
    """Tables already found consistent, least recently used dropped first (shared by a process's engines)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._ok: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()  # virtual ranks check from many threads

    def __contains__(self, key: tuple) -> bool:
        with self._lock:
            if key in self._ok:
                self._ok.move_to_end(key)
                return True
            return False

    def add(self, key: tuple) -> None:
        with self._lock:
            self._ok[key] = None
            if len(self._ok) > self.limit:
                self._ok.popitem(last=False)


_KNOWN_GOOD = _KnownGood()


class TopologyPatterns:
    """Exchanges an engine's static topology gives (weights left out), found consistent once: not declared again.

    Every rank takes such an exchange's pattern from the same topology at the same
    round, so after one check of each (round, size, dtype) (which finds the ranks'
    topologies, sizes and dtypes in agreement) a repeat cannot disagree: it skips the
    gather, and costs what the bare exchange costs. Every rank learns the same keys
    from the same checks, so every rank skips the same calls. A program whose ranks
    leave the topology at different calls is not caught (it hangs, as raw MPI does;
    the hang watchdog names it); exchanges with explicit weights are always checked.
    """

    def __init__(self) -> None:
        self._known: set[tuple] = set()
        self._held: dict[int, Any] = {}  # the topologies keyed by id, kept alive so no other object takes the id
        self._specs: dict[tuple, Any] = {}  # (topology id, round) -> this rank's NeighborSpec, read-only

    def spec(self, topology: Any, t: int, make: Callable[[], Any]) -> Any:
        """This rank's part of the topology's round ``t`` (made once per round: a topology repeats)."""
        key = (id(topology), int(t) % int(getattr(topology, "period", 1) or 1))
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = make()
            self._held[key[0]] = topology
        return spec

    @staticmethod
    def key(topology: Any, t: int, numel: int, dtype: torch.dtype) -> tuple | None:
        """What identifies a repeat: the topology object, the round within its period, size and dtype."""
        if topology is None:
            return None
        period = int(getattr(topology, "period", 1) or 1)
        return (id(topology), int(t) % period, int(numel), dtype)

    def __contains__(self, key: tuple | None) -> bool:
        return key is not None and key in self._known

    def learner(self, key: tuple | None, topology: Any = None) -> Callable[[], None] | None:
        """What a declaration calls once found consistent: remember ``key`` (None: nothing to learn)."""
        if key is None:
            return None

        def learn() -> None:
            self._held[key[0]] = topology
            self._known.add(key)

        return learn


class Declaration:
    """This rank's declaration of a neighbor_allreduce: sources, destinations, size and dtype.

    ``row`` is what the engine gathers from every rank (one row each, in
    rank order); ``verdict(rows)`` says what is wrong, the same on every rank.
    """

    unit = "rank"

    def __init__(
        self,
        op: str,
        units: int,
        srcs: Sequence[int],
        dsts: Sequence[int],
        numel: int,
        dtype: torch.dtype,
        count: int = 1,
        signature: int = 0,
        label: str | None = None,
        learned: Callable[[], None] | None = None,
    ) -> None:
        self.op = op
        self.units = units
        self.label = label or op
        self.learned = learned  # told when the exchange is found consistent (TopologyPatterns)
        self.header = header(numel, dtype, count, signature)
        self.row = np.concatenate([self.header.view(np.uint8), _pattern_bits(units, tuple(srcs), tuple(dsts))])

    def table(self, rows: np.ndarray) -> Table:
        return Table(rows, self.units)

    def problems(self, table: Table) -> list[str]:
        """Every edge declared at both ends, carrying as many elements of one dtype as its receiver holds."""
        return pattern_problems(table.sends, table.expects, table.numels, table.dtypes, self.unit)

    def _cache_key(self, rows: np.ndarray) -> tuple:
        return (type(self).__name__, self.units, rows.tobytes())

    def verdict(self, rows: np.ndarray) -> list[str]:
        """What is wrong with the exchange whose declarations are ``rows`` (rank order); [] when nothing."""
        key = self._cache_key(rows)
        if key in _KNOWN_GOOD:
            problems = []
        else:
            problems = self.problems(self.table(rows))
            if not problems:
                _KNOWN_GOOD.add(key)
        if not problems and self.learned is not None:
            self.learned()
        return problems

    def verify(self, rows: np.ndarray) -> None:
        """Raise this exchange's CommError when the declarations disagree."""
        problems = self.verdict(rows)
        if problems:
            raise self.error(problems)

    def error(self, problems: list[str]) -> CommError:
        return mismatch_error(self.label, problems)


class GatherDeclaration(Declaration):
    """A neighbor_allgather's: its ends agree on dtype, count and trailing shapes; first dims may differ."""

    def __init__(self, units: int, srcs: Sequence[int], dsts: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        numel = sum(t.numel() for t in tensors)
        super().__init__(
            "neighbor_allgather", units, srcs, dsts, numel, tensors[0].dtype, len(tensors), shape_signature(tensors)
        )

    def problems(self, table: Table) -> list[str]:
        headers = table.headers
        problems = pattern_problems(table.sends, table.expects, None, table.dtypes, self.unit)
        for i, j in np.argwhere(table.sends.T & table.expects).tolist():
            if (headers[i, 2:] != headers[j, 2:]).any():
                problems.append(
                    f"rank {j} sends {headers[j, 2]} tensor(s) of trailing shapes #{headers[j, 3]} to rank {i}, "
                    f"which has {headers[i, 2]} of #{headers[i, 3]} (only first dims may differ)"
                )
        return problems


class MachineDeclaration(Declaration):
    """A hierarchical op's, keyed by machine: the same on every rank of a machine, consistent among machines."""

    unit = "machine"

    def __init__(
        self, machines: int, local_size: int, srcs: Sequence[int], dsts: Sequence[int], numel: int, dtype: torch.dtype
    ) -> None:
        super().__init__("hierarchical_neighbor_allreduce", machines, srcs, dsts, numel, dtype)
        self.local_size = local_size

    def _cache_key(self, rows: np.ndarray) -> tuple:
        return (*super()._cache_key(rows), self.local_size)

    def problems(self, table: Table) -> list[str]:
        headers, expects, sends, local = table.headers, table.expects, table.sends, self.local_size
        problems = []
        differs = (headers[:, 0] != headers[0, 0]) | (headers[:, 1] != headers[0, 1])
        if differs.any():
            bad = int(np.flatnonzero(differs)[0])
            problems.append(
                f"rank {bad} has {headers[bad, 0]} x {dtype_name(headers[bad, 1])}, "
                f"rank 0 has {headers[0, 0]} x {dtype_name(headers[0, 1])}"
            )
        for r in range(headers.shape[0]):
            lead = r - r % local
            if (expects[r] != expects[lead]).any() or (sends[r] != sends[lead]).any():
                problems.append(f"rank {r} declares other machine weights than rank {lead} of its machine")
        leaders = list(range(0, headers.shape[0], local))
        return problems + pattern_problems(sends[leaders], expects[leaders], unit=self.unit)


class WindowDeclaration(Declaration):
    """A win_create's: the window's edges, size and dtype as for neighbor_allreduce, and one name everywhere."""

    def __init__(self, units: int, srcs: Sequence[int], dsts: Sequence[int], flat: torch.Tensor, name: str) -> None:
        signature = zlib.crc32(name.encode())
        super().__init__("win_create", units, srcs, dsts, flat.numel(), flat.dtype, 1, signature, f"win_create({name!r})")

    def problems(self, table: Table) -> list[str]:
        problems = super().problems(table)
        names = table.headers[:, 3]
        if (names != names[0]).any():
            bad = int(np.flatnonzero(names != names[0])[0])
            problems.append(f"ranks disagree on the window name: rank {bad} names another window than rank 0")
        return problems


def allgather_problems(headers: np.ndarray, me: int) -> list[str]:
    """The collective allgather: every rank gives the list rank ``me`` gives, but for first dimensions.

    ``headers`` holds every rank's ``header(...)`` (one row per rank).
    """
    mine = headers[me]
    problems = []
    for r in np.flatnonzero((headers[:, 1:] != mine[1:]).any(axis=1)).tolist():
        theirs = headers[r]
        problems.append(
            f"rank {r} gives {theirs[2]} tensor(s) of {dtype_name(theirs[1])} (trailing shapes #{theirs[3]}), "
            f"rank {me} gives {mine[2]} of {dtype_name(mine[1])} (#{mine[3]}); "
            "allowed: the same list, only first dims may differ"
        )
    return problems


def pattern_problems(
    sends: np.ndarray,
    expects: np.ndarray,
    numels: Sequence[int] | None = None,
    dtypes: Sequence[int] | None = None,
    unit: str = "rank",
) -> list[str]:
    """What is wrong with one exchange's edges, seen from every participant's declaration.

    ``sends[j, i]``: j declared it sends to i; ``expects[i, j]``: i declared
    it receives from j. With ``numels``/``dtypes``, every edge must also move
    as many elements of one dtype as its receiver expects. Every rank that
    computes this from the same gathered declarations gets the same list,
    so every rank can raise the same error.
    """
    problems = []
    for i, j in np.argwhere(sends.T != expects).tolist():  # (receiver, sender) pairs
        if expects[i, j]:
            problems.append(f"{unit} {i} expects to receive from {unit} {j}, but {unit} {j} does not send to {unit} {i}")
        else:
            problems.append(f"{unit} {j} sends to {unit} {i}, but {unit} {i} does not expect to receive from {unit} {j}")
    edges = sends.T & expects  # (i, j): j sends to i and i expects it
    if numels is not None:
        numels = np.asarray(numels)
        for i, j in np.argwhere(edges & (numels[:, None] != numels[None, :])).tolist():
            problems.append(f"{unit} {j} sends {numels[j]} elements to {unit} {i}, which has {numels[i]}")
    if dtypes is not None:
        dtypes = np.asarray(dtypes)
        for i, j in np.argwhere(edges & (dtypes[:, None] != dtypes[None, :])).tolist():
            problems.append(f"{unit} {j} sends {dtype_name(dtypes[j])} to {unit} {i}, which has {dtype_name(dtypes[i])}")
    return problems


def mismatch_error(op: str, problems: list[str], limit: int = 4) -> CommError:
    """One clear message for a broken exchange (the first few problems, then a count)."""
    shown = "; ".join(problems[:limit])
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return CommError(f"{op}: send/receive declarations do not match: {shown}{more}")
