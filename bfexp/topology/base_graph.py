"""Base-(k+1) graphs: exact averaging in finitely many steps, for any number of ranks.

Takezawa, Sato, Bao, Niwa, Yamada, "Beyond Exponential Graph:
Communication-Efficient Topologies for Decentralized Learning via
Finite-time Convergence", NeurIPS 2023. Every rank talks to at most k peers
per step, and the product W(m-1) ... W(1) W(0) of one period is exactly
J = 11^T / n for every n (one-peer exp2 manages that only for powers of 2).
Every W(t) is symmetric and doubly stochastic.

The construction, as the authors' code builds it (with exact integer
arithmetic where theirs takes floating-point logarithms):

* k-peer hyper-hypercube, for n whose prime factors are all <= k+1: write
  n = f_1 f_2 ... f_L with every f_l <= k+1 (largest factors taken first),
  read a rank's position as mixed-radix digits, and in step l average each
  group of f_l ranks that differ only in digit l (a clique, weights 1/f_l).
  After L steps every rank holds the average.
* simple Base-(k+1) graph, for any n: write n in base k+1,
  n = sum_l a_l (k+1)^(p_l) with p_1 > p_2 > ..., and split the ranks into
  blocks V_l of a_l (k+1)^(p_l) consecutive ranks, each cut into a_l
  sub-blocks of (k+1)^(p_l). (1) Every block averages itself (its
  hyper-hypercube, in parallel). (2) In step r, every rank of a later block
  V_l (l > r) pairs with one rank of each of V_r's a_r sub-blocks, weighing
  them n_r / (S_r a_r) each and itself 1 - n_r / S_r (S_r = sum over l >= r
  of |V_l|): later blocks then hold the average over V_r, V_{r+1}, ...; V_r's
  ranks left unpaired average among themselves in cliques of up to k+1.
  (3) From the step after its own, each block averages inside its
  sub-blocks again, which now all carry the same sum. It ends when the first
  block has.
* Base-(k+1) graph: with n = n_s n_r, n_s the largest divisor of n whose
  prime factors are <= k+1, run the simple graph inside each of n_s groups
  of n_r consecutive ranks, then the hyper-hypercube across the groups
  (the i-th rank of every group); the simple graph on all n ranks instead
  when that takes fewer steps.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from bfexp.errors import TopologyError, number_in
from bfexp.topology.base import Topology
from bfexp.topology.mixing import SparseMixing

# One step of mixing: row i -> {j: W[i, j]} (diagonal included); ranks absent keep their value.
Step = dict[int, dict[int, float]]


def factors(n: int, k: int) -> list[int] | None:
    """n = f_1 ... f_L with every 2 <= f_l <= k+1, largest taken first, listed smallest first;
    None when a prime factor of n exceeds k+1."""
    rest, out = n, []
    for f in range(k + 1, 1, -1):
        while rest % f == 0:
            out.append(f)
            rest //= f
    return out[::-1] if rest == 1 else None


def smooth_part(n: int, k: int) -> int:
    """The largest divisor of n whose prime factors are all <= k+1."""
    part, rest = 1, n
    for p in range(2, k + 2):
        while rest % p == 0:
            part *= p
            rest //= p
    return part


def clique(step: Step, members: list[int]) -> None:
    """Average ``members`` exactly in this step (weights 1/|members|, self included)."""
    w = 1.0 / len(members)
    for i in members:
        step[i] = {j: w for j in members}


def hyper_hypercube(nodes: list[int], k: int) -> list[Step]:
    """Steps that average ``nodes`` exactly, each rank in one clique of at most k+1 per step."""
    fs = factors(len(nodes), k)
    assert fs is not None, "a hyper-hypercube needs prime factors <= k+1"
    steps, stride = [], 1
    for f in fs:
        step: Step = {}
        for pos in range(len(nodes)):
            if pos % (stride * f) < stride:  # the group's first member: digit l is 0
                clique(step, [nodes[pos + stride * t] for t in range(f)])
        steps.append(step)
        stride *= f
    return steps or [{}]  # one rank: one step that changes nothing


def simple_base_graph(nodes: list[int], k: int) -> list[Step]:
    """The simple Base-(k+1) graph on ``nodes`` (see the module doc)."""
    n, base = len(nodes), k + 1
    if factors(n, k) is not None:
        return hyper_hypercube(nodes, k)
    sizes, power = [], 1
    while power * base <= n:
        power *= base
    rest = n
    while rest:
        if rest >= power:
            sizes.append((rest // power) * power)
            rest -= sizes[-1]
        power //= base
    starts = np.cumsum([0, *sizes]).tolist()
    blocks = [nodes[starts[l] : starts[l + 1]] for l in range(len(sizes))]
    subs = []  # each block's a_l sub-blocks of (k+1)^(p_l) ranks
    for size, block in zip(sizes, blocks):
        width = _largest_power_dividing(size, base)
        subs.append([block[i : i + width] for i in range(0, size, width)])
    inside = [hyper_hypercube(block, k) for block in blocks]  # phase 1
    inside_subs = [hyper_hypercube(s[0], k) for s in subs]  # phase 3, per sub-block (same length for all)
    first = len(inside[0])
    steps: list[Step] = [{} for _ in range(first)]
    for block_steps in inside:
        for m in range(first):
            steps[m].update(block_steps[m % len(block_steps)])
    count = [0] * len(blocks)  # phase-3 steps each block has taken
    r = 0
    while count[0] < len(inside_subs[0]):
        step: Step = {}
        unpaired = [list(s) for s in subs[r]] if r < len(blocks) - 1 else []  # block r's ranks not yet paired
        for l in reversed(range(len(blocks))):
            if r < l:  # phase 2: block l pairs with one rank of each sub-block of block r
                share = sizes[r] / sum(sizes[r:])
                for i in blocks[l]:
                    step[i] = {i: 1.0 - share}
                    for sub in unpaired:
                        j = sub.pop()
                        w = share / len(unpaired)
                        step[i][j] = w
                        step[j] = {j: 1.0 - w, i: w}
            elif r == l and l != len(blocks) - 1:  # block r's unpaired ranks: cliques of up to k+1
                left = [j for sub in unpaired for j in sub]
                while len(left) > 1:
                    clique(step, left[:base])
                    left = left[base:]
            else:  # phase 3: block l averages inside its sub-blocks again
                if sizes[l] < base:
                    step.update(inside[l][count[l] % len(inside[l])])
                else:
                    for sub in subs[l]:
                        sub_steps = hyper_hypercube(sub, k)
                        step.update(sub_steps[count[l] % len(sub_steps)])
                count[l] += 1
        steps.append(step)
        r += 1
    return steps


def _largest_power_dividing(size: int, base: int) -> int:
    """(k+1)^p for a block of a (k+1)^p ranks, a < k+1."""
    width = 1
    while size % (width * base) == 0:
        width *= base
    return width


def base_graph(n: int, k: int) -> list[Step]:
    """The Base-(k+1) graph's steps on ranks 0..n-1 (see the module doc)."""
    ranks = list(range(n))
    simple = simple_base_graph(ranks, k)
    n_s = smooth_part(n, k)
    n_r = n // n_s
    groups = [ranks[n_r * g : n_r * (g + 1)] for g in range(n_s)]
    within = [simple_base_graph(group, k) for group in groups]
    across = [hyper_hypercube([group[i] for group in groups], k) for i in range(n_r)]
    if len(simple) < len(within[0]) + len(across[0]):
        return simple
    steps: list[Step] = []
    for parts in (within, across):
        for m in range(len(parts[0])):
            step: Step = {}
            for part in parts:
                step.update(part[m])
            steps.append(step)
    return steps


