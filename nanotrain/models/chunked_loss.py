"""The head's mean token loss computed a chunk of tokens at a time (``training.loss_chunk_tokens``),
so that no rank ever holds the logits of a whole micro-batch.

At a large vocabulary the logits are the biggest activation of the model: ``tokens x V/tp`` in
fp32, kept for backward, and in backward two or three more tensors of that size (8192 tokens at a
128k vocabulary: 4 GB each). Here the final norm, the LM head and the per-token cross-entropy run
on one chunk of this rank's tokens at a time inside one autograd Function (``_ChunkedLoss``):

* forward (autograd off) computes each chunk's summed loss and drops its logits; it keeps only
  the hidden state and the targets; the loss is the sum of the chunks' sums divided by the token
  count, the mean over all tokens as in the one-piece head;
* backward loops over the chunks itself: it reruns one chunk's head with autograd on, takes
  ``torch.autograd.grad`` of its summed loss to the chunk's hidden rows and to the head's
  parameters, writes the rows' gradient into the hidden state's and adds the parameters' into
  one fp32 sum each, in place, before the next chunk starts. The peak is one chunk's logits and
  their gradients, by construction (not by the order autograd happens to run nodes in), plus
  the sum of the LM head weight's gradients (``4 x V/tp x H`` bytes), which autograd then hands
  to ``.grad`` once: hooks on the parameters (the data-parallel gradient sync) see one gradient,
  as with the one-piece head. A tied LM head's weight is the embedding's: its two gradients meet
  in ``.grad`` as before.

The rerun tensors are the backward's working set, not tensors kept for it: they are packed by
identity hooks of their own, so an outer ``saved_tensors_hooks`` meter (``benchmarks/memory.py``,
the pipeline engine's) counts what the head keeps between forward and backward, as
``torch.utils.checkpoint`` does for ``training.recompute``.

Autocast: the forward's dtype is recorded and entered again around each rerun, with autocast's
cache of cast weights off, so each chunk casts the LM head weight itself and its gradient comes
back in fp32 before the chunks' sum, whatever region the caller runs backward in (a copy cached
by an enclosing region would be shared by the chunks, and their gradients summed in bf16,
rounding once per chunk). A cast is ``V x H`` elements per chunk, against the chunk's
``tokens x V x H`` matmul. Tensor-parallel collectives inside the head (the vocab-parallel loss's
all-reduces, the LM head's input gather and its gradient's all-reduce or reduce-scatter) run per
chunk, in the same order on every tp rank; the rerun runs the forward's again.

Sequence parallelism (tp REDUCE_SCATTER): the hidden state holds this rank's ``1/tp`` of the
tokens and the column-parallel LM head gathers the same rows of every tp rank, in rank order. A
chunk of ``r`` rows here is therefore ``r`` rows of each rank's block of the sequence, and its
targets are taken from every block alike. The number of blocks is read from the shapes: the
targets hold every token, the hidden state its share.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from nanotrain.models.llama_parallelize_costs import loss_chunk_rows
from nanotrain.parallel import accelerator

TokenLosses = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mean_token_loss(
    token_losses: TokenLosses,
    params: Sequence[torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """The mean over ``targets`` of ``token_losses(hidden rows, their targets)`` (the per-token loss
    of final norm, LM head and cross-entropy, whose parameters are ``params``), ``chunk_tokens``
    logits rows at a time (0: in one piece, as when one chunk would hold every row).

    ``hidden``: ``[..., H]`` (sequence-first, this rank's rows); ``targets``: the same tokens'
    targets in the same order, or ``shards`` times as many (each rank's block of rows after the
    other, sequence parallelism)."""
    rows = hidden.numel() // hidden.shape[-1]
    shards = targets.numel() // rows if rows else 1
    if rows * shards != targets.numel():
        raise ValueError(
            f"targets {tuple(targets.shape)} cover neither the hidden state's {rows} tokens "
            "nor a whole multiple of them"
        )
    per_chunk = loss_chunk_rows(chunk_tokens, rows, shards)
    if per_chunk == 0:
        return token_losses(hidden, targets).mean()
    blocks = targets.reshape(shards, rows)
    return _ChunkedLoss.apply(token_losses, per_chunk, hidden, blocks, *params) / targets.numel()


class _ChunkedLoss(torch.autograd.Function):
    """Summed token loss of ``hidden`` rows and ``blocks`` ``[shards, rows]`` of targets, ``per_chunk``
    rows at a time (module docstring); gradients for ``hidden`` and ``params``."""

    @staticmethod
    def forward(ctx, token_losses: TokenLosses, per_chunk: int, hidden, blocks, *params):
        ctx.token_losses, ctx.per_chunk, ctx.params = token_losses, per_chunk, params
        ctx.dtype = accelerator.autocast_dtype(hidden.device.type)
        ctx.save_for_backward(hidden, blocks)
        total = None
        for rows, targets in _chunks(hidden, blocks, per_chunk):
            with _autocast(rows.device.type, ctx.dtype):
                summed = token_losses(rows, targets).sum()
            total = summed if total is None else total + summed
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, blocks = ctx.saved_tensors
        need_hidden = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        grad_hidden = torch.empty_like(hidden).view(-1, hidden.shape[-1]) if need_hidden else None
        sums: list = [None] * len(ctx.params)
        start = 0
        for rows, targets in _chunks(hidden, blocks, ctx.per_chunk):
            stop = start + rows.shape[0]
            into = grad_hidden[start:stop] if need_hidden else None
            _chunk_backward(ctx, rows, targets, grad_total, into, wanted, sums)
            start = stop
        grad_hidden = None if grad_hidden is None else grad_hidden.view(hidden.shape)
        return (None, None, grad_hidden, None, *sums)


def _chunk_backward(ctx, rows, targets, grad_total, into, wanted: list[int], sums: list) -> None:
    """One chunk rerun and taken back: its rows' gradient written ``into`` (None: not needed), the
    gradients of the parameters ``wanted`` added to ``sums``. Everything else it made is gone when
    it returns, before the next chunk is rerun."""
    rows = rows.detach().requires_grad_(into is not None)
    inputs = ([rows] if into is not None else []) + [ctx.params[i] for i in wanted]
    with torch.enable_grad(), _autocast(rows.device.type, ctx.dtype), _working_set():
        summed = ctx.token_losses(rows, targets).sum()
    grads = list(torch.autograd.grad(summed, inputs, grad_total, allow_unused=True))
    if into is not None:
        into.copy_(grads.pop(0))
    for i, grad in zip(wanted, grads):
        if grad is not None:  # the first one copied: autograd's own tensor is not ours to add to
            sums[i] = grad.clone() if sums[i] is None else sums[i].add_(grad)


def _chunks(hidden: torch.Tensor, blocks: torch.Tensor, per_chunk: int):
    """(rows, their targets) of each chunk: ``per_chunk`` rows of ``hidden`` and the targets of
    those rows in every block (rank order, as the LM head gathers them)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    for start in range(0, flat.shape[0], per_chunk):
        yield flat[start : start + per_chunk], blocks[:, start : start + per_chunk].reshape(-1)


def _autocast(device_type: str, dtype):
    """Autocast in ``dtype`` (None: off) without its cache of cast weights (module docstring)."""
    if dtype is None:
        return contextlib.nullcontext()
    return accelerator.autocast(device_type, dtype=dtype, cache_enabled=False)


def _working_set():
    """Identity saved-tensor hooks: the rerun's tensors are not reported to outer hooks."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
