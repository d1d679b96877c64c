"""What the one-sided (asynchronous) rules share: async_push_sum, gossip, ad_psgd.

They have no rounds: a rank never waits for another inside ``step()``, only
for its own one-sided operations on one window. So no exact average can be
slipped in every H rounds (``global_average_every`` must stay 0), random
peer choices come from each rank's own stream (never a global RNG, so
virtual ranks draw as processes do), and ``close()`` frees the window once.
``finish()`` is collective and the same for all: ``quiesce()`` (this rank's
own one-sided operations complete, ``drain``, the rule's; then every rank
meets at a barrier, so every operation has landed), then the rule settles
its model (``settle``: by default a re-read of the window's model; push-sum
folds). A checkpoint of a run whose ranks stopped mid-budget is written
between the two: what has landed and is not yet settled is kept as it is.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from bfexp.algorithms.base import DecentralizedOptimizer
from bfexp.errors import ConfigError, number_in


class AsynchronousOptimizer(DecentralizedOptimizer):
    asynchronous: ClassVar[bool] = True
    window: str  # the rule's window, created in its constructor
    _closed: bool = False

    @classmethod
    def check_options(cls, **options: Any) -> None:
        super().check_options(**options)
        every = options.get("global_average_every", 0)
        if every:
            raise ConfigError(f"algorithm.global_average_every={every}; allowed: 0, since algorithm={cls.name} "
                              "never makes the ranks wait for one another")
        if "seed" in options:
            number_in("algorithm.seed", options["seed"], low=0, integer=True)

    def peer_stream(self, seed: int) -> random.Random:
        """This rank's own stream of peer choices: the same on MPI and virtual ranks."""
        return random.Random(1_000_003 * int(seed) + self.engine.rank)

    def drain(self) -> None:
        """Complete this rank's own one-sided operations in flight (never waits for a peer)."""
        raise NotImplementedError

    def settle(self) -> None:
        """After every rank's operations have landed: the model the rule evaluates and trains from.
        Default: the window's copy of the model (``self.model``), read whole under the window's lock."""
        with self.engine.win_lock(self.window):
            self.flat.copy_(self.model)

    def quiesce(self) -> None:
        """Collective: own operations complete, then every rank's (a barrier); nothing is settled."""
        if self._closed:
            return
        self.drain()
        self.engine.barrier()

    def finish(self) -> None:
        """Collective: every operation has landed (``quiesce``), then the model is settled."""
        if self._closed:
            return
        self.quiesce()
        self.settle()

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._closed = True
        self.engine.win_free(self.window)
