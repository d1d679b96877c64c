"""Allreduce-SGD on R ranks is single-process SGD on the union of the R mini-batches,
for our baseline (fused allreduce from backward hooks) and for torch's DistributedDataParallel."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from bfexp.models import build_model
from tests.mpi_helpers import run_ranks

STEPS, BATCH, LR, SEED = 15, 8, 0.3, 7
MODEL = dict(_target_="bfexp.models.MLP", hidden=[16], activation="tanh")

RANK_CODE = f"""
import torch, torch.nn.functional as F
from omegaconf import OmegaConf
from bfexp.algorithms import DDP, Allreduce
from bfexp.comm.mpi import MPIEngine
from bfexp.models import build_model
e = MPIEngine()
r = e.rank
out = {{}}
for cls in (Allreduce, DDP):
    name = cls.name
    model = build_model(OmegaConf.create({MODEL!r}), (5,), 3, seed={SEED}, dtype=torch.float64)
    # bucket_mb tiny: several buckets, each started from backward hooks
    opt = cls(torch.optim.SGD(model.parameters(), lr={LR}), e, None, model=model, bucket_mb=1e-4)
    g = torch.Generator().manual_seed(100 + r)
    for _ in range({STEPS}):
        x = torch.randn({BATCH}, 5, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, ({BATCH},), generator=g)
        opt.zero_grad()
        F.cross_entropy(opt.module(x), y).backward()
        opt.step()
    opt.close()
    out[name] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
emit(out)
"""


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.large)])  # .ci/run: 4 ranks too
def test_allreduce_sgd_equals_centralized_sgd(n, tmp_path):
    out = run_ranks(n, RANK_CODE, tmp_path)
    # The reference: one process, the union of every rank's batch each step.
    model = build_model(OmegaConf.create(MODEL), (5,), 3, seed=SEED, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(n)]
    for _ in range(STEPS):
        xs, ys = [], []
        for g in gens:
            xs.append(torch.randn(BATCH, 5, generator=g, dtype=torch.float64))
            ys.append(torch.randint(0, 3, (BATCH,), generator=g))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    expected = [p.detach().reshape(-1).numpy() for p in model.parameters()]
    for rank_out in out:
        for name in ("allreduce", "ddp"):  # ours and PyTorch's DistributedDataParallel
            for got, want in zip(rank_out[name], expected):
                np.testing.assert_allclose(got, want, atol=1e-10, rtol=0, err_msg=name)
