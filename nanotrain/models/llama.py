"""Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention) built from tensor-parallel layers.

Read it like nanoGPT: embedding -> decoder layers -> final norm -> LM head -> loss. Activations are
sequence-first `[S, B, H]` so that sequence-parallel shards (tp_mode REDUCE_SCATTER) are contiguous.
Under REDUCE_SCATTER the norms and residual adds see `[S/tp, B, H]`; the column linears gather the
sequence and the row linears scatter it again, so attention always sees the whole sequence.
Under context parallelism (``cp_pg``) a rank holds S/cp tokens of every sequence and attention
gathers the keys and values of the others (``parallel/context_parallel.py``).

One class serves every pipeline stage: the model is declared as PipelineBlocks on every rank and
each rank builds only the blocks of its stage(s). Parameter names are global
(`layers.7.attn.qkv.weight` is the same name on whichever stage holds layer 7), and every
parameter is initialised from its full tensor drawn from a generator seeded by (seed, name), so
any (tp, pp) starts from the exact weights of the single-process model.
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from nanotrain.config import ModelArgs
from nanotrain.models import llama_arch
from nanotrain.models.mlp import MLP
from nanotrain.models.moe import MoEFeedForward, MoEState
from nanotrain.models.recompute import compile_layers_, recomputed
from nanotrain.parallel import accelerator
from nanotrain.parallel.context_parallel import SDPA_GQA, ContextParallel, sdpa
from nanotrain.parallel.pipeline_parallel import MessageSpec, PipelineBlock, mark_tied_, place_blocks
from nanotrain.parallel.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelLinearMode,
    TensorParallelRowLinear,
    column_linear,
    group_size,
    has_sequence_parallel_partial_grad,
    init_from_full_,
    mark_sequence_parallel_partial_grad_,
    sharded_cross_entropy,
)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for reductions and rotations (bf16 in, fp32 math; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """Replicated over tp. Under sequence parallelism each tp rank sees a different sequence shard,
    so its weight gradient is partial: the model marks it, and the training step sums marked
    gradients over tp (one coalesced all-reduce per step, not one per norm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 math, output in the input's dtype: a bf16 residual stream under autocast stays
        bf16 into the next linear (and its tp all-gather), as with Megatron's bf16 weights."""
        wide = upcast(x)
        variance = wide.pow(2).mean(-1, keepdim=True)
        return (wide * torch.rsqrt(variance + self.eps) * self.weight.to(wide.dtype)).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [S, 1, 1, head_dim] (HF Llama convention: halves rotated together)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]  # float64; apply_rope casts


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return (x.to(dtype) * cos.to(dtype) + rotated.to(dtype) * sin.to(dtype)).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal attention over local heads; under context parallelism the queries
    of this rank's tokens attend to the keys and values of the whole sequence, gathered over cp
    (see ``parallel/context_parallel.py``)."""

    def __init__(self, args: ModelArgs, tp_pg, mode: TensorParallelLinearMode, async_comm: bool,
                 cp: ContextParallel, selective: bool = False):
        super().__init__()
        self.cp, self.selective = cp, selective
        tp = group_size(tp_pg)
        self.head_dim = args.hidden_size // args.num_attention_heads
        kv_heads = args.num_key_value_heads or args.num_attention_heads
        self.local_heads = args.num_attention_heads // tp
        self.local_kv_heads = kv_heads // tp
        q_out, kv_out = args.num_attention_heads * self.head_dim, kv_heads * self.head_dim
        self.qkv = TensorParallelColumnLinear(args.hidden_size, q_out + 2 * kv_out, tp_pg, mode,
                                              async_communication=async_comm,
                                              contiguous_chunks=(q_out, kv_out, kv_out))
        self.o_proj = TensorParallelRowLinear(q_out, args.hidden_size, tp_pg, mode,
                                              async_communication=async_comm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [S, B, (hq + 2 hkv) * d] local heads, full sequence
        seq, batch = qkv.shape[0], qkv.shape[1]
        d = self.head_dim
        q, k, v = qkv.split([self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d], dim=-1)
        q = apply_rope(q.view(seq, batch, self.local_heads, d), cos, sin)
        k = apply_rope(k.view(seq, batch, self.local_kv_heads, d), cos, sin)
        v = v.view(seq, batch, self.local_kv_heads, d)
        if self.cp.enabled:  # keys/values of the whole sequence (this rank's queries: S/cp)
            k, v = self.cp.gather_kv(k, v)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, d]
        if self.local_kv_heads != self.local_heads and not SDPA_GQA:
            repeat = self.local_heads // self.local_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = recomputed(self._core, q, k, v, enabled=self.selective)  # selective: not kept for backward
        out = out.permute(2, 0, 1, 3).reshape(seq, batch, self.local_heads * d)
        return self.o_proj(out)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``[B, heads, S, d]``: what ``recompute: selective`` recomputes."""
        return self.cp.attention(q, k, v) if self.cp.enabled else sdpa(q, k, v, is_causal=True)


