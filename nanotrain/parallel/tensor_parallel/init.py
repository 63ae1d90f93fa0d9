"""Initialise sharded parameters from the full tensor, so every tp size starts from the same model.

Why from the full tensor: drawing each shard from its own generator makes the model depend on tp
(tp=4 would not equal tp=1 at step 0, and a loss-equality test across topologies could not pass).
Drawing the whole unsharded tensor from a generator seeded identically on every rank, then keeping
only this rank's pieces (the ShardInfo pairs), gives every topology bit-identical weights. The cost
is one full-size temporary per parameter at init, which is fine: the largest (embedding / LM head)
is far smaller than the optimizer states every rank keeps anyway.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from nanotrain.parallel.sharding import copy_from_full_, get_shard_info


def init_from_full_(
    param: torch.Tensor, fill_fn: Callable[[torch.Tensor], object], dtype: Optional[torch.dtype] = None
) -> None:
    """Build the unsharded tensor, let `fill_fn(full)` fill it in place, copy this rank's pieces.

    Padding rows (not in the ShardInfo) are zeroed. `fill_fn` must be deterministic across ranks,
    e.g. `lambda t: t.normal_(0, std, generator=g)` with `g` seeded identically everywhere.
    `dtype` (default fp32) is the dtype of the temporary, so a bf16 model gets the rounding of
    fp32 draws rather than bf16 sampling.
    """
    info = get_shard_info(param)
    full = torch.empty(info.global_shape, dtype=dtype or torch.float32, device="cpu")
    fill_fn(full)
    with torch.no_grad():
        param.zero_()
        copy_from_full_(param, full.to(device=param.device, dtype=param.dtype))
