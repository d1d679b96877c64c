"""How well a job scales, and how it compares with the allreduce baseline: arithmetic on numbers.

Definitions (README "Scaling"):

* throughput = samples per second over all ranks = ranks x batch / step time;
* scaling_efficiency = throughput at R ranks / (R x single-rank throughput),
  where the single-rank throughput is the SAME step (the worker's
  train_step, the same algorithm wrapper, model, batch, dtype, device) on
  ONE rank, where every communication op takes the engine's single-rank
  path: a 1-rank job is its own reference (its own steps) and scores 1;
* framework_overhead_fraction = that 1-rank step / a plain torch step of
  the same model and batch - 1 (the wrapper's cost, shown on its own
  instead of inside efficiency);
* speedup_vs_baseline = throughput / throughput of the allreduce baseline at
  the same ranks, model and batch.

Every timing figure is a median with an interval (``Spread``): per-step
samples are cut into BLOCKS runs of consecutive steps, and the interval
is a distribution-free confidence interval (order statistics, at least
CONFIDENCE) for the median of the run medians: a load that drifts during
a job widens it, while one disturbed run (another process took the cores
for a second) does not. Too few samples for runs: the same interval on
the samples themselves. Figures derived from two timings (throughput over
a reference, a speedup) take the widest combination of their ends. Two
figures differ by less than their combined spread when their intervals
overlap: ``within_noise``.

Measured figures come from the job's own steps and the engine's count of
time blocked in communication: per rank, compute = step - blocked. The rank
that blocked least is taken to have spent its blocked time moving data
(comm_time_s); what other ranks blocked beyond that is waiting for slower
peers (wait_time_s). Modeled figures come from bfexp.costmodel with the
cluster the scaling config describes; their intervals come from their
inputs' (a measured compute speed). The numbers are taken by the worker
and bfexp.probes; this module only combines them (no torch, no engine, no
whole config), so the driver imports it for its notes at no cost.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any, Mapping, NamedTuple, Sequence

from bfexp import costmodel
from bfexp.results import HEADLINE, INTERVALS, high_key, low_key

# Runs of consecutive steps whose medians give a figure's interval (10 runs: the 2nd lowest to the
# 2nd highest run median), the fewest steps in a run, and the confidence the interval aims at.
BLOCKS = 10
MIN_BLOCK = 3
CONFIDENCE = 0.95
# The most step times a reference keeps of its distribution (its order statistics, evenly spaced).
STEP_TIMES = 101


class Spread(NamedTuple):
    """A figure and its interval: low <= value <= high."""

    value: float
    low: float
    high: float

    @classmethod
    def exact(cls, value: float) -> "Spread":
        """A figure with no spread (a declared number, or a figure equal to itself by definition)."""
        return cls(value, value, value)

    def times(self, k: float) -> "Spread":
        return Spread(self.value * k, self.low * k, self.high * k)

    def inverse(self, k: float = 1.0) -> "Spread":
        """k / x of a positive figure: the ends swap."""
        return Spread(k / self.value, k / self.high, k / self.low)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def order_interval(n: int, confidence: float = CONFIDENCE) -> int:
    """The largest j such that the j-th smallest and j-th largest of n samples bound their median
    with at least ``confidence``: 1 - 2 P(Binomial(n, 1/2) <= j - 1); 1 (their range) when none does."""
    j = 1
    while j + 1 <= (n + 1) // 2 and 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2**n >= confidence:
        j += 1
    return j


def spread_of(samples: Sequence[float]) -> Spread:
    """The median of per-step samples and its interval: the order-statistic confidence interval of the
    median of BLOCKS runs of consecutive samples, widened to hold the median; with fewer than
    BLOCKS x MIN_BLOCK samples, that interval of the samples' own median (a single one: no spread)."""
    xs = [float(x) for x in samples if _finite(x)]
    if not xs:
        nan = float("nan")
        return Spread(nan, nan, nan)
    mid = statistics.median(xs)
    if len(xs) >= BLOCKS * MIN_BLOCK:
        bounds = [round(i * len(xs) / BLOCKS) for i in range(BLOCKS + 1)]
        xs = [statistics.median(xs[a:b]) for a, b in zip(bounds, bounds[1:])]
    xs.sort()
    j = order_interval(len(xs))
    return Spread(mid, min(mid, xs[j - 1]), max(mid, xs[-j]))


