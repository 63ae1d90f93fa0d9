"""Tensor-parallel modules: column linear, row linear, vocab-parallel embedding.

Every parameter carries a ShardInfo (nanotrain.parallel.sharding) saying which slices of the full
tensor this rank holds, so checkpointing, resharding and initialisation need no knowledge of these
classes. Parameters start as zeros (padding rows must be zero, and zeros are deterministic); the
model fills the real pieces from the full tensor (`init.init_from_full_`), so a tp=4 model equals
the tp=1 model at step 0.

Padding: a vocabulary (embedding rows, LM-head outputs) that tp does not divide is padded up to a
multiple of tp. The padded rows are zero, are not listed in the ShardInfo (a checkpoint never sees
them, and another tp re-pads as it needs), receive no gradient from the embedding and, through
`sharded_cross_entropy`'s masking, none from the LM head either.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.parallel.collectives import allreduce_flat_
from nanotrain.parallel.sharding import replicated_info, row_shard_info, set_shard_info
from nanotrain.parallel.tensor_parallel.functional import (
    TensorParallelLinearMode,
    as_mode,
    column_linear,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_along_dim0,
    row_linear,
    to_compute_dtype,
)

_SP_PARTIAL = "_nanotrain_sequence_parallel_partial_grad"


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))


# ----------------------------------------------------------------------------- sequence parallel
def mark_sequence_parallel_partial_grad_(param: torch.Tensor) -> None:
    """Mark a replicated parameter whose gradient on each tp rank is a partial sum: one that acts
    on sequence shards (REDUCE_SCATTER: each rank's gradient covers only its own tokens; norm
    weights under sequence parallelism, Megatron's `sequence_parallel` attribute), or one shared
    by heads split over tp (a per-head q/k norm, in either mode). The true gradient is the sum
    over tp, taken once however many reasons apply (the mark is a flag)."""
    setattr(param, _SP_PARTIAL, True)


def has_sequence_parallel_partial_grad(param: torch.Tensor) -> bool:
    return bool(getattr(param, _SP_PARTIAL, False))


def allreduce_sequence_parallel_grads_(params: Iterable[torch.Tensor], group, grad_of=None) -> None:
    """Sum the gradients of the marked parameters over tp, in one flat all-reduce.

    Call after the backward of the last micro-batch, before clipping and the optimizer step.
    ``grad_of(p)``: the tensor holding ``p``'s gradient instead of ``p.grad`` (ZeRO-2: the owned
    piece; tp ranks have the same bucket layout, so they own the same ranges).
    """
    grad_of = grad_of or (lambda p: p.grad)
    grads = [g for p in params if has_sequence_parallel_partial_grad(p) for g in [grad_of(p)] if g is not None]
    if group_size(group) > 1:
        allreduce_flat_(grads, group)


# ----------------------------------------------------------------------------- linears
class TensorParallelColumnLinear(nn.Module):
    """Linear whose output features are split over tp: weight [out/tp, in], output [S, B, out/tp].

    Input [S, B, in] (ALL_REDUCE) or [S/tp, B, in] (REDUCE_SCATTER: gathered inside).
    `contiguous_chunks` splits a fused projection chunk by chunk, e.g. (q, k, v) output sizes:
    each rank then holds [q_shard; k_shard; v_shard], so a local split by the chunk sizes / tp
    gives this rank's heads of each. `pad_to_tp` pads out_features up to a multiple of tp (an LM
    head over a vocabulary tp does not divide); padded outputs come from zero rows.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        pg,
        mode,
        bias: bool = False,
        async_communication: bool = False,
        contiguous_chunks: Optional[Sequence[int]] = None,
        pad_to_tp: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.pg, self.mode, self.async_communication = pg, as_mode(mode), async_communication
        tp, rank = group_size(pg), group_rank(pg)
        self.tp, self.tp_rank = tp, rank
        chunks = tuple(contiguous_chunks) if contiguous_chunks is not None else (out_features,)
        if sum(chunks) != out_features:
            raise ValueError(f"contiguous_chunks {chunks} must sum to out_features={out_features}")
        if pad_to_tp:
            if len(chunks) > 1:
                raise ValueError("pad_to_tp pads a single output block; it cannot be combined with contiguous_chunks")
            padded_chunks = (_ceil_to(out_features, tp),)
        else:
            bad = [c for c in chunks if c % tp]
            if bad:
                raise ValueError(
                    f"output chunk(s) {bad} of {chunks} not divisible by tp={tp}; "
                    f"pass pad_to_tp=True for a vocabulary-sized output"
                )
            padded_chunks = chunks
        self.in_features, self.out_features = in_features, out_features
        self.padded_out_features = sum(padded_chunks)
        self.contiguous_chunks = chunks
        self.local_out_features = self.padded_out_features // tp
        self.weight = _param((self.local_out_features, in_features), device, dtype)
        set_shard_info(
            self.weight,
            row_shard_info((self.padded_out_features, in_features), 0, padded_chunks, rank, tp, real_sizes=chunks),
        )
        if bias:
            self.bias = _param((self.local_out_features,), device, dtype)
            set_shard_info(
                self.bias, row_shard_info((self.padded_out_features,), 0, padded_chunks, rank, tp, real_sizes=chunks)
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.bias, self.pg, self.mode, self.async_communication)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(padded {self.padded_out_features}, local {self.local_out_features}), "
            f"chunks={self.contiguous_chunks}, tp={self.tp}, mode={self.mode.value}, "
            f"async={self.async_communication}, bias={self.bias is not None}"
        )


