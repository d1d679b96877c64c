"""What every engine shares below the contract, checked without a GPU: declarations, gathered buffers, engine facts.

bfexp.comm.declarations is the one judge of who sends what to whom (MPI,
NCCL and virtual ranks all gather the same rows and run these checks);
``ungather`` is the one layout of a gathered list. The contract suite
(test_contract.py) checks the same behaviour end to end on real ranks.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from bfexp.comm import engine_class
from bfexp.comm.declarations import (
    Declaration,
    GatherDeclaration,
    MachineDeclaration,
    WindowDeclaration,
    allgather_problems,
    header,
    shape_signature,
)
from bfexp.comm.engine import local_size_for, ungather
from bfexp.errors import ConfigError
from tests.comm.engines import REPO
from tests.mpi_helpers import run_ranks


def rows(*declarations: Declaration) -> np.ndarray:
    """The table an engine gathers: one declaration row per rank, in rank order."""
    return np.stack([d.row for d in declarations])


def test_gathered_rows_are_cut_and_concatenated_per_tensor():
    # Two sources sending two tensors shaped (rows, 2) and (rows,): 1 + 3 rows, then 2 + 1 rows (padded buffers).
    like = [torch.empty(5, 2), torch.empty(4)]
    buffers = [torch.tensor([1.0, 2, 3, 4, 5, 0, 0]), torch.tensor([6.0, 7, 8, 9, 10, 0, 0])]
    first, second = ungather(buffers, [(1, 3), (2, 1)], like)
    assert first.tolist() == [[1, 2], [6, 7], [8, 9]]
    assert second.tolist() == [3, 4, 5, 10]
    (scalars,) = ungather([torch.tensor([5.0]), torch.tensor([6.0])], [(1,), (1,)], [torch.tensor(0.0)])
    assert scalars.tolist() == [5, 6]  # 0-d tensors gather into 1-d
    (one,) = ungather([buffers[0]], [(2,)], [torch.empty(1, 2)])
    assert one.data_ptr() != buffers[0].data_ptr(), "a result never aliases what a sender sent"
    (none,) = ungather([], [], [torch.empty(3, 2, dtype=torch.float64)])
    assert none.shape == (0, 2) and none.dtype == torch.float64


def test_gather_and_machine_declarations_name_the_problem():
    # Ranks 1 and 2 send to rank 0; first dims differ, which is allowed.
    def gather(r: int, t: torch.Tensor) -> GatherDeclaration:
        return GatherDeclaration(3, [1, 2] if r == 0 else [], [] if r == 0 else [0], [t])

    good = [gather(r, torch.zeros(r + 1, 2)) for r in range(3)]
    assert good[0].verdict(rows(*good)) == []
    bad = good[:2] + [gather(2, torch.zeros(1, 3))]
    ours, theirs = shape_signature([torch.zeros(1, 2)]), shape_signature([torch.zeros(1, 3)])
    assert bad[0].verdict(rows(*bad)) == [
        f"rank 2 sends 1 tensor(s) of trailing shapes #{theirs} to rank 0, which has 1 of #{ours} (only first dims may differ)"
    ]
    # Two machines of two ranks; every rank of machine m receives from and sends to machine 1 - m.
    def machine(r: int, sends: bool = True) -> MachineDeclaration:
        other = 1 - r // 2
        return MachineDeclaration(2, 2, [other], [other] if sends else [], 7, torch.float32)

    ranks = [machine(r) for r in range(4)]
    assert ranks[0].verdict(rows(*ranks)) == []
    ranks[1] = machine(1, sends=False)  # rank 1 forgets to send
    assert ranks[0].verdict(rows(*ranks)) == ["rank 1 declares other machine weights than rank 0 of its machine"]
    assert str(ranks[0].error(["x"])) == "hierarchical_neighbor_allreduce: send/receive declarations do not match: x"


def test_window_and_allgather_declarations_name_the_problem():
    flat = torch.zeros(4)
    ring = [WindowDeclaration(2, [1 - r], [1 - r], flat, "w") for r in range(2)]
    assert ring[0].verdict(rows(*ring)) == []
    other = ring[:1] + [WindowDeclaration(2, [0], [0], flat, "v")]
    problems = other[0].verdict(rows(*other))
    assert problems == ["ranks disagree on the window name: rank 1 names another window than rank 0"]
    assert str(other[1].error(problems)).startswith("win_create('v'): send/receive declarations do not match: ")

    heads = np.stack([header(6, torch.float32, 1, 5), header(2, torch.float32, 1, 5), header(6, torch.float64, 1, 5)])
    assert allgather_problems(heads[:2], 0) == []  # only the numbers of rows differ
    assert allgather_problems(heads, 0) == [
        "rank 2 gives 1 tensor(s) of float64 (trailing shapes #5), rank 0 gives 1 of float32 (#5); "
        "allowed: the same list, only first dims may differ"
    ]


MISMATCH = """
import torch
from mpi4py import MPI
from bfexp.comm.declarations import Declaration
from bfexp.comm.mpi import gather_declarations
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()

