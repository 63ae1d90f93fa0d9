"""The ZeRO side of ``BucketedGradSync`` (``grad_sync.py``): cutting its buckets into the pieces
each rank owns (stages 1-3, ``shard``), what a sharded sync hands the norm and the optimizer
(``grad_shards``, ``owned_grad``), and hybrid sharding's sum of the pieces across the blocks
(``hybrid.py``). A mixin: it works on the sync's own buckets, views and hooks' state."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from nanotrain.parallel.collectives import allreduce_flat_
from nanotrain.parallel.data_parallel import buckets as layout
from nanotrain.parallel.data_parallel.shard_grads import GradShards, ShardAccumulator, _same_storage, piece_of


class ZeroSharding:
    """Stages 1-3 of ``BucketedGradSync`` (see the module doc and ``grad_sync``'s)."""

    def _idle(self) -> bool:
        return not any(b.launched or b.handle is not None for b in self.buckets)

    def shard(self, stage: int = 1, units: Optional[dict[int, str]] = None) -> list:
        """Cut every bucket into ``shards`` equal pieces, rank r owning piece r (module doc);
        returns the buckets, whose layout is the ZeRO partition (the same at stages 1 and 2;
        at 3 also cut at the ``units``, id(param) -> gather unit: ``shard_params.py``).
        ``stage`` 2 and 3 also turn the buffers into per-micro-batch reduce-scatters into an owned
        accumulator (``shard_grads.py``). Called between steps (gradients accumulated so far
        are kept); a group of one keeps its buckets as they are (rank 0 owns everything) and
        nothing changes."""
        if not self._idle():
            raise RuntimeError("BucketedGradSync.shard() during a sync round")
        if self.world_size > 1 and self.shards == 1:
            if stage >= 2:  # the buffers' zeros are no gradient: let them go (only real ones move)
                empty = {id(p) for b in self.buckets if not bool(b.buffer.any()) for p in b.params}
                for p in self.params:
                    if id(p) in empty and _same_storage(p.grad, self._view_of[id(p)]):
                        p.grad = None
            self.shards, self.gather_grads = self.world_size, stage == 1
            self.buckets = self._build_buckets(self.shards, allocate=stage == 1, units=units if stage == 3 else None)
            self._index_views()
            self._next_launch = 0
            sizes = [b.size for b in self.buckets]
            numels = [[p.numel() for p in b.params] for b in self.buckets]
            self._pieces = [
                (self.buckets[k].params[j], a, z)
                for k, j, a, z in layout.shard_pieces(numels, sizes, self.shards, self.rank)
            ]
            if stage == 1:
                self._attach_views(copy_existing=True)
            else:
                ref = weakref.ref(self)  # no cycle: the trainer's drop frees the sync and its group
                self.accumulator = ShardAccumulator(
                    self.buckets,
                    self._pieces,
                    self.group,
                    self.shards,
                    self.rank,
                    self.divisor,
                    lambda index, from_hook: ref()._log_launch(index, from_hook),
                    self.reduce_dtype,
                )
                for b in self.buckets:  # gradients so far: into fresh buffers, reduced at the next finish
                    if any(p.grad is not None for p in b.params):
                        self.accumulator.allocate(b)
        elif self.shards > 1 and (stage >= 2) != (self.accumulator is not None):
            raise RuntimeError(f"BucketedGradSync is sharded for another ZeRO stage than {stage}")
        return self.buckets

    def stop_gathering_grads(self) -> None:
        """From now on leave each gradient reduced on its owner's piece only (after ``shard()``;
        the optimizer calls it after each step)."""
        self.gather_grads = False

    def _owned(self, b) -> torch.Tensor:
        return piece_of(b.buffer, self.shards, self.rank)

    def grad_shards(self) -> Optional[list[GradShards]]:
        """None when gradients are all-reduced; when reduce-scattered, this rank's pieces, which
        hold the average (for the gradient norm: ``optim/clip.py``, the same whether or not the
        pieces were all-gathered too; under ZeRO-2 with the accumulator's tensors)."""
        if self.shards == 1:
            return None
        tensors = self.accumulator.piece_grads() if self.accumulator is not None else None
        return [GradShards(self.group, list(self.params), list(self._pieces), tensors)]

    def owned_grad(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """ZeRO-2: the accumulator's view of the range of ``p`` this rank owns (1-D; None: owns
        none). At stages 0/1 the reduced gradient is ``p.grad``."""
        if self.accumulator is None:
            raise RuntimeError("owned_grad: the sync is not sharded for ZeRO-2")
        return self.accumulator.owned_grad(p)

    def _across_blocks(self) -> None:
        """Hybrid sharding: sum what this rank reduced (its pieces) across the other blocks."""
        if self.replicate_group is None:
            return
        if self.accumulator is not None:
            tensors = [self.accumulator.flat]
        else:
            tensors = [self._owned(b) if self.shards > 1 else b.buffer for b in self.buckets]
        allreduce_flat_(tensors, self.replicate_group)
