"""Config -> this rank's part of the model and its pipeline engine.

    model = build_model(config, pc, device=pc.device)   # its pp stage(s) and tp shards
    engine = build_engine(config, pc)                    # None when pp = 1

The only place where the config meets the model's and the engine's constructors, so the trainer,
the checkpoint tools and the tests build exactly the same thing.
"""
from __future__ import annotations

from typing import Optional

from nanotrain.models import llama_arch
from nanotrain.models.llama import LlamaModel
from nanotrain.parallel.pipeline_parallel import PipelineEngine


def build_model(config, pc, device=None) -> LlamaModel:
    """This rank's ``LlamaModel``: its pp stage(s) (``pp_virtual_stages`` chunks), its tp shards;
    the mapping from the config is ``llama_arch.model_kwargs`` (one place for it)."""
    return LlamaModel(**llama_arch.model_kwargs(config, pc), device=device)


def build_engine(config, pc) -> Optional[PipelineEngine]:
    """The engine for ``parallelism.pp_engine``, or None when pp = 1 (no pipeline). On NCCL it
    sends over one communicator per flow (``pc.pipeline_flow_groups``, see ``p2p.py``)."""
    if pc.pp_size == 1:
        return None
    return PipelineEngine(config.parallelism.pp_engine, pc.pp_pg, pc.device,
                          flow_groups=getattr(pc, "pipeline_flow_groups", None))
