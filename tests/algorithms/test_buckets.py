"""Gradient buckets: a model that fits one bucket registers no per-parameter hooks (its bucket can
only be ready when backward has ended, so step() starts it); one cut into several buckets starts
them during backward, in bucket order. Both give the same parameters as the un-overlapped step."""

import torch
import torch.nn.functional as F

from bfexp.algorithms import DSGD
from bfexp.algorithms.buckets import GradBuckets
from bfexp.comm.threads import ThreadsEngine, ThreadWorld
from bfexp.topology import FullyConnected


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def test_one_bucket_has_no_hooks_and_starts_in_collect():
    net = model()
    params = list(net.parameters())
    fired = []
    one = GradBuckets(params, 1 << 20, lambda b: fired.append(("one", b.index)))
    many = GradBuckets(params, 1, lambda b: fired.append(("many", b.index)))  # one parameter per bucket
    assert one._hooks == [] and len(one.buckets) == 1
    assert len(many._hooks) == len(params) and len(many.buckets) == len(params)
    one.arm()
    many.arm()
    F.cross_entropy(net(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
    assert fired == [("many", k) for k in range(len(params))]  # during backward, in order
    assert [b.index for b, _ in one.collect()] == [0] and fired[-1] == ("one", 0)


def test_overlapped_dsgd_on_one_rank_equals_the_plain_step():
    """atc with overlap (one bucket: no hooks; tiny buckets: hooks) and without: the same parameters."""
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
    results = []
    for options in ({"overlap": True}, {"overlap": True, "bucket_mb": 1e-9}, {"overlap": False}):
        net = model()
        opt = DSGD(torch.optim.SGD(net.parameters(), lr=0.1), ThreadsEngine(ThreadWorld(1), 0), FullyConnected(1),
                   model=net, **options)
        for _ in range(5):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        opt.close()
    # the plain torch loop, by hand
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(5):
        sgd.zero_grad()
        F.cross_entropy(net(x), y).backward()
        sgd.step()
    plain = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    for got in results:
        assert torch.equal(got, plain)


def test_a_forward_pre_hook_only_where_an_iteration_has_work_before_forward():
    """A hook on the model sends every forward call down torch's slow path, so the wrapper adds one only where
    begin_iteration has work that must precede forward: cta's combine, awc's exchange, hooks to arm for
    several buckets, a subclass's own begin_iteration. atc with the model in one bucket has none, and
    skipping zero_grad() still trains as the plain step does (step() starts the bucket)."""
    class Counting(DSGD):
        def begin_iteration(self) -> None:
            super().begin_iteration()

    def hooked(cls=DSGD, **options) -> bool:
        net = model()
        opt = cls(torch.optim.SGD(net.parameters(), lr=0.1), ThreadsEngine(ThreadWorld(1), 0), FullyConnected(1),
                  model=net, **options)
        try:
            return len(net._forward_pre_hooks) == 1
        finally:
            opt.close()

    assert not hooked(style="atc") and not hooked(style="atc", overlap=False)
    assert hooked(style="atc", bucket_mb=1e-9) and hooked(style="cta") and hooked(style="awc")
    assert hooked(Counting, style="atc")
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
    net, plain = model(), model()
    opt = DSGD(torch.optim.SGD(net.parameters(), lr=0.1), ThreadsEngine(ThreadWorld(1), 0), FullyConnected(1),
               model=net)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):  # no zero_grad(): gradients accumulate on both sides alike
        F.cross_entropy(net(x), y).backward()
        opt.step()
        F.cross_entropy(plain(x), y).backward()
        sgd.step()
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))
