"""Hugging Face ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5) and ``Qwen3ForCausalLM`` (Qwen3 dense) <-> nanotrain.

From transformers 5.x ``configuration_qwen2.py`` / ``modeling_qwen2.py`` and the Qwen3 pair:

* Qwen2 builds q/k/v with ``bias=True`` and o_proj without, always (no switch): ``qkv_bias``
  true, read as ``self_attn.{q,k,v}_proj.bias`` into ``attn.qkv.bias`` rows ``[q | k | v]``.
* Qwen3 has per-head RMSNorms ``self_attn.q_norm`` / ``k_norm`` (``[head_dim]``): ``qk_norm``
  true; its ``head_dim`` defaults to 128 when config.json has none (not hidden / heads);
  ``attention_bias: true`` puts a bias on o_proj too, which nanotrain has not: refused.
* Sliding window: ``use_sliding_window: false`` means none whatever ``sliding_window`` says
  (Qwen2.5 ships 131072 / 32768 with the switch off; ``__post_init__`` nulls it). With the switch
  on, the layers whose ``layer_types`` entry is ``sliding_attention`` use it (default: layers
  ``>= max_window_layers``). nanotrain has one window for all layers, so a window on some layers
  only is refused unless it covers ``max_position_embeddings`` (``Mapping.window_of``). Export
  writes the switch, ``max_window_layers: 0`` and ``layer_types`` for a window on every layer.
"""

from __future__ import annotations

from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models.hf_config_json import Mapping, num_layers

_QWEN_DEFAULTS = {
    **Mapping.DEFAULTS,
    "max_position_embeddings": 32768,
    "num_key_value_heads": 32,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}


def layered_windows(mapping: Mapping, cfg: dict) -> tuple[Any, list[bool]]:
    """Qwen2/Qwen3's ``__post_init__``: the window (None when switched off) and its layers."""
    if not mapping.get(cfg, "use_sliding_window"):
        return None, []
    n, types = num_layers(cfg), cfg.get("layer_types")
    if not isinstance(types, list):
        start = mapping.get(cfg, "max_window_layers")
        start = start if isinstance(start, int) else 0
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    return mapping.get(cfg, "sliding_window"), [t == "sliding_attention" for t in types[:n]]


def window_config(args: ModelArgs, *, layer_types: bool = True) -> dict[str, Any]:
    """config.json's window fields for ``model.sliding_window`` on every layer (or none)."""
    window, n = args.sliding_window, args.num_layers
    out = {"use_sliding_window": window is not None, "sliding_window": window}
    out["max_window_layers"] = 0 if window is not None else n
    if layer_types:
        out["layer_types"] = ["sliding_attention" if window is not None else "full_attention"] * n
    return out


class Qwen2Mapping(Mapping):
    ARCHITECTURE = "Qwen2ForCausalLM"
    MODEL_TYPE = "qwen2"
    DEFAULTS = _QWEN_DEFAULTS
    QKV_BIAS = True
    BIAS_KEYS = ()  # Qwen2Config has no bias switch: q/k/v always, o_proj and MLP never

    def sliding_layers(self, cfg: dict) -> tuple[Any, list[bool]]:
        return layered_windows(self, cfg)

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        return window_config(args)


class Qwen3Mapping(Mapping):
    ARCHITECTURE = "Qwen3ForCausalLM"
    MODEL_TYPE = "qwen3"
    DEFAULTS = {**_QWEN_DEFAULTS, "head_dim": 128}
    QK_NORM = True
    BIAS_KEYS = ("attention_bias",)

    def sliding_layers(self, cfg: dict) -> tuple[Any, list[bool]]:
        return layered_windows(self, cfg)

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        return {"attention_bias": False, **window_config(args)}


QWEN2 = Qwen2Mapping()
QWEN3 = Qwen3Mapping()
