"""Tensor parallelism (Megatron/nanotron style) on plain tensors and process groups.

Activations are sequence-first [S, B, H]. `functional` holds the differentiable collectives and
the fused column/row linears (also used by the tied LM head), `layers` the modules whose
parameters carry ShardInfo, `cross_entropy` the vocab-parallel loss, `init` the full-tensor
initialiser that makes every tp size start from the same weights.
"""

from nanotrain.parallel.tensor_parallel.cross_entropy import sharded_cross_entropy
from nanotrain.parallel.tensor_parallel.functional import (
    TensorParallelLinearMode,
    as_mode,
    column_linear,
    copy_to_tp,
    gather_along_dim0,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_along_dim0,
    row_linear,
)
from nanotrain.parallel.tensor_parallel.init import init_from_full_
from nanotrain.parallel.tensor_parallel.layers import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
    allreduce_sequence_parallel_grads_,
    has_sequence_parallel_partial_grad,
    mark_sequence_parallel_partial_grad_,
)

__all__ = [
    "TensorParallelLinearMode",
    "as_mode",
    "group_size",
    "group_rank",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_along_dim0",
    "reduce_scatter_along_dim0",
    "column_linear",
    "row_linear",
    "sharded_cross_entropy",
    "TensorParallelColumnLinear",
    "TensorParallelRowLinear",
    "TensorParallelEmbedding",
    "mark_sequence_parallel_partial_grad_",
    "has_sequence_parallel_partial_grad",
    "allreduce_sequence_parallel_grads_",
    "init_from_full_",
]