class DecoderLayer(nn.Module):
    """Attention then a feed-forward: the dense ``MLP``, or ``MoEFeedForward`` when layer ``index``
    is an MoE layer (``llama_arch.is_moe_layer``; its experts sharded over ``ep_pg``)."""

    def __init__(self, args: ModelArgs, tp_pg, mode: TensorParallelLinearMode, async_comm: bool,
                 cp: ContextParallel, index: int = 0, ep_pg=None, moe_state: MoEState | None = None,
                 selective: bool = False):
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, tp_pg, mode, async_comm, cp, selective)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if llama_arch.is_moe_layer(args, index):
            self.mlp = MoEFeedForward(args, tp_pg, mode, async_comm, ep_pg, moe_state, selective)
        else:
            self.mlp = MLP(args, tp_pg, mode, async_comm, selective)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """A Llama, or this pipeline rank's part of one (pp_size > 1).

    Every piece (`embed`, `layers.<i>`, `final_norm`, `lm_head` when untied) is a PipelineBlock
    declared on every rank; `place_blocks` splits them into pp_size * virtual_stages stages of
    balanced cost and builds only this rank's, whose chunks are `self.chunks` (one, or
    `virtual_stages` for the interleaved schedule). With tied embeddings the last stage builds a
    replica of `embed` for the LM head (see `pipeline_parallel/tied.py`).

    forward(input_ids [B,S] or hidden [S(/tp),B,H], targets [B,S], chunk) runs one chunk and
    returns the hidden state for the next stage, or — on the last stage — the mean token loss
    (fp32 scalar), or the logits when no targets are given. With a ``cp_pg`` of size cp > 1 every
    rank is given the full ``[B, S]`` ids and targets and keeps its S/cp tokens (zig-zag chunks);
    hidden states, logits and the loss are those of its tokens.
    """

    def __init__(self, args: ModelArgs, tp_pg, *, mode: str | TensorParallelLinearMode = "ALL_REDUCE",
                 async_communication: bool = False, pp_rank: int = 0, pp_size: int = 1,
                 virtual_stages: int = 1, seed: int = 0, device=None,
                 compute_dtype: torch.dtype | str | None = None, cp_pg=None, ep_pg=None, recompute: str = "none",
                 compile_layers: bool = False):
        super().__init__()
        self.args, self.tp_pg, self.ep_pg = args, tp_pg, ep_pg
        self.moe_state = MoEState()  # aux-loss scale and routing statistics of the MoE layers
        # training.recompute (see models/recompute.py); "full" wraps whole layers in _forward.
        self.recompute = llama_arch.check_recompute(recompute)
        selective = recompute == "selective"
        self.cp = cp = ContextParallel(cp_pg)
        # bf16 on GPU: the forward runs under autocast; weights, grads and optimizer stay fp32.
        # A name ("bfloat16", config.model.dtype) is accepted so that llama_arch.model_kwargs,
        # which the torch-free planner imports, can pass the config's value as it is.
        self.compute_dtype = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
        self.mode = TensorParallelLinearMode(mode)
        self.async_communication = async_communication
        self.head_dim = args.hidden_size // args.num_attention_heads
        mode = self.mode
        # Costs and attachments come from llama_arch, whose parameter counts follow the same split.
        spec = {b.name: b for b in llama_arch.pipeline_blocks(args)}
        self.embed = _declare(spec["embed"], lambda: TensorParallelEmbedding(args.vocab_size, args.hidden_size,
                                                                             tp_pg, mode))
        self.layers = nn.ModuleDict({str(i): _declare(spec[f"layers.{i}"],
                                                      lambda i=i: DecoderLayer(args, tp_pg, mode, async_communication,
                                                                               cp, i, ep_pg, self.moe_state,
                                                                               selective))
                                     for i in range(args.num_layers)})
        self.final_norm = _declare(spec["final_norm"], lambda: RMSNorm(args.hidden_size, args.rms_norm_eps))
        self.lm_head = None if "lm_head" not in spec else _declare(
            spec["lm_head"], lambda: TensorParallelColumnLinear(args.hidden_size, args.vocab_size, tp_pg, mode,
                                                                async_communication=async_communication,
                                                                pad_to_tp=True))
        blocks = [self.embed, *self.layers.values(), self.final_norm] + ([self.lm_head] if self.lm_head else [])
        self.chunks = place_blocks(blocks, pp_rank, pp_size, virtual_stages if pp_size > 1 else 1)
        if args.tie_word_embeddings and pp_size > 1 and (self.embed.is_built or self.final_norm.is_built):
            replica = not self.embed.is_built
            self.embed.build()
            mark_tied_(self.embed.weight, "embed.weight", replica=replica)
        if self.mode is TensorParallelLinearMode.REDUCE_SCATTER and group_size(tp_pg) > 1:
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    mark_sequence_parallel_partial_grad_(param)
        if device is not None:
            self.to(device)
        self.init_weights(seed)
        if compile_layers:  # after init: compiling wraps the call, names and weights are unchanged
            compile_layers_([layer.module for layer in self.layers.values() if layer.is_built], self.device.type)

    # ------------------------------------------------------------------ init
    def init_weights(self, seed: int) -> None:
        """Every parameter from its full tensor, seeded by (seed, name): identical for any tp/pp."""
        scaled_std = self.args.init_std / math.sqrt(2 * self.args.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                init_from_full_(param, lambda full: full.fill_(1.0))
                continue
            std = scaled_std if name.endswith(("o_proj.weight", "down.weight")) else self.args.init_std
            generator = torch.Generator().manual_seed(param_seed(seed, name))
            init_from_full_(param, lambda full: full.normal_(0.0, std, generator=generator))

    def begin_step(self, microbatches: int) -> None:
        """Before a step's micro-batches: the MoE auxiliary losses' gradient scale (the engines
        divide each micro-batch's loss by their count) and fresh routing statistics."""
        self.moe_state.begin_step(microbatches)

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Params replicated over tp whose gradients are partial sums under REDUCE_SCATTER."""
        return [p for p in self.parameters() if has_sequence_parallel_partial_grad(p)]

    # ------------------------------------------------------------------ forward
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def residual_dtype(self) -> torch.dtype:
        """dtype of the hidden states between layers and stages: the compute dtype under
        autocast (bf16: half the activation memory and pipeline bytes, as Megatron and nanotron),
        else the parameters' dtype."""
        if self.compute_dtype not in (None, torch.float32):
            return self.compute_dtype
        return next(self.parameters()).dtype

    def pipeline_message(self, micro_batch_size: int, sequence_length: int) -> MessageSpec:
        """What crosses every pipeline stage boundary for micro-batches of ``[B, S]`` tokens:
        this rank's hidden state ``[S / cp (/ tp under REDUCE_SCATTER), B, H]``."""
        seq = sequence_length // self.cp.size
        if self.mode is TensorParallelLinearMode.REDUCE_SCATTER:
            seq //= group_size(self.tp_pg)
        return MessageSpec((seq, micro_batch_size, self.args.hidden_size), self.residual_dtype)

    def forward(self, input_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        device = self.device
        _check_input("input_ids", input_ids, device, integer=True)
        _check_input("targets", targets, device, integer=True)
        _check_input("hidden", hidden, device, integer=False)
        if self.compute_dtype in (None, torch.float32):
            return self._forward(input_ids, targets, hidden, chunk)
        with accelerator.autocast(device.type, dtype=self.compute_dtype):
            return self._forward(input_ids, targets, hidden, chunk)

    def _forward(self, input_ids, targets, hidden, chunk: int) -> torch.Tensor:
        part = self.chunks[chunk]
        if self.embed in part:
            hidden = self.embed(self.cp.local(input_ids).transpose(0, 1).contiguous()).to(self.residual_dtype)
        cos, sin = self._rope(self._full_seq_len(hidden), hidden)
        full = self.recompute == "full"
        for layer in self.layers.values():
            if layer in part:  # full: only the layer's input is kept, its forward reruns in backward
                hidden = recomputed(layer, hidden, cos, sin, enabled=full, replay=self.moe_state.replaying)
        if not part.is_last:
            return hidden
        hidden = self.final_norm(hidden)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:  # tied: the embedding matrix (or its replica on the last stage) is the vocab-parallel head
            logits = column_linear(hidden, self.embed.weight, None, self.tp_pg, self.mode,
                                   self.async_communication)
        if targets is None:
            return logits
        losses = sharded_cross_entropy(logits, self.cp.local(targets).transpose(0, 1).contiguous(), self.tp_pg,
                                       self.args.vocab_size)
        return losses.mean()

    def _rope(self, seq: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_tables`` at this rank's token positions (all of them, or its cp share), cast to
        the dtype ``apply_rope`` computes in (fp32, or fp64 for an fp64 model): built once per
        (length, device, dtype), not in every forward."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        key = (seq, hidden.device, dtype)
        cache = self.__dict__.setdefault("_rope_cache", {})
        if key not in cache:
            cos, sin = rope_tables(seq, self.head_dim, self.args.rope_theta, hidden.device)
            if self.cp.enabled:
                positions = self.cp.positions(seq, hidden.device)
                cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
            cache[key] = (cos.to(dtype), sin.to(dtype))
        return cache[key]

    def _full_seq_len(self, hidden: torch.Tensor) -> int:
        """The whole sequence's length from a hidden state holding this rank's tokens."""
        sequence_parallel = self.mode is TensorParallelLinearMode.REDUCE_SCATTER
        local = hidden.shape[0] * (group_size(self.tp_pg) if sequence_parallel else 1)
        return local * self.cp.size


def _check_input(name: str, tensor: torch.Tensor | None, device: torch.device, integer: bool) -> None:
    """The model's entry contract (host metadata only, no sync): inputs already on the model's
    device — on a GPU a CPU batch would otherwise fail deep inside an embedding or the loss."""
    if tensor is None:
        return
    if tensor.device != device:
        raise RuntimeError(f"LlamaModel: {name} is on {tensor.device}, the model on {device}; move "
                           f"batches to the device first (the trainer's BatchPrefetcher does)")
    if integer and tensor.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"LlamaModel: {name} must be int64/int32 token ids, got {tensor.dtype}")


def _declare(spec: llama_arch.Block, builder) -> PipelineBlock:
    """A block with the cost and attachment that llama_arch counts parameters and stages with."""
    return PipelineBlock(builder, spec.cost, attach=spec.attach)


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
