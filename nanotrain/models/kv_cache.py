"""A key/value cache for decoding with the plain ``LlamaModel`` (``models/generate.py``).

Why a module in the ``attn.core`` seam, and not new arguments through ``run_layers`` /
``DecoderLayer`` / ``Attention``: each ``Attention`` already computes q, k and v, applies its q/k
norms and (unless it is a no-RoPE layer) rotates q and k at the positions ``run_layers`` is
given; what decoding changes is only which keys and values the new queries attend to. So
``KVCache`` puts a ``CachedCore`` in every layer's ``attn.core`` (as context parallelism puts its
own core there) for the length of a ``with`` block, and puts the model's own back after: the
training paths never see it and run exactly as before. A cached core keeps the rotated k and
the v of every token fed so far (its kv heads only: grouped-query k/v stay unrepeated), writes a
step's new ones at their absolute positions, and lets the step's queries attend to all of them,
causally. q/k norms, layers without RoPE, grouped-query heads and MoE feed-forwards need nothing
of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from nanotrain.parallel.sdpa import SDPA_GQA, sdpa


class CachedCore(nn.Module):
    """``attn.core`` during cached decoding: rotated ``q`` ``[S, B, heads, d]`` and this step's
    ``k, v`` ``[S, B, kv_heads, d]`` (at positions ``cache.length ..``) -> ``[S, B, heads * d]``,
    attending to every cached token before them and causally among themselves. A prompt is one
    document: the attention's document mask (``data.document_masking``) is never given here."""

    def __init__(self, cache: KVCache):
        super().__init__()
        self.cache = cache
        self.keys: torch.Tensor | None = None  # [B, kv_heads, capacity, d], filled up to cache.length
        self.values: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if mask is not None:
            raise ValueError("cached decoding takes one document per prompt: no document mask")
        seq, batch, heads, d = q.shape
        start, stop = self.cache.length, self.cache.length + seq
        if stop > self.cache.capacity:
            raise ValueError(f"KV cache of {self.cache.capacity} tokens: cannot hold {stop}")
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [B, kv_heads, S, d]
        if self.keys is None:  # allocated once, for the whole decode: no copy per token
            shape = (batch, k.shape[1], self.cache.capacity, d)
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.keys[:, :, start:stop] = k
        self.values[:, :, start:stop] = v
        keys, values = self.keys[:, :, :stop], self.values[:, :, :stop]
        q = q.permute(1, 2, 0, 3)  # [B, heads, S, d]
        if keys.shape[1] != heads and not SDPA_GQA:
            keys, values = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (keys, values))
        if start == 0:  # the prompt: plain causal attention, as the uncached model computes it
            out = sdpa(q, keys, values, is_causal=True)
        elif seq == 1:  # one new token sees every cached one
            out = sdpa(q, keys, values)
        else:  # new token i (position start + i) sees positions <= start + i
            mask = torch.ones(seq, stop, dtype=torch.bool, device=q.device).tril(diagonal=start)
            out = sdpa(q, keys, values, attn_mask=mask)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * d)


class KVCache:
    """Cached decoding with ``model`` (a plain ``LlamaModel``) for at most ``capacity`` tokens::

        with KVCache(model, capacity) as cache:
            logits = cache.forward(prompt_ids)      # [S, B, V]; positions 0 .. S-1
            logits = cache.forward(next_ids)        # [1, B, V]; position S

    ``forward`` runs the model on ids ``[B, S]`` that follow the ``length`` tokens fed before,
    at positions ``length .. length + S - 1`` (RoPE's absolute positions), and returns their logits.
    ``capacity`` sizes each layer's k/v buffers, allocated on the first ``forward``.
    """

    def __init__(self, model: nn.Module, capacity: int):
        self.model, self.capacity, self.length = model, capacity, 0
        self._own_cores: dict[str, nn.Module] = {}

    def __enter__(self) -> KVCache:
        for name, layer in self.model.layers.items():
            self._own_cores[name] = layer.attn.core
            layer.attn.core = CachedCore(self)
        return self

    def __exit__(self, *exc) -> None:
        for name, core in self._own_cores.items():
            self.model.layers[name].attn.core = core
        self._own_cores.clear()

    def forward(self, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Logits ``[S, B, V]`` of ``ids`` ``[B, S]``; ``last``: of the last position only
        ``[1, B, V]`` (decoding needs no more; a long prompt's ``[S, B, V]`` can be gigabytes)."""
        if not self._own_cores:
            raise RuntimeError("KVCache.forward outside its `with` block")
        positions = torch.arange(self.length, self.length + ids.shape[1], device=ids.device)
        hidden = self.model.run_layers(self.model.embed_tokens(ids), positions=positions)
        self.length += ids.shape[1]
        return self.model.head(hidden[-1:] if last else hidden)
