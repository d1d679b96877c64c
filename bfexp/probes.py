"""Measurements a job takes besides its own training: they take objects and return numbers.

* ``SingleRankReference``: the denominator of scaling efficiency. ONE rank
  runs the job's step (the same step function, algorithm wrapper, model,
  batch, dtype and device) where every communication op takes the engine's
  single-rank path, paired round by round with a plain torch step of the
  same model and batch (the framework overhead). Its steps are interleaved
  with the job's own training steps, so the reference and the job see the
  same load on a shared machine and the same loop around them. References
  are cached per key (everything that changes a step time: model,
  optimizer, wrapper, batch, sample shape, dtype, device, threads, torch)
  with the load average they were taken at, and measured again when the
  load has moved by more than a margin or the user asks;
* ``baseline_probe``: timed steps of the allreduce baseline on a fresh copy of
  the model, on the same ranks, for speedup_vs_baseline;
* ``communication_probe``: timed ``step()`` calls of an algorithm on
  zero gradients of the model's real size (throughput-only jobs: only the
  local update and the communication run).

Every probe runs the worker's step function, handed in as ``step`` (this
module sits below the worker and never imports it), so a probe step is the
job's step. Collective probes must be called by every rank; timings come
back as numbers for bfexp.scaling (medians with their intervals).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from bfexp import results, scaling
from bfexp.comm.engine import Engine
from bfexp.metrics import StepTimer

# step(net, optimizer, x, y, dtype) -> loss: the worker's train_step.
StepFunction = Callable[..., Any]
# () -> (what forward is called on, its optimizer): a fresh model and optimizer for the reference.
Factory = Callable[[], tuple[torch.nn.Module, Any]]
# Untimed rounds before the first timed one (allocations, first-call costs).
WARMUP_ROUNDS = 2


def quiet_barrier(engine: Engine) -> None:
    """A barrier that sleeps while it waits: a process engine's blocking barrier spins
    and would steal the core a measuring rank needs (threads already sleep). Virtual ranks taking
    turns in simulated time (Engine.schedule) are quiet already: no barrier, which would reorder them."""
    if getattr(engine, "scheduled", False):
        return
    handle = engine.ibarrier()
    if engine.processes:
        while not handle.done():
            time.sleep(0.002)
    handle.wait()


# How often the baseline probe asks whether the job was asked to stop (in steps).
STOP_CHECK_STEPS = 25


def timed(engine: Engine, run_one: Callable[[], Any], steps: int, warmup: int = 2, cuda: bool = False,
          timer: StepTimer | None = None) -> StepTimer:
    """Run ``warmup + steps`` steps under a StepTimer (engine-counted blocked time included); given the
    ``timer`` of earlier steps, ``steps`` more under it (its warm-up is done)."""
    more = steps if timer is not None else steps + warmup
    timer = timer if timer is not None else StepTimer(warmup=warmup, cuda=cuda)
    for _ in range(more):
        timer.start(engine)
        run_one()
        timer.stop(engine)
    return timer


def broadcast_json(engine: Engine, obj: Any, root: int = 0) -> Any:
    """``root``'s JSON-able object on every rank (two broadcasts: its length, then its bytes)."""
    raw = json.dumps(results.clean(obj)).encode() if engine.rank == root else b""
    size = engine.broadcast(torch.tensor([len(raw)], dtype=torch.int64), root)
    buf = torch.zeros(int(size[0]), dtype=torch.uint8)
    if engine.rank == root:
        buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return json.loads(bytes(engine.broadcast(buf, root).tolist()).decode())


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes), where the OS reports one."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# ---------------------------------------------------------------- the reference cache


def cache_dir(setting: str | None) -> Path | None:
    """Where single-rank references live; None = do not cache."""
    if setting is None or str(setting).lower() in ("", "none", "null", "off"):
        return None
    if setting == "auto":
        env = os.environ.get("BFEXP_CACHE_DIR")
        if env:
            return Path(env).expanduser() / "reference"
        base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
        return Path(base).expanduser() / "bfexp" / "reference"
    return Path(setting).expanduser()


