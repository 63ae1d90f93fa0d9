"""transformers' Llama as the float64 reference the HF tests compare nanotrain with.

* ``in_float64(hf, inv_freq)`` — a loaded ``LlamaForCausalLM`` in float64 throughout;
* ``llama3_inv_freq_float64(config)`` — transformers' own ``rope_type: llama3`` frequencies,
  computed by its function in float64 instead of float32.

Only test modules that already import transformers use this (the rank side, ``hf_ranks``, does not).
"""

from __future__ import annotations

import inspect
import textwrap

import torch


def in_float64(hf, inv_freq: torch.Tensor | None = None):
    """``hf`` in float64 throughout. transformers' Llama-like families cast to fp32 in three places
    whatever the model's dtype (every RMSNorm, q/k norms included: ``hidden_states.to(torch.float32)``;
    RoPE angles: ``inv_freq.float()``; an MoE router's softmax: ``.float()`` / ``dtype=torch.float``),
    which alone caps agreement with a float64 model at ~2e-7. Here those functions run their own
    formulas in float64; everything else is transformers' code as shipped.

    Args:
        hf: the model (changed in place and returned).
        inv_freq: the float64 inverse frequencies its RoPE uses; default plain RoPE's
            ``theta ** (-2i / head_dim)`` (a scaled RoPE passes its own, e.g. ``llama3_inv_freq_float64``).
    """
    hf = hf.double()
    if any(type(m).__name__.endswith("TopKRouter") for m in hf.modules()):
        hf.set_experts_implementation("eager")  # the default grouped GEMM takes no float64
    cfg = hf.config
    if inv_freq is None:
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    assert inv_freq.dtype == torch.float64 and hf.model.rotary_emb.attention_scaling == 1.0

    def rope(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms_norm(norm):
        def forward(h):
            return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

        return forward

    hf.model.rotary_emb.forward = rope
    for module in hf.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = rms_norm(module)
        elif kind.endswith("TopKRouter"):
            module.forward = _router(module)
    return hf


def _router(router):
    """transformers' MoE router (Mixtral, Qwen3-MoE) with its softmax in the model's dtype: softmax,
    top-k, the k weights renormalised unless ``norm_topk_prob`` is off (Mixtral always renormalises)."""

    def forward(h):
        logits = torch.nn.functional.linear(h.reshape(-1, router.hidden_dim), router.weight)
        top, index = torch.topk(logits.softmax(dim=-1), router.top_k, dim=-1)
        if getattr(router, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, index

    return forward


def llama3_inv_freq_float64(config) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters`` of ``config`` (a ``LlamaConfig`` with
    ``rope_type: llama3``), run in float64: its source as installed, with its one float32 cast
    (``dtype=torch.float``) made ``torch.float64``, executed in its own module's namespace."""
    from transformers import modeling_rope_utils as rope_utils

    source = textwrap.dedent(inspect.getsource(rope_utils._compute_llama3_parameters))
    cast = "dtype=torch.float)"
    assert source.count(cast) == 1, "transformers' llama3 RoPE changed: update this helper"
    namespace = dict(vars(rope_utils))
    exec(compile(source.replace(cast, "dtype=torch.float64)"), rope_utils.__file__, "exec"), namespace)
    inv_freq, attention_factor = namespace["_compute_llama3_parameters"](config, torch.device("cpu"))
    assert inv_freq.dtype == torch.float64 and attention_factor == 1.0
    return inv_freq
