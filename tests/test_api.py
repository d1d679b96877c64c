"""The one-import library (bfexp.api, `import bfexp as bf`), on virtual ranks in this process.

References are independent of the code: hand sums, numpy mixing-matrix products, RNG streams
drawn from fresh generators, the set arithmetic of a partition. MPI itself is exercised by
tests/test_bfexp_run.py (the same script on MPI and on virtual ranks gives the same numbers).
"""

import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bfexp
import bfexp as bf
from bfexp import api
from bfexp.algorithms import DSGD, DecentralizedOptimizer
from bfexp.errors import ConfigError
from bfexp.topology import Ring


def test_import_is_light_and_names_are_the_apis():
    """`import bfexp` pulls no torch (the CLI starts fast); its lazy names are exactly bfexp.api's."""
    code = "import sys, bfexp; assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"
    assert bfexp._API == set(api.__all__)
    assert bf.allreduce is api.allreduce and bf.DistributedOptimizer is api.DistributedOptimizer
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        bfexp.nonsense  # noqa: B018


def test_plain_process_is_one_rank_and_init_checks():
    """Outside a launcher a script is one rank (no MPI started); asking for more says how to get them."""
    api.shutdown()
    try:
        assert api.detect_engine() == "threads"
        e = bf.init()
        assert (bf.rank(), bf.size(), bf.local_size(), e.name) == (0, 1, 1, "threads")
        assert bf.init() is e and bf.engine() is e  # idempotent
        assert torch.equal(bf.allreduce(torch.tensor([2.0, 3.0])), torch.tensor([2.0, 3.0]))
        with pytest.raises(ConfigError, match="size=4"):
            bf.init(size=4)
        with pytest.raises(ConfigError, match="engine='mpi'"):
            bf.init(engine="mpi")
    finally:
        api.shutdown()
    with pytest.raises(ConfigError, match=r"bf.spawn\(fn, size=4\)"):
        bf.init(size=4)


def test_spawn_each_thread_answers_for_its_rank():
    """Virtual ranks: rank/size/machines per thread; operations reach the rank's engine (hand sums, numpy W X)."""

    def job():
        x = torch.tensor([float(bf.rank() + 1)], dtype=torch.float64)
        total = float(bf.allreduce(x, op="sum"))
        r, n = bf.rank(), bf.size()
        # ring with 1/3 weights, given per call
        peers = [(r - 1) % n, (r + 1) % n]
        mixed = float(bf.neighbor_allreduce(x, 1 / 3, {p: 1 / 3 for p in peers}, peers))
        return (r, n, bf.local_rank(), bf.local_size(), bf.machine_rank(), bf.machine_size(), total, mixed,
                bf.engine() is bf.init())

    out = bf.spawn(job, 6, ranks_per_machine=3)
    w = np.zeros((6, 6))
    for i in range(6):
        w[i, [i, (i - 1) % 6, (i + 1) % 6]] = 1 / 3
    expected_mix = w @ np.arange(1.0, 7.0)
    for r, (rank, n, lr, ls, m, ms, total, mixed, same) in enumerate(out):
        assert (rank, n, lr, ls, m, ms, total, same) == (r, 6, r % 3, 3, r // 3, 2, 21.0, True)
        assert mixed == pytest.approx(expected_mix[r], abs=1e-14)


def test_spawn_gives_each_rank_its_own_global_rngs():
    """Interleaved at communication calls, each rank still draws its own torch/numpy/random streams,
    as separate MPI processes would: the same numbers as a fresh generator seeded alike."""

    def job():
        torch.manual_seed(100 + bf.rank())
        np.random.seed(200 + bf.rank())
        random.seed(300 + bf.rank())
        draws = []
        for _ in range(3):
            draws.append((torch.rand(2).tolist(), np.random.rand(2).tolist(), [random.random()]))
            bf.barrier()  # every rank hands its turn on here
            bf.allreduce(torch.zeros(1))
        return draws

    out = bf.spawn(job, 4)
    for r in range(4):
        g, rs, py = torch.Generator().manual_seed(100 + r), np.random.RandomState(200 + r), random.Random(300 + r)
        expected = [(torch.rand(2, generator=g).tolist(), rs.rand(2).tolist(), [py.random()]) for _ in range(3)]
        assert out[r] == expected


def test_spawn_reraises_the_failing_rank_and_ends_the_others():
    def job():
        if bf.rank() == 1:
            raise KeyError("rank one broke")
        bf.allreduce(torch.ones(1))  # would wait forever for rank 1
        return "unreachable"

    with pytest.raises(KeyError, match="rank one broke") as info:
        bf.spawn(job, 3)
    assert info.value.bfexp_rank == 1
    assert any("virtual rank 1 of 3" in note for note in info.value.__notes__)


def test_shard_splits_datasets_and_loaders_by_rank():
    """iid parts are disjoint, even and cover the data; sorted gives each rank a label-sorted run;
    a loader keeps batch size and shuffling over its part."""
    n = 103
    labels = torch.arange(n) % 5
    data = TensorDataset(torch.arange(n, dtype=torch.float32), labels)

    def job():
        part = bf.shard(data)
        by_label = bf.shard(data, partition="sorted")
        loader = bf.shard(DataLoader(data, batch_size=7, shuffle=True))
        plain = bf.shard(DataLoader(data, batch_size=5))
        seen = [int(v) for x, _ in loader for v in x]
        return (sorted(int(data[i][0]) for i in part.indices), [int(labels[i]) for i in by_label.indices],
                loader.batch_size, type(loader.sampler).__name__, seen, type(plain.sampler).__name__)

    out = bf.spawn(job, 4)
    parts = [set(o[0]) for o in out]
    assert set().union(*parts) == set(range(n)) and sum(len(p) for p in parts) == n
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]
    runs = [o[1] for o in out]
    assert all(max(runs[r]) <= min(runs[r + 1]) for r in range(3))  # contiguous runs of the sorted labels
    for o, p in zip(out, parts):
        assert o[2] == 7 and o[3] == "RandomSampler" and sorted(o[4]) == sorted(p) and o[5] == "SequentialSampler"
    with pytest.raises(ConfigError, match="partition='bogus'"):
        bf.spawn(lambda: bf.shard(data, partition="bogus"), 1)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def test_distributed_optimizer_broadcasts_the_start_and_is_a_torch_optimizer():
    """Ranks seeded differently start from rank 0's parameters, buffers and momentum; torch sees an
    Optimizer (StepLR, state_dict); a foreign attribute is refused by name."""
    reference = _model(0)

    def job(broadcast):
        model = _model(bf.rank())
        local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if bf.rank() == 0:  # rank 0 alone has momentum state already
            model(torch.ones(2, 3)).sum().backward()
            local.step()
        start = [p.detach().clone() for p in model.parameters()]
        opt = bf.DistributedOptimizer(local, model, algorithm="dsgd", topology="ring", broadcast_initial=broadcast)
        after = [p.detach().clone() for p in model.parameters()]
        states = len(local.state)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model.train()
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
            scheduler.step()
        with pytest.raises(AttributeError, match="'self_weight'"):
            opt.self_weight = 0.5
        opt.communication_period = 1  # one of its options: fine
        state = opt.state_dict()
        opt.load_state_dict(state)
        return (start, after, states, isinstance(opt, torch.optim.Optimizer), opt.param_groups is local.param_groups,
                local.param_groups[0]["lr"], [b.clone() for b in model.buffers()], type(opt).__name__,
                state["iteration"])

    out = bf.spawn(job, 3, args=(True,))
    ref_local = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)  # rank 0's start: one step from seed 0
    reference(torch.ones(2, 3)).sum().backward()
    ref_local.step()
    ref = [p.detach() for p in reference.parameters()]
    for start, after, states, is_opt, shared, lr, _, name, iteration in out:
        assert all(torch.equal(a, b) for a, b in zip(after, ref))
        assert states == len(ref) and is_opt and shared and name == "DSGD" and iteration == 2
        assert lr == pytest.approx(0.1 * 0.25)
    assert not all(torch.equal(a, b) for a, b in zip(out[1][0], ref))  # rank 1 did start elsewhere

    kept = bf.spawn(job, 3, args=(False,))
    for start, after, states, *_ in kept:
        assert all(torch.equal(a, b) for a, b in zip(start, after))
    assert [k[2] for k in kept] == [len(ref), 0, 0]


