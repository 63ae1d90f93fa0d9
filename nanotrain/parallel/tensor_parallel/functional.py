"""Differentiable tensor-parallel collectives and the fused column/row linear functions.

Activations are sequence-first, [S, B, H] (as in nanotron and Megatron), so a sequence shard is a
contiguous block along dim 0 and every gather/scatter is one flat collective with no copies.

Two modes, named as in the config (`parallelism.tp_mode`):

* ALL_REDUCE: activations between TP blocks are full and replicated on every tp rank. A column
  linear takes the full input (backward: all-reduce of the input gradient); a row linear all-reduces
  its partial output (backward: identity).
* REDUCE_SCATTER (sequence parallel): activations between TP blocks are sequence shards
  [S/tp, B, H]. A column linear all-gathers its input first (backward: reduce-scatter); a row
  linear reduce-scatters its partial output (backward: all-gather). Same bytes on the wire as
  ALL_REDUCE (an all-reduce is a reduce-scatter + all-gather), but norms, residuals and dropout
  then run on 1/tp of the tokens and activation memory shrinks by tp.

`async_communication=True` launches the collectives with `async_op=True` and computes something
useful while they are in flight (works on gloo, whose collectives run on a background thread):

* column backward (both modes): the input-gradient all-reduce / reduce-scatter overlaps the
  weight-gradient matmul;
* column forward (REDUCE_SCATTER): the input all-gather overlaps the matmul of this rank's own
  sequence shard; the other shards are multiplied once the gather lands (nanotron's split);
* row backward (REDUCE_SCATTER): the output-gradient all-gather overlaps this rank's own-shard
  parts of the input- and weight-gradient matmuls.
The row forward and the ALL_REDUCE row backward have nothing to overlap (the output needs the
reduction; the backward needs no communication), so they take the synchronous path.

With a group of size 1 everything short-circuits to the plain local op: no collective is issued.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanotrain.parallel import accelerator, collectives
from nanotrain.parallel.collectives import all_gather_into, reduce_scatter_into


# ----------------------------------------------------------------------------- autocast
def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The lower-precision dtype autocast computes linears in here, or None outside autocast."""
    return accelerator.autocast_dtype(x.device.type)


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Cast an activation to autocast's dtype before it is communicated: the linear it feeds
    would cast it anyway, and this way the collective moves bf16 (half the bytes of fp32)."""
    dtype = autocast_dtype(x)
    return x if dtype is None or not x.is_floating_point() or x.dtype == dtype else x.to(dtype)


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = "ALL_REDUCE"
    REDUCE_SCATTER = "REDUCE_SCATTER"


def as_mode(mode) -> TensorParallelLinearMode:
    """Accept the enum or its config string (case-insensitive)."""
    if isinstance(mode, TensorParallelLinearMode):
        return mode
    try:
        return TensorParallelLinearMode(str(mode).upper())
    except ValueError:
        valid = [m.value for m in TensorParallelLinearMode]
        raise ValueError(f"unknown tp mode {mode!r}; expected one of {valid}") from None


# ----------------------------------------------------------------------------- group helpers
def group_size(group) -> int:
    """Size of `group`; 1 when torch.distributed is not initialised (single-process use)."""
    if group is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return group.size()


def group_rank(group) -> int:
    """This process's rank inside `group` (not its global rank)."""
    if group is None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return group.rank()


def _check_seq(x: torch.Tensor, tp: int, what: str) -> None:
    if x.dim() == 0 or x.shape[0] % tp:
        raise ValueError(
            f"{what}: dim 0 (sequence) of shape {tuple(x.shape)} must be divisible by tp={tp} "
            f"(sequence_length must be divisible by tp under REDUCE_SCATTER)"
        )


