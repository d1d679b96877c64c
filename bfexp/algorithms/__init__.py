"""One file per algorithm; each shows its update rule and cites its paper.

Every algorithm wraps a torch optimizer (see base.DecentralizedOptimizer), and
its constructor is its config schema. In a script:

    topology, _ = DSGD.resolve_topology(topology)   # the topology the rule runs on
    opt = DSGD(torch.optim.SGD(model.parameters(), lr=0.1), engine, topology, model=model, style="awc")
    # the usual loop: opt.zero_grad(); loss.backward(); opt.step()

From config, conf/algorithm/<name>.yaml names the class (``_target_``,
``_partial_: true``) with its options, and the worker builds it the Hydra way:
``instantiate(cfg.algorithm)(local_optimizer, engine, topology, model=model)``.
"""

from __future__ import annotations

from bfexp.algorithms.ad_psgd import ADPSGD
from bfexp.algorithms.allreduce import Allreduce
from bfexp.algorithms.async_push_sum import AsyncPushSum
from bfexp.algorithms.base import DecentralizedOptimizer, GlobalAverage, Requirements
from bfexp.algorithms.choco_sgd import ChocoSGD
from bfexp.algorithms.compressed_allreduce import CompressedAllreduce
from bfexp.algorithms.ddp import DDP
from bfexp.algorithms.diloco import DiLoCo
from bfexp.algorithms.dsgd import DSGD
from bfexp.algorithms.exact_diffusion import ExactDiffusion
from bfexp.algorithms.gossip import Gossip
from bfexp.algorithms.gradient_tracking import GradientTracking
from bfexp.algorithms.push_diging import PushDIGing
from bfexp.algorithms.push_sum import PushSum
from bfexp.algorithms.qg_dsgdm import QGDSGDm
from bfexp.algorithms.slowmo import SlowMo
from bfexp.errors import TopologyMismatch

__all__ = [
    "ADPSGD",
    "DDP",
    "DSGD",
    "Allreduce",
    "AsyncPushSum",
    "ChocoSGD",
    "CompressedAllreduce",
    "DecentralizedOptimizer",
    "DiLoCo",
    "ExactDiffusion",
    "GlobalAverage",
    "Gossip",
    "GradientTracking",
    "PushDIGing",
    "PushSum",
    "QGDSGDm",
    "Requirements",
    "SlowMo",
    "TopologyMismatch",
]
