"""engine=stacked (bfexp.comm.stacked) against independent references.

* its operations on a (elements, ranks) tensor equal numpy's W(t) @ X, the mean, the root's row;
* one torch optimizer over stacked parameters equals n optimizers, one per rank's slice;
* every stackable algorithm, run on least squares in float64, equals the same algorithm on
  engine=threads (virtual ranks as threads, which equal MPI) to 1e-12 over 50 steps, on static,
  time-varying and directed graphs;
* the worker's real training (mlp on digits, float64) equals engine=threads to 1e-12;
* what cannot be stacked is refused by the CLI in one line, exit 2, before anything runs.

The default suite runs a few small cases in this interpreter; every algorithm on every graph kind,
and engine=auto's choice at scale, are ``large`` (.ci/run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bfexp.comm.stacked import StackedEngine, StackedModel
from bfexp.comm.threads import run_threads
from bfexp.models import CNN, MLP, LogReg
from tests.algorithms import configs, lsq
from tests.algorithms.test_least_squares import DIRECTED, ONE_PEER, ONE_PEER_PUSH, RING, SEXP2
from tests.cli_in_process import call, ran

N, STEPS, TOL = lsq.RANKS, 50, 1e-12
DIRECTED_ROW = {**DIRECTED, "weights": "uniform"}  # the same one-way graph, receivers averaging (row stochastic)
EXP2_TOPOLOGY = {"_target_": "bfexp.topology.Exp2"}


# ---------------------------------------------------------------- engine operations vs numpy


def test_operations_equal_numpy():
    """neighbor_allreduce of round t = W(t) X (X: ranks as rows in numpy, as the last dim here); allreduce,
    broadcast, allgather, hierarchical: what each rank of another engine gets."""
    from bfexp.topology import OnePeerExp2, Ring

    n = 8
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 3, 2))  # rank r's tensor is X[r], shape (3, 2)
    stacked = torch.tensor(np.moveaxis(X, 0, -1))  # (3, 2, n)
    engine = StackedEngine(size=n, ranks_per_machine=4)
    topology = OnePeerExp2(n)
    engine.set_topology(topology)
    for t in range(3):
        W = topology.mixing_matrix(t)
        got = engine.neighbor_allreduce(stacked, t=t)
        np.testing.assert_allclose(np.moveaxis(got.numpy(), -1, 0), np.einsum("ij,jab->iab", W, X), rtol=0, atol=1e-14)
    half = stacked.clone()
    engine.imix_(half, topology, 1, scale=0.5).wait()
    W = 0.5 * (np.eye(n) + topology.mixing_matrix(1))
    np.testing.assert_allclose(np.moveaxis(half.numpy(), -1, 0), np.einsum("ij,jab->iab", W, X), rtol=0, atol=1e-14)
    mean = engine.allreduce(stacked)
    np.testing.assert_allclose(mean.numpy(), np.broadcast_to(X.mean(0)[..., None], stacked.shape), rtol=0, atol=1e-14)
    total = engine.allreduce([stacked, stacked[:1]], op="sum")
    np.testing.assert_allclose(total[1].numpy()[..., 3], X.sum(0)[:1], rtol=0, atol=1e-13)
    np.testing.assert_array_equal(engine.broadcast(stacked, root=5).numpy()[..., 2], X[5])
    gathered = engine.allgather(stacked)  # every rank: the ranks' (3, 2) tensors along dim 0
    np.testing.assert_array_equal(gathered.numpy()[..., 7], X.reshape(n * 3, 2))
    machines = Ring(2)
    engine.set_machine_topology(machines)
    got = engine.hierarchical_neighbor_allreduce(stacked)
    M = machines.mixing_matrix(0)
    means = X.reshape(2, 4, 3, 2).mean(1)  # each machine's average
    want = np.repeat(np.einsum("ij,jab->iab", M, means), 4, axis=0)
    np.testing.assert_allclose(np.moveaxis(got.numpy(), -1, 0), want, rtol=0, atol=1e-14)
    assert engine.bytes_sent > 0
    with pytest.raises(ValueError, match="the 8 ranks as its last dimension"):
        engine.allreduce(torch.zeros(3))
    with pytest.raises(ValueError, match="no stacked form"):
        engine.neighbor_allreduce(stacked, 0.5, {1: 0.5}, [1])
    with pytest.raises(ValueError, match="no one-sided windows"):
        engine.win_create(stacked, "w")


# ---------------------------------------------------------------- optimizers over the stack


@pytest.mark.parametrize("name,options", [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
])
def test_one_optimizer_over_the_stack_is_one_per_rank(name, options):
    n, gen = 5, torch.Generator().manual_seed(1)
    start = torch.randn(4, 3, n, dtype=torch.float64, generator=gen)
    grads = [torch.randn(4, 3, n, dtype=torch.float64, generator=gen) for _ in range(6)]
    stacked = nn.Parameter(start.clone())
    ranks = [nn.Parameter(start[..., r].clone()) for r in range(n)]
    one = getattr(torch.optim, name)([stacked], **options)
    many = [getattr(torch.optim, name)([p], **options) for p in ranks]
    for g in grads:
        stacked.grad = g.clone()
        one.step()
        for r, (p, opt) in enumerate(zip(ranks, many)):
            p.grad = g[..., r].clone()
            opt.step()
    assert torch.equal(stacked.detach(), torch.stack([p.detach() for p in ranks], -1))


# ---------------------------------------------------------------- algorithms: stacked = threads

# (id, algorithm, topology, local optimizer, options)
CASES = [
    ("dsgd-atc-ring-momentum", "dsgd", RING, "momentum", {}),
    ("exact_diffusion-sexp2-adam", "exact_diffusion", SEXP2, "adam", {}),
    ("gradient_tracking-one_peer", "gradient_tracking", ONE_PEER, "sgd", {}),
    ("push_sum-directed", "push_sum", DIRECTED, "sgd", {}),
    ("allreduce-adamw", "allreduce", RING, "adamw", {}),
    ("choco_sgd-top_k-ring", "choco_sgd", RING, "sgd", {"compressor": {"_target_": "bfexp.compression.TopK",
                                                                       "ratio": 0.5}}),
    # issue 44: its second gradient read (nesterov) came back flat, not in the stacked layout
    ("qg_dsgdm-nesterov", "qg_dsgdm", RING, "momentum", {"nesterov": True}),
]
LARGE_CASES = [
    ("dsgd-awc-one_peer", "dsgd", ONE_PEER, "sgd", {"style": "awc"}),
    ("dsgd-cta-directed", "dsgd", DIRECTED_ROW, "momentum", {"style": "cta"}),
    ("dsgd-atc-exp2-overlap-off", "dsgd", EXP2_TOPOLOGY, "sgd", {"overlap": False}),
    ("dsgd-global_average_every", "dsgd", ONE_PEER, "sgd", {"global_average_every": 3}),
    ("dsgd-local_sgd", "dsgd", RING, "sgd", {"communication_period": 3}),
    ("exact_diffusion-ring", "exact_diffusion", RING, "sgd", {}),
    ("gradient_tracking-atc-sexp2", "gradient_tracking", SEXP2, "adam", {"form": "atc"}),
    ("gradient_tracking-ring-fused", "gradient_tracking", RING, "sgd", {}),
    ("push_sum-one_peer", "push_sum", ONE_PEER_PUSH, "momentum", {}),
    ("push_diging-directed", "push_diging", DIRECTED, "sgd", {}),
    ("push_diging-one_peer", "push_diging", ONE_PEER_PUSH, "sgd", {}),
    ("allreduce-local_sgd", "allreduce", RING, "sgd", {"communication_period": 4}),
    ("diloco", "diloco", RING, "adamw", {"communication_period": 5}),
    ("diloco-allreduce", "diloco", RING, "sgd", {"communication_period": 5, "average": "allreduce"}),
    ("slowmo", "slowmo", ONE_PEER, "momentum", {"communication_period": 4}),
    ("qg_dsgdm", "qg_dsgdm", RING, "sgd", {}),
    ("qg_dsgdm-one_peer", "qg_dsgdm", ONE_PEER, "sgd", {}),
    ("choco_sgd-random_k-sexp2", "choco_sgd", SEXP2, "momentum",
     {"compressor": {"_target_": "bfexp.compression.RandomK", "ratio": 0.5, "seed": 3}}),
    ("choco_sgd-qsgd-ring", "choco_sgd", RING, "sgd", {"compressor": "qsgd", "gamma": 0.5}),
    ("choco_sgd-sign-global_average_every", "choco_sgd", RING, "adam", {"compressor": "sign",
                                                                        "global_average_every": 4}),
]


class LeastSquares(nn.Module):
    """f_i(x) = 1/2 ||A_i x - b_i||^2 with x as two parameters (so the rules cut two buckets). ``ranks``:
    every rank's x stacked along the last dimension, the loss summed over ranks."""

    def __init__(self, A: np.ndarray, b: np.ndarray, x0: np.ndarray, stacked: bool) -> None:
        super().__init__()
        self.A = torch.tensor(A, dtype=torch.float64)
        self.b = torch.tensor(b, dtype=torch.float64)
        x = torch.tensor(x0.T if stacked else x0, dtype=torch.float64)
        self.stacked = stacked
        self.head = nn.Parameter(x[:1].clone())
        self.tail = nn.Parameter(x[1:].clone())

    def forward(self) -> torch.Tensor:
        x = torch.cat([self.head, self.tail])
        if self.stacked:  # (ranks, rows) residuals, each rank's own A_i and b_i
            r = torch.einsum("nmd,dn->nm", self.A, x) - self.b
            return 0.5 * (r * r).sum()
        r = self.A @ x - self.b
        return 0.5 * (r @ r)