def _all_gather_dim0(x: torch.Tensor, group, async_op: bool = False):
    """[s, ...] on each rank -> [s * tp, ...] in rank order; returns (output, work or None)."""
    x = x.contiguous()
    out = torch.empty((x.shape[0] * group_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_into(out, x, group=group, async_op=async_op)
    return out, work


def _reduce_scatter_dim0(x: torch.Tensor, group, async_op: bool = False):
    """[S, ...] partial sums -> this rank's [S / tp, ...] block of the sum; (output, work or None)."""
    tp = group_size(group)
    _check_seq(x, tp, "reduce-scatter")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // tp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = reduce_scatter_into(out, x, group=group, async_op=async_op)
    return out, work


def _all_reduce(x: torch.Tensor, group, async_op: bool = False):
    """Sum over the group into a fresh tensor (never in place on an autograd input)."""
    out = x.clone(memory_format=torch.contiguous_format)
    return out, collectives.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=async_op, what="tp all_reduce")


# ----------------------------------------------------------------------------- primitives
class _CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce: the entry of a replicated input into a column
    layer, whose input gradient is the sum of every rank's partial contribution."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group)[0], None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce, backward identity: the exit of a row layer under ALL_REDUCE."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlongDim0(torch.autograd.Function):
    """Forward all-gather of sequence shards, backward reduce-scatter: every rank used the full
    tensor, so each shard's gradient is the sum of all ranks' gradients for that block."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group)[0], None


class _ReduceScatterAlongDim0(torch.autograd.Function):
    """Forward reduce-scatter of partial sums, backward all-gather: the exit of a row layer (or
    the vocab-parallel embedding) under REDUCE_SCATTER."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group)[0], None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_along_dim0(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherAlongDim0.apply(x, group)


def reduce_scatter_along_dim0(x: torch.Tensor, group) -> torch.Tensor:
    tp = group_size(group)
    if tp == 1:
        return x
    _check_seq(x, tp, "reduce_scatter_along_dim0")
    return _ReduceScatterAlongDim0.apply(x, group)


# ----------------------------------------------------------------------------- async linears
def _mm2d(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(-1, a.shape[-1])


class _ColumnLinearAsync(torch.autograd.Function):
    """Column linear with communication overlapped (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, mode):
        # Autocast does not reach inside a custom Function's backward, so the casts it would do
        # are done here, once: x, weight and bias in the compute dtype, the same tensors saved
        # for backward, and gradients handed back in each input's own dtype (fp32 weights keep
        # fp32 gradients). As torch.amp.custom_fwd(cast_inputs=...) does, for any device.
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        dtype = autocast_dtype(x)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with accelerator.autocast(x.device.type, enabled=False):
            return _ColumnLinearAsync._forward(ctx, x, weight, bias, group, mode)

    @staticmethod
    def _forward(ctx, x, weight, bias, group, mode):
        ctx.group, ctx.mode, ctx.has_bias = group, mode, bias is not None
        if mode is TensorParallelLinearMode.ALL_REDUCE:
            ctx.save_for_backward(x, weight)
            return F.linear(x, weight, bias)
        tp, rank = group_size(group), group_rank(group)
        x = x.contiguous()
        s = x.shape[0]
        x_full, work = _all_gather_dim0(x, group, async_op=True)
        out = torch.empty((s * tp, *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        out[rank * s : (rank + 1) * s] = F.linear(x, weight, bias)  # own shard, while gathering
        collectives.wait(work)
        if rank > 0:
            out[: rank * s] = F.linear(x_full[: rank * s], weight, bias)
        if rank < tp - 1:
            out[(rank + 1) * s :] = F.linear(x_full[(rank + 1) * s :], weight, bias)
        ctx.save_for_backward(x_full, weight)  # the gathered input: the weight grad needs it
        return out

    @staticmethod
    def backward(ctx, grad):
        x_full, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype).contiguous()  # the compute dtype of the forward
        grad_x = grad_w = grad_b = work = None
        if ctx.needs_input_grad[0]:
            partial = grad.matmul(weight)  # this rank's contribution to the full input grad
            if ctx.mode is TensorParallelLinearMode.ALL_REDUCE:
                grad_x, work = (
                    partial,
                    collectives.all_reduce(partial, group=ctx.group, async_op=True, what="tp all_reduce (backward)"),
                )
            else:
                grad_x, work = _reduce_scatter_dim0(partial, ctx.group, async_op=True)
        g2 = _mm2d(grad)
        if ctx.needs_input_grad[1]:
            grad_w = g2.t().mm(_mm2d(x_full))  # computed while the input grad is on the wire
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        if work is not None:
            collectives.wait(work)
        return (*_in_dtypes((grad_x, grad_w, grad_b), ctx.dtypes), None, None)


class _RowLinearAsyncReduceScatter(torch.autograd.Function):
    """Row linear under REDUCE_SCATTER whose backward overlaps the gradient all-gather with the
    own-shard parts of the input/weight-gradient matmuls (the bias is added by the caller)."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group, ctx.dtypes = group, (x.dtype, weight.dtype)
        dtype = autocast_dtype(x)  # autocast's casts, done by hand (see _ColumnLinearAsync)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        with accelerator.autocast(x.device.type, enabled=False):
            return _reduce_scatter_dim0(F.linear(x, weight), group)[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp, rank = group_size(ctx.group), group_rank(ctx.group)
        grad = grad.to(weight.dtype).contiguous()
        s = grad.shape[0]
        g_full, work = _all_gather_dim0(grad, ctx.group, async_op=True)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        own = slice(rank * s, (rank + 1) * s)
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None
        if need_x:
            grad_x[own] = grad.matmul(weight)
        grad_w = _mm2d(grad).t().mm(_mm2d(x[own])) if need_w else None
        collectives.wait(work)
        for part in (slice(0, rank * s), slice((rank + 1) * s, tp * s)):
            if part.stop <= part.start:
                continue
            if need_x:
                grad_x[part] = g_full[part].matmul(weight)
            if need_w:
                grad_w.addmm_(_mm2d(g_full[part]).t(), _mm2d(x[part]))
        return (*_in_dtypes((grad_x, grad_w), ctx.dtypes), None)


def _in_dtypes(grads, dtypes) -> tuple:
    """Each gradient in the dtype of the input it belongs to (None stays None)."""
    return tuple(None if g is None else g.to(d) for g, d in zip(grads, dtypes))


# ----------------------------------------------------------------------------- fused linears
def column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group, mode, async_communication: bool = False
) -> torch.Tensor:
    """y = x W^T + b with W split by output rows over `group`.

    x: [S, B, in] (ALL_REDUCE, full and replicated) or [S/tp, B, in] (REDUCE_SCATTER, this rank's
    sequence shard); weight: [out/tp, in] (this rank's rows); bias: [out/tp] or None.
    Returns [S, B, out/tp]. Also the tied LM head: pass the vocab-parallel embedding's weight.
    """
    mode = as_mode(mode)
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    if async_communication:
        return _ColumnLinearAsync.apply(x, weight, bias, group, mode)
    x = to_compute_dtype(x)  # gathered (and its gradient reduced) in bf16 under autocast
    if mode is TensorParallelLinearMode.ALL_REDUCE:
        x = copy_to_tp(x, group)
    else:
        x = gather_along_dim0(x, group)
    return F.linear(x, weight, bias)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group, mode, async_communication: bool = False
) -> torch.Tensor:
    """y = x W^T + b with W split by input columns over `group`.

    x: [S, B, in/tp]; weight: [out, in/tp]; bias: [out] replicated, added once after the
    reduction. Returns [S, B, out] (ALL_REDUCE) or this rank's [S/tp, B, out] (REDUCE_SCATTER).
    Under REDUCE_SCATTER with tp > 1 the bias only sees this rank's tokens, so its gradient is a
    partial sum over tp (like a norm weight's): see `allreduce_sequence_parallel_grads_`.
    """
    mode = as_mode(mode)
    tp = group_size(group)
    if tp == 1:
        return F.linear(x, weight, bias)
    if mode is TensorParallelLinearMode.ALL_REDUCE:
        out = reduce_from_tp(F.linear(x, weight), group)
    else:
        _check_seq(x, tp, "row_linear")
        if async_communication:
            out = _RowLinearAsyncReduceScatter.apply(x, weight, group)
        else:
            out = reduce_scatter_along_dim0(F.linear(x, weight), group)
    return out if bias is None else out + bias
