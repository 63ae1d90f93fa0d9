"""Config -> this rank's part of the model and its pipeline engine.

    model = build_model(config, pc, device=pc.device)   # its pp stage(s) and tp shards
    engine = build_engine(config, pc)                    # None when pp = 1

The only place where the config meets the model's and the engine's constructors, so the trainer,
the checkpoint tools and the tests build exactly the same thing.
"""
from __future__ import annotations

from typing import Optional

import torch

from nanotrain.models.llama import LlamaModel
from nanotrain.parallel.pipeline_parallel import PipelineEngine


def build_model(config, pc, device=None) -> LlamaModel:
    """This rank's ``LlamaModel``: its pp stage(s) (``pp_virtual_stages`` chunks), its tp shards.

    ``model.dtype`` is the compute dtype (autocast) on every device; weights, gradients and
    optimizer states stay fp32. CPU autocast runs bf16 too (slower than fp32 on most CPUs, but it
    is how the GPU precision path is tested here)."""
    p = config.parallelism
    return LlamaModel(config.model, pc.tp_pg, mode=p.tp_mode, async_communication=p.tp_linear_async_communication,
                      pp_rank=pc.pp_rank, pp_size=pc.pp_size, virtual_stages=p.pp_virtual_stages,
                      seed=config.training.seed, device=device, compute_dtype=getattr(torch, config.model.dtype),
                      cp_pg=pc.cp_pg)


def build_engine(config, pc) -> Optional[PipelineEngine]:
    """The engine for ``parallelism.pp_engine``, or None when pp = 1 (no pipeline). On NCCL it
    sends over one communicator per flow (``pc.pipeline_flow_groups``, see ``p2p.py``)."""
    if pc.pp_size == 1:
        return None
    return PipelineEngine(config.parallelism.pp_engine, pc.pp_pg, pc.device,
                          flow_groups=getattr(pc, "pipeline_flow_groups", None))