def to_sparse(n: int, step: Step) -> SparseMixing:
    """One step as W: its rows, and weight 1 on the diagonal for ranks it leaves alone."""
    diag = np.ones(n)
    receivers, senders, values = [], [], []
    for i, row in step.items():
        diag[i] = row.get(i, 0.0)
        for j, w in row.items():
            if j != i and w:
                receivers.append(i)
                senders.append(j)
                values.append(w)
    return SparseMixing.from_entries(n, diag, np.array(receivers, np.int64), np.array(senders, np.int64),
                                     np.array(values, np.float64))


class BaseGraph(Topology):
    """The Base-(k+1) graph: at most k peers per rank per step, exact average after ``period`` steps."""

    name: ClassVar[str] = "base_graph"

    def __init__(self, size: int, *, k: int = 1) -> None:
        """``k``: the most peers a rank talks to in one step (Base-(k+1): k = 1 is Base-2)."""
        super().__init__(size)
        number_in("topology.k", k, low=1, integer=True, error=TopologyError)
        self.k = int(k)
        self.weight_scheme = "base_graph"  # the construction's own weights
        self._steps = [to_sparse(self.size, s) for s in base_graph(self.size, self.k)]
        self.period = len(self._steps)
        self.validate()

    def _build(self, t: int) -> SparseMixing:
        return self._steps[t]

    def params(self) -> dict[str, Any]:
        return {"k": self.k}

    @property
    def exact_average_steps(self) -> int:
        """Steps after which every rank holds the exact average (the period)."""
        return self.period

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "exact_average_steps": self.exact_average_steps}
