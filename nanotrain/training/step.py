"""One optimizer step for any (dp, tp, pp), split in the two halves every engine shares.

The first half runs the micro-batches of one step: `forward_backward` on a pp=1 model, or a
`PipelineEngine` (afab / 1f1b / interleaved_1f1b) when pp > 1. `optimizer_step` then finishes the
data-parallel gradient sync, sums the sequence-parallel gradients over tp and the tied-embedding
gradients over the first and last stage, clips by the global norm and steps the optimizer and LR.
The loss of each micro-batch is divided by the micro-batch count and the DP sync averages over
replicas, so the gradient is that of the mean token loss over the whole global batch — the
same number a single process gets from the same samples.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from nanotrain.optim import clip_grad_norm_
from nanotrain.parallel import collectives
from nanotrain.parallel.data_parallel.shard_grads import reduced_grad_of
from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.pipeline_parallel import MessageSpec, PipelineEngine, TensorPointer, allreduce_tied_grads_
from nanotrain.parallel.tensor_parallel import allreduce_sequence_parallel_grads_

MicroBatch = tuple[torch.Tensor, ...]  # (input ids [B, S], targets [B, S]), + document ids [B, S]


class StepStats:
    """The numbers of one step. The loss and grad norm stay 0-d device tensors until read:
    ``.loss`` / ``.grad_norm`` copy them to the host (a sync that waits for the whole step on a
    GPU), so a loop reads them on logging steps only and lets the host run ahead otherwise."""

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, skipped: Optional[torch.Tensor] = None):
        self.loss_tensor, self.grad_norm_tensor, self.lr = loss, grad_norm, lr
        self.skipped = skipped  # training.spike skip/rewind: 1.0 where the step applied no update (device)
        self._host: Optional[tuple[float, float]] = None

    def _read(self) -> tuple[float, float]:
        if self._host is None:
            both = torch.stack([self.loss_tensor.double(), self.grad_norm_tensor.double()]).cpu()
            self._host = (float(both[0]), float(both[1]))
        return self._host

    @property
    def loss(self) -> float:
        """Mean token loss over the global batch (every dp replica)."""
        return self._read()[0]

    @property
    def grad_norm(self) -> float:
        """Global gradient norm before clipping."""
        return self._read()[1]


def micro_loss(model: torch.nn.Module, microbatch: MicroBatch) -> torch.Tensor:
    """The model's mean token loss of one micro-batch: ``(ids, targets)``, or ``(ids, targets,
    documents)`` under document masking (the per-token document ids go in as ``documents``), or
    ``(ids, targets, documents, cp_order)`` under cp's balanced order (``parallelism.cp_balance``)."""
    ids, targets, *extra = microbatch
    return model(ids, targets, **dict(zip(("documents", "cp_order"), extra)))


def forward_backward(model: torch.nn.Module, microbatches: Sequence[MicroBatch], grad_sync) -> torch.Tensor:
    """Gradient accumulation; the DP all-reduces start only in the last micro-batch's backward
    (ZeRO-2: every micro-batch's backward reduce-scatters, ``grad_sync.backward_scope``)."""
    total = None
    count = len(microbatches)
    for index, microbatch in enumerate(microbatches):
        last = index == count - 1
        with grad_sync.backward_scope(last):
            HANG_RECORD.mark("forward")  # the hang record (progress.py): plain attribute writes
            loss = micro_loss(model, microbatch) / count
            HANG_RECORD.mark("backward")
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def optimizer_step(
    model: torch.nn.Module,
    grad_sync,
    optimizer,
    scheduler,
    pc: ParallelContext,
    clip_grad: float | None,
    before_update=None,
    judge=None,
) -> tuple[torch.Tensor, float, Optional[torch.Tensor]]:
    """Finish the gradient sync, clip, step; returns (grad norm before clipping, lr used, skip
    decision or None). ``before_update``: called right before the parameters and optimizer states
    change (an async checkpoint's host copies are waited for there). ``judge(grad_norm)``: the
    skip decision (``training/spike.py``), a device tensor given to the fused AdamW as
    ``found_inf``: 1.0 leaves parameters, moments and step count as they were."""
    HANG_RECORD.mark("optimizer (gradient sync)")
    grad_sync.finish_grad_sync()
    HANG_RECORD.mark("optimizer (clip, step)")
    shards = grad_sync.grad_shards()  # ZeRO-1/2: the pieces this rank reduced (ZeRO-2: its accumulator)
    grad_of = reduced_grad_of(shards)
    allreduce_sequence_parallel_grads_(model.sequence_parallel_params(), pc.tp_pg, grad_of)
    if pc.embedding_pg is not None and pc.pp_size > 1:  # first and last stage
        allreduce_tied_grads_(model.parameters(), pc.embedding_pg, grad_of)
    grad_norm = clip_grad_norm_(model.parameters(), clip_grad, pc, shards)
    lr = optimizer.param_groups[0]["lr"]
    skipped = None
    if judge is not None:
        skipped = optimizer.found_inf = judge(grad_norm)
    if before_update is not None:
        HANG_RECORD.mark("optimizer (waiting for the checkpoint's host copy)")
        before_update()
        HANG_RECORD.mark("optimizer (clip, step)")
    optimizer.step()
    scheduler.step()
    grad_sync.zero_grad()
    return grad_norm, lr, skipped


