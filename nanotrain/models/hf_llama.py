"""The Hugging Face Llama <-> nanotrain mapping, both directions, in one place.

Why one module: converters elsewhere (nanotron, torchtitan, gpt-neox) are known for weights that
load without error and still compute another function (fused q/k/v or gate/up rows in another
order, the other RoPE convention). Everything that decides how a tensor of one side becomes a
tensor of the other lives here, and the import, the export, the pre-launch checks and the tests
all read it. Pure Python (no torch, no transformers): ``submit.py`` checks a HF directory
against the config before a launch without importing torch.

The layout facts (proven by tests/test_hf.py against ``transformers.LlamaForCausalLM``):

* nanotrain's fused ``attn.qkv.weight`` holds the rows ``[q_proj | k_proj | v_proj]`` (q heads,
  then the kv heads' keys, then their values), ``mlp.gate_up.weight`` the rows
  ``[gate_proj | up_proj]``; every other tensor is one HF tensor under another name.
* RoPE rotates the two halves of each head (``rotate_half``), as HF's Llama does, so q/k rows
  need no permutation (the Meta checkpoints' interleaved layout is HF's problem, not ours).
  Its frequencies are plain or scaled by ``rope_type: llama3`` (``model.rope_scaling``, proven by
  tests/test_hf_llama3.py); every other scaling is refused.
* The vocabulary is never padded in a checkpoint (padding to a multiple of tp exists only inside
  the live model), so the rows map 1:1. A HF vocabulary smaller than ``model.vocab_size`` fills
  the first rows; the others keep nanotrain's seeded initialisation.
* Tied embeddings: HF stores ``model.embed_tokens.weight`` only (an ``lm_head.weight`` beside it
  is ignored on import and never written on export); nanotrain has no ``lm_head``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nanotrain.config import ModelArgs
from nanotrain.models import llama_arch

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` (dim 0) of a nanotrain tensor are the HF tensor ``hf_name``'s rows
    ``[0, stop - start)``."""

    hf_name: str
    start: int
    stop: int


def nanotrain_names(args: ModelArgs) -> list[str]:
    """Every parameter name of the full model, in forward order (export writes in this order)."""
    names = ["embed.weight"]
    for i in range(args.num_layers):
        names += [
            f"layers.{i}.{n}"
            for n in (
                "input_norm.weight",
                "attn.qkv.weight",
                "attn.o_proj.weight",
                "post_attn_norm.weight",
                "mlp.gate_up.weight",
                "mlp.down.weight",
            )
        ]
    names.append("final_norm.weight")
    if not args.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


_LAYER = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def pieces(name: str, args: ModelArgs, hf_vocab: int | None = None) -> list[Piece]:
    """The HF tensors that nanotrain's ``name`` is made of, stacked along dim 0.
    ``hf_vocab``: rows the HF side has of the embedding / LM head (default ``model.vocab_size``)."""
    vocab = args.vocab_size if hf_vocab is None else hf_vocab
    if name == "embed.weight":
        return [Piece("model.embed_tokens.weight", 0, vocab)]
    if name == "lm_head.weight":
        return [Piece("lm_head.weight", 0, vocab)]
    if name == "final_norm.weight":
        return [Piece("model.norm.weight", 0, args.hidden_size)]
    prefix, _, rest = name.partition(".")
    layer, _, field = rest.partition(".")
    if prefix != "layers" or not layer.isdigit():
        raise KeyError(f"no Hugging Face counterpart for {name!r}")
    hf = f"model.layers.{layer}."
    if field == "attn.qkv.weight":
        q = args.num_attention_heads * llama_arch.head_dim(args)
        kv = llama_arch.kv_heads(args) * llama_arch.head_dim(args)
        return [
            Piece(hf + "self_attn.q_proj.weight", 0, q),
            Piece(hf + "self_attn.k_proj.weight", q, q + kv),
            Piece(hf + "self_attn.v_proj.weight", q + kv, q + 2 * kv),
        ]
    if field == "mlp.gate_up.weight":
        f = args.intermediate_size
        return [Piece(hf + "mlp.gate_proj.weight", 0, f), Piece(hf + "mlp.up_proj.weight", f, 2 * f)]
    if field in _LAYER:
        return [Piece(hf + _LAYER[field], 0, args.hidden_size)]  # norms, o_proj, down: hidden rows
    raise KeyError(f"no Hugging Face counterpart for {name!r}")


