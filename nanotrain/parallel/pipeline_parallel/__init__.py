"""Pipeline parallelism: nanotron's explicit objects, Megatron's schedules.

* ``TensorPointer`` — a tensor that lives on another pipeline rank;
* ``P2P`` — send/recv of shapes both sides know between stages over ``pc.pp_pg``, one batch per
  communication point (what keeps NCCL from deadlocking, ``p2p.py``);
* ``place_stages`` / ``keep_blocks_`` — the cost-balanced split of a model's blocks into
  (virtual) stages, and a model cut down to this rank's (``stages.py``);
* ``PipelineEngine`` — runs a schedule (``afab``, ``1f1b``, ``interleaved_1f1b``) over a step's
  micro-batches, with bubble and activation-memory instrumentation;
* ``tied`` — parameters shared by the first and last stage (tied embeddings).
"""

from nanotrain.parallel.pipeline_parallel.engine import EngineStats, PipelineEngine, schedule_actions
from nanotrain.parallel.pipeline_parallel.p2p import P2P, MessageSpec, TorchP2PTransport
from nanotrain.parallel.pipeline_parallel.schedules import SCHEDULES, Action, schedule_steps, theoretical_bubble
from nanotrain.parallel.pipeline_parallel.stages import ModelChunk, keep_blocks_, place_stages
from nanotrain.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotrain.parallel.pipeline_parallel.tied import allreduce_tied_grads_, is_tied, is_tied_replica, mark_tied_
from nanotrain.parallel.stage_split import balanced_split  # pure arithmetic, kept importable here

__all__ = [
    "TensorPointer",
    "P2P",
    "MessageSpec",
    "TorchP2PTransport",
    "ModelChunk",
    "place_stages",
    "keep_blocks_",
    "balanced_split",
    "PipelineEngine",
    "EngineStats",
    "schedule_actions",
    "schedule_steps",
    "SCHEDULES",
    "Action",
    "theoretical_bubble",
    "mark_tied_",
    "is_tied",
    "is_tied_replica",
    "allreduce_tied_grads_",
]
