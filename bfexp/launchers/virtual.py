"""Virtual ranks: a job's ranks as threads of the driver's process (engine=threads; engine=stacked: ONE thread
running every rank as one batched program, bfexp.comm.stacked), with MPI's files and status rules.

Every rank reads the config the driver wrote, as an MPI rank does, and runs the worker's ``run``; a rank that
raises records its failure (results.record_failure) and the others raise RankAborted at their next engine call
(or wake in a wait). What the ranks print goes to logs/rank<N>.log, as MPI ranks' output does. The driver
(bfexp.launch) supervises them as it supervises process ranks: ``VirtualRanks`` answers the watch loop's
questions (bfexp.launch.Ranks) from ``started`` on and, after the job, gives the exit code, the reason and
the failure the driver saw itself (``outcome``). Imports torch (when built): the driver reaches here only for
a job of virtual ranks.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from omegaconf import OmegaConf

from bfexp import config, results
from bfexp.errors import RankAborted
from bfexp.sessions import TERMINATE_GRACE_S
from bfexp.watchdog import dump_thread_stacks, live_heartbeats

__all__ = ["ThreadRanks", "VirtualRanks", "intra_op_threads"]


def intra_op_threads(ranks: int) -> int:
    """torch threads per rank: R ranks each using every core thrash the machine."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


class ThreadRanks:
    """Virtual ranks as the watch loop sees them: the threads of a ThreadWorld."""

    def __init__(self, world: Any, run_dir: Path) -> None:
        self.world, self.run_dir, self.waits = world, run_dir, world.waits

    def running(self, wait_s: float) -> bool:
        return not self.world.join(wait_s)

    def failed(self) -> bool:
        return self.world.failed

    def end(self, reason: str) -> None:
        self.world.abort(RankAborted(reason))  # every rank raises at its next engine call, or wakes in a wait
        self.world.join(TERMINATE_GRACE_S)

    def dump_stacks(self, stuck: dict) -> None:
        dump_thread_stacks(self.run_dir, stuck)


class VirtualRanks(ThreadRanks):
    """One job's virtual ranks: the engine and world its config names, started by ``started``."""

    def __init__(self, engine_node: Any, ranks: int, run_dir: Path) -> None:
        """The job's ``ranks`` on the engine its node (``engine_node``) names."""
        from bfexp.comm import engine_class
        from bfexp.comm.threads import ThreadWorld

        run_dir = Path(run_dir)
        timeline_dir = run_dir / "timeline" if engine_node.get("timeline", False) else None
        node = {**OmegaConf.to_container(engine_node, resolve=True), "_partial_": True}
        # engine=stacked: ONE thread runs every rank as one batched program, supervised as a world of one
        # virtual rank; its engine holds the job's ranks.
        self.stacked = engine_class(engine_node.name).stacked
        self.threads = 1 if self.stacked else int(ranks)
        engine = config.build(node, "engine", **({"size": int(ranks)} if self.stacked else {}))  # (world, rank)
        world = ThreadWorld(self.threads, 0 if self.stacked else engine_node.ranks_per_machine,
                            timeline_dir=timeline_dir, engine=engine)
        super().__init__(world, run_dir)

    def heartbeats(self) -> dict[int, dict]:
        """The ranks' heartbeats, for the hang watchdog (read from the threads, not from files)."""
        return live_heartbeats(self.run_dir)

    def _rank_main(self, engine: Any) -> dict:  # every rank reads the config the driver wrote, as an MPI rank does
        from bfexp.worker import run

        return run(OmegaConf.load(self.run_dir / results.CONFIG), engine, self.run_dir)

    def _on_error(self, rank: int, exc: BaseException) -> None:
        if not isinstance(exc, RankAborted):  # the others only follow the failed rank down
            with contextlib.suppress(OSError):  # a full disk: the driver names the failure from world.errors
                results.record_failure(self.run_dir, rank, exc)

    @contextlib.contextmanager
    def started(self) -> Iterator["VirtualRanks"]:
        """Within: the ranks run (started on entry), their output in logs/rank<N>.log, torch's threads shared
        out among them (process-wide: set once, here)."""
        import torch

        from bfexp.comm.stacked import freed_memory_kept
        from bfexp.comm.threads import routed_output

        saved_threads = torch.get_num_threads()
        # engine=stacked: one torch thread; its ops are many small batched kernels, which two threads on this
        # shared 2-core machine ran 3-5x slower than one (128 ranks).
        torch.set_num_threads(1 if self.stacked else intra_op_threads(self.threads))
        try:
            with routed_output(self.run_dir / results.LOGS_DIR), \
                    (freed_memory_kept() if self.stacked else contextlib.nullcontext()):
                self.world.start(self._rank_main, self._on_error)
                yield self
        finally:
            if not self.world.alive():  # a rank thread still inside torch keeps the pool it runs on
                torch.set_num_threads(saved_threads)

    def outcome(self, reason: str | None) -> tuple[int, str | None, str | None]:
        """After the watch: (exit code, the reason the job ended early, the failure the driver saw itself for
        when no rank could record one)."""
        stuck = self.world.alive()
        if stuck and reason is None and not self.world.errors:
            reason = f"rank threads {stuck[:8]} did not finish"
        own = {r: e for r, e in sorted(self.world.errors.items()) if not isinstance(e, RankAborted)}
        fallback = next((f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                         for r, e in own.items()), None)
        return (1 if self.world.errors or stuck else 0), reason, fallback
