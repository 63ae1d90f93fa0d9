"""The PyTorch-native baseline: a Llama as a torch.distributed user would write it (torchtitan style).

Same math as ``nanotrain.models.llama`` (RMSNorm, RoPE with rotated halves, SwiGLU, grouped-query
attention, untied LM head, mean token cross-entropy) and the same initial weights, but written
the way the native parallel APIs expect it:

* batch-first activations ``[B, T, H]``; separate ``wq``/``wk``/``wv`` and ``w1`` (gate) / ``w3`` (up)
  projections, each an ``nn.Linear``, so that ``ColwiseParallel``/``RowwiseParallel`` apply per
  projection; the attention reshapes with ``view(B, T, -1, head_dim)`` so it runs on the local heads;
* layers in an index-keyed ``nn.ModuleDict``, so a pipeline stage keeps the full model's names;
* ``apply_tp``: ``parallelize_module`` with Colwise/Rowwise (+ ``SequenceParallel`` norms and
  ``PrepareModuleInput`` for sequence parallelism), vocab-parallel embedding (Rowwise) and LM head
  (Colwise, ``Shard(-1)`` logits for ``loss_parallel``), as torchtitan's ``parallelize_llama``;
* ``pipeline_stage_module``: the full model with the modules of other stages deleted, for
  ``torch.distributed.pipelining.PipelineStage`` (torchtitan's manual split);
* ``apply_dp``: FSDP2-based ``replicate`` (``replicate_with_fsdp``) or ``fully_shard`` on the dp mesh:
  DDP cannot wrap DTensor modules and the legacy ``_composable.replicate`` is wrong with TP/PP
  (see benchmarks/README.md).

``init_like_nanotrain`` draws every weight exactly as ``LlamaModel.init_weights`` does (the same
full tensors from the same (seed, name) generators, fused ones split into their parts), so both
sides start from bit-identical weights and their first losses agree to rounding.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # local heads under TP
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, d]
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)  # gate
        self.w2 = nn.Linear(ffn, hidden, bias=False)  # down
        self.w3 = nn.Linear(hidden, ffn, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        kv = args.num_key_value_heads or args.num_attention_heads
        self.attention_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attention = Attention(args.hidden_size, args.num_attention_heads, kv)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.feed_forward = FeedForward(args.hidden_size, args.intermediate_size)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_cos_sin(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, d] tables, halves rotated together (HF Llama convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[: x.shape[1]] + rotated * sin[: x.shape[1]]


class NativeLlama(nn.Module):
    """tokens [B, T] -> logits [B, T, V] (or, as a pipeline stage, hidden -> hidden / logits)."""

    def __init__(self, args, seq_len: int):
        super().__init__()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.num_layers)})
        self.norm: Optional[nn.RMSNorm] = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        cos, sin = rope_cos_sin(seq_len, args.hidden_size // args.num_attention_heads, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss; works on plain logits and, under ``loss_parallel()``, on Shard(-1) DTensors."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


# ----------------------------------------------------------------------------- same init
def init_like_nanotrain(model: NativeLlama, seed: int) -> None:
    """The full tensors ``nanotrain.models.llama.LlamaModel.init_weights`` draws, by its names."""
    from nanotrain.models.llama import param_seed

    args = model.args
    std, scaled = args.init_std, args.init_std / math.sqrt(2 * args.num_layers)

    def draw(name: str, shape, s: float) -> torch.Tensor:
        g = torch.Generator().manual_seed(param_seed(seed, name))
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, s, generator=g)

    h = args.hidden_size
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # every RMSNorm weight
        model.tok_embeddings.weight.copy_(draw("embed.weight", (args.vocab_size, h), std))
        model.output.weight.copy_(draw("lm_head.weight", (args.vocab_size, h), std))
        for i, layer in model.layers.items():
            a, f = layer.attention, layer.feed_forward
            q, kv = a.wq.out_features, a.wk.out_features
            qkv = draw(f"layers.{i}.attn.qkv.weight", (q + 2 * kv, h), std)
            a.wq.weight.copy_(qkv[:q]), a.wk.weight.copy_(qkv[q : q + kv]), a.wv.weight.copy_(qkv[q + kv :])
            a.wo.weight.copy_(draw(f"layers.{i}.attn.o_proj.weight", (h, q), scaled))
            ffn = f.w1.out_features
            gate_up = draw(f"layers.{i}.mlp.gate_up.weight", (2 * ffn, h), std)
            f.w1.weight.copy_(gate_up[:ffn]), f.w3.weight.copy_(gate_up[ffn:])
            f.w2.weight.copy_(draw(f"layers.{i}.mlp.down.weight", (h, ffn), scaled))


def build_native(args, seq_len: int, seed: int) -> NativeLlama:
    if args.tie_word_embeddings:
        raise ValueError("the native baseline is written for untied embeddings")
    model = NativeLlama(args, seq_len)
    init_like_nanotrain(model, seed)
    return model


# ----------------------------------------------------------------------------- parallelisms
def apply_tp(model: NativeLlama, tp_mesh, sequence_parallel: bool, loss_parallel: bool = True) -> NativeLlama:
    """torchtitan's ``apply_tp``: Colwise q/k/v and w1/w3, Rowwise wo and w2, vocab-parallel
    embedding and head; with ``sequence_parallel`` the norms and residual stream are sequence
    shards (``Shard(1)``) and the attention / MLP inputs are gathered by ``PrepareModuleInput``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()
        )
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    for layer in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        if sp:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(layer, tp_mesh, plan)
    return model


def pipeline_stage_module(full: NativeLlama, layer_ids: Sequence[int], first: bool, last: bool) -> NativeLlama:
    """A copy of ``full`` holding only ``layer_ids`` (and the embedding / norm+head on the first /
    last stage): torchtitan's manual pipeline split. Names stay those of the full model."""
    stage = copy.deepcopy(full)
    keep = {str(i) for i in layer_ids}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm, stage.output = None, None
    return stage


def apply_dp(model: nn.Module, dp_mesh, kind: str = "replicate") -> nn.Module:
    """FSDP2 ``replicate`` (DDP semantics, composes with DTensor TP and pipelining) or
    ``fully_shard``, per transformer block and then the root (torchtitan's order)."""
    if kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
    elif kind == "fully_shard":
        from torch.distributed.fsdp import fully_shard as wrap
    else:
        raise ValueError(kind)
    for layer in model.layers.values():
        wrap(layer, mesh=dp_mesh)
    wrap(model, mesh=dp_mesh)
    return model


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as ``nanotrain.optim.weight_decay_groups``: decay on matrices, not on norms."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
