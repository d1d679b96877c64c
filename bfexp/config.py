"""Structured config schema and validation.

Every option YAML under conf/<group>/ starts from one of these dataclasses
(its ``defaults`` names ``schema_<option>``), so a misspelt key or a value
of the wrong type fails at compose time. ``validate`` then checks what a
type cannot say (ranges, allowed words, graph/rank-count fits) and raises
ConfigError, which the CLI turns into a one-line message and exit code 2
before any rank starts.

This module imports only the standard library, Hydra and OmegaConf: the CLI
needs it for ``--help`` and completion, which must stay instant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value that cannot run; the message names the value and what is allowed."""


# ------------------------------------------------------------------ algorithm
@dataclass
class AlgorithmConfig:
    name: str = MISSING
    # Local SGD: communicate every `communication_period` steps (W = I in between).
    communication_period: int = 1
    # Start communication from hooks so it overlaps computation (false: after backward).
    overlap: bool = True
    # Messages started during backward carry buckets of at most this many MiB.
    bucket_mb: float = 25.0


@dataclass
class DSGDConfig(AlgorithmConfig):
    name: str = "dsgd"
    # atc: X+ = W(X - a F(X)); awc: X+ = WX - a F(X); cta: X+ = WX - a F(WX).
    style: str = "atc"


@dataclass
class ExactDiffusionConfig(AlgorithmConfig):
    """Needs a static symmetric doubly stochastic W; a graph with an undirected form runs on that form."""

    name: str = "exact_diffusion"


@dataclass
class GradientTrackingConfig(AlgorithmConfig):
    name: str = "gradient_tracking"
    # diging: X+ = WX - aY, Y+ = WY + dF; atc: X+ = W(X - aY), Y+ = W(Y + dF).
    form: str = "diging"


@dataclass
class PushSumConfig(AlgorithmConfig):
    """Directed graphs: needs column-stochastic weights (topology.weights=column on non-regular graphs)."""

    name: str = "push_sum"


@dataclass
class PushDIGingConfig(AlgorithmConfig):
    name: str = "push_diging"


@dataclass
class AllreduceConfig(AlgorithmConfig):
    name: str = "allreduce"


@dataclass
class DDPConfig(AlgorithmConfig):
    """torch DistributedDataParallel (gloo on CPU, nccl on GPU); bucket_mb is its bucket_cap_mb."""

    name: str = "ddp"


def validate_algorithm(cfg: Any) -> None:
    """Algorithm options a type cannot check (the topology and engine fit is checked by
    bfexp.algorithms.resolve_job, which needs the built topology)."""
    algo = cfg.algorithm
    period = algo.communication_period
    if period < 1:
        raise ConfigError(f"algorithm.communication_period={period}; allowed: an integer >= 1")
    if algo.bucket_mb <= 0:
        raise ConfigError(f"algorithm.bucket_mb={algo.bucket_mb}; allowed: a number > 0")
    if algo.name == "ddp" and period != 1:
        raise ConfigError(
            f"algorithm.communication_period={period}; algorithm=ddp allows only 1 "
            "(algorithm=allreduce runs local SGD with a period)"
        )


# ------------------------------------------------------------------ topology
@dataclass
class TopologyConfig:
    name: str = MISSING
    # uniform: 1/(in-degree+1); metropolis: Metropolis-Hastings (symmetric,
    # doubly stochastic on undirected graphs); column: column-stochastic (push-sum).
    weights: str = "uniform"


@dataclass
class RingConfig(TopologyConfig):
    name: str = "ring"
    directed: bool = False


@dataclass
class Exp2Config(TopologyConfig):
    name: str = "exp2"
    base: int = 2


@dataclass
class SymmetricExp2Config(TopologyConfig):
    name: str = "symmetric_exp2"
    base: int = 2


@dataclass
class MeshConfig(TopologyConfig):
    name: str = "mesh"
    # Grids are not regular, so uniform weights would not be doubly stochastic.
    weights: str = "metropolis"
    torus: bool = True
    # 0 = the two closest factors of the rank count.
    rows: int = 0


@dataclass
class StarConfig(TopologyConfig):
    name: str = "star"
    weights: str = "metropolis"
    center: int = 0


@dataclass
class FullyConnectedConfig(TopologyConfig):
    name: str = "fully_connected"


