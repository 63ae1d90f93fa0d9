"""The ``model:`` section of the config schema: the architecture (``ModelArgs``), its mixture of
experts (``MoEArgs``) and its RoPE scaling (``RopeScalingArgs``); ``schema.py`` holds the other
sections and the ``Config`` that gathers them (see its docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from nanotrain.config.fields import MAX_LAYERS, bounded, doc


@dataclass
class MoEArgs:
    """``model.moe``: which decoder layers replace their SwiGLU MLP by routed SwiGLU experts.

    Router: softmax over all experts, top-k, weights renormalised over the k (``norm_topk_prob``). Layer i is
    MoE when ``i >= first_dense_layers`` and ``(i - first_dense_layers) % layer_frequency == 0``."""

    num_experts: int = bounded(8, 1, 65536, doc="routed experts per MoE layer")
    top_k: int = bounded(2, 1, 65536, doc="experts each token is sent to (<= num_experts)")
    expert_intermediate_size: Optional[int] = bounded(
        None, 1, doc="SwiGLU width of one expert; null = model.intermediate_size"
    )
    num_shared_experts: int = bounded(
        0, 0, 1024, doc="0 = Mixtral; >= 1 = DeepSeek/Qwen: an always-on SwiGLU of this many experts' width"
    )
    layer_frequency: int = bounded(1, 1, doc="every k-th layer (after first_dense_layers) is MoE")
    first_dense_layers: int = bounded(0, 0, doc="leading decoder layers that stay dense")
    aux_loss_coef: float = bounded(0.01, 0.0, 1e3, doc="Switch/Mixtral load-balancing loss weight")
    z_loss_coef: float = bounded(0.0, 0.0, 1e3, doc="router z-loss weight (ST-MoE)")
    capacity_factor: Optional[float] = bounded(
        None,
        0.0,
        1e3,
        doc="null = dropless; else tokens per expert capped at ceil(factor * tokens * top_k / num_experts)",
        above=True,
    )
    norm_topk_prob: bool = doc(
        True,
        "renormalise the top_k router weights to sum to 1 (Mixtral, Qwen3-MoE's usual setting); "
        "false keeps the softmax probabilities (Qwen3-MoE's transformers default)",
    )


@dataclass
class RopeScalingArgs:
    """``model.rope_scaling``: RoPE frequencies stretched for a longer context than pretraining's
    (absent = plain RoPE). ``llama3`` (Llama 3.1-3.3): with wavelength ``2*pi / inv_freq``,
    frequencies whose wavelength is below ``original_max_position_embeddings / high_freq_factor``
    are kept, those above ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, and the band between is interpolated smoothly (Hugging Face's ``rope_type: llama3``)."""

    type: Literal["llama3"] = doc(
        "llama3",
        "scaling scheme; llama3 (Llama 3.1/3.2/3.3) is the one supported",
        why="llama3 is the one scaling nanotrain computes; for plain RoPE remove model.rope_scaling (or set null)",
    )
    factor: float = bounded(
        8.0,
        1.0,
        doc="low frequencies are divided by this (Llama 3.1: 8, Llama 3.2: 32)",
        why="a factor below 1 would shorten the context, not stretch it; Llama 3.1 uses 8.0",
    )
    low_freq_factor: float = bounded(
        1.0, 0.0, doc="wavelengths above original_max_position_embeddings / this are scaled", above=True
    )
    high_freq_factor: float = bounded(
        4.0,
        0.0,
        doc="wavelengths below original_max_position_embeddings / this are kept (> low_freq_factor)",
        above=True,
    )
    original_max_position_embeddings: int = bounded(
        8192, 1, doc="pretraining context the frequencies were trained at (< model.max_position_embeddings)"
    )


@dataclass
class ModelArgs:
    vocab_size: int = bounded(256, 1, doc="tokens; padded to a multiple of tp inside the model")
    hidden_size: int = bounded(128, 1, doc="model width")
    intermediate_size: int = bounded(512, 1, doc="SwiGLU MLP width")
    num_layers: int = bounded(4, 1, MAX_LAYERS, doc="decoder layers")
    num_attention_heads: int = bounded(4, 1, doc="query heads")
    num_key_value_heads: Optional[int] = bounded(None, 1, doc="defaults to num_attention_heads")
    max_position_embeddings: int = bounded(2048, 1, doc="longest sequence RoPE is built for")
    rope_theta: float = bounded(10000.0, 0.0, 1e12, doc="RoPE base", above=True)
    rms_norm_eps: float = bounded(1e-5, 0.0, 1.0, doc="RMSNorm epsilon")
    tie_word_embeddings: bool = doc(False, "LM head shares the embedding matrix")
    dtype: Literal["float32", "bfloat16", "float16"] = doc(
        "bfloat16",
        "compute dtype (autocast, on GPU and CPU); weights, grads and optimizer stay "
        "float32; float16 is refused (no loss scaler)",
    )
    init_std: float = bounded(
        0.02,
        0.0,
        1.0,
        above=True,
        doc="std of the normal init of weights",
        why="all-zero weights get zero gradients, so the model would never learn; the usual value is 0.02",
    )
    moe: Optional[MoEArgs] = doc(None, "mixture of experts (absent = dense): the model.moe fields")
    rope_scaling: Optional[RopeScalingArgs] = doc(
        None, "RoPE scaling for long context (absent = plain RoPE): the model.rope_scaling fields"
    )
    family: Literal["llama", "mistral", "qwen2", "qwen3", "smollm3", "mixtral", "qwen3_moe"] = doc(
        "llama",
        "Hugging Face family (its model_type): the names and config.json that init_from_hf reads and "
        "export writes; the options below say what the model computes",
        why="nanotrain imports and exports these Hugging Face families; "
        "python scripts/hf_config.py DIR prints the section of a directory",
    )
    head_dim: Optional[int] = bounded(
        None, 1, doc="features per attention head; null = hidden_size / num_attention_heads (Qwen3: 128)"
    )
    qkv_bias: bool = doc(False, "bias terms on the q, k and v projections (Qwen2 / Qwen2.5)")
    qk_norm: bool = doc(False, "RMSNorm over each head's features of q and k, before RoPE (Qwen3, Qwen3-MoE)")
    no_rope_layers: list[int] = doc(list, "indices of the decoder layers that apply no RoPE (SmolLM3)")
    sliding_window: Optional[int] = bounded(
        None,
        1,
        doc="attention window in tokens (Mistral); null = full causal attention; at least "
        "training.sequence_length (where it changes nothing), a shorter window is refused",
    )
    attention_kernel: Literal["auto", "sdpa_mask", "flex"] = doc(
        "auto",
        "kernel of document-masked attention (data.document_masking): flex = FlexAttention under a "
        "block mask built from the document ids (compiled, no S x S tensor, skips tiles across documents; "
        "CUDA only for training), sdpa_mask = SDPA under a materialised S x S boolean mask (the exact "
        "reference), auto = flex on CUDA, sdpa_mask elsewhere; the same numbers either way",
    )


def attention_kernel_on(model: ModelArgs, cuda: bool) -> str:
    """``model.attention_kernel`` where it runs: ``auto`` is ``flex`` on CUDA (FlexAttention's
    kernels) and ``sdpa_mask`` elsewhere (torch has no FlexAttention backward on the CPU)."""
    if model.attention_kernel == "auto":
        return "flex" if cuda else "sdpa_mask"
    return model.attention_kernel
