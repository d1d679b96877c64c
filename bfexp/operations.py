"""The engine operations a script runs as ``bf.<name>`` (bfexp.api makes the functions).

Listed in a module of their own, which imports nothing, so that the package
(``import bfexp``) answers for them without importing torch, and bfexp.api
reads the same list without importing the package's namespace back.
"""

__all__ = ["OPERATIONS"]

# Every Engine operation that ``bf.<name>`` runs on the current engine (bfexp.api makes the functions).
OPERATIONS = (
    "allreduce", "allreduce_", "iallreduce", "iallreduce_", "allgather", "iallgather",
    "broadcast", "broadcast_", "ibroadcast", "ibroadcast_", "barrier", "ibarrier",
    "neighbor_allreduce", "neighbor_allreduce_", "ineighbor_allreduce", "ineighbor_allreduce_",
    "neighbor_allgather", "ineighbor_allgather",
    "hierarchical_neighbor_allreduce", "hierarchical_neighbor_allreduce_",
    "ihierarchical_neighbor_allreduce", "ihierarchical_neighbor_allreduce_",
    "win_create", "win_free", "win_tensor", "win_weight",
    "win_put", "iwin_put", "win_accumulate", "iwin_accumulate", "win_get", "iwin_get", "win_update", "iwin_update",
    "set_topology", "set_machine_topology",
)
