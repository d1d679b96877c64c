"""Heterogeneous least squares and numpy re-implementations of each paper's
matrix-form update: the independent references the algorithm tests compare
real MPI ranks against.

f_i(x) = 1/2 ||A_i x - b_i||^2 with a different (A_i, b_i) per rank; the
optimum of sum_i f_i is numpy's lstsq on the stacked data. X stacks the
ranks' iterates (one row per rank), W(r) is the mixing matrix of
communication round r, G(X) the local gradients, row by row.

Nothing here imports bfexp.algorithms: the references are written from the
papers, not from the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

RANKS, DIM, ROWS = 8, 4, 32


@dataclass(frozen=True)
class Problem:
    A: np.ndarray  # (ranks, rows, dim)
    b: np.ndarray  # (ranks, rows)
    x0: np.ndarray  # (ranks, dim): every rank starts somewhere else

    def grad(self, X: np.ndarray) -> np.ndarray:
        return np.einsum("nmd,nm->nd", self.A, np.einsum("nmd,nd->nm", self.A, X) - self.b)

    @property
    def optimum(self) -> np.ndarray:
        return np.linalg.lstsq(self.A.reshape(-1, self.A.shape[2]), self.b.reshape(-1), rcond=None)[0]

    def relative_errors(self, X: np.ndarray) -> np.ndarray:
        """||x_i - x*|| / ||x*|| for every rank."""
        xs = self.optimum
        return np.linalg.norm(np.asarray(X) - xs, axis=1) / np.linalg.norm(xs)


def problem(seed: int = 0, ranks: int = RANKS, zero: bool = False) -> Problem:
    """Rank i's data; the ranks' b_i are shifted apart so their optima differ a lot.
    zero=True: all-zero data, so every gradient is 0 (pure averaging)."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(ranks, ROWS, DIM)) / np.sqrt(ROWS)
    b = rng.normal(size=(ranks, ROWS)) + 3.0 * rng.normal(size=(ranks, 1))
    x0 = rng.normal(size=(ranks, DIM))
    if zero:
        A, b = np.zeros_like(A), np.zeros_like(b)
    return Problem(A, b, x0)


# ---------------------------------------------------------------- local optimizers
@dataclass
class LocalSGD:
    """torch.optim.SGD's update, row by row: buf = m buf + g (buf_0 = g); step = -lr buf."""

    lr: float
    momentum: float = 0.0
    buf: np.ndarray | None = None

    def step(self, G: np.ndarray) -> np.ndarray:
        if self.momentum == 0.0:
            return -self.lr * G
        self.buf = G.copy() if self.buf is None else self.momentum * self.buf + G
        return -self.lr * self.buf


