"""Hybrid sharding (``optimizer.zero_shard_size``): ZeRO within blocks of a parameter's replicas,
plain data parallelism across the blocks (PyTorch's HSDP, DeepSpeed's hpZ / MiCS).

The n replicas of a parameter (dp x cp x ep ranks for dense parameters, dp x cp for an expert
shard) are cut into blocks of ``s`` consecutive ranks of their group. ZeRO-1/2/3 shard over a
block (partition, reduce-scatters, parameter all-gathers: the fast links when a block is one
node); each rank's owned piece is then summed across the n/s ranks that own the same piece in the
other blocks, one all-reduce of the pieces per step (``BucketedGradSync.finish_grad_sync``). Every
block holds the whole model state once, so a rank holds 1/s (not 1/n) of it, and the per-step
inter-block traffic is one all-reduce of 1/s of the gradient bytes.

With the grid's rank order (tp fastest, then cp, then dp) the block of dp ranks ``k*s .. k*s+s-1``
lies on one node when ``s x cp x tp`` ranks fit one (``gpus_per_node``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from nanotrain.parallel.observe.hang_record import HANG_RECORD


@dataclass
class ShardGroups:
    """This rank's block (``shard``) of its replicas along ``axis``, the ranks owning the same
    pieces in the other blocks (``replicate``; None with one block) and the replica count
    (the gradients' divisor)."""

    shard: dist.ProcessGroup
    replicate: Optional[dist.ProcessGroup]
    replicas: int


def shard_groups(pc, axis: str, size: int) -> ShardGroups:
    """The groups of hybrid sharding in blocks of ``size`` along ``axis`` (``"dp_cp_ep"``: dense
    replicas, ``"dp_cp"``: an expert shard's), created once per context (every rank calls this
    with the same arguments in the same order, as for any group)."""
    cache = pc.__dict__.setdefault("_shard_groups", {})
    if (axis, size) in cache:
        return cache[(axis, size)]
    mine = pc.grid.group_of(axis, pc.world_rank)
    everyone = [mine] if pc.local_sync else pc.grid.groups(axis)
    n = len(mine)
    if size < 1 or n % size:
        raise ValueError(f"optimizer.zero_shard_size ({size}) must divide the {n} replicas along {axis}")
    shard = replicate = None
    for ranks in everyone:
        for i in range(0, n, size):
            pg = pc.subgroup(tuple(ranks[i : i + size]))
            shard = pg if pg is not None else shard
    for ranks in everyone:
        for j in range(size if n > size else 0):
            pg = pc.subgroup(tuple(ranks[j::size]))
            replicate = pg if pg is not None else replicate
    for pg, name in ((shard, "zero shard"), (replicate, "zero replicate")):
        if pg is not None:
            HANG_RECORD.name_group(pg, f"{name} ({axis})")
    cache[(axis, size)] = ShardGroups(shard, replicate, n)
    return cache[(axis, size)]
