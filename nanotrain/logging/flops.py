"""Model FLOPs per token and GPU peak throughput: the two numbers MFU is a ratio of.

MFU is only comparable across codebases when the FLOP count is a property of the *model* (not of
what this implementation happens to execute), so activation recomputation, padding of the
vocabulary to a multiple of tp and the causal mask are deliberately not counted. We use the
PaLM convention (Chowdhery et al. 2022, appendix B), which is also torchtitan's
`get_num_flop_per_token`:

    training FLOPs / token = 6 * N_matmul + 12 * L * H * S

* `N_matmul`: weights that multiply every token — per layer the fused q/k/v projection (GQA:
  H * (H + 2 * kv_heads * head_dim)), o_proj (H * H), SwiGLU gate + up + down (3 * H * F) — plus
  the LM head (V * H), counted even when it is tied to the embedding because the head matmul is
  computed either way. The embedding lookup and the RMSNorm weights do no matmul and are left out.
  `6 = 2 (multiply-add) * 3 (forward + backward for activations and for weights)`.
* `12 * L * H * S`: attention scores QK^T and the weighted sum AV, 2 * 2 * S * H forward per layer
  per token, times 3 for forward + backward, over the full S x S matrix (no halving for the
  causal mask, as in PaLM/torchtitan; this is "model FLOPs", not "hardware FLOPs"). GQA does not
  change it: scores are computed for every query head, H = heads * head_dim.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from nanotrain.config import ModelArgs


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the unsharded model, split the way the FLOP count needs them."""

    embedding: int
    per_layer_matmul: int   # qkv + o_proj + gate/up/down of one decoder layer
    per_layer_norm: int     # the two RMSNorm weights of one decoder layer
    num_layers: int
    final_norm: int
    lm_head: int            # 0 when tied to the embedding

    @property
    def total(self) -> int:
        """What `sum(p.numel() for p in model.parameters())` gives at tp=1 (tied weights once)."""
        return (self.embedding + self.num_layers * (self.per_layer_matmul + self.per_layer_norm)
                + self.final_norm + self.lm_head)

    @property
    def matmul(self) -> int:
        """N_matmul of the module docstring: layer matmuls plus the (possibly tied) head."""
        head = self.lm_head or self.embedding
        return self.num_layers * self.per_layer_matmul + head


def parameter_count(args: ModelArgs) -> ParamCount:
    """Counted from the architecture of `nanotrain.models.llama` (no bias anywhere)."""
    hidden, ffn, vocab = args.hidden_size, args.intermediate_size, args.vocab_size
    head_dim = hidden // args.num_attention_heads
    q_out = args.num_attention_heads * head_dim
    kv_out = (args.num_key_value_heads or args.num_attention_heads) * head_dim
    qkv = hidden * (q_out + 2 * kv_out)
    o_proj = q_out * hidden
    mlp = 3 * hidden * ffn  # gate and up (fused in the model), down
    return ParamCount(embedding=vocab * hidden, per_layer_matmul=qkv + o_proj + mlp,
                      per_layer_norm=2 * hidden, num_layers=args.num_layers, final_norm=hidden,
                      lm_head=0 if args.tie_word_embeddings else vocab * hidden)


def attention_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """12 * L * H * S: QK^T and AV, forward + backward, full (non-causal) S x S."""
    head_dim = args.hidden_size // args.num_attention_heads
    return 12 * args.num_layers * args.num_attention_heads * head_dim * seq_len


def training_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward), PaLM convention; see module doc."""
    return 6 * parameter_count(args).matmul + attention_flops_per_token(args, seq_len)


# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets, matched
# against `torch.cuda.get_device_name()`. Order matters: the first pattern that matches wins, so
# variants (H100 PCIe, GH200, L40S) come before the names they contain (H100, H200, L40).
_PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    (r"GB200", 2500.0),
    (r"B200", 2250.0),
    (r"B100", 1750.0),
    (r"GH200", 989.0),
    (r"H200.*NVL", 835.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|H800", 989.0),        # SXM ("NVIDIA H100 80GB HBM3") and H800
    (r"A100|A800", 312.0),        # SXM and PCIe have the same tensor peak
    (r"A30\b", 165.0),
    (r"A40\b", 149.7),
    (r"A10\b", 125.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"RTX 4090", 165.2),
    (r"RTX 3090", 71.0),
    (r"MI325X|MI300X", 1307.4),
    (r"MI250X", 383.0),
]


def peak_bf16_tflops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak of one GPU, or None for a CPU, an unknown GPU, or one without bf16 (V100):
    an MFU against a guessed peak would be worse than none."""
    if not device_name:
        return None
    for pattern, tflops in _PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops
    return None
