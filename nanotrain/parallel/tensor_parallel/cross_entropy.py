"""Cross-entropy over vocab-parallel logits, without ever materialising the full vocabulary.

Each tp rank holds logits for its contiguous block of the (padded) vocabulary, [S, B, Vpad/tp].
The loss needs only three per-token scalars that reduce over the vocabulary: the max (for
stability), the sum of exponentials and the target's logit. So the forward costs two small
collectives on [S, B]: an all-reduce MAX, then ONE all-reduce SUM of the stacked (sum-exp,
target-logit) pair (fused because on gloo a collective's latency, not its size, dominates).
The backward needs no communication: d loss / d logits = softmax - onehot(target), and each rank
owns its columns of both.

Padded vocabulary columns (global index >= vocab_size; they exist when the vocab is not divisible
by tp) are filled with -inf before the max, so they add nothing to the loss and get a zero
gradient whatever the LM head wrote there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanotrain.parallel import collectives
from nanotrain.parallel.tensor_parallel.functional import group_rank, group_size


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index):
        tp, rank = group_size(group), group_rank(group)
        v_local = logits.shape[-1]
        start = rank * v_local
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # >= fp32 math; a copy we may overwrite
        if x is logits:  # .to() returns the tensor itself when nothing changes
            x = x.clone()
        real = max(0, min(v_local, vocab_size - start))  # this rank's real (unpadded) columns
        if real < v_local:
            x[..., real:] = float("-inf")

        local_max = x.max(dim=-1).values
        if tp > 1:
            collectives.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group, what="tp all_reduce logits max")
        x.sub_(local_max.unsqueeze(-1))  # every real logit <= 0 now: exp cannot overflow

        ignored = targets == ignore_index
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < real) & ~ignored
        local_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(mine, target_logit, torch.zeros_like(target_logit))

        x.exp_()
        stats = torch.stack([x.sum(dim=-1), target_logit])
        if tp > 1:
            collectives.all_reduce(stats, op=dist.ReduceOp.SUM, group=group, what="tp all_reduce loss")
        sum_exp, target_logit = stats[0], stats[1]

        loss = torch.log(sum_exp) - target_logit
        loss = torch.where(ignored, torch.zeros_like(loss), loss)
        x.div_(sum_exp.unsqueeze(-1))  # softmax over the full vocabulary, this rank's columns
        ctx.save_for_backward(x, local_t, mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        grad = softmax.clone() if ctx.needs_input_grad[0] else None
        if grad is None:
            return None, None, None, None, None
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        scale = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss)
        scale = scale.to(torch.promote_types(grad_loss.dtype, torch.float32))
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def sharded_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token loss [S, B] (fp32) of vocab-parallel logits [S, B, Vpad/tp] and full targets [S, B].

    Rank r holds global vocabulary columns [r * Vpad/tp, (r + 1) * Vpad/tp); columns >= vocab_size
    are padding and are ignored. Tokens whose target is `ignore_index` get loss 0 and no gradient
    (as F.cross_entropy(..., reduction="none")). Equal to F.cross_entropy on the full logits.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree "
            f"on the token dims (logits must be [S, B, Vpad/tp], targets [S, B])"
        )
    tp = group_size(group)
    padded = logits.shape[-1] * tp
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} does not fit the {padded} vocab-parallel columns")
    if tp == 1:  # the whole vocabulary is here: torch's fused kernel (same math, fewer ops)
        wide = logits[..., :vocab_size].to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(
            wide.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=ignore_index, reduction="none"
        ).view(targets.shape)
    return _ShardedCrossEntropy.apply(logits, targets, group, vocab_size, ignore_index)
