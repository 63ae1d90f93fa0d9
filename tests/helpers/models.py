"""The tiny models, batches and gradient gathering that several parallel test files share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.config import ModelArgs, OptimizerArgs
from nanotrain.parallel.sharding import get_shard_info


def full_grad(param: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """The full (unsharded) gradient of a tp-sharded or sequence-parallel parameter, on every tp rank."""
    info = get_shard_info(param)
    full = torch.zeros(info.global_shape)
    for local, global_ in info.pairs:
        full[global_] = param.grad[local]
    if info.is_sharded or sequence_parallel:  # disjoint pieces, or partial sums over sequence shards
        dist.all_reduce(full, group=tp_group)
    return full


# ----------------------------------------------------------------------------- dp x tp training
# The setup of test_training_dp_tp, which test_checkpoint trains and saves too.
MODEL = ModelArgs(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    dtype="float32",
)
# clip_grad is low enough that clipping triggers on most steps: it must trigger identically.
OPTIM = OptimizerArgs(lr=3e-3, weight_decay=0.1, warmup_steps=3, min_lr=3e-4, clip_grad=0.5)
STEPS, SEQ, MICRO_BATCH, GLOBAL_BATCH = 10, 16, 2, 8


def global_batch(step: int) -> torch.Tensor:
    """Samples of one step: [GLOBAL_BATCH, SEQ + 1] tokens, identical for every topology.
    Arithmetic sequences (random start and stride) so that 10 steps visibly learn something."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % MODEL.vocab_size
