"""Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention) as a plain single-device model, with
the options of the Hugging Face families it imports (``Attention``: a head width of its own,
q/k/v biases, per-head q/k norms, layers without RoPE; ``moe.py``: the routers' top-k weights).

Read it like nanoGPT: embedding -> decoder layers -> final norm -> LM head -> loss. Activations are
sequence-first ``[S, B, H]``, the layout whose sequence shards are contiguous (what sequence and
context parallelism cut). The model knows nothing of parallelism: ``LlamaModel(args)`` is the
whole model on one device, built from its configuration alone. Parallelism is applied from
outside by swapping modules (``models/llama_parallelize.py``): the linears and the embedding for
tensor-parallel ones, the attention ``core`` for the context-parallel one, the experts for the
expert-parallel dispatch, layers and kernels wrapped to rerun in backward. The seams are named
modules:

* ``attn.core`` — causal attention of rotated ``q, k, v`` ``[S, B, heads, d]``; its ``kernel``
  (``[B, heads, S, d]`` in, no parameters, no communication) can rerun in backward instead of
  keeping its output and log-sum-exp;
* ``mlp.act`` — the SwiGLU activation, which can rerun in backward too;
* ``loss`` — per-token cross-entropy of ``[S, B, V]`` logits (a vocab-parallel one under tp);
  with ``loss_chunk_tokens`` the head (final norm, LM head, loss) runs a chunk of tokens at a
  time and recomputes each chunk's logits in backward (``chunked_loss.py``).

A pipeline stage runs the three parts of ``forward`` on its own: ``embed_tokens`` (first stage),
``run_layers`` over the layers it holds, ``head`` (last stage). Layer ``i``'s parameters are named
``layers.<i>....`` whichever stage holds it, and each parameter is initialised from a generator
seeded by (seed, name) (``init_weights``), so every topology starts from the same weights.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.config import ModelArgs, RopeScalingArgs
from nanotrain.models import chunked_loss, llama_arch
from nanotrain.models.mlp import MLP
from nanotrain.models.moe import MoEFeedForward, MoEState
from nanotrain.parallel import accelerator
from nanotrain.parallel.documents import document_attention
from nanotrain.parallel.sdpa import SDPA_GQA, masked_sdpa, sdpa


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for reductions and rotations (bf16 in, fp32 math; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
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


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScalingArgs | None = None, device=None) -> torch.Tensor:
    """RoPE's ``head_dim / 2`` inverse frequencies ``theta ** (-2i / head_dim)`` in float64, with
    ``scaling`` (``model.rope_scaling``, type llama3) applied as Hugging Face's
    ``_compute_llama3_parameters`` does, operation for operation (it computes in float32): with
    wavelength ``2*pi / f``, f is kept below ``original / high_freq_factor``, divided by ``factor``
    above ``original / low_freq_factor``, and in between ``(1 - s) * f / factor + s * f`` with
    ``s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if scaling is None:
        return inv_freq
    original, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScalingArgs | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (float64) of shape ``[S, 1, 1, head_dim]`` at the int ``positions`` ``[S]`` (HF
    Llama convention: the two halves of a head rotate together), of ``inv_frequencies``; per-sample
    ``positions`` ``[S, B]`` (document masking: they restart at each document) give ``[S, B, 1, head_dim]``."""
    inv_freq = inv_frequencies(head_dim, theta, scaling, positions.device)
    if positions.dim() == 1:
        angles = torch.outer(positions.to(torch.float64), inv_freq)
    else:
        angles = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    shape = (positions.shape[0], -1, 1, head_dim)
    return emb.cos().view(shape), emb.sin().view(shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return (x.to(dtype) * cos.to(dtype) + rotated.to(dtype) * sin.to(dtype)).to(x.dtype)


class CausalKernel(nn.Module):
    """Causal attention of ``[B, heads, S, d]`` q, k, v (k/v may have fewer heads); with a boolean
    ``mask`` ``[B, 1, S, S]`` or a FlexAttention block mask (document masking,
    ``parallel/documents.py``, ``model.attention_kernel``) attention under that mask instead. The
    mask is an argument, not state, so a recomputed kernel reruns with it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if mask is None:
            return sdpa(q, k, v, is_causal=True)
        return masked_sdpa(q, k, v, mask)


