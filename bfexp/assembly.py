"""One assembly of a decentralized optimizer: an algorithm wrapping a local optimizer, on a topology, on an engine.

Three doors lead here, and they must agree: the runner's ranks
(bfexp.worker.build, from the job's config nodes), the library
(bfexp.DistributedOptimizer, from names, classes or objects) and BlueFog's
layer (bfexp.bluefog.optimizers). Written once, the same (algorithm,
topology, options) meets the same checks in the same order as the driver's
dry build (bfexp.cli): the algorithm's keys and types (``config.check_node``),
its ranges (``check_options``), the kind of job (``check_run``), then the
graph its rule runs on (``resolve_topology``, with the options that decide
whether it reads the graph at all). A refusal is the same one-line
ConfigError whatever the door; a substituted topology comes back as a note,
which the library and BlueFog's layer warn with (``Assembly.warn``) and the
driver prints as ``note: ...``.

Components come as config nodes (a mapping with ``_target_``) or as objects:
a Topology, a class, a Compressor in the options. The algorithm is called
directly with its options as plain values, never through OmegaConf, so an
object option reaches its constructor as it is, and a nested node (a
compressor's) is checked by the constructor that owns it (one line naming
the allowed keys) rather than instantiated blind by Hydra.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from bfexp import config
from bfexp.algorithms import DecentralizedOptimizer
from bfexp.comm.engine import Engine
from bfexp.errors import ConfigError
from bfexp.topology import Topology, build_topology

__all__ = ["Assembly", "algorithm_of", "assemble", "layout_ranks_per_machine", "resolve", "topology_of"]


@dataclass
class Assembly:
    """What ``assemble`` made: the wrapped optimizer, the topology its rule runs on, and notes for the user."""

    optimizer: DecentralizedOptimizer
    topology: Topology | None  # what the rule runs on (exact diffusion may substitute an undirected form)
    notes: list[str] = field(default_factory=list)

    def warn(self, stacklevel: int = 2) -> None:
        """Each note as a UserWarning, pointing ``stacklevel`` frames above the caller (a library's door)."""
        for note in self.notes:
            warnings.warn(note, UserWarning, stacklevel=stacklevel + 1)


def layout_ranks_per_machine(engine: Engine) -> int:
    """The engine's machines as a ranks_per_machine setting (0: every rank on one machine)."""
    return 0 if engine.local_size == engine.size else engine.local_size


def algorithm_of(algorithm: type | Mapping[str, Any], options: Mapping[str, Any] | None = None
                 ) -> tuple[type, dict[str, Any]]:
    """(class, options) from a config node (its keys over by ``options``, checked against the
    constructor: ``unknown key 'algorithm.x'; allowed: ...``) or from a class and its keywords
    (its constructor names a misspelt one)."""
    if isinstance(algorithm, type):
        return algorithm, dict(options or {})
    node = {**_plain(algorithm), **(options or {})}
    target, values = config.check_node(node, "algorithm", runtime=config.RUNTIME["algorithm"])
    return target, values


def _plain(node: Mapping[str, Any]) -> dict[str, Any]:
    """A node as a plain dict (a DictConfig resolved), so that objects can be laid over its values."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def topology_of(topology: Topology | Mapping[str, Any] | Callable[..., Topology] | None, engine: Engine,
                options: Mapping[str, Any] | None = None) -> Topology | None:
    """The Topology on the engine's ranks from a config node (built on the engine's machines, as the
    runner builds it), a Topology, or a class/function called with the rank count and ``options``."""
    if topology is None or isinstance(topology, Topology):
        made = topology
    elif isinstance(topology, Mapping):
        made = build_topology({**_plain(topology), **(options or {})}, engine.size, layout_ranks_per_machine(engine))
    else:
        made = topology(engine.size, **(options or {}))
    if made is not None and made.size != engine.size:
        raise ConfigError(f"topology has {made.size} ranks; allowed: a topology on the job's {engine.size} ranks")
    return made


def resolve(cls: type, topology: Topology | None, options: Mapping[str, Any]) -> tuple[Topology | None, list[str]]:
    """The topology the rule runs on and the notes to give (a substituted graph); TopologyMismatch
    (one line) when it cannot run there. A rule that reads no graph with these options takes any."""
    if topology is None or not hasattr(cls, "resolve_topology"):
        return topology, []
    used, note = cls.resolve_topology(topology, **options)
    return used, [note] if note else []


def check(cls: type, options: Mapping[str, Any], engine: type[Engine], *, throughput_only: bool = False) -> None:
    """What the driver checks before any rank starts: the options' ranges, then the kind of job."""
    if hasattr(cls, "check_options"):
        cls.check_options(**options)
    if hasattr(cls, "check_run"):
        cls.check_run(engine, throughput_only=throughput_only, modeled=False)


def assemble(
    algorithm: type | Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    engine: Engine,
    topology: Topology | Mapping[str, Any] | Callable[..., Topology] | None,
    *,
    model: torch.nn.Module | None = None,
    options: Mapping[str, Any] | None = None,
    topology_options: Mapping[str, Any] | None = None,
    throughput_only: bool = False,
) -> Assembly:
    """``algorithm`` wrapping ``optimizer`` on ``topology`` on ``engine``: checked, resolved, built.

    ``algorithm``: a config node (``options`` over its keys) or a class (``options`` its keywords);
    ``topology``: see ``topology_of`` (None for a rule that takes none, as BlueFog's wrappers).
    The engine's static topology becomes the one the rule runs on. ``throughput_only``: the job
    times step() alone (some rules cannot be timed so).
    """
    cls, values = algorithm_of(algorithm, options)
    check(cls, values, type(engine), throughput_only=throughput_only)
    used, notes = resolve(cls, topology_of(topology, engine, topology_options), values)
    if used is not None:
        engine.set_topology(used)
    return Assembly(cls(optimizer, engine, used, model=model, **values), used, notes)
