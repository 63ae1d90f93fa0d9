"""Scaled dot-product attention as both the model and context parallelism call it (torch only,
no process group: ``models`` may import it).

Masked attention (document masking) runs one of two kernels, by the type of the mask it is given
(``documents.document_attention`` builds the one ``model.attention_kernel`` picks):
* a boolean tensor ``[B, 1, S_q, S]``: SDPA under that mask (``sdpa_mask``, the exact reference);
* a FlexAttention ``BlockMask`` (``document_blocks.py``): ``flex_attention``, compiled once per
  process (``torch.compile``; uncompiled it materialises the scores). Grouped-query k/v go in as
  they are (``enable_gqa``). torch has its kernels for CUDA (forward and backward) and, compiled,
  a forward for the CPU; no backward on the CPU (``documents.resolve_kernel`` refuses training
  there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch: only the materialised mask
    BlockMask = flex_attention = None

# SDPA takes grouped-query k/v (fewer heads than q) as they are from torch 2.5 on (``enable_gqa``).
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Scaled dot-product attention over ``[B, heads, S, d]``; grouped-query k/v go in without
    the per-head copy ``repeat_interleave`` makes (callers repeat them on older torch)."""
    if SDPA_GQA and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """``sdpa`` under a boolean ``mask`` (True: attend) broadcast over heads, or FlexAttention
    under a ``BlockMask`` (``flex_sdpa``). Under a tensor mask grouped-query k/v are repeated
    to every query head here: given a tensor mask and ``enable_gqa``, CUDA's SDPA has only its
    math kernel (a float S x S score matrix per head), while with equal head counts the
    memory-efficient kernel takes the mask. On the CPU both are the math kernel, same numbers."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex_sdpa(q, k, v, mask)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


_FLEX: list = []  # made by the first ``flex_kernel()`` (importing torch.compile's machinery costs seconds)


def flex_kernel():
    """The compiled ``flex_attention`` (static shapes: one graph per length, as training has)
    behind a graph break (``torch.compiler.disable``). Made once, outside traced code:
    ``documents.document_attention`` calls it when it builds a block mask, before any layer runs.

    The graph break: traced into a compiled layer's graph (``training.compile``), inductor's CPU
    kernel read the layer's q/k wrongly (torch 2.13: the logits far off), while compiled on its
    own it equals the reference; one break per layer is cheap. A wrapper first made while dynamo
    traces would be replayed as the plain, unfused ``flex_attention``."""
    if not _FLEX:
        compiled = torch.compile(flex_attention, dynamic=False)

        def call(*args, **kwargs):  # disable() of the compiled function itself would run it uncompiled
            return compiled(*args, **kwargs)

        _FLEX.append(torch.compiler.disable(call))
    return _FLEX[0]


def flex_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """FlexAttention of ``[B, heads, S_q, d]`` q over ``[B, kv_heads, S, d]`` k, v under
    ``block_mask`` (``flex_kernel``)."""
    return flex_kernel()(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