def quotient(a: Spread | None, b: Spread | None) -> Spread | None:
    """a / b of two positive figures, its interval the widest the two intervals allow."""
    if a is None or b is None or not all(_finite(x) and x > 0 for x in (*a, *b)):
        return None
    return Spread(a.value / b.value, a.low / b.high, a.high / b.low)


def within_noise(a: Spread, b: Spread) -> bool:
    """The difference of two figures is smaller than their combined spread (their intervals overlap)."""
    return a.low <= b.high and b.low <= a.high


def put(out: dict, key: str, figure: Spread | None) -> None:
    """A figure and the two ends of its interval into a summary dict (None when it cannot be had)."""
    out[key], out[low_key(key)], out[high_key(key)] = figure if figure is not None else (None, None, None)


def get(figures: Mapping[str, Any] | None, key: str) -> Spread | None:
    """A figure with its interval back from a summary dict; a figure without ends has no spread."""
    if not figures or not _finite(figures.get(key)):
        return None
    value = float(figures[key])
    lo, hi = figures.get(low_key(key)), figures.get(high_key(key))
    return Spread(value, float(lo) if _finite(lo) else value, float(hi) if _finite(hi) else value)


def bounded(point: dict, *variants: dict) -> dict:
    """``point`` with every interval figure bounded by the least and greatest value it takes in point and variants
    (a model evaluated at its inputs' interval ends)."""
    out = dict(point)
    for key in INTERVALS:
        if key in point:
            values = [d[key] for d in (point, *variants) if _finite(d.get(key))]
            put(out, key, Spread(point[key], min(values), max(values)) if _finite(point[key]) else None)
    return out


def throughput(ranks: int, batch: int, step_s: float | None) -> float | None:
    """Samples per second over all ranks."""
    if step_s is None or not step_s > 0 or not math.isfinite(step_s):
        return None
    return ranks * batch / step_s


def throughput_spread(ranks: int, batch: int, step: Spread | None) -> Spread | None:
    """Samples per second over all ranks, with the interval its step time's gives."""
    if step is None or not all(_finite(x) and x > 0 for x in step):
        return None
    return step.inverse(ranks * batch)


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


def reference_threads(setting: int | None, cores: int) -> int:
    """torch threads the single-rank reference runs with: what a 1-rank job gets here (all the cores)
    unless the scaling config pins a number. Never the job's threads per rank, which shrink as ranks
    grow: jobs that differ only in ranks must share one reference."""
    return int(setting) if setting else max(1, cores)


def load_moved(then: float | None, now: float | None, margin: float) -> bool:
    """The machine is busier or quieter than when a reference was taken by more than ``margin``
    (runnable processes in the 1-minute load average); unknown loads count as moved."""
    if not (_finite(then) and _finite(now)):
        return True
    return abs(float(now) - float(then)) > margin


def contention_note(ranks: int, cores: int, on_cpu: bool, quotas: Mapping[str, Any] | None = None) -> str | None:
    """A warning for CPU ranks that outnumber the cores they share, else None. ``quotas``: the emulated
    cluster's hosts (all on this machine) and their CPU quota in cores ("none": no quota)."""
    if quotas:
        asked = [float(q) for q in quotas.values() if q not in (None, "none")]
        if len(asked) < len(quotas) or sum(asked) > cores:
            given = " + ".join(str(q) for q in quotas.values())
            return (f"the emulated hosts' CPU quotas ({given} cores) exceed this machine's {cores} cores: measured "
                    f"throughput and scaling efficiency show CPU contention too; give each host less (launcher.cpu)")
        return None
    if not on_cpu or ranks <= cores:
        return None
    return (
        f"{ranks} ranks share {cores} cores on this machine: measured throughput and scaling "
        f"efficiency mostly show CPU contention, not communication, so the headline figures are the modeled "
        f"ones (the measured ones: summary.json's measured)"
    )


