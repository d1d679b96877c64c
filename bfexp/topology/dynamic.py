"""Dynamic graphs: every rank sends to exactly one peer per iteration, cycling with a period.

One peer per iteration costs one message per step instead of log(n), and a
well-chosen schedule still mixes fast: for one-peer exp2 over n = 2^k ranks
the product of k consecutive W(t) is exactly 11^T / n.

Each class is a conf/topology option (keyword parameters after ``size`` are
its schema); inner_outer_exp2 also takes ``ranks_per_machine`` from the run
(how ranks sit on machines), never from its YAML.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from bfexp.errors import TopologyError
from bfexp.topology.base import GraphTopology, log2_ceil
from bfexp.topology.mixing import WeightScheme

Edges = tuple[np.ndarray, np.ndarray]


class OnePeerExp2(GraphTopology):
    """At iteration t rank i sends to i + 2^(t mod ceil(log2 n)) and hears from i - 2^(...)."""

    name: ClassVar[str] = "one_peer_exp2"

    def __init__(self, size: int, *, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        self.period = max(1, log2_ceil(size))
        self.validate()

    def _edges(self, t: int) -> Edges:
        i = np.arange(self.size)
        return i, (i + (1 << t)) % self.size


class OnePeerRing(GraphTopology):
    """At even t rank i sends to i + 1, at odd t to i - 1: a ring, one message per step."""

    name: ClassVar[str] = "one_peer_ring"

    def __init__(self, size: int, *, weights: WeightScheme = "uniform") -> None:
        super().__init__(size, weights=weights)
        self.period = 2 if size > 2 else 1
        self.validate()

    def _edges(self, t: int) -> Edges:
        i = np.arange(self.size)
        return i, (i + (1 if t % 2 == 0 else -1)) % self.size


class InnerOuterExp2(GraphTopology):
    """Hierarchical one-peer exp2 for ranks grouped into machines of L ranks each.

    At iteration t one local rank o = t mod L of every machine talks across
    machines (to local rank o of the machine 2^k machines ahead), while the
    other L-1 ranks of each machine run one-peer exp2 among themselves. Every
    rank sends one message and hears one, so each W(t) is (I + P)/2 for a
    permutation P: doubly stochastic, and only one message per machine crosses
    the slow network each step.
    """

    name: ClassVar[str] = "inner_outer_exp2"

    def __init__(self, size: int, *, ranks_per_machine: int = 0, weights: WeightScheme = "uniform") -> None:
        """``ranks_per_machine``: the run's layout (engine.ranks_per_machine); 0 = all ranks on one machine."""
        super().__init__(size, weights=weights)
        local = size if ranks_per_machine == 0 else ranks_per_machine
        if ranks_per_machine < 0 or size % local:
            raise TopologyError(
                f"engine.ranks_per_machine={ranks_per_machine}; allowed: 0 or a divisor of ranks={size}"
            )
        if size // local < 2:
            raise TopologyError(
                f"engine.ranks_per_machine={ranks_per_machine} puts ranks={size} on 1 machine; allowed: a divisor "
                "of ranks below it, since topology=inner_outer_exp2 needs at least 2 machines"
            )
        if local == 2:
            raise TopologyError(
                "engine.ranks_per_machine=2; allowed: 1 or >= 3 for topology=inner_outer_exp2 "
                "(with 2 the ranks of a machine never meet)"
            )
        self.local_size, self.machines = local, size // local
        self.outer_steps = log2_ceil(self.machines)
        self.inner_steps = max(1, log2_ceil(local - 1))
        self.period = local * math.lcm(self.outer_steps, self.inner_steps)
        self.validate()

    def params(self) -> dict[str, Any]:
        return {"ranks_per_machine": self.local_size}

    def positions(self) -> np.ndarray:
        """Machines on a big circle, each machine's ranks on a small circle around it."""
        m, local = np.divmod(np.arange(self.size), self.local_size)
        a = np.pi / 2 - 2 * np.pi * m / self.machines
        b = np.pi / 2 - 2 * np.pi * local / self.local_size
        r = 0.9 * np.sin(np.pi / self.machines) / 2 if self.local_size > 1 else 0.0
        return np.stack([np.cos(a) + r * np.cos(b), np.sin(a) + r * np.sin(b)], axis=1)

    def _edges(self, t: int) -> Edges:
        local, machines = self.local_size, self.machines
        outer = t % local
        block = t // local
        d_out = 1 << (block % self.outer_steps)
        m = np.arange(machines)
        senders = [m * local + outer]
        receivers = [((m + d_out) % machines) * local + outer]
        inner = local - 1
        if inner >= 2:
            d_in = 1 << (block % self.inner_steps)
            pos = np.arange(inner)
            # Position p of the inner ranks is local rank o + 1 + p (mod L).
            src_local = (outer + 1 + pos) % local
            dst_local = (outer + 1 + (pos + d_in) % inner) % local
            senders.append((m[:, None] * local + src_local[None, :]).ravel())
            receivers.append((m[:, None] * local + dst_local[None, :]).ravel())
        return np.concatenate(senders), np.concatenate(receivers)