def local_optimizer(kind: str, params) -> torch.optim.Optimizer:
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.1),
            "momentum": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            "adam": lambda: torch.optim.Adam(params, lr=0.05),
            "adamw": lambda: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)}[kind]()


def train(engine, problem: lsq.Problem, algorithm: str, topology: dict, kind: str, options: dict,
          rank: int | None) -> torch.Tensor:
    """STEPS full-batch steps of the configured rule; returns its flat parameters (stacked: (dim, ranks))."""
    if rank is None:
        model = LeastSquares(problem.A, problem.b, problem.x0, stacked=True)
    else:
        model = LeastSquares(problem.A[rank], problem.b[rank], problem.x0[rank], stacked=False)
    options = {"bucket_mb": 1e-9, **options}  # one parameter per bucket: overlapped rules send two
    opt = configs.build(algorithm, local_optimizer(kind, model.parameters()), engine,
                        configs.topology(topology, N), model=model, **options)
    if opt.topology is not None:
        engine.set_topology(opt.topology)
    for _ in range(STEPS):
        opt.zero_grad()
        model().backward()
        opt.step()
    opt.finish()
    return opt.evaluation_parameters().detach().clone()


def check_case(algorithm: str, topology: dict, kind: str, options: dict) -> None:
    """Parameters to 1e-12, and bytes: a stacked engine counts one rank's (the mean over ranks)."""
    problem = lsq.problem(seed=3)
    sent: list[int] = [0] * N

    def on_threads(engine):
        out = train(engine, problem, algorithm, topology, kind, options, engine.rank)
        sent[engine.rank] = engine.bytes_sent
        return out

    threads = run_threads(N, on_threads)
    engine = StackedEngine(size=N)
    stacked = train(engine, problem, algorithm, topology, kind, options, None)
    if algorithm == "choco_sgd":  # its compressed payloads are what travels
        assert engine.bytes_sent == pytest.approx(sum(sent) / N, rel=1e-12), (engine.bytes_sent, sent)
    want = torch.stack(threads, -1)
    assert want.shape == stacked.shape
    assert float((want - stacked).abs().max()) <= TOL
    assert float((want - want.mean(-1, keepdim=True)).abs().max()) > 1e-6 or algorithm in ("allreduce",) \
        or options.get("average") == "allreduce", "the ranks still differ: the test compares their mixing"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stacked_equals_threads(case):
    check_case(*case[1:])