def cycle_means(samples: Sequence[float], cycle: int) -> list[float]:
    """Means of consecutive whole runs of ``cycle`` samples (any ``cycle`` consecutive steps of a rule that
    communicates every ``cycle``-th step hold one communicating step); the samples themselves for 1."""
    if cycle <= 1:
        return list(samples)
    return [sum(samples[i : i + cycle]) / cycle for i in range(0, len(samples) - cycle + 1, cycle)]


def rank_timing(step_samples: Sequence[float], blocked_samples: Sequence[float], cycle: int = 1) -> list[float]:
    """One rank's step and blocked times as six numbers to gather, in split_timing's order:
    the two medians, then the step's interval ends, then the blocked time's. ``cycle``: the rule
    communicates every this many steps (local SGD's H), so the figures are of means over whole
    cycles (a median of single steps would be of the steps that do not communicate)."""
    if cycle > 1 and len(step_samples) >= cycle:
        step_samples, blocked_samples = cycle_means(step_samples, cycle), cycle_means(blocked_samples, cycle)
    step, blocked = spread_of(step_samples), spread_of(blocked_samples)
    return [step.value, blocked.value, step.low, step.high, blocked.low, blocked.high]


def split_timing(
    step_s: Sequence[float],
    blocked_s: Sequence[float],
    step_low_s: Sequence[float] | None = None,
    step_high_s: Sequence[float] | None = None,
    blocked_low_s: Sequence[float] | None = None,
    blocked_high_s: Sequence[float] | None = None,
) -> dict[str, float | None]:
    """Per-rank step and blocked times (medians, and their interval ends when given) -> the job's
    compute / comm / wait split, each with its interval.

    compute = step - blocked (mean over ranks); comm = the least any rank
    blocked; wait = the mean of what ranks blocked beyond that. The three
    add up to the step time (the mean of the ranks' medians). Ends: the
    step's are the means of the ranks' ends, comm's the least of each end,
    compute's and wait's the widest the ends allow (never below 0).
    """
    rows = [r for r in zip(step_s, blocked_s, step_low_s or step_s, step_high_s or step_s,
                           blocked_low_s or blocked_s, blocked_high_s or blocked_s) if all(map(_finite, r))]
    out: dict[str, float | None] = {}
    if not rows:
        for key in ("step_time_s", "compute_time_s", "comm_time_s", "wait_time_s"):
            put(out, key, Spread(*[float("nan")] * 3))
        return out

    def mean(values: Any) -> float:
        values = list(values)
        return sum(values) / len(values)

    step = Spread(mean(r[0] for r in rows), mean(r[2] for r in rows), mean(r[3] for r in rows))
    comm = Spread(min(r[1] for r in rows), min(r[4] for r in rows), min(r[5] for r in rows))
    compute = mean(r[0] - r[1] for r in rows)
    wait = mean(r[1] for r in rows) - comm.value
    put(out, "step_time_s", step)
    put(out, "compute_time_s", Spread(compute, min(compute, max(0.0, mean(r[2] - r[5] for r in rows))),
                                      max(compute, mean(r[3] - r[4] for r in rows))))
    put(out, "comm_time_s", Spread(comm.value, min(comm), max(comm)))
    put(out, "wait_time_s", Spread(wait, min(wait, max(0.0, mean(r[4] for r in rows) - comm.high)),
                                   max(wait, mean(r[5] for r in rows) - comm.low)))
    return out