def device_name(device: torch.device) -> str:
    """The device kind a reference ran on: the GPU's name, or the CPU's model."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}"


def reference_key(*, model: dict, optimizer: dict, wrapper: dict, sample_shape: tuple[int, ...], classes: int,
                  batch: int, dtype: str, device: str, threads: int) -> dict:
    """Everything that changes a single-rank step time (the reference is cached under its hash).

    Ranks and topology are not in it: on one rank there is no one to talk to,
    so jobs that differ only in those share one reference.
    """
    return {
        "model": model,
        "optimizer": optimizer,
        "wrapper": wrapper,
        "sample_shape": list(sample_shape),
        "classes": int(classes),
        "batch_size": int(batch),
        "dtype": str(dtype),
        "device": device,
        "threads": int(threads),
        "torch": torch.__version__,
    }


def reference_path(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    label = str(key["model"].get("_target_", "model")).rpartition(".")[2] or "model"
    return directory / f"{label}-b{key['batch_size']}-{digest}.json"


def load_reference(directory: Path | None, key: dict) -> dict | None:
    """The cached reference for a key, or None (absent, another key, or unreadable)."""
    if directory is None:
        return None
    record = results.read_json(reference_path(directory, key))
    if record and record.get("key") == key and (record.get("step_time_s") or 0) > 0:
        return record
    return None


def store_reference(directory: Path | None, key: dict, record: dict) -> None:
    """One file per key, replaced atomically: concurrent jobs never see half a file
    (two jobs measuring the same key at once both write a valid record)."""
    if directory is None:
        return
    results.write_json_atomic(reference_path(directory, key), {**record, "key": key})


# ---------------------------------------------------------------- single-rank reference


class SingleRankReference:
    """The single-rank reference of one job. Collective: every rank calls ``start``,
    ``after_step`` (after each training step) and ``finish``.

    ``alone`` builds the job's model and algorithm wrapper on a 1-rank engine,
    ``plain`` the same model with the bare torch optimizer; ``next_batch`` gives
    each step a new mini-batch, as training does (a batch that stays in the
    caches makes a faster step). One rank at a time times ``rounds`` steps of
    each with ``threads`` torch threads while the other ranks sleep, ONE step after each
    of evenly spaced training steps from ``first`` to ``steps`` (the job's
    timed ones), wrapper and plain taking turns: every timed step then follows
    a training step and the loop's work around it, as the job's own steps
    do (what comes just before a step changes its time by tens of percent
    on a small model). What training does not reach runs in ``finish``.

    Where ranks are processes, round k (its wrapper and plain step) runs on
    rank k mod n, and ``finish`` gathers the rounds to rank 0: a process's
    speed comes in stretches of its own (CHOCO-SGD's top-k ran 104-162 ms a
    step in one process while the job's ranks averaged 156 ms), so timing one
    process alone samples one of them. Virtual ranks share one process and
    rank 0 times them all.

    ``policy`` cached reuses the cache's reference of ``key`` unless the load
    average has moved by more than ``margin`` since it was taken; fresh
    measures. A job that itself runs on one rank (``job_alone``) always
    measures: it is its own reference, measured beside its own steps at no
    cost to other ranks, and it refreshes the cache for the jobs on more ranks.

    ``own_steps`` (a 1-rank job whose steps run at the reference's threads and
    pace, with at least ``rounds`` timed steps): the job's own timed training
    steps are the wrapper's samples, passed to ``finish`` (fewer than
    ``rounds`` after all, e.g. a run stopped early: the wrapper is timed in
    rounds); rounds time only plain steps, each paired with the training
    step it follows (``after_step``'s ``step_s``) for the framework overhead.
    The job then scores efficiency 1 by definition, with its steps' interval,
    instead of against a second copy of its model timed in between (which
    differed from the job's own steps by up to 10% on a 0.2 ms step here:
    caches and allocator state, not scaling).
    """

    def __init__(self, engine: Engine, step: StepFunction, *, alone: Factory, plain: Factory,
                 next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], key: dict, directory: Path | None,
                 policy: str, margin: float, rounds: int, threads: int, steps: int = 0, first: int = 1,
                 job_alone: bool = False, own_steps: bool = False) -> None:
        self.engine, self.step, self.alone, self.plain, self.next_batch = engine, step, alone, plain, next_batch
        self.key, self.directory, self.policy, self.margin = key, directory, policy, margin
        self.threads, self.job_alone = threads, job_alone or own_steps
        self.rounds = rounds
        # round k on rank k mod n (processes; ranks in one process share its speed, rank 0 times them)
        self.rotate = bool(getattr(engine, "processes", False)) and engine.size > 1
        self.taken: list[str] = []  # every item timed so far, in order (the same list on every rank)
        self.timed: dict[int, float] = {}  # this rank's: item index -> seconds
        self.own = own_steps and steps - first + 1 >= rounds and torch.get_num_threads() == threads
        # training step -> what to time after it (pairs in alternating order: plain, wrapper, wrapper, plain, ...;
        # with the job's own steps as the wrapper's, plain steps alone)
        pairs = [which for k in range(rounds) for which in (("plain", "wrapper"), ("wrapper", "plain"))[k % 2]]
        turns = ["plain"] * rounds if self.own else pairs
        self.schedule: dict[int, list[str]] = {}
        for k, which in enumerate(turns if steps >= first else []):
            self.schedule.setdefault(first + k * (steps - first + 1) // len(turns), []).append(which)
        self.pairs = pairs
        self.left = pairs if steps < first else []  # for ``finish``
        self.own_samples: list[float] = []
        self.measuring = False
        self.cached: dict | None = None
        self.refreshed: str | None = None
        self.load_now: float | None = None
        self.samples: dict[str, list[float]] = {"wrapper": [], "plain": []}
        self.ranks: list[int] = [0]  # the ranks that timed rounds
        self._built: dict[str, tuple[torch.nn.Module, Any]] | None = None

    def start(self) -> None:
        """Rank 0 decides between the cache and a measurement; every rank learns which."""
        flag = torch.zeros(1, dtype=torch.float64)
        if self.engine.rank == 0:
            self.load_now = load_average()
            self.cached = None if self.policy == "fresh" else load_reference(self.directory, self.key)
            if self.policy == "fresh":
                self.refreshed = "scaling.reference=fresh"
            elif self.cached and self.job_alone:
                self.refreshed = "a 1-rank job is its own reference: measured beside its own steps"
                self.cached = None
            elif self.cached and scaling.load_moved(self.cached.get("load_average_1min"), self.load_now, self.margin):
                self.refreshed = (f"the cached reference was taken at load {_load(self.cached.get('load_average_1min'))} "
                                  f"and the load is now {_load(self.load_now)}, more than "
                                  f"scaling.reference_load_margin={self.margin:g} apart")
                self.cached = None
            flag[0] = 0.0 if self.cached else 1.0
        self.measuring = bool(self.engine.broadcast(flag, 0)[0] > 0)

    def after_step(self, step: int, step_s: float | None = None) -> None:
        """After a training step (``step_s``: its time): on its turn, one rank times a reference step
        while the others sleep."""
        turn = self.schedule.pop(step, [])
        if self.own and self.measuring and turn and step_s is not None and self.engine.rank == 0:
            self.samples["wrapper"].extend([step_s] * len(turn))  # the training step each plain round pairs with
        self._take(turn)

    def finish(self, own_steps: Sequence[float] = ()) -> dict:
        """The reference record (the summary's ``reference``), the same on every rank. ``own_steps``:
        the job's timed training steps (used with ``own_steps=True``)."""
        if self.own and len(own_steps) >= self.rounds:
            self.own_samples = list(own_steps)
            self.schedule.clear()  # rounds training did not reach: the overhead pairs it did reach suffice
        elif self.own:  # too few timed steps after all (a run stopped early): time the wrapper too
            self.own, self.samples, self.left, self._built = False, {"wrapper": [], "plain": []}, self.pairs, None
            self.taken, self.timed = [], {}
            self.schedule.clear()
        # What training did not reach (a short, resumed or diverged run): in rounds, order kept.
        self._take(self.left + [which for turn in self.schedule.values() for which in turn])
        self.schedule.clear()
        self._gather()
        record = None
        if self.engine.rank == 0:
            record = self._measured() if self.measuring else {**self.cached, "source": "cache"}
            record.pop("key", None)
            path = reference_path(self.directory, self.key) if self.directory is not None else None
            record.update({"refreshed": self.refreshed, "load_now_1min": self.load_now,
                           "load_margin": self.margin, "policy": self.policy,
                           "cache_file": str(path) if path else None, "key": self.key})
        self._built = None
        return broadcast_json(self.engine, record)

    # the measuring rank's side ----------------------------------------------
    def _owner(self, item: int) -> int:
        """The rank that times item ``item`` (items 2k and 2k + 1 are round k's pair)."""
        return (item // 2) % self.engine.size if self.rotate and not self.own else 0

    def _take(self, turn: list[str]) -> None:
        if not (self.measuring and turn):
            return
        mine = [(len(self.taken) + i, which) for i, which in enumerate(turn)
                if self._owner(len(self.taken) + i) == self.engine.rank]
        self.taken.extend(turn)
        if mine:
            saved = torch.get_num_threads()
            switch = saved != self.threads  # the job's ranks run fewer threads each than one rank alone
            if switch:
                torch.set_num_threads(self.threads)
            try:
                if self._built is None:
                    kinds = ("plain",) if self.own else ("plain", "wrapper")
                    self._built = {which: (self.alone if which == "wrapper" else self.plain)() for which in kinds}
                    for _ in range(WARMUP_ROUNDS):
                        for which in kinds:
                            self._time(which)
                for item, which in mine:
                    if switch:  # threads that slept through the job's steps wake up in an untimed step
                        self._time(which)
                    self.timed[item] = self._time(which)
            finally:
                if switch:
                    torch.set_num_threads(saved)
        quiet_barrier(self.engine)

    def _gather(self) -> None:
        """Every rank's rounds to rank 0, in their order (rank 0's own when it timed them all)."""
        if not self.measuring:
            return
        owners = sorted({self._owner(i) for i in range(len(self.taken))})
        timed = dict(self.timed)
        for root in (r for r in owners if r != 0):  # none where rank 0 timed every round
            theirs = broadcast_json(self.engine, {str(k): v for k, v in self.timed.items()}, root)
            timed.update({int(k): float(v) for k, v in theirs.items()})
        if self.engine.rank == 0:
            for item, which in enumerate(self.taken):
                self.samples[which].append(timed[item])
            self.ranks = owners
        self.taken, self.timed = [], {}

    def _measured(self) -> dict:
        record = scaling.reference_figures(self.samples["wrapper"], self.samples["plain"], self.own_samples or None)
        record.update({
            "source": "measured",
            "wrapper_steps": "the job's own training steps" if self.own_samples else "timed rounds",
            "steps": len(self.own_samples or self.samples["wrapper"]),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rounds": len(self.samples["plain"]),
            "ranks": self.ranks,
            "threads": self.threads,
            "load_average_1min": self.load_now,
            "load_at_end_1min": load_average(),
        })
        store_reference(self.directory, self.key, record)
        return record

    def _time(self, which: str) -> float:
        net, optimizer = self._built[which]
        x, y = self.next_batch()
        dtype = next(net.parameters()).dtype
        cuda = x.is_cuda
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.step(net, optimizer, x, y, dtype)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


# ---------------------------------------------------------------- allreduce baseline


def baseline_probe(
    engine: Engine,
    step: StepFunction,
    make_model: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    stop: Callable[[], bool] | None = None,
) -> tuple[list[float], int]:
    """``steps`` timed steps of the allreduce baseline (its defaults: overlapped with
    backward, every step) on a fresh copy of the model. Collective. Returns this
    rank's step and blocked seconds (scaling.rank_timing: medians and intervals), and
    the steps timed: fewer when ``stop()`` (collective: the ranks agree), asked every
    STOP_CHECK_STEPS steps, says the job was asked to stop (a signal while the
    results are measured ends the job promptly)."""
    from bfexp.algorithms import Allreduce

    probe = make_model()
    optimizer = Allreduce(make_optimizer(probe.parameters()), engine)
    dtype = next(probe.parameters()).dtype

    def one() -> None:
        x, y = next_batch()
        step(probe, optimizer, x, y, dtype)

    timer = timed(engine, one, min(steps, STOP_CHECK_STEPS), cuda=next(probe.parameters()).is_cuda)
    while len(timer.step_samples) < steps and not (stop is not None and stop()):
        timed(engine, one, min(STOP_CHECK_STEPS, steps - len(timer.step_samples)), timer=timer)
    optimizer.close()  # completes what is in flight, releases its hooks
    return scaling.rank_timing(timer.step_samples, timer.blocked_samples), len(timer.step_samples)


# ---------------------------------------------------------------- communication only


def communication_probe(engine: Engine, step: StepFunction, optimizer: Any, steps: int) -> list[float]:
    """Timed ``step()`` calls of a wrapped optimizer whose gradients are zero (set once):
    the local update and the communication, no forward or backward. Collective.
    Returns this rank's step and blocked seconds (scaling.rank_timing)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    timer = timed(engine, lambda: step(None, optimizer, None, None, None), steps,
                  cuda=optimizer.param_groups[0]["params"][0].is_cuda)
    optimizer.close()
    return scaling.rank_timing(timer.step_samples, timer.blocked_samples)
