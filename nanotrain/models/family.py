"""A model family described once: config -> plain module, its parallelize plan, its Hugging Face
mapping and the arithmetic the torch-free commands need.

One family per Hugging Face class nanotrain imports and exports (``FAMILIES``, keyed by
``model.family``, which is the HF ``model_type``): llama, mistral, qwen2, qwen3, smollm3, mixtral,
qwen3_moe. They share one model (``LlamaModel``, whose options — head_dim, q/k/v biases, q/k
norms, NoPE layers, sliding window, experts — say what it computes), one plan and one arithmetic;
only the name and the HF mapping differ. A family with another model would be one such object
(its plain model, plan, mapping and arithmetic modules) plus its tests. This module imports no torch:
``submit.py --dry-run``, ``--plan`` and the pre-launch checks read ``arch`` and ``hf`` in well
under the 2 seconds they promise; the torch parts are imported when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nanotrain.config import Config, ModelArgs
from nanotrain.models import llama_arch
from nanotrain.models.hf_config_json import Mapping
from nanotrain.models.hf_llama import LLAMA as HF_LLAMA
from nanotrain.models.hf_mistral import MISTRAL
from nanotrain.models.hf_moe import MIXTRAL, QWEN3_MOE
from nanotrain.models.hf_qwen import QWEN2, QWEN3
from nanotrain.models.hf_smollm3 import SMOLLM3


@dataclass(frozen=True)
class ModelFamily:
    """``arch``: shapes, blocks, parameter counts and FLOPs on the config (torch-free);
    ``hf``: the Hugging Face names, layout and config.json, both directions (an
    ``hf_config_json.Mapping``: ``ARCHITECTURE``, ``MODEL_TYPE``, ``pieces``, ``hf_shapes``, ...; torch-free);
    ``model`` / ``plan``: ``"module:attribute"`` of the plain model class, and the plan's module
    (``ParallelPlan``, ``plan_from_config``, ``build_part``), imported on use (they import torch)."""

    name: str
    arch: ModuleType
    hf: Mapping
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


def _family(mapping: Mapping) -> ModelFamily:
    return ModelFamily(
        name=mapping.MODEL_TYPE,
        arch=llama_arch,
        hf=mapping,
        model="nanotrain.models.llama:LlamaModel",
        plan="nanotrain.models.llama_parallelize",
    )


FAMILIES: dict[str, ModelFamily] = {
    m.MODEL_TYPE: _family(m) for m in (HF_LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3, MIXTRAL, QWEN3_MOE)
}
LLAMA = FAMILIES["llama"]


def family_of(args: ModelArgs) -> ModelFamily:
    """The family of the ``model:`` section (``model.family``; a checkpoint saved before the field
    existed reads it at its default, llama)."""
    return FAMILIES[getattr(args, "family", None) or "llama"]


def family_of_hf(cfg: dict) -> ModelFamily | None:
    """The family of a Hugging Face config.json, by its ``model_type`` (None: one nanotrain does
    not import)."""
    model_type = cfg.get("model_type")
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def supported_families() -> str:
    """``llama (LlamaForCausalLM), mistral (MistralForCausalLM), ...``: for messages."""
    return ", ".join(f"{name} ({f.hf.ARCHITECTURE})" for name, f in FAMILIES.items())