@dataclass
class HypercubeConfig(TopologyConfig):
    name: str = "hypercube"


@dataclass
class RandomRegularConfig(TopologyConfig):
    name: str = "random_regular"
    degree: int = 3
    # The graph's own seed: the same graph across training seeds.
    seed: int = 0


@dataclass
class OnePeerExp2Config(TopologyConfig):
    name: str = "one_peer_exp2"


@dataclass
class OnePeerRingConfig(TopologyConfig):
    name: str = "one_peer_ring"


@dataclass
class InnerOuterExp2Config(TopologyConfig):
    """Machines of engine.ranks_per_machine ranks each."""

    name: str = "inner_outer_exp2"


# ------------------------------------------------------------------ model
@dataclass
class ModelConfig:
    name: str = MISSING


@dataclass
class LogRegConfig(ModelConfig):
    name: str = "logreg"


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    hidden: List[int] = field(default_factory=lambda: [64])
    activation: str = "relu"


@dataclass
class CNNConfig(ModelConfig):
    """A small LeNet-style convolutional net for image data sets."""

    name: str = "cnn"
    channels: List[int] = field(default_factory=lambda: [16, 32])
    hidden: int = 128


@dataclass
class ResNet50Config(ModelConfig):
    """ResNet-50 (He et al. 2016; torchvision's v1.5 layout, 25.6M parameters).

    The image shape and classes below are ImageNet's: throughput-only mode,
    which loads no data, sizes the model from them. Training on a data set
    uses its own class count, and flat inputs are viewed as `channels`-channel
    square images.
    """

    name: str = "resnet50"
    channels: int = 3
    image_size: int = 224
    classes: int = 1000


# ------------------------------------------------------------------ dataset
@dataclass
class DatasetConfig:
    name: str = MISSING
    # How the training set is split by rank: iid, dirichlet (label skew with
    # concentration `alpha`; small alpha = very heterogeneous) or sorted.
    partition: str = "iid"
    alpha: float = 0.5
    # Held-out samples every rank evaluates on (0 = all).
    eval_samples: int = 2000


@dataclass
class SyntheticConfig(DatasetConfig):
    """Logistic regression where each rank has its own true model (non-iid)."""

    name: str = "synthetic"
    samples_per_rank: int = 512
    features: int = 32
    classes: int = 2
    # Spread of the ranks' true models around a shared one: 0 = iid.
    heterogeneity: float = 1.0
    label_noise: float = 0.05


