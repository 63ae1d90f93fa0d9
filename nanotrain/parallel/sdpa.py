"""Scaled dot-product attention as both the model and context parallelism call it (torch only,
no process group: ``models`` may import it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# SDPA takes grouped-query k/v (fewer heads than q) as they are from torch 2.5 on (``enable_gqa``).
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Scaled dot-product attention over ``[B, heads, S, d]``; grouped-query k/v go in without
    the per-head copy ``repeat_interleave`` makes (callers repeat them on older torch)."""
    if SDPA_GQA and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sdpa`` under a boolean ``mask`` (True: attend) broadcast over heads. Grouped-query k/v
    are repeated to every query head here: given a tensor mask and ``enable_gqa``, CUDA's SDPA
    has only its math kernel (a float S x S score matrix per head), while with equal head counts
    the memory-efficient kernel takes the mask. On the CPU both are the math kernel, same numbers."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
