"""Heterogeneous ranks as config (conf/heterogeneity/): stragglers that compute slower.

Decentralized and asynchronous training exist for clusters where some
machines are slow; this makes chosen ranks slow, reproducibly. A slow rank's
step costs

    compute * factor + delay + pause

where ``compute`` is the step's compute time, ``delay`` a random per-step
delay (constant, uniform on [0, 2 * delay_s] or exponential with mean
``delay_s``) and ``pause`` an occasional long pause (``pause_s`` with
probability ``pause_probability`` each step). Draws come from a generator
seeded by (seed, rank, step): the same seed gives the same delays on every
engine, and a resumed run draws what the uninterrupted one would have.

How the cost is paid depends on the ranks (``Engine.advance``), at the
START of each training step, before the forward pass, so whatever a slow
rank sends during its step leaves late:

* real ranks (mpi, nccl): the rank sleeps ``compute * (factor - 1) + delay +
  pause``, with ``compute`` the forward and backward its previous step
  measured (the real compute is paid by computing); or, with ``cpu_quota``,
  the rank gets that many CPUs (a cgroup of its own, bfexp.cgroups) instead
  of the factor's sleep, so its compute and communication really are slower
  (delay and pause still sleep);
* virtual ranks (threads): nothing sleeps; the rank's simulated clock moves
  on by the whole cost, with ``compute`` = ``step_time_s`` (default 10 ms:
  the same on any host, so asynchronous runs are reproducible), or with
  ``step_time_s=null`` the previous step's measured forward and backward
  (host-dependent: threads share the cores).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np

from bfexp.errors import ConfigError, number_in

__all__ = ["Heterogeneity", "Pace"]

Delay = Literal["none", "constant", "uniform", "exponential"]
DELAYS: tuple[str, ...] = ("none", "constant", "uniform", "exponential")


class Heterogeneity:
    """Which ranks are slow and how (the constructor is conf/heterogeneity/*.yaml's schema).

    A rank listed in ``slow_ranks`` beyond a job's ranks slows nothing (a sweep over
    ``ranks`` may share one setting), as ``fail_rank`` does.
    """

    name: ClassVar[str] = "heterogeneity"

    def __init__(
        self,
        slow_ranks: list[int] = (),  # type: ignore[assignment]
        factor: float = 1.0,
        delay: Delay = "none",
        delay_s: float = 0.0,
        pause_probability: float = 0.0,
        pause_s: float = 0.0,
        step_time_s: float | None = 0.01,
        seed: int | None = None,
        cpu_quota: float | None = None,
    ) -> None:
        ranks = list(slow_ranks)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ConfigError(f"heterogeneity.slow_ranks={ranks}; allowed: a list of ranks (integers >= 0)")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"heterogeneity.slow_ranks={ranks}; allowed: each rank once")
        if delay not in DELAYS:
            raise ConfigError(f"heterogeneity.delay={delay!r}; allowed: {', '.join(DELAYS)}")
        self.slow_ranks = sorted(ranks)
        self.factor = float(number_in("heterogeneity.factor", factor, low=1.0))
        self.delay = delay
        self.delay_s = float(number_in("heterogeneity.delay_s", delay_s, low=0.0))
        if delay != "none" and self.delay_s == 0:
            raise ConfigError(f"heterogeneity.delay_s={delay_s} with heterogeneity.delay={delay}; "
                              "allowed: a number > 0")
        self.pause_probability = float(number_in("heterogeneity.pause_probability", pause_probability, low=0.0, high=1.0))
        self.pause_s = float(number_in("heterogeneity.pause_s", pause_s, low=0.0))
        self.step_time_s = None if step_time_s is None else float(
            number_in("heterogeneity.step_time_s", step_time_s, low=0.0, low_open=True))
        if seed is not None:
            number_in("heterogeneity.seed", seed, low=0, integer=True, note="or null (the run's seed)")
        self.seed = seed
        self.cpu_quota = None if cpu_quota is None else float(
            number_in("heterogeneity.cpu_quota", cpu_quota, low=0.01, note="(CPUs of a slow process rank), or null"))

    @property
    def active(self) -> bool:
        """Whether any rank is slowed at all."""
        return bool(self.slow_ranks) and (
            self.factor > 1 or self.delay != "none" or (self.pause_probability > 0 and self.pause_s > 0)
            or self.cpu_quota is not None)

    def describe(self) -> dict:
        """What the summary records: every setting, and whether any rank is slowed."""
        return {"slow_ranks": list(self.slow_ranks), "factor": self.factor, "delay": self.delay,
                "delay_s": self.delay_s, "pause_probability": self.pause_probability, "pause_s": self.pause_s,
                "step_time_s": self.step_time_s, "cpu_quota": self.cpu_quota, "active": self.active}

    def extra_s(self, rank: int, step: int, compute_s: float, seed: int, factor: bool = True) -> float:
        """What a step of ``rank`` costs beyond ``compute_s``: 0 for a rank that is not slow.
        ``factor=False``: without the factor's share (a rank whose CPU quota slows it instead)."""
        if rank not in self.slow_ranks:
            return 0.0
        rng = np.random.default_rng([self.seed if self.seed is not None else seed, rank, step])
        draw, pause_draw = rng.random(2)  # always two draws: one setting does not shift the other's stream
        extra = compute_s * (self.factor - 1.0) if factor else 0.0
        if self.delay == "constant":
            extra += self.delay_s
        elif self.delay == "uniform":
            extra += 2.0 * self.delay_s * draw
        elif self.delay == "exponential":
            extra += -self.delay_s * float(np.log1p(-draw))
        if pause_draw < self.pause_probability:
            extra += self.pause_s
        return extra

    def pace(self, engine: Any, seed: int, first_step: int = 1) -> "Pace":
        """This rank's pacing of its training steps, from step ``first_step`` on."""
        return Pace(self, engine, seed, first_step)


class Pace:
    """One rank's straggler cost, paid at the start of each training step (``before_step``);
    ``computed`` tells it what the step's forward and backward took."""

    def __init__(self, heterogeneity: Heterogeneity, engine: Any, seed: int, first_step: int = 1) -> None:
        self.heterogeneity = heterogeneity
        self.engine = engine
        self.seed = int(seed)
        self.step = int(first_step)
        self.simulated = getattr(engine, "time_source", "measured") == "simulated"
        self.measured_s = 0.0  # the previous step's forward and backward
        self._ahead: float | None = None  # the cost paid ahead for the step about to run

    def next_cost(self) -> float:
        """What the next step will cost (simulated: its whole time; measured: the extra sleep)."""
        h = self.heterogeneity
        compute = h.step_time_s if (self.simulated and h.step_time_s is not None) else self.measured_s
        starved = h.cpu_quota is not None and not self.simulated  # the quota slows it, not a sleep
        extra = h.extra_s(self.engine.rank, self.step, compute, self.seed, factor=not starved)
        return compute + extra if self.simulated else extra

    def before_step(self) -> float:
        """Pay this step's cost (module doc); returns the seconds the rank's time moved on. A step
        paid ahead (``pay_ahead``) is not paid twice."""
        if self._ahead is not None:
            cost, self._ahead = self._ahead, None
            return cost
        cost = self.next_cost()
        self.step += 1
        if cost > 0 or self.simulated:
            self.engine.advance(cost)
        return cost

    def pay_ahead(self) -> float:
        """Pay the next step's cost now (a budget loop: the step takes effect at the time this brings
        the clock to, and the loop decides there whether it runs); its ``before_step`` pays nothing."""
        self._ahead = None
        self._ahead = self.before_step()
        return self._ahead

    def unpay(self) -> None:
        """The step paid ahead will not run (a budget or a stop ends the loop first): its draw is the
        next step's again, as in a run that resumes here. The clock is not moved back: the caller
        keeps the time from before the payment."""
        if self._ahead is not None:
            self.step -= 1
            self._ahead = None

    def computed(self, seconds: float) -> None:
        """After backward, before ``step()``: remember the compute time; on virtual ranks also a
        zero-time yield, so that at one clock every rank has finished computing (and folded what
        arrived, at the step's start) before any rank's ``step()`` pushes: with equal step times an
        asynchronous rule then runs in synchronous rounds."""
        self.measured_s = float(seconds)
        if self.simulated:
            self.engine.advance(0.0)