@dataclass
class LocalAdam:
    """Kingma & Ba's Adam (torch's defaults), row by row: step = -lr m_hat / (sqrt(v_hat) + eps)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    m: np.ndarray | None = None
    v: np.ndarray | None = None
    t: int = 0

    def step(self, G: np.ndarray) -> np.ndarray:
        b1, b2 = self.betas
        self.t += 1
        self.m = (1 - b1) * G if self.m is None else b1 * self.m + (1 - b1) * G
        self.v = (1 - b2) * G * G if self.v is None else b2 * self.v + (1 - b2) * G * G
        m_hat = self.m / (1 - b1**self.t)
        v_hat = self.v / (1 - b2**self.t)
        return -self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


def local_optimizer(name: str, lr: float, momentum: float = 0.0):
    return LocalAdam(lr) if name == "adam" else LocalSGD(lr, momentum)


# ---------------------------------------------------------------- schedules
@dataclass
class Schedule:
    """Which iterations communicate, and with which W: round r = k // H uses W(r)."""

    matrices: Callable[[int], np.ndarray]
    period: int = 1  # communication_period H

    def W(self, k: int) -> np.ndarray | None:
        """W for iteration k, or None when k is a local-only iteration."""
        if (k + 1) % self.period:
            return None
        return self.matrices(k // self.period)


def mix(W: np.ndarray | None, X: np.ndarray) -> np.ndarray:
    return X if W is None else W @ X


@dataclass
class Trace:
    """Iterates x_k (k = 0..K) and, where a rule has them, its other variables."""

    x: list = field(default_factory=list)
    y: list = field(default_factory=list)  # trackers y_k
    numerator: list = field(default_factory=list)  # push-sum numerators x_k
    weight: list = field(default_factory=list)  # push-sum weights w_k


# ---------------------------------------------------------------- the papers' rules
def dsgd(p: Problem, s: Schedule, opt, K: int, style: str) -> Trace:
    """atc: X+ = W(X - aG(X)); awc: X+ = WX - aG(X); cta: X+ = WX - aG(WX)  (Lian 2017; Chen & Sayed 2012)."""
    X = p.x0.copy()
    t = Trace(x=[X])
    for k in range(K):
        W = s.W(k)
        if style == "atc":
            X = mix(W, X + opt.step(p.grad(X)))
        elif style == "awc":
            X = mix(W, X) + opt.step(p.grad(X))
        else:
            M = mix(W, X)
            X = M + opt.step(p.grad(M))
        t.x.append(X)
    return t


def exact_diffusion(p: Problem, s: Schedule, opt, K: int) -> Trace:
    """psi+ = x - aG(x); phi = psi+ + x - psi; x+ = (I+W)/2 phi; psi_0 = x_0 (Yuan et al. 2019).
    Between rounds (H > 1) the local steps are the 'adapt'; x, psi are kept from the last round."""
    X = p.x0.copy()
    x_last, psi = X.copy(), X.copy()
    t = Trace(x=[X])
    for k in range(K):
        Z = X + opt.step(p.grad(X))
        W = s.W(k)
        if W is None:
            X = Z
        else:
            phi = Z + x_last - psi
            psi = Z
            X = 0.5 * (np.eye(len(W)) + W) @ phi
            x_last = X
        t.x.append(X)
    return t


def diging(p: Problem, s: Schedule, opt, K: int) -> Trace:
    """X+ = W(k)X - aY; Y+ = W(k)Y + G(X+) - G(X); Y_0 = G(X_0) (Nedic, Olshevsky, Shi 2017)."""
    X = p.x0.copy()
    Y = p.grad(X)
    t = Trace(x=[X], y=[Y])
    for k in range(K):
        W = s.W(k)
        X_new = mix(W, X) + opt.step(Y)
        Y = mix(W, Y) + p.grad(X_new) - p.grad(X)
        X = X_new
        t.x.append(X)
        t.y.append(Y)
    return t


def atc_tracking(p: Problem, s: Schedule, opt, K: int) -> Trace:
    """X+ = W(k)(X - aY); Y+ = W(k)(Y + G(X+) - G(X)); Y_0 = G(X_0) (Aug-DGM, Xu et al. 2015; NEXT;
    ATC-DIGing, Nedic et al. 2017, for time-varying W)."""
    X = p.x0.copy()
    Y = p.grad(X)
    t = Trace(x=[X], y=[Y])
    for k in range(K):
        W = s.W(k)
        X_new = mix(W, X + opt.step(Y))
        Y = mix(W, Y + p.grad(X_new) - p.grad(X))
        X = X_new
        t.x.append(X)
        t.y.append(Y)
    return t


def push_sum(p: Problem, s: Schedule, opt, K: int) -> Trace:
    """x+ = A(x - aG(z)); w+ = A w; z = x / w; w_0 = 1 (SGP, Assran et al. 2019)."""
    X = p.x0.copy()
    w = np.ones((len(X), 1))
    Z = X / w
    t = Trace(x=[Z], numerator=[X], weight=[w[:, 0]])
    for k in range(K):
        A = s.W(k)
        X = mix(A, X + opt.step(p.grad(Z)))
        w = mix(A, w)
        Z = X / w
        t.x.append(Z)
        t.numerator.append(X)
        t.weight.append(w[:, 0])
    return t


def push_diging(p: Problem, s: Schedule, opt, K: int) -> Trace:
    """u+ = C(u - aY); v+ = Cv; x+ = u+/v+; Y+ = CY + G(x+) - G(x); Y_0 = G(x_0) (Nedic et al. 2017, Alg. 2)."""
    U = p.x0.copy()
    v = np.ones((len(U), 1))
    X = U / v
    Y = p.grad(X)
    t = Trace(x=[X], y=[Y])
    for k in range(K):
        C = s.W(k)
        U = mix(C, U + opt.step(Y))
        v = mix(C, v)
        X_new = U / v
        Y = mix(C, Y) + p.grad(X_new) - p.grad(X)
        X = X_new
        t.x.append(X)
        t.y.append(Y)
    return t


def centralized(p: Problem, x0: np.ndarray, opt, K: int) -> Trace:
    """One model stepped along the average gradient, x+ = x + step((1/n) sum_i G_i(x)): what allreduce must equal."""
    x = x0.copy()
    n = len(p.A)
    t = Trace(x=[np.tile(x, (n, 1))])
    for _ in range(K):
        x = x + opt.step(p.grad(np.tile(x, (n, 1))).mean(axis=0))
        t.x.append(np.tile(x, (n, 1)))
    return t


def local_sgd_average(p: Problem, x0: np.ndarray, opt, period: int, K: int) -> Trace:
    """Local SGD: local steps, the models averaged after every `period`-th (Stich 2019)."""
    X = np.tile(x0, (len(p.A), 1))
    t = Trace(x=[X])
    for k in range(K):
        X = X + opt.step(p.grad(X))
        if (k + 1) % period == 0:
            X = np.tile(X.mean(axis=0), (len(X), 1))
        t.x.append(X)
    return t


REFERENCES = {
    "dsgd": dsgd,
    "exact_diffusion": exact_diffusion,
    "diging": diging,
    "atc": atc_tracking,
    "push_sum": push_sum,
    "push_diging": push_diging,
}
