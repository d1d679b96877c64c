"""A user's own engines, written outside bfexp/ as a user writes them: one class each, plus a YAML.

Each is a bfexp engine with an observable difference: it counts the ``allreduce`` calls it serves
and, when it closes, leaves ``<note>.rank<N>`` in the working folder with its class, its rank and
that count. Their own names (``counting_mpi``, ``counting_threads``) are what a summary calls them.
tests/test_user_engine.py runs them through `bfexp`, `bfexp-run` and ``import bfexp as bf``.
"""

from pathlib import Path

from bfexp.comm.mpi import MPIEngine
from bfexp.comm.threads import ThreadsEngine


class CountingMPI(MPIEngine):
    """The MPI engine (a process per rank, as its base says), counting its allreduce calls."""

    name = "counting_mpi"

    def __init__(self, note: str = "counted", **options) -> None:
        super().__init__(**options)
        self.note, self.allreduce_calls = note, 0

    def allreduce(self, tensors, op="avg"):
        self.allreduce_calls += 1
        return super().allreduce(tensors, op)

    def close(self) -> None:
        Path(f"{self.note}.rank{self.rank}").write_text(f"{type(self).__name__} {self.rank} {self.allreduce_calls}")
        super().close()


class CountingThreads(ThreadsEngine):
    """Virtual ranks (threads of one process, as its base says), each counting its allreduce calls."""

    name = "counting_threads"

    def __init__(self, world, rank, note: str = "counted", **options) -> None:
        super().__init__(world, rank, **options)
        self.note, self.allreduce_calls = note, 0

    def allreduce(self, tensors, op="avg"):
        self.allreduce_calls += 1
        return super().allreduce(tensors, op)

    def close(self) -> None:
        Path(f"{self.note}.rank{self.rank}").write_text(f"{type(self).__name__} {self.rank} {self.allreduce_calls}")
        super().close()
