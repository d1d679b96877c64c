"""BlueFog's public torch API (``import bluefog.torch as bf``) implemented on bfexp.

A BlueFog program runs on bfexp with one changed line::

    import bfexp.bluefog.torch as bf      # was: import bluefog.torch as bf
    # or: import bfexp.bluefog as bf

under ``bfexp-run -n 4 python prog.py`` (MPI ranks) or as virtual ranks
(``bfexp-run -n 4 --engine threads python prog.py``, ``bf.spawn``). BlueFog
itself pins torch 1.4 and needs a C++ build; here every call is carried by
bfexp's engine (bfexp.comm) and, for the optimizer wrappers, by bfexp's
update rules (bfexp.algorithms). ``from bluefog.common import
topology_util`` becomes ``from bfexp.bluefog.common import topology_util``.

What is covered, what differs and what raises NotImplementedError: README
"Coming from BlueFog". The modules: ops (basics, collectives, neighbor
ops, handles, windows), utility (parameter and optimizer-state helpers),
optimizers (the wrappers), topology_util (graphs and dynamic schedules).
"""

from bfexp.api import advance, clock_s  # bfexp's, not BlueFog's: a rank's (simulated) time, docs "Coming from BlueFog"
from bfexp.bluefog import topology_util
from bfexp.bluefog.ops import (
    allgather,
    allgather_nonblocking,
    allreduce,
    allreduce_,
    allreduce_nonblocking,
    allreduce_nonblocking_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_nonblocking,
    broadcast_nonblocking_,
    get_current_created_window_names,
    get_skip_negotiate_stage,
    get_win_version,
    hierarchical_neighbor_allreduce,
    hierarchical_neighbor_allreduce_nonblocking,
    in_neighbor_machine_ranks,
    in_neighbor_ranks,
    init,
    is_homogeneous,
    is_machine_topo_weighted,
    is_topo_weighted,
    load_machine_topology,
    load_topology,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    mpi_threads_supported,
    nccl_built,
    neighbor_allgather,
    neighbor_allgather_nonblocking,
    neighbor_allreduce,
    neighbor_allreduce_nonblocking,
    neighbor_win_accumulate,
    neighbor_win_accumulate_nonblocking,
    neighbor_win_get,
    neighbor_win_get_nonblocking,
    neighbor_win_put,
    neighbor_win_put_nonblocking,
    out_neighbor_machine_ranks,
    out_neighbor_ranks,
    poll,
    rank,
    resume,
    set_machine_topology,
    set_skip_negotiate_stage,
    set_topology,
    shutdown,
    size,
    suspend,
    synchronize,
    timeline_context,
    timeline_end_activity,
    timeline_start_activity,
    turn_off_win_ops_with_associated_p,
    turn_on_win_ops_with_associated_p,
    unified_mpi_window_model_supported,
    wait,
    win_accumulate,
    win_accumulate_nonblocking,
    win_associated_p,
    win_create,
    win_free,
    win_get,
    win_get_nonblocking,
    win_mutex,
    win_poll,
    win_put,
    win_put_nonblocking,
    win_update,
    win_update_then_collect,
    win_wait,
)
from bfexp.bluefog.optimizers import (
    CommunicationType,
    DistributedAdaptThenCombineOptimizer,
    DistributedAdaptWithCombineOptimizer,
    DistributedAllreduceOptimizer,
    DistributedGradientAllreduceOptimizer,
    DistributedHierarchicalNeighborAllreduceOptimizer,
    DistributedNeighborAllreduceOptimizer,
    DistributedOptimizer,
    DistributedWinPutOptimizer,
)
from bfexp.bluefog.topology_util import (
    ExponentialGraph,
    ExponentialTwoGraph,
    FullyConnectedGraph,
    GetDynamicOnePeerSendRecvRanks,
    GetExp2DynamicSendRecvMachineRanks,
    GetInnerOuterExpo2DynamicSendRecvRanks,
    GetInnerOuterRingDynamicSendRecvRanks,
    GetRecvWeights,
    GetSendWeights,
    IsRegularGraph,
    IsTopologyEquivalent,
    MeshGrid2DGraph,
    RingGraph,
    StarGraph,
    SymmetricExponentialGraph,
)
from bfexp.bluefog.utility import allreduce_parameters, broadcast_optimizer_state, broadcast_parameters
from bfexp.bluefog.inference import InferDestinationFromSourceRanks, InferSourceFromDestinationRanks

__all__ = [name for name in dir() if not name.startswith("_") and name not in ("ops", "optimizers", "utility",
                                                                                  "inference")]
