"""The Llama's numbers read from the module itself: a plain model on the meta device is built in
milliseconds and holds no storage, and its parameters are what the arithmetic of ``llama_arch``
(the torch-free twin kept for ``--dry-run`` and ``--plan``) must agree with.

FLOPs follow ``llama_arch``'s PaLM convention: ``6 * N_matmul + 12 * L * H * S`` per training
token, ``N_matmul`` the weights a token multiplies (every linear, the LM head even when tied, the
router and ``top_k`` of each MoE layer's routed experts), ``H`` each layer's query features.
"""

from __future__ import annotations

from torch import nn

from nanotrain.models.llama import Attention, LlamaModel
from nanotrain.models.moe import MoEFeedForward, Router


def query_features(attn: Attention) -> int:
    """Query heads x head_dim of an attention module, from its fused ``qkv`` width."""
    return attn.qkv.out_features * attn.group // (attn.group + 2)


def matmul_parameters(module: nn.Module) -> int:
    """Weights one token multiplies in ``module``'s forward: linears and routers whole, routed
    experts ``top_k / num_experts`` of them."""
    total = 0
    for m in module.modules():
        if isinstance(m, (nn.Linear, Router)):
            total += m.weight.numel()
        elif isinstance(m, MoEFeedForward):
            routed = sum(p.numel() for p in m.experts.parameters())
            total += routed * m.moe.top_k // m.moe.num_experts
    return total


def attention_forward_flops(module: nn.Module, seq_len: int) -> int:
    """Forward FLOPs per token of the attention scores and weighted sums in ``module``
    (``4 * H * S`` per layer: full S x S, as the PaLM convention counts them; an upper bound of
    the causal and of the document-masked work, ``data.document_masking``)."""
    return sum(4 * query_features(m) * seq_len for m in module.modules() if isinstance(m, Attention))


def training_flops_per_token(model: LlamaModel, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward)."""
    return 6 * matmul_parameters(model) + 3 * attention_forward_flops(model, seq_len)


def total_parameters(model: nn.Module) -> int:
    """``sum(numel)`` over distinct parameters (a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "query_features",
    "matmul_parameters",
    "attention_forward_flops",
    "training_flops_per_token",
    "total_parameters",
]
