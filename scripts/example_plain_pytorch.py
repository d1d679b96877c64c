"""A plain PyTorch training loop made decentralized by wrapping its optimizer.

Run it on 4 MPI ranks (each rank trains on its own, differently distributed data):

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py scripts/example_plain_pytorch.py

Compared with single-process PyTorch, three lines change: make an engine
(who the other ranks are), pick a topology (who talks to whom), and wrap
the optimizer. The loop itself (zero_grad, forward, backward, step) stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bfexp.algorithms import ExactDiffusion
from bfexp.comm.mpi import MPIEngine
from bfexp.topology import SymmetricExp2


def rank_data(rank: int, samples: int = 512, features: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own classification data, shifted per rank (non-iid)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(samples, features, generator=g) + 0.5 * rank
    w = torch.randn(features, generator=torch.Generator().manual_seed(0))
    y = (x @ w > 0.5 * rank * w.sum()).long()
    return x, y


def main() -> None:
    engine = MPIEngine()  # 1. who the other ranks are
    topology = SymmetricExp2(engine.size, weights="metropolis")  # 2. who talks to whom
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = ExactDiffusion(local, engine, topology, model=model)  # 3. wrap the optimizer

    x, y = rank_data(engine.rank)
    g = torch.Generator().manual_seed(engine.rank)
    for step in range(300):  # the usual loop
        idx = torch.randint(0, len(y), (32,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
    optimizer.close()

    with torch.no_grad():
        full_loss = F.cross_entropy(model(x), y).item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean = engine.allreduce(params, op="avg")
    spread = float(engine.allreduce(((params - mean) ** 2).sum().reshape(1), op="avg"))
    print(f"rank {engine.rank}: loss on its own data {full_loss:.3f}; consensus distance {spread:.2e}", flush=True)


if __name__ == "__main__":
    main()
