"""bfexp: declarative experiments for decentralized deep learning.

``import bfexp as bf`` is also the library for a user's own script:
``bf.init``, ``bf.rank``, ``bf.size``, the engine's operations
(``bf.allreduce``, ``bf.neighbor_allreduce``, ``bf.win_put`` ...),
``bf.shard``, ``bf.DistributedOptimizer`` and ``bf.spawn`` (bfexp.api).
They load on first use, so ``import bfexp`` (and the ``bfexp`` command's
start-up) imports neither torch nor MPI.
"""

from typing import Any

from bfexp.operations import OPERATIONS

__version__ = "0.1.0"

# bfexp.api's public names (tests/test_api.py checks this is its __all__). Only these load it:
# any other name (a submodule Hydra or pickle looks up) stays an AttributeError without importing torch.
_API = frozenset({
    "DistributedOptimizer", "OPERATIONS", "advance", "broadcast_optimizer_state", "broadcast_parameters", "clock_s",
    "engine", "init",
    "is_initialized", "local_rank", "local_size", "machine_rank", "machine_size", "rank", "shard", "shutdown",
    "size", "spawn", *OPERATIONS,
})


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'bfexp' has no attribute {name!r}")
    from bfexp import api

    value = getattr(api, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
