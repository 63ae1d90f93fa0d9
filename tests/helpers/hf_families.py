"""The Hugging Face families as tiny random ``transformers`` models, saved as a user downloads them.

One entry per family (``FAMILIES``): its transformers config class and the options that make it
that family, each switched on (GQA everywhere; Mistral's window at least the sequence; Qwen2's
q/k/v biases; Qwen3's per-head q/k norms with a head size that is not hidden / heads; SmolLM3's
no-RoPE layer beside a RoPE one; Mixtral's 4 experts, top 2; Qwen3-MoE's dense layer 0 and
sparse layer 1, top-k weights not renormalised). Weights are random but shaped so that a
mapping slip shows: norms away from 1, biases away from 0, sharp q/k (positions matter), and
RoPE bases that differ per family. Only test modules that already import transformers use this.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    pad_token_id=None,  # SmolLM3's default pad id 128004 is outside a 256-token vocabulary
    bos_token_id=None,
    eos_token_id=None,
)


def _rope(theta: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


FAMILIES: dict[str, tuple[str, dict]] = {
    "mistral": ("MistralConfig", dict(sliding_window=128, **_rope(1e6))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False, **_rope(1e6))),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True, **_rope(5e5))),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0], tie_word_embeddings=True, **_rope(2e6))),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, **_rope(1e6))),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=2,  # layer 1 sparse, layer 0 dense
            norm_topk_prob=False,
            head_dim=32,
            **_rope(1e6),
        ),
    ),
}
MOE = ("mixtral", "qwen3_moe")
# Llama itself, for the tests that cover every family nanotrain has (test_hf_families compares the
# six others; Llama's own tests are test_hf.py and test_hf_llama3.py).
LLAMA = ("LlamaConfig", dict(**_rope(5e5)))


def make_hf_dir(name: str, root: Path) -> Path:
    """``FAMILIES[name]`` (or ``LLAMA``) built by transformers with a fixed seed and saved under ``root / name``."""
    cls, options = LLAMA if name == "llama" else FAMILIES[name]
    torch.manual_seed(11)
    cfg = getattr(transformers, cls)(**BASE, **options)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):  # every RMSNorm, q/k norms too: a missed one shows
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):  # zero biases would hide a lost or misplaced one
                p.uniform_(-0.5, 0.5)
            elif n.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention: positions matter
                p.mul_(3.0)
    path = root / name
    hf.save_pretrained(str(path))
    return path


def load(path: Path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
