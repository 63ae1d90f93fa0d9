"""Pipeline parallelism: nanotron's explicit objects, Megatron's schedules.

* ``TensorPointer`` — a tensor that lives on another pipeline rank;
* ``P2P`` — send/recv of shapes both sides know between stages over ``pc.pp_pg``, one batch per
  communication point (what keeps NCCL from deadlocking, ``p2p.py``);
* ``PipelineBlock`` / ``place_blocks`` — a model piece declared on every rank, built on its owner;
  cost-balanced split into (virtual) stages;
* ``PipelineEngine`` — runs a schedule (``afab``, ``1f1b``, ``interleaved_1f1b``) over a step's
  micro-batches, with bubble and activation-memory instrumentation;
* ``tied`` — parameters shared by the first and last stage (tied embeddings).
The config-driven builders live above the model, in ``nanotrain.training.builder``.
"""
from nanotrain.parallel.pipeline_parallel.block import ModelChunk, PipelineBlock, place_blocks
from nanotrain.parallel.pipeline_parallel.engine import EngineStats, PipelineEngine, schedule_actions
from nanotrain.parallel.pipeline_parallel.p2p import P2P, MessageSpec, TorchP2PTransport
from nanotrain.parallel.pipeline_parallel.schedules import SCHEDULES, Action, schedule_steps, theoretical_bubble
from nanotrain.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotrain.parallel.pipeline_parallel.tied import allreduce_tied_grads_, is_tied, is_tied_replica, mark_tied_
from nanotrain.parallel.stage_split import balanced_split  # pure arithmetic, kept importable here

__all__ = [
    "TensorPointer", "P2P", "MessageSpec", "TorchP2PTransport",
    "PipelineBlock", "ModelChunk", "place_blocks", "balanced_split",
    "PipelineEngine", "EngineStats", "schedule_actions", "schedule_steps", "SCHEDULES", "Action",
    "theoretical_bubble",
    "mark_tied_", "is_tied", "is_tied_replica", "allreduce_tied_grads_",
]
