"""What summary.json says, assembled where the driver and the ranks both reach it: the job's identity, the
scaling part (measured and modeled figures, the machine layout), a modeled job's whole summary, and the
summary of a job that did not finish.

No torch at import: the driver calls this before (modeled jobs: instead
of) starting ranks; the few figures that need a model or an algorithm class
import them when asked.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf

from bfexp import config, costmodel, results, scaling
from bfexp.config import launcher_of
from bfexp.schema import Settings

__all__ = ["compute_speed", "failed_summary", "job_identity", "machine_layout", "modeled", "modeled_block",
           "pricing_facts", "reference_fields", "scaling_block", "topology_ranks_per_machine"]


def job_identity(cfg: Any, **actual: Any) -> dict:
    """The summary's identity for this config; ``actual`` overrides what the run really used."""
    values = {
        "algorithm": config.label(cfg.algorithm),
        "topology": config.label(cfg.topology),
        "ranks": cfg.ranks,
        "engine": cfg.engine.name,
        "seed": cfg.seed,
        "model": config.label(cfg.model),
        "dataset": config.label(cfg.dataset),
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
    }
    values.update(actual)
    return results.identity(**values)


def failed_summary(identity: dict, run_dir: Path, error: str, extra: dict | None = None,
                   status: str = results.FAILED) -> dict:
    """A summary for a job that did not finish (failed or interrupted), keeping what rank 0 had logged; without
    one, the job's ``identity`` (``job_identity``) to begin with."""
    summary = results.read_json(run_dir / results.SUMMARY) or dict(identity)
    records = results.read_jsonl(run_dir / results.METRICS)
    if records:
        last = records[-1]
        summary.setdefault("final_loss", last.get("loss"))
        summary.setdefault("final_accuracy", last.get("accuracy"))
        summary.setdefault("consensus_distance", last.get("consensus_distance"))
        summary["steps"] = last.get("step")
    summary.update(extra or {})
    summary["status"] = status
    summary["error"] = error
    results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary


def reference_fields(single: dict) -> dict:
    """The summary's reference: the whole record, where it came from, and the framework overhead it measured."""
    out = {"reference": single, "reference_source": single["source"]}
    scaling.put(out, "framework_overhead_fraction", scaling.get(single, "framework_overhead_fraction"))
    return out


def modeled_block(scaling_node: Any, algorithm_node: Any, batch: int, ranks: int, param_count: int,
                  element_bytes: int, topology: Any, speed: scaling.Spread | None, source: str,
                  ranks_per_machine: int = 0, step_times: Sequence[float] = ()) -> dict | None:
    """The cost model's figures for this job (its scaling and algorithm nodes, ``batch`` samples per rank and
    step) on the scaling config's cluster; None without a compute speed.
    ``ranks_per_machine``: where the ranks ran, for a scaling config of this machine (modeled=false)
    that leaves its machines to the run. ``step_times``: the single-rank reference's step times, whose
    spread prices the wait for the slowest rank where scaling.straggler_wait asks (a measured speed only)."""
    from bfexp.algorithms import Allreduce

    if not speed:
        return None
    where = scaling_node
    if ranks_per_machine and not scaling_node.modeled and not scaling_node.ranks_per_machine:
        where = {**OmegaConf.to_container(scaling_node, resolve=True), "ranks_per_machine": ranks_per_machine}
    algorithm = config.target_of(algorithm_node, "algorithm")
    options = config.node_options(algorithm_node)
    traffic, period = algorithm.traffic_of(**options), int(options.get("communication_period", 1))
    wait_s = baseline_wait_s = 0.0
    if scaling_node.get("straggler_wait") and source == "measured here" and step_times:  # this machine's jitter
        if not algorithm.asynchronous:  # its ranks never wait for one another
            wait_s = costmodel.straggler_wait_s(step_times, traffic, ranks, topology, period)
        baseline_wait_s = costmodel.straggler_wait_s(step_times, Allreduce.traffic, ranks)
    return scaling.modeled_figures(
        scaling.cluster(where), traffic=traffic, baseline=Allreduce.traffic,
        overlap=bool(options.get("overlap", True)), period=period,
        ranks=ranks, batch=int(batch), param_count=param_count, element_bytes=element_bytes,
        topology=topology, backward_fraction=float(scaling_node.backward_fraction),
        single=speed, compute_source=source,
        buckets=bucket_count(algorithm, options, param_count * element_bytes),
        baseline_buckets=bucket_count(Allreduce, {}, param_count * element_bytes),
        wait_s=wait_s, baseline_wait_s=baseline_wait_s, ends=scaling.calibration_clusters(where),
    )


def pricing_facts(algorithm_node: Any, model_node: Any, batch: int, param_bytes: int, forward_flop: int) -> dict:
    """What pricing a job's recorded steps on any cluster needs besides the cluster (bfexp.ledger.Prices.on):
    plain data, kept in operations.json, so that repricing a folder imports nothing it names."""
    algorithm = config.target_of(algorithm_node, "algorithm")
    options = config.node_options(algorithm_node)
    traffic = algorithm.traffic_of(**options)
    return {"model": config.label(model_node), "batch_size": int(batch), "forward_flop_per_sample": int(forward_flop),
            "overlap": bool(options.get("overlap", True)), "buckets": bucket_count(algorithm, options, param_bytes),
            # a compressor's payloads: each received one is rebuilt as this many dense bytes before it is added
            "decoded_bytes": traffic.decoded_bytes(param_bytes)}