def hf_shapes(args: ModelArgs, hf_vocab: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the model needs, with its shape, in nanotrain's forward order."""
    h, f, d = args.hidden_size, args.intermediate_size, llama_arch.head_dim(args)
    cols = {
        "attn.qkv.weight": h,
        "attn.o_proj.weight": args.num_attention_heads * d,
        "mlp.gate_up.weight": h,
        "mlp.down.weight": f,
    }
    out: dict[str, tuple[int, ...]] = {}
    for name in nanotrain_names(args):
        field = name.split(".", 2)[-1] if name.startswith("layers.") else name
        for p in pieces(name, args, hf_vocab):
            if name.endswith("norm.weight"):
                out[p.hf_name] = (p.stop - p.start,)
            else:
                out[p.hf_name] = (p.stop - p.start, cols.get(field, h))
    return out


# ----------------------------------------------------------------------------- config.json
def rope_theta_of(cfg: dict) -> Any:
    """transformers 4.x writes ``rope_theta`` at the top, 5.x inside ``rope_parameters``; 5.x takes
    it from the RoPE parameters it uses (``rope_params_of``), else from the top."""
    return rope_params_of(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0))


def rope_params_of(cfg: dict) -> dict:
    """The RoPE parameters transformers computes with: ``rope_scaling`` (4.x, and 5.x reads it
    first when set) else ``rope_parameters`` (5.x); {} when neither is a mapping."""
    for key in ("rope_scaling", "rope_parameters"):
        params = cfg.get(key)
        if isinstance(params, dict) and params:
            return params
    return {}


def rope_type_of(cfg: dict) -> str | None:
    """None for plain RoPE (no parameters, or rope_type "default"), else the scaling's name."""
    params = rope_params_of(cfg)
    kind = params.get("rope_type", params.get("type"))
    return None if kind in (None, "default") else str(kind)


SUPPORTED_ROPE = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_ORIGINAL = "original_max_position_embeddings"


def _original_context(cfg: dict) -> Any:
    """transformers 5.x: a top-level ``original_max_position_embeddings`` wins over the RoPE
    parameters' own, which default to ``max_position_embeddings``."""
    return cfg.get(_ORIGINAL, rope_params_of(cfg).get(_ORIGINAL, cfg.get("max_position_embeddings")))


def _rope_problems(cfg: dict) -> list[str]:
    """What keeps the RoPE of config.json from being a ``model.rope_scaling`` section."""
    kind = rope_type_of(cfg)
    if kind is None:
        return []
    if kind not in SUPPORTED_ROPE:
        return [
            f"rope scaling {kind!r}: nanotrain computes plain RoPE and rope_type "
            f"{' / '.join(map(repr, SUPPORTED_ROPE))} (Llama 3.1-3.3) only"
        ]
    params, out = rope_params_of(cfg), []
    for key in _LLAMA3_KEYS:
        if not _is_number(params.get(key)):
            out.append(f"rope scaling {kind!r}: {key} is {params.get(key)!r}; transformers needs a number")
    original = _original_context(cfg)
    if not (isinstance(original, int) and not isinstance(original, bool)):
        out.append(f"rope scaling {kind!r}: {_ORIGINAL} is {original!r}; transformers needs an integer")
    elif _ORIGINAL in cfg and params.get(_ORIGINAL, original) != original:
        out.append(
            f"rope scaling {kind!r}: {_ORIGINAL} is {cfg[_ORIGINAL]} at the top of config.json but "
            f"{params[_ORIGINAL]} in the RoPE parameters (transformers 4.x and 5.x read different ones): keep one"
        )
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rope_scaling_of(cfg: dict) -> dict[str, Any] | None:
    """The ``model.rope_scaling`` fields for config.json's RoPE (None = plain RoPE); call only
    when ``unsupported(cfg)`` found nothing."""
    kind = rope_type_of(cfg)
    if kind is None:
        return None
    params = rope_params_of(cfg)
    section: dict[str, Any] = {"type": kind}
    section.update({key: float(params[key]) for key in _LLAMA3_KEYS})
    section[_ORIGINAL] = _original_context(cfg)
    return section


