"""What every rank runs: `python -m mpi4py -m bfexp.worker RUN_DIR`.

Workers are not Hydra apps: they read the resolved config the driver wrote
into RUN_DIR, so every rank agrees on one directory. Everything here is
engine-agnostic (virtual ranks call it from threads): it touches no global
RNG and no process-wide state beyond what the caller set up.

Top to bottom: ``build`` makes a rank's components from the config (a column
of builds, one per group); ``train_step`` is THE training step, which the
loop and every probe (bfexp.probes) run; ``train`` is the loop, which
resumes from and writes checkpoints and stops where the ranks agree to
(bfexp.checkpoint); the three kinds of job (train; throughput-only on
ranks; modeled, with no ranks) are dispatched in one place, ``JOBS``, and
every rank's heartbeat feeds the driver's hang watchdog (bfexp.watchdog).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from bfexp import budget, cgroups, checkpoint, checkpointer, config, probes, results, scaling, watchdog
from bfexp.config import job_kind
from bfexp.algorithms import Allreduce, DecentralizedOptimizer
from bfexp.assembly import assemble, layout_ranks_per_machine
from bfexp.summary import compute_speed, job_identity, modeled_block, pricing_facts, reference_fields, scaling_block
from bfexp.comm.engine import Engine
from bfexp.comm.stacked import StackedData, StackedModel, StackedSampler
from bfexp.data import BatchSampler, RankData
from bfexp.heterogeneity import Heterogeneity, Pace
from bfexp.ledger import Ledger, Prices
from bfexp.schema import Settings
from bfexp.torch_internals import defer_dynamo
from bfexp.metrics import (EvalSchedule, StepTimer, consensus_distance, cross_entropy, evaluate, gather_floats,
                           global_mean, held_out, model_input, perplexity, rank_value)
from bfexp.models import build_model, sample_shape
from bfexp.plan import Plan
from bfexp.timeline import Timeline, span
from bfexp.topology import Topology

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
BASELINE = "allreduce"
# The graph of a 1-rank world (every graph is W = [1] there): the single-rank reference's topology.
ONE_RANK = {"_target_": "bfexp.topology.FullyConnected"}
# Where this process's wall time went, from its start (an MPI rank's: rank 0 writes logs/timing.json).
PHASES = results.Phases("rank 0", results.process_started_at())


def mark(engine: Engine, phase: str) -> None:
    """End a phase of this rank's wall time (ranks that are processes; `bfexp --verbose` shows rank 0's)."""
    if engine.processes:
        PHASES.mark(phase)


# ---------------------------------------------------------------- THE step


def train_step(net: torch.nn.Module | None, optimizer: Any, x: torch.Tensor | None, y: torch.Tensor | None,
               dtype: torch.dtype | None, timeline: Timeline | None = None, pace: Pace | None = None
               ) -> torch.Tensor | None:
    """One training step: zero_grad, forward (inputs cast to the model's dtype), loss, backward, step.

    ``x=None`` runs ``step()`` alone on the gradients already set: the
    communication probe of throughput-only jobs. Returns the loss (None then).
    ``pace`` (bfexp.heterogeneity): a straggler's extra time, paid before the step, and
    the rank's simulated compute time on virtual ranks.
    """
    if x is None:
        optimizer.step()
        return None
    if pace is not None:
        pace.before_step()
        computing = time.perf_counter()
    optimizer.zero_grad()
    with span(timeline, "forward"):
        out = net(model_input(x, dtype))
        # Stacked ranks (bfexp.comm.stacked): each rank's mean loss; the sum's gradient is each rank's own.
        loss = net.losses(out, y) if isinstance(net, StackedModel) else cross_entropy(out, y)
    with span(timeline, "backward"):
        (loss if loss.dim() == 0 else loss.sum()).backward()  # a scalar as it is: no extra op to run backward
    if pace is not None:
        pace.computed(time.perf_counter() - computing)
    if isinstance(optimizer, DecentralizedOptimizer):
        optimizer.observe_loss(loss.detach())
    with span(timeline, "step"):
        optimizer.step()
    return loss


# ---------------------------------------------------------------- building a rank's components


@dataclass
class Built:
    """One rank's components for a job, built from the config."""

    topology: Topology  # what the algorithm runs on (exact diffusion may substitute an undirected form)
    data: RankData
    model: torch.nn.Module
    optimizer: Any  # the algorithm wrapping the local optimizer
    net: torch.nn.Module  # what forward is called on (ddp: its wrapper)
    make_model: Callable[[], torch.nn.Module]  # a fresh copy of the architecture, for probes
    make_optimizer: Callable[[Any], torch.optim.Optimizer]  # the local optimizer on given parameters
    in_shape: tuple[int, ...]
    classes: int
    dtype: torch.dtype
    device: torch.device
    notes: list[str] = field(default_factory=list)  # what the assembly noted (the driver printed the same)
    tokens: bool = False  # samples are token ids with a target per position (a language model's data)
    # One rank's model (the single-rank reference's); make_model's own unless the engine is stacked.
    make_rank_model: Callable[[], torch.nn.Module] | None = None
    forward_flop_per_sample: int = 0  # as the driver's plan counted it (0: no plan)

    def rank_model(self) -> torch.nn.Module:
        return (self.make_rank_model or self.make_model)()

    def rank_data(self) -> RankData:
        """Rank 0's shard on a stacked engine (the single-rank reference's data), else this rank's."""
        return self.data.shards[0] if isinstance(self.data, StackedData) else self.data


def build(settings: Settings, engine: Engine, *, dataset: Any, model: Any, optimizer: Any, algorithm: Any,
          topology: Any, with_data: bool = True, plan: Plan | None = None) -> Built:
    """A rank's data shard, model, local optimizer and algorithm on its topology, as their nodes name them
    (``settings``: the run's dtype and seed).

    The algorithm, topology and engine are put together by bfexp.assembly, as the
    library and BlueFog's layer put them together (the driver printed its notes).
    ``with_data=False`` (throughput-only) sizes the model from the declared
    sample shape and loads no data. ``plan``: the driver's plan of the job (bfexp.plan), which this
    build must match (PlanMismatch names the difference).
    """
    dtype = DTYPES[settings.dtype]
    source = config.build(dataset, "dataset")
    if with_data and engine.stacked:  # every rank's shard, read and split once
        data = StackedData(source.load_ranks(engine.size, settings.seed))
        in_shape, classes = tuple(data.train_x.shape[1:]), data.classes
    elif with_data:
        data = source.load(engine.rank, engine.size, settings.seed)
        in_shape, classes = tuple(data.train_x.shape[1:]), data.classes
        mark(engine, "build: data shard")
    else:
        data = None
        in_shape, classes = sample_shape(model, source)
    device = getattr(engine, "device", None) or torch.device("cpu")  # GPU engines name the rank's device

    def make_rank_model() -> torch.nn.Module:
        return build_model(model, in_shape, classes, settings.seed, dtype).to(device)

    def make_model() -> torch.nn.Module:  # stacked: every rank's copy of the same start as one module
        return StackedModel(make_rank_model(), engine.size) if engine.stacked else make_rank_model()

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        return config.build(optimizer, "optimizer")(params)

    module = make_model()
    if plan is not None:
        plan.confirm(in_shape, classes, rank_numel(module))
    made = assemble(algorithm, make_optimizer(module.parameters()), engine, topology, model=module,
                    throughput_only=not with_data)
    wrapper = made.optimizer
    net = wrapper.module if wrapper.module is not None else module  # ddp: the DDP wrapper
    if getattr(type(wrapper), "asynchronous", False):  # virtual ranks: window ops in simulated-clock order
        engine.schedule()
    tokens = data.tokens if data is not None else bool(getattr(source, "tokens", False))
    return Built(made.topology, data, module, wrapper, net, make_model, make_optimizer, in_shape, classes, dtype,
                 device, made.notes, tokens, make_rank_model,
                 plan.forward_flop_per_sample if plan is not None else 0)


def peak_memory_bytes() -> int:
    """The largest resident set of this process's own memory so far: Linux's VmHWM, which starts afresh at
    exec. getrusage's ru_maxrss does not: it keeps the high-water mark of the process that forked this one
    (a large pytest or notebook process set every job's peak to its own size). Elsewhere, ru_maxrss (KiB on
    Linux, bytes on macOS)."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def rank_numel(model: torch.nn.Module) -> int:
    """Parameters of one rank's model (a stacked model holds every rank's)."""
    return model.rank_numel if isinstance(model, StackedModel) else sum(p.numel() for p in model.parameters())


def is_baseline(algorithm: Any) -> bool:
    """Whether the algorithm (its node) is the baseline (allreduce)."""
    return config.label(algorithm) == BASELINE


# ---------------------------------------------------------------- the training loop


@dataclass
class Trained:
    """What a rank's training left: the summary, its last mini-batch loss and final parameters."""

    summary: dict
    loss: float | None
    parameters: torch.Tensor