@pytest.mark.large
@pytest.mark.parametrize("case", LARGE_CASES, ids=[c[0] for c in LARGE_CASES])
def test_stacked_equals_threads_every_rule(case):
    check_case(*case[1:])


class NormedNet(nn.Sequential):
    """A user's own model with batch norm: its batch statistics couple a rank's samples."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__(nn.Linear(in_features, 8), nn.BatchNorm1d(8), nn.Linear(8, classes))


class ClippedSGD(torch.optim.SGD):
    """A user's own optimizer: engine=stacked cannot know its step is elementwise (a norm would couple ranks)."""


def test_refuses_what_cannot_stack_before_running():
    """A rule without a stacked form, a batch-norm model, an optimizer that is not elementwise: one line,
    exit 2, from the driver's checks (no run folder's ranks start)."""
    common = ["engine=stacked", "ranks=4", "steps=2", "hydra.run.dir=/tmp/never-made"]
    for extra, words in [
        (["algorithm=gossip"], "engine=stacked cannot run algorithm=gossip: its ranks exchange asynchronously"),
        (["model._target_=tests.test_stacked.NormedNet"], "couples the samples of a batch in train mode"),
        (["optimizer._target_=tests.test_stacked.ClippedSGD"], "cannot run optimizer ClippedSGD"),
        (["heterogeneity=stragglers"], "no stragglers"),
    ]:
        got = call(common + extra)
        assert got["escaped"] is None, got["escaped"]
        assert got["code"] == 2, (extra, got)
        lines = got["stderr"].strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (extra, got["stderr"])
        assert "allowed:" in lines[0]


