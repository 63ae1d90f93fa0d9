"""config.json's RoPE, read and written the way transformers 4.x and 5.x read and write it.

Why apart from the name mapping: every family (Llama, Mistral, Qwen, SmolLM3, Mixtral,
Qwen3-MoE) keeps its RoPE in the same fields, and the two transformers generations disagree on
where: 4.x writes ``rope_theta`` and ``rope_scaling`` at the top, 5.x ``rope_parameters`` (and
reads ``rope_scaling`` first when it is set). Reading the wrong one imports a model whose
frequencies differ from the ones transformers computes, and nothing fails. Pure Python.

nanotrain computes plain RoPE and ``rope_type: llama3`` (Llama 3.1-3.3, ``model.rope_scaling``,
proven by tests/test_hf_llama3.py); every other scaling, and a ``partial_rotary_factor`` below
1, is refused.
"""

from __future__ import annotations

from typing import Any

from nanotrain.config import ModelArgs

SUPPORTED_ROPE = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_ORIGINAL = "original_max_position_embeddings"


def rope_params_of(cfg: dict) -> dict:
    """The RoPE parameters transformers computes with: ``rope_scaling`` (4.x, and 5.x reads it
    first when set) else ``rope_parameters`` (5.x); {} when neither is a mapping."""
    for key in ("rope_scaling", "rope_parameters"):
        params = cfg.get(key)
        if isinstance(params, dict) and params:
            return params
    return {}


def rope_theta_of(cfg: dict, default: float = 10000.0) -> Any:
    """transformers 4.x writes ``rope_theta`` at the top, 5.x inside ``rope_parameters``; 5.x takes
    it from the RoPE parameters it uses (``rope_params_of``), else from the top, else the
    family's ``default_theta`` (10000; SmolLM3 2e6, Mixtral 1e6)."""
    return rope_params_of(cfg).get("rope_theta", cfg.get("rope_theta", default))


def rope_type_of(cfg: dict) -> str | None:
    """None for plain RoPE (no parameters, or rope_type "default"), else the scaling's name."""
    params = rope_params_of(cfg)
    kind = params.get("rope_type", params.get("type"))
    return None if kind in (None, "default") else str(kind)


def _original_context(cfg: dict) -> Any:
    """transformers 5.x: a top-level ``original_max_position_embeddings`` wins over the RoPE
    parameters' own, which default to ``max_position_embeddings``."""
    return cfg.get(_ORIGINAL, rope_params_of(cfg).get(_ORIGINAL, cfg.get("max_position_embeddings")))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rope_problems(cfg: dict) -> list[str]:
    """What keeps the RoPE of config.json from being nanotrain's (plain or ``model.rope_scaling``)."""
    partial = rope_params_of(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    out = []
    if partial not in (None, 1, 1.0):
        out.append(f"partial_rotary_factor {partial!r}: nanotrain rotates every feature of a head")
    kind = rope_type_of(cfg)
    if kind is None:
        return out
    if kind not in SUPPORTED_ROPE:
        return out + [
            f"rope scaling {kind!r}: nanotrain computes plain RoPE and rope_type "
            f"{' / '.join(map(repr, SUPPORTED_ROPE))} (Llama 3.1-3.3) only"
        ]
    params = rope_params_of(cfg)
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


def rope_scaling_of(cfg: dict) -> dict[str, Any] | None:
    """The ``model.rope_scaling`` fields for config.json's RoPE (None = plain RoPE); call only
    when ``rope_problems(cfg)`` found nothing."""
    kind = rope_type_of(cfg)
    if kind is None:
        return None
    params = rope_params_of(cfg)
    section: dict[str, Any] = {"type": kind}
    section.update({key: float(params[key]) for key in _LLAMA3_KEYS})
    section[_ORIGINAL] = _original_context(cfg)
    return section


def hf_rope(args: ModelArgs) -> dict[str, Any]:
    """config.json's RoPE fields: ``rope_theta`` and ``rope_scaling`` (4.x) and ``rope_parameters``
    (5.x; it also reads ``rope_scaling`` first, so both hold the same scaling)."""
    rs = args.rope_scaling
    if rs is None:
        return {
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        }
    scaling = {
        "rope_type": rs.type,
        "factor": rs.factor,
        "low_freq_factor": rs.low_freq_factor,
        "high_freq_factor": rs.high_freq_factor,
        _ORIGINAL: rs.original_max_position_embeddings,
    }
    return {
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**scaling, "rope_theta": args.rope_theta},
    }
