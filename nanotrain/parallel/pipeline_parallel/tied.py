"""Parameters tied across pipeline stages: the input embedding and the LM head.

With ``tie_word_embeddings`` the LM head multiplies by the embedding matrix. Under pp the
embedding lives on the first stage and the head on the last, so the last stage holds a *replica*
of ``embed.weight``: same name, same shard layout, initialised from the same seed. The true
gradient of the tied matrix is the sum of the embedding's and the head's contributions, so after
backward both copies get that sum (one all-reduce over ``pc.embedding_pg``, the {first, last}
stage ranks of one (dp, cp, tp) coordinate) and then step identically: they never diverge beyond
rounding. The replica is marked, so that the gradient norm (``optim/clip.py``) and checkpoints
count the tied matrix once — a known nanotron failure point is counting it twice.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from nanotrain.parallel.collectives import allreduce_flat_

_TIED = "_nanotrain_tied"  # on both copies: the name of the tied parameter
_REPLICA = "_nanotrain_tied_replica"  # on the copy that is not the original


def mark_tied_(param: torch.Tensor, name: str, replica: bool) -> None:
    setattr(param, _TIED, name)
    setattr(param, _REPLICA, replica)


def is_tied(param: torch.Tensor) -> bool:
    return getattr(param, _TIED, None) is not None


def is_tied_replica(param: torch.Tensor) -> bool:
    """True for a copy that only mirrors a parameter owned by another stage (skip it when
    counting or saving parameters)."""
    return bool(getattr(param, _REPLICA, False))


def allreduce_tied_grads_(params: Iterable[torch.Tensor], group, grad_of=None) -> None:
    """Sum the gradients of the tied copies over ``group`` (one flat all-reduce). Ranks without
    tied parameters (middle stages) must not call it; a missing gradient counts as zero.
    ``grad_of(p)``: the tensor holding ``p``'s gradient instead of ``p.grad`` (ZeRO-2: the owned
    piece, the same range on both stages since a tied parameter has a bucket of its own)."""
    params = sorted((p for p in params if is_tied(p)), key=lambda p: getattr(p, _TIED))
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    if grad_of is not None and any(grad_of(p) is not p.grad for p in params):
        allreduce_flat_([t for t in map(grad_of, params) if t is not None], group)
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    allreduce_flat_([p.grad for p in params], group)
