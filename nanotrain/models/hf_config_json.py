"""A family's config.json <-> nanotrain's ``model:`` section, both directions, with per-family hooks.

Why a base class with hooks: the seven families read mostly the same fields (sizes, RoPE, norm
epsilon, tied embeddings) and differ in a few (biases, q/k norms, head_dim's default, which
layers slide or skip RoPE, experts). What transformers builds for a config.json is decided by
its ``Configuration`` class (defaults for absent keys, ``__post_init__`` rules) and modeling file
(what a flag switches on); each family's hooks copy those rules from transformers 5.x (4.x reads
the same fields) and the family modules say where. Everything a config.json asks for that the
model cannot compute is refused in one line each (``unsupported``); every ``model`` field that
differs from it is one line naming both values and the fix (``mismatches``); what a family's
config.json cannot say about a checkpoint is refused before an export (``inexpressible``).

Training choices are never compared: ``moe.aux_loss_coef`` (printed at config.json's
``router_aux_loss_coef``), ``moe.z_loss_coef`` and ``moe.capacity_factor`` change how a run
trains, not which function the imported weights compute (transformers' MoE is dropless).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models import hf_rope, llama_arch
from nanotrain.models.hf_mapping import Layout, head_dim

HINT = "(python scripts/hf_config.py DIR prints the whole section)"
_HF_NAME = {"num_layers": "num_hidden_layers"}
# model options the section prints only when they differ from these (the schema's defaults)
_OPTIONS: dict[str, Any] = {"qkv_bias": False, "qk_norm": False, "no_rope_layers": [], "sliding_window": None}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def num_layers(cfg: dict) -> int:
    """``num_hidden_layers`` when it is a count, else 0 (validate then names the bad value)."""
    n = cfg.get("num_hidden_layers")
    return n if _int(n) and n > 0 else 0


class Mapping(Layout):
    """A family's mapping: the tensor names (``Layout``) and config.json. The defaults here are
    Llama's; a family overrides the constants and hooks that differ."""

    # config.json keys the family's configuration class fills when they are absent
    DEFAULTS: dict[str, Any] = {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "num_key_value_heads": None,
        "head_dim": None,
    }
    QKV_BIAS = False  # the family always has q/k/v biases (and can have no other)
    QK_NORM = False  # the family always has per-head q/k RMSNorms
    NO_ROPE = False  # config.json can name layers that apply no RoPE
    SLIDING = True  # config.json can give a sliding window
    BIAS_KEYS = ("attention_bias", "mlp_bias")  # switches whose true nanotrain refuses

    def get(self, cfg: dict, key: str) -> Any:
        """config.json's ``key``, or the family's default when it is absent."""
        return cfg[key] if key in cfg else self.DEFAULTS.get(key)

    # ------------------------------------------------------------------ hooks
    def sliding_layers(self, cfg: dict) -> tuple[Any, list[bool]]:
        """(the window, which layers use it) as transformers builds the model; here (Mistral,
        Mixtral) ``sliding_window`` on every layer."""
        return self.get(cfg, "sliding_window"), [True] * num_layers(cfg)

    def no_rope_layers(self, cfg: dict) -> list[int]:
        """The layers that apply no RoPE (SmolLM3); none here."""
        return []

    def family_problems(self, cfg: dict) -> list[str]:
        """What else of config.json this family's model computes and nanotrain cannot."""
        return []

    def moe_section(self, cfg: dict) -> dict[str, Any] | None:
        """The ``model.moe`` fields (None: a dense family)."""
        return None

    def moe_inexpressible(self, args: ModelArgs) -> list[str]:
        if args.moe is not None:
            return [f"model.moe: {self.ARCHITECTURE} has no experts (families mixtral and qwen3_moe have)"]
        return []

    def family_config(self, args: ModelArgs) -> dict[str, Any]:
        """The family's own config.json fields for ``args`` (windows, biases, experts)."""
        return {}

    # ------------------------------------------------------------------ config.json -> model
    def head_dim_of(self, cfg: dict) -> Any:
        """The head size transformers builds: ``head_dim``, else hidden / heads (Qwen3's
        configuration class defaults it to 128 instead)."""
        value = self.get(cfg, "head_dim")
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        if value is None and _int(hidden) and _int(heads) and heads > 0:
            return hidden // heads
        return value

    def window_of(self, cfg: dict) -> tuple[int | None, str | None]:
        """(``model.sliding_window``, a reason it cannot be imported). A window on some layers
        only is refused unless it covers ``max_position_embeddings`` (then it never bites: null)."""
        window, layers = self.sliding_layers(cfg)
        if window in (None, 0) or not any(layers):
            return None, None
        if not _int(window) or window < 1:
            return None, f"sliding_window {window!r}: transformers needs a positive integer or null"
        if all(layers):
            return window, None
        context = self.get(cfg, "max_position_embeddings")
        if _int(context) and window >= context:
            return None, None
        slid = [i for i, s in enumerate(layers) if s]
        return None, (
            f"sliding_window {window} on layers {slid} only (the others attend to the whole sequence): "
            f"nanotrain applies one window to every layer, so it imports such a model only when the window "
            f"covers max_position_embeddings ({context})"
        )

    def unsupported(self, cfg: dict) -> list[str]:
        """What a config.json asks for that nanotrain cannot compute, one reason each."""
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") != self.MODEL_TYPE or (archs and archs != [self.ARCHITECTURE]):
            return [  # the fields below mean something else in other architectures
                f"model_type {cfg.get('model_type')!r}, architectures {archs}: only "
                f"{self.MODEL_TYPE!r} / {self.ARCHITECTURE} checkpoints can be imported as "
                f"model.family {self.MODEL_TYPE}"
            ]
        problems = hf_rope.rope_problems(cfg)
        act = self.get(cfg, "hidden_act")
        if act != "silu":
            problems.append(f"hidden_act {act!r}: nanotrain's MLP is SwiGLU (silu)")
        if cfg.get("attention_bias") and "attention_bias" in self.BIAS_KEYS:
            problems.append(
                f"attention_bias: true: {self.ARCHITECTURE} then adds a bias to q, k, v and o_proj; nanotrain "
                "has q/k/v biases (Qwen2) but no bias on o_proj"
            )
        if cfg.get("mlp_bias") and "mlp_bias" in self.BIAS_KEYS:
            problems.append("mlp_bias: true: nanotrain's MLP has no bias terms")
        value = self.head_dim_of(cfg)
        if value is not None and (not _int(value) or value < 1):
            problems.append(f"head_dim {value!r}: transformers needs a positive integer")
        problems += [p for p in [self.window_of(cfg)[1]] if p]
        return problems + self.family_problems(cfg)

    def model_section(self, cfg: dict) -> dict[str, Any]:
        """The ``model:`` fields of a nanotrain config that compute the function config.json
        describes (the options only where they differ from the schema's defaults; call only
        when ``unsupported(cfg)`` found nothing)."""
        out: dict[str, Any] = {
            "family": self.MODEL_TYPE,
            "vocab_size": cfg.get("vocab_size"),
            "hidden_size": cfg.get("hidden_size"),
            "intermediate_size": cfg.get("intermediate_size"),
            "num_layers": cfg.get("num_hidden_layers"),
            "num_attention_heads": cfg.get("num_attention_heads"),
            "num_key_value_heads": self.get(cfg, "num_key_value_heads") or cfg.get("num_attention_heads"),
            "max_position_embeddings": self.get(cfg, "max_position_embeddings"),
            "rope_theta": float(hf_rope.rope_theta_of(cfg, self.DEFAULTS["rope_theta"])),
            "rms_norm_eps": float(self.get(cfg, "rms_norm_eps")),
            "tie_word_embeddings": bool(self.get(cfg, "tie_word_embeddings")),
        }
        hidden, heads, value = cfg.get("hidden_size"), cfg.get("num_attention_heads"), self.head_dim_of(cfg)
        if not (_int(hidden) and _int(heads) and heads > 0 and value == hidden // heads):
            out["head_dim"] = value
        if self.QKV_BIAS:
            out["qkv_bias"] = True
        if self.QK_NORM:
            out["qk_norm"] = True
        if self.no_rope_layers(cfg):
            out["no_rope_layers"] = self.no_rope_layers(cfg)
        window = self.window_of(cfg)[0]
        if window is not None:
            out["sliding_window"] = window
        scaling = hf_rope.rope_scaling_of(cfg)
        if scaling is not None:
            out["rope_scaling"] = scaling
        moe = self.moe_section(cfg)
        if moe is not None:
            out["moe"] = moe
        return out

    def mismatches(self, args: ModelArgs, cfg: dict) -> list[str]:
        """Every ``model`` field that disagrees with config.json, one line each naming both values.
        ``model.vocab_size`` may exceed the HF vocabulary (the extra rows are trained from scratch)."""
        want = self.model_section(cfg)
        out = []
        family = want.pop("family")
        if args.family != family:
            out.append(
                f"model.family is {args.family} but config.json is a {family} model ({self.ARCHITECTURE}): "
                f"set model.family: {family} {HINT}"
            )
        out += _rope_mismatches(args, want.pop("rope_scaling", None))
        moe = want.pop("moe", None)
        theirs = want.pop("head_dim", self.head_dim_of(cfg))
        want = {**want, **{k: want.get(k, v) for k, v in _OPTIONS.items()}}
        for key, value in want.items():
            mine = llama_arch.kv_heads(args) if key == "num_key_value_heads" else getattr(args, key)
            if key == "no_rope_layers":
                mine = sorted(set(mine))
            if key == "vocab_size":
                if _int(value) and value > mine:
                    out.append(
                        f"model.vocab_size ({mine}) is smaller than the Hugging Face vocabulary (config.json "
                        f"vocab_size {value}): set model.vocab_size: {value} (or more)"
                    )
                continue
            if mine != value:
                hf_key = _HF_NAME.get(key, key)
                out.append(
                    f"model.{key} is {mine!r} but config.json has {hf_key} {value!r}: "
                    f"set model.{key}: {_yaml(value)} {HINT}"
                )
        if head_dim(args) != theirs:
            out.append(
                f"model.head_dim is {_yaml(args.head_dim)} ({head_dim(args)} features per head) but config.json's "
                f"heads have {theirs}: set model.head_dim: {_yaml(theirs)} {HINT}"
            )
        return out + self._moe_mismatches(args, moe)

    def _moe_mismatches(self, args: ModelArgs, want: dict[str, Any] | None) -> list[str]:
        mine = args.moe
        if want is None:
            return (
                []
                if mine is None
                else [f"model.moe is set but config.json describes a dense {self.ARCHITECTURE}: remove model.moe"]
            )
        if mine is None:
            return [f"model.moe is absent (dense) but config.json has experts: set model.moe: {_yaml(want)} {HINT}"]
        have = {**asdict(mine), "expert_intermediate_size": llama_arch.expert_ffn(args)}
        out = [
            f"model.moe.{key} is {_yaml(have[key])} but config.json has {_yaml(want[key])}: "
            f"set model.moe.{key}: {_yaml(want[key])} {HINT}"
            for key in ("num_experts", "top_k", "expert_intermediate_size", "norm_topk_prob")
            if have[key] != want[key]
        ]
        if mine.num_shared_experts:
            out.append(
                f"model.moe.num_shared_experts is {mine.num_shared_experts} but {self.ARCHITECTURE} has no "
                "shared experts: set model.moe.num_shared_experts: 0"
            )
        layers = range(args.num_layers)
        f, k = want["first_dense_layers"], want["layer_frequency"]
        theirs = [i for i in layers if i >= f and (i - f) % k == 0]
        if [i for i in layers if llama_arch.is_moe_layer(args, i)] != theirs:
            out.append(
                f"model.moe makes layers {llama_arch.moe_layer_indices(args)} MoE but config.json's MoE layers "
                f"are {theirs}: set model.moe.first_dense_layers: {f} and model.moe.layer_frequency: {k}"
            )
        return out

    # ------------------------------------------------------------------ model -> config.json
    def inexpressible(self, args: ModelArgs) -> list[str]:
        """What of the ``model`` section this family's config.json cannot say (export refuses it)."""
        out = []
        for key, has, what in (("qkv_bias", self.QKV_BIAS, "q/k/v biases"), ("qk_norm", self.QK_NORM, "q/k norms")):
            if getattr(args, key) != has:
                out.append(
                    f"model.{key} is {_yaml(getattr(args, key))}: {self.ARCHITECTURE} "
                    f"{'always has' if has else 'has no'} {what}"
                )
        if args.no_rope_layers and not self.NO_ROPE:
            out.append(f"model.no_rope_layers {args.no_rope_layers}: every layer of {self.ARCHITECTURE} applies RoPE")
        if args.sliding_window is not None and not self.SLIDING:
            out.append(f"model.sliding_window {args.sliding_window}: {self.ARCHITECTURE} has no sliding window")
        return out + self.moe_inexpressible(args)

    def hf_config(self, args: ModelArgs, *, dtype: str, bos_token_id: int | None, eos_token_id: int | None) -> dict:
        """config.json for ``AutoModelForCausalLM.from_pretrained``: the fields of transformers 4.x
        (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and 5.x (``rope_parameters``, ``dtype``) alike."""
        return {
            "architectures": [self.ARCHITECTURE],
            "model_type": self.MODEL_TYPE,
            "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "num_hidden_layers": args.num_layers,
            "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": llama_arch.kv_heads(args),
            "head_dim": head_dim(args),
            "max_position_embeddings": args.max_position_embeddings,
            **hf_rope.hf_rope(args),
            "rms_norm_eps": args.rms_norm_eps,
            "tie_word_embeddings": args.tie_word_embeddings,
            "hidden_act": "silu",
            **self.family_config(args),
            "attention_dropout": 0.0,
            "initializer_range": args.init_std,
            "use_cache": True,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": None,
            "torch_dtype": dtype,
            "dtype": dtype,
        }

    def model_yaml(self, cfg: dict) -> str:
        """The ``model:`` YAML section for config.json (what ``scripts/hf_config.py`` prints)."""
        lines = ["model:"]
        for key, value in self.model_section(cfg).items():
            if isinstance(value, dict):
                lines += [f"  {key}:"] + [f"    {k}: {_yaml(v)}" for k, v in value.items()]
            else:
                lines.append(f"  {key}: {_yaml(value)}")
        return "\n".join(lines) + "\n"


def _rope_mismatches(args: ModelArgs, want: dict[str, Any] | None) -> list[str]:
    """``model.rope_scaling`` against config.json's scaling (``want``; None = plain RoPE)."""
    mine = None if args.rope_scaling is None else asdict(args.rope_scaling)
    if mine == want:
        return []
    if want is None:
        return [
            f"model.rope_scaling is {_yaml(mine)} but config.json has plain RoPE (no rope scaling): "
            "remove model.rope_scaling"
        ]
    if mine is None:
        return [
            f"model.rope_scaling is absent (plain RoPE) but config.json scales RoPE with {_yaml(want)}: "
            f"set model.rope_scaling: {_yaml(want)} {HINT}"
        ]
    return [
        f"model.rope_scaling.{key} is {mine[key]!r} but config.json has {key} {value!r}: "
        f"set model.rope_scaling.{key}: {_yaml(value)} {HINT}"
        for key, value in want.items()
        if mine[key] != value
    ]


def _yaml(value: Any) -> str:
    """``value`` as YAML that nanotrain's loader reads back as it is (mappings and lists in flow style)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # YAML 1.1 (PyYAML) reads 1e-06 as a string: write 1.0e-06
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa or not e else '.0'}{e}{exponent}"
    return str(value)
