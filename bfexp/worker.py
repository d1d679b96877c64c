"""What every rank runs: `python -m mpi4py -m bfexp.worker RUN_DIR`.

Workers are not Hydra apps: they read the resolved config the driver wrote
into RUN_DIR, so every rank agrees on one directory. `train` is engine-
agnostic (virtual ranks call it from threads): it touches no global RNG and
no process-wide state beyond what the caller set up.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from bfexp import results
from bfexp.algorithms import build_algorithm, resolve_topology
from bfexp.comm.engine import Engine
from bfexp.data import BatchSampler, load_rank_data
from bfexp.metrics import StepTimer, consensus_distance, evaluate, global_mean
from bfexp.models import build_model
from bfexp.timeline import Timeline, span
from bfexp.topology import build_topology

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_local_optimizer(cfg: Any, params) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay)
    if o.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    raise ValueError(f"optimizer.name={o.name!r}; allowed: sgd, adam, adamw")


def total_steps(cfg: Any, global_train_size: int, size: int) -> int:
    """Every rank must run the same number of steps, even when shards differ in size."""
    if cfg.epochs is None:
        return int(cfg.steps)
    per_epoch = max(1, global_train_size // (size * cfg.batch_size))
    return int(cfg.epochs) * per_epoch


def train(cfg: Any, engine: Engine, run_dir: Path, inspect: Callable[[dict], None] | None = None) -> dict:
    """Train one rank's model; rank 0 writes metrics.jsonl and summary.json. Returns the summary.

    ``inspect`` (for tests comparing engines rank by rank) gets this rank's
    last mini-batch loss and final parameters when training ends.
    """
    rank, size = engine.rank, engine.size
    started = time.perf_counter()
    if cfg.engine.get("timeline", False) and engine.timeline is None:  # Chrome trace per rank (Perfetto)
        engine.timeline = Timeline(run_dir / "timeline" / f"rank{rank}.json", rank)
    if cfg.get("throughput_only", False):  # no training: time communication, model the rest
        from bfexp.scaling import throughput_only_ranks

        return throughput_only_ranks(cfg, engine, run_dir)
    dtype = DTYPES[cfg.dtype]
    topology = build_topology(cfg.topology, size, cfg.engine.ranks_per_machine)
    # The topology the algorithm's rule runs on (exact diffusion: exp2 -> its undirected form).
    topology, _ = resolve_topology(cfg.algorithm, topology)
    engine.set_topology(topology)
    data = load_rank_data(cfg.dataset, rank, size, cfg.seed)
    # GPU engines (nccl) name the rank's device; CPU engines have none.
    device = getattr(engine, "device", None) or torch.device("cpu")
    model = build_model(cfg.model, data.in_features, data.classes, cfg.seed, dtype, in_shape=tuple(data.train_x.shape[1:])).to(device)
    optimizer = build_algorithm(cfg.algorithm, make_local_optimizer(cfg, model.parameters()), engine, topology, model=model)
    net = optimizer.module if optimizer.module is not None else model  # ddp: the DDP wrapper
    sampler = BatchSampler(data, cfg.batch_size, cfg.seed, rank)
    steps = total_steps(cfg, data.global_train_size, size)
    timer = StepTimer(warmup=min(3, steps // 4))
    test_x, test_y = data.test_x.to(device, dtype), data.test_y.to(device)
    metrics_path = run_dir / results.METRICS
    status, error = "completed", None
    record: dict = {}
    interval_loss, interval_n = 0.0, 0

    for step in range(1, steps + 1):
        if cfg.fail_rank == rank and step == cfg.fail_step:
            raise RuntimeError(f"injected failure (fail_rank={rank}, fail_step={step})")
        x, y = sampler.next()
        x, y = x.to(device), y.to(device)
        timer.start(engine)
        optimizer.zero_grad()
        with span(engine.timeline, "forward"):
            loss = F.cross_entropy(net(x.to(dtype)).float(), y)
        with span(engine.timeline, "backward"):
            loss.backward()
        with span(engine.timeline, "step"):
            optimizer.step()
        timer.stop(engine)
        interval_loss += float(loss.detach())
        interval_n += 1
        if step % cfg.log_every and step != steps:
            continue
        optimizer.finish()
        eval_loss, accuracy = evaluate(model, test_x, test_y)
        train_loss, eval_loss, accuracy, step_time = global_mean(
            engine, interval_loss / interval_n, eval_loss, accuracy, timer.take_window()
        )
        interval_loss, interval_n = 0.0, 0
        record = {
            "step": step,
            "epoch": round(sampler.epoch_progress(), 4),
            "loss": train_loss,
            "eval_loss": eval_loss,
            "accuracy": accuracy,
            "consensus_distance": consensus_distance(engine, optimizer.evaluation_parameters()),
            "step_time_s": step_time,
            "throughput_samples_per_s": size * sampler.batch_size / step_time if step_time > 0 else None,
            "elapsed_s": time.perf_counter() - started,
        }
        if rank == 0:
            results.append_jsonl(metrics_path, record)
        if not math.isfinite(train_loss) or train_loss > cfg.divergence_loss:
            status, error = "diverged", f"loss {train_loss:.4g} at step {step} (divergence_loss={cfg.divergence_loss:g})"
            break

    optimizer.finish()
    if inspect is not None:
        inspect({"rank": rank, "loss": float(loss.detach()), "parameters": optimizer.evaluation_parameters().detach().cpu().clone()})
    step_time_s, comm_time_s = global_mean(engine, timer.mean_step_s, timer.comm_s / max(1, timer.timed_steps))
    summary = {
        "algorithm": cfg.algorithm.name,
        "topology": cfg.topology.name,
        # What the algorithm really ran on (exact diffusion may substitute an undirected form).
        "topology_used": topology.label if optimizer.uses_topology else None,
        "topology_weights": topology.weight_scheme if optimizer.uses_topology else None,
        "ranks": size,
        "engine": engine.name,
        "seed": cfg.seed,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "batch_size": sampler.batch_size,
        "lr": cfg.lr,
        "status": status,
        "error": error,
        "final_loss": record.get("loss"),
        "final_eval_loss": record.get("eval_loss"),
        "final_accuracy": record.get("accuracy"),
        "consensus_distance": record.get("consensus_distance"),
        "steps": record.get("step", 0),
        "epochs": record.get("epoch"),
        "step_time_s": step_time_s,
        "comm_time_s": comm_time_s,
        "throughput_samples_per_s": size * sampler.batch_size / step_time_s if step_time_s > 0 else None,
    }
    # Scaling: compute/comm/wait split, single-rank reference, allreduce baseline probe, cost model.
    from bfexp.scaling import job_figures

    probe_sampler = BatchSampler(data, cfg.batch_size, cfg.seed + 1, rank)
    model_device = next(model.parameters()).device

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        bx, by = probe_sampler.next()
        return bx.to(model_device), by.to(model_device)

    def make_model() -> torch.nn.Module:  # a fresh copy of the architecture for the probes
        return build_model(
            cfg.model, data.in_features, data.classes, cfg.seed, dtype, in_shape=tuple(data.train_x.shape[1:])
        ).to(model_device)

    summary.update(job_figures(
        cfg, engine, model=model, make_model=make_model, algorithm=optimizer, topology=topology,
        make_optimizer=lambda params: make_local_optimizer(cfg, params), next_batch=next_batch,
        classes=data.classes, batch=sampler.batch_size,
        step_s=timer.mean_step_s, blocked_s=timer.comm_s / max(1, timer.timed_steps),
    ))
    optimizer.close()
    summary["wall_time_s"] = time.perf_counter() - started
    if rank == 0:
        results.write_json_atomic(run_dir / results.SUMMARY, summary)
    if engine.timeline is not None:
        engine.timeline.save()
    return summary


def record_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Leave the reason for the driver before MPI tears the job down."""
    results.write_json_atomic(
        run_dir / results.ERRORS_DIR / f"rank{rank}.json",
        {
            "rank": rank,
            "type": type(exc).__name__,
            "message": str(exc).splitlines()[0] if str(exc) else "",
            "traceback": traceback.format_exc(),
            "time": time.time(),
        },
    )


def _redirect_output(run_dir: Path, rank: int) -> None:
    """Each rank's stdout/stderr into logs/rank<N>.log (the driver owns the terminal)."""
    log_dir = run_dir / results.LOGS_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    cfg = OmegaConf.load(run_dir / results.CONFIG)
    if cfg.engine.name == "nccl":  # one rank per GPU; NCCL's unique id travels over MPI
        from bfexp.comm.nccl import NCCLEngine

        engine = NCCLEngine(ranks_per_machine=cfg.engine.ranks_per_machine, check_neighbors=cfg.engine.check_neighbors)
    else:
        from bfexp.comm.mpi import MPIEngine

        engine = MPIEngine(ranks_per_machine=cfg.engine.ranks_per_machine)
    _redirect_output(run_dir, engine.rank)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        train(cfg, engine, run_dir)
    except BaseException as exc:
        record_failure(run_dir, engine.rank, exc)
        if engine.timeline is not None:  # what happened up to the failure
            engine.timeline.save()
        raise  # mpi4py's runner turns this into MPI_Abort: every rank ends
    engine.close()  # free windows and communicators before MPI finalizes


if __name__ == "__main__":
    main()
