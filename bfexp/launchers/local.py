"""Every rank on this machine: ``mpiexec -n R`` (oversubscribed when ranks outnumber cores)."""

from __future__ import annotations

from typing import ClassVar, Sequence

from bfexp.launchers.base import Launcher, find_mpiexec

__all__ = ["Local"]


class Local(Launcher):
    """``mpiexec --oversubscribe -n R`` on this machine (the venv's Open MPI)."""

    name: ClassVar[str] = "local"
    on_this_machine: ClassVar[bool] = True

    def command(self, ranks: int, program: Sequence[str], mpiexec_args: Sequence[str] = ()) -> list[str]:
        return [find_mpiexec(), "--oversubscribe", "-n", str(ranks), *map(str, mpiexec_args), *program]

    def check(self, ranks: int) -> None:
        find_mpiexec()
