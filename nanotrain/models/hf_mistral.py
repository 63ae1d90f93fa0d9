"""Hugging Face ``MistralForCausalLM`` (Mistral 7B v0.1-v0.3, Mistral NeMo, Ministral-style dense
models) <-> nanotrain: Llama's tensor names, no biases, and a sliding window.

From transformers 5.x ``configuration_mistral.py`` / ``modeling_mistral.py``: ``sliding_window``
(default 4096 when the key is absent; null = full attention) applies to every layer
(``create_sliding_window_causal_mask`` for the whole model) -> ``model.sliding_window``, which
validate refuses when it is shorter than ``training.sequence_length``; ``head_dim`` may be given
(NeMo: 128 with hidden 5120 / 32 heads) -> ``model.head_dim``. Every projection is built with
``bias=False`` whatever config.json says, so no bias switch is read.
"""

from __future__ import annotations

from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models.hf_config_json import Mapping


class MistralMapping(Mapping):
    ARCHITECTURE = "MistralForCausalLM"
    MODEL_TYPE = "mistral"
    DEFAULTS = {
        **Mapping.DEFAULTS,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    }
    BIAS_KEYS = ()

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        return {"sliding_window": args.sliding_window}


MISTRAL = MistralMapping()
