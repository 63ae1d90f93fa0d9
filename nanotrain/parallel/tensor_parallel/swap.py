"""Plain modules -> tensor-parallel ones with the same full shapes (a parallelize plan's tools).

Each function takes a plain module (``nn.Linear``, an embedding with a ``weight``) and returns the
tensor-parallel module standing for it on this rank, on the same device (the meta device while a
model is being cut: values come later, from the seeded initializer or a checkpoint).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from nanotrain.parallel.tensor_parallel.cross_entropy import sharded_cross_entropy
from nanotrain.parallel.tensor_parallel.functional import TensorParallelLinearMode
from nanotrain.parallel.tensor_parallel.layers import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
    mark_sequence_parallel_partial_grad_,
)


def column_parallel(
    linear: nn.Linear,
    pg,
    mode: TensorParallelLinearMode,
    async_communication: bool = False,
    chunks: Optional[Sequence[int]] = None,
    pad_to_tp: bool = False,
) -> TensorParallelColumnLinear:
    """``linear`` with its output features (rows) split over ``pg``, chunk by chunk for a fused
    projection (``chunks``: e.g. the q, k, v output sizes)."""
    return TensorParallelColumnLinear(
        linear.in_features,
        linear.out_features,
        pg,
        mode,
        bias=linear.bias is not None,
        async_communication=async_communication,
        contiguous_chunks=chunks,
        pad_to_tp=pad_to_tp,
        device=linear.weight.device,
    )


def row_parallel(
    linear: nn.Linear, pg, mode: TensorParallelLinearMode, async_communication: bool = False
) -> TensorParallelRowLinear:
    """``linear`` with its input features (columns) split over ``pg``."""
    return TensorParallelRowLinear(
        linear.in_features,
        linear.out_features,
        pg,
        mode,
        bias=linear.bias is not None,
        async_communication=async_communication,
        device=linear.weight.device,
    )


def vocab_parallel_embedding(embedding: nn.Module, pg, mode: TensorParallelLinearMode) -> TensorParallelEmbedding:
    """An embedding (``weight`` ``[V, H]``) with its rows split over ``pg`` (padded to a multiple of tp)."""
    vocab, hidden = embedding.weight.shape
    return TensorParallelEmbedding(vocab, hidden, pg, mode, device=embedding.weight.device)


class VocabParallelCrossEntropy(nn.Module):
    """Per-token loss ``[S, B]`` of vocab-parallel logits ``[S, B, Vpad/tp]`` (``sharded_cross_entropy``)."""

    def __init__(self, pg, vocab_size: int):
        super().__init__()
        self.pg, self.vocab_size = pg, vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return sharded_cross_entropy(logits, targets, self.pg, self.vocab_size)


def mark_sequence_parallel_(params: Iterable[torch.Tensor]) -> None:
    """Mark replicated parameters whose tp ranks each hold a partial gradient (sequence shards,
    or heads split over tp): their gradients are summed over tp."""
    for param in params:
        mark_sequence_parallel_partial_grad_(param)
