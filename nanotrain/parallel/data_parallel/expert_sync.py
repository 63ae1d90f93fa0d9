"""Gradient sync with experts: dense parameters and expert shards average over different groups.

Dense parameters are replicated over ep and each ep rank reads different samples, so their
gradients average over dp x cp x ep (``pc.dense_replica_pg``). An expert shard exists once per
(dp, cp) coordinate; the all-to-all's backward already summed, on its owner, the gradients of
the tokens of every ep rank, so it sums over dp x cp (``pc.dp_cp_pg``) and divides by
dp x cp x ep: the average over every rank whose tokens could reach it, the same gradient as one
process training on the whole global batch (Megatron's expert gradient scaling).

``build_grad_sync`` returns one ``BucketedGradSync`` when there is nothing to split (ep = 1),
else a ``GradSyncSet`` of two driven through the same calls (``no_sync``, ``backward_scope``,
``finish_grad_sync``, ``zero_grad``, ``grad_shards``). ZeRO-1/2 (``ZeroOneOptimizer``) turn each
into reduce-scatters over its own group.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from nanotrain.parallel.data_parallel.buckets import DEFAULT_BUCKET_CAP_MB
from nanotrain.parallel.data_parallel.grad_sync import BucketedGradSync
from nanotrain.parallel.data_parallel.hybrid import shard_groups
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.sharding import get_shard_info


def is_expert_param(p: nn.Parameter) -> bool:
    """Sharded over the expert axis (``ShardInfo.axis`` contains "ep")."""
    axis = get_shard_info(p).axis
    return axis is not None and "ep" in axis.split("_")


class GradSyncSet:
    """Several ``BucketedGradSync`` driven as one (each over its own group)."""

    def __init__(self, syncs: list[BucketedGradSync]):
        self.syncs = syncs

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for s in self.syncs:
                stack.enter_context(s.no_sync())
            yield

    def backward_scope(self, last: bool, params=None):
        """Every sync's ``backward_scope`` (each keeps the parameters of its own)."""
        stack = contextlib.ExitStack()
        for s in self.syncs:
            stack.enter_context(s.backward_scope(last, params))
        return stack

    def finish_grad_sync(self) -> None:
        for s in self.syncs:
            s.finish_grad_sync()

    def zero_grad(self) -> None:
        for s in self.syncs:
            s.zero_grad()

    def grad_shards(self):
        """``BucketedGradSync.grad_shards`` of every sync that reduce-scatters (None: none does)."""
        parts = [s.grad_shards() for s in self.syncs]
        return None if all(p is None for p in parts) else [g for p in parts if p for g in p]


def build_grad_sync(
    params: list[nn.Parameter],
    pc: ParallelContext,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    shard_size: Optional[int] = None,
    reduce_dtype: Optional[torch.dtype] = None,
):
    """The gradient sync of this rank's ``params`` (see the module docstring). ``shard_size``
    (``optimizer.zero_shard_size``): hybrid sharding, each sync over this rank's block of the
    replicas and its pieces all-reduced across the blocks (``hybrid.py``). ``reduce_dtype``
    (``optimizer.grad_reduce_dtype``): the dtype the gradients travel and are summed in (None:
    theirs)."""
    dense_replicas = pc.dense_replica_pg.size() if pc.dense_replica_pg is not None else 1
    kw = dict(bucket_cap_mb=bucket_cap_mb, divisor=dense_replicas, reduce_dtype=reduce_dtype)

    def sync(ps, axis: str, group):
        if not shard_size:
            return BucketedGradSync(ps, group, **kw)
        groups = shard_groups(pc, axis, shard_size)
        return BucketedGradSync(ps, groups.shard, replicate_group=groups.replicate, **kw)

    if pc.ep_size == 1:
        return sync(params, "dp_cp_ep", pc.dense_replica_pg)
    dense = [p for p in params if not is_expert_param(p)]
    experts = [p for p in params if is_expert_param(p)]
    syncs = [sync(dense, "dp_cp_ep", pc.dense_replica_pg)]
    if experts:
        syncs.append(sync(experts, "dp_cp", pc.dp_cp_pg))
    return GradSyncSet(syncs)
