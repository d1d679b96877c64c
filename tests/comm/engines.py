"""Engines the contract suite runs against: one entry each in ENGINE_RUNNERS.

How to plug in an engine (no test code is written twice):

1. Write ``run_<engine>(size, tmp_path) -> list[dict]``: start ``size`` ranks
   of your engine, build the engine on each with
   ``ranks_per_machine=contract.ranks_per_machine(size)``, call
   ``contract.run_contract(engine)`` on every rank, and return the results
   indexed by rank. Spawn once per size: the suite caches the results and
   runs every check on them. Call ``pytest.skip("why")`` inside the runner
   where the engine cannot run here (no GPU, too few devices for ``size``).
2. Add it to ENGINE_RUNNERS below. test_contract.py then runs every check
   for every size in contract.SIZES against numpy references.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from tests.mpi_helpers import run_ranks

REPO = Path(__file__).resolve().parents[2]

EngineRunner = Callable[[int, Path], list]

MPI_CODE = """
from mpi4py import MPI
from bfexp.comm.mpi import MPIEngine
from tests.comm.contract import ranks_per_machine, run_contract
engine = MPIEngine(ranks_per_machine=ranks_per_machine(MPI.COMM_WORLD.Get_size()))
emit(run_contract(engine))
engine.close()
"""


def run_mpi(size: int, tmp_path: Path) -> list:
    """Real MPI processes under mpiexec."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return run_ranks(size, MPI_CODE, tmp_path, timeout=300, env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1"})


NCCL_CODE = """
from mpi4py import MPI
from bfexp.comm.nccl import NCCLEngine
from tests.comm.contract import ranks_per_machine, run_contract
engine = NCCLEngine(ranks_per_machine=ranks_per_machine(MPI.COMM_WORLD.Get_size()))
emit(run_contract(engine))
engine.close()
"""


def run_nccl(size: int, tmp_path: Path) -> list:
    """One MPI rank per GPU of this machine, NCCL through CuPy; skipped where that cannot run."""
    import pytest

    from bfexp.comm.nccl import nccl_available

    ok, why = nccl_available(size)  # every rank is on this machine, whatever machines the suite emulates
    if not ok:
        pytest.skip(f"engine=nccl with {size} ranks cannot run here: {why}")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return run_ranks(size, NCCL_CODE, tmp_path, timeout=300, env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1"})


def run_threads(size: int, tmp_path: Path) -> list:
    """Virtual ranks: threads of this test process, one torch thread between them (as each MPI rank has)."""
    import torch

    from bfexp.comm.threads import run_threads as start_threads
    from tests.comm.contract import ranks_per_machine, run_contract

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return start_threads(size, run_contract, ranks_per_machine=ranks_per_machine(size), timeout=300)
    finally:
        torch.set_num_threads(saved)


ENGINE_RUNNERS: dict[str, EngineRunner] = {
    "mpi": run_mpi,
    "nccl": run_nccl,
    "threads": run_threads,
}
