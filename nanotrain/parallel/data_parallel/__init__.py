"""Data parallelism: bucketed gradient all-reduce overlapped with backward, and ZeRO-1."""
from nanotrain.parallel.data_parallel.grad_sync import Bucket, BucketedGradSync
from nanotrain.parallel.data_parallel.zero import ShardPiece, ZeroOneOptimizer, zero_partition

__all__ = ["Bucket", "BucketedGradSync", "ShardPiece", "ZeroOneOptimizer", "zero_partition"]
