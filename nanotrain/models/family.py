"""A model family described once: config -> plain module, its parallelize plan, its Hugging Face
mapping and the arithmetic the torch-free commands need.

``LLAMA`` is the one family today (dense and MoE Llamas). A new family is one such object (its
plain model, plan, mapping and arithmetic modules) plus its tests. This module imports no torch:
``submit.py --dry-run``, ``--plan`` and the pre-launch checks read ``arch`` and ``hf`` in well
under the 2 seconds they promise; the torch parts are imported when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nanotrain.config import Config, ModelArgs
from nanotrain.models import hf_llama, llama_arch


@dataclass(frozen=True)
class ModelFamily:
    """``arch``: shapes, blocks, parameter counts and FLOPs on the config (torch-free);
    ``hf``: the Hugging Face names and layout, both directions (torch-free);
    ``model`` / ``plan``: ``"module:attribute"`` of the plain model class, and the plan's module
    (``ParallelPlan``, ``plan_from_config``, ``build_part``), imported on use (they import torch)."""

    name: str
    arch: ModuleType
    hf: ModuleType
    model: str
    plan: str

    def model_class(self) -> type:
        module, _, attr = self.model.partition(":")
        return getattr(importlib.import_module(module), attr)

    def plan_module(self) -> ModuleType:
        return importlib.import_module(self.plan)

    def build(self, args: ModelArgs):
        """The plain single-device model (uninitialised: ``init_weights(seed)`` fills it)."""
        return self.model_class()(args)

    def build_part(self, config: Config, pc: Any = None, device: Any = None, initialize: bool = True):
        """This rank's ``ModelPart`` for ``config`` (``pc``: a ParallelContext or a stand-in with
        its groups; None is one process); ``initialize`` False: a meta skeleton (names, shapes,
        shard records) for offline tools."""
        return self.plan_module().build_part(config, pc, device, initialize)

    def flops_per_token(self, config: Config) -> tuple[int, int]:
        """(model, hardware) FLOPs of one training token, read from the module (meta device)."""
        return self.plan_module().flops_per_token(config)


LLAMA = ModelFamily(
    name="llama",
    arch=llama_arch,
    hf=hf_llama,
    model="nanotrain.models.llama:LlamaModel",
    plan="nanotrain.models.llama_parallelize",
)


def family_of(args: ModelArgs) -> ModelFamily:
    """The family of the ``model:`` section (every config describes a Llama today)."""
    return LLAMA
