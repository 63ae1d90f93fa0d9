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
    from nanotrain.models import llama_arch  # the model imports this package
    from nanotrain.models.llama import LlamaModel

    return LlamaModel(**llama_arch.model_kwargs(config, pc), device=device)


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