class TensorParallelRowLinear(nn.Module):
    """Linear whose input features are split over tp: weight [out, in/tp], input [S, B, in/tp].

    Output [S, B, out] all-reduced (ALL_REDUCE) or [S/tp, B, out] reduce-scattered
    (REDUCE_SCATTER). The optional bias is replicated and added once, after the reduction; under
    REDUCE_SCATTER it is marked as having a partial (per-token-shard) gradient.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        pg,
        mode,
        bias: bool = False,
        async_communication: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.pg, self.mode, self.async_communication = pg, as_mode(mode), async_communication
        tp, rank = group_size(pg), group_rank(pg)
        self.tp, self.tp_rank = tp, rank
        if in_features % tp:
            raise ValueError(f"in_features={in_features} not divisible by tp={tp}")
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features = in_features // tp
        self.weight = _param((out_features, self.local_in_features), device, dtype)
        set_shard_info(self.weight, row_shard_info((out_features, in_features), 1, (in_features,), rank, tp))
        if bias:
            self.bias = _param((out_features,), device, dtype)
            set_shard_info(self.bias, replicated_info((out_features,)))
            if self.mode is TensorParallelLinearMode.REDUCE_SCATTER and tp > 1:
                mark_sequence_parallel_partial_grad_(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self.weight, self.bias, self.pg, self.mode, self.async_communication)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.local_in_features}), "
            f"out_features={self.out_features}, tp={self.tp}, mode={self.mode.value}, "
            f"async={self.async_communication}, bias={self.bias is not None}"
        )


# ----------------------------------------------------------------------------- embedding
class TensorParallelEmbedding(nn.Module):
    """Vocab-parallel embedding: rank r holds rows [vocab_start, vocab_end) of the padded table.

    Input ids [S, B], full on every tp rank. Each rank looks up the ids it owns (others give
    zeros) and the partial results are summed: [S, B, H] all-reduced (ALL_REDUCE) or
    [S/tp, B, H] reduce-scattered (REDUCE_SCATTER), which also lands the activations already
    sequence-sharded for the first block. Its weight [Vpad/tp, H] doubles as the tied LM head's
    column-linear weight (`column_linear(x, emb.weight, None, ...)`).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, pg, mode, device=None, dtype=None):
        super().__init__()
        self.pg, self.mode = pg, as_mode(mode)
        tp, rank = group_size(pg), group_rank(pg)
        self.tp, self.tp_rank = tp, rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = _ceil_to(num_embeddings, tp)
        rows = self.padded_num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * rows, (rank + 1) * rows
        self.weight = _param((rows, embedding_dim), device, dtype)
        set_shard_info(
            self.weight,
            row_shard_info(
                (self.padded_num_embeddings, embedding_dim),
                0,
                (self.padded_num_embeddings,),
                rank,
                tp,
                real_sizes=(num_embeddings,),
            ),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Under autocast the result is in the compute dtype (an fp32 table stays fp32): the
        residual stream starts in bf16 and the partial lookups are reduced in bf16."""
        if self.tp == 1:
            return to_compute_dtype(F.embedding(ids, self.weight))
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
        out = to_compute_dtype(F.embedding(local, self.weight))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.mode is TensorParallelLinearMode.ALL_REDUCE:
            return reduce_from_tp(out, self.pg)
        return reduce_scatter_along_dim0(out, self.pg)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_num_embeddings}, rows "
            f"[{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}, tp={self.tp}, "
            f"mode={self.mode.value}"
        )
