"""Numpy re-implementations of the communication-efficient rules, written from their papers:
the references tests/algorithms/test_efficient.py compares real MPI ranks against.

Same conventions as lsq.py: X stacks the ranks' iterates (one row per rank),
W(r) is the mixing matrix of round r, ``opt.step(G)`` the local optimizer's
step for gradients G. Nothing here imports bfexp.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from tests.algorithms.lsq import Problem, Schedule, Trace, mix


def top_k(V: np.ndarray, ratio: float) -> np.ndarray:
    """Row by row: the k = ceil(ratio d) entries of largest magnitude, zeros elsewhere."""
    k = max(1, math.ceil(ratio * V.shape[1]))
    out = np.zeros_like(V)
    for i, v in enumerate(V):
        keep = np.argsort(-np.abs(v), kind="stable")[:k]
        out[i, keep] = v[keep]
    return out


def sign(V: np.ndarray) -> np.ndarray:
    """Row by row: mean |v| times sign(v), zeros counted positive."""
    scale = np.abs(V).mean(axis=1, keepdims=True)
    return np.where(V >= 0, scale, -scale)


def identity(V: np.ndarray) -> np.ndarray:
    return V.copy()


def pga(matrices: Callable[[int], np.ndarray], every: int, n: int) -> Callable[[int], np.ndarray]:
    """Gossip-PGA's rounds: J = 11^T / n on every ``every``-th round, W(r) on the others."""
    J = np.full((n, n), 1.0 / n)
    return lambda r: J if (r + 1) % every == 0 else matrices(r)


def choco(p: Problem, W: np.ndarray, opt, K: int, gamma: float, Q: Callable) -> Trace:
    """X_half = X - aG(X); Q_k = Q(X_half - X_hat); X_hat += Q_k; X+ = X_half + gamma (W - I) X_hat;
    X_hat_0 = 0 (Koloskova, Stich, Jaggi 2019, Algorithm 2)."""
    X = p.x0.copy()
    X_hat = np.zeros_like(X)
    t = Trace(x=[X])
    for _ in range(K):
        X_half = X + opt.step(p.grad(X))
        X_hat = X_hat + Q(X_half - X_hat)
        X = X_half + gamma * (W - np.eye(len(W))) @ X_hat
        t.x.append(X)
    return t


def outer(p: Problem, x0: np.ndarray, opt, K: int, H: int, step: Callable[[np.ndarray], np.ndarray],
          matrices: Callable[[int], np.ndarray] | None) -> Trace:
    """H local steps from Theta, Delta = Theta - X; matrices None (the papers): every rank steps
    along the mean Delta; else each steps along its own and the outer models are mixed,
    Theta+ = W(r) (Theta - step(Delta)). ``step`` keeps the outer optimizer's state."""
    X = x0.copy()
    Theta = X.copy()
    t = Trace(x=[X])
    for k in range(K):
        X = X + opt.step(p.grad(X))
        if (k + 1) % H == 0:
            D = Theta - X
            if matrices is None:
                D = np.tile(D.mean(axis=0), (len(D), 1))
                Theta = Theta - step(D)
            else:
                Theta = matrices(k // H) @ (Theta - step(D))
            X = Theta.copy()
        t.x.append(X)
    return t


def nesterov_sgd(lr: float, mu: float, nesterov: bool) -> Callable[[np.ndarray], np.ndarray]:
    """DiLoCo's outer optimizer (torch's SGD): m = mu m + D; step = lr (D + mu m) or lr m."""
    state = {"m": None}

    def step(D: np.ndarray) -> np.ndarray:
        state["m"] = D.copy() if state["m"] is None else mu * state["m"] + D
        return lr * (D + mu * state["m"] if nesterov else state["m"])

    return step


def slow_momentum(alpha: float, beta: float, gamma: float) -> Callable[[np.ndarray], np.ndarray]:
    """SlowMo: u = beta u + D / gamma; step = alpha gamma u (Wang et al. 2020, Algorithm 1)."""
    state = {"u": None}

    def step(D: np.ndarray) -> np.ndarray:
        state["u"] = D / gamma if state["u"] is None else beta * state["u"] + D / gamma
        return alpha * gamma * state["u"]

    return step


def qg_dsgdm(p: Problem, s: Schedule, lr: float, beta: float, nesterov: bool, K: int) -> Trace:
    """m = beta m_hat + g (Nesterov: g + beta m); X+ = W(X - a m); d = (X - X+) / a;
    m_hat = beta m_hat + (1 - beta) d (Lin et al. 2021, Algorithm 1 with mu = beta)."""
    X = p.x0.copy()
    m_hat = np.zeros_like(X)
    t = Trace(x=[X])
    for k in range(K):
        G = p.grad(X)
        M = beta * m_hat + G
        if nesterov:
            M = G + beta * M
        X_new = mix(s.W(k), X - lr * M)
        m_hat = beta * m_hat + (1 - beta) * (X - X_new) / lr
        X = X_new
        t.x.append(X)
    return t


def error_feedback(p: Problem, x0: np.ndarray, opt, K: int, H: int, Q: Callable) -> Trace:
    """Local steps from the shared x; every H: P = (x - X) + E; C = Q(P); E = P - C; x -= mean_i C_i
    (EF-SGD, Karimireddy et al. 2019, averaged over ranks)."""
    n = len(p.A)
    x = x0.copy()
    X = np.tile(x, (n, 1))
    E = np.zeros_like(X)
    t = Trace(x=[X])
    for k in range(K):
        X = X + opt.step(p.grad(X))
        if (k + 1) % H == 0:
            P = (x - X) + E
            C = Q(P)
            E = P - C
            x = x - C.mean(axis=0)
            X = np.tile(x, (n, 1))
        t.x.append(X)
    return t
