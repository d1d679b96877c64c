import bluefog.torch as bf
import numpy as np
import torch

# Exact decentralized methods written against BlueFog's API, on least squares:
# f_i(x) = ||A_i x - b_i||^2 / (2 m). Every method must reach the minimizer of sum_i f_i.

bf.init()
n, me = bf.size(), bf.rank()
m, d = 40, 5


def data(r):
    g = torch.Generator().manual_seed(4242 + r)
    a = torch.randn(m, d, generator=g, dtype=torch.float64)
    b = a @ torch.randn(d, 1, generator=g, dtype=torch.float64) + torch.randn(m, 1, generator=g, dtype=torch.float64)
    return a, b


A, b = data(me)
# The optimum from every rank's data (numpy, not the code under test).
stacked = [data(r) for r in range(n)]
x_opt = np.linalg.solve(sum(a.numpy().T @ a.numpy() for a, _ in stacked), sum(a.numpy().T @ y.numpy() for a, y in stacked))


def grad(x):
    return A.T @ (A @ x - b) / m


def error(x):
    return float(np.abs(x.numpy() - x_opt).max())


alpha, iters = 0.3, 200
errors = {}

# Exact diffusion (Yuan et al. 2019) on a ring with its symmetric weights, A_bar = (I + A) / 2.
bf.set_topology(bf.RingGraph(n), is_weighted=True)
self_weight, neighbor_weights = bf.GetRecvWeights(bf.load_topology(), me)
self_weight = (self_weight + 1) / 2
neighbor_weights = {r: v / 2 for r, v in neighbor_weights.items()}
x = torch.zeros(d, 1, dtype=torch.float64)
psi_prev = x.clone()
for _ in range(iters):
    psi = x - alpha * grad(x)
    phi = psi + x - psi_prev
    x = bf.neighbor_allreduce(phi, self_weight=self_weight, src_weights=neighbor_weights, name="ed")
    psi_prev = psi
errors["exact_diffusion"] = error(x)

# Gradient tracking (DIGing) on the exponential-2 graph, both exchanges nonblocking.
bf.set_topology(bf.ExponentialTwoGraph(n))
x = torch.zeros(d, 1, dtype=torch.float64)
q = grad(x)
g_prev = q.clone()
for _ in range(iters):
    x_handle = bf.neighbor_allreduce_nonblocking(x, name="gt.x")
    q_handle = bf.neighbor_allreduce_nonblocking(q, name="gt.q")
    x = bf.synchronize(x_handle) - alpha * q
    g = grad(x)
    q = bf.synchronize(q_handle) + g - g_prev
    g_prev = g
errors["gradient_tracking"] = error(x)

# Push-DIGing (Nedic et al. 2017) on a directed one-way ring, column-stochastic weights applied by the
# sender (dst_weights), u, y and v sent as one vector so they always travel together.
bf.set_topology(bf.RingGraph(n, connect_style=2))
outs = bf.out_neighbor_ranks()
share = 1.0 / (len(outs) + 1)
w = torch.zeros(2 * d + 1, 1, dtype=torch.float64)
w[d : 2 * d] = grad(w[:d])
w[-1] = 1.0
g_prev = w[d : 2 * d].clone()
for _ in range(2 * iters):
    w[:d] -= alpha * w[d : 2 * d]
    w = bf.neighbor_allreduce(w, self_weight=share, src_weights={r: 1.0 for r in bf.in_neighbor_ranks()},
                              dst_weights={r: share for r in outs}, name="push_diging")
    x = w[:d] / w[-1]
    g = grad(x)
    w[d : 2 * d] += g - g_prev
    g_prev = g
errors["push_diging"] = error(w[:d] / w[-1])

RESULT = {"errors": errors}
