"""Config-driven entry points for the trainer: the model of this rank's stage(s) and one step.

    model = build_pipeline_model(config, pc, device=pc.device)
    stats = train_step(model, microbatches, grad_sync, optimizer, scheduler, pc, config)

Any (dp, tp, pp): pp = 1 takes the plain accumulation path, pp > 1 the engine named by
``parallelism.pp_engine``. Ranks on middle pipeline stages read no data and may pass
``microbatches=None`` (the count comes from ``training.batch_accumulation_per_replica``).
"""
from __future__ import annotations

from typing import Optional, Sequence

from nanotrain.parallel.pipeline_parallel.engine import MicroBatch, PipelineEngine


def build_pipeline_model(config, pc, device=None):
    """This rank's ``LlamaModel``: its pp stage(s) (``pp_virtual_stages`` chunks), its tp shards."""
    from nanotrain.models.llama import LlamaModel  # the model imports this package

    import torch

    p = config.parallelism
    # model.dtype is the compute dtype (autocast) on every device; weights, gradients and
    # optimizer states stay fp32. CPU autocast runs bf16 too (slower on most CPUs than fp32,
    # but it is how the GPU precision path is tested here).
    compute_dtype = getattr(torch, config.model.dtype)
    return LlamaModel(config.model, pc.tp_pg, mode=p.tp_mode, async_communication=p.tp_linear_async_communication,
                      pp_rank=pc.pp_rank, pp_size=pc.pp_size, virtual_stages=p.pp_virtual_stages,
                      seed=config.training.seed, device=device, compute_dtype=compute_dtype,
                      cp_pg=pc.cp_pg)


def build_engine(config, pc) -> Optional[PipelineEngine]:
    """The engine for ``parallelism.pp_engine``, or None when pp = 1 (no pipeline)."""
    if pc.pp_size == 1:
        return None
    return PipelineEngine(config.parallelism.pp_engine, pc.pp_pg, pc.device,
                          flow_groups=getattr(pc, "pipeline_flow_groups", None))


def train_step(model, microbatches: Optional[Sequence[MicroBatch]], grad_sync, optimizer, scheduler, pc,
               config, engine: Optional[PipelineEngine] = None):
    """``nanotrain.training.step.train_step`` with the engine, micro-batch count and clipping
    taken from ``config``. Returns ``StepStats`` (loss averaged over dp, on every rank)."""
    from nanotrain.training.step import train_step as step  # the step module imports this package

    t = config.training
    if microbatches is None:
        microbatches = [None] * t.batch_accumulation_per_replica
    engine = engine if engine is not None else build_engine(config, pc)
    message = model.pipeline_message(t.micro_batch_size, t.sequence_length) if engine is not None else None
    return step(model, microbatches, grad_sync, optimizer, scheduler, pc, config.optimizer.clip_grad,
                engine=engine, message=message)
