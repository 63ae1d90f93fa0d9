"""Data parallelism: bucketed gradient all-reduce overlapped with backward, ZeRO-1 (the same
buckets reduce-scattered, the parameters all-gathered), ZeRO-2 (reduce-scattered every
micro-batch into an owned accumulator, the full buffers freed), and the expert-aware sync (dense
over dp x cp x ep, experts over dp x cp)."""

from nanotrain.parallel.data_parallel.expert_sync import GradSyncSet, build_grad_sync, is_expert_param
from nanotrain.parallel.data_parallel.grad_sync import Bucket, BucketedGradSync, grad_sync_of
from nanotrain.parallel.data_parallel.shard_grads import GradShards, ShardAccumulator, reduced_grad_of
from nanotrain.parallel.data_parallel.zero import ShardPiece, ZeroOneOptimizer, zero_partition

__all__ = [
    "Bucket",
    "BucketedGradSync",
    "GradShards",
    "GradSyncSet",
    "ShardAccumulator",
    "ShardPiece",
    "ZeroOneOptimizer",
    "build_grad_sync",
    "grad_sync_of",
    "is_expert_param",
    "reduced_grad_of",
    "zero_partition",
]