def cluster(scaling: Mapping[str, Any], cores: int | None = None, end: str | None = None) -> costmodel.Cluster:
    """The cost model's cluster from a scaling config node; ``end``: with the figures of that end of its
    calibration (scaling.calibration_ends) in place of its own."""
    if end is not None:
        scaling = {**scaling, **scaling["calibration_ends"][end]}
    return costmodel.Cluster(
        name=str(scaling["name"]),
        ranks_per_machine=int(scaling["ranks_per_machine"]),
        intra=costmodel.Link(float(scaling["intra_latency_s"]), float(scaling["intra_bandwidth_gbyte_per_s"]) * 1e9),
        inter=costmodel.Link(float(scaling["inter_latency_s"]), float(scaling["inter_bandwidth_gbyte_per_s"]) * 1e9),
        nic_shared=bool(scaling["nic_shared"]),
        reduce_bytes_per_s=float(scaling["reduce_gbyte_per_s"]) * 1e9,
        cores=(scaling.get("cores") or cores or processor_count()) if scaling.get("shares_cores", False) else 0,
        allreduce=str(scaling["allreduce"]),
        stack_bytes_per_s=float(scaling.get("inter_stack_gbyte_per_s") or math.inf) * 1e9,
        switch_bytes_per_s=float(scaling.get("switch_gbyte_per_s") or math.inf) * 1e9,
    )


def calibration_clusters(scaling: Mapping[str, Any], cores: int | None = None) -> list[costmodel.Cluster]:
    """The cost model's cluster at each end of the scaling config's calibration; none where its figures are exact."""
    return [cluster(scaling, cores, end) for end in (scaling.get("calibration_ends") or {})]


def declared_speed(scaling: Mapping[str, Any], model: str) -> float | None:
    """A scaling config's compute speed (samples/s of one rank) for a model, if it declares one."""
    value = (scaling.get("compute_samples_per_s") or {}).get(model)
    return float(value) if value else None


def device_speed(scaling: Mapping[str, Any], forward_flop_per_sample: float) -> float | None:
    """One rank's training samples/s from the scaling config's device: its peak FLOP/s times the fraction a
    step achieves, over a sample's training FLOP (the forward's over 1 - backward_fraction); None without
    device figures or a counted forward."""
    peak = float(scaling.get("device_peak_tflop_per_s") or 0.0) * 1e12
    achieved = float(scaling.get("device_achieved_fraction") or 0.0)
    if peak <= 0 or achieved <= 0 or not forward_flop_per_sample or forward_flop_per_sample <= 0:
        return None
    backward = float(scaling.get("backward_fraction", 0.667))
    return peak * achieved * (1.0 - backward) / float(forward_flop_per_sample)


def rank_speed(scaling: Mapping[str, Any], model: str, forward_flop_per_sample: float) -> tuple[float, str] | None:
    """One rank's training samples/s on a modeled cluster and its source: the figure the scaling config
    declares for the model (published measurements), else its device's FLOP/s over the model's counted FLOP;
    None where it has neither."""
    declared = declared_speed(scaling, model)
    if declared:
        return declared, "declared"
    derived = device_speed(scaling, forward_flop_per_sample)
    return (derived, "device FLOP/s") if derived else None


def missing_speed_message(scaling: Mapping[str, Any], model: str) -> str:
    declared = sorted((scaling.get("compute_samples_per_s") or {}).keys())
    return (
        f"throughput_only=true on scaling={scaling['name']} needs the compute speed of model={model}; "
        f"declared: {', '.join(declared) or 'none'}, and no device figures; allowed: one of those, or "
        f"+scaling.compute_samples_per_s.{model}=<samples/s of one rank>, or scaling.device_peak_tflop_per_s and "
        "scaling.device_achieved_fraction (a step's FLOP are counted from the model)"
    )