def bucket_count(algorithm: type, options: dict, param_bytes: int) -> int:
    """Buckets a rule that sends gradients from backward hooks (``bucketed``) cuts the model into at its
    bucket_mb (the parameters' boundaries aside); 0 for every other rule (the cost model's finest overlap)."""
    from bfexp.algorithms.base import BUCKET_MB

    if not getattr(algorithm, "bucketed", False) or not options.get("overlap", True):
        return 0
    bucket_bytes = float(options.get("bucket_mb", BUCKET_MB)) * 2**20
    return max(1, math.ceil(param_bytes / bucket_bytes))


def compute_speed(scaling_node: Any, model: Any, measured: scaling.Spread | None,
                  forward_flop: int = 0) -> tuple[scaling.Spread | None, str]:
    """One rank's samples/s for the cost model: the scaling config's declared figure for the model (its node),
    else its device's over ``forward_flop`` (one sample's forward, the plan's count), else the measured one."""
    speed = scaling.rank_speed(scaling_node, config.label(model), forward_flop)
    return (scaling.Spread.exact(speed[0]), speed[1]) if speed else (measured, "measured here")


def machine_layout(engine_node: Any, engine: Any) -> dict:
    """Where the ranks ran: machines, ranks on each, and how that was known (detected from
    MPI's shared-memory split, emulated with engine.ranks_per_machine, or threads of one process)."""
    source = getattr(engine, "layout_source", "emulated" if engine_node.ranks_per_machine else "one process")
    return {"run_machines": engine.machines, "run_ranks_per_machine": engine.local_size, "machine_layout": source}


def scaling_block(scaling_node: Any, engine: Any | None, measured: dict | None, modeled: dict | None, *,
                  throughput_only: bool, engine_node: Any = None, launcher: Any = None) -> dict:
    """The summary's scaling part: headline figures, their source, the cluster and the contention note.
    With the ranks' ``engine``: its node (``engine_node``) and the job's launcher node (``launcher``)."""
    virtual = bool(engine is not None and engine.virtual)
    source = scaling.time_source(virtual=virtual, modeled_cluster=bool(scaling_node.modeled),
                                 throughput_only=throughput_only)
    contention, extra = None, {}
    if engine is not None:
        extra.update(machine_layout(engine_node, engine))
        cores = scaling.processor_count()
        extra["cores"] = cores
        facts = {} if engine.virtual else launcher_of(launcher).facts(engine.size)
        extra.update(facts)
        # the ranks that share one machine's cores: across machines, those of a machine
        sharing = engine.local_size if engine.machines > 1 else engine.size
        contention = scaling.contention_note(sharing, cores, engine.device_type == "cpu",
                                             (facts.get("emulated_cluster") or {}).get("cpu_per_host"))
    if contention and source == "measured" and modeled:
        source = "modeled"  # measured on shared cores is mostly contention: the headline is the cluster's model
    out = scaling.headline(measured, modeled, source)
    out["scaling"] = str(scaling_node.name)
    out.update(extra)
    out["contention"] = contention
    return out


def topology_ranks_per_machine(engine_node: Any, ranks: int, *, modeled: bool, scaling_node: Any = None,
                               launcher: Any = None) -> int:
    """How ranks sit on machines for the topology: the engine's layout (engine.ranks_per_machine, else the
    machines a launcher across machines (its node: ``launcher``) places them on, as the ranks will detect),
    and for a ``modeled`` cluster the scaling config's machines (0 = one machine)."""
    rpm = int(engine_node.ranks_per_machine)
    if modeled:
        rpm = rpm or int(scaling_node.ranks_per_machine)
        return 0 if rpm >= int(ranks) else rpm
    from bfexp.comm import PROCESS_ENGINES

    if not rpm and engine_node.name in PROCESS_ENGINES:
        launcher = launcher_of(launcher)
        placed = [] if launcher.on_this_machine else launcher.hosts(int(ranks))
        rpm = placed[0][1] if len(placed) > 1 else 0
    return rpm


def modeled(identity: dict, settings: Settings, run_dir: Path, *, topology: Any, model: Any, dataset: Any,
            scaling_node: Any, algorithm: Any, engine: Any, forward_flop: int = 0) -> dict:
    """Throughput-only on a modeled cluster: no ranks start. Parameter sizes come from
    the model built on torch's meta device, compute speed from the scaling config (declared, or its device's
    over ``forward_flop``, one sample's forward as the plan counted it; counted here when 0). ``identity``: the job's
    (``job_identity``; its topology is the one built here), ``settings``: the run's; then the components' nodes."""
    import torch

    from bfexp.models import forward_flop_per_sample, parameter_count, sample_shape
    from bfexp.topology import build_topology

    started = time.perf_counter()
    ranks = int(settings.ranks)
    graph = build_topology(topology, ranks, topology_ranks_per_machine(engine, ranks, modeled=True,
                                                                       scaling_node=scaling_node))
    in_shape, classes = sample_shape(model, config.build(dataset, "dataset"))
    speed_and_source = scaling.rank_speed(scaling_node, config.label(model), forward_flop or
                                          forward_flop_per_sample(model, in_shape, classes))
    if speed_and_source is None:
        raise config.ConfigError(scaling.missing_speed_message(scaling_node, config.label(model)))
    speed, source = speed_and_source
    count = parameter_count(model, in_shape, classes)
    summary = {**identity, "topology": graph.name}
    summary.update({"status": results.COMPLETED, "error": None, "throughput_only": True, "steps": 0})
    element_bytes = getattr(torch, str(settings.dtype)).itemsize
    summary.update(scaling_block(
        scaling_node, None, None,
        modeled_block(scaling_node, algorithm, int(settings.batch_size), ranks, count, element_bytes, graph,
                      scaling.Spread.exact(speed), source),
        throughput_only=True,
    ))
    summary["wall_time_s"] = time.perf_counter() - started
    results.write_json_atomic(run_dir / results.SUMMARY, summary)
    return summary