def mean_over_replicas(loss: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """The per-replica loss averaged over dp (and cp, and ep: its ranks read different samples)
    for logging: one tiny all-reduce."""
    loss = loss.detach().clone()
    group = pc.dense_replica_pg
    if group.size() > 1:
        collectives.all_reduce(loss, group=group, what="all_reduce loss over dp")
        loss /= group.size()
    return loss


def reduce_loss(loss: torch.Tensor | TensorPointer, pc: ParallelContext) -> torch.Tensor:
    """The step's loss averaged over replicas, on every rank: the last pipeline stage holds it
    (a TensorPointer elsewhere), averages it over dp, then broadcasts it along its pp group, so
    whichever rank logs (global rank 0, on the first stage) has it."""
    if pc.pp_size == 1:
        return mean_over_replicas(loss, pc)
    if isinstance(loss, TensorPointer):
        value = torch.zeros((), dtype=torch.float64, device=pc.device)
    else:
        value = mean_over_replicas(loss, pc).to(torch.float64)
    collectives.broadcast(value, group_src=pc.pp_size - 1, group=pc.pp_pg, what="broadcast loss over pp")
    return value


def train_step(
    model,
    microbatches: Sequence[MicroBatch],
    grad_sync,
    optimizer,
    scheduler,
    pc: ParallelContext,
    clip_grad: float | None,
    engine: PipelineEngine | None = None,
    message: MessageSpec | None = None,
    before_update=None,
    spike=None,
) -> StepStats:
    """One optimizer step: forward and backward of every micro-batch, the gradient sync, clipping,
    the update and the scheduler step. Collective over every group of the model. No host sync
    happens here: read the returned stats when they are needed.

    Args:
        model: this rank's ``ModelPart`` (``build_model``).
        microbatches: the step's (ids, targets) pairs, or (ids, targets, documents) under document
            masking; every pp rank passes the same ones (the first stage reads the ids, the last
            the targets, every stage the documents), or None on middle stages with ``message``
            when there are no documents.
        grad_sync: the model's ``BucketedGradSync``.
        optimizer, scheduler: as ``build_optimizer`` and ``build_lr_scheduler`` made them.
        pc: the ParallelContext.
        clip_grad: the global gradient-norm limit (None or <= 0: only measured).
        engine: required when pp > 1 (``build_engine``).
        message: the pipeline messages' shapes, for middle stages (see ``PipelineEngine``).
        before_update: called right before the parameters change (``optimizer_step``).
        spike: a ``SpikeGuard`` (``training.spike.policy`` skip or rewind): the loss is reduced before the
            update, so that the guard can judge it with the grad norm and skip the update.

    Returns:
        ``StepStats``: the global mean loss, the grad norm before clipping and the lr used.

    Raises:
        ValueError: pp > 1 without ``engine``.
    """
    begin_step = getattr(model, "begin_step", None)  # LlamaModel: the MoE auxiliary losses' share
    if begin_step is not None:  # of each micro-batch; other models have none
        begin_step(len(microbatches))
    if pc.pp_size > 1:
        if engine is None:
            raise ValueError("train_step: pp > 1 needs engine=PipelineEngine(pp_engine, pc.pp_pg)")
        loss = engine.forward_backward(model, microbatches, grad_sync, message)
    else:
        loss = forward_backward(model, microbatches, grad_sync)
    if spike is None:
        grad_norm, lr, _ = optimizer_step(model, grad_sync, optimizer, scheduler, pc, clip_grad, before_update)
        HANG_RECORD.mark("loss reduction")
        return StepStats(reduce_loss(loss, pc), grad_norm, lr)
    HANG_RECORD.mark("loss reduction")
    loss = reduce_loss(loss, pc)  # before the update: the skip decision needs it

    def judge(grad_norm):
        return spike.judge(loss, grad_norm)

    grad_norm, lr, skipped = optimizer_step(model, grad_sync, optimizer, scheduler, pc, clip_grad, before_update, judge)
    return StepStats(loss, grad_norm, lr, skipped)
