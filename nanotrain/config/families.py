"""Which ``model:`` options each Hugging Face family has (``model.family``, its ``model_type``).

The family changes no computation: the options (``head_dim``, ``qkv_bias``, ``qk_norm``,
``no_rope_layers``, ``sliding_window``, ``moe``...) say what the model computes. But a checkpoint
exported as a family whose transformers model lacks one of them would load as a different function
there (its biases or norms dropped, every layer rotated), and one imported under the wrong family
would be read with the wrong names. So each family lists the options it may have, and
``validate_family`` refuses any other in one line naming the field, the family and the fix.

``head_dim`` is every family's (each transformers class reads config.json's ``head_dim``: Mistral
NeMo's 128 at hidden 5120 and 32 heads), so is ``tie_word_embeddings`` (every transformers model
can tie its head); the ``llama`` family also takes nanotrain's own MoE (``model.moe``, any shape), as before families.
Torch-free: ``validate`` calls it before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nanotrain.config.loader import ConfigError
from nanotrain.config.schema import Config, ModelArgs


@dataclass(frozen=True)
class Family:
    """``hf_class``: transformers' model class; ``options``: the optional fields it may set;
    ``moe``: ``no`` (dense only), ``may`` or ``must`` (every layer routes through experts)."""

    hf_class: str
    options: frozenset[str]
    moe: str = "no"
    dense: str | None = None  # the dense family of the same attention (a must-moe family's fix)


FAMILIES: dict[str, Family] = {
    # Every one but Llama's has a sliding_window field.
    "llama": Family("LlamaForCausalLM", frozenset({"rope_scaling"}), moe="may"),
    "mistral": Family("MistralForCausalLM", frozenset({"sliding_window"})),
    "qwen2": Family("Qwen2ForCausalLM", frozenset({"qkv_bias", "sliding_window"})),
    "qwen3": Family("Qwen3ForCausalLM", frozenset({"qk_norm", "sliding_window"})),
    "smollm3": Family("SmolLM3ForCausalLM", frozenset({"no_rope_layers", "sliding_window"})),
    "mixtral": Family("MixtralForCausalLM", frozenset({"sliding_window"}), moe="must", dense="mistral"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", frozenset({"qk_norm", "sliding_window"}), moe="must", dense="qwen3"),
}


# option -> (is it set?, how the field and its value read, why the family lacks it (``{cls}``:
# its transformers class, ``{have}``: the families that have it), how to turn it off)
OPTIONS: dict[str, tuple[Callable[[ModelArgs], bool], Callable[[ModelArgs], str], str, str]] = {
    "qkv_bias": (
        lambda m: m.qkv_bias,
        lambda m: "model.qkv_bias: true",
        "{cls} has no biases on q, k and v alone",
        "qkv_bias: false",
    ),
    "qk_norm": (lambda m: m.qk_norm, lambda m: "model.qk_norm: true", "{cls} has no q/k norms", "qk_norm: false"),
    "no_rope_layers": (
        lambda m: bool(m.no_rope_layers),
        lambda m: f"model.no_rope_layers ({m.no_rope_layers})",
        "{cls} rotates every layer",
        "no_rope_layers: []",
    ),
    "sliding_window": (
        lambda m: m.sliding_window is not None,
        lambda m: f"model.sliding_window ({m.sliding_window})",
        "nanotrain maps a sliding window for {have} only",
        "sliding_window: null",
    ),
    "rope_scaling": (
        lambda m: m.rope_scaling is not None,
        lambda m: "model.rope_scaling",
        "nanotrain maps rope_scaling for {have} only",
        "remove model.rope_scaling",
    ),
}


def _fail(message: str):
    raise ConfigError(message)


def _having(option: str, moe: bool) -> list[str]:
    """The families that have ``option`` and take (``moe``) or go without a ``model.moe`` section."""
    return [
        name
        for name, fam in FAMILIES.items()
        if option in fam.options and (fam.moe != "no" if moe else fam.moe != "must")
    ]


def validate_family(config: Config) -> None:
    """``model``'s options against ``model.family``'s table; raises ``ConfigError`` (one line)."""
    m = config.model
    name, fam = m.family, FAMILIES[m.family]
    cls = f"transformers' {fam.hf_class}"
    if m.moe is None and fam.moe == "must":
        _fail(
            f"model.family {name} needs a model.moe section ({cls} routes every layer through experts): "
            f"add model.moe (e.g. {{num_experts: 8, top_k: 2}}), or set model.family: {fam.dense}"
        )
    if m.moe is not None and fam.moe == "no":
        _fail(
            f"model.moe is not part of model.family {name} ({cls} has no experts): set model.family: "
            f"{' or '.join(_having_moe(m))}, or remove model.moe"
        )
    for option, (is_set, shown, lack, off) in OPTIONS.items():
        if option in fam.options or not is_set(m):
            continue
        have = _having(option, m.moe is not None)
        reason = lack.format(cls=cls, have=" and ".join(have))
        fix = f"set model.family: {' or '.join(have)}, or {off}" if have else f"set {off}"
        _fail(f"{shown(m)} is not part of model.family {name} ({reason}): {fix}")
    if fam.moe == "must":
        _validate_hf_moe(config, name, cls)


def _having_moe(m: ModelArgs) -> list[str]:
    """The families with experts that also have every option ``m`` sets (``llama``, nanotrain's
    own MoE, last)."""
    used = {option for option, (is_set, *_) in OPTIONS.items() if is_set(m)}
    names = [n for n, f in FAMILIES.items() if f.moe != "no" and n != "llama" and used <= f.options]
    if used <= FAMILIES["llama"].options:
        names.append("llama (nanotrain's own MoE)")
    return names or ["llama (nanotrain's own MoE) without the options of " + m.family]


def _validate_hf_moe(config: Config, name: str, cls: str) -> None:
    """The ``model.moe`` fields a Hugging Face MoE family fixes: no shared experts; Mixtral also
    routes every layer and always renormalises the top-k weights."""
    moe = config.model.moe
    own = "model.family: llama (nanotrain's own MoE)"
    if moe.num_shared_experts:
        _fail(
            f"model.moe.num_shared_experts ({moe.num_shared_experts}) is not part of model.family {name} "
            f"({cls} has no shared experts): set it to 0, or {own}"
        )
    if name != "mixtral":
        return
    if moe.first_dense_layers or moe.layer_frequency != 1:
        _fail(
            f"model.moe.first_dense_layers ({moe.first_dense_layers}) / layer_frequency ({moe.layer_frequency}) "
            f"are not part of model.family mixtral ({cls} routes every layer through experts): set them to 0 "
            f"and 1, or {own}"
        )
    if not moe.norm_topk_prob:
        _fail(
            f"model.moe.norm_topk_prob: false is not part of model.family mixtral ({cls} always renormalises "
            "the top-k weights): set it to true, or model.family: qwen3_moe"
        )