def train(settings: Settings, engine: Engine, run_dir: Path, **parts: Any) -> Trained:
    """Train one rank's model; rank 0 writes metrics.jsonl and summary.json. ``parts``: the sections Training reads."""
    return Training(settings, engine, run_dir, **parts).run()


class Training:
    """One rank's training job, read top to bottom: ``__init__`` builds it (or restores it from the run
    folder's checkpoint), ``run`` is the loop, ``log`` a logging step, ``summary`` what it reports.

    It reads the run's ``settings`` and the components' nodes: the dataset, model, optimizer, algorithm and
    topology it builds, the heterogeneity node (stragglers), the scaling node (the single-rank reference and
    the figures), the engine's and the launcher's nodes (where the ranks ran); the job's ``identity``
    (summary.job_identity) heads its summary, and ``experiment`` (checkpoint.experiment) is what its
    checkpoints are valid for."""

    def __init__(self, settings: Settings, engine: Engine, run_dir: Path, *, identity: dict, experiment: dict,
                 dataset: Any, model: Any, optimizer: Any, algorithm: Any, topology: Any, heterogeneity: Any,
                 scaling_node: Any, engine_node: Any, launcher: Any) -> None:
        self.settings, self.engine, self.run_dir = settings, engine, run_dir
        self.identity, self.heterogeneity_node = identity, heterogeneity
        # what the figures after training read (job_figures)
        self.figure_nodes = {"algorithm": algorithm, "model": model, "scaling_node": scaling_node,
                             "engine_node": engine_node, "launcher": launcher}
        self.started = time.perf_counter()
        self.job = job = build(settings, engine, dataset=dataset, model=model, optimizer=optimizer, algorithm=algorithm,
                               topology=topology, plan=Plan.read(run_dir))
        mark(engine, "build: model, optimizer, algorithm")
        data = job.data
        self.sampler = (StackedSampler(data, settings.batch_size, settings.seed) if isinstance(data, StackedData)
                        else BatchSampler(data, settings.batch_size, settings.seed, engine.rank))
        self.steps = steps = config.total_steps(settings, data.global_train_size, engine.size)
        self.timer = StepTimer(warmup=min(3, steps // 4), cuda=job.device.type == "cuda")
        # Stragglers (bfexp.heterogeneity): a rank's extra time per step, or its simulated compute time.
        self.heterogeneity = config.build(heterogeneity, "heterogeneity") if heterogeneity else Heterogeneity()
        # The single-rank reference: from the cache, or measured in rounds between the timed training steps
        # (a 1-rank job at an even pace is its own: its steps are the reference's).
        self.single = reference(engine, job,
                                BatchSampler(job.rank_data(), settings.batch_size, settings.seed + 1, engine.rank).next,
                                algorithm=algorithm, model=model, optimizer=optimizer, scaling_node=scaling_node,
                                dtype=settings.dtype, steps=steps, first=self.timer.warmup + 1,
                                own_steps=engine.size == 1 and not self.heterogeneity.active)
        mark(engine, "single-rank reference: cache look-up")
        self.test = held_out(model_input(data.test_x.to(job.device), job.dtype), data.test_y.to(job.device),
                             settings.eval_subset)
        # A checkpoint in the run folder (a resumed run): continue from its step, bit for bit, with the
        # loop's own state: the logging window's sums, the last record, the bytes this rank's training
        # steps put on the wire (engine.bytes_sent, compressed as sent) and the time so far.
        self.checkpoints = checkpointer.Checkpointer(settings.checkpoint_every, experiment, engine, run_dir)
        # A stop request between logging steps: where ranks are processes (a signal, Slurm's preemption) and
        # the rule is synchronous. Virtual ranks' simulated clocks and an asynchronous rule's ranks would be
        # synchronized by the poll's collective at wall-clock times: their results would change from run to run.
        synchronous = not getattr(type(self.job.optimizer), "asynchronous", False)
        self.polls = StopPoll(engine) if engine.processes and synchronous else None
        resumed = self.checkpoints.restore(job.model, job.optimizer, self.sampler)
        self.first = resumed["step"] + 1
        self.interval_loss, self.interval_n = resumed.get("interval_loss", 0.0), resumed.get("interval_n", 0)
        self.record: dict = resumed.get("record", {})
        self.bytes_sent = resumed.get("bytes_sent", 0)
        self.elapsed_before = resumed.get("elapsed_s", 0.0)
        # Held-out evaluation: at eval_every, or as often as eval_budget of the training time allows (bfexp.metrics).
        self.evals = EvalSchedule(settings.eval_every, settings.eval_budget, settings.log_every,
                                  len(self.test[1]), self.sampler.batch_size, steps, settings.eval_points)
        self.evals.time_s, self.last_eval = resumed.get("eval_time_s", 0.0), resumed.get("last_eval", {})
        # Time to accuracy: this rank's training time, simulated (virtual ranks' clocks) or measured
        # (wall seconds inside its training steps, straggler sleeps included).
        self.pace = self.heterogeneity.pace(engine, int(settings.seed), first_step=self.first)
        self.clock = TrainClock(engine, resumed.get("time_s", 0.0))
        # A time budget (bfexp.budget): `steps` is then the most a rank runs. Synchronous ranks pull the
        # last step in where they agree the budget ends; asynchronous ones train without lockstep.
        self.budget_s = None if settings.budget_s is None else float(settings.budget_s)
        self.last = steps
        self.budget_mark = (self.first - 1, self.clock.now_s())  # (step, time) the pace is measured from
        self.unlocked = config.no_lockstep(settings, algorithm)
        self.ended = "steps"  # what ended training: steps, budget, stop, diverged
        self.resumed = resumed  # an asynchronous budget run's own state: its place at the cut, its copies
        self.cgroup: Path | None = None  # a CPU-starved rank's cgroup (heterogeneity.cpu_quota)
        # Modeled time (bfexp.ledger): rank 0 records what each training step sent (operations.json), and on a
        # cluster whose compute speed it knows prices each step as it goes (metrics.jsonl's modeled_time_s).
        self.ledger = self.prices = None
        self.modeled_s = 0.0
        if engine.rank == 0:
            saved = resumed.get("ledger")
            self.ledger = Ledger.from_json(saved) if saved else Ledger(engine.size, engine.rank)
            engine.ledger = self.ledger
            params = list(job.model.parameters())
            self.ledger.facts = pricing_facts(algorithm, model, int(settings.batch_size),
                                              rank_numel(job.model) * params[0].element_size(),
                                              job.forward_flop_per_sample)
            self.prices = Prices.on(scaling_node, self.ledger.facts)
            if self.prices is not None and saved:
                self.modeled_s = (self.prices.cumulative(self.ledger) or [0.0])[-1]

    def state(self) -> dict:
        """What a checkpoint keeps of the loop besides the model, the algorithm and the sampler."""
        return {"interval_loss": self.interval_loss, "interval_n": self.interval_n, "record": self.record,
                "bytes_sent": self.bytes_sent, "elapsed_s": self.elapsed(), "time_s": self.clock.now_s(),
                "eval_time_s": self.evals.time_s, "last_eval": self.last_eval,
                "ledger": self.ledger.to_json() if self.ledger is not None else None}

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (collective: every rank gets the same answer)."""
        [flags] = gather_floats(self.engine, self.checkpoints.stop_requested())
        return any(flag > 0 for flag in flags)

    def stopped(self, at: int) -> str:
        return f"stopped at step {at} ({checkpoint.stop_reason(self.run_dir) or 'stop requested'}); checkpoint at step {at}"

    def budget_ends(self, step: int, now: float | None = None) -> bool:
        """At a logging step of a synchronous budget run (every rank has the same record; ``now``: the
        slowest rank's training time, the record's by default): whether the budget is spent; if not, the
        last step is pulled in to where the pace since the last look says it will be (or pushed out
        again: the next logging step looks again)."""
        assert self.budget_s is not None
        now = float(self.record["time_s"]) if now is None else now
        mark_step, mark_s = self.budget_mark
        self.budget_mark = (step, now)
        if now >= self.budget_s:
            return True
        pace = (now - mark_s) / (step - mark_step) if step > mark_step else 0.0
        if pace > 0:
            fits = math.floor((self.budget_s - now) / pace + 1e-9)
            if fits == 0:
                return True
            self.last = min(self.steps, step + fits)
        return False

    def run(self) -> Trained:
        if self.engine.size > 1:  # training time (and a budget's clock) starts once every rank is here: start-up
            self.engine.barrier()  # skew (tens of seconds under load) would land in the first step's wait
        try:
            return self.run_unlocked() if self.unlocked else self.run_locked()
        finally:
            self.speed_up()

    def slow_down(self, step: int) -> None:
        """After the first training step (start-up and the first step's one-time costs at full speed):
        a slow process rank under heterogeneity.cpu_quota moves into its own CPU-quota cgroup."""
        if step == self.first and self.cgroup is None:
            self.cgroup = starve(self.heterogeneity_node, self.engine, self.run_dir)

    def speed_up(self) -> None:
        """Training is over: a CPU-starved rank leaves its cgroup, which goes (bfexp.cgroups), so that the
        figures after training (evaluation, the scaling probes) run at the speed of the rest."""
        if self.cgroup is not None:
            cgroups.leave(self.cgroup)
            self.cgroup = None

    def timed_step(self) -> torch.Tensor:
        """THE step on this rank's next batch, timed (the job's timer, the rank's clock) and its bytes counted:
        what both loops run."""
        job, engine = self.job, self.engine
        x, y = self.sampler.next()
        x, y = x.to(job.device), y.to(job.device)
        sent_before = engine.bytes_sent
        ledger = self.ledger
        if ledger is not None:
            ledger.begin()
        self.timer.start(engine)
        self.clock.start()
        loss = train_step(job.net, job.optimizer, x, y, job.dtype, engine.timeline, self.pace)
        self.clock.stop()
        self.timer.stop(engine)
        self.bytes_sent += engine.bytes_sent - sent_before
        if ledger is not None:
            index = ledger.end()
            if self.prices is not None:
                self.modeled_s += self.prices.step_s(ledger, index)
        return loss

    def run_locked(self) -> Trained:
        settings, engine, job, optimizer, sampler, timer = self.settings, self.engine, self.job, self.job.optimizer, self.sampler, self.timer
        status, error, loss = results.COMPLETED, None, None
        step = self.first - 1
        for step in range(self.first, self.steps + 1):
            # the heartbeat; an injected fault (fail_rank, fail_step, fail_mode)
            watchdog.at_step(engine, step, settings.fail_rank, settings.fail_step, settings.fail_mode)
            loss = self.timed_step()
            self.interval_loss += rank_value(loss)
            self.interval_n += 1
            self.single.after_step(step, timer.last_s)
            self.slow_down(step)
            if self.budget_s is not None and step == self.first and not self.evals.logs(step, self.last):
                # The first step gives the pace (one collective): where the budget ends, before the first
                # logging step, which may come long after it with slow steps.
                if self.budget_ends(step, self.clock.latest_s()):
                    self.last = step
            if not self.evals.logs(step, self.last):
                asked = self.polls is not None and self.polls.due(step) and \
                    self.polls.agree(step, self.checkpoints.stop_requested())
                if self.checkpoints.boundary(step, job.model, optimizer, sampler, self.state(),  # checkpoint_every
                                             stop=True if asked else None):
                    status, error = results.INTERRUPTED, self.stopped(step)
                    break
                continue
            stop = self.log(step)
            train_loss = self.record["loss"]
            if not math.isfinite(train_loss) or train_loss > settings.divergence_loss:
                status, error = results.DIVERGED, f"loss {train_loss:.4g} at step {step} (divergence_loss={settings.divergence_loss:g})"
                break
            if self.checkpoints.boundary(step, job.model, optimizer, sampler, self.state(), stop=stop > 0):
                status, error = results.INTERRUPTED, self.stopped(step)
                break
            if self.budget_s is not None and self.budget_ends(step):
                self.ended = "budget"
                break
        self.speed_up()
        optimizer.finish()
        mark(engine, "training loop")
        parameters = optimizer.evaluation_parameters().detach().cpu().clone()
        summary = self.summary(status, error, step)
        optimizer.close()
        summary["wall_time_s"] = time.perf_counter() - self.started
        summary["peak_memory_bytes"] = peak_memory_bytes()
        if engine.rank == 0:
            self.ledger.save(self.run_dir)
            results.write_json_atomic(self.run_dir / results.SUMMARY, summary)
        return Trained(summary, float(loss.detach().mean()) if loss is not None else None, parameters)

    def log(self, step: int) -> float:
        """A logging step (collective): evaluate when due, average over ranks, rank 0 appends the record.
        Returns the ranks' stop flag (> 0: a stop was asked), which travels with the metrics so that every
        rank learns of it at the same step."""
        engine, optimizer, evals = self.engine, self.job.optimizer, self.evals
        optimizer.finish()
        evaluating = evals.due(step, self.last)
        eval_started = time.perf_counter()
        eval_loss, accuracy = evaluate(self.job.model, *self.test) if evaluating else (math.nan, math.nan)
        eval_s = time.perf_counter() - eval_started
        # Under a budget, also the worst rank's accuracy and the ranks' average model's (time to a target).
        models = self.models(accuracy) if evaluating and self.budget_s is not None else {}
        train_loss, eval_loss, accuracy, step_time, mean_sent, stop = global_mean(
            engine, self.interval_loss / self.interval_n, eval_loss, accuracy, self.timer.take_window(),
            float(self.bytes_sent), self.checkpoints.stop_requested(),
        )
        self.interval_loss, self.interval_n = 0.0, 0
        # Every logged step: how far the models are apart (0 by construction for the allreduce baselines).
        consensus = 0.0 if getattr(optimizer, "models_agree", False) else consensus_distance(
            engine, optimizer.evaluation_parameters())
        if evaluating:
            self.last_eval = {"eval_loss": eval_loss, "accuracy": accuracy}
            if self.job.tokens:  # a language model's: exp of the mean held-out token cross-entropy
                self.last_eval["perplexity"] = perplexity(eval_loss)
            evals.spent(eval_s)
        self.record = {
            "step": step,
            "epoch": round(self.sampler.epoch_progress(), 4),
            "loss": train_loss,
            # null where this step did not evaluate (EvalSchedule)
            **(self.last_eval if evaluating else
               dict.fromkeys(("eval_loss", "accuracy", "perplexity") if self.job.tokens else ("eval_loss", "accuracy"))),
            "consensus_distance": consensus,
            **models,
            "step_time_s": step_time,
            "throughput_samples_per_s": scaling.throughput(engine.size, self.sampler.batch_size, step_time),
            "bytes_sent": mean_sent,
            "elapsed_s": self.elapsed(),
            "time_s": self.clock.latest_s(),  # collective: the last rank's training time
            "time_source": engine.time_source,
        }
        if self.prices is not None:  # rank 0's: the steps so far priced on the scaling config's cluster
            self.record["modeled_time_s"] = self.modeled_s
        if engine.rank == 0:
            results.append_jsonl(self.run_dir / results.METRICS, self.record)
        return stop

    def models(self, accuracy: float) -> dict:
        """Collective: the worst rank's held-out accuracy and the average model's (loss and accuracy)."""
        worst = min(gather_floats(self.engine, accuracy)[0])
        optimizer = self.job.optimizer
        if getattr(optimizer, "models_agree", False):
            average = (math.nan, accuracy)
        else:
            flat = optimizer.evaluation_parameters().detach().to(torch.float64)
            average = self.evaluate_flat(self.engine.allreduce(flat, op="avg"))
        return {"worst_accuracy": worst, "average_model_eval_loss": average[0], "average_model_accuracy": average[1]}

    def evaluate_flat(self, flat: torch.Tensor) -> tuple[float, float]:
        """(loss, accuracy) on the held-out set of the model whose flat parameters are ``flat``."""
        model = self.job.make_model()
        torch.nn.utils.vector_to_parameters(flat.to(self.job.dtype).to(self.job.device), model.parameters())
        return evaluate(model, *self.test)

    def rank_figures(self, step: int, time_s: float) -> dict:
        """Collective: each rank's steps and training time (the summary's lists)."""
        steps, times = gather_floats(self.engine, float(step), float(time_s))
        return {"steps_per_rank": [int(v) for v in steps], "time_per_rank_s": times}

    # ------------------------------------------------------------ asynchronous ranks under a budget

    def run_unlocked(self) -> Trained:
        """An asynchronous run under budget_s (bfexp.budget): each rank trains until its own clock
        reaches the budget, writes its own records and evaluates its model by its clock, with no
        collective; the ranks meet only once training is over (and a stop request reaches each rank
        through the run folder)."""
        settings, engine, optimizer, sampler, timer = self.settings, self.engine, self.job.optimizer, self.sampler, self.timer
        assert self.budget_s is not None
        limit = self.budget_s * (1 + 1e-12)  # a clock summed from step times may land a rounding past it
        simulated = self.clock.simulated
        resumed = self.checkpoints.step > 0
        records = budget.RankRecords(self.run_dir, engine.rank, kept_step=self.first - 1 if resumed else None)
        cut = budget.Cut(self.run_dir, engine.rank, simulated)
        times = budget.eval_times(self.budget_s, settings.eval_every_s)
        next_eval = int(self.resumed.get("next_eval", 0))
        copies: list[torch.Tensor] = list(self.resumed.get("copies", []))
        if "held_parameters" in self.resumed:  # the model as the rank held it at the cut, before the settling
            with torch.no_grad():
                optimizer.evaluation_parameters().copy_(self.resumed["held_parameters"])
        if resumed and simulated:  # back to its clock at the cut, in the order the ranks stopped there
            budget.rejoin(engine, int(self.resumed.get("cut_order") or 0), float(self.resumed["time_s"]))
            self.clock = TrainClock(engine, float(self.resumed["time_s"]))
        status, error, loss = results.COMPLETED, None, None
        step, end_s = self.first - 1, None
        while step < self.steps:
            watchdog.at_step(engine, step + 1, settings.fail_rank, settings.fail_step, settings.fail_mode)
            before = self.clock.now_s()
            if simulated:  # the step takes effect at the time its cost brings the clock to
                self.pace.pay_ahead()
                at = self.clock.now_s()
                over, asked = at > limit, cut.stops(at, self.checkpoints.stop_requested() > 0)
            else:
                over, asked = before >= self.budget_s, self.checkpoints.stop_requested() > 0
            if over or asked:
                self.pace.unpay()
                self.ended, end_s = ("budget" if over else "stop"), before
                break
            step += 1
            loss = self.timed_step()
            self.interval_loss += float(loss.detach())
            self.interval_n += 1
            self.slow_down(step)
            now = self.clock.now_s()
            if step % settings.log_every == 0:
                train_loss = self.interval_loss / self.interval_n
                self.interval_loss, self.interval_n = 0.0, 0
                self.record = {"step": step, "epoch": round(sampler.epoch_progress(), 4), "loss": train_loss,
                               "time_s": now, "step_time_s": timer.take_window(), "bytes_sent": self.bytes_sent,
                               "elapsed_s": self.elapsed(), "time_source": engine.time_source}
                records.write("train", **self.record)
                if not math.isfinite(train_loss) or train_loss > settings.divergence_loss:
                    status, error = results.DIVERGED, (f"loss {train_loss:.4g} at step {step} on rank {engine.rank} "
                                                       f"(divergence_loss={settings.divergence_loss:g})")
                    self.ended = results.DIVERGED
                    break
            while next_eval < len(times) and now >= times[next_eval]:
                self.evaluate_own(records, step, times[next_eval], now, copies)
                next_eval += 1
        end_s = self.clock.now_s() if end_s is None else end_s
        return self.end_unlocked(status, error, loss, step, end_s, records, cut, copies, times, next_eval)

    def end_unlocked(self, status: str, error: str | None, loss: torch.Tensor | None, step: int, end_s: float,
                     records: budget.RankRecords, cut: budget.Cut, copies: list[torch.Tensor], times: list[float],
                     next_eval: int) -> Trained:
        """After an asynchronous budget run's loop: the times this rank did not reach, then (collective)
        how the ranks ended, the checkpoint of a stopped run, the summary."""
        engine, job, optimizer, sampler = self.engine, self.job, self.job.optimizer, self.sampler
        self.speed_up()
        if self.ended != "stop":  # times this rank did not reach (it stopped early): its last model stands in
            while next_eval < len(times):
                self.evaluate_own(records, step, times[next_eval], end_s, copies)
                next_eval += 1
        # Training is over: the ranks meet (every one-sided operation lands) and agree on how it ended.
        held = optimizer.evaluation_parameters().detach().clone()  # what the rank trains from next, unsettled
        optimizer.quiesce()
        mark(engine, "training loop")
        ended = gather_floats(engine, *(float(self.ended == e) for e in ("stop", results.DIVERGED)))
        if any(ended[1]) and status != results.DIVERGED:
            status, error = results.DIVERGED, "another rank's loss diverged"
        elif any(ended[0]) and status != results.DIVERGED:
            status = results.INTERRUPTED
            loop = {**self.state(), "time_s": end_s, "next_eval": next_eval, "copies": copies,
                    "cut_order": cut.order, "record": self.record, "held_parameters": held}
            # Before the settling: what landed after a rank's last step stays unsettled (push-sum's slots).
            label = self.checkpoints.write_unlocked(step, job.model, optimizer, sampler, loop)
            error = (f"stopped at step {step} of rank {engine.rank} "
                     f"({checkpoint.stop_reason(self.run_dir) or 'stop requested'}); checkpoint at step {label}")
        optimizer.finish()  # the settled models: what the summary evaluates
        parameters = optimizer.evaluation_parameters().detach().cpu().clone()
        summary = self.summary_unlocked(status, error, step, end_s, records, copies, times)
        optimizer.close()
        summary["wall_time_s"] = time.perf_counter() - self.started
        if engine.rank == 0:
            self.ledger.save(self.run_dir)
            results.write_json_atomic(self.run_dir / results.SUMMARY, summary)
        return Trained(summary, float(loss.detach()) if loss is not None else None, parameters)

    def evaluate_own(self, records: budget.RankRecords, step: int, scheduled_s: float, at_s: float,
                     copies: list[torch.Tensor]) -> None:
        """This rank's model on the held-out set at a scheduled time (no collective); a copy of its
        parameters is kept for the average model."""
        started = time.perf_counter()
        eval_loss, accuracy = evaluate(self.job.model, *self.test)
        self.evals.spent(time.perf_counter() - started)
        copies.append(self.job.optimizer.evaluation_parameters().detach().cpu().clone())
        records.write("eval", step=step, scheduled_s=scheduled_s, time_s=at_s, eval_loss=eval_loss, accuracy=accuracy)

    def summary_unlocked(self, status: str, error: str | None, step: int, end_s: float,
                         records: budget.RankRecords, copies: list[torch.Tensor], times: list[float]) -> dict:
        """Collective, after training: the final figures over ranks (each rank's settled model, the
        worst, the average model at every scheduled time), then the summary as a synchronous run's."""
        engine, job = self.engine, self.job
        eval_loss, accuracy = evaluate(job.model, *self.test)
        records.write("eval", step=step, scheduled_s=budget.END, time_s=end_s, eval_loss=eval_loss, accuracy=accuracy)
        tail = self.interval_loss / self.interval_n if self.interval_n else self.record.get("loss", math.nan)
        steps, ends, losses, epochs, accs, eval_losses = gather_floats(
            engine, float(step), end_s, tail, self.sampler.epoch_progress(), accuracy, eval_loss)
        flat = job.optimizer.evaluation_parameters().detach().cpu().clone()
        averages = budget.average_models(engine, copies + [flat]) if status != results.INTERRUPTED else None
        average_figures = {}
        if averages is not None:
            # Each rank evaluates its share of the average models; one allreduce hands every rank all of them.
            table = torch.zeros(len(averages), 2, dtype=torch.float64)
            for k in range(engine.rank, len(averages), engine.size):
                table[k] = torch.tensor(self.evaluate_flat(averages[k]), dtype=torch.float64)
            table = engine.allreduce(table, op="sum")
            if engine.rank == 0:
                scheduled = [*times[:len(averages) - 1], budget.END]
                lines = [{"scheduled_s": t, "eval_loss": float(row[0]), "accuracy": float(row[1])}
                         for t, row in zip(scheduled, table)]
                results.write_text_atomic(self.run_dir / budget.RECORDS_DIR / budget.AVERAGE,
                                          "".join(json.dumps(r) + "\n" for r in lines))
            average_figures = {"final_average_model_eval_loss": float(table[-1][0]),
                               "final_average_model_accuracy": float(table[-1][1])}
        consensus = consensus_distance(engine, job.optimizer.evaluation_parameters())

        def mean(values: list[float]) -> float:
            finite = [v for v in values if math.isfinite(v)]
            return sum(finite) / len(finite) if finite else math.nan

        self.record = {"step": round(mean(steps)), "epoch": round(mean(epochs), 4), "loss": mean(losses),
                       "consensus_distance": consensus, "time_s": max(ends), "time_source": engine.time_source}
        if status != results.INTERRUPTED:
            self.last_eval = {"eval_loss": mean(eval_losses), "accuracy": mean(accs)}
        summary = self.summary(status, error, step)
        summary.update({"steps_per_rank": [int(v) for v in steps], "time_per_rank_s": ends,
                        "final_worst_accuracy": min(accs), **average_figures})
        if status == results.INTERRUPTED:
            summary["checkpoint_step"] = checkpoint.latest(self.run_dir)["step"] if checkpoint.latest(self.run_dir) else None
        return summary

    def summary(self, status: str, error: str | None, step: int) -> dict:
        """The job's summary (collective): what it trained to, its costs, and (unless stopped to be resumed)
        its scaling figures."""
        engine, job, timer, batch, record = self.engine, self.job, self.timer, self.sampler.batch_size, self.record
        step_time_s, comm_time_s, bytes_per_step, eval_time_s = global_mean(
            engine, timer.mean_step_s, timer.mean_blocked_s, self.bytes_sent / max(1, timer.steps), self.evals.time_s)
        uses_topology = type(job.optimizer).uses_topology
        summary = {**self.identity, "ranks": engine.size, "engine": engine.name, "batch_size": batch}
        summary.update({
            # What the algorithm really ran on (exact diffusion may substitute an undirected form).
            "topology_used": job.topology.label if uses_topology else None,
            "topology_weights": job.topology.weight_scheme if uses_topology else None,
            "status": status,
            "error": error,
            "final_loss": record.get("loss"),
            "final_eval_loss": self.last_eval.get("eval_loss"),  # the last evaluation's
            "final_accuracy": self.last_eval.get("accuracy"),
            **({"final_perplexity": self.last_eval.get("perplexity")} if job.tokens else {}),
            "consensus_distance": record.get("consensus_distance"),
            "steps": record.get("step", 0),
            "epochs": record.get("epoch"),
            "step_time_s": step_time_s,
            "comm_time_s": comm_time_s,
            "throughput_samples_per_s": scaling.throughput(engine.size, batch, step_time_s),
            "bytes_sent_per_step": bytes_per_step,
            "heterogeneity": self.heterogeneity.describe(),
            # A time budget: what ended training (steps, budget, stop, diverged), each rank's steps and time.
            "budget_s": self.budget_s,
            "ended_by": self.ended if status != results.DIVERGED else results.DIVERGED,
            **({} if self.unlocked else self.rank_figures(step, self.clock.now_s())),
            "train_time_s": record.get("time_s"),
            "train_time_source": engine.time_source,
            # The steps priced on the scaling config's cluster (rank 0's ledger, bfexp.ledger): None where the
            # cluster's compute speed for this model is not known before the run.
            **({"modeled_train_time_s": self.modeled_s, "modeled_cluster": self.prices.cluster.name}
               if self.prices is not None else {}),
            # Held-out evaluation, apart from training: seconds per rank (mean over ranks), how many, how often.
            "eval_time_s": eval_time_s,
            "evaluations": self.evals.count,
            "eval_every": self.evals.interval,
            # Ranks whose held-out figures the accuracy and eval loss average (engine=stacked: a sample of
            # evenly spaced ranks above bfexp.comm.stacked.EVAL_RANKS).
            "eval_ranks": len(job.model.evaluated_ranks()) if isinstance(job.model, StackedModel) else engine.size,
        })
        if self.checkpoints.step:
            summary["resumed_from_step"] = self.checkpoints.step
        if status == results.INTERRUPTED:  # stopped to be resumed: the run that finishes it measures the figures
            summary["checkpoint_step"] = step
        else:
            summary.update(job_figures(self.settings, engine, job, batch, timer,
                                       self.single.finish(timer.step_samples), stop=self.stop_agreed,
                                       **self.figure_nodes))
            mark(engine, "scaling figures: reference rounds left, baseline probe")
        return summary


class StopPoll:
    """When the ranks ask each other, between logging steps, whether the job was asked to stop.

    The ranks agree on a stop at logging steps (the flag travels with the metrics); at log_every=100000
    a signal would wait for hours. So about every POLL_S seconds of the slowest rank they also agree on it
    in one small collective, which carries every rank's flag and the seconds each took since the last poll.
    The steps to the next poll come from those gathered values alone, so every rank polls at the same step:
    1 at first, then as many steps as take about POLL_S (at most 8x the last interval)."""

    POLL_S = 1.0

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.next_step: int | None = None  # the first step polls
        self.interval = 1
        self.since = time.perf_counter()

    def due(self, step: int) -> bool:
        return self.next_step is None or step >= self.next_step

    def agree(self, step: int, requested: float) -> bool:
        """Whether any rank was asked to stop (collective); sets the step of the next poll."""
        flags, waited = gather_floats(self.engine, requested, time.perf_counter() - self.since)
        self.since = time.perf_counter()
        slowest = max(max(waited), 1e-6)
        self.interval = max(1, min(self.interval * 8, int(self.interval * self.POLL_S / slowest)))
        self.next_step = step + self.interval
        return any(flag > 0 for flag in flags)


class TrainClock:
    """A rank's training time for time-to-accuracy: its simulated clock on virtual ranks; on real
    ranks the wall seconds spent inside training steps (evaluation and logging left out)."""

    def __init__(self, engine: Engine, before_s: float = 0.0) -> None:
        self.engine = engine
        self.simulated = engine.time_source == "simulated"
        self.origin = engine.clock_s - before_s if self.simulated else 0.0
        self.total_s = before_s
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.total_s += time.perf_counter() - self._t0

    def now_s(self) -> float:
        return self.engine.clock_s - self.origin if self.simulated else self.total_s

    def latest_s(self) -> float:
        """Collective: the largest training time over ranks (when the slowest rank reached this point)."""
        return max(gather_floats(self.engine, self.now_s())[0])


# ---------------------------------------------------------------- scaling figures of a job


def component(node: Any) -> dict:
    """A component node as plain data (its options and target): part of the reference's key."""
    return config.node_options(node) | {"_target_": str(node._target_)}


def one_rank(algorithm: Any, engine: Engine, job: Built) -> tuple[probes.Factory, dict]:
    """The job's step on ONE rank with communication removed: the same algorithm wrapper on a
    1-rank engine, where every op takes the engine's single-rank path.

    A 1-rank job uses its own engine, so it is its own reference; a larger one
    a virtual 1-rank world. An algorithm that cannot run on virtual ranks (ddp:
    torch.distributed already spans the job's ranks) is timed there with the
    allreduce wrapper, which averages gradients as it does. Returns the factory
    and the node of the wrapper it times (part of the reference's key). ``algorithm``: the job's node.
    """
    from bfexp.comm.threads import ThreadsEngine, ThreadWorld

    node = algorithm
    if engine.size > 1:
        try:
            config.target_of(node, "algorithm").check_run(ThreadsEngine, throughput_only=False, modeled=False)
        except config.ConfigError:
            shared = [k for k, p in inspect.signature(DecentralizedOptimizer.__init__).parameters.items()
                      if p.kind is p.KEYWORD_ONLY and k != "model"]
            node = OmegaConf.create({"_target_": f"{Allreduce.__module__}.{Allreduce.__qualname__}", "_partial_": True,
                                     **{k: v for k, v in config.node_options(node).items() if k in shared}})

    def make() -> tuple[torch.nn.Module, Any]:
        one = engine if engine.size == 1 and not engine.stacked else ThreadsEngine(ThreadWorld(1), 0)
        model = job.rank_model()
        wrapper = assemble(node, job.make_optimizer(model.parameters()), one, ONE_RANK, model=model).optimizer
        return (wrapper.module if wrapper.module is not None else model), wrapper

    return make, component(node)


def reference(engine: Engine, job: Built, batches: Callable[[], tuple[torch.Tensor, torch.Tensor]], *,
              algorithm: Any, model: Any, optimizer: Any, scaling_node: Any, dtype: str, steps: int = 0,
              first: int = 1, own_steps: bool = False) -> probes.SingleRankReference:
    """This job's single-rank reference, started (rank 0 has looked in the cache); measured rounds go
    between training steps ``first`` to ``steps``, the rest at ``finish``. ``batches`` gives a new
    mini-batch per call, as training's sampler does. ``own_steps``: the job's own steps are the
    wrapper's samples (probes.SingleRankReference). The reference's key: the algorithm's, model's and
    optimizer's nodes and the ``dtype``; how it is kept and measured: the scaling node. Collective."""

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        bx, by = batches()
        return bx.to(job.device), by.to(job.device)

    x, _ = next_batch()
    alone, wrapper = one_rank(algorithm, engine, job)
    threads = scaling.reference_threads(scaling_node.reference_threads, scaling.processor_count())
    key = probes.reference_key(
        model=component(model), optimizer=component(optimizer), wrapper=wrapper, sample_shape=job.in_shape,
        classes=job.classes, batch=x.shape[0], dtype=dtype, device=probes.device_name(x.device), threads=threads,
    )

    def plain() -> tuple[torch.nn.Module, Any]:  # a plain torch loop: the bare optimizer, no wrapper
        net = job.rank_model()
        return net, job.make_optimizer(net.parameters())

    # Stacked ranks are one program: rank 0's decisions are every rank's, shared on a world of one.
    single = probes.SingleRankReference(
        engine.coordinator() if engine.stacked else engine, train_step, alone=alone, plain=plain, next_batch=next_batch, key=key,
        directory=probes.cache_dir(scaling_node.reference_cache), policy=str(scaling_node.reference),
        margin=float(scaling_node.reference_load_margin), rounds=int(scaling_node.reference_steps), threads=threads,
        steps=steps, first=first, job_alone=engine.size == 1, own_steps=own_steps,
    )
    single.start()
    return single


def job_figures(settings: Settings, engine: Engine, job: Built, batch: int, timer: StepTimer, single: dict,
                stop: Callable[[], bool] | None = None, *, algorithm: Any, model: Any, scaling_node: Any,
                engine_node: Any, launcher: Any) -> dict:
    """Every scaling figure of a finished training job, each with its interval. Collective: every
    rank calls it; rank 0 gets the full dict (the others get the measured part). ``stop()``
    (collective): whether the job was asked to stop meanwhile, which cuts the baseline probe short.
    ``settings``: the run's (batch size, seed, baseline steps); the algorithm's, model's, scaling's, engine's
    and launcher's nodes: what the cost model and the summary's scaling part read."""
    n = engine.size
    # a rule that communicates every H steps: timed over whole cycles (one rank communicates nothing, and is
    # its own reference at single steps)
    cycle = int(getattr(job.optimizer, "step_cycle", 1)) if n > 1 else 1
    timing = scaling.split_timing(*gather_floats(engine, *scaling.rank_timing(timer.step_samples, timer.blocked_samples,
                                                                              cycle)))
    probe_sampler = (StackedSampler(job.data, settings.batch_size, settings.seed + 1) if isinstance(job.data, StackedData)
                     else BatchSampler(job.data, settings.batch_size, settings.seed + 1, engine.rank))

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        bx, by = probe_sampler.next()
        return bx.to(job.device), by.to(job.device)

    own = is_baseline(algorithm) or n == 1  # one rank: nothing to communicate, its own baseline
    baseline_timing = timing if own else None
    probed = int(settings.baseline_steps)
    if not own and settings.baseline_steps > 0:
        probe, probed = probes.baseline_probe(engine, train_step, job.make_model, job.make_optimizer, next_batch,
                                              int(settings.baseline_steps), stop)
        baseline_timing = scaling.split_timing(*gather_floats(engine, *probe))
    single_step = scaling.get(single, "step_time_s")
    measured = scaling.measured_figures(n, batch, timing, single_step, baseline_timing, own_baseline=own,
                                        source=scaling.measured_source(virtual=engine.virtual))
    if not is_baseline(algorithm):
        measured["baseline_steps"] = probed  # baseline_steps, or fewer when a stop signal came meanwhile
    modeled = None
    if engine.rank == 0:
        params = list(job.model.parameters())
        modeled = modeled_block(scaling_node, algorithm, int(settings.batch_size), n, rank_numel(job.model),
                                params[0].element_size(), job.topology,
                                *compute_speed(scaling_node, model, scaling.throughput_spread(1, batch, single_step),
                                               job.forward_flop_per_sample),
                                layout_ranks_per_machine(engine), step_times=single.get("step_times_s") or ())
    out = scaling_block(scaling_node, engine, measured, modeled, throughput_only=False, engine_node=engine_node,
                        launcher=launcher)
    out.update(reference_fields(single))
    return out


# ---------------------------------------------------------------- throughput-only jobs


def throughput_only(settings: Settings, engine: Engine, run_dir: Path, *, identity: dict, dataset: Any, model: Any,
                    optimizer: Any, algorithm: Any, topology: Any, scaling_node: Any, engine_node: Any,
                    launcher: Any) -> dict:
    """Throughput-only on real (or virtual) ranks here: no training. The ranks time the
    algorithm's step and the baseline's on buffers of the model's real size with zero
    gradients (so only the local update and the communication run); compute comes
    from the declared speed or the single-rank reference; the model prices the rest. ``settings``: the
    run's; ``identity``: the job's (summary.job_identity); then the components' nodes it builds and prices."""
    started = time.perf_counter()
    n, batch = engine.size, int(settings.batch_size)
    job = build(settings, engine, dataset=dataset, model=model, optimizer=optimizer, algorithm=algorithm,
                topology=topology, with_data=False, plan=Plan.read(run_dir))
    steps = max(1, int(settings.baseline_steps) or 10)
    options = config.node_options(algorithm)
    own = scaling.split_timing(*gather_floats(engine, *probes.communication_probe(engine, train_step, job.optimizer, steps)))
    base = None
    if not is_baseline(algorithm) and n > 1:
        fresh = job.make_model()
        baseline = Allreduce(job.make_optimizer(fresh.parameters()), engine)
        base = scaling.split_timing(*gather_floats(engine, *probes.communication_probe(engine, train_step, baseline, steps)))
    declared = scaling.declared_speed(scaling_node, config.label(model))
    if declared:
        single: dict = {"source": "declared", "refreshed": None}
        scaling.put(single, "step_time_s", scaling.Spread.exact(batch / declared))
    else:
        g = torch.Generator().manual_seed(settings.seed)

        def batches() -> tuple[torch.Tensor, torch.Tensor]:  # random samples of the declared shape
            if job.tokens:  # random token ids, a target per position
                return tuple(torch.randint(0, job.classes, (batch, *job.in_shape), generator=g) for _ in range(2))
            return (torch.randn(batch, *job.in_shape, generator=g, dtype=job.dtype),
                    torch.randint(0, job.classes, (batch,), generator=g))

        single = reference(engine, job, batches, algorithm=algorithm, model=model, optimizer=optimizer,
                           scaling_node=scaling_node, dtype=settings.dtype).finish()
    compute = scaling.get(single, "step_time_s")
    backward = float(scaling_node.backward_fraction)
    own_m = scaling.exchange_step(own, compute=compute, backward_fraction=backward,
                                  overlap=bool(options.get("overlap", True)), period=int(options.get("communication_period", 1)))
    if base is not None:
        base_m = scaling.exchange_step(base, compute=compute, backward_fraction=backward, overlap=True, period=1)
    else:
        base_m = own_m if is_baseline(algorithm) else None
    # The step is priced by the cost model from the measured exchange and compute: modeled.
    measured = scaling.measured_figures(n, batch, own_m, compute, base_m, own_baseline=is_baseline(algorithm), source="modeled")
    measured["comm_measured_on"] = f"{n} {engine.name} ranks here, zero-gradient steps of the real model size"
    modeled = None
    if engine.rank == 0:
        params = list(job.model.parameters())
        modeled = modeled_block(scaling_node, algorithm, int(settings.batch_size), n, rank_numel(job.model),
                                params[0].element_size(), job.topology,
                                *compute_speed(scaling_node, model, scaling.throughput_spread(1, batch, compute),
                                               job.forward_flop_per_sample),
                                layout_ranks_per_machine(engine), step_times=single.get("step_times_s") or ())
    summary = {**identity, "ranks": n, "engine": engine.name, "batch_size": batch}
    summary.update({"status": results.COMPLETED, "error": None, "throughput_only": True, "steps": 0})
    summary.update(scaling_block(scaling_node, engine, measured, modeled, throughput_only=True, engine_node=engine_node,
                                 launcher=launcher))
    summary.update(reference_fields(single))
    summary["wall_time_s"] = time.perf_counter() - started
    if engine.rank == 0:
        results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary


# ---------------------------------------------------------------- the kinds of job, in one place

# kind -> what a rank runs for it (None: no rank starts; the driver calls `summary.modeled`), with the run's
# Settings, the engine, the run folder and the sections ``run`` hands it.
JOBS: dict[str, Callable[..., Any] | None] = {"train": train, "throughput": throughput_only, "modeled": None}


def run(cfg: Any, engine: Engine, run_dir: Path) -> Any:
    """What one rank does for a job (every engine's ranks come here): the rank's entry point, the one place
    that reads the whole config; it makes the run's Settings and hands the job its sections."""
    if cfg.engine.get("timeline", False) and engine.timeline is None:  # Chrome trace per rank (Perfetto)
        engine.timeline = Timeline(run_dir / "timeline" / f"rank{engine.rank}.json", engine.rank)
    timeout = float(cfg.get("timeout_s", 0) or 0)  # the driver's hang watchdog reads the heartbeat
    heartbeat = watchdog.Heartbeat(engine, run_dir, period_s=min(1.0, timeout / 4) if timeout else 1.0,
                                   timeout_s=timeout)
    try:
        settings = Settings.of(cfg)
        kind = job_kind(settings.throughput_only, cfg.scaling)
        runner = JOBS[kind]
        assert runner is not None, "modeled jobs start no rank"
        # the job's sections: its identity, the components' nodes; a training job's checkpoints' experiment and
        # its stragglers' node too
        parts = {"identity": job_identity(cfg), "dataset": cfg.dataset, "model": cfg.model, "optimizer": cfg.optimizer,
                 "algorithm": cfg.algorithm, "topology": cfg.topology, "scaling_node": cfg.scaling,
                 "engine_node": cfg.engine, "launcher": cfg.get("launcher")}
        if kind == "train":
            parts.update(experiment=checkpoint.experiment(cfg), heterogeneity=cfg.get("heterogeneity"))
        return runner(settings, engine, run_dir, **parts)
    finally:
        heartbeat.close()
        if engine.timeline is not None:  # what happened, up to a failure too
            engine.timeline.save()


def starve(heterogeneity: Any, engine: Engine, run_dir: Path) -> Path | None:
    """A slow process rank under heterogeneity.cpu_quota (``heterogeneity``: the node, or None): into its own
    CPU-quota cgroup (bfexp.cgroups); None for any other rank."""
    node = heterogeneity or {}
    quota = node.get("cpu_quota")
    if quota is None or not engine.processes or engine.rank not in list(node.get("slow_ranks") or ()):
        return None
    return cgroups.starve(run_dir, engine.rank, float(quota))


# ---------------------------------------------------------------- an MPI rank's process


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    defer_dynamo()
    run_dir = Path(argv[0])
    PHASES.mark("start: python, torch and bfexp imports")
    if not watchdog.wait_at_gate():  # started early: the driver refused the job, or is gone
        os._exit(0)  # nothing done, nothing to keep; no MPI finalize (its fence would wait on the other ranks)
    PHASES.mark("MPI init; the driver's checks, if started early")
    cfg = OmegaConf.load(run_dir / results.CONFIG)
    engine = config.build(cfg.engine, "engine")  # mpi, or nccl: one rank per GPU, its unique id over MPI
    PHASES.mark("engine: communicators")
    results.output_to(run_dir / results.LOGS_DIR / f"rank{engine.rank}.log")  # the driver owns the terminal
    watchdog.enable_stack_dumps()  # the hang watchdog's SIGUSR2, and crashes: every thread's stack into the log
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        run(cfg, engine, run_dir)
    except BaseException as exc:
        try:
            results.record_failure(run_dir, engine.rank, exc)
        except OSError:  # e.g. the run folder's disk is full: the driver finds out from the exit
            pass
        raise  # mpi4py's runner turns this into MPI_Abort: every rank ends
    PHASES.mark("summary")
    if engine.rank == 0:
        with contextlib.suppress(OSError):
            results.write_json_atomic(run_dir / results.LOGS_DIR / results.TIMING, {"spans": PHASES.spans})
    engine.close()  # free windows and communicators before MPI finalizes
    # Finalize MPI and leave without the interpreter's final garbage collection, which takes
    # seconds with torch loaded: a stopped or finished job ends promptly.
    import atexit

    from mpi4py import MPI

    atexit._run_exitfuncs()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
