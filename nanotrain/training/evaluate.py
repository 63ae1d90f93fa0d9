"""Forward-only evaluation on the validation stream: `val/loss` and `val/ppl`.

Every evaluation reads the same windows: global validation samples [0, eval_batches * G) with
G = dp * m * micro_batch_size, split over dp ranks exactly like a training step, so the mean
token loss is the same number at every (dp, tp, pp, cp) that keeps G. Nothing of the training
state is touched: no gradients (`no_grad`, and the pipeline's forward-only schedule), no RNG
draws (the model has no dropout), and the training sampler's position is not read or moved, so
a run with evaluation on has the same `train/loss` sequence as one without.
"""

from __future__ import annotations

import math

import torch

from nanotrain.training.step import micro_loss, reduce_loss


@torch.no_grad()
def evaluate(
    model, batches, pc, num_batches: int, global_batch: int, m: int, engine=None, message=None
) -> torch.Tensor:
    """The mean validation loss over `num_batches` global batches, as a float64 0-d tensor on
    every rank. `batches`: a `BatchPrefetcher` over the validation sampler (None on middle
    pipeline stages, which read no data unless document masking hands them document ids)."""
    total = torch.zeros((), dtype=torch.float64, device=pc.device)
    for b in range(num_batches):
        micro = batches.get(b * global_batch) if batches is not None else [None] * m
        if pc.pp_size > 1:
            loss = engine.forward_only(model, micro, message)
        else:
            loss = sum(micro_loss(model, mb) for mb in micro) / m
        total = total + reduce_loss(loss, pc).to(torch.float64)
    return total / num_batches


def perplexity(loss: float) -> float:
    """exp(loss), capped where exp would overflow (a diverged model)."""
    return math.exp(min(loss, 700.0))
