"""BlueFog's InferSourceFromDestinationRanks / InferDestinationFromSourceRanks (collective)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from bfexp.bluefog import ops


def _check(ranks: Sequence[int], what: str) -> list[int]:
    me, n = ops.rank(), ops.size()
    out = [int(r) for r in ranks]
    if any(not 0 <= r < n for r in out) or len(set(out)) != len(out) or me in out:
        raise ValueError(f"{what}={out}; allowed: distinct ranks in 0..{n - 1} other than this rank {me}")
    return out


def _infer(ranks: list[int], transpose: bool, construct_adjacency_matrix: bool):
    degrees = ops.allgather(torch.tensor([len(ranks)], dtype=torch.int64)).tolist()
    flat = ops.allgather(torch.tensor(ranks, dtype=torch.int64)).tolist()
    adjacency, at = {}, 0
    for r, d in enumerate(degrees):
        adjacency[r] = sorted(flat[at : at + d])
        at += d
    me = ops.rank()
    found = [k for k, adj in adjacency.items() if me in adj]
    if not construct_adjacency_matrix:
        return found
    w = np.eye(ops.size())
    for k, adj in adjacency.items():
        w[k, adj] = 1.0
    if transpose:
        w = w.T
    return found, w / w.sum(axis=1)


def InferSourceFromDestinationRanks(dst_ranks: Sequence[int], construct_adjacency_matrix: bool = False):  # noqa: N802
    """The ranks that send to this one, from every rank's destinations (collective)."""
    return _infer(_check(dst_ranks, "dst_ranks"), False, construct_adjacency_matrix)


def InferDestinationFromSourceRanks(src_ranks: Sequence[int], construct_adjacency_matrix: bool = False):  # noqa: N802
    """The ranks this one sends to, from every rank's sources (collective)."""
    return _infer(_check(src_ranks, "src_ranks"), True, construct_adjacency_matrix)
