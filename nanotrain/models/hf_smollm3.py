"""Hugging Face ``SmolLM3ForCausalLM`` <-> nanotrain: Llama's tensors with some layers applying no RoPE.

From transformers 5.x ``configuration_smollm3.py`` / ``modeling_smollm3.py``: ``no_rope_layers``
is a per-layer list where **1 means the layer uses RoPE** and 0 that it is a NoPE layer
(``use_rope = config.no_rope_layers[layer_idx]``); absent, it is built from
``no_rope_layer_interval`` (default 4: every 4th layer is NoPE). nanotrain's
``model.no_rope_layers`` is the opposite kind of list: the *indices* of the NoPE layers, so 0s
become indices on import and indices become 0s on export (the interval is then not written: the
list wins over it). A sliding window applies to the NoPE layers only by default (``layer_types``)
and is refused on some layers only, as for Qwen (``Mapping.window_of``). ``attention_bias`` and
``mlp_bias`` put biases where nanotrain has none: refused. The configuration class ties the
embeddings by default (``tie_word_embeddings`` true) and its RoPE base is 2e6.
"""

from __future__ import annotations

from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models.hf_config_json import Mapping, num_layers


class SmolLM3Mapping(Mapping):
    ARCHITECTURE = "SmolLM3ForCausalLM"
    MODEL_TYPE = "smollm3"
    DEFAULTS = {
        **Mapping.DEFAULTS,
        "rope_theta": 2000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "use_sliding_window": False,
        "sliding_window": None,
        "no_rope_layer_interval": 4,
    }
    NO_ROPE = True

    def rope_flags(self, cfg: dict) -> list[Any] | None:
        """config.json's per-layer RoPE flags (1 = RoPE), built from the interval when absent;
        None when they cannot be read (``family_problems`` says why)."""
        n, flags = num_layers(cfg), cfg.get("no_rope_layers")
        if flags is None:
            k = self.get(cfg, "no_rope_layer_interval")
            return [int((i + 1) % k != 0) for i in range(n)] if isinstance(k, int) and k > 0 else None
        ok = isinstance(flags, list) and len(flags) >= n and all(f in (0, 1) for f in flags)
        return flags[:n] if ok else None

    def no_rope_layers(self, cfg: dict) -> list[int]:
        return [i for i, uses in enumerate(self.rope_flags(cfg) or []) if not uses]

    def family_problems(self, cfg: dict) -> list[str]:
        if self.rope_flags(cfg) is not None:
            return []
        if cfg.get("no_rope_layers") is None:
            k = self.get(cfg, "no_rope_layer_interval")
            return [f"no_rope_layer_interval {k!r}: transformers needs a positive integer"]
        return [
            f"no_rope_layers {cfg['no_rope_layers']!r}: transformers needs a 0/1 entry (1 = the layer uses "
            f"RoPE) for each of the {num_layers(cfg)} layers"
        ]

    def sliding_layers(self, cfg: dict) -> tuple[Any, list[bool]]:
        window = self.get(cfg, "sliding_window")
        if not self.get(cfg, "use_sliding_window") or window is None:
            return None, []
        n, types = num_layers(cfg), cfg.get("layer_types")
        if not isinstance(types, list):
            flags = self.rope_flags(cfg) or [1] * n
            types = ["full_attention" if uses else "sliding_attention" for uses in flags]
        return window, [t == "sliding_attention" for t in types[:n]]

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        nope, window, n = set(args.no_rope_layers), args.sliding_window, args.num_layers
        return {
            "no_rope_layers": [0 if i in nope else 1 for i in range(n)],
            "attention_bias": False,
            "mlp_bias": False,
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "layer_types": ["sliding_attention" if window is not None else "full_attention"] * n,
        }


SMOLLM3 = SmolLM3Mapping()
