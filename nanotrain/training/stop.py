"""The per-step agreement of all ranks: stop now (and why), or the numbers went non-finite.

Why one collective for both: a stop signal reaches only some ranks, and a NaN loss is seen first
on the last pipeline stage, yet every rank must take the same branch at the same step (save
together, or stop without saving) or the others wait forever in the next collective. One
all-reduce (MAX) of two numbers per step settles both, at the cost the stop flag alone had.

A non-finite loss or gradient norm stops the run *before* the step's checkpoint could be
written: the weights after such a step are already poisoned (AdamW has applied the NaN
gradient), so saving them would overwrite the last finite checkpoint with garbage that every
resume then loads (issue 17, item 4).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became non-finite at `step`; nothing was saved after it."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"training diverged at step {step}: loss {loss:g}, grad norm {grad_norm:g} "
                         "(not finite); stopped without saving this step")


def agree_on_stop(stop_code: int, loss: float, grad_norm: float, device=None, group=None) -> tuple[int, bool]:
    """(the strongest stop code any rank holds, whether any rank saw a non-finite loss/grad norm)."""
    nonfinite = not (math.isfinite(loss) and math.isfinite(grad_norm))
    flags = torch.tensor([float(stop_code), 1.0 if nonfinite else 0.0], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    code, bad = flags.tolist()
    return int(code), bad > 0