class CausalCore(nn.Module):
    """Rotated ``q`` ``[S, B, heads, d]`` and ``k, v`` ``[S', B, kv_heads, d]`` -> ``[S, B, heads * d]``
    through ``kernel`` (heads-major layout, grouped-query k/v repeated where torch cannot take them);
    ``mask``: the kernel's block-causal mask (None: causal)."""

    def __init__(self):
        super().__init__()
        self.kernel = CausalKernel()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq, batch, heads, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, d]
        if k.shape[1] != heads and not SDPA_GQA:
            k, v = k.repeat_interleave(heads // k.shape[1], dim=1), v.repeat_interleave(heads // v.shape[1], dim=1)
        return self.kernel(q, k, v, mask).permute(2, 0, 1, 3).reshape(seq, batch, heads * d)


class Attention(nn.Module):
    """Grouped-query causal attention. ``qkv`` holds the rows ``[q | k | v]`` (its bias too, with
    ``qkv_bias``); the head counts of a forward are read from its output width, so a
    tensor-parallel ``qkv`` producing this rank's heads needs no other change.

    ``qk_norm`` (Qwen3): an RMSNorm of one head's width over each head of q and of k, after the
    projection and before RoPE, as transformers' ``Qwen3Attention``; its weight is shared by all
    heads, so under tp a rank's gradient covers its own heads only (the parallelize plan marks it
    to be summed over tp). ``rope`` False (``model.no_rope_layers``, SmolLM3): no rotation."""

    def __init__(self, args: ModelArgs, rope: bool = True):
        super().__init__()
        self.head_dim = llama_arch.head_dim(args)
        self.group = args.num_attention_heads // llama_arch.kv_heads(args)  # query heads per kv head
        q_out, kv_out = llama_arch.query_features(args), llama_arch.kv_heads(args) * self.head_dim
        self.qkv = nn.Linear(args.hidden_size, q_out + 2 * kv_out, bias=args.qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.rope = rope
        self.core = CausalCore()
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [S, B, (heads + 2 kv_heads) * d] over the sequence attention sees
        seq, batch, d = qkv.shape[0], qkv.shape[1], self.head_dim
        kv_heads = qkv.shape[-1] // (d * (self.group + 2))
        heads = kv_heads * self.group
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k = q.view(seq, batch, heads, d), k.view(seq, batch, kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.core(q, k, v.view(seq, batch, kv_heads, d), mask))


class DecoderLayer(nn.Module):
    """Attention then a feed-forward: the dense ``MLP``, or ``MoEFeedForward`` when layer
    ``index`` is an MoE layer (``llama_arch.is_moe_layer``)."""

    def __init__(self, args: ModelArgs, index: int = 0, moe_state: MoEState | None = None):
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, rope=index not in args.no_rope_layers)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if llama_arch.is_moe_layer(args, index):
            self.mlp = MoEFeedForward(args, moe_state if moe_state is not None else MoEState())
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.mlp(self.post_attn_norm(x))


class Embedding(nn.Module):
    """Token ids ``[S, B]`` -> ``[S, B, H]``, in autocast's dtype when it is on (the residual
    stream starts in the compute dtype)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        dtype = accelerator.autocast_dtype(out.device.type)
        return out if dtype is None or out.dtype == dtype else out.to(dtype)


class TokenCrossEntropy(nn.Module):
    """Per-token loss ``[S, B]`` (fp32) of logits ``[S, B, >= V]`` whose first ``vocab_size``
    columns are the vocabulary (F.cross_entropy; ignore index -100)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        wide = upcast(logits[..., : self.vocab_size])
        return F.cross_entropy(wide.reshape(-1, self.vocab_size), targets.reshape(-1), reduction="none").view(
            targets.shape
        )


class LlamaModel(nn.Module):
    """The whole Llama on one device: ``forward(input_ids [B, S], targets [B, S])`` is the mean
    token loss (fp32 scalar), or the logits ``[S, B, V]`` without targets.

    With ``tie_word_embeddings`` the LM head's weight is the embedding's (one parameter, named
    ``embed.weight``). ``moe_state`` collects the MoE layers' auxiliary-loss scale and routing
    statistics (``begin_step`` before each step's micro-batches)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.moe_state = MoEState()
        self.head_dim = llama_arch.head_dim(args)
        self.embed = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i, self.moe_state) for i in range(args.num_layers)})
        self.final_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.loss = TokenCrossEntropy(args.vocab_size)
        self.loss_chunk_tokens = 0  # the head in one piece; the parallelize plan sets the config's
        self._rope_cache: dict = {}

    # ------------------------------------------------------------------ init
    def param_initializer(self, name: str, seed: int) -> Callable[[torch.Tensor], object]:
        """Fills the full (unsharded) fp32 tensor of parameter ``name`` in place: norms with 1,
        biases with 0 (the qkv one: a fresh model computes what a bias-free one does), others
        N(0, init_std), the residual projections (o_proj, down) scaled by 1/sqrt(2L), each from a
        generator seeded by (seed, name) — identical on every rank and topology."""
        if name.endswith("norm.weight"):
            return lambda full: full.fill_(1.0)
        if name.endswith(".bias"):
            return lambda full: full.zero_()
        std = self.args.init_std
        if name.endswith(("o_proj.weight", "down.weight")):
            std /= math.sqrt(2 * self.args.num_layers)
        generator = torch.Generator().manual_seed(param_seed(seed, name))
        return lambda full: full.normal_(0.0, std, generator=generator)

    def init_weights(self, seed: int) -> None:
        """Every parameter from its seeded initializer, drawn in fp32 on the CPU."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                full = torch.empty(param.shape, dtype=torch.float32)
                self.param_initializer(name, seed)(full)
                param.copy_(full.to(device=param.device, dtype=param.dtype))

    def begin_step(self, microbatches: int) -> None:
        """Before a step's micro-batches: the MoE auxiliary losses' gradient scale (each
        micro-batch's loss is divided by their count) and fresh routing statistics."""
        self.moe_state.begin_step(microbatches)

    # ------------------------------------------------------------------ forward, in three parts
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` ids -> the residual stream ``[S, B, H]``."""
        return self.embed(input_ids.transpose(0, 1).contiguous())

    def run_layers(
        self,
        hidden: torch.Tensor,
        names: Iterable[str] | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder layers ``names`` (default: all held, in order) on ``hidden``; ``positions``
        are the int positions of the tokens attention sees (default ``0 .. S-1``; ``[S, B]`` under
        document masking), ``mask`` its block-causal attention mask (None: causal;
        ``parallel/documents.document_attention`` makes both)."""
        if positions is None:
            positions = self.default_positions(hidden.shape[0], hidden.device)
        cos, sin = self.rotary(positions, torch.promote_types(hidden.dtype, torch.float32))
        for name in self.layers.keys() if names is None else names:
            hidden = self.layers[name](hidden, cos, sin, mask)
        return hidden

    def head(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head: the logits, or with ``targets`` ``[B, S]`` the mean token loss,
        ``loss_chunk_tokens`` tokens at a time when it is set (``chunked_loss``)."""
        if targets is None:
            return self.lm_head(self.final_norm(hidden))
        targets = targets.transpose(0, 1).contiguous()
        params = {id(p): p for m in (self.final_norm, self.lm_head, self.loss) for p in m.parameters()}
        return chunked_loss.mean_token_loss(
            self.token_losses, list(params.values()), hidden, targets, self.loss_chunk_tokens
        )

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token loss of hidden rows ``[..., H]`` and their targets (final norm, LM head, loss)."""
        return self.loss(self.lm_head(self.final_norm(hidden)), targets)

    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``documents``: per-token document ids ``[B, S]`` (``data.document_masking``): attention
        stays within each document and positions restart at each (``parallel/documents.py``)."""
        positions, mask = None, None
        if documents is not None:
            positions, mask = document_attention(documents, kernel=self.args.attention_kernel)
        return self.head(self.run_layers(self.embed_tokens(input_ids), None, positions, mask), targets)

    # ------------------------------------------------------------------ rotary tables
    def default_positions(self, seq_len: int, device) -> torch.Tensor:
        """``arange(seq_len)``, one tensor per (length, device)."""
        key = ("positions", seq_len, device)
        if key not in self._rope_cache:
            self._rope_cache[key] = torch.arange(seq_len, device=device)
        return self._rope_cache[key]

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_tables`` at ``positions`` cast to ``dtype`` (what ``apply_rope`` computes in),
        built once per positions tensor and dtype, not in every forward. Per-sample positions
        (``[S, B]``, document masking) are new with every micro-batch: built once per call, never
        kept (a cache of them would hold dozens of batches' tables)."""
        if positions.dim() > 1:
            cos, sin = rope_tables(positions, self.head_dim, self.args.rope_theta, self.args.rope_scaling)
            return cos.to(dtype), sin.to(dtype)
        key = ("rotary", id(positions), dtype)  # the entry keeps ``positions`` alive: ids stay unique
        if key not in self._rope_cache:
            if len(self._rope_cache) > 64:
                self._rope_cache.clear()
            cos, sin = rope_tables(positions, self.head_dim, self.args.rope_theta, self.args.rope_scaling)
            self._rope_cache[key] = (positions, cos.to(dtype), sin.to(dtype))
        return self._rope_cache[key][1:]


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