def modeled_figures(
    where: costmodel.Cluster,
    *,
    traffic: costmodel.Traffic,
    overlap: bool,
    period: int,
    baseline: costmodel.Traffic,
    ranks: int,
    batch: int,
    param_count: int,
    element_bytes: int,
    topology: Any,
    backward_fraction: float,
    single: Spread,
    compute_source: str,
    buckets: int = 0,
    baseline_buckets: int = 0,
    wait_s: float = 0.0,
    baseline_wait_s: float = 0.0,
    ends: Sequence[costmodel.Cluster] = (),
) -> dict:
    """Step time, throughput, efficiency and speedup the cost model gives on a cluster, each with
    the interval the model gives at the ends of the compute speed's (none for a declared speed) and at
    ``ends``, the cluster at the ends of its calibration (calibration_clusters): its inputs' intervals.

    The baseline is allreduce with its defaults: overlapped with backward, every step.
    ``buckets``/``baseline_buckets``: how many buckets backward releases the message in (costmodel.step_estimate).
    ``wait_s``/``baseline_wait_s``: what waiting for the slowest rank adds to a step (costmodel.straggler_wait_s).
    """
    param_bytes = param_count * element_bytes

    def prices(cluster: costmodel.Cluster) -> tuple[float, float]:
        """One exchange of the rule and of the baseline on ``cluster``: the compute speed does not enter it."""
        return (costmodel.communication_s(cluster, traffic, ranks, param_bytes, topology, element_bytes),
                costmodel.communication_s(cluster, baseline, ranks, param_bytes, None, element_bytes))

    def at(speed: float, comm: float, base_comm: float) -> dict:
        compute_s = batch / speed
        own = costmodel.step_estimate(compute_s, comm, backward_fraction=backward_fraction, overlap=overlap, period=period,
                                      buckets=buckets, wait_s=wait_s)
        base = costmodel.step_estimate(compute_s, base_comm, backward_fraction=backward_fraction, overlap=True, period=1,
                                       buckets=baseline_buckets, wait_s=baseline_wait_s)
        tput, base_tput = own.throughput(ranks, batch), base.throughput(ranks, batch)
        return {
            "step_time_s": own.step_s,
            "compute_time_s": own.compute_s,
            "comm_time_s": own.exposed_comm_s,
            "wait_time_s": own.wait_s,
            "throughput_samples_per_s": tput,
            "single_rank_throughput_samples_per_s": speed,
            "scaling_efficiency": efficiency(tput, ranks, speed),
            "baseline_throughput_samples_per_s": base_tput,
            "baseline_scaling_efficiency": efficiency(base_tput, ranks, speed),
            "speedup_vs_baseline": speedup(tput, base_tput),
            "exchange_time_s": own.comm_s,
            "baseline_step_time_s": base.step_s,
            "baseline_exchange_time_s": base.comm_s,
        }

    # the point first: the point cluster at the point speed
    out = bounded(*(at(speed, *comms) for comms in map(prices, (where, *ends)) for speed in single))
    out.update({
        "time_source": "modeled",
        "cluster": where.name,
        "machines": where.machines(ranks),
        "ranks_per_machine": where.local_size(ranks),
        "parameters": int(param_count),
        "message_bytes": int(param_bytes),
        "compute_source": compute_source,
    })
    return out


def exchange_step(exchange: dict, *, compute: Spread, backward_fraction: float, overlap: bool, period: int) -> dict:
    """A step built from a measured exchange (throughput-only on ranks) and a known compute time,
    its interval from both ends of both (the step grows with each).

    Every timed step communicated (communication_period aside); the model spreads it over the period.
    """
    measured = get(exchange, "step_time_s") or Spread(*[float("nan")] * 3)
    runs = []
    for compute_s, exchange_s in zip(compute, measured):
        est = costmodel.step_estimate(compute_s, exchange_s, backward_fraction=backward_fraction,
                                      overlap=overlap, period=period)
        runs.append({"step_time_s": est.step_s, "compute_time_s": compute_s, "comm_time_s": est.exposed_comm_s,
                     "wait_time_s": 0.0})
    out = bounded(*runs)
    out.update({"exchange_time_s": exchange["step_time_s"], "exchange_blocked_time_s": exchange["comm_time_s"],
                "exchange_wait_time_s": exchange["wait_time_s"]})
    return out


