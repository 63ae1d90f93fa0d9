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
* ``all_reduce``, ``broadcast``, ``all_gather``, ``gather``, ``all_to_all_single``,
  ``batch_isend_irecv``: the plain torch.distributed calls, each first telling the hang record
  (``hang_record.py``) which collective on which group this rank enters. Every collective of
  training passes here, so a hang report names the one a rank waits in; one attribute write
  each, no cost.
* ``wait``: a work handle's ``wait()``. It and every synchronous call above are timed as this
  rank's time blocked on its peers (``wait_clock.py``) while the trainer holds a step window
  open, so the straggler metric compares what each rank does outside those waits.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.observe.wait_clock import WAITS


def _blocking(fn, *args, async_op: bool = False, **kwargs):
    """``fn(*args, **kwargs)``; timed as a wait on the peers unless it only posts (``async_op``:
    its handle's ``wait`` is timed instead)."""
    if async_op:
        return fn(*args, async_op=True, **kwargs)
    timer = WAITS.start()
    try:
        return fn(*args, **kwargs)
    finally:
        WAITS.stop(timer)


def wait(work) -> None:
    """``work.wait()`` of an asynchronous collective or send/receive, timed as a wait."""
    timer = WAITS.start()
    try:
        work.wait()
    finally:
        WAITS.stop(timer)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` = every rank's ``inp`` concatenated along dim 0, in rank order."""
    HANG_RECORD.entering("all_gather", group)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _blocking(fn, out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out`` = this rank's dim-0 block of the sum of every rank's ``inp``."""
    HANG_RECORD.entering("reduce_scatter", group)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _blocking(fn, out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def allreduce_flat_(tensors: Sequence[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place, through one flat buffer (one collective)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce(
    tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False, what: str = "all_reduce"
):
    """``dist.all_reduce``; ``what`` names it in hang reports (e.g. "all_reduce grad bucket")."""
    HANG_RECORD.entering(what, group)
    return _blocking(dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor, src: int | None = None, group=None, group_src: int | None = None, what: str = "broadcast"
):
    """``dist.broadcast`` from global rank ``src``, or from ``group_src``, a rank within ``group``.
    torch < 2.6 has no ``group_src`` keyword, so it is turned into the global rank here
    (``get_global_rank``, which torch 2.4 has) and torch only ever sees ``src``."""
    HANG_RECORD.entering(what, group)
    if group_src is not None:
        src = group_src if group is None else dist.get_global_rank(group, group_src)
    return _blocking(dist.broadcast, tensor, src=src, group=group)


def all_gather(out: list, tensor: torch.Tensor, group=None, what: str = "all_gather"):
    HANG_RECORD.entering(what, group)
    return _blocking(dist.all_gather, out, tensor, group=group)


def gather(tensor: torch.Tensor, out, dst: int, group=None, what: str = "gather"):
    HANG_RECORD.entering(what, group)
    return _blocking(dist.gather, tensor, out, dst=dst, group=group)


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    group=None,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    what: str = "all_to_all",
):
    """``dist.all_to_all_single`` (equal splits when none are given)."""
    HANG_RECORD.entering(what, group)
    return _blocking(dist.all_to_all_single, out, inp, out_splits, in_splits, group=group)


def batch_isend_irecv(ops: list, what: str, group=None):
    """``dist.batch_isend_irecv``; ``what`` says which sends/receives (pipeline messages)."""
    HANG_RECORD.entering(what, group)
    return dist.batch_isend_irecv(ops)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        all_to_all_single(out, x, group, out_splits, in_splits, what="all_to_all experts")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x`` [sum(in_splits), ...]: ``in_splits[r]`` go to rank r of ``group``; returns
    [sum(out_splits), ...], ``out_splits[r]`` rows from rank r, in rank order. Differentiable."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)
