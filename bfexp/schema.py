"""The top-level schema and the data-only groups' schemas, as Hydra's ConfigStore holds them.

Two kinds of config group: components (a ``_target_`` node whose constructor is
its schema: bfexp.components) and data-only groups (scaling), whose options are
the dataclasses below, stored in Hydra's ConfigStore under ``schema/<group>``;
each conf/<group>/<option>.yaml pulls its own in, so a misspelt key or a wrong
type fails at compose time. ``Config`` is the top level (``bfexp_schema``, which
conf/config.yaml pulls in). What may not run is refused by bfexp.config.validate.
This module imports only the standard library, Hydra and OmegaConf.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Dict, Literal, Optional

from omegaconf import MISSING

__all__ = ["DATA_GROUPS", "Config", "Dtype", "FailMode", "ScalingConfig", "register_schema"]

Dtype = Literal["float32", "float64", "float16", "bfloat16"]
FailMode = Literal["raise", "kill", "freeze", "hang"]


# ------------------------------------------------------------------ scaling
@dataclass
class ScalingConfig:
    """A cluster the cost model (bfexp/costmodel.py) prices a training step on.

    Each conf/scaling/<option>.yaml cites the source of every figure it declares.
    """

    name: str = MISSING
    # true: this is a cluster that is not here; its modeled figures headline
    # summary.json (time_source=modeled) beside what was measured on this machine.
    modeled: bool = True
    # Ranks (GPUs) per machine; 0 = every rank on one machine.
    ranks_per_machine: int = 0
    # Inside a machine (NVLink, shared memory): seconds per message, GB/s (1e9 bytes/s) per rank.
    intra_latency_s: float = 1e-6
    intra_bandwidth_gbyte_per_s: float = 10.0
    # Between machines (one network card): seconds per message, GB/s per card.
    inter_latency_s: float = 1e-5
    inter_bandwidth_gbyte_per_s: float = 1.0
    # true: a machine's ranks share one card; false: each rank has its own.
    nic_shared: bool = True
    # How fast a rank combines received data with its own (GB/s).
    reduce_gbyte_per_s: float = 10.0
    # Between machines over TCP on CPUs: GB/s at which one core moves bytes through a rank's network stack
    # (the kernel's copies of what it sends and receives), a stage of the same pipeline as the wire and the
    # switch (the slowest paces a transfer); 0: no such cost (RDMA, GPUDirect, or not modeled).
    inter_stack_gbyte_per_s: float = 0.0
    # GB/s the network between machines forwards in all, every machine's flows together (a switch that is
    # not non-blocking: the emulated cluster's hosts share one kernel); 0: no such limit.
    switch_gbyte_per_s: float = 0.0
    # true: ranks are CPU processes sharing this machine's cores (copies slow down past one rank per core).
    shares_cores: bool = False
    # The cores a machine's ranks share (may be a fraction: a CPU quota); null: this machine's processors.
    cores: Optional[float] = None
    # The baseline's allreduce: ring (flat) or hierarchical (inside machines, then across).
    allreduce: str = "ring"
    # Share of a step's compute that is the backward pass, which communication can hide behind.
    backward_fraction: float = 0.667
    # The figures above at the fast and slow ends of their calibration: {fast: {figure: value, ...}, slow: {...}},
    # any of intra_latency_s, intra_bandwidth_gbyte_per_s, inter_latency_s, inter_stack_gbyte_per_s,
    # reduce_gbyte_per_s, switch_gbyte_per_s. The modeled interval then spans the model at both ends as well
    # as at the compute speed's (a calibration measured here, whose exchanges vary from call to call:
    # scripts/check_costmodel.py writes them; on the command line +scaling.calibration_ends.fast.<figure>=...).
    # Empty: the figures are exact.
    calibration_ends: Dict[str, Any] = field(default_factory=dict)  # Any: OmegaConf refuses an int in nested floats
    # true: price the wait for the slowest rank. An exchange that waits on k ranks (an allreduce: all of
    # them; a neighbor exchange: a rank and its in-neighbors) starts after the slowest of k draws of the
    # single-rank reference's step times, not one (costmodel.straggler_wait_s). Only for ranks that run
    # where the reference ran (scaling=emulated): this machine's jitter is not a modeled cluster's.
    straggler_wait: bool = False
    # Training samples per second of ONE rank, by model name (compute only, no
    # communication); models not listed use the device's figures below, else the measured
    # single-rank reference.
    compute_samples_per_s: Dict[str, float] = field(default_factory=dict)
    # One rank's device, for a model compute_samples_per_s does not list: its peak in TFLOP/s (10^12
    # floating-point operations a second, dense, at the precision it trains in). A training step's FLOP: one
    # sample's forward pass as the job's plan counts it (torch's FlopCounterMode: plan.json's
    # forward_flop_per_sample) over 1 - backward_fraction (backward twice the forward at 0.667), times the
    # batch. 0: no device figures (the model's speed is declared or measured).
    device_peak_tflop_per_s: float = 0.0
    # The fraction of device_peak_tflop_per_s a training step achieves (0: no device figures).
    device_achieved_fraction: float = 0.0
    # Single-rank reference (the denominator of scaling efficiency): timed rounds of the
    # job's step on ONE rank (its wrapper, communication on the single-rank path), each
    # paired with a plain torch step; measured rounds are interleaved with training.
    reference_steps: int = 30
    # cached: reuse a reference of the same key taken at a load average within
    # reference_load_margin of now (a 1-rank job is its own reference: its own steps,
    # stored for the larger jobs); fresh: measure it in every job.
    reference: str = "cached"
    # Runnable processes (1-minute load average) the load may have moved since a cached reference
    # (on a shared machine the load swings by a few all the time; re-measuring stalls every rank).
    reference_load_margin: float = 4.0
    # torch threads of the reference; null = what a 1-rank job gets here (every core).
    reference_threads: Optional[int] = None
    # Where references are cached (one file per key: model, optimizer, wrapper, batch, dtype,
    # device, threads): "auto" = $BFEXP_CACHE_DIR, else $XDG_CACHE_HOME/bfexp, else ~/.cache/bfexp;
    # null = no cache.
    reference_cache: Optional[str] = "auto"


@dataclass
class LocalScalingConfig(ScalingConfig):
    """This machine, measured; link figures from scripts/calibrate_comm.py."""

    name: str = "local"
    modeled: bool = False
    shares_cores: bool = True


@dataclass
class EmulatedScalingConfig(ScalingConfig):
    """The emulated cluster (launcher=emulated), measured; its links and quota from the launcher."""

    name: str = "emulated"
    modeled: bool = False
    shares_cores: bool = True


@dataclass
class V100ClusterConfig(ScalingConfig):
    name: str = "v100_cluster"


@dataclass
class H100ClusterConfig(ScalingConfig):
    name: str = "h100_cluster"


@dataclass
class Ethernet10GConfig(ScalingConfig):
    name: str = "ethernet_10g"


# ------------------------------------------------------------------ top level
@dataclass
class Config:
    """Top level. conf/config.yaml picks one option per group on top of this."""

    # Components: `_target_` nodes whose constructors are their schema.
    algorithm: Any = MISSING
    topology: Any = MISSING
    model: Any = MISSING
    dataset: Any = MISSING
    optimizer: Any = MISSING
    # How process ranks start (bfexp.launchers): a `_target_` node, conf/launcher/.
    launcher: Any = MISSING
    # The engine its ranks run (bfexp.comm; auto: chosen per job), a `_target_` node, conf/engine/.
    engine: Any = MISSING
    # A data-only group: the dataclasses above.
    scaling: Any = MISSING
    # What the driver does with the metrics stream (bfexp.loggers): a `_target_` node, conf/logger/.
    logger: Any = MISSING
    # Stragglers (bfexp.heterogeneity): a `_target_` node, conf/heterogeneity/.
    heterogeneity: Any = MISSING

    ranks: int = 4
    seed: int = 0
    # Training length: `epochs` (over each rank's shard) wins over `steps` when set.
    steps: int = 200
    epochs: Optional[int] = None
    # Train for a time budget: each rank trains until this many seconds of its training time have passed
    # (measured on process ranks, simulated on virtual ranks); `steps` (or `epochs`) is then an upper
    # bound. Synchronous algorithms stop where the budget ends, agreed collectively; asynchronous ones
    # run as many steps as each rank's speed allows, with no lockstep (docs/how-to/async-and-stragglers.md). null: no budget.
    budget_s: Optional[float] = None
    # Under budget_s, asynchronous runs evaluate each rank's model every this many seconds of its own
    # training time (and the ranks' average model at those times, where it is cheap); null: budget_s / 20.
    eval_every_s: Optional[float] = None
    batch_size: int = 32
    # The local optimizer's learning rate (conf/optimizer/*.yaml read it as ${lr}).
    lr: float = 0.1
    dtype: str = "float32"
    log_every: int = 10
    # Held-out evaluation (loss, accuracy) every this many steps, and at the last step;
    # null = by budget: the first logged step, then in multiples of log_every spaced so evaluation takes
    # about eval_budget of the training time, priced from the work (bfexp.metrics.EvalSchedule).
    eval_every: Optional[int] = None
    eval_budget: float = 0.1
    # With eval_every=null: at least this many evaluations over the run, evenly spaced in multiples of log_every,
    # where eval_budget would space them wider (accuracy curves, not two points); 0 = eval_budget alone.
    eval_points: int = 10
    # Evaluate on the first this many held-out samples (a fixed subset); null = all of them.
    eval_subset: Optional[int] = None
    # A run is stopped as diverged when the loss is not finite or exceeds this.
    divergence_loss: float = 1e6
    # The hang watchdog: seconds a rank may wait inside one communication call (or, as a
    # process, go without a heartbeat) before the job counts as hung and ends (0 = no watchdog).
    timeout_s: float = 300.0
    # Write a checkpoint every this many steps (0: only where a signal stops the job).
    checkpoint_every: int = 0
    # A sweep (-m) stops at its first failed job instead of running the rest.
    fail_fast: bool = False
    # A sweep (-m) with points that cannot run (e.g. exact_diffusion on a directed graph): run the valid
    # points and list the refused ones, with their reasons, in the report (false: refuse the whole sweep).
    skip_invalid: bool = False
    # Fault injection, for testing how a job fails: at fail_step, rank fail_rank does fail_mode:
    # raise (an exception), kill (SIGKILL itself), freeze (SIGSTOP itself) or hang (sleep
    # forever inside its next communication call). kill and freeze need a process per rank.
    fail_rank: Optional[int] = None
    fail_step: int = 1
    fail_mode: str = "raise"
    # Skip training: report the step time and throughput the scaling config
    # models (no ranks for a modeled cluster; on scaling=local the ranks also
    # measure the algorithm's communication on buffers of the model's size).
    throughput_only: bool = False
    # Timed steps of the allreduce baseline probe each job runs after training
    # on the same ranks, model and batch (0 = no probe; allreduce jobs are their own baseline).
    baseline_steps: int = 10
    # At the end of a sweep (-m), write report.csv, report.md and plots into its folder.
    report: bool = True
    # Time to accuracy: the report's time to reach this held-out accuracy / loss (null: the final value
    # of the sweep's allreduce job at the same ranks and engine).
    target_accuracy: Optional[float] = None
    target_eval_loss: Optional[float] = None


# The data-only group's options (component groups have no schema here: their targets are it).
DATA_GROUPS: dict[str, dict[str, type]] = {
    "scaling": {
        "local": LocalScalingConfig,
        "emulated": EmulatedScalingConfig,
        "v100_cluster": V100ClusterConfig,
        "h100_cluster": H100ClusterConfig,
        "ethernet_10g": Ethernet10GConfig,
    },
}


def register_schema() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent).

    Option schemas live in groups ``schema/<group>`` so they never show up
    as selectable options; each conf/<group>/<option>.yaml pulls its own in
    with ``- /schema/<group>/<option>@_here_``. Stored once per process: command lines run one after another in
    one interpreter (tests/cli_in_process.py) would otherwise convert every dataclass again each time.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "bfexp_schema.yaml" in cs.repo:  # the last to be stored below is there too
        return
    for group, options in DATA_GROUPS.items():
        for option, node in options.items():
            cs.store(group=f"schema/{group}", name=option, node=node)
    cs.store(name="bfexp_schema", node=Config)


# The component groups of the top level: each component receives its own node, never the whole config.
COMPONENTS = ("algorithm", "topology", "model", "dataset", "optimizer", "launcher", "engine", "scaling", "logger",
              "heterogeneity")


def _settings_of(cls: type, cfg: Any) -> Any:
    """The top level's values of a composed config (a key an older saved config lacks: its default)."""
    from dataclasses import fields

    return cls(**{f.name: cfg.get(f.name, f.default) for f in fields(cls)})


# The run's own section: the top level's plain values (ranks, steps, seed, lr, ...), typed and read-only, without
# the component nodes. What a function needs of the run it reads here; a component's options come in its own node
# (``cfg.algorithm``, ``cfg.engine``, ...). Made once, at an entry point, by ``Settings.of(cfg)``. Its fields are
# Config's less COMPONENTS, with their types and defaults: every key is declared once, in Config.
Settings = make_dataclass(
    "Settings",
    [(f.name, f.type, field(default=f.default)) for f in fields(Config) if f.name not in COMPONENTS],
    frozen=True,
    namespace={"of": classmethod(_settings_of), "__module__": __name__,
               "__doc__": "The run's own section: the top level's plain values, typed and read-only (Config's "
                          "fields less the component nodes)."},
)
