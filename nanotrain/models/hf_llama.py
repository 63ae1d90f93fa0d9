"""Hugging Face ``LlamaForCausalLM`` (TinyLlama, SmolLM, Llama 2, 3 and 3.1-3.3) <-> nanotrain.

The family the others extend: its tensor names and config.json are ``hf_mapping.Layout`` and
``hf_config_json.Mapping`` as they stand (transformers 5.x ``LlamaConfig`` defaults). What is
Llama's own: no sliding window (``LlamaForCausalLM`` has none and ignores a ``sliding_window``
key; one in config.json is refused, as it says the checkpoint is something else), and
``attention_bias`` / ``mlp_bias`` refused (they put biases on o_proj and the MLP too). A
``head_dim`` other than hidden / heads is read into ``model.head_dim``.

The module-level names (``pieces``, ``hf_shapes``, ``unsupported``, ``model_section``,
``mismatches``, ``hf_config``, ``model_yaml``, ``nanotrain_names``) are ``LLAMA``'s, kept for
the callers that knew only this family.
"""

from __future__ import annotations

from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models.hf_config_json import Mapping
from nanotrain.models.hf_mapping import Piece, nanotrain_names  # noqa: F401 (this module's names since before)


class LlamaMapping(Mapping):
    ARCHITECTURE = "LlamaForCausalLM"
    MODEL_TYPE = "llama"
    SLIDING = False

    def sliding_layers(self, cfg: dict) -> tuple[Any, list[bool]]:
        return None, []

    def family_problems(self, cfg: dict) -> list[str]:
        window = cfg.get("sliding_window")
        if window in (None, 0):
            return []
        return [f"sliding_window {window}: LlamaForCausalLM has no sliding window (Mistral's model_type is mistral)"]

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


LLAMA = LlamaMapping()
ARCHITECTURE, MODEL_TYPE = LLAMA.ARCHITECTURE, LLAMA.MODEL_TYPE
pieces, hf_shapes, inexpressible = LLAMA.pieces, LLAMA.hf_shapes, LLAMA.inexpressible
unsupported, model_section, mismatches = LLAMA.unsupported, LLAMA.model_section, LLAMA.mismatches
hf_config, model_yaml = LLAMA.hf_config, LLAMA.model_yaml