def measured_figures(ranks: int, batch: int, timing: dict, single_step: Spread | None, baseline_timing: dict | None,
                     *, own_baseline: bool, source: str) -> dict:
    """The measured (or, on virtual ranks, simulated) block of a summary, every figure with its interval.

    ``timing``/``baseline_timing``: split_timing of the job's and the baseline's
    steps; ``single_step``: the single-rank reference's step time;
    ``own_baseline``: the job is its own baseline (speedup 1 exactly).
    """
    tput = throughput_spread(ranks, batch, get(timing, "step_time_s"))
    single = throughput_spread(1, batch, single_step)
    all_single = single.times(ranks) if single else None
    base = throughput_spread(ranks, batch, get(baseline_timing, "step_time_s"))
    out = dict(timing)
    out["time_source"] = source
    put(out, "throughput_samples_per_s", tput)
    put(out, "single_rank_throughput_samples_per_s", single)
    put(out, "scaling_efficiency", quotient(tput, all_single))
    put(out, "baseline_throughput_samples_per_s", base)
    put(out, "baseline_scaling_efficiency", quotient(base, all_single))
    put(out, "speedup_vs_baseline", Spread.exact(1.0) if own_baseline and tput else quotient(tput, base))
    out["baseline_step_time_s"] = baseline_timing["step_time_s"] if baseline_timing else None
    return out


def reference_figures(wrapper_s: Sequence[float], plain_s: Sequence[float],
                      step_s: Sequence[float] | None = None) -> dict:
    """The single-rank reference from its paired rounds: the step with the job's wrapper, a plain
    torch step, and framework_overhead_fraction = wrapper / plain - 1 per round (paired rounds
    see the same load, so their ratio is steadier than either time). ``step_s``: every step of
    a 1-rank job, its own reference (``wrapper_s`` then holds the steps the plain rounds followed)."""
    out: dict[str, Any] = {}
    put(out, "step_time_s", spread_of(step_s if step_s else wrapper_s))
    put(out, "plain_step_time_s", spread_of(plain_s))
    put(out, "framework_overhead_fraction", spread_of([w / p - 1.0 for w, p in zip(wrapper_s, plain_s) if p > 0]))
    out["step_times_s"] = order_statistics(step_s if step_s else wrapper_s)
    return out


def order_statistics(samples: Sequence[float], most: int = STEP_TIMES) -> list[float]:
    """The samples sorted (rounded to microseconds), or ``most`` of them evenly spaced from the least to the greatest:
    their distribution, for the cost model's wait for the slowest rank (costmodel.straggler_wait_s)."""
    xs = sorted(float(x) for x in samples if _finite(x))
    if len(xs) > most:
        xs = [xs[round(i * (len(xs) - 1) / (most - 1))] for i in range(most)]
    return [round(x, 6) for x in xs]


def headline(measured: dict | None, modeled: dict | None, time_source: str) -> dict:
    """The summary's top-level scaling figures: the measured or the modeled block, as time_source says."""
    chosen = modeled if time_source == "modeled" else measured
    out = {k: (chosen or {}).get(k) for k in HEADLINE}
    out["time_source"] = time_source
    out["measured"] = measured
    out["modeled"] = modeled
    return out


def time_source(*, virtual: bool, modeled_cluster: bool, throughput_only: bool) -> str:
    """modeled for virtual ranks, a cluster that is not here, and throughput-only jobs."""
    return "modeled" if virtual or modeled_cluster or throughput_only else "measured"


def measured_source(*, virtual: bool) -> str:
    """What the ranks' own timings are: measured on real ranks, simulated on virtual ranks (threads)."""
    return "simulated" if virtual else "measured"