class Shifted(nn.Module):
    """A model outside LayerProgram's layers (its own forward): the stack runs it vmapped."""

    def __init__(self, in_shape: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_shape[0], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(x) + 1.0)


STACKED_MODELS = {  # name -> (a model of one rank, one sample's shape, whether LayerProgram runs it)
    "mlp": (lambda: MLP(in_shape=(6,), classes=3, hidden=[5, 4], activation="tanh"), (6,), True),
    "logreg": (lambda: LogReg(in_shape=(2, 3), classes=3), (2, 3), True),
    "cnn": (lambda: CNN(in_shape=(16,), classes=3, channels=[2, 3], hidden=5), (16,), True),
    "own-forward": (lambda: Shifted((6,), 3), (6,), False),
}


@pytest.mark.parametrize("name,block", [(name, None) for name in STACKED_MODELS] + [("cnn", 64), ("cnn", 128)])
def test_stacked_model_is_one_slice_per_rank(name, block, monkeypatch):
    """StackedModel's forward on rank r's batch, and the gradient of every rank's loss, are the model's own
    with rank r's parameters (the batched layers of LayerProgram, or vmap for another model); ``block``:
    the convolutions run one rank (64 input values) or two ranks (128) at a time, in uneven parts."""
    import bfexp.comm.stacked as stacked_module

    if block is not None:
        monkeypatch.setattr(stacked_module, "CONV_BLOCK", block)
    make, shape, batched = STACKED_MODELS[name]
    torch.manual_seed(0)
    base = make().double()
    stacked = StackedModel(base, 3)
    assert (stacked.program is not None) == batched
    with torch.no_grad():
        for p in stacked.per_layer():
            p.add_(torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(3, 4, *shape, dtype=torch.float64)
    out = stacked(x)
    (grad,) = torch.autograd.grad(out.square().sum(), [stacked.flat])
    assert grad.stride() == stacked.flat.stride()  # in the parameter's own (ranks-first) layout
    grads = stacked.per_layer(grad)
    shared = stacked.forward_shared(x[0])
    for r in range(3):
        one = make().double()
        with torch.no_grad():
            for p, s in zip(one.parameters(), stacked.per_layer()):
                p.copy_(s[..., r])
        want = one(x[r])
        torch.testing.assert_close(out[r], want, rtol=0, atol=1e-13)
        torch.testing.assert_close(shared[r], one(x[0]), rtol=0, atol=1e-13)
        for g, w in zip(grads, torch.autograd.grad(want.square().sum(), list(one.parameters()))):
            torch.testing.assert_close(g[..., r], w, rtol=1e-13, atol=1e-12)  # the cnn's reach ~1e3


# ---------------------------------------------------------------- the worker's real training

TRAINING = {  # case -> overrides (mlp on digits in float64; each rule on a graph its theory accepts)
    "dsgd-one_peer_exp2": ["algorithm=dsgd", "topology=one_peer_exp2"],
}
LARGE_TRAINING = {
    "exact_diffusion-ring-adam": ["algorithm=exact_diffusion", "topology=ring", "optimizer=adam", "lr=0.01"],
    "gradient_tracking-ring": ["algorithm=gradient_tracking", "topology=ring"],
    "push_sum-exp2-column": ["algorithm=push_sum", "topology=exp2", "topology.weights=column"],
    "allreduce": ["algorithm=allreduce"],
    "diloco": ["algorithm=diloco", "algorithm.communication_period=5", "topology=ring"],
    "qg_dsgdm-exp2": ["algorithm=qg_dsgdm", "topology=exp2"],
    "choco_sgd-ring-top_k": ["algorithm=choco_sgd", "topology=ring", "algorithm.gamma=0.5"],
}


def train_both(tmp_path, overrides: list[str], ranks: int = 4, steps: int = STEPS) -> tuple[torch.Tensor, dict, dict]:
    """The worker's ``train`` on engine=threads and on engine=stacked, in this interpreter: (the largest
    difference of any rank's final parameters, the two summaries)."""
    from omegaconf import OmegaConf

    from bfexp.worker import run
    from tests.test_threads_equivalence import compose

    cfg = compose(overrides + [f"ranks={ranks}", f"steps={steps}", "model=mlp", "dataset=digits", "dtype=float64",
                               "log_every=25", "baseline_steps=2"])
    cfg = OmegaConf.create(OmegaConf.to_yaml(cfg, resolve=True))
    (tmp_path / "threads").mkdir()
    (tmp_path / "stacked").mkdir()
    threads = run_threads(ranks, lambda engine: run(cfg, engine, tmp_path / "threads"))
    stacked = run(cfg, StackedEngine(size=ranks), tmp_path / "stacked")
    want = torch.stack([t.parameters for t in threads], -1)
    return (want - stacked.parameters).abs().max(), threads[0].summary, stacked.summary


@pytest.mark.large  # 4-8 s here (both engines' whole loop); test_config_options runs engine=stacked small in make test
@pytest.mark.parametrize("case", list(TRAINING))
def test_training_equals_threads(tmp_path, case):
    """50 steps of the worker's loop, mlp on digits: parameters to 1e-12; the summary's figures agree."""
    diff, threads, stacked = train_both(tmp_path, TRAINING[case])
    assert float(diff) <= TOL
    assert stacked["engine"] == "stacked" and stacked["status"] == "completed"
    for key in ("final_accuracy", "consensus_distance", "bytes_sent_per_step", "steps"):
        assert stacked[key] == pytest.approx(threads[key], rel=1e-9), key
    assert stacked["final_loss"] == pytest.approx(threads["final_loss"], rel=1e-6)  # losses are taken in float32


@pytest.mark.large
@pytest.mark.parametrize("case", list(LARGE_TRAINING))
def test_training_equals_threads_every_rule(tmp_path, case):
    diff, threads, stacked = train_both(tmp_path, LARGE_TRAINING[case], ranks=8)
    assert float(diff) <= TOL
    assert stacked["consensus_distance"] == pytest.approx(threads["consensus_distance"], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("sample", [False, True])
def test_evaluation_equals_each_ranks_own(monkeypatch, sample):
    """StackedModel.evaluate, in blocks of a few ranks and samples, equals bfexp.metrics.evaluate of each
    rank's own model; above EVAL_RANKS ranks, the means over the evenly spaced ranks it names."""
    import bfexp.comm.stacked as stacked_module
    from bfexp.metrics import evaluate

    n = 7
    monkeypatch.setattr(stacked_module, "EVAL_BLOCK", 2 * 5 * 6)  # 2 ranks x 5 samples of 6 features a block
    if sample:
        monkeypatch.setattr(stacked_module, "EVAL_RANKS", 3)
    gen = torch.Generator().manual_seed(4)
    stacked = StackedModel(MLP(in_shape=(6,), classes=3, hidden=[5]).double(), n)
    with torch.no_grad():
        for p in stacked.per_layer():
            p.add_(torch.randn(p.shape, dtype=p.dtype, generator=gen))
    x = torch.randn(23, 6, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 3, (23,), generator=gen)
    own = []
    for r in range(n):
        one = MLP(in_shape=(6,), classes=3, hidden=[5]).double()
        with torch.no_grad():
            for p, s in zip(one.parameters(), stacked.per_layer()):
                p.copy_(s[..., r])
        own.append(evaluate(one, x, y, batch=256))
    loss, accuracy = stacked.evaluate(x, y, batch=5)
    ranks = [0, 3, 6] if sample else list(range(n))
    assert stacked.evaluated_ranks().tolist() == ranks
    want_loss = np.array([own[r][0] for r in ranks])
    want_accuracy = np.array([own[r][1] for r in ranks])
    if sample:
        assert loss.dim() == 0 and accuracy.dim() == 0
        want_loss, want_accuracy = want_loss.mean(), want_accuracy.mean()
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-6)  # the losses are taken in float32
    np.testing.assert_allclose(accuracy.numpy(), want_accuracy, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lengths", [[10, 10, 10], [10, 7, 10], "shared"])
def test_sampler_gives_each_ranks_own_batches(lengths):
    """StackedSampler's rows are each rank's own BatchSampler's batches (its generator, its epochs), over
    several epochs, equally long shards (drawn in lock step) or not, or one set every rank holds
    (dataset.partition=shared); its state resumes the same batches."""
    from bfexp.comm.stacked import StackedData, StackedSampler
    from bfexp.data import BatchSampler, RankData

    gen = torch.Generator().manual_seed(5)
    if lengths == "shared":
        one = RankData(torch.randn(10, 2, generator=gen), torch.randint(0, 3, (10,), generator=gen),
                       torch.zeros(1, 2), torch.zeros(1, dtype=torch.int64), 3, 10)
        shards = [one] * 3
    else:
        shards = [RankData(torch.randn(k, 2, generator=gen), torch.randint(0, 3, (k,), generator=gen),
                           torch.zeros(1, 2), torch.zeros(1, dtype=torch.int64), 3, sum(lengths)) for k in lengths]
    stacked = StackedSampler(StackedData(shards), batch_size=3, seed=7)
    own = [BatchSampler(shard, 3, 7, r) for r, shard in enumerate(shards)]
    for step in range(9):  # 3 epochs of 3 batches
        x, y = stacked.next()
        for r, sampler in enumerate(own):
            bx, by = sampler.next()
            assert torch.equal(x[r], bx) and torch.equal(y[r], by), (step, r)
        if step == 4:
            state = stacked.state_dict()
            assert [s["position"] for s in state["ranks"]] == [sampler.state_dict()["position"] for sampler in own]
    resumed = StackedSampler(StackedData(shards), batch_size=3, seed=7)
    resumed.load_state_dict(state)
    replay = StackedSampler(StackedData(shards), batch_size=3, seed=7)
    for _ in range(5):
        replay.next()
    for _ in range(6):
        assert torch.equal(resumed.next()[0], replay.next()[0])
    assert stacked.epoch == own[0].epoch


HEAP_CHECK = """
import ctypes, torch
from bfexp.comm.stacked import freed_memory_kept
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
def on_the_heap():
    t = torch.ones(1 << 24)  # 64 MiB
    return t.data_ptr() < libc.sbrk(0)
print(on_the_heap())
with freed_memory_kept():
    print(on_the_heap())
print(on_the_heap())
"""


def test_large_tensors_come_from_the_heap_while_a_stacked_job_runs():
    """Inside freed_memory_kept glibc serves a 64 MiB tensor from its heap (below the program break), whose
    freed memory it keeps for the next tensors, where by default it maps each one apart (above the break,
    given back when freed); afterwards the defaults are back. In a fresh interpreter: after a stacked job
    ran in this one, its heap may hold a free chunk big enough that glibc serves the tensor from it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HEAP_CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True", "False"]  # mapped apart, from the heap, mapped apart


def test_bytes_per_step_on_a_graph_of_unequal_degrees_is_the_mean_not_floored(tmp_path):
    """A star on 5 ranks: the hub sends to 4, each leaf to 1, so a rank sends (4 + 4x1)/5 = 1.6 messages a step
    on average; stacked ranks report the mean as threads do, not rounded down to whole bytes (issue 44)."""
    from tests.cli_in_process import calls

    jobs = calls([{"id": engine, "folder": str(tmp_path / engine), "args": [
        "hydra.run.dir=run", f"engine={engine}", "ranks=5", "topology=star", "steps=3", "baseline_steps=0",
        "report=false", "logger=jsonl"]} for engine in ("threads", "stacked")], timeout=240)  # one interpreter
    got = {}
    for engine, job in jobs.items():
        ran(job)
        got[engine] = job["summaries"]["run/summary.json"]["bytes_sent_per_step"]
    message = 66 * 4  # the default model's 66 float32 parameters
    assert got["threads"] == pytest.approx(1.6 * message, rel=1e-12)
    assert got["stacked"] == pytest.approx(got["threads"], rel=1e-12)