def test_distributed_optimizer_by_name_is_the_runners_rule():
    """algorithm="dsgd" topology="ring" with options: one step equals numpy's W (x - lr g) (adapt, then combine)."""
    n, lr = 5, 0.1
    x0 = np.arange(n, dtype=np.float64) + 1.0

    def job(style):
        x = nn.Parameter(torch.tensor([x0[bf.rank()]], dtype=torch.float64))
        opt = bf.DistributedOptimizer(torch.optim.SGD([x], lr=lr), algorithm="dsgd", topology="ring", style=style,
                                      overlap=False, broadcast_initial=False)
        opt.zero_grad()
        (0.5 * x**2).sum().backward()  # gradient x
        opt.step()
        return float(x.detach()), type(opt).__name__, opt.style

    w = np.zeros((n, n))
    for i in range(n):
        w[i, [i, (i - 1) % n, (i + 1) % n]] = 1 / 3
    out = bf.spawn(job, n, args=("atc",))
    np.testing.assert_allclose([o[0] for o in out], w @ (x0 - lr * x0), rtol=0, atol=1e-14)
    assert {o[1:] for o in out} == {("DSGD", "atc")}


def test_distributed_optimizer_takes_objects_and_refuses_bad_names():
    def job():
        x = nn.Parameter(torch.ones(2))
        by_class = bf.DistributedOptimizer(torch.optim.SGD([x], lr=0.1), algorithm=DSGD, topology=Ring)
        y = nn.Parameter(torch.ones(2))
        by_object = bf.DistributedOptimizer(torch.optim.SGD([y], lr=0.1), algorithm="push_sum",
                                            topology=Ring(bf.size(), weights="column"))
        errors = []
        bad = ({"algorithm": "no_such_rule"}, {"topology": "no_such_graph"}, {"stlye": "awc", "algorithm": "dsgd"})
        for kwargs in bad:
            try:
                bf.DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), **kwargs)
            except ConfigError as e:
                errors.append(str(e))
        return type(by_class).__name__, type(by_object).__name__, isinstance(by_object, DecentralizedOptimizer), errors

    (a, b, ok, errors), _ = bf.spawn(job, 2)
    assert (a, b, ok) == ("DSGD", "PushSum", True)
    assert errors[0].startswith("algorithm=no_such_rule; allowed:") and "exact_diffusion" in errors[0]
    assert errors[1].startswith("topology=no_such_graph; allowed:") and "ring" in errors[1]
    assert "algorithm.stlye" in errors[2] and "style" in errors[2]