@dataclass
class DigitsConfig(DatasetConfig):
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes)."""

    name: str = "digits"
    partition: str = "dirichlet"
    test_fraction: float = 0.2


@dataclass
class MNISTConfig(DatasetConfig):
    """MNIST from its four idx files (optionally .gz) in a local folder; nothing is downloaded."""

    name: str = "mnist"
    root: str = "data/mnist"


@dataclass
class CIFAR10Config(DatasetConfig):
    """CIFAR-10 from the python pickle batches (cifar-10-batches-py) in a local folder."""

    name: str = "cifar10"
    root: str = "data/cifar-10-batches-py"


# ------------------------------------------------------------------ engine
@dataclass
class EngineConfig:
    name: str = MISSING
    # Ranks per machine for hierarchical ops and inner-outer graphs; 0 = all ranks on one machine.
    ranks_per_machine: int = 0
    # Per-rank Chrome-trace JSON (Perfetto) in <run dir>/timeline/.
    timeline: bool = False


@dataclass
class MPIEngineConfig(EngineConfig):
    name: str = "mpi"
    # Extra arguments for mpiexec, e.g. ["--bind-to", "none"].
    mpiexec_args: List[str] = field(default_factory=list)


@dataclass
class NCCLEngineConfig(EngineConfig):
    """CuPy-NCCL on GPUs: one MPI rank per GPU (GPU = the rank's index on its machine)."""

    name: str = "nccl"
    mpiexec_args: List[str] = field(default_factory=list)
    # Share each neighbor exchange's pattern over MPI first: a mismatch raises
    # on every rank instead of leaving NCCL waiting forever (one small allgather).
    check_neighbors: bool = True


@dataclass
class ThreadsEngineConfig(EngineConfig):
    """Virtual ranks: every rank is a thread of the driver process; tensors move in memory."""

    name: str = "threads"


@dataclass
class AutoEngineConfig(EngineConfig):
    """Chooses per job: nccl when every rank has its own GPU; else mpi while ranks fit
    the processor slots times slots_factor; else threads (printed, and kept in summary.json)."""

    name: str = "auto"
    # MPI ranks per processor slot (core) before auto switches to threads.
    slots_factor: float = 4.0
    # Passed to mpiexec when mpi or nccl is chosen.
    mpiexec_args: List[str] = field(default_factory=list)


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
    # true: ranks are CPU processes sharing this machine's cores (copies slow down past one rank per core).
    shares_cores: bool = False
    # The baseline's allreduce: ring (flat) or hierarchical (inside machines, then across).
    allreduce: str = "ring"
    # Share of a step's compute that is the backward pass, which communication can hide behind.
    backward_fraction: float = 0.667
    # Training samples per second of ONE rank, by model name (compute only, no
    # communication); models not listed use the measured single-rank reference.
    compute_samples_per_s: Dict[str, float] = field(default_factory=dict)
    # Single-rank reference: timed steps of one rank without communication.
    reference_steps: int = 10
    # Where references are cached (per model, batch, dtype and device): "auto" =
    # $BFEXP_CACHE_DIR, else $XDG_CACHE_HOME/bfexp, else ~/.cache/bfexp; null = no cache.
    reference_cache: Optional[str] = "auto"


@dataclass
class LocalScalingConfig(ScalingConfig):
    """This machine, measured; link figures from scripts/calibrate_comm.py."""

    name: str = "local"
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


# ------------------------------------------------------------------ logger
# Rank 0 always writes metrics.jsonl; a logger option says what the driver
# does with the stream besides: show it, and/or send it to a tracker.
@dataclass
class LoggerConfig:
    name: str = MISSING
    # Driver progress: a rich bar on a terminal, plain lines otherwise (CI, pipes).
    progress: bool = True


@dataclass
class ConsoleLoggerConfig(LoggerConfig):
    name: str = "console"


@dataclass
class JsonlLoggerConfig(LoggerConfig):
    """metrics.jsonl only: no progress display, just the summary table at the end."""

    name: str = "jsonl"
    progress: bool = False


@dataclass
class WandbLoggerConfig(LoggerConfig):
    """Weights & Biases from the driver: one run per job, grouped by sweep."""

    name: str = "wandb"
    project: str = "bfexp"
    entity: Optional[str] = None
    # null: $WANDB_MODE when the user set it, else offline (sync later with `wandb sync`).
    mode: Optional[str] = None
    # null: the sweep folder for a multirun, none for a single run.
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


# ------------------------------------------------------------------ top level
@dataclass
class OptimizerConfig:
    # The local optimizer each rank runs before (or after) communication.
    name: str = "sgd"
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class Config:
    """Top level. conf/config.yaml picks one option per group on top of this."""

    algorithm: Any = MISSING
    topology: Any = MISSING
    model: Any = MISSING
    dataset: Any = MISSING
    engine: Any = MISSING
    scaling: Any = MISSING
    logger: Any = MISSING

    ranks: int = 4
    seed: int = 0
    # Training length: `epochs` (over each rank's shard) wins over `steps` when set.
    steps: int = 200
    epochs: Optional[int] = None
    batch_size: int = 32
    lr: float = 0.1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dtype: str = "float32"
    log_every: int = 10
    # A run is stopped as diverged when the loss is not finite or exceeds this.
    divergence_loss: float = 1e6
    # Seconds a job may run before the driver stops it (0 = no limit).
    timeout_s: float = 0.0
    # Fault injection, for testing how a job fails: this rank raises at fail_step.
    fail_rank: Optional[int] = None
    fail_step: int = 1
    # Skip training: report the step time and throughput the scaling config
    # models (no ranks for a modeled cluster; on scaling=local the ranks also
    # measure the algorithm's communication on buffers of the model's size).
    throughput_only: bool = False
    # Timed steps of the allreduce baseline probe each job runs after training
    # on the same ranks, model and batch (0 = no probe; allreduce jobs are their own baseline).
    baseline_steps: int = 10
    # At the end of a sweep (-m), write report.csv, report.md and plots into its folder.
    report: bool = True


SCHEMAS: dict[str, dict[str, type]] = {
    "algorithm": {
        "dsgd": DSGDConfig,
        "exact_diffusion": ExactDiffusionConfig,
        "gradient_tracking": GradientTrackingConfig,
        "push_sum": PushSumConfig,
        "push_diging": PushDIGingConfig,
        "allreduce": AllreduceConfig,
        "ddp": DDPConfig,
    },
    "topology": {
        "ring": RingConfig,
        "exp2": Exp2Config,
        "symmetric_exp2": SymmetricExp2Config,
        "mesh": MeshConfig,
        "star": StarConfig,
        "fully_connected": FullyConnectedConfig,
        "hypercube": HypercubeConfig,
        "random_regular": RandomRegularConfig,
        "one_peer_exp2": OnePeerExp2Config,
        "one_peer_ring": OnePeerRingConfig,
        "inner_outer_exp2": InnerOuterExp2Config,
    },
    "model": {"logreg": LogRegConfig, "mlp": MLPConfig, "cnn": CNNConfig, "resnet50": ResNet50Config},
    "dataset": {"synthetic": SyntheticConfig, "digits": DigitsConfig, "mnist": MNISTConfig, "cifar10": CIFAR10Config},
    "engine": {"mpi": MPIEngineConfig, "nccl": NCCLEngineConfig, "threads": ThreadsEngineConfig, "auto": AutoEngineConfig},
    "scaling": {
        "local": LocalScalingConfig,
        "v100_cluster": V100ClusterConfig,
        "h100_cluster": H100ClusterConfig,
        "ethernet_10g": Ethernet10GConfig,
    },
    "logger": {"console": ConsoleLoggerConfig, "jsonl": JsonlLoggerConfig, "wandb": WandbLoggerConfig},
}


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent).

    Option schemas live in groups ``schema/<group>`` so they never show up
    as selectable options; each conf/<group>/<option>.yaml pulls its own in
    with ``- /schema/<group>/<option>@_here_``.
    """
    cs = ConfigStore.instance()
    cs.store(name="bfexp_schema", node=Config)
    for group, options in SCHEMAS.items():
        for option, node in options.items():
            cs.store(group=f"schema/{group}", name=option, node=node)


# ------------------------------------------------------------------ validation
ALLOWED = {
    "dtype": ("float32", "float64", "float16", "bfloat16"),
    "optimizer.name": ("sgd", "adam", "adamw"),
    "topology.weights": ("uniform", "metropolis", "column"),
    "dataset.partition": ("iid", "dirichlet", "sorted"),
    "model.activation": ("relu", "tanh", "gelu"),
    "algorithm.style": ("atc", "awc", "cta"),
    "algorithm.form": ("diging", "atc"),
    "logger.mode": ("offline", "online", "disabled"),
    "scaling.allreduce": ("ring", "hierarchical"),
}


# Files a local-folder data set needs (nothing is downloaded at run time).
DATASET_FILES = {
    "mnist": ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"],
    "cifar10": [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
}


def missing_files(dataset: str, root: str) -> list[str]:
    """Files of `dataset` absent from `root` (MNIST's may be gzipped)."""
    base = os.path.expanduser(root)
    return [
        name for name in DATASET_FILES[dataset]
        if not any(os.path.exists(os.path.join(base, name + ext)) for ext in ("", ".gz"))
    ]


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_logger(logger: Any) -> None:
    """A tracker must be importable here, or the user gets the command that installs it."""
    if logger.name == "wandb":
        import importlib.util

        _require(
            importlib.util.find_spec("wandb") is not None,
            "logger=wandb needs the wandb package; install it with: pip install 'bfexp[wandb]'",
        )


def validate_scaling(cfg: Any) -> None:
    """The scaling config's figures, the baseline probe and throughput-only mode."""
    sc = cfg.scaling
    for key in ("intra_bandwidth_gbyte_per_s", "inter_bandwidth_gbyte_per_s", "reduce_gbyte_per_s"):
        _require(sc[key] > 0, f"scaling.{key}={sc[key]}; allowed: a number > 0")
    for key in ("intra_latency_s", "inter_latency_s"):
        _require(sc[key] >= 0, f"scaling.{key}={sc[key]}; allowed: a number >= 0")
    _require(0 <= sc.backward_fraction <= 1, f"scaling.backward_fraction={sc.backward_fraction}; allowed: 0 to 1")
    _require(sc.reference_steps >= 1, f"scaling.reference_steps={sc.reference_steps}; allowed: an integer >= 1")
    for model, speed in (sc.compute_samples_per_s or {}).items():
        _require(speed > 0, f"scaling.compute_samples_per_s.{model}={speed}; allowed: a number > 0")
    _require(cfg.baseline_steps >= 0, f"baseline_steps={cfg.baseline_steps}; allowed: an integer >= 0 (0 = no probe)")
    rpm = sc.ranks_per_machine
    _require(rpm >= 0, f"scaling.ranks_per_machine={rpm}; allowed: 0 (one machine) or >= 1")
    if rpm and cfg.ranks > rpm:
        _require(
            cfg.ranks % rpm == 0,
            f"ranks={cfg.ranks} does not fill machines of scaling.ranks_per_machine={rpm} (scaling={sc.name}); "
            f"allowed: at most {rpm} ranks or a multiple of {rpm}",
        )
        erpm = cfg.engine.ranks_per_machine
        _require(
            erpm in (0, rpm),
            f"engine.ranks_per_machine={erpm} differs from scaling.ranks_per_machine={rpm} of scaling={sc.name}; "
            f"allowed: 0 or {rpm} (the model places ranks on the scaling config's machines)",
        )
    if cfg.throughput_only and sc.modeled and not (sc.compute_samples_per_s or {}).get(cfg.model.name):
        declared = ", ".join(sorted(sc.compute_samples_per_s or {})) or "none"
        raise ConfigError(
            f"throughput_only=true on scaling={sc.name} needs the compute speed of model={cfg.model.name} "
            f"(declared: {declared}); allowed: a declared model, or "
            f"+scaling.compute_samples_per_s.{cfg.model.name}=<samples/s of one rank>"
        )


def validate(cfg: Any) -> None:
    """Reject what cannot run, with a message that names the value and what is allowed."""
    for key, allowed in ALLOWED.items():
        value = _get(cfg, key)
        if value is not None:
            _require(value in allowed, f"{key}={value!r}; allowed: {', '.join(allowed)}")
    _require(cfg.ranks >= 1, f"ranks={cfg.ranks}; allowed: an integer >= 1")
    _require(cfg.steps >= 1, f"steps={cfg.steps}; allowed: an integer >= 1")
    if cfg.epochs is not None:
        _require(cfg.epochs >= 1, f"epochs={cfg.epochs}; allowed: an integer >= 1 or null")
    _require(cfg.batch_size >= 1, f"batch_size={cfg.batch_size}; allowed: an integer >= 1")
    _require(cfg.lr > 0, f"lr={cfg.lr}; allowed: a number > 0")
    _require(cfg.log_every >= 1, f"log_every={cfg.log_every}; allowed: an integer >= 1")
    validate_logger(cfg.logger)
    validate_scaling(cfg)
    validate_algorithm(cfg)
    if cfg.engine.name == "auto":
        factor = cfg.engine.slots_factor
        _require(factor > 0, f"engine.slots_factor={factor}; allowed: a number > 0")
    rpm = cfg.engine.ranks_per_machine
    _require(rpm >= 0, f"engine.ranks_per_machine={rpm}; allowed: 0 (one machine) or >= 1")
    if rpm:
        _require(
            cfg.ranks % rpm == 0,
            f"engine.ranks_per_machine={rpm} does not divide ranks={cfg.ranks}; allowed: a divisor of ranks",
        )
    ds = cfg.dataset
    if ds.name == "synthetic":
        _require(ds.classes >= 2, f"dataset.classes={ds.classes}; allowed: an integer >= 2")
        _require(ds.features >= 1, f"dataset.features={ds.features}; allowed: an integer >= 1")
        _require(ds.samples_per_rank >= 1, f"dataset.samples_per_rank={ds.samples_per_rank}; allowed: >= 1")
    if ds.name in ("mnist", "cifar10"):
        missing = missing_files(ds.name, ds.root)
        _require(not missing, f"dataset.root={ds.root!r} lacks {missing}; place the {ds.name} files there (nothing is downloaded)")
    if ds.partition == "dirichlet":
        _require(ds.alpha > 0, f"dataset.alpha={ds.alpha}; allowed: a number > 0")