def unsupported(cfg: dict) -> list[str]:
    """What a config.json asks for that nanotrain's Llama cannot compute, one reason each."""
    problems = []
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != MODEL_TYPE or (archs and archs != [ARCHITECTURE]):
        problems.append(
            f"model_type {cfg.get('model_type')!r}, architectures {archs}: only "
            f"{MODEL_TYPE!r} / {ARCHITECTURE} checkpoints can be imported"
        )
        return problems  # the fields below mean something else in other architectures
    problems += _rope_problems(cfg)
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            problems.append(f"{key}: true: nanotrain's Llama has no bias terms")
    if cfg.get("sliding_window") not in (None, 0):
        problems.append(f"sliding_window {cfg['sliding_window']}: nanotrain attends causally over the whole sequence")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r}: nanotrain's MLP is SwiGLU (silu)")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if (
        cfg.get("head_dim") is not None
        and isinstance(heads, int)
        and isinstance(hidden, int)
        and heads
        and cfg["head_dim"] != hidden // heads
    ):
        problems.append(
            f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads = {hidden // heads}: "
            "nanotrain derives the head size from the hidden size"
        )
    return problems


# nanotrain model field -> how to read it from config.json
_FIELDS = {
    "vocab_size": lambda c: c.get("vocab_size"),
    "hidden_size": lambda c: c.get("hidden_size"),
    "intermediate_size": lambda c: c.get("intermediate_size"),
    "num_layers": lambda c: c.get("num_hidden_layers"),
    "num_attention_heads": lambda c: c.get("num_attention_heads"),
    "num_key_value_heads": lambda c: c.get("num_key_value_heads") or c.get("num_attention_heads"),
    "max_position_embeddings": lambda c: c.get("max_position_embeddings"),
    "rope_theta": lambda c: float(rope_theta_of(c)),
    "rms_norm_eps": lambda c: float(c.get("rms_norm_eps", 1e-6)),
    "tie_word_embeddings": lambda c: bool(c.get("tie_word_embeddings", False)),
}
_HF_NAME = {"num_layers": "num_hidden_layers"}


def model_section(cfg: dict) -> dict[str, Any]:
    """The ``model:`` fields of a nanotrain config that compute the function config.json describes
    (``rope_scaling``, a mapping of its fields, only when config.json scales RoPE)."""
    out = {k: read(cfg) for k, read in _FIELDS.items()}
    scaling = rope_scaling_of(cfg)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def mismatches(args: ModelArgs, cfg: dict) -> list[str]:
    """Every ``model`` field that disagrees with config.json, one line each naming both values.
    ``model.vocab_size`` may exceed the HF vocabulary (the extra rows are trained from scratch)."""
    want = model_section(cfg)
    out = _rope_mismatches(args, want.pop("rope_scaling", None))
    for key, value in want.items():
        mine = llama_arch.kv_heads(args) if key == "num_key_value_heads" else getattr(args, key)
        hf_key = _HF_NAME.get(key, key)
        if key == "vocab_size":
            if isinstance(value, int) and value > mine:
                out.append(
                    f"model.vocab_size ({mine}) is smaller than the Hugging Face vocabulary (config.json "
                    f"vocab_size {value}): set model.vocab_size: {value} (or more)"
                )
            continue
        if mine != value:
            out.append(
                f"model.{key} is {mine!r} but config.json has {hf_key} {value!r}: set model.{key}: "
                f"{_yaml(value)} (python scripts/hf_config.py prints the whole section)"
            )
    return out


def _rope_mismatches(args: ModelArgs, want: dict[str, Any] | None) -> list[str]:
    """``model.rope_scaling`` against config.json's scaling (``want``; None = plain RoPE)."""
    mine = None if args.rope_scaling is None else asdict(args.rope_scaling)
    hint = "(python scripts/hf_config.py prints the whole section)"
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
            f"set model.rope_scaling: {_yaml(want)} {hint}"
        ]
    return [
        f"model.rope_scaling.{key} is {mine[key]!r} but config.json has {key} {value!r}: "
        f"set model.rope_scaling.{key}: {_yaml(value)} {hint}"
        for key, value in want.items()
        if mine[key] != value
    ]


def _hf_rope(args: ModelArgs) -> dict[str, Any]:
    """config.json's RoPE fields: ``rope_scaling`` (4.x) and ``rope_parameters`` (5.x; it also
    reads ``rope_scaling`` first, so both hold the same scaling)."""
    rs = args.rope_scaling
    if rs is None:
        return {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}}
    scaling = {
        "rope_type": rs.type,
        "factor": rs.factor,
        "low_freq_factor": rs.low_freq_factor,
        "high_freq_factor": rs.high_freq_factor,
        _ORIGINAL: rs.original_max_position_embeddings,
    }
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": args.rope_theta}}


def hf_config(args: ModelArgs, *, dtype: str, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json for ``LlamaForCausalLM.from_pretrained``: the fields of transformers 4.x
    (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and 5.x (``rope_parameters``, ``dtype``) alike."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": llama_arch.kv_heads(args),
        "head_dim": llama_arch.head_dim(args),
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        **_hf_rope(args),
        "rms_norm_eps": args.rms_norm_eps,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": args.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def model_yaml(cfg: dict) -> str:
    """The ``model:`` YAML section for config.json (what ``scripts/hf_config.py`` prints)."""
    lines = ["model:"]
    for key, value in model_section(cfg).items():
        if isinstance(value, dict):
            lines += [f"  {key}:"] + [f"    {k}: {_yaml(v)}" for k, v in value.items()]
        else:
            lines.append(f"  {key}: {_yaml(value)}")
    return "\n".join(lines) + "\n"


def _yaml(value: Any) -> str:
    """``value`` as YAML that nanotrain's loader reads back as it is (a mapping in flow style)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # YAML 1.1 (PyYAML) reads 1e-06 as a string: write 1.0e-06
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa or not e else '.0'}{e}{exponent}"
    return str(value)
