"""A plain PyTorch training loop made decentralized by wrapping its optimizer.

Run it on 4 MPI ranks (each rank trains on its own, differently distributed data),
or on 4 virtual ranks in one process:

    .venv/bin/python -m bfexp.run -n 4 python scripts/example_plain_pytorch.py
    .venv/bin/python -m bfexp.run -n 4 --engine threads python scripts/example_plain_pytorch.py

Compared with single-process PyTorch, two lines change: import bfexp, and
wrap the optimizer with an algorithm and a topology (by name, or objects).
Who the other ranks are comes from the launcher. The loop itself
(zero_grad, forward, backward, step) stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import bfexp as bf


def rank_data(rank: int, samples: int = 512, features: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own classification data, shifted per rank (non-iid)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(samples, features, generator=g) + 0.5 * rank
    w = torch.randn(features, generator=torch.Generator().manual_seed(0))
    y = (x @ w > 0.5 * rank * w.sum()).long()
    return x, y


def main() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))  # rank 0's starts everywhere
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = bf.DistributedOptimizer(local, model, algorithm="exact_diffusion", topology="symmetric_exp2")

    x, y = rank_data(bf.rank())
    g = torch.Generator().manual_seed(bf.rank())
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
    mean = bf.allreduce(params, op="avg")
    spread = float(bf.allreduce(((params - mean) ** 2).sum().reshape(1), op="avg"))
    print(f"rank {bf.rank()}: loss on its own data {full_loss:.3f}; consensus distance {spread:.2e}", flush=True)


if __name__ == "__main__":
    main()