def check(srcs, dsts, numel):
    declaration = Declaration("neighbor_allreduce", n, srcs, dsts, numel, torch.float32)
    problems = declaration.verdict(gather_declarations(comm, declaration))
    return str(declaration.error(problems)) if problems else None

ring = ([(r - 1) % n], [(r + 1) % n])
out = {"ok": check(*ring, 4)}
out["pattern"] = check(ring[0], [] if r == 1 else ring[1], 4)  # rank 2 still expects from rank 1
out["size"] = check(*ring, 5 if r == 1 else 4)
emit(out)
"""


def test_mismatched_declarations_give_every_rank_the_same_error(tmp_path):
    """The host-side check NCCL runs before anything reaches NCCL (and MPI runs alongside its data)."""
    out = run_ranks(3, MISMATCH, tmp_path, env={"PYTHONPATH": str(REPO)})
    prefix = "neighbor_allreduce: send/receive declarations do not match: "
    for o in out:
        assert o["ok"] is None
        assert o["pattern"] == prefix + "rank 2 expects to receive from rank 1, but rank 1 does not send to rank 2"
        assert o["size"] == prefix + "rank 0 sends 4 elements to rank 1, which has 5; rank 1 sends 5 elements to rank 2, which has 4"


# ------------------------------------------------------------------ engines by name, their facts


def test_engine_classes_by_name_and_their_facts():
    classes = {name: engine_class(name) for name in ("mpi", "nccl", "threads", "stacked")}
    facts = {name: (c.name, c.virtual, c.processes, c.device_type) for name, c in classes.items()}
    assert facts == {
        "mpi": ("mpi", False, True, "cpu"),
        "nccl": ("nccl", False, True, "cuda"),
        "threads": ("threads", True, False, "cpu"),
        "stacked": ("stacked", True, False, "cpu"),
    }
    assert engine_class("threads").available(1000) == (True, "")
    with pytest.raises(ConfigError, match=r"^engine=gloo; allowed: a shipped option \(mpi, nccl, stacked, threads\) "
                                          r"or an Engine class's path, e\.g\. mylab\.engines\.MyEngine$"):
        engine_class("gloo")
    with pytest.raises(ConfigError, match=r"^engine=os\.path is not an Engine class; allowed: "):
        engine_class("os.path")
    with pytest.raises(ConfigError, match=r"^engine.ranks_per_machine=3; allowed: 0 \(one machine\) or a divisor of ranks=8$"):
        local_size_for(8, 3)
    assert local_size_for(8, 0) == 8 and local_size_for(8, 2) == 2


def test_engine_modules_import_without_initializing_mpi_or_cuda():
    """The driver imports engine classes; it must never become an MPI rank (mpiexec cannot nest)."""
    code = (
        "import sys\n"
        "from bfexp.comm import engine_class\n"
        "assert 'torch' not in sys.modules, 'bfexp.comm alone imports torch'\n"
        "for name in ('mpi', 'nccl', 'threads'):\n"
        "    engine_class(name)\n"
        "print(sorted(m for m in ('mpi4py.MPI', 'cupy') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
