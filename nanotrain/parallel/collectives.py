"""Collective helpers every parallel module shares (one definition each).

* ``all_gather_into`` / ``reduce_scatter_into``: torch 2.13 deprecates all_gather_into_tensor
  and reduce_scatter_tensor (a FutureWarning on every call) for the ``*_single`` names, which
  older torch lacks: take whichever exists, looked up per call so a wrapper around
  torch.distributed (the tests' device contract) sees every collective.
* ``all_to_all``: differentiable ``all_to_all_single`` with variable splits (expert parallelism);
  its backward is the reverse exchange. gloo on torch 2.13 implements it (checked), as NCCL does,
  so no fallback is needed.
* ``allreduce_flat_``: sum many small tensors over a group in ONE collective (on gloo and NCCL
  a collective's latency, not its size, dominates small messages), in place.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` = every rank's ``inp`` concatenated along dim 0, in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` = this rank's dim-0 block of the sum of every rank's ``inp``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def allreduce_flat_(tensors: Sequence[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place, through one flat buffer (one collective)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x`` [sum(in_splits), ...]: ``in_splits[r]`` go to rank r of ``group``; returns
    [sum(out_splits), ...], ``out_splits[r]`` rows from rank r, in rank order. Differentiable."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)
