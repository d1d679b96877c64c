"""How well a job scales, and how it compares with the allreduce baseline.

Definitions (README "Scaling"):

* throughput = samples per second over all ranks = ranks x batch / step time;
* scaling_efficiency = throughput at n ranks / (n x single-rank throughput),
  where the single-rank reference is ONE rank training the same model on the
  same batch on the same device, with no communication;
* speedup_vs_baseline = throughput / throughput of the allreduce baseline at
  the same ranks, model and batch.

Measured figures come from the job's own steps and the engine's count of
time blocked in communication (``engine.comm_time_s``): per rank, compute =
step - blocked. The rank that blocked least is taken to have spent its
blocked time moving data (comm_time_s); what other ranks blocked beyond
that is waiting for slower peers (wait_time_s). Modeled figures come from
bfexp.costmodel with the cluster the scaling config describes.

Importing this module is cheap (no torch): the driver uses it for notes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from bfexp import costmodel, results

# The figures a summary headlines; `time_source` says whether they are measured or modeled.
HEADLINE = (
    "step_time_s",
    "compute_time_s",
    "comm_time_s",
    "wait_time_s",
    "throughput_samples_per_s",
    "single_rank_throughput_samples_per_s",
    "scaling_efficiency",
    "baseline_throughput_samples_per_s",
    "baseline_scaling_efficiency",
    "speedup_vs_baseline",
)
BASELINE = "allreduce"
VIRTUAL_ENGINES = ("threads",)
CPU_ENGINES = ("mpi", "threads", "auto")


# ---------------------------------------------------------------- definitions


def throughput(ranks: int, batch: int, step_s: float | None) -> float | None:
    """Samples per second over all ranks."""
    if step_s is None or not step_s > 0 or not math.isfinite(step_s):
        return None
    return ranks * batch / step_s


def efficiency(throughput_samples_per_s: float | None, ranks: int, single_samples_per_s: float | None) -> float | None:
    """Throughput at n ranks over n times the single-rank throughput."""
    if throughput_samples_per_s is None or not single_samples_per_s:
        return None
    return throughput_samples_per_s / (ranks * single_samples_per_s)


def speedup(throughput_samples_per_s: float | None, baseline_samples_per_s: float | None) -> float | None:
    if throughput_samples_per_s is None or not baseline_samples_per_s:
        return None
    return throughput_samples_per_s / baseline_samples_per_s


def processor_count() -> int:
    """Cores this process may run on (what ranks on this machine share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def contention_note(ranks: int, cores: int, engine: str) -> str | None:
    """A warning for CPU ranks that outnumber the cores they share, else None."""
    if engine not in CPU_ENGINES or ranks <= cores:
        return None
    return (
        f"{ranks} ranks share {cores} cores on this machine: measured throughput and scaling "
        f"efficiency mostly show CPU contention, not communication; see the modeled figures"
    )


def job_note(cfg: Any) -> str | None:
    """What the driver says before a job starts about how to read its scaling figures."""
    if cfg.get("throughput_only", False) and cfg.scaling.get("modeled", False):
        return None  # nothing runs here
    return contention_note(int(cfg.ranks), processor_count(), str(cfg.engine.name))


# ---------------------------------------------------------------- measured timing


def split_timing(step_s: list[float], blocked_s: list[float]) -> dict[str, float]:
    """Per-rank mean step and blocked times -> the job's compute / comm / wait split.

    compute = step - blocked (mean over ranks); comm = the least any rank
    blocked; wait = the mean of what ranks blocked beyond that. The three
    add up to the mean step time.
    """
    pairs = [(s, b) for s, b in zip(step_s, blocked_s) if math.isfinite(s) and math.isfinite(b)]
    if not pairs:
        nan = float("nan")
        return {"step_time_s": nan, "compute_time_s": nan, "comm_time_s": nan, "wait_time_s": nan}
    comm = min(b for _, b in pairs)
    n = len(pairs)
    return {
        "step_time_s": sum(s for s, _ in pairs) / n,
        "compute_time_s": sum(s - b for s, b in pairs) / n,
        "comm_time_s": comm,
        "wait_time_s": sum(b - comm for _, b in pairs) / n,
    }


def gather_floats(engine: Any, *values: float) -> list[list[float]]:
    """Every rank's values, on every rank: result[k][r] is value k of rank r (one allreduce)."""
    import torch

    n, k = engine.size, len(values)
    table = torch.zeros(k, n, dtype=torch.float64)
    table[:, engine.rank] = torch.tensor([v if math.isfinite(v) else 0.0 for v in values], dtype=torch.float64)
    finite = torch.zeros(k, n, dtype=torch.float64)
    finite[:, engine.rank] = torch.tensor([1.0 if math.isfinite(v) else 0.0 for v in values], dtype=torch.float64)
    both = engine.allreduce([table, finite], op="sum")
    table, finite = both
    return [[float(table[i, r]) if finite[i, r] else float("nan") for r in range(n)] for i in range(k)]


def quiet_barrier(engine: Any) -> None:
    """A barrier that sleeps while it waits: MPI's blocking barrier spins and would
    steal the core a measuring rank needs."""
    handle = engine.ibarrier()
    if engine.name in ("mpi", "nccl"):
        while not handle.done():
            time.sleep(0.002)
    handle.wait()


def time_steps(model: Any, optimizer: Any, x: Any, y: Any, steps: int, warmup: int = 2) -> list[float]:
    """Wall time of each of `steps` training steps (after `warmup`) on one fixed batch."""
    import torch
    import torch.nn.functional as F

    cuda = x.is_cuda
    dtype = next(model.parameters()).dtype
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------- single-rank reference


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


def device_name(device: Any) -> str:
    """What a single-rank reference depends on besides the model: the device and its threads."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model} x{torch.get_num_threads()} threads"


def reference_key(cfg: Any, sample_shape: tuple[int, ...], classes: int, batch: int, device: str) -> dict:
    """Everything a single-rank reference depends on (cached under its hash)."""
    from omegaconf import OmegaConf
    import torch

    model = OmegaConf.to_container(cfg.model, resolve=True) if not isinstance(cfg.model, dict) else dict(cfg.model)
    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True) if not isinstance(cfg.optimizer, dict) else dict(cfg.optimizer)
    return {
        "model": model,
        "sample_shape": list(sample_shape),
        "classes": int(classes),
        "batch_size": int(batch),
        "dtype": str(cfg.dtype),
        "optimizer": optimizer,
        "device": device,
        "torch": torch.__version__,
    }


def reference_path(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"{key['model'].get('name', 'model')}-b{key['batch_size']}-{digest}.json"


def load_reference(directory: Path | None, key: dict) -> dict | None:
    if directory is None:
        return None
    record = results.read_json(reference_path(directory, key))
    if record and record.get("key") == key and record.get("step_time_s", 0) > 0:
        return record
    return None


def store_reference(directory: Path | None, key: dict, step_time_s: float, steps: int) -> None:
    """One file per key, replaced atomically: concurrent jobs never see half a file
    (two jobs measuring the same key at once both write a valid record)."""
    if directory is None:
        return
    results.write_json_atomic(
        reference_path(directory, key),
        {
            "key": key,
            "step_time_s": step_time_s,
            "steps": steps,
            "statistic": "median",
            "measured_at": time.time(),
            # a busy machine slows the reference for good: say how busy it was
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
    )


def single_rank_reference(
    cfg: Any,
    engine: Any,
    make_model: Callable[[], Any],
    make_optimizer: Callable[[Any], Any],
    batch: tuple[Any, Any],
    classes: int,
) -> dict:
    """Median step time of one rank training alone (no communication), from the cache
    or measured by rank 0 on a fresh model while the other ranks sleep. Collective:
    every rank calls it."""
    import torch

    x, y = batch
    key = reference_key(cfg, tuple(x.shape[1:]), classes, x.shape[0], device_name(x.device))
    directory = cache_dir(cfg.scaling.get("reference_cache", "auto"))
    known = torch.zeros(1, dtype=torch.float64)
    source = "cache"
    if engine.rank == 0:
        record = load_reference(directory, key)
        if record:
            known[0] = record["step_time_s"]
    known = engine.broadcast(known, 0)
    if not known[0] > 0:
        source = "measured"
        steps = int(cfg.scaling.get("reference_steps", 20))
        if engine.rank == 0:
            alone = make_model()  # fresh: no hooks of the job's algorithm on it
            times = time_steps(alone, make_optimizer(alone.parameters()), x, y, steps)
            known[0] = statistics.median(times)
            store_reference(directory, key, float(known[0]), steps)
        quiet_barrier(engine)
        known = engine.broadcast(known, 0)
    step_s = float(known[0])
    return {"step_time_s": step_s, "samples_per_s": x.shape[0] / step_s, "source": source}


# ---------------------------------------------------------------- baseline probe


def baseline_algorithm_config() -> Any:
    """The allreduce baseline with its schema defaults (overlapped with backward, every step)."""
    from omegaconf import OmegaConf

    from bfexp.config import SCHEMAS

    return OmegaConf.structured(SCHEMAS["algorithm"][BASELINE])


def baseline_probe(
    engine: Any,
    make_model: Callable[[], Any],
    make_optimizer: Callable[[Any], Any],
    topology: Any,
    next_batch: Callable[[], tuple[Any, Any]],
    steps: int,
) -> dict:
    """`steps` timed steps of the allreduce baseline on a fresh copy of the model
    (same architecture and batch, on the same ranks). Collective. Returns this
    rank's mean step and blocked time."""
    import torch.nn.functional as F

    from bfexp.algorithms import build_algorithm
    from bfexp.metrics import StepTimer

    probe = make_model()
    optimizer = build_algorithm(baseline_algorithm_config(), make_optimizer(probe.parameters()), engine, topology)
    timer = StepTimer(warmup=2)
    dtype = next(probe.parameters()).dtype
    for _ in range(steps + timer.warmup):
        x, y = next_batch()
        timer.start(engine)
        optimizer.zero_grad()
        loss = F.cross_entropy(probe(x.to(dtype)).float(), y)
        loss.backward()
        optimizer.step()
        timer.stop(engine)
    optimizer.finish()
    getattr(optimizer, "close", lambda: None)()  # release its hooks
    return {"step_s": timer.mean_step_s, "blocked_s": timer.comm_s / max(1, timer.timed_steps)}


# ---------------------------------------------------------------- modeled


def cluster(scaling: Any, cores: int | None = None) -> costmodel.Cluster:
    """The cost model's cluster from a scaling config node."""
    return costmodel.Cluster(
        name=str(scaling.name),
        ranks_per_machine=int(scaling.ranks_per_machine),
        intra=costmodel.Link(float(scaling.intra_latency_s), float(scaling.intra_bandwidth_gbyte_per_s) * 1e9),
        inter=costmodel.Link(float(scaling.inter_latency_s), float(scaling.inter_bandwidth_gbyte_per_s) * 1e9),
        nic_shared=bool(scaling.nic_shared),
        reduce_bytes_per_s=float(scaling.reduce_gbyte_per_s) * 1e9,
        cores=(cores or processor_count()) if scaling.get("shares_cores", False) else 0,
        allreduce=str(scaling.allreduce),
    )


def declared_speed(scaling: Any, model_name: str) -> float | None:
    speeds = scaling.get("compute_samples_per_s") or {}
    value = speeds.get(model_name)
    return float(value) if value else None


def modeled_figures(
    cfg: Any,
    *,
    ranks: int,
    param_count: int,
    element_bytes: int,
    topology: Any,
    single_samples_per_s: float,
    compute_source: str,
) -> dict:
    """Step time, throughput, efficiency and speedup the cost model gives on the scaling config's cluster."""
    where = cluster(cfg.scaling)
    batch = int(cfg.batch_size)
    algo = cfg.algorithm
    param_bytes = param_count * element_bytes
    backward = float(cfg.scaling.backward_fraction)
    compute_s = batch / single_samples_per_s
    comm = costmodel.communication_s(where, algo.name, ranks, param_bytes, topology, element_bytes)
    own = costmodel.step_estimate(
        compute_s,
        comm,
        backward_fraction=backward,
        overlap=bool(algo.get("overlap", True)),
        period=int(algo.get("communication_period", 1)),
    )
    base_cfg = baseline_algorithm_config()
    base_comm = costmodel.communication_s(where, BASELINE, ranks, param_bytes, None, element_bytes)
    base = costmodel.step_estimate(
        compute_s, base_comm, backward_fraction=backward, overlap=bool(base_cfg.overlap), period=int(base_cfg.communication_period)
    )
    tput, base_tput = own.throughput(ranks, batch), base.throughput(ranks, batch)
    return {
        "cluster": where.name,
        "machines": where.machines(ranks),
        "ranks_per_machine": where.local_size(ranks),
        "parameters": int(param_count),
        "message_bytes": int(param_bytes),
        "compute_source": compute_source,
        "step_time_s": own.step_s,
        "compute_time_s": own.compute_s,
        "comm_time_s": own.exposed_comm_s,
        "wait_time_s": 0.0,
        "exchange_time_s": own.comm_s,
        "throughput_samples_per_s": tput,
        "single_rank_throughput_samples_per_s": single_samples_per_s,
        "scaling_efficiency": efficiency(tput, ranks, single_samples_per_s),
        "baseline_step_time_s": base.step_s,
        "baseline_exchange_time_s": base.comm_s,
        "baseline_throughput_samples_per_s": base_tput,
        "baseline_scaling_efficiency": efficiency(base_tput, ranks, single_samples_per_s),
        "speedup_vs_baseline": speedup(tput, base_tput),
    }


def measured_figures(
    ranks: int, batch: int, timing: dict, single: dict | None, baseline_timing: dict | None, reference_source: str | None
) -> dict:
    """The measured block of a summary from the job's and the probe's timing splits."""
    tput = throughput(ranks, batch, timing["step_time_s"])
    single_tput = single["samples_per_s"] if single else None
    base_tput = throughput(ranks, batch, baseline_timing["step_time_s"]) if baseline_timing else None
    out = dict(timing)
    out.update(
        {
            "throughput_samples_per_s": tput,
            "single_rank_throughput_samples_per_s": single_tput,
            "scaling_efficiency": efficiency(tput, ranks, single_tput),
            "baseline_throughput_samples_per_s": base_tput,
            "baseline_scaling_efficiency": efficiency(base_tput, ranks, single_tput),
            "speedup_vs_baseline": speedup(tput, base_tput),
            "baseline_step_time_s": baseline_timing["step_time_s"] if baseline_timing else None,
            "reference_source": reference_source,
        }
    )
    return out


def headline(measured: dict | None, modeled: dict | None, time_source: str) -> dict:
    """The summary's top-level scaling figures: the measured or the modeled block, as time_source says."""
    chosen = modeled if time_source == "modeled" else measured
    out = {k: (chosen or {}).get(k) for k in HEADLINE}
    out["time_source"] = time_source
    out["measured"] = measured
    out["modeled"] = modeled
    return out


def time_source(cfg: Any, engine_name: str) -> str:
    """modeled for virtual ranks, a cluster that is not here, and throughput-only jobs."""
    if engine_name in VIRTUAL_ENGINES or cfg.scaling.get("modeled", False) or cfg.get("throughput_only", False):
        return "modeled"
    return "measured"


# ---------------------------------------------------------------- one job on real or virtual ranks


def job_figures(
    cfg: Any,
    engine: Any,
    *,
    model: Any,
    make_model: Callable[[], Any],
    algorithm: Any,
    topology: Any,
    make_optimizer: Callable[[Any], Any],
    next_batch: Callable[[], tuple[Any, Any]],
    classes: int,
    batch: int,
    step_s: float,
    blocked_s: float,
) -> dict:
    """Every scaling figure of a finished training job. Collective: every rank calls it;
    rank 0 gets the full dict (the others get the measured part)."""
    n = engine.size
    per_rank = gather_floats(engine, step_s, blocked_s)
    timing = split_timing(per_rank[0], per_rank[1])
    reference_batch = next_batch()
    single = single_rank_reference(cfg, engine, make_model, make_optimizer, reference_batch, classes)
    baseline_timing = None
    if cfg.algorithm.name == BASELINE or n == 1:  # one rank: nothing to communicate, its own baseline
        baseline_timing = timing
    elif int(cfg.get("baseline_steps", 0)) > 0 and n > 1:
        probe = baseline_probe(engine, make_model, make_optimizer, topology, next_batch, int(cfg.baseline_steps))
        probe_rank = gather_floats(engine, probe["step_s"], probe["blocked_s"])
        baseline_timing = split_timing(probe_rank[0], probe_rank[1])
    measured = measured_figures(n, batch, timing, single, baseline_timing, single["source"])
    if cfg.algorithm.name != BASELINE:
        measured["baseline_steps"] = int(cfg.get("baseline_steps", 0))
    modeled = None
    if engine.rank == 0:
        modeled = model_job(cfg, n, model, getattr(algorithm, "topology", None) or topology, single["samples_per_s"])
    source = time_source(cfg, engine.name)
    out = headline(measured, modeled, source)
    out["scaling"] = str(cfg.scaling.name)
    cores = processor_count()
    out["cores"] = cores
    out["contention"] = contention_note(n, cores, engine.name)
    return out


def model_job(cfg: Any, ranks: int, model: Any, topology: Any, measured_samples_per_s: float | None) -> dict | None:
    """The modeled block for a job whose model is built; None when there is no compute speed."""
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    element = params[0].element_size() if params else 4
    declared = declared_speed(cfg.scaling, cfg.model.name)
    speed, source = (declared, "declared") if declared else (measured_samples_per_s, "measured here")
    if not speed:
        return None
    return modeled_figures(
        cfg, ranks=ranks, param_count=count, element_bytes=element, topology=topology,
        single_samples_per_s=speed, compute_source=source,
    )


# ---------------------------------------------------------------- throughput-only mode


def element_size(dtype_name: str) -> int:
    return {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}[dtype_name]


def modeled_job(cfg: Any, run_dir: Path) -> dict:
    """Throughput-only on a modeled cluster: no ranks start. Parameter sizes come from
    the model built on torch's meta device, compute speed from the scaling config."""
    from bfexp.models import parameter_count
    from bfexp.topology import build_topology

    started = time.perf_counter()
    ranks = int(cfg.ranks)
    rpm = int(cfg.engine.ranks_per_machine) or int(cfg.scaling.ranks_per_machine)
    if rpm >= ranks:
        rpm = 0
    topology = build_topology(cfg.topology, ranks, rpm)
    count = parameter_count(cfg.model, cfg.dataset)
    speed = declared_speed(cfg.scaling, cfg.model.name)
    if not speed:
        raise ValueError(missing_speed_message(cfg))
    modeled = modeled_figures(
        cfg, ranks=ranks, param_count=count, element_bytes=element_size(cfg.dtype), topology=topology,
        single_samples_per_s=speed, compute_source="declared",
    )
    summary = {
        "algorithm": cfg.algorithm.name,
        "topology": topology.name,
        "ranks": ranks,
        "engine": "cost model",
        "seed": cfg.seed,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "batch_size": int(cfg.batch_size),
        "lr": cfg.lr,
        "status": "completed",
        "error": None,
        "throughput_only": True,
        "steps": 0,
        "scaling": str(cfg.scaling.name),
        "contention": None,
    }
    summary.update(headline(None, modeled, "modeled"))
    summary["wall_time_s"] = time.perf_counter() - started
    results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary


def missing_speed_message(cfg: Any) -> str:
    declared = sorted((cfg.scaling.get("compute_samples_per_s") or {}).keys())
    return (
        f"throughput_only=true on scaling={cfg.scaling.name} needs the compute speed of model={cfg.model.name}; "
        f"declared: {', '.join(declared) or 'none'}; allowed: one of those, or "
        f"+scaling.compute_samples_per_s.{cfg.model.name}=<samples/s of one rank>"
    )


def throughput_only_ranks(cfg: Any, engine: Any, run_dir: Path) -> dict:
    """Throughput-only on real (or virtual) ranks here: no training. The ranks time the
    algorithm's step and the baseline's on buffers of the model's real size with zero
    gradients (so only the local update and the communication run); compute comes
    from the declared speed or the single-rank reference; the model prices the rest."""
    import torch

    from bfexp.algorithms import build_algorithm
    from bfexp.metrics import StepTimer
    from bfexp.models import build_model, sample_shape
    from bfexp.topology import build_topology
    from bfexp.worker import DTYPES, make_local_optimizer

    started = time.perf_counter()
    n, batch = engine.size, int(cfg.batch_size)
    dtype = DTYPES[cfg.dtype]
    topology = build_topology(cfg.topology, n, cfg.engine.ranks_per_machine)
    engine.set_topology(topology)
    shape, classes = sample_shape(cfg.model, cfg.dataset)
    in_features = int(math.prod(shape))
    def make_model() -> Any:
        return build_model(cfg.model, in_features, classes, cfg.seed, dtype, in_shape=shape)

    model = make_model()
    make_optimizer = lambda params: make_local_optimizer(cfg, params)  # noqa: E731
    steps = max(1, int(cfg.get("baseline_steps", 0)) or 10)

    def time_comm(algorithm_cfg: Any) -> tuple[float, float]:
        fresh = make_model()
        optimizer = build_algorithm(algorithm_cfg, make_optimizer(fresh.parameters()), engine, topology)
        timer = StepTimer(warmup=2)
        for p in fresh.parameters():
            p.grad = torch.zeros_like(p)
        for _ in range(steps + timer.warmup):
            timer.start(engine)
            optimizer.step()
            timer.stop(engine)
        optimizer.finish()
        getattr(optimizer, "close", lambda: None)()
        return timer.mean_step_s, timer.comm_s / max(1, timer.timed_steps)

    own_step, own_blocked = time_comm(cfg.algorithm)
    own = split_timing(*gather_floats(engine, own_step, own_blocked))
    base = None
    if cfg.algorithm.name != BASELINE and n > 1:
        base_step, base_blocked = time_comm(baseline_algorithm_config())
        base = split_timing(*gather_floats(engine, base_step, base_blocked))
    declared = declared_speed(cfg.scaling, cfg.model.name)
    if declared:
        single = {"samples_per_s": declared, "step_time_s": batch / declared, "source": "declared"}
    else:
        g = torch.Generator().manual_seed(cfg.seed)
        x = torch.randn(batch, *shape, generator=g, dtype=dtype)
        y = torch.randint(0, classes, (batch,), generator=g)
        single = single_rank_reference(cfg, engine, make_model, make_optimizer, (x, y), classes)
    compute_s = batch / single["samples_per_s"]
    overlap = bool(cfg.algorithm.get("overlap", True))
    backward = float(cfg.scaling.backward_fraction)
    period = int(cfg.algorithm.get("communication_period", 1))

    def measured_step(comm: dict | None, overlap_: bool, period_: int) -> dict | None:
        if comm is None:
            return None
        # Every timed step communicated (communication_period aside); spread it over the period.
        est = costmodel.step_estimate(compute_s, comm["step_time_s"], backward_fraction=backward, overlap=overlap_, period=period_)
        return {"step_time_s": est.step_s, "compute_time_s": compute_s, "comm_time_s": est.exposed_comm_s,
                "wait_time_s": 0.0, "exchange_time_s": comm["step_time_s"],
                "exchange_blocked_time_s": comm["comm_time_s"], "exchange_wait_time_s": comm["wait_time_s"]}

    own_m = measured_step(own, overlap, period)
    base_m = measured_step(base, True, 1) if base else (own_m if cfg.algorithm.name == BASELINE else None)
    measured = measured_figures(n, batch, own_m, single, base_m, single["source"])
    measured["comm_measured_on"] = f"{n} {engine.name} ranks here, zero-gradient steps of the real model size"
    modeled = None
    if engine.rank == 0:
        modeled = model_job(cfg, n, model, topology, single["samples_per_s"])
    summary = {
        "algorithm": cfg.algorithm.name,
        "topology": topology.name,
        "ranks": n,
        "engine": engine.name,
        "seed": cfg.seed,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "batch_size": batch,
        "lr": cfg.lr,
        "status": "completed",
        "error": None,
        "throughput_only": True,
        "steps": 0,
        "scaling": str(cfg.scaling.name),
        "cores": processor_count(),
        "contention": contention_note(n, processor_count(), engine.name),
    }
    summary.update(headline(measured, modeled, "modeled"))
    summary["wall_time_s"] = time.perf_counter() - started
    if engine.rank == 0:
        results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary
